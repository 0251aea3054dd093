"""Bounds on the rounding error of float results, derived from the arithmetic, for comparisons between
results that different kernels, orders or code paths compute (Higham, Accuracy and Stability of
Numerical Algorithms, 2nd ed., ch. 2-3). Each rounding of +, -, * or / lies within a relative u, the
dtype's unit roundoff; a sum of n terms in ANY order or grouping (blocked, pairwise, with FMA) lies
within gamma(n) * (the sum of their magnitudes). Bounds here are first order: each assert_within call
checks that the terms dropped (products of two relative errors) are negligible beside the bound.

For long sums gamma(n) takes Higham and Mary's probabilistic bound (SIAM J. Sci. Comput. 41(5), 2019,
Theorem 2.4), which holds when rounding errors are independent with mean zero, as on the random data of
these tests: lambda * sqrt(n) * u instead of n * u, failing with probability below n * 2 exp(-lambda^2 / 2),
under 1e-15 for every sum here (n < 1e6) with LAMBDA = 10.
"""

import math

import torch

UNIT_ROUNDOFF = {torch.float64: 2.0 ** -53, torch.float32: 2.0 ** -24, torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}
# exp, exp2, log, cos, sin, tanh and rsqrt of SLEEF, MKL and ATen within 4 ulp, each ulp at most 2u of the result;
# CPU flash attention and inductor's flex template use ATen's faster exp_u20, documented within 20 ulp.
EXP_ULPS = 4
ATTENTION_EXP_ULPS = 20


LAMBDA = 10


def worst_case_gamma(n: int, dtype: torch.dtype = torch.float32) -> float:
    """n u / (1 - n u): the relative error bound of n roundings in a row, also where they are not independent,
    as in a sum of equal terms, whose partial sums round alike."""
    nu = n * UNIT_ROUNDOFF[dtype]
    return nu / (1 - nu) if nu < 1 else math.inf


def gamma(n: int, dtype: torch.dtype = torch.float32) -> float:
    """worst_case_gamma(n), or for long runs of independent roundings the probabilistic
    exp(LAMBDA sqrt(n) u + n u^2 / (1 - u)) - 1, whichever is smaller."""
    u = UNIT_ROUNDOFF[dtype]
    bound = min(worst_case_gamma(n, dtype), math.expm1(LAMBDA * math.sqrt(n) * u + n * u * u / (1 - u)))
    assert bound < 0.01, f"{n} roundings in {dtype}: the bound is meaningless"
    return bound


def matmul_bound(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Elementwise bound on |fl(a @ b) - a @ b| for inputs exact in dtype, summed in any order."""
    return gamma(a.size(-1), dtype) * (a.double().abs() @ b.double().abs())


def assert_within(actual: torch.Tensor, exact: torch.Tensor, bound, what: str = "", relative_terms: float = 0.0):
    """|actual - exact| <= bound elementwise. relative_terms: the largest relative error that entered the
    first-order bound; the terms it drops are below relative_terms times the bound, hence the check."""
    assert relative_terms < 1e-3, f"{what}: relative errors of {relative_terms:.1e} make a first-order bound unsafe"
    bound = torch.as_tensor(bound, dtype=torch.float64) * (1 + relative_terms)
    error = (actual.double() - exact.double()).abs()
    worst = (error / bound.clamp_min(torch.finfo(torch.float64).tiny)).max().item()
    assert bool((error <= bound).all()), (f"{what}: error up to {error.max().item():.3e}, {worst:.2f} times the "
                                          f"derived bound")


def attention_bounds(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor, scale: float,
                     grad_out: torch.Tensor | None = None, dtype: torch.dtype = torch.float32) -> dict:
    """The exact (float64) softmax attention of (..., T, D) inputs over the allowed (Tq, Tk) pairs, its
    gradients against grad_out, and a first-order bound on the error of any kernel computing them in dtype
    from inputs exact in dtype, whatever its order of sums, its running max, and its online rescaling.
    Returns a dict of exact values ("out", "dq", "dk", "dv") and bounds ("out_bound", ...), and "relative",
    the largest relative error of a softmax weight, for assert_within."""
    u = UNIT_ROUNDOFF[dtype]
    q, k, v = (t.double() for t in (q, k, v))
    n = allowed.sum(-1, keepdim=True).double()  # keys per query
    scores = scale * q @ k.transpose(-1, -2)
    magnitude = scale * q.abs() @ k.abs().transpose(-1, -2)
    p = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    # Each score within gamma(D + 2) of its magnitude (dot product, scale, a log2(e) factor); the max a kernel
    # subtracts lies among the scores (2u of the largest); exp's error; a backward's p recomputed from logsumexp.
    score_error = gamma(q.size(-1) + 2, dtype) * magnitude + 2 * u * scores.abs()
    largest = score_error.masked_fill(~allowed, 0).amax(-1, keepdim=True)
    logsumexp_error = 2 * EXP_ULPS * u * n.log() + 2 * u * scores.masked_fill(~allowed, 0).abs().amax(-1, keepdim=True)
    theta = largest + 2 * ATTENTION_EXP_ULPS * u + logsumexp_error
    # The sums over n keys pass each term through at most n additions and n rescalings (online softmax).
    sums = torch.tensor([gamma(int(c), dtype) for c in 2 * n.flatten()], dtype=torch.float64).view(n.shape)
    rho = 2 * theta + sums + 2 * u  # a normalized weight: numerator, denominator, a reciprocal and a product
    out = p @ v
    weighted = p @ v.abs()
    result = dict(out=out, out_bound=(rho + sums) * weighted, relative=float(rho.max()))
    if grad_out is None:
        return result
    g = grad_out.double()
    d = v.size(-1)
    num_queries, num_keys = p.size(-2), p.size(-1)
    dv = p.transpose(-1, -2) @ g
    dv_bound = ((rho + gamma(2 * num_queries, dtype)) * p).transpose(-1, -2) @ g.abs()
    dp = g @ v.transpose(-1, -2)
    dp_error = gamma(d, dtype) * g.abs() @ v.abs().transpose(-1, -2)
    row = (g * out).sum(-1, keepdim=True)  # the softmax's backward subtracts sum_j p_ij dp_ij = dO_i . O_i
    # a kernel forms it from its own output (flash) or from p and dp (the math path): either bound holds
    row_error = (gamma(d, dtype) * (g.abs() * out.abs()).sum(-1, keepdim=True)
                 + (g.abs() * result["out_bound"]).sum(-1, keepdim=True)
                 + (rho * p * dp.abs() + p * dp_error).sum(-1, keepdim=True) + sums * (p * dp.abs()).sum(-1, keepdim=True))
    ds = p * (dp - row)
    ds_error = rho * p * (dp - row).abs() + p * (dp_error + row_error) + 2 * u * p * (dp.abs() + row.abs())
    dq = scale * ds @ k
    dq_bound = scale * (ds_error @ k.abs() + gamma(2 * num_keys + 1, dtype) * ds.abs() @ k.abs())
    dk = scale * ds.transpose(-1, -2) @ q
    dk_bound = scale * (ds_error.transpose(-1, -2) @ q.abs()
                        + gamma(2 * num_queries + 1, dtype) * ds.abs().transpose(-1, -2) @ q.abs())
    result.update(dq=dq, dk=dk, dv=dv, dq_bound=dq_bound, dk_bound=dk_bound, dv_bound=dv_bound)
    return result


# Torch functions whose results are exact: they move, select or compare values, or cast them (a float64
# trace stands for a float32 run, where the model's casts to float32 change nothing).
EXACT_FUNCTIONS = {"__getitem__", "__get__", "size", "numel", "dim", "view", "view_as", "reshape", "flatten", "transpose",
                   "permute", "unsqueeze", "squeeze", "expand", "contiguous", "chunk", "split", "unbind", "cat", "stack",
                   "embedding", "relu", "neg", "__neg__", "clone", "detach", "masked_fill", "arange", "zeros", "ones",
                   "flip", "unflatten", "clamp_min", "repeat_interleave", "pad", "unfold", "amax",
                   "float", "type_as", "to"}
ONE_ROUNDING = {"add", "sub", "mul", "div", "square", "__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__",
                "__truediv__"}
CASTS = {"float", "type_as", "to"}


def rounds(name: str, result) -> bool:
    """Whether a torch function's result is rounded: a new float tensor, not a move, selection or comparison
    of values, nor a cast to a dtype that holds them (a float64 trace's casts, a float32 run's to float32)."""
    if not (isinstance(result, torch.Tensor) and result.is_floating_point()) or result._base is not None:
        return False
    return name not in EXACT_FUNCTIONS or (name in CASTS and result.dtype not in (torch.float32, torch.float64))


def norm_eps(name: str, args, kwargs, dtype: torch.dtype) -> dict:
    """kwargs with rms_norm's default eps made explicit as dtype's: a float64 trace of a run in dtype norms
    with the run's eps, not float64's."""
    if name == "rms_norm" and kwargs.get("eps") is None and len(args) < 4:
        return {**kwargs, "eps": torch.finfo(dtype).eps}
    return kwargs


class TorchCalls(torch.overrides.TorchFunctionMode):
    """Every torch function called in the block, in order: its name, its result where that is a tensor, and
    whether a 0-dim float argument of another dtype scales it (an op on bf16 rounds such a factor first).
    norm_dtype: rms_norm's default eps taken as that dtype's (for a float64 twin of a run in it)."""

    def __init__(self, norm_dtype: torch.dtype | None = None):
        super().__init__()
        self.calls, self.norm_dtype = [], norm_dtype

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", str(func))
        kwargs = norm_eps(name, args, kwargs or {}, self.norm_dtype) if self.norm_dtype else kwargs or {}
        result = func(*args, **kwargs)
        tensor = result if isinstance(result, torch.Tensor) else None
        factors = [a for a in args if isinstance(a, torch.Tensor) and a.dim() == 0 and a.is_floating_point()]
        rounded_factor = tensor is not None and any(a.dtype != tensor.dtype for a in factors)
        self.calls.append((name, tensor, rounded_factor))
        return result


def probabilistic_bound(run: TorchCalls, twin: TorchCalls, twin_value: torch.Tensor, rounded_leaves=()) -> float:
    """A probabilistic first-order bound on how far the value a recorded run computed lies from its float64 twin's
    (the same calls on float64 copies): rounding k moves it by d_k a_k, a_k the sum of dvalue/dz z over the values
    it rounds, |d_k| <= u of its dtype, independent with mean zero; by Hoeffding's inequality |sum d_k a_k| exceeds
    LAMBDA sqrt(sum (u a_k)^2) with probability below 2 exp(-LAMBDA^2 / 2). Each element of a rounded result is a
    rounding (each kernel taken to round its result once), a rounded 0-dim factor one for the whole result, and
    each entry of rounded_leaves (float64 twins of tensors the run stores in bf16) one; a result the value does not
    use moves nothing."""
    roundings, twins = [], []
    for (name, result, rounded_factor), (twin_name, twin_result, _) in zip(run.calls, twin.calls, strict=True):
        assert name == twin_name
        if not rounds(name, result):
            continue
        if not twin_result.requires_grad:  # made from buffers alone (the bigram's signs): it must have rounded nothing
            assert torch.equal(result.double(), twin_result), f"{name} rounded a value no gradient reaches"
            continue
        roundings.append((UNIT_ROUNDOFF[result.dtype], rounded_factor))
        twins.append(twin_result)
    roundings += [(UNIT_ROUNDOFF[torch.bfloat16], False)] * len(rounded_leaves)
    spread = 0.0
    grads = torch.autograd.grad(twin_value, twins + list(rounded_leaves), allow_unused=True)
    for (u, rounded_factor), z, dz in zip(roundings, twins + list(rounded_leaves), grads):
        if dz is None:
            continue
        a = torch.where(z.detach().isfinite(), dz * z.detach(), 0)  # infinities (masked logits) are exact
        spread += u**2 * (float(a.square().sum()) + (float(a.sum()) ** 2 if rounded_factor else 0.0))
    return LAMBDA * spread ** 0.5


class RoundingTrace(torch.overrides.TorchFunctionMode):
    """Evaluates in float64 (casts to other float dtypes kept in float64) and records, for each torch function
    that rounds, its result z and a bound on the error one evaluation of it in dtype makes from exact inputs."""

    def __init__(self, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.u, self.dtype, self.records = UNIT_ROUNDOFF[dtype], dtype, []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        if name in CASTS and isinstance(args[0], torch.Tensor) and args[0].dtype == torch.float64:
            target = kwargs.get("dtype") or next((a.dtype if isinstance(a, torch.Tensor) else a for a in args[1:]
                                                  if isinstance(a, (torch.dtype, torch.Tensor))), torch.float32)
            if target.is_floating_point:
                assert target in (torch.float64, torch.float32, self.dtype), f"a cast to {target} rounds"
                return args[0]
        out = func(*args, **norm_eps(name, args, kwargs, self.dtype))
        if not rounds(name, out):
            return out
        # an infinite result (a masked logit less a finite one) is exact: IEEE arithmetic on infinities does not round
        local = torch.where(out.detach().isfinite(), self.local_bound(name, args, kwargs, out), 0)
        assert out.requires_grad, f"{name} rounds a result no gradient reaches: give its inputs requires_grad"
        self.records.append((out, local))
        return out

    def local_bound(self, name, args, kwargs, out):
        u, z = self.u, out.detach().abs()
        if name in ONE_ROUNDING:
            # a Python float that dtype cannot hold is rounded once more, before the op; inductor divides by a
            # constant as a product with its rounded reciprocal
            inexact = [a for a in args if isinstance(a, float) and float(torch.tensor(a, dtype=self.dtype)) != a]
            extra = sum(u * abs(a) for a in inexact) if name.endswith(("add", "sub", "add__", "sub__")) else len(inexact) * u * z
            return (2 if name in ("div", "__truediv__") else 1) * u * z + extra
        if name == "sigmoid":  # 1 / (1 + exp(-x)): exp's error is relative to exp(-x) <= 1 + exp(-x)
            return (2 * EXP_ULPS + 2) * u * z
        if name == "tanh":
            return 2 * EXP_ULPS * u * z
        if name == "exp2":  # the vector libraries' exp2, like their exp, within EXP_ULPS ulps
            return EXP_ULPS * u * z
        if name == "sum":  # its terms in any order
            terms = args[0].numel() // max(out.numel(), 1)
            return gamma(max(terms, 1), self.dtype) * torch.sum(args[0].detach().abs(), *args[1:], **kwargs)
        if name == "gelu":
            return gelu_bound(args[0].detach(), u) + u * z
        if name == "rms_norm":  # a mean of D squares, a square root and a division, a weight
            return (gamma(args[0].size(-1) + 2, self.dtype) + (2 * EXP_ULPS + 2) * u) * z
        if name in ("linear", "matmul", "__matmul__", "mm", "bmm"):
            weight = args[1].transpose(-1, -2) if name == "linear" else args[1]
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            return matmul_bound(args[0].detach(), weight.detach(), self.dtype) + (u * z if bias is not None else 0)
        if name == "scaled_dot_product_attention":
            q, k, v = (a.detach() for a in args[:3])
            mask, scale = kwargs.get("attn_mask"), kwargs.get("scale") or q.size(-1) ** -0.5
            assert mask is not None and mask.dtype == torch.bool and not kwargs.get("is_causal"), "a boolean attn_mask"
            return attention_bounds(q, k, v, mask, scale, dtype=self.dtype)["out_bound"]
        if name == "cross_entropy":
            return self.cross_entropy_bound(args[0].detach(), args[1], kwargs.get("reduction", "mean"), out)
        raise AssertionError(f"tests/rounding.py knows no rounding bound for torch function {name}")

    def cross_entropy_bound(self, logits, targets, reduction, out):
        """Each row: logsumexp (exp arguments off by at most 2u of the largest logit, exp, a sum of V terms,
        log's ulps, the max added back) minus the target's logit; then a sum of the rows."""
        u = self.u
        logits = logits.reshape(-1, logits.size(-1))
        largest = logits.amax(-1)
        lse = logits.logsumexp(-1)
        rows = lse - logits.gather(1, targets.reshape(-1, 1)).squeeze(1)
        per_row = (2 * u * logits.abs().amax(-1) + 2 * EXP_ULPS * u + gamma(logits.size(-1), self.dtype)
                   + 2 * EXP_ULPS * u * (lse - largest) + u * lse.abs() + u * rows.abs())
        total = per_row.sum() + gamma(rows.numel(), self.dtype) * rows.abs().sum()
        return total / rows.numel() + u * out.detach().abs() if reduction == "mean" else total


ERF_APPROXIMATION_ERROR = 1.5e-7  # Abramowitz and Stegun 7.1.26's bound, the formula of ATen's vectorized erf
ERF_COEFFICIENTS = (0.254829592, -0.284496736, 1.421413741, -1.453152027, 1.061405429)  # its a_1 .. a_5
ERF_SLOPE = sum(k * abs(a) for k, a in enumerate(ERF_COEFFICIENTS, 1))


def gelu_bound(x: torch.Tensor, u: float) -> torch.Tensor:
    """Bound on |fl(gelu(x)) - gelu(x)| before the result's own rounding, for the erf form x (1 + erf(x / sqrt 2)) / 2
    as ATen's and inductor's CPU kernels compute it: erf(a) = 1 - S(t) e^(-a^2), t = 1 / (1 + p |a|) <= 1, S the
    formula's polynomial a_1 t + ... + a_5 t^5 in Horner's form, within ERF_APPROXIMATION_ERROR of erf. Its float32
    evaluation: t's fma and division (2u relative) and p's rounding (t (1 - t) u <= u / 4) move S by at most
    ERF_SLOPE (sum k |a_k|) times that; the coefficients' roundings by sum |a_k| u; Horner's four fmas, each
    rounding a value below 1.5 that reaches S through powers of t, 6u; exp within EXP_ULPS ulps and its argument's
    rounding (a^2 e^(-a^2) u <= u / e), times S e^(-a^2) <= 1; the product by t and the final fma, u each; a = x / sqrt 2
    (a rounded constant and a product, 2u relative) moves erf by at most 2 / sqrt(pi) |a| e^(-a^2) 2u < u. Then 1 + erf
    rounds (2u), the half is exact, and the product by x rounds its own result (the caller's u |z|): |x| / 2 times
    erf's error plus that sum's."""
    coefficients = sum(map(abs, ERF_COEFFICIENTS))
    erf_error = ERF_APPROXIMATION_ERROR + (2.25 * ERF_SLOPE + coefficients + 6 + 2 * EXP_ULPS + 1 + 2 + 1) * u
    return x.abs() / 2 * (erf_error + 2 * u)


def first_order_bound(compute, dtype: torch.dtype = torch.float32):
    """compute() builds a scalar, or a 1-D tensor of a few, from float64 copies of inputs exact in dtype, some of
    them requiring grad. Returns the exact value(s) and first-order bound(s) on the error of any evaluation in dtype
    that rounds each op within RoundingTrace's local bounds: the sum over ops of |d value / d z| times the bound."""
    with torch.enable_grad():
        with RoundingTrace(dtype) as trace:
            values = compute()
        results = [z for z, _ in trace.records]
        bounds = []
        for value in values.reshape(-1):
            grads = torch.autograd.grad(value, results, allow_unused=True, retain_graph=True)
            bounds.append(sum(float((g.abs() * local).sum()) for g, (_, local) in zip(grads, trace.records)
                              if g is not None))
    if values.dim() == 0:
        return float(values.detach()), bounds[0]
    return values.detach(), torch.tensor(bounds, dtype=torch.float64)


def rounding_bound(a: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Elementwise bound on |fl(a) - a| for a rounded to nearest in dtype, within its range: u |a| for normal
    results, half the subnormal spacing below them; from torch.finfo, so float8 formats (e4m3: u = 2^-4, e5m2:
    u = 2^-3) are covered too."""
    info = torch.finfo(dtype)
    return info.eps / 2 * a.double().abs() + info.smallest_normal * info.eps / 2


def cos_sin_bound(angle: torch.Tensor, angle_error: float, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Elementwise bound on the error of cos or sin evaluated in dtype at an angle within a relative angle_error
    of the exact angle: both functions are 1-Lipschitz, and the vector libraries' cos and sin, like their exp, are
    documented within EXP_ULPS ulps, at most 2u each of a result at most 1."""
    return angle_error * angle.double().abs() + 2 * EXP_ULPS * UNIT_ROUNDOFF[dtype]
