"""Orthogonalization, Muon, and the learning-rate / momentum / window / attention-scale schedules."""

import dataclasses
import itertools
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pytest
import torch

import train_gpt
from rounding import EXP_ULPS, UNIT_ROUNDOFF, TorchCalls, assert_within, gamma, worst_case_gamma

pytestmark = pytest.mark.numerics

# square, wide, tall, a batch, and a 4-D stack like Muon's batch of qkv weights (n, 3, rows, cols)
SHAPES = [(128, 128), (64, 256), (256, 64), (3, 64, 128), (2, 3, 64, 32)]


def random_matrices(shape, seed):
    """Gaussian matrices; square ones get a random spectrum in [0.05, 1] instead, because a square
    Gaussian matrix has singular values near 0 (~1/n of the largest) that no 5-step iteration lifts
    into the band, which says nothing about the method."""
    torch.manual_seed(seed)
    if shape[-1] != shape[-2]:
        return torch.randn(shape)
    n = shape[-1]
    q1, _ = torch.linalg.qr(torch.randn(*shape[:-2], n, n))
    q2, _ = torch.linalg.qr(torch.randn(*shape[:-2], n, n))
    return q1 @ torch.diag_embed(0.05 + 0.95 * torch.rand(*shape[:-1])) @ q2


def polar_factor(G):
    """The exact U V^T of G's reduced SVD, in fp32."""
    U, _, Vh = torch.linalg.svd(G.float(), full_matrices=False)
    return U @ Vh


def orthogonalization_stats(shape, method):
    """Over three seeds: (smallest singular value, largest, largest |s - 1|, smallest cosine with U V^T)."""
    lo, hi, dev, cos = [], [], [], []
    for seed in range(3):
        G = random_matrices(shape, seed)
        O = train_gpt.orthogonalize(G, method)
        assert O.shape == G.shape and O.dtype == torch.bfloat16
        s = torch.linalg.svdvals(O.float())
        P = polar_factor(G)
        cosine = (O.float() * P).sum((-2, -1)) / (O.float().norm(dim=(-2, -1)) * P.norm(dim=(-2, -1)))
        lo.append(s.min().item())
        hi.append(s.max().item())
        dev.append((s - 1).abs().max().item())
        cos.append(cosine.min().item())
    return min(lo), max(hi), max(dev), min(cos)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_orthogonalize_lands_near_the_polar_factor(shape):
    """Both methods map every singular value into a band around 1 and point along U V^T; Polar
    Express is tighter. Measured over all shapes: Newton-Schulz s in [0.67, 1.14], |s-1| <= 0.33,
    cosine >= 0.984; Polar Express s in [0.85, 1.15], |s-1| <= 0.15, cosine >= 0.994."""
    ns_lo, ns_hi, ns_dev, ns_cos = orthogonalization_stats(shape, "newton_schulz")
    pe_lo, pe_hi, pe_dev, pe_cos = orthogonalization_stats(shape, "polar_express")
    assert 0.5 < ns_lo and ns_hi < 1.3
    assert 0.7 < pe_lo and pe_hi < 1.25
    assert pe_dev < 0.25 and pe_dev < ns_dev
    assert ns_cos > 0.97 and pe_cos > 0.98


def steepest_slope(a, b, c, lo, hi):
    """The largest |p'(s)| and |p(s) / s| over lo <= s <= hi, for p(s) = a s + b s^3 + c s^5: both are quadratics
    in s^2, largest in size at an end or at the vertex."""
    def largest(linear, quadratic):
        ends = (lo * lo, hi * hi)
        vertex = min(max(-linear / (2 * quadratic), ends[0]), ends[1])
        return max(abs(a + linear * t + quadratic * t * t) for t in (*ends, vertex))
    return max(largest(3 * b, 5 * c), largest(b, c))


def step_rounding(bound, a, b, c, dtype):
    """A bound on the Frobenius norm of the rounding of one step, a X + (b A + c A A) X with A = X X^T, computed in
    dtype from any X with |X| <= bound: a matmul within gamma(its inner dim) |P| |Q|, a product by a constant (rounded
    to dtype) within gamma(2), a sum within u, and each intermediate's error carried through what multiplies it. A
    line computed as one scaled product and sum (addmm) rounds no more often, so the bound holds for it too."""
    u, rows, cols = UNIT_ROUNDOFF[dtype], bound.size(-2), bound.size(-1)
    gram = bound @ bound.mT  # bounds |A|
    gram_error = gamma(cols, dtype) * gram
    b_gram_error, c_gram_error = (abs(k) * gram_error + gamma(2, dtype) * abs(k) * (gram + gram_error) for k in (b, c))
    square_error = (c_gram_error @ (gram + gram_error) + abs(c) * gram @ gram_error
                    + gamma(rows, dtype) * (abs(c) * gram + c_gram_error) @ (gram + gram_error))
    poly = abs(b) * gram + abs(c) * gram @ gram  # bounds |b A + c A A|
    poly_error = b_gram_error + square_error + u * (poly + b_gram_error + square_error)
    linear_error = gamma(2, dtype) * abs(a) * bound
    product_error = poly_error @ bound + gamma(rows, dtype) * (poly + poly_error) @ bound
    total = linear_error + product_error + u * (abs(a) * bound + linear_error + poly @ bound + product_error)
    return torch.linalg.matrix_norm(total, "fro")


def orthogonalization_error(G, method, dtype):
    """A bound on the Frobenius norm of orthogonalize(G, method, dtype) minus the same iteration in exact arithmetic,
    per matrix, shaped to broadcast over its entries (the float64 iterates stand in for the exact ones' magnitudes).
    Each step X <- p(X) adds its own rounding to the error it inherits times p's Lipschitz constant."""
    X = G.double()
    if X.size(-2) > X.size(-1):
        X = X.mT
    norm = X.norm(dim=(-2, -1), keepdim=True)
    X = X / (norm * (1 + train_gpt.POLAR_EXPRESS_SAFETY) + 1e-6) if method == "polar_express" else X / (norm + 1e-7)
    # X's Frobenius norm is below 1 and each entry's relative error within gamma: the norm's mn roundings and its
    # square root, the safety factor (rounded, then a product), eps (rounded, then a sum) and the division
    error = torch.full(X.shape[:-2], gamma(X.size(-2) * X.size(-1) + 6, dtype), dtype=torch.float64)
    for a, b, c in train_gpt.ORTHOGONALIZERS[method]:
        # p's Lipschitz constant (Frobenius norm) near X: its largest divided difference over the singular values of
        # the computed and exact iterates, which lie within the error of X's (Weyl)
        singular = torch.linalg.svdvals(X)
        lipschitz = torch.tensor([steepest_slope(a, b, c, max(lo - e, 0.0), hi + e) for lo, hi, e in zip(
            singular.amin(-1).flatten().tolist(), singular.amax(-1).flatten().tolist(), error.flatten().tolist())],
            dtype=torch.float64).view(error.shape)
        error = lipschitz * error + step_rounding(X.abs() + error[..., None, None], a, b, c, dtype)
        A = X @ X.mT
        X = a * X + (b * A + c * A @ A) @ X
    return error[..., None, None]


def test_orthogonalize_batches_independently():
    """Each matrix of a stack is orthogonalized on its own: in float64 a batch equals its slices within the
    iteration's float64 rounding; in bf16 a matrix's result keeps its bits whatever the other matrices hold."""
    G = random_matrices((3, 64, 128), 0)
    batched = train_gpt.orthogonalize(G.double(), dtype=torch.float64)
    # two float64 evaluations of one exact iteration, each within its bound of it
    bound = 2 * orthogonalization_error(G, "newton_schulz", torch.float64)
    for i in range(3):
        alone = train_gpt.orthogonalize(G[i].double(), dtype=torch.float64)
        assert_within(batched[i], alone, bound[i], f"matrix {i} of the batch")
    others = G.clone()
    others[1] = 10 * random_matrices((64, 128), 1)
    # the same shapes run the same kernels: each matrix's result depends on its own bits only
    assert torch.equal(train_gpt.orthogonalize(others)[[0, 2]], train_gpt.orthogonalize(G)[[0, 2]])


@pytest.mark.parametrize("method", train_gpt.ORTHOGONALIZERS)
def test_orthogonalize_in_float32_follows_the_float64_iteration(method):
    """dtype=float32 (a float32 run's Muon) computes the iteration within the bound float32's rounding implies of the
    float64 result, and the result keeps the dtype it was computed in. Small matrices: the bound grows with size."""
    G = random_matrices((2, 3, 6), 0)
    exact = train_gpt.orthogonalize(G.double(), method, torch.float64)
    fp32 = train_gpt.orthogonalize(G, method, torch.float32)
    assert fp32.dtype == torch.float32 and train_gpt.orthogonalize(G, method).dtype == torch.bfloat16
    # each of the two within its own bound of the iteration in exact arithmetic
    bound = orthogonalization_error(G, method, torch.float32) + orthogonalization_error(G, method, torch.float64)
    assert_within(fp32, exact, bound, f"{method} in float32")


@pytest.mark.parametrize("method", train_gpt.ORTHOGONALIZERS)
@pytest.mark.parametrize("shape", [(96, 48), (3, 32, 64), (2, 2, 16, 24)], ids=str)
def test_each_line_of_the_iteration_rounds_once_as_the_records_kernels_do(method, shape):
    """The record stores each line of the iteration once in bf16 after float32 accumulation: A = X X^T,
    B = b A + c A A^T, X' = a X + B X. orthogonalize() computes three such lines an iteration, each one rounding
    of its value computed in float32 from the line's recorded bf16 inputs: two roundings to bf16 of values within
    delta of each other lie within delta plus a bf16 rounding of each. Rounding after each operation (the form
    before) computes seven values an iteration, and B's large terms b A and c A A, which nearly cancel, each round."""
    G = random_matrices(shape, 0)
    with TorchCalls() as run:
        train_gpt.orthogonalize(G, method)
    X = [result for name, result, _ in run.calls if name in ("contiguous", "reshape")][-1]  # the stack iterated on
    lines = [result for name, result, _ in run.calls if name in ("matmul", "baddbmm")]
    coeffs = train_gpt.ORTHOGONALIZERS[method]
    assert len(lines) == 3 * len(coeffs) and all(t.dtype == torch.bfloat16 for t in [X, *lines])
    u, size = UNIT_ROUNDOFF[torch.bfloat16], max(X.shape[-2:])
    for (a, b, c), (A, B, X_next) in zip(coeffs, zip(*[iter(lines)] * 3)):
        x, gram, poly = X.double(), A.double(), B.double()
        # each line's exact value from its bf16 inputs, and the float32 error of a computation of it (matmul
        # accumulation, the two coefficient products and the sum), which both computations are within
        for got, exact, magnitude in ((A, x @ x.mT, x.abs() @ x.abs().mT),
                                      (B, b * gram + c * gram @ gram.mT, abs(b) * gram.abs() + abs(c) * gram.abs() @ gram.abs()),
                                      (X_next, a * x + poly @ x, abs(a) * x.abs() + poly.abs() @ x.abs())):
            delta = 2 * worst_case_gamma(size + 3) * magnitude
            reference = exact.float().bfloat16().double()
            bound = u / (1 - u) * (got.double().abs() + reference.abs()) + delta
            assert_within(got, reference, bound, f"{method} line of shape {tuple(got.shape)}")
        X = X_next


@pytest.mark.parametrize("method", train_gpt.ORTHOGONALIZERS)
def test_compiled_orthogonalize_computes_the_iteration(method):
    """The device plan compiles Muon's orthogonalization on CUDA. torch.compile's capture and AOT autograd's graph
    (backends eager, aot_eager) run eager's kernels: the bf16 result to the bit. Inductor's kernels round apart: in
    float32 (bf16 has no meaningful bound), within the derived bound of the float64 iteration, as the test above."""
    G = random_matrices((2, 3, 6), 0)
    eager = train_gpt.orthogonalize(G, method)
    for backend in ("eager", "aot_eager"):
        torch._dynamo.reset()
        assert torch.equal(torch.compile(train_gpt.orthogonalize, backend=backend, dynamic=False)(G, method), eager)
    torch._dynamo.reset()
    compiled = torch.compile(train_gpt.orthogonalize, dynamic=False)(G, method, torch.float32)
    exact = train_gpt.orthogonalize(G.double(), method, torch.float64)
    bound = orthogonalization_error(G, method, torch.float32) + orthogonalization_error(G, method, torch.float64)
    assert_within(compiled, exact, bound, f"compiled {method} in float32")


def test_muon_reduces_a_least_squares_loss():
    """Muon fits W_i X_i ~ Y_i for matrices of two shapes (tall and wide): the loss falls 20x."""
    torch.manual_seed(0)
    shapes = [(32, 16), (32, 16), (16, 48), (16, 48)]
    params = [torch.nn.Parameter(torch.zeros(s)) for s in shapes]
    data = [(torch.randn(s[1], 64), torch.randn(s[0], s[1]) / s[1] ** 0.5) for s in shapes]
    targets = [W @ X for X, W in data]

    def loss():
        return sum(((p @ X - Y) ** 2).mean() for p, (X, _), Y in zip(params, data, targets))

    optimizer = train_gpt.Muon(params, lr=0.02, momentum=0.9)
    initial = loss().item()
    for _ in range(60):
        optimizer.zero_grad()
        loss().backward()
        optimizer.step()
    assert loss().item() < initial / 20


def assert_stepped(got: torch.Tensor, start: torch.Tensor, update: torch.Tensor, lr: torch.Tensor):
    """got == start - lr * update in float32 as addcmul computes it: each entry rounded once (a fused multiply-add, as
    x86 CPUs' vector kernels do) or with the product rounded first."""
    fused = (start.double() - update.double() * lr.double()).float()  # the product exact in float64
    unfused = start - update * lr
    assert not torch.equal(got, start)
    assert bool(((got == fused) | (got == unfused)).all()), "not the step, rounded either way"


@pytest.mark.parametrize("nesterov", [True, False])
def test_muon_matches_the_documented_update(nesterov):
    """World size 1, three steps, a group of shape-identical params: by hand, buf <- lerp(buf, g, 1 - m);
    u = lerp(g, buf, m) with Nesterov, else buf; p <- p - lr' * orth(u), with lr' = lr * sqrt(max(1, rows/cols)) in
    float32 (the record's factor tensor, times the lr): each entry that step, rounded once or twice."""
    torch.manual_seed(1)
    lr, momentum = 0.03, 0.9
    params = [torch.nn.Parameter(torch.randn(64, 32)) for _ in range(3)]
    bufs = [torch.zeros_like(p) for p in params]
    optimizer = train_gpt.Muon(params, lr=lr, momentum=momentum, nesterov=nesterov)
    for _ in range(3):
        grads = [torch.randn(64, 32) for _ in params]
        starts = [p.detach().clone() for p in params]
        for p, g in zip(params, grads):
            p.grad = g.clone()
        optimizer.step()
        for i, g in enumerate(grads):
            bufs[i] = torch.lerp(bufs[i], g, 1 - momentum)
            u = torch.lerp(g, bufs[i], momentum) if nesterov else bufs[i]
            assert_stepped(params[i].detach(), starts[i], train_gpt.orthogonalize(u).float(),
                           lr * torch.tensor(max(1.0, 64 / 32) ** 0.5))


@pytest.mark.parametrize("shape, scale", [((64, 16), 2.0), ((16, 64), 1.0), ((3, 64, 16), 2.0), ((3, 16, 64), 1.0)])
def test_muon_update_scale(shape, scale):
    """Without momentum the update is lr * sqrt(max(1, rows/cols)) * orth(g): 2 for a 4x tall matrix,
    1 for a wide one, with rows, cols the last two dims (the qkv weight is (3, hidden, dim))."""
    torch.manual_seed(2)
    lr = 0.01
    p = torch.nn.Parameter(torch.zeros(shape))
    p.grad = torch.randn(shape)
    train_gpt.Muon([p], lr=lr, momentum=0.0, nesterov=False).step()
    # from zero, p + alpha * orth(g) rounds alpha * orth(g) once, as the product here does (alpha rounded alike)
    assert torch.equal(p.detach(), train_gpt.orthogonalize(p.grad).float() * (-lr * scale))


@pytest.mark.parametrize("method", train_gpt.ORTHOGONALIZERS)
@pytest.mark.parametrize("shape", [(48, 16), (16, 48), (3, 32, 24), (20, 20)])
def test_orthogonalization_flops_match_torchs_flop_counter(shape, method):
    """The FLOP formula that deals Muon's work equals what torch's own counter sees in orthogonalize()."""
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        train_gpt.orthogonalize(torch.randn(shape), method)
    assert counter.get_total_flops() == train_gpt.orthogonalization_flops(shape)


def test_deal_by_cost_balances_and_deals_everything_once():
    costs = [7, 3, 3, 9, 1, 5, 5, 2]
    dealt = train_gpt.deal_by_cost(costs, 3)
    assert sorted(i for mine in dealt for i in mine) == list(range(len(costs)))
    assert [sum(costs[i] for i in mine) for mine in dealt] == [12, 12, 11]  # the best split of 35 into 3
    assert all([costs[i] for i in mine] == sorted((costs[i] for i in mine), reverse=True) for mine in dealt)
    assert train_gpt.deal_by_cost(costs, 1) == [sorted(range(len(costs)), key=lambda i: -costs[i])]
    assert train_gpt.deal_by_cost([4], 3) == [[0], [], []]


def record_muon(rank: int, world_size: int) -> train_gpt.Muon:
    """Muon over the record model's hidden matrices, built on the meta device (no memory, no init cost)."""
    args = train_gpt.Hyperparameters()
    with torch.device("meta"):
        return train_gpt.build_optimizers(train_gpt.build_model(args, 1024), args, rank, world_size)[1]


def test_record_muon_work_is_balanced_over_8_ranks():
    """Each of 8 ranks orthogonalizes its share of the record model's 43 matrices (10 q/k/v/o stacks, 10
    attention gates, 22 MLP matrices and the smear gate: layers 0 and 7 have no attention, 0 no MLP); per-rank
    FLOPs within 1.25x of each other (dealing by shape group, 11 qkv matrices over 8 ranks left 2 ranks idle)."""
    muons = [record_muon(rank, 8) for rank in range(8)]
    params = muons[0].param_groups[0]["params"]
    assert len(params) == 43
    flops = [sum(train_gpt.orthogonalization_flops(p.shape) for p in mine) for mine in muons[0].dealt]
    assert muons[0].flops_per_rank == flops  # what the log reports
    print("record Muon orthogonalization GFLOPs per rank (8 ranks):", [round(f / 1e9, 1) for f in flops])
    assert max(flops) / min(flops) <= 1.25
    assert sum(flops) == sum(train_gpt.orthogonalization_flops(p.shape) for p in params)
    # every rank deals the same way, and every matrix is someone's, once
    shapes = lambda muon: [[tuple(p.shape) for p in mine] for mine in muon.dealt]
    assert all(shapes(m) == shapes(muons[0]) for m in muons)
    assert sorted(id(p) for mine in muons[0].dealt for p in mine) == sorted(id(p) for p in params)
    # round r holds each rank's r-th matrix
    for r, round_params in enumerate(muons[0].rounds):
        assert round_params == [mine[r] if r < len(mine) else None for mine in muons[0].dealt]


def test_muon_on_one_rank_equals_orthogonalizing_each_matrix_alone():
    """Muon orthogonalizes matrix by matrix (never batched), so the result cannot depend on which
    matrices share a rank: one step equals p - lr * scale * orthogonalize(g) for each, bit for bit."""
    torch.manual_seed(3)
    params = [torch.nn.Parameter(torch.randn(s)) for s in [(16, 8), (8, 24), (16, 8), (3, 8, 8)]]
    before = [p.detach().clone() for p in params]
    for p in params:
        p.grad = torch.randn_like(p)
    lr = 0.1
    train_gpt.Muon(params, lr=lr, momentum=0.0, nesterov=False, dtype=torch.float32).step()
    for p, p0 in zip(params, before):
        rows, cols = p.shape[-2:]
        expected = p0.clone().add_(train_gpt.orthogonalize(p.grad, "newton_schulz", torch.float32),
                                   alpha=-lr * max(1.0, rows / cols) ** 0.5)
        assert torch.equal(p.detach(), expected)


RECORD = train_gpt.Hyperparameters()
CPU = dataclasses.replace(RECORD, **train_gpt.PRESETS["cpu"])


def lr_rounding(args):
    """How far lr_multiplier and its formula by hand may differ in float64: the two round 15 times in all (7 and 8),
    each moving the result by at most u / cooldown_frac (the cooldown's division, or its start over its length)."""
    return 15 * UNIT_ROUNDOFF[torch.float64] / args.cooldown_frac


@pytest.mark.parametrize("args", [RECORD, CPU], ids=["record", "cpu"])
def test_lr_multiplier(args):
    """Over the S = N - extension scheduled steps: 1.0 until (1 - cooldown_frac) S, then linear toward 0.1 at S; from
    S on (the extension, and the final validation's step N), the value at 0.9999 S, where the record holds it."""
    N, S = args.num_iterations, args.num_iterations - args.extension_steps
    start = (1 - args.cooldown_frac) * S
    held = 0.1 + 0.9 * 0.0001 / args.cooldown_frac
    for step in range(N + 1):
        expected = 1.0 if step < start else 1.0 - 0.9 * (min(step, 0.9999 * S) - start) / (S - start)
        assert train_gpt.lr_multiplier(step, args) == pytest.approx(expected, abs=lr_rounding(args)), step
    assert len({train_gpt.lr_multiplier(step, args) for step in range(S, N + 1)}) == 1  # flat
    assert train_gpt.lr_multiplier(N, args) == pytest.approx(held, abs=lr_rounding(args))
    assert all(train_gpt.lr_multiplier(step, args) == 1.0 for step in range(max(1, math.ceil(start))))  # exactly 1


def test_lr_multiplier_record_values():
    """Spot values for the record (2185 scheduled steps of 2225, cooldown 0.5): 1.0 through step 1092, below 1 from
    1093, when step / 2185 passes 0.5; 0.1 + 0.9 x 0.0002 = 0.10018 through the 40 extension steps."""
    assert (RECORD.num_iterations, RECORD.extension_steps, RECORD.cooldown_frac) == (2225, 40, 0.5)
    assert {step: train_gpt.lr_multiplier(step, RECORD) for step in (0, 1092)} == {0: 1.0, 1092: 1.0}
    assert train_gpt.lr_multiplier(1093, RECORD) == pytest.approx(1 - 0.9 * (1093 - 0.5 * 2185) / (0.5 * 2185),
                                                                  abs=lr_rounding(RECORD))
    assert train_gpt.lr_multiplier(1093, RECORD) < 1 and train_gpt.lr_multiplier(2184, RECORD) > train_gpt.lr_multiplier(2185, RECORD)
    for step in (2185, 2224, 2225):
        assert train_gpt.lr_multiplier(step, RECORD) == pytest.approx(0.10018, abs=lr_rounding(RECORD))


def test_muon_momentum():
    """0.85 at step 0, linear to 0.95 at step 300, then constant; no warm-up means 0.95 throughout."""
    # the ends weigh one value by 1 and the other by 0, exactly; between, the two sides round 12 times in all, each
    # of a term below 1
    assert {step: train_gpt.muon_momentum(step, RECORD) for step in (0, 300, 1000)} == {0: 0.85, 300: 0.95, 1000: 0.95}
    for step, expected in {150: 0.90, 299: 0.85 + 0.1 * 299 / 300}.items():
        assert train_gpt.muon_momentum(step, RECORD) == pytest.approx(expected, abs=12 * UNIT_ROUNDOFF[torch.float64])
    no_warmup = dataclasses.replace(RECORD, muon_momentum_warmup_steps=0)
    assert train_gpt.muon_momentum(0, no_warmup) == 0.95


@pytest.mark.parametrize("args", [RECORD, CPU], ids=["record", "cpu"])
def test_window_at(args):
    """The S = N - extension scheduled steps go through the stages in order, in parts that differ by at most one; the
    extension steps and the final validation (step N) have final_window."""
    N, S, stages = args.num_iterations, args.num_iterations - args.extension_steps, args.window_stages
    values = [train_gpt.window_at(step, args) for step in range(N + 1)]
    assert values[S:] == [args.final_window] * (N + 1 - S)
    runs = [(window, len(list(steps))) for window, steps in itertools.groupby(values[:S])]
    assert [window for window, _ in runs] == list(stages)  # each stage once, in order
    parts = [length for _, length in runs]
    assert max(parts) - min(parts) <= 1 and sum(parts) == S


def test_window_at_record_boundaries():
    """3, 7, 11 over steps 0-728, 729-1456 and 1457-2184 (int(3 step / 2185)); 13 for the 40 extension steps and the
    final validation at 2225."""
    assert (RECORD.window_stages, RECORD.final_window, RECORD.num_iterations) == ((3, 7, 11), 13, 2225)
    values = {0: 3, 728: 3, 729: 7, 1456: 7, 1457: 11, 2184: 11, 2185: 13, 2224: 13, 2225: 13}
    assert {step: train_gpt.window_at(step, RECORD) for step in values} == values
    cpu_steps = (0, 51, 52, 103, 104, 155, 156, 207, 208, 259, 260)  # 5 stages of 52 steps over 260
    assert [train_gpt.window_at(step, CPU) for step in cpu_steps] == [2, 2, 4, 4, 8, 8, 16, 16, 32, 32, 32]
    # 5 stages over 10 steps, no extension: two steps each, then final_window for the validation
    short = dataclasses.replace(RECORD, num_iterations=10, extension_steps=0, window_stages=(1, 2, 3, 4, 5), final_window=6)
    assert [train_gpt.window_at(step, short) for step in range(11)] == [1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6]


def test_the_2025_11_18_schedules_at_every_step():
    """2185 scheduled steps and 40 more (2225), at every step against the record's functions written out: get_ws
    switches windows by int(3 x step / 2185) and trains the extension at 13; get_lr decays over the 2185 and holds
    0.9999 of the way after; get_muon_momentum rises from 0.85 over 300 steps, is 0.95 exactly until the last 50 of
    all 2225, then falls to 0.85 (the same float operations: equal). A cooldown reaching into the warm-up leaves the
    warm-up."""
    args = RECORD

    def record_lr(step):
        x = min(0.9999, step / 2185)
        if x >= 1 - 0.50:
            w = (1 - x) / 0.50
            return w * 1.0 + (1 - w) * 0.1
        return 1.0

    def record_ws(step):
        return 13 if step >= 2185 else (3, 7, 11)[int(3 * (step / 2185))]

    for step in range(args.num_iterations):
        assert train_gpt.window_at(step, args) == record_ws(step), step
        assert train_gpt.lr_multiplier(step, args) == record_lr(step), step
        if step < 300:
            expected = 0.85 + (step / 300) * (0.95 - 0.85)
        else:
            expected = 0.95 - ((step - 2175) / 50) * (0.95 - 0.85) if step > 2175 else 0.95
        assert train_gpt.muon_momentum(step, args) == expected, step
    overlapping = dataclasses.replace(args, num_iterations=320, extension_steps=0)  # the cooldown would start at 270
    assert train_gpt.muon_momentum(280, overlapping) == train_gpt.muon_momentum(280, RECORD) < 0.95


def test_attention_scales_record():
    """0.1 at the first window, then times 1 + 0.2 ln(new / previous) at each new window, by hand (the same float
    operations in the same order, so equal); the published values to 7 decimals. A repeated window keeps its scale
    (cpu preset: 8 throughout)."""
    scales = train_gpt.attention_scales((3, 7, 11, 13), 0.1, growth=0.2)
    by_hand = {3: 0.1}
    by_hand[7] = by_hand[3] * (1 + 0.2 * math.log(7 / 3))
    by_hand[11] = by_hand[7] * (1 + 0.2 * math.log(11 / 7))
    by_hand[13] = by_hand[11] * (1 + 0.2 * math.log(13 / 11))
    assert list(scales) == [3, 7, 11, 13]
    assert scales == by_hand
    assert {w: round(s, 7) for w, s in scales.items()} == {3: 0.1, 7: 0.1169460, 11: 0.1275175, 13: 0.1317780}
    assert train_gpt.attention_scales((8, 8), 0.12, growth=0.2) == {8: 0.12}
    assert train_gpt.attention_scales((2, 2, 4, 4), 0.1, growth=0.2) == {2: 0.1, 4: 0.1 * (1 + 0.2 * math.log(2))}
    assert train_gpt.attention_scales((2, 4, 8), 0.1, growth=0.5) == {
        2: 0.1, 4: 0.1 * (1 + 0.5 * math.log(2)), 8: 0.1 * (1 + 0.5 * math.log(2)) * (1 + 0.5 * math.log(2))}
    assert train_gpt.attention_scales((2, 4, 8), 0.12, growth=0) == {2: 0.12, 4: 0.12, 8: 0.12}
    model = train_gpt.build_model(dataclasses.replace(RECORD, model_dim=64, num_heads=1, head_dim=64), 128)
    assert model.attention_scales == scales


class RescaleSpy:
    """Stands in for a model: move_window touches only model.rotary.rescale."""

    def __init__(self):
        self.calls = []
        self.rotary = self

    def rescale(self, old, new):
        self.calls.append((old, new))


def test_move_window_rescales_only_when_the_window_changes():
    """Stepping through a run: one rescale per change, at its first step; none for a final window equal to the last stage's."""
    cpu_changes = [(52, (2, 4)), (104, (4, 8)), (156, (8, 16)), (208, (16, 32))]
    for args, expected in ((RECORD, [(729, (3, 7)), (1457, (7, 11)), (2185, (11, 13))]),
                           (dataclasses.replace(CPU, yarn=True), cpu_changes)):
        spy, window, seen = RescaleSpy(), train_gpt.window_at(0, args), []
        for step in range(args.num_iterations + 1):
            before = len(spy.calls)
            window = train_gpt.move_window(spy, window, step, args)
            assert window == train_gpt.window_at(step, args)
            seen += [(step, call) for call in spy.calls[before:]]
        assert seen == expected


def test_move_window_without_yarn_changes_windows_and_never_rescales():
    """yarn=false: the windows move at the same steps, and the rotary keeps its frequencies (a fresh model's)."""
    assert not CPU.yarn  # the cpu preset's choice (records/track_cpu/README.md)
    args = CPU
    spy, window, model = RescaleSpy(), train_gpt.window_at(0, args), train_gpt.build_model(args, 1024)
    freqs = model.rotary.freqs.clone()
    for step in range(args.num_iterations + 1):
        window = train_gpt.move_window(spy, window, step, args)
        assert window == train_gpt.window_at(step, args)
    assert spy.calls == [] and window == args.final_window
    assert train_gpt.replay_windows(model, args.num_iterations, args) == args.final_window
    assert torch.equal(model.rotary.freqs, freqs)


def hand_neuron_normalization(update, second_moment, beta2):
    """NorMuon's step as the records from 2025-10-27 compute it, in plain Python over the matrices of an update
    (rows, cols) or a stack (k, rows, cols), which the record stores as one (rows, k cols) matrix: per column of
    each matrix when that storage is wide, else per row: the EMA of the mean square (second_moment: k lists), division
    by its root (floored at NORMUON_EPS), rescaling to the matrix's own Frobenius norm."""
    *stack, rows, cols = update.shape
    per_row = rows >= math.prod(stack) * cols
    outputs, moments = [], []
    for matrix, moment in zip(update.reshape(-1, rows, cols).tolist(), second_moment):
        lines = matrix if per_row else [list(column) for column in zip(*matrix)]
        mean_square = [sum(v * v for v in line) / len(line) for line in lines]
        moment = [beta2 * s + (1 - beta2) * m for s, m in zip(moment, mean_square)]
        divisor = [math.sqrt(max(s, train_gpt.NORMUON_EPS)) for s in moment]
        divided = [[matrix[r][c] / divisor[r if per_row else c] for c in range(cols)] for r in range(rows)]
        norm = lambda m: math.sqrt(sum(v * v for row in m for v in row))
        scale = norm(matrix) / max(norm(divided), train_gpt.NORMUON_EPS)
        outputs += [v * scale for row in divided for v in row]
        moments.append(moment)
    return outputs, moments


@pytest.mark.parametrize("shape", [(3, 2), (2, 3), (2, 2), (4, 2, 2)])
def test_normuon_normalizes_per_neuron_as_computed_by_hand(shape):
    """Two steps on a tall (per row), a wide (per column), a square (per row) matrix and a q, k, v, o stack (per
    column of each matrix: the record's (2, 8) storage is wide), in float32 against the same float32 updates by hand
    in float64. The statistics of the 10-24 record, per column of the storage (pooling entries of different matrices),
    fall outside the bound on the stack."""
    muon = train_gpt.Muon([torch.nn.Parameter(torch.zeros(shape))], lr=0.1, momentum=0.9, neuron_beta2=0.95)
    p = muon.param_groups[0]["params"][0]
    *stack, rows, cols = shape
    per_row = rows >= math.prod(stack) * cols
    neuron_size = cols if per_row else rows
    second_moment = [[0.0] * (rows if per_row else cols) for _ in range(math.prod(stack))]
    for step, seed in enumerate((1, 2)):
        update = torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * (1 + step)
        expected, second_moment = hand_neuron_normalization(update, second_moment, 0.95)
        got = muon._normalize_neurons(p, update.clone())
        # relative roundings, of positive terms only: the mean square n + 2 (n squares and sums, the mean's division
        # or reciprocal and product), then 4 per lerp (its weight, difference, product and sum)
        moment_roundings = neuron_size + 2 + 4 * (step + 1)
        # the output: the moment's, halved by the sqrt, twice (in the entry and in its norm), the two norms' N / 2 + 1
        # each, and 8 more (the sqrt, reciprocal and product, twice; the norms' quotient and its product)
        output_roundings = rows * cols + moment_roundings + 10
        expected = torch.tensor(expected, dtype=torch.float64).view(shape)
        assert_within(got, expected, gamma(output_roundings) * expected.abs(), "normalized update",
                      gamma(output_roundings))
        expected_moment = torch.tensor(second_moment, dtype=torch.float64)
        stored = muon.state[p]["neuron_second_moment"]
        assert stored.dtype == p.dtype
        assert_within(stored.reshape(expected_moment.shape), expected_moment,
                      gamma(moment_roundings) * expected_moment, "second moment", gamma(moment_roundings))
    if stack:
        pooled, _ = hand_neuron_normalization(update.reshape(rows, -1), [[0.0] * (math.prod(stack) * cols)], 0.95)
        with pytest.raises(AssertionError, match="times the derived bound"):
            fresh = train_gpt.Muon([torch.nn.Parameter(torch.zeros(shape))], lr=0.1, momentum=0.9, neuron_beta2=0.95)
            got = fresh._normalize_neurons(fresh.param_groups[0]["params"][0], update.clone())
            pooled = torch.tensor(pooled, dtype=torch.float64).view(shape)
            assert_within(got, pooled, gamma(output_roundings) * pooled.abs(), "pooled statistics")


def test_normuon_keeps_its_statistics_in_the_parameter_s_dtype():
    """The record's second moment is made like the gradient: bfloat16 for a bf16 gate, float32 for a float32 matrix."""
    params = [torch.nn.Parameter(torch.zeros(6, 12, dtype=torch.bfloat16)), torch.nn.Parameter(torch.zeros(4, 8, 8))]
    muon = train_gpt.Muon(params, lr=0.1, momentum=0.9, neuron_beta2=0.95)
    for p in params:
        p.grad = torch.randn(p.shape).to(p.dtype)
    muon.step()
    assert [tuple(muon.state[p]["neuron_second_moment"].shape) for p in params] == [(1, 12), (4, 1, 8)]
    assert [muon.state[p]["neuron_second_moment"].dtype for p in params] == [torch.bfloat16, torch.float32]


def first_muon_update(grad, momentum, method="newton_schulz"):
    """Muon's first step direction, independently: momentum buffer (1 - m) g, Nesterov g.lerp(buf, m)."""
    return train_gpt.orthogonalize(grad.lerp((1 - momentum) * grad, momentum), method, torch.float32)


def test_muon_with_normuon_applies_the_normalized_update():
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(8, 4))
    grad = torch.randn(8, 4)
    start = p.detach().clone()
    muon = train_gpt.Muon([p], lr=0.1, momentum=0.9, dtype=torch.float32, neuron_beta2=0.95)
    p.grad = grad
    muon.step()
    fresh = train_gpt.Muon([torch.nn.Parameter(torch.zeros(8, 4))], lr=0.1, momentum=0.9, neuron_beta2=0.95)
    direction = fresh._normalize_neurons(fresh.param_groups[0]["params"][0], first_muon_update(grad, 0.9))
    assert_stepped(p.detach(), start, direction, 0.1 * torch.tensor(max(1.0, 8 / 4) ** 0.5))


def test_cautious_weight_decay_decays_only_where_the_update_agrees():
    """The records' cautious weight decay, coupled to the lr (from 2025-11-10): where the update and the weight share a
    sign (or either is 0) the update gains lr * wd * weight, and p <- p - lr * update; elsewhere the plain step. In
    float64 by hand, within float32's bound: lr * wd, its product with the weight, the sum, the product by lr and the
    subtraction each round within u: |error| <= u (lr (3 |update'| + 2 lr wd |p|) + |expected|)."""
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(6, 6))
    grad = torch.randn(6, 6)
    start = p.detach().double()
    lr, weight_decay = 0.05, 0.5
    muon = train_gpt.Muon([p], lr=lr, momentum=0.9, dtype=torch.float32, weight_decay=weight_decay)
    p.grad = grad
    muon.step()
    update = first_muon_update(grad, 0.9).double()
    agree = update * start >= 0
    assert 0 < agree.sum() < agree.numel()  # both kinds of entry occur
    decayed = update + lr * weight_decay * agree * start
    expected = start - lr * decayed
    u = UNIT_ROUNDOFF[torch.float32]
    bound = u * (lr * (3 * decayed.abs() + 2 * lr * weight_decay * start.abs()) + expected.abs())
    assert_within(p.detach(), expected, bound, "cautious weight decay", 3 * u)
    for wrong, name in ((start - lr * update, "the step without the decay"),
                        (start - lr * (update + lr * weight_decay * start), "decay everywhere"),
                        (start * (1 - lr * weight_decay * agree) - lr * update, "decay decoupled from the lr")):
        with pytest.raises(AssertionError, match="times the derived bound"):
            assert_within(p.detach(), wrong, bound, name, 3 * u)


def test_muon_lr_mul_scales_one_matrix_s_step():
    """lr_mul (the record's 2 on each MLP's up-projection): from zero, without momentum or decay, a matrix's step is
    -(lr * mul) * orth(g) with lr * mul in float32 (one rounding of the product: equal), the others' -lr * orth(g)."""
    torch.manual_seed(3)
    fast, plain = torch.nn.Parameter(torch.zeros(16, 64)), torch.nn.Parameter(torch.zeros(16, 64))
    fast.grad, plain.grad = torch.randn(16, 64), torch.randn(16, 64)
    lr = 0.03
    train_gpt.Muon([fast, plain], lr=lr, momentum=0.0, nesterov=False, lr_mul={fast: 2.0}).step()
    assert torch.equal(fast.detach(), train_gpt.orthogonalize(fast.grad).float() * -(lr * torch.tensor(2.0)))
    assert torch.equal(plain.detach(), train_gpt.orthogonalize(plain.grad).float() * -(lr * torch.tensor(1.0)))


def test_the_record_s_muon_gets_the_up_projections_lr_mul_and_the_weight_decay():
    """build_optimizers hands Muon mlp_up_lr_mul for every c_fc (nothing else) and muon_cautious_wd, which the
    training step leaves alone (the decay follows the lr through the lr alone)."""
    args = dataclasses.replace(RECORD, model_dim=64, num_heads=1, head_dim=64, seq_len=128, val_seq_len=128,
                               batch_slots=1, dtype="float32", num_iterations=4, extension_steps=1, compile=False)
    trainer = train_gpt.Trainer(args, 0, 1, train_gpt.plan_device(args, torch.device("cpu")))
    up = {block.mlp.c_fc for block in trainer.model.blocks if block.mlp is not None}
    assert len(up) == args.num_layers - 1 and trainer.muon.lr_mul == dict.fromkeys(up, 2.0)
    tokens = torch.randint(0, 50257, (129,))
    for step in range(4):
        trainer.train_step(step, [(tokens[:-1].int(), tokens[1:])])
        assert trainer.muon.param_groups[0]["weight_decay"] == args.muon_cautious_wd == 1.2


def adam_by_hand(start, grads, lrs, betas, eps, dtype):
    """The record's Adam from start in float64: m, v EMAs of g and g^2 from zero; at step t,
    p -= lr_t * sqrt(1 - beta2^t) / (1 - beta1^t) * m / (sqrt(v) + eps). Returns it, a first-order bound on how far
    train_gpt.Adam's run (states and parameters in dtype; the step size in double precision as the record's Python
    floats, then rounded once to a float32 scalar) lies from it, and the largest relative error in that bound."""
    beta1, beta2 = betas
    # the reference's own float64 roundings, as many again; the step size's are float64 on both sides
    u, u_step = UNIT_ROUNDOFF[dtype] + UNIT_ROUNDOFF[torch.float64], 2 * UNIT_ROUNDOFF[torch.float64]
    p, m, v, magnitude, bound, relative = start.double(), 0.0, 0.0, 0.0, 0.0, 0.0
    for t, (grad, lr) in enumerate(zip(grads, lrs), start=1):
        g = grad.double()
        m, v = beta1 * m + (1 - beta1) * g, beta2 * v + (1 - beta2) * g * g
        magnitude = beta1 * magnitude + (1 - beta1) * g.abs()  # bounds |m| and the terms it sums
        step_size = lr * math.sqrt(1 - beta2**t) / (1 - beta1**t)
        p = p - step_size * m / (v.sqrt() + eps)
        # 1 - beta^t: beta rounded, then to the power t (within EXP_ULPS ulps), errors scaled by beta^t / (1 - beta^t)
        # in the difference, which rounds too; halved by the sqrt; then the quotient and the product by lr, all in
        # float64; then the one rounding to the float32 scalar
        power_error = lambda beta: ((t + 2 * EXP_ULPS) * beta**t / (1 - beta**t) + 1) * u_step
        step_size_error = power_error(beta2) / 2 + power_error(beta1) + 4 * u_step + UNIT_ROUNDOFF[torch.float32]
        # m: 3 roundings a step of terms within magnitude; v: 3 a step and 1 more, halved by the sqrt, which rounds;
        # then eps (rounded, a sum), the quotient (or a reciprocal and a product) and the product by the step size
        move_error = step_size_error + (4.5 * t + 6.5) * u
        bound = bound + move_error * step_size * magnitude / (v.sqrt() + eps) + u * p.abs()
        relative = max(relative, move_error)
    return p, bound, relative


def test_adam_is_the_records_formula_computed_by_hand():
    """Four steps of two groups (float64 parameters) against adam_by_hand. eps is large here, so that where it is
    added shows: torch's Adam, which adds it to sqrt(v / (1 - beta2^t)), falls outside the bound."""
    g = torch.Generator().manual_seed(0)
    params = [torch.randn(5, 3, generator=g, dtype=torch.float64), torch.randn(7, generator=g, dtype=torch.float64)]
    grads = [[torch.randn(p.shape, generator=g, dtype=torch.float64) * 10**-k for k in range(4)] for p in params]
    lrs, betas, eps = (0.1, 0.02), (0.8, 0.95), 1e-2
    ours = [p.clone().requires_grad_() for p in params]
    adam = train_gpt.Adam([dict(params=[ours[0]], lr=lrs[0]), dict(params=[ours[1]], lr=lrs[1])], betas=betas, eps=eps)
    torchs = [p.clone().requires_grad_() for p in params]
    reference = torch.optim.Adam([dict(params=[torchs[0]], lr=lrs[0]), dict(params=[torchs[1]], lr=lrs[1])], betas=betas, eps=eps)
    for step in range(4):
        for optimizer, copies in ((adam, ours), (reference, torchs)):
            for p, gs in zip(copies, grads):
                p.grad = gs[step].clone()
            optimizer.step()
    for p, torch_p, p0, gs, lr in zip(ours, torchs, params, grads, lrs):
        expected, bound, relative = adam_by_hand(p0, gs, [lr] * len(gs), betas, eps, torch.float64)
        assert_within(p.detach(), expected, bound, "Adam", relative)
        with pytest.raises(AssertionError, match="times the derived bound"):
            assert_within(torch_p.detach(), expected, bound, "torch's Adam", relative)
        assert adam.state[p]["step"] == 4 and type(adam.state[p]["step"]) is int and adam.state[p]["exp_avg"].dtype == p.dtype


def test_adam_keeps_its_moments_in_the_run_dtype_when_asked():
    """adam_state_in_run_dtype (the records from 2025-09-11): bf16 moments for a float32 and a bf16 parameter. Step 1
    by hand in float64: m = (1 - b1) g, v = (1 - b2) g^2, the move lr sqrt(1 - b2) / (1 - b1) m / (sqrt(v) + eps).
    Each of the move's bf16 roundings (m, v, the sqrt, the eps sum, the quotient, the product by the step size) is
    within e = bf16's u plus float32's 3u of the value it rounds, the sqrt halving v's: the move lies within
    (1 + e)^4 / (1 - e)^3 - 1 of its own magnitude, and the parameter's subtraction rounds in its dtype."""
    g = torch.Generator().manual_seed(0)
    params = [torch.randn(64, generator=g), torch.randn(64, generator=g).bfloat16()]
    grads = [torch.randn(64, generator=g).to(p.dtype) for p in params]
    lr, (beta1, beta2), eps = 0.05, (0.65, 0.95), 1e-8
    moved = {}
    for state_dtype in (torch.bfloat16, None):
        copies = [p.clone().requires_grad_() for p in params]
        adam = train_gpt.Adam([dict(params=copies, lr=lr)], betas=(beta1, beta2), eps=eps, state_dtype=state_dtype)
        for p, grad in zip(copies, grads):
            p.grad = grad.clone()
        adam.step()
        moved[state_dtype] = [p.detach() for p in copies]
        assert all(adam.state[p]["exp_avg"].dtype == (state_dtype or p.dtype) for p in copies)
    e = UNIT_ROUNDOFF[torch.bfloat16] + 3 * UNIT_ROUNDOFF[torch.float32]
    for p0, grad, got in zip(params, grads, moved[torch.bfloat16]):
        gd = grad.double()
        move = lr * math.sqrt(1 - beta2) / (1 - beta1) * ((1 - beta1) * gd) / (((1 - beta2) * gd * gd).sqrt() + eps)
        expected = p0.double() - move
        bound = ((1 + e) ** 4 / (1 - e) ** 3 - 1) * move.abs() + UNIT_ROUNDOFF[p0.dtype] * expected.abs() * 1.01
        assert_within(got, expected, bound, f"Adam with bf16 moments, {p0.dtype} parameter")
    assert not torch.equal(moved[torch.bfloat16][0], moved[None][0])  # float32 moments round less


def test_compiled_adam_compiles_once_whatever_the_lr():
    """The device plan compiles Adam's update on CUDA: twelve steps at twelve lrs (a cooldown) run the
    graph compiled at the first, and move the parameters as the eager update does: both within float32's
    bound of the update by hand."""
    g = torch.Generator().manual_seed(0)
    params = [torch.randn(64, 8, generator=g), torch.randn(5, generator=g)]
    grads = [[torch.randn(p.shape, generator=g) for p in params] for _ in range(12)]
    initial_lrs, betas, eps = (0.1, 0.02), (0.8, 0.95), 1e-10
    results = []
    for compiled in (False, True):
        copies = [p.clone().requires_grad_() for p in params]
        adam = train_gpt.Adam([dict(params=copies[:1], lr=initial_lrs[0]), dict(params=copies[1:], lr=initial_lrs[1])],
                              betas=betas, eps=eps, compiled=compiled)
        for step, step_grads in enumerate(grads):
            for group in adam.param_groups:
                group["lr"] = group.setdefault("initial_lr", group["lr"]) * (1 - step / 12)
            for p, grad in zip(copies, step_grads):
                p.grad = grad.clone()
            with torch.compiler.set_stance("fail_on_recompile" if compiled and step >= 1 else "default"):
                adam.step()
        results.append([p.detach() for p in copies])
    for i, (start, initial_lr, eager, compiled) in enumerate(zip(params, initial_lrs, *results)):
        lrs = [initial_lr * (1 - step / 12) for step in range(12)]
        expected, bound, relative = adam_by_hand(start, [step_grads[i] for step_grads in grads], lrs, betas, eps,
                                                 torch.float32)
        assert_within(eager, expected, bound, "eager Adam", relative)
        assert_within(compiled, expected, bound, "compiled Adam", relative)
        # a slightly larger lr moves the parameters proportionally further, more than rounding can: outside the bound
        with pytest.raises(AssertionError, match="times the derived bound"):
            assert_within(start + (eager - start) * (1 + 1e-3), expected, bound, "lr 0.1% larger", relative)
