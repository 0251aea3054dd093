"""Bounds on the rounding error of float results, derived from the arithmetic, for comparisons between
results that different kernels, orders or code paths compute (Higham, Accuracy and Stability of
Numerical Algorithms, 2nd ed., ch. 2-3). Each rounding of +, -, * or / lies within a relative u, the
dtype's unit roundoff; a sum of n terms in ANY order or grouping (blocked, pairwise, with FMA) lies
within gamma(n) * (the sum of their magnitudes). Bounds here are first order: each assert_within call
checks that the terms dropped (products of two relative errors) are negligible beside the bound.
"""

import torch

UNIT_ROUNDOFF = {torch.float64: 2.0 ** -53, torch.float32: 2.0 ** -24, torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}
# Vectorized exp and exp2 (SLEEF's, ATen's own and inductor's) are accurate to a few units in the last
# place; one ulp is at most 2u of the result, and 4 ulp covers every library's documented accuracy.
EXP_ULPS = 4


def gamma(n: int, dtype: torch.dtype = torch.float32) -> float:
    """The relative error bound of n roundings in a row: n u / (1 - n u)."""
    nu = n * UNIT_ROUNDOFF[dtype]
    assert nu < 0.01, f"{n} roundings in {dtype}: the bound is meaningless"
    return nu / (1 - nu)


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
    # A weight exp(s - m) / sum: each score within gamma(D + 2) of its magnitude (the dot product, the
    # scale and a log2(e) factor); the max a kernel subtracts lies among the scores, so the subtraction
    # adds at most 2u of the largest score; then exp's own error.
    score_error = gamma(q.size(-1) + 2, dtype) * magnitude + 2 * u * scores.abs()
    theta = score_error.masked_fill(~allowed, 0).amax(-1, keepdim=True) + 2 * EXP_ULPS * u
    # The sums over n keys pass each term through at most n additions and n rescalings (online softmax).
    sums = torch.tensor([gamma(int(c), dtype) for c in 2 * n.flatten()], dtype=torch.float64).view(n.shape)
    rho = 2 * theta + sums + u  # relative error of a normalized weight: numerator, denominator, division
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
