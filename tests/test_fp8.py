"""The FP8 lm_head matmul (custom ops nanogpt::fp8_mm and nanogpt::fp8_mm_backward, which the training loss,
SoftcappedLoss, calls) and its scales."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pytest
import torch
import torch._inductor.config
import torch.nn.functional as F

import train_gpt
from rounding import UNIT_ROUNDOFF, assert_within, gamma, rounding_bound

pytestmark = pytest.mark.numerics

D = 256  # lm_head input width
V = 512  # lm_head output rows
N = 128  # tokens

# x is bf16: the op divides it by its scale in float32 (the scale rounded, then a division, or a reciprocal and a
# product) and rounds the quotient to bf16 before rounding it to FP8
BF16_DIVISION_ERROR = (1 + UNIT_ROUNDOFF[torch.bfloat16]) * (1 + gamma(3)) - 1
# The loss's float32 gradient times grad_s's float32 reciprocal: two roundings before the one to e5m2
FP32_RECIPROCAL_ERROR = gamma(2)


def gradient_codes(g, grad_s):
    """g's e5m2 copy as SoftcappedLoss makes it: times grad_s's float32 reciprocal, rounded once to e5m2."""
    return (g.float() * train_gpt.float32(1 / train_gpt.float32(grad_s))).to(torch.float8_e5m2)


def quantization_error(t, scale, fp8_dtype, division_error=0.0):
    """Elementwise bound on |q * scale - t| for the op's FP8 copy q of t: t / scale, within a relative
    division_error, rounded to fp8_dtype."""
    t = t.detach().double().abs()
    return rounding_bound((1 + division_error) * t / scale, fp8_dtype) * scale + division_error * t


def fp8_product_and_bound(a, a_error, b, b_error, out_dtype):
    """a @ b in float64, and an elementwise bound on the error of the FP8 op's result against it when the op's
    operands lie within a_error and b_error (elementwise, or 0) of a and b."""
    exact = a.detach().double() @ b.detach().double()
    a, b = a.detach().double().abs(), b.detach().double().abs()
    a_error, b_error = (torch.as_tensor(e, dtype=torch.float64).expand_as(t) for e, t in ((a_error, a), (b_error, b)))
    # the operands' errors; then a float32 sum of k products, each off by five roundings at most before it: both
    # scales to float32, each scale applied to its operand (or both to the sum), the product
    error = a_error @ (b + b_error) + a @ b_error + gamma(a.size(-1) + 4) * (a + a_error) @ (b + b_error)
    u = UNIT_ROUNDOFF[out_dtype]  # the result's rounding to out_dtype
    return exact, u * exact.abs() + (1 + u) * error


def lm_head_operands(seed, x_dtype=torch.bfloat16):
    """Like the lm_head: x RMS-normed rows (|x| <= sqrt(D)), w small uniform; grad_out a
    cross-entropy-sized gradient (|g| <= 1/sqrt(D))."""
    torch.manual_seed(seed)
    x = train_gpt.norm(torch.randn(N, D)).to(x_dtype)
    w = (torch.rand(V, D) * 2 - 1) * 0.05
    g = (torch.rand(N, V) * 2 - 1) / D**0.5
    return x, w, g


@pytest.mark.parametrize("seed", [0, 1])
def test_forward_is_an_fp8_approximation_of_the_matmul(seed):
    """The result is the product of the op's e4m3 copies of x and w, to float32 accumulation and bf16 rounding,
    and not the product of x and w: it really quantized. The copies are x / x_s and w / w_s rounded to e4m3,
    so the result lies within the bound those roundings give of x @ w.T."""
    x, w, _ = lm_head_operands(seed)
    x_s, w_s, _ = train_gpt.LM_HEAD_FP8_SCALES
    out, x_f8, w_f8 = train_gpt.fp8_mm(x, w, x_s, w_s)
    assert out.dtype == torch.bfloat16 and out.shape == (N, V)
    assert x_f8.dtype == w_f8.dtype == torch.float8_e4m3fn
    quantized, bound = fp8_product_and_bound(x_f8.double() * x_s, 0, w_f8.double().T * w_s, 0, torch.bfloat16)
    assert_within(out, quantized, bound, "the e4m3 copies' product")
    with pytest.raises(AssertionError, match="times the derived bound"):
        assert_within((x.float() @ w.T).bfloat16(), quantized, bound, "the unquantized product")
    x_error = quantization_error(x, x_s, torch.float8_e4m3fn, BF16_DIVISION_ERROR)
    w_error = quantization_error(w, w_s, torch.float8_e4m3fn)  # w is float32 and w_s a power of two: w / w_s is exact
    assert_within(out, *fp8_product_and_bound(x, x_error, w.T, w_error.T, torch.bfloat16), "x @ w.T")


@pytest.mark.parametrize("seed", [0, 1])
def test_backward_gradients_within_fp8_tolerance(seed):
    """The backward op's grad_x (bf16) and grad_w (fp32) from the gradient's e5m2 codes (made from float32, as the loss
    makes them): the products of the codes with the forward's e4m3 copies of w and x, to float32 accumulation and the
    result's rounding; so they lie within the bound the three roundings give of g @ w and g.T @ x."""
    x, w, g = lm_head_operands(seed)
    x_s, w_s, grad_s = scales = train_gpt.LM_HEAD_FP8_SCALES
    _, x_f8, w_f8 = train_gpt.fp8_mm(x, w, x_s, w_s)
    g_f8 = gradient_codes(g, grad_s)
    grad_x, grad_w = torch.ops.nanogpt.fp8_mm_backward(g_f8, x_f8, w_f8, *scales)
    assert grad_x.dtype == torch.bfloat16 and grad_w.dtype == torch.float32
    assert grad_x.shape == x.shape and grad_w.shape == w.shape
    g_q, x_q, w_q = g_f8.double() * grad_s, x_f8.double() * x_s, w_f8.double() * w_s
    assert_within(grad_x, *fp8_product_and_bound(g_q, 0, w_q, 0, torch.bfloat16), "grad_x from the FP8 copies")
    assert_within(grad_w, *fp8_product_and_bound(g_q.T, 0, x_q, 0, torch.float32), "grad_w from the FP8 copies")
    g_error = quantization_error(g, grad_s, torch.float8_e5m2, FP32_RECIPROCAL_ERROR)
    x_error = quantization_error(x, x_s, torch.float8_e4m3fn, BF16_DIVISION_ERROR)
    w_error = quantization_error(w, w_s, torch.float8_e4m3fn)
    assert_within(grad_x, *fp8_product_and_bound(g, g_error, w, w_error, torch.bfloat16), "grad_x against g @ w")
    assert_within(grad_w, *fp8_product_and_bound(g.T, g_error.T, x, x_error, torch.float32), "grad_w against g.T @ x")


def test_the_loss_takes_the_fp8_ops_on_its_own_codes():
    """SoftcappedLoss with FP8 scales: its logits are fp8_mm's, to the bit, and its gradients are fp8_mm_backward's on
    the forward's e4m3 copies and the e5m2 codes of the float32 gradient of the logits, which the same loss without
    FP8 (on those logits' values, in float32) computes before its rounding; the codes made through bf16 (the records'
    before 2026-01-24) differ on some entries, and so do the gradients."""
    x, w, _ = lm_head_operands(6)
    w = w.bfloat16()  # the lm_head's, in the run's dtype
    x_s, w_s, grad_s = scales = (*train_gpt.LM_HEAD_FP8_SCALES[:2], 0.125 * train_gpt.LM_HEAD_FP8_SCALES[2])
    targets, weights = torch.randint(0, V, (N,), generator=torch.Generator().manual_seed(6)), torch.tensor([1.0, 0.5])
    logits, x_f8, w_f8 = train_gpt.fp8_mm(x, w, x_s, w_s)
    xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
    losses = train_gpt.SoftcappedLoss.apply(xi, wi, targets, weights, 23.0, 5.0, scales)
    (losses.sum() * 0.125).backward()
    # the float32 gradient of the logits, from the same logits: the loss without FP8 on x = I, w = logits^T
    z = logits.float().detach().requires_grad_()
    eye = torch.eye(N)
    plain = train_gpt.SoftcappedLoss.apply(eye, z.T.contiguous().requires_grad_(), targets, weights, 23.0, 5.0, None)
    assert torch.equal(plain, losses.detach())
    (grad_z,) = torch.autograd.grad(plain.sum() * 0.125, z)
    codes = gradient_codes(grad_z, grad_s)
    expected = torch.ops.nanogpt.fp8_mm_backward(codes, x_f8, w_f8, *scales)
    assert torch.equal(xi.grad, expected[0]) and torch.equal(wi.grad, expected[1].bfloat16())
    through_bf16 = (grad_z.bfloat16().float() * train_gpt.float32(1 / train_gpt.float32(grad_s))).to(torch.float8_e5m2)
    assert not torch.equal(through_bf16.float(), codes.float())
    assert not torch.equal(torch.ops.nanogpt.fp8_mm_backward(through_bf16, x_f8, w_f8, *scales)[0], xi.grad)


# opcheck's test_schema and test_aot_dispatch_* call allclose/sum on every output, which torch
# does not implement for float8 tensors, so they cannot run on these ops; the compiled test
# below covers AOT dispatch in practice.
OPCHECK_UTILS = ("test_faketensor", "test_autograd_registration")


@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float32])
def test_opcheck_forward(x_dtype):
    """The fake matches the real op (bf16 result even for fp32 inputs)."""
    x, w, _ = lm_head_operands(3, x_dtype)
    torch.library.opcheck(train_gpt.fp8_mm, (x, w, *train_gpt.LM_HEAD_FP8_SCALES[:2]), test_utils="test_faketensor")


@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float32])
def test_opcheck_backward(x_dtype):
    """The backward op's fake matches its real outputs in shape, dtype and strides."""
    x, w, g = lm_head_operands(3, x_dtype)
    scales = train_gpt.LM_HEAD_FP8_SCALES
    _, x_f8, w_f8 = train_gpt.fp8_mm(x, w, *scales[:2])
    torch.library.opcheck(torch.ops.nanogpt.fp8_mm_backward.default, (gradient_codes(g, scales[2]), x_f8, w_f8, *scales),
                          test_utils="test_faketensor")


@pytest.mark.filterwarnings("ignore:dynamo_pgo force disabled")
@pytest.mark.parametrize("backward", [False, True])
def test_compiled_matches_eager(backward):
    """The training loss with FP8 traces through torch.compile and computes exactly what eager does: the compiled graphs
    call the same custom ops, which run the same _scaled_mm on the same e4m3 and e5m2 values, so the results are
    equal."""
    x, w, _ = lm_head_operands(4)
    scales = train_gpt.LM_HEAD_FP8_SCALES
    targets = torch.randint(0, V, (N,), generator=torch.Generator().manual_seed(4))

    def run(fn):
        xi, wi = x.clone().requires_grad_(backward), w.bfloat16().requires_grad_(backward)
        out = fn(xi, wi)
        if not backward:
            return (out,)
        out.backward()
        return out.detach(), xi.grad, wi.grad

    fn = lambda a, b: train_gpt.SoftcappedLoss.apply(a, b, targets, torch.ones(1), 23.0, 5.0, scales).sum()
    # Inductor's cache keys do not cover a custom op's fake, so a cached graph could outlive a fix.
    with torch._inductor.config.patch(force_disable_caches=True):
        compiled_results = run(torch.compile(fn, dynamic=False, fullgraph=True))
    for eager, compiled in zip(run(fn), compiled_results):
        assert compiled.dtype == eager.dtype and torch.equal(compiled, eager)


def test_lm_head_scales():
    """The record's scales (from 2025-12-29): x_s = 100/448, w_s = 1.6/448, grad_s = 0.75/448."""
    assert train_gpt.LM_HEAD_FP8_SCALES == (100 / 448, 1.6 / 448, 0.75 / 448)
    assert torch.finfo(torch.float8_e4m3fn).max == 448 and torch.finfo(torch.float8_e5m2).max == 57344


@pytest.mark.parametrize("cap, offset", [(23.0, 5.0), (30.0, 0.0)])
def test_gradient_bound_holds_and_fits_e5m2(cap, offset):
    """The gradient of the summed softcapped cross-entropy w.r.t. the lm_head output z is at most cap / (4 x 7.5) per
    element (and comes close to it); multi-token prediction sums at most sum(MTP_WEIGHTS) such terms a position, so
    g / grad_s at the record's scale never overflows e5m2."""
    torch.manual_seed(int(cap))
    spread = 7.5
    # logits around the softcap's steepest point (z = -offset) and far out on both sides
    z = torch.cat([torch.randn(64, 1000) * s - offset for s in (0.01 * spread, spread, 10 * spread)])
    z.requires_grad_()
    targets = torch.randint(0, 1000, (z.size(0),))
    loss = F.cross_entropy(train_gpt.softcap(z, cap=cap, offset=offset), targets, reduction="sum")
    (grad,) = torch.autograd.grad(loss, z)
    bound = cap / (4 * spread)
    assert grad.abs().max() <= bound
    assert grad.abs().max() > 0.99 * bound  # the bound is tight: no range wasted
    scaled = grad * sum(train_gpt.MTP_WEIGHTS) / train_gpt.LM_HEAD_FP8_SCALES[2]
    assert scaled.abs().max() <= 57344
    assert torch.isfinite(scaled.to(torch.float8_e5m2).float()).all()
