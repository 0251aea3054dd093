"""The FP8 lm_head matmul (custom ops nanogpt::fp8_mm and nanogpt::fp8_mm_backward, which the training loss,
SoftcappedLoss, calls) and its scales; the MLP's FP8 forward, its scales carried between steps, and its backward."""

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
    """g's e5m2 copy: times grad_s's float32 reciprocal, rounded once to e5m2 (SoftcappedLoss's codes: its float32
    gradient, 1 / grad_s among its factors, rounded once)."""
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


def test_the_loss_takes_the_fp8_ops_on_its_own_codes(monkeypatch):
    """SoftcappedLoss with FP8 scales: its logits are fp8_mm's (its losses are those of the same loss without FP8 on
    those bf16 logits, to the bit), and its gradients are fp8_mm_backward's on the forward's e4m3 copies and the e5m2
    codes it hands over. Those codes times grad_s are the gradient the loss without FP8 makes of those logits (rounded
    to bf16) within their roundings: its float32 gradient, its factors in another order and 1 / grad_s (ten roundings
    apart), rounded to e5m2 and, in the loss without FP8, to bf16. The codes made through bf16 (that gradient, then
    divided by grad_s: the records' before 2026-01-24) differ on some entries, and so do the gradients."""
    x, w, _ = lm_head_operands(6)
    w = w.bfloat16()  # the lm_head's, in the run's dtype
    x_s, w_s, grad_s = scales = (*train_gpt.LM_HEAD_FP8_SCALES[:2], 0.125 * train_gpt.LM_HEAD_FP8_SCALES[2])
    targets, weights = torch.randint(0, V, (N,), generator=torch.Generator().manual_seed(6)), torch.tensor([1.0, 0.5])
    logits, x_f8, w_f8 = train_gpt.fp8_mm(x, w, x_s, w_s)
    handed = []
    fp8_mm_backward = train_gpt.fp8_mm_backward
    monkeypatch.setattr(train_gpt, "fp8_mm_backward",
                        lambda g_f8, *args: handed.append(g_f8) or fp8_mm_backward(g_f8, *args))
    xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
    losses = train_gpt.SoftcappedLoss.apply(xi, wi, targets, weights, 23.0, 5.0, scales)
    (losses.sum() * 0.125).backward()
    # the gradient of the same logits without FP8: the loss on x = I, w = logits^T
    z = logits.detach().T.contiguous().requires_grad_()
    plain = train_gpt.SoftcappedLoss.apply(torch.eye(N, dtype=torch.bfloat16), z, targets, weights, 23.0, 5.0, None)
    assert torch.equal(plain, losses.detach())
    (grad_z,) = torch.autograd.grad(plain.sum() * 0.125, z)
    grad_z = grad_z.T.double()
    (codes,) = handed
    assert torch.equal(xi.grad, fp8_mm_backward(codes, x_f8, w_f8, *scales)[0])
    assert torch.equal(wi.grad, fp8_mm_backward(codes, x_f8, w_f8, *scales)[1].bfloat16())
    u_b = UNIT_ROUNDOFF[torch.bfloat16]
    float32_gradient = grad_z.abs() * (1 + 2 * u_b)  # at most, from its bf16 rounding
    bound = (rounding_bound(float32_gradient * (1 + gamma(10)) / grad_s, torch.float8_e5m2) * grad_s
             + (2 * u_b + gamma(10)) * float32_gradient)
    assert_within(codes.double() * grad_s, grad_z, bound, "the codes")
    through_bf16 = (grad_z.float() * train_gpt.float32(1 / train_gpt.float32(grad_s))).to(torch.float8_e5m2)
    assert not torch.equal(through_bf16.float(), codes.float())
    assert not torch.equal(fp8_mm_backward(through_bf16, x_f8, w_f8, *scales)[0], xi.grad)


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
    """The training loss with FP8 traces through torch.compile whole: AOT autograd's graphs (backend aot_eager) call the
    same custom ops, which run the same _scaled_mm on the same e4m3 and e5m2 values, and eager's kernels around them,
    so the results are equal. (Inductor's kernels round the loss's float32 math apart from eager's: the next test.)"""
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
        compiled_results = run(torch.compile(fn, backend="aot_eager", dynamic=False, fullgraph=True))
    for eager, compiled in zip(run(fn), compiled_results):
        assert compiled.dtype == eager.dtype and torch.equal(compiled, eager)


@pytest.mark.filterwarnings("ignore:dynamo_pgo force disabled")
def test_inductor_reads_the_custom_ops_results_as_eager_does():
    """Under inductor, both ops' results (the logits and e4m3 copies, grad_x and the transposed grad_w), read by
    inductor's kernels through the fakes' shapes, dtypes and strides (times 2: exact), are eager's to the bit."""
    x, w, g = lm_head_operands(5)
    scales = train_gpt.LM_HEAD_FP8_SCALES

    def ops(a, b, g_f8):
        out, a_f8, b_f8 = train_gpt.fp8_mm(a, b, *scales[:2])
        grad_x, grad_w = train_gpt.fp8_mm_backward(g_f8, a_f8, b_f8, *scales)
        return out * 2, a_f8.float() * 2, b_f8.float() * 2, grad_x * 2, grad_w * 2

    args = (x, w.bfloat16(), gradient_codes(g, scales[2]))
    with torch._inductor.config.patch(force_disable_caches=True):
        compiled = torch.compile(ops, dynamic=False, fullgraph=True)(*args)
    for eager, result in zip(ops(*args), compiled, strict=True):
        assert result.dtype == eager.dtype and torch.equal(result, eager)


def test_lm_head_scales():
    """The record's scales (from 2025-12-29): x_s = 100/448, w_s = 1.6/448, grad_s = 0.75/448."""
    assert train_gpt.LM_HEAD_FP8_SCALES == (100 / 448, 1.6 / 448, 0.75 / 448)
    assert torch.finfo(torch.float8_e4m3fn).max == 448 and torch.finfo(torch.float8_e5m2).max == 57344


@pytest.mark.parametrize("cap, offset", [(23.0, 5.0), (30.0, 0.0)])
def test_gradient_bound_holds_and_fits_e5m2(cap, offset):
    """The gradient of the summed softcapped cross-entropy w.r.t. the lm_head output z is at most cap / (4 x 7.5) per
    element (and comes close to it); multi-token prediction and the prefix token's term sum at most sum(MTP_WEIGHTS) +
    PREFIX_WEIGHT such terms a position, so g / grad_s at the record's scale never overflows e5m2."""
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
    scaled = grad * (sum(train_gpt.MTP_WEIGHTS) + train_gpt.PREFIX_WEIGHT) / train_gpt.LM_HEAD_FP8_SCALES[2]
    assert scaled.abs().max() <= 57344
    assert torch.isfinite(scaled.to(torch.float8_e5m2).float()).all()


# ------------------------------------------------------------------------------------------------
# The MLP in training with FP8 (the records' kernels: the up-projection from 2026-05-19, the down-projection's delayed
# scales from 2026-07-17) and its backward from post (from 2026-06-11)

E4M3 = torch.float8_e4m3fn
MLP_DIM, MLP_TOKENS = 64, 128


def float32_constant(value: float) -> torch.Tensor:
    """A Python constant as a kernel holds it: rounded to float32."""
    return torch.tensor(value, dtype=torch.float32)


def exact_e4m3_product(a_f8, b_f8):
    """a @ b for e4m3 a and b, exact in integers (every e4m3 value is a multiple of 2^-9), rounded once to float32: the
    kernels' float32 sum without the roundings of its order."""
    a, b = ((t.double() * 2**9).long() for t in (a_f8, b_f8))
    return ((a @ b).double() * 2**-18).float()


def records_current_scale(w):
    """quantize_mlp_fp8's scale of a bf16 weight, eager on the weight's dtype: amax, floor and quotient in bf16."""
    return (w.abs().amax().clamp(min=1e-12) / 448).float()


def records_delayed_scale(amax, headroom):
    """The records' reduce kernel: max(amax, 1e-12) times the float32 of headroom / 448."""
    return torch.maximum(amax.float(), float32_constant(1e-12)) * float32_constant(headroom / 448)


def records_fp8_mlp(x, w_up, w_down, act_scale, down_scale):
    """The records' FP8 MLP forward on bf16 x (N, D) and weights (4D, D), step by step: the up weight quantized as
    quantize_mlp_fp8 does (bf16 quotient); x scaled in the compiled graph (448 / amax is amax's reciprocal times 448; the
    dequantization's division by 448 a product with its float32 reciprocal on CUDA); the linear_relu_square kernel (the
    float32 sum times the dequantization, bf16, relu and square in bf16, post times 1 / act_scale capped at 448 in e4m3);
    the down weight by the transpose-quantize kernel; _scaled_mm's float32 sum times both scales in bf16. Returns
    (output, post, the next act_scale, whether the caps clipped post and the down weight)."""
    up_scale = records_current_scale(w_up)
    w_up_f8 = (w_up / up_scale.bfloat16()).to(E4M3)
    amax = x.abs().amax().clamp(min=1e-12).float()
    x_f8 = (x.float() * (amax.reciprocal() * 448)).to(E4M3)
    dequantization = up_scale * amax * float32_constant(1 / 448)
    pre = (exact_e4m3_product(x_f8, w_up_f8.T) * dequantization).bfloat16()
    relu = pre.clamp(min=0)
    post = relu * relu
    post_scaled = post.float() * (float32_constant(1.0) / act_scale)
    post_f8 = torch.minimum(post_scaled, float32_constant(448.0)).to(E4M3)
    w_down_scaled = w_down.float() / down_scale
    w_down_f8 = w_down_scaled.clamp(-448, 448).to(E4M3)
    out = (exact_e4m3_product(post_f8, w_down_f8) * (act_scale * down_scale)).bfloat16()
    # what the caps clipped: post past 448, the down weight past its current scale's bf16 rounding (2^-8) above 448
    clipped = (bool(post_scaled.max() > 448), bool(w_down_scaled.abs().max() > 448 * (1 + 2**-8)))
    return out, post, records_delayed_scale(post.amax(), 1.8), clipped


def records_mlp_backward(g, x, w_up, w_down, post):
    """The records' backward from post, on the 2-d tensors: the down weight's gradient post^T g; pre's from the
    kernel's g w_down^T (bf16 in the records), doubled, times sqrt(post) in float32, rounded back; then x's and the up
    weight's."""
    grad_relu = g @ w_down.T
    grad_pre = ((2 * grad_relu).float() * torch.sqrt(post.float())).to(g.dtype)
    return grad_pre @ w_up, grad_pre.T @ x, post.T @ g


def fp8_mlp(seed=0):
    """An MLP with FP8 in training, bf16, both matrices drawn (the down-projection as a trained one, no longer zero)."""
    torch.manual_seed(seed)
    mlp = train_gpt.MLP(MLP_DIM, torch.bfloat16, fp8=True).train()
    with torch.no_grad():
        for w in (mlp.c_fc, mlp.c_proj):
            w.uniform_(-train_gpt.init_bound(MLP_DIM), train_gpt.init_bound(MLP_DIM))
    return mlp


# x's amax 6.0 gives x scale 448 x fl(1/6) = 74.666672, and these entries land on e4m3 ties (10.5 for 0.140625) or
# off them as the order of 448 / amax's operations decides (448 / 6 correctly rounded is 74.666664)
TIE_TOKEN = (6.0, 0.140625, -0.0703125, 0.03515625, 0.017578125)


def inputs_with_a_tie_token(generator):
    """Normed rows (1, MLP_TOKENS, MLP_DIM) in bf16, the first token's entries TIE_TOKEN's (6.0 the amax)."""
    x = train_gpt.norm(torch.randn(1, MLP_TOKENS, MLP_DIM, generator=generator))
    x[0, 0, :len(TIE_TOKEN)] = torch.tensor(TIE_TOKEN)
    assert x.abs().max() == 6.0
    return x.bfloat16()


def scale_buffers(mlp):
    return [mlp.act_scale.clone(), mlp.down_scale.clone(), mlp.next_down_scale.clone()]


def test_the_fp8_mlp_computes_the_records_kernels_over_steps_across_the_bootstrap():
    """Steps 15, 16 and 17 of a run, each a forward, a backward and an optimizer step (here: the weights grown and
    jittered), then the scale update with bootstrap = step < 16: the output, the gradients and the three scales equal
    the records' kernels written out, to the bit. The updates after 15 scale the down weight by its own amax, the one
    after 16 by 1.12 x the amax before its step; each forward's activation scale is 1.8 x the previous forward's amax.
    Step 17's weights grew past both headrooms, so its caps clip (and the delayed scale differs from the current). Each
    step's first token lands on e4m3 ties under x's scale (TIE_TOKEN)."""
    mlp = fp8_mlp()
    train_gpt.refresh_down_scales([mlp.c_proj], [mlp.down_scale], [mlp.next_down_scale], bootstrap=True)  # step 14's
    down_scale = records_current_scale(mlp.c_proj.detach())
    next_down_scale = records_delayed_scale(mlp.c_proj.detach().abs().amax(), 1.12)
    assert all(map(torch.equal, scale_buffers(mlp), [torch.tensor(1.0), down_scale, next_down_scale]))
    g = torch.Generator().manual_seed(1)
    x = train_gpt.norm(torch.randn(1, MLP_TOKENS, MLP_DIM, generator=g)).bfloat16()
    with torch.no_grad():
        mlp(x)  # step 14's forward, from the initial activation scale
    act_scale = records_fp8_mlp(x[0], mlp.c_fc.detach(), mlp.c_proj.detach(), torch.tensor(1.0), down_scale)[2]
    growth = {16: 1.5}  # the up weight's (post grows by its square) and the down weight's, by step 17
    for step in (15, 16, 17):
        x = inputs_with_a_tie_token(g)
        grad = torch.randn(1, MLP_TOKENS, MLP_DIM, generator=g).bfloat16()
        w_up, w_down = mlp.c_fc.detach().clone(), mlp.c_proj.detach().clone()
        out, post, act_scale, clipped = records_fp8_mlp(x[0], w_up, w_down, act_scale, down_scale)
        assert clipped == (step == 17, step == 17), step
        xi = x.clone().requires_grad_()
        got = mlp(xi)
        got.backward(grad)
        assert got.dtype == torch.bfloat16 and torch.equal(got[0], out), step
        grads = records_mlp_backward(grad[0], x[0], w_up, w_down, post)
        for name, a, b in zip(("x", "c_fc", "c_proj"), (xi.grad[0], mlp.c_fc.grad, mlp.c_proj.grad), grads):
            assert a.dtype == torch.bfloat16 and torch.equal(a, b), (step, name)
        with torch.no_grad():  # the optimizer step
            for w in (mlp.c_fc, mlp.c_proj):
                w.mul_(growth.get(step, 1.0)).add_(torch.randn(w.shape, generator=g).bfloat16(), alpha=1e-3)
                w.grad = None
        bootstrap = step < train_gpt.DOWN_BOOTSTRAP_STEPS
        train_gpt.refresh_down_scales([mlp.c_proj], [mlp.down_scale], [mlp.next_down_scale], bootstrap)
        if bootstrap:
            next_down_scale = records_current_scale(mlp.c_proj.detach())
        down_scale = next_down_scale
        next_down_scale = records_delayed_scale(mlp.c_proj.detach().abs().amax(), 1.12)
        assert all(map(torch.equal, scale_buffers(mlp), [act_scale, down_scale, next_down_scale])), step
    assert train_gpt.DOWN_BOOTSTRAP_STEPS == 16 and not torch.equal(down_scale, records_current_scale(mlp.c_proj.detach()))


def test_the_scales_start_as_the_records_on_a_zero_down_projection():
    """An MLP's down-projection starts at zero: its scale then is the records' floor through bf16, the next one the
    floor times the headroom; the activation scale 1."""
    mlp = train_gpt.MLP(MLP_DIM, torch.bfloat16)
    zero = torch.zeros((), dtype=torch.bfloat16)
    assert all(map(torch.equal, scale_buffers(mlp), [torch.tensor(1.0), records_current_scale(zero),
                                                     records_delayed_scale(zero, 1.12)]))
    assert mlp.down_scale != 1e-12 / 448  # bf16's floor, and quotient


def test_evaluation_and_fp8_off_compute_the_plain_mlp_and_leave_the_scales():
    """Without FP8, and in evaluation with it, the MLP is relu(x c_fc^T)^2 c_proj as before, to the bit, in bf16 and in
    float32, and no scale changes."""
    for dtype in (torch.bfloat16, torch.float32):
        mlp = fp8_mlp().to(dtype)
        x = train_gpt.norm(torch.randn(1, MLP_TOKENS, MLP_DIM)).to(dtype)
        plain = F.linear(F.relu(F.linear(x, mlp.c_fc)).square(), mlp.c_proj.T)
        before = scale_buffers(mlp)
        for fp8, training in ((False, True), (True, False)):
            mlp.fp8 = fp8
            assert torch.equal(mlp.train(training)(x), plain), (dtype, fp8)
        assert all(map(torch.equal, scale_buffers(mlp), before))


def test_the_bf16_backward_recovers_relu_pre_from_post():
    """Without FP8 too, the bf16 MLP's gradients are the records' from post (relu(pre) = sqrt(post)), to the bit; for
    some units that differs from autograd's rule (2 relu(pre) from pre), which in float32 is the same (the square root
    of a float's rounded square is the float), so the float32 MLP keeps autograd's."""
    mlp = fp8_mlp().bfloat16()
    mlp.fp8 = False
    x = train_gpt.norm(torch.randn(1, MLP_TOKENS, MLP_DIM)).bfloat16().requires_grad_()
    grad = torch.randn(1, MLP_TOKENS, MLP_DIM).bfloat16()
    mlp(x).backward(grad)
    w_up, w_down = mlp.c_fc.detach(), mlp.c_proj.detach()
    post = F.relu(F.linear(x[0].detach(), w_up)).square()
    expected = records_mlp_backward(grad[0], x[0].detach(), w_up, w_down, post)
    assert all(torch.equal(a, b) for a, b in zip((x.grad[0], mlp.c_fc.grad, mlp.c_proj.grad), expected))
    for dtype in (torch.bfloat16, torch.float32):
        pre = F.linear(x[0].detach(), w_up).to(dtype).requires_grad_()
        grad_post = (grad[0] @ w_down.T).to(dtype)
        (autograd,) = torch.autograd.grad(F.relu(pre).square(), pre, grad_post)
        ours = train_gpt.relu_squared_backward(grad_post, F.relu(pre.detach()).square())
        assert torch.equal(autograd, ours) == (dtype == torch.float32), dtype


def test_rounded_to_compiled_rounds_as_eager():
    """2^20 float32 values: random bit patterns (NaN and infinities among them), a quarter of them ties (the dropped
    half exactly 0x8000, with even and odd kept lsb), and their neighbours; the compiled helper rounds each to the bits
    of eager's x.bfloat16().float(), NaN to NaN."""
    bits = torch.randint(-2**31, 2**31, (1 << 20,), generator=torch.Generator().manual_seed(2), dtype=torch.int64)
    bits = bits.to(torch.int32)
    for i, low in enumerate((0x8000, 0x7FFF, 0x8001)):
        bits[i::4] = (bits[i::4] & -0x10000) | low
    specials = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), 3.4028235e38, -3.4028235e38, 1e-45, 3.3961775e38])
    x = torch.cat([bits.view(torch.float32), specials])
    with torch._inductor.config.patch(force_disable_caches=True):
        compiled = torch.compile(train_gpt.rounded_to, dynamic=False, fullgraph=True)(x)
    eager = x.bfloat16().float()
    assert torch.equal(train_gpt.rounded_to(x).isnan(), eager.isnan()) and torch.equal(compiled.isnan(), eager.isnan())
    kept = ~eager.isnan()
    assert torch.equal(compiled[kept].view(torch.int32), eager[kept].view(torch.int32))
    assert (bits[::4] & 0x10000).any() and ((bits[::4] & 0x10000) == 0).any()  # ties to even, both ways


def bf16_rounding_moves_within(q, ulps: int) -> torch.Tensor:
    """Where a float32 q within ulps float32 ulps rounds to another bf16 than q itself."""
    moved = torch.zeros(q.shape, dtype=torch.bool)
    for direction in (float("inf"), -float("inf")):
        near = q
        for _ in range(ulps):
            near = torch.nextafter(near, torch.full_like(q, direction))
            moved |= near.bfloat16() != q.bfloat16()
    return moved


def test_a_quotient_of_bf16_values_rounds_to_bf16_alike_from_any_division_within_two_ulps():
    """What current_scale and the up weight's quantization rely on: the float32 quotient of two bf16 values lies more
    than 2 float32 ulps from every bf16 tie (a tie would need 9 significant bits of a product of 8-bit ones), so a
    division within 2 ulps (Triton's approximate one, inductor's product with a reciprocal) rounds to the same bf16.
    Every bf16 amax from the floor up, over 448 (and its product with 1/448's float32); 2^20 random weights over random
    scales with quotients up to 450."""
    every = torch.arange(0, 0x7F80, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    amax = every[every >= torch.tensor(1e-12).bfloat16().float()]
    quotient = amax / 448
    assert not bf16_rounding_moves_within(quotient, 2).any()
    assert torch.equal((amax * float32_constant(1 / 448)).bfloat16(), quotient.bfloat16())
    g = torch.Generator().manual_seed(3)
    scale = (10 ** (torch.rand(1 << 20, generator=g) * 8 - 6)).bfloat16().float()
    w = ((torch.rand(1 << 20, generator=g) * 2 - 1) * 450 * scale).bfloat16().float()
    assert not bf16_rounding_moves_within(w / scale, 2).any()


@pytest.mark.filterwarnings("ignore:dynamo_pgo force disabled")
def test_the_compiled_fp8_mlp_computes_eager_s_bits():
    """The MLP's FP8 forward and backward, and the scales' update, compiled (inductor fuses the roundings away unless
    rounded_to keeps them) equal eager to the bit: output, gradients and all three scales, over two steps."""
    mlps = [fp8_mlp(), fp8_mlp()]
    x = train_gpt.norm(torch.randn(2, 1, MLP_TOKENS, MLP_DIM, generator=torch.Generator().manual_seed(4))).bfloat16()
    results = []
    with torch._inductor.config.patch(force_disable_caches=True):
        for mlp, forward, refresh in ((mlps[0], mlps[0], train_gpt.refresh_down_scales),
                                      (mlps[1], torch.compile(mlps[1], dynamic=False, fullgraph=True),
                                       torch.compile(train_gpt.refresh_down_scales, dynamic=False, fullgraph=True))):
            for step in (15, 16):
                xi = x[step - 15].clone().requires_grad_()
                out = forward(xi)
                out.float().square().sum().backward()
                results.append([out.detach(), xi.grad, mlp.c_fc.grad, mlp.c_proj.grad, *scale_buffers(mlp)])
                with torch.no_grad():
                    for w in (mlp.c_fc, mlp.c_proj):
                        w.mul_(1.25)
                        w.grad = None
                refresh([mlp.c_proj], [mlp.down_scale], [mlp.next_down_scale], step < train_gpt.DOWN_BOOTSTRAP_STEPS)
                results[-1] += scale_buffers(mlp)
    for eager, compiled in zip(results[:2], results[2:]):
        for a, b in zip(eager, compiled):
            assert a.dtype == b.dtype and torch.equal(a, b)
