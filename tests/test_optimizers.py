"""Orthogonalization, Muon, and the learning-rate / momentum / window / attention-scale schedules."""

import dataclasses
import itertools
import math
import sys
from fractions import Fraction
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


def orthogonalization_stats(shape):
    """Over three seeds: (smallest singular value, largest, largest |s - 1|, smallest cosine with U V^T)."""
    lo, hi, dev, cos = [], [], [], []
    for seed in range(3):
        G = random_matrices(shape, seed)
        O = train_gpt.orthogonalize(G)
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
    """Polar Express maps every singular value into a band around 1 and points along U V^T. Measured over all
    shapes: s in [0.85, 1.15], |s-1| <= 0.15, cosine >= 0.994; asserted with a margin for bf16's rounding."""
    lo, hi, dev, cosine = orthogonalization_stats(shape)
    assert 0.7 < lo and hi < 1.25 and dev < 0.25 and cosine > 0.98


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


def orthogonalization_error(G, dtype):
    """A bound on the Frobenius norm of orthogonalize(G, dtype) minus the same iteration in exact arithmetic,
    per matrix, shaped to broadcast over its entries (the float64 iterates stand in for the exact ones' magnitudes).
    Each step X <- p(X) adds its own rounding to the error it inherits times p's Lipschitz constant."""
    X = G.double()
    if X.size(-2) > X.size(-1):
        X = X.mT
    norm = X.norm(dim=(-2, -1), keepdim=True)
    X = X / (norm * (1 + train_gpt.POLAR_EXPRESS_SAFETY) + 1e-6)
    # X's Frobenius norm is below 1 and each entry's relative error within gamma: the norm's mn roundings and its
    # square root, the safety factor (rounded, then a product), eps (rounded, then a sum) and the division
    error = torch.full(X.shape[:-2], gamma(X.size(-2) * X.size(-1) + 6, dtype), dtype=torch.float64)
    for a, b, c in train_gpt.POLAR_EXPRESS_COEFFS:
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
    bound = 2 * orthogonalization_error(G, torch.float64)
    for i in range(3):
        alone = train_gpt.orthogonalize(G[i].double(), dtype=torch.float64)
        assert_within(batched[i], alone, bound[i], f"matrix {i} of the batch")
    others = G.clone()
    others[1] = 10 * random_matrices((64, 128), 1)
    # the same shapes run the same kernels: each matrix's result depends on its own bits only
    assert torch.equal(train_gpt.orthogonalize(others)[[0, 2]], train_gpt.orthogonalize(G)[[0, 2]])


def test_orthogonalize_in_float32_follows_the_float64_iteration():
    """dtype=float32 (a float32 run's Muon) computes the iteration within the bound float32's rounding implies of the
    float64 result, and the result keeps the dtype it was computed in. Small matrices: the bound grows with size."""
    G = random_matrices((2, 3, 6), 0)
    exact = train_gpt.orthogonalize(G.double(), torch.float64)
    fp32 = train_gpt.orthogonalize(G, torch.float32)
    assert fp32.dtype == torch.float32 and train_gpt.orthogonalize(G).dtype == torch.bfloat16
    # each of the two within its own bound of the iteration in exact arithmetic
    bound = orthogonalization_error(G, torch.float32) + orthogonalization_error(G, torch.float64)
    assert_within(fp32, exact, bound, "in float32")


@pytest.mark.parametrize("shape", [(96, 48), (3, 32, 64), (2, 2, 16, 24)], ids=str)
def test_each_line_of_the_iteration_rounds_once_as_the_records_kernels_do(shape):
    """The record stores each line of the iteration once in bf16 after float32 accumulation: A = X X^T,
    B = b A + c A A^T, X' = a X + B X; for a tall X (the first shape), A = X^T X and X' = a X + X B (the records from
    2026-02-16). orthogonalize() computes three such lines an iteration, each one rounding
    of its value computed in float32 from the line's recorded bf16 inputs: two roundings to bf16 of values within
    delta of each other lie within delta plus a bf16 rounding of each. Rounding after each operation (the form
    before) computes seven values an iteration, and B's large terms b A and c A A, which nearly cancel, each round."""
    G = random_matrices(shape, 0)
    with TorchCalls() as run:
        train_gpt.orthogonalize(G)
    X = [result for name, result, _ in run.calls if name in ("contiguous", "reshape")][-1]  # the stack iterated on
    lines = [result for name, result, _ in run.calls if name in ("matmul", "baddbmm")]
    coeffs = train_gpt.POLAR_EXPRESS_COEFFS
    assert len(lines) == 3 * len(coeffs) and all(t.dtype == torch.bfloat16 for t in [X, *lines])
    u, size, tall = UNIT_ROUNDOFF[torch.bfloat16], max(X.shape[-2:]), X.size(-2) > X.size(-1)
    assert tall == (shape == (96, 48))
    gram_of = lambda m: m.mT @ m if tall else m @ m.mT
    times = lambda p, m: m @ p if tall else p @ m  # B X, or X B for a tall X
    for (a, b, c), (A, B, X_next) in zip(coeffs, zip(*[iter(lines)] * 3)):
        x, gram, poly = X.double(), A.double(), B.double()
        assert gram.shape[-1] == min(X.shape[-2:])
        # each line's exact value from its bf16 inputs, and the float32 error of a computation of it (matmul
        # accumulation, the two coefficient products and the sum), which both computations are within
        for got, exact, magnitude in ((A, gram_of(x), gram_of(x.abs())),
                                      (B, b * gram + c * gram @ gram.mT, abs(b) * gram.abs() + abs(c) * gram.abs() @ gram.abs()),
                                      (X_next, a * x + times(poly, x), abs(a) * x.abs() + times(poly.abs(), x.abs()))):
            delta = 2 * worst_case_gamma(size + 3) * magnitude
            reference = exact.float().bfloat16().double()
            bound = u / (1 - u) * (got.double().abs() + reference.abs()) + delta
            assert_within(got, reference, bound, f"line of shape {tuple(got.shape)}")
        X = X_next


def test_compiled_orthogonalize_computes_the_iteration():
    """The device plan compiles Muon's orthogonalization on CUDA. torch.compile's capture and AOT autograd's graph
    (backends eager, aot_eager) run eager's kernels: the bf16 result to the bit. Inductor's kernels round apart: in
    float32 (bf16 has no meaningful bound), within the derived bound of the float64 iteration, as the test above."""
    G = random_matrices((2, 3, 6), 0)
    eager = train_gpt.orthogonalize(G)
    for backend in ("eager", "aot_eager"):
        torch._dynamo.reset()
        assert torch.equal(torch.compile(train_gpt.orthogonalize, backend=backend, dynamic=False)(G), eager)
    torch._dynamo.reset()
    compiled = torch.compile(train_gpt.orthogonalize, dynamic=False)(G, torch.float32)
    exact = train_gpt.orthogonalize(G.double(), torch.float64)
    bound = orthogonalization_error(G, torch.float32) + orthogonalization_error(G, torch.float64)
    assert_within(compiled, exact, bound, "compiled, in float32")


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
    """got == start - update * lr, the records' cautious update without decay (p - p mask 0 lr is p): the product in the
    update's dtype (a bf16 update times a float32 0-dim lr is bf16), then one float32 subtraction."""
    assert lr.dtype == torch.float32 and lr.dim() == 0
    assert not torch.equal(got, start)
    assert torch.equal(got, start - update * lr)


@pytest.mark.parametrize("nesterov", [True, False])
def test_muon_matches_the_documented_update(nesterov):
    """World size 1, three steps, a group of shape-identical params: by hand, buf <- lerp(buf, g, 1 - m), 1 - m made
    in float32 from m's float32 value (the record's momentum tensor, from 2026-02-16: not float32(1 - m), which moves
    the result); u = lerp(g, buf, m) with Nesterov, else buf; p <- p - orth(u) * lr', with lr' =
    sqrt(max(1, rows/cols)) * lr in float32 (the records' factor tensor, times the lr), the product in bf16 as orth(u)
    is."""
    torch.manual_seed(1)
    lr, momentum = 0.03, 0.9
    params = [torch.nn.Parameter(torch.randn(64, 32)) for _ in range(3)]
    bufs = [torch.zeros_like(p) for p in params]
    optimizer = train_gpt.Muon(params, lr=lr, momentum=momentum, nesterov=nesterov)
    weight = 1 - torch.tensor(momentum, dtype=torch.float32)
    assert weight.item() != train_gpt.float32(1 - momentum)  # the control: the two weights differ at this m
    for _ in range(3):
        grads = [torch.randn(64, 32) for _ in params]
        starts = [p.detach().clone() for p in params]
        for p, g in zip(params, grads):
            p.grad = g.clone()
        optimizer.step()
        for i, g in enumerate(grads):
            bufs[i] = torch.lerp(bufs[i], g, weight)
            u = torch.lerp(g, bufs[i], momentum) if nesterov else bufs[i]
            assert_stepped(params[i].detach(), starts[i], train_gpt.orthogonalize(u), torch.tensor(2**0.5) * lr)


@pytest.mark.parametrize("shape, scale", [((64, 16), 2.0), ((16, 64), 1.0), ((3, 64, 16), 2.0), ((3, 16, 64), 1.0),
                                          ((4, 32, 32), 1.0)])
def test_muon_update_scale(shape, scale):
    """Without momentum the update is orth(g) * (sqrt(max(1, rows/cols)) lr), rows and cols those of each matrix of a
    stack: the attention's (4, d, d) takes 1 (the records from 2026-01-18, which lay out q, k, v and o apart; 2 before,
    from one (4d, d) matrix)."""
    torch.manual_seed(2)
    lr = 0.01
    p = torch.nn.Parameter(torch.zeros(shape))
    p.grad = torch.randn(shape)
    train_gpt.Muon([p], lr=lr, momentum=0.0, nesterov=False).step()
    # from zero: 0 - 0 - orth(g) lr' is the negated bf16 product
    assert torch.equal(p.detach(), -(train_gpt.orthogonalize(p.grad) * (torch.tensor(scale) * lr)).float())


@pytest.mark.parametrize("shape", [(48, 16), (16, 48), (3, 32, 24), (20, 20)])
def test_orthogonalization_flops_match_torchs_flop_counter(shape):
    """The FLOP formula that deals Muon's work equals what torch's own counter sees in orthogonalize()."""
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        train_gpt.orthogonalize(torch.randn(shape))
    assert counter.get_total_flops() == train_gpt.orthogonalization_flops(shape)


def test_deal_by_cost_balances_and_deals_everything_once():
    costs = [7, 3, 3, 9, 1, 5, 5, 2]
    dealt = train_gpt.deal_by_cost(costs, 3)
    assert sorted(i for mine in dealt for i in mine) == list(range(len(costs)))
    assert [sum(costs[i] for i in mine) for mine in dealt] == [12, 12, 11]  # the best split of 35 into 3
    assert all([costs[i] for i in mine] == sorted((costs[i] for i in mine), reverse=True) for mine in dealt)
    assert train_gpt.deal_by_cost(costs, 1) == [sorted(range(len(costs)), key=lambda i: -costs[i])]
    assert train_gpt.deal_by_cost([4], 3) == [[0], [], []]


# HEAD's TrainingManager.param_table (f411b3d3), its Adam entries: (lr_mul, wd_mul, betas) on its Adam lr 0.008, its
# weight decay 0.005; unnamed multipliers 1.
HEADS_ADAM_LR, HEADS_ADAM_WD = 0.008, 0.005
HEADS_ADAM_TABLE = dict(
    scalars=(5.0, 0.0, (0.9, 0.99)), smear_gate=(0.01, 0.0, (0.9, 0.99)), ve_gate_bank=(1.0, 1.0, (0.9, 0.99)),
    lm_head=(1.0, 150.0, (0.5, 0.95)), bigram_embed=(75.0, 5.0, (0.75, 0.95)), post_lambdas=(1.0, 0.0, (0.9, 0.95)),
    resid_lambdas=(5.0, 0.0, (0.9, 0.95)), value_embeds=(75.0, 5.0, (0.75, 0.95)), embed=(1.0, 150.0, (0.5, 0.95)),
    mudd_w1=(0.25, 1.0, (0.9, 0.99)), mudd_w2=(0.25, 1.0, (0.9, 0.99)), mudd_b2=(0.25, 0.0, (0.9, 0.99)),
    mudd_gate_w1=(0.1, 1.0, (0.9, 0.99)), mudd_gate_w2=(0.1, 1.0, (0.9, 0.99)), mudd_gate_b2=(0.1, 0.0, (0.9, 0.99)),
    _mudd_gate_scale=(0.1, 0.0, (0.9, 0.99)))


def heads_names(model: train_gpt.GPT) -> dict:
    """Each of our parameters' id by its HEAD name (its banks: every layer's matrices, its value-embedding gates)."""
    attention = [block.attn for block in model.blocks if block.attn is not None]
    named = dict(scalars=[model.scalars], smear_gate=[model.smear_gate.weight], lm_head=[model.lm_head.weight],
                 ve_gate_bank=[attn.ve_gate.weight for attn in attention if attn.ve_gate is not None],
                 bigram_embed=[model.bigram_embed.weight], post_lambdas=[model.post_lambdas],
                 resid_lambdas=[model.resid_lambdas], value_embeds=[model.value_embeds], embed=[model.embed.weight],
                 qk_bank=[attn.qk_w for attn in attention], vo_bank=[attn.vo_w for attn in attention],
                 mlp_bank=[p for block in model.blocks for p in (block.mlp.c_fc, block.mlp.c_proj)],
                 _mudd_gate_scale=[model.gates.scale])
    for ours, heads in ((model.mudd, "mudd"), (model.gates, "mudd_gate")):
        named.update({f"{heads}_{name}": [getattr(ours, name)] for name in ("w1", "w2", "b2")})
    return {id(p): name for name, params in named.items() for p in params}


def test_adam_groups_are_heads_param_table():
    """build_optimizers on the record's model (meta device): every parameter in exactly one group, Muon's the banks'
    matrices; each Adam parameter's group gives its entry of HEAD's param_table (HEADS_ADAM_TABLE): initial_lr x lr_mul
    = 0.008 x HEAD's lr_mul (in double, as HEAD's Python floats: equal), its wd_mul and betas, the decay 0.005, eps
    1e-10. (HEAD's fifth value-embedding gate, on the last layer, is unused there; here the dense connections gate that
    layer's value embedding and there is no such gate.)"""
    args = train_gpt.Hyperparameters()
    with torch.device("meta"):
        model = train_gpt.build_model(args, 1024)
        adam, muon = train_gpt.build_optimizers(model, args)
    name_of = heads_names(model)
    assert sorted(name_of) == sorted(map(id, model.parameters()))
    adams = [(id(p), group) for group in adam.param_groups for p in group["params"]]
    muons = [id(p) for group in muon.param_groups for p in group["params"]]
    assert sorted([p for p, _ in adams] + muons) == sorted(name_of)  # each once
    assert {name_of[p] for p in muons} == {"qk_bank", "vo_bank", "mlp_bank"}
    assert {name_of[p] for p, _ in adams} == set(HEADS_ADAM_TABLE)
    for p, group in adams:
        lr_mul, wd_mul, betas = HEADS_ADAM_TABLE[name_of[p]]
        assert group["initial_lr"] * group["lr_mul"] == HEADS_ADAM_LR * lr_mul, name_of[p]
        assert (group["wd_mul"], tuple(group["betas"]), group["weight_decay"], group["eps"]) == (
            wd_mul, betas, HEADS_ADAM_WD, 1e-10), name_of[p]


def test_adam_steps_with_heads_scheduled_lr():
    """Every Adam step of the record's run (the odd steps), each group's lr set as the Trainer sets it (initial_lr times
    lr_multiplier) and stepped: the float32 step size and decay the update takes equal HEAD's, whose lr is
    (0.008 x the schedule) x lr_mul: lr sqrt(1 - beta2^t) / (1 - beta1^t) and lr^2 0.005 wd_mul, each made in double and
    rounded once. (Our groups fold some of HEAD's lr_mul into their initial lr: the double lrs may differ in their last
    bit, the float32 values the update takes do not, over this run.)"""
    args = train_gpt.Hyperparameters()
    with torch.device("meta"):
        model = train_gpt.build_model(args, 1024)
        groups = train_gpt.build_optimizers(model, args)[0].param_groups
    name_of = heads_names(model)
    stand_ins = [torch.zeros(1, requires_grad=True) for _ in groups]
    adam = train_gpt.Adam([{**{k: v for k, v in group.items() if k != "params"}, "params": [p]}
                           for group, p in zip(groups, stand_ins)], eps=args.adam_eps, weight_decay=train_gpt.ADAM_CAUTIOUS_WD)
    taken = []
    adam.update = lambda p, grad, m, v, step_size, decay, *rest: taken.append((step_size.clone(), decay.clone()))
    t = 0
    for step in range(args.num_iterations):
        if not train_gpt.adam_steps_at(step):
            continue
        t += 1
        for group, p in zip(adam.param_groups, stand_ins):
            group["lr"] = group["initial_lr"] * train_gpt.lr_multiplier(step, args)
            p.grad = torch.ones(1)
        taken.clear()
        adam.step()
        for group, (step_size, decay) in zip(groups, taken, strict=True):
            lr_mul, wd_mul, (beta1, beta2) = HEADS_ADAM_TABLE[name_of[id(group["params"][0])]]
            lr = HEADS_ADAM_LR * train_gpt.lr_multiplier(step, args) * lr_mul
            assert step_size == torch.tensor(lr * ((1 - beta2**t) ** 0.5 / (1 - beta1**t)), dtype=torch.float32), step
            assert decay == torch.tensor(lr * lr * HEADS_ADAM_WD * wd_mul, dtype=torch.float32), step
    assert t == args.num_iterations // 2


def record_muon(rank: int, world_size: int) -> train_gpt.Muon:
    """Muon over the record model's hidden matrices, built on the meta device (no memory, no init cost)."""
    args = train_gpt.Hyperparameters()
    with torch.device("meta"):
        return train_gpt.build_optimizers(train_gpt.build_model(args, 1024), args, rank, world_size)[1]


def test_record_muon_work_is_balanced_over_8_ranks():
    """Each of 8 ranks orthogonalizes its share of the record model's 42 parameters (10 stacks of q and k head pairs,
    10 of v and o, and 22 MLP matrices: 11 layers, 6 without attention; the gates are Adam's from 2025-12-31); per-rank
    FLOPs within 1.25x of each other (dealing by shape group, 11 qkv matrices over 8 ranks left 2 ranks idle)."""
    muons = [record_muon(rank, 8) for rank in range(8)]
    params = muons[0].param_groups[0]["params"]
    assert len(params) == 42
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
    matrices share a rank: one step equals p - orthogonalize(g) * (scale lr) for each, bit for bit."""
    torch.manual_seed(3)
    params = [torch.nn.Parameter(torch.randn(s)) for s in [(16, 8), (8, 24), (16, 8), (3, 8, 8)]]
    before = [p.detach().clone() for p in params]
    for p in params:
        p.grad = torch.randn_like(p)
    lr = 0.1
    train_gpt.Muon(params, lr=lr, momentum=0.0, nesterov=False, dtype=torch.float32).step()
    for p, p0, scale in zip(params, before, (2**0.5, 1.0, 2**0.5, 1.0)):  # each matrix's rows / cols: 2, 1/3, 2, 1
        expected = p0 - train_gpt.orthogonalize(p.grad, torch.float32) * (torch.tensor(scale) * lr)
        assert torch.equal(p.detach(), expected)


RECORD = train_gpt.Hyperparameters()
CPU = dataclasses.replace(RECORD, **train_gpt.PRESETS["cpu"])


# lr_multiplier rounds at most 5 times (t, 1 - t, the two products, their sum), each of a value below 2, and the hand's
# exact fraction once, converting it: within 6 units of 2 u.
LR_ROUNDING = 12 * UNIT_ROUNDOFF[torch.float64]


@pytest.mark.parametrize("args", [RECORD, CPU], ids=["record", "cpu"])
def test_lr_multiplier(args):
    """Over the S = N - extension scheduled steps: peak k of the P LR_STAGE_PEAKS from step round(k S / P), until
    int((1 - cooldown_frac) S), then on the line from that peak there to the floor 0.15 at S (exact fractions by
    hand); the floor from S on (the extension, and the final validation's step N)."""
    N, S, peaks, floor = args.num_iterations, args.num_iterations - args.extension_steps, train_gpt.LR_STAGE_PEAKS, train_gpt.LR_FLOOR
    assert floor == 0.15
    start = int(S * (1 - args.cooldown_frac))
    for step in range(N + 1):
        peak = peaks[max(k for k in range(len(peaks)) if step >= round(Fraction(k * S, len(peaks))))]
        expected = peak if step < start else floor + (Fraction(peak) - Fraction(floor)) * Fraction(S - min(step, S), S - start)
        assert train_gpt.lr_multiplier(step, args) == pytest.approx(float(expected), abs=LR_ROUNDING), step
    assert {train_gpt.lr_multiplier(step, args) for step in range(S, N + 1)} == {floor}
    assert all(train_gpt.lr_multiplier(step, args) == peaks[0] for step in range(min(start, round(S / len(peaks)))))


def test_lr_multiplier_record_values():
    """Spot values for the record (HEAD's 1270 scheduled steps of 1285, cooldown 0.6, peaks 1, 1.52, 1.73): 1.0 through
    step 422, 1.52 from 423 (round(1270 / 3)) through the cooldown's start at 508 (int(0.4 x 1270)), then on the line
    to 0.15 at 1270; 1.73 on the same line's form from 847 (round(2 x 1270 / 3)); 0.15 from 1270 through the 15
    extension steps."""
    assert (RECORD.num_iterations, RECORD.extension_steps, RECORD.cooldown_frac) == (1285, 15, 0.6)
    assert train_gpt.LR_STAGE_PEAKS == (1.0, 1.52, 1.73)
    assert {step: train_gpt.lr_multiplier(step, RECORD) for step in (0, 422, 423, 507, 508)} == {
        0: 1.0, 422: 1.0, 423: 1.52, 507: 1.52, 508: 1.52}
    for step, peak in ((509, 1.52), (846, 1.52), (847, 1.73), (1269, 1.73)):
        t = Fraction(step - 508, 1270 - 508)
        assert train_gpt.lr_multiplier(step, RECORD) == pytest.approx(float(peak * (1 - t) + Fraction(0.15) * t), abs=LR_ROUNDING)
    assert train_gpt.lr_multiplier(847, RECORD) > train_gpt.lr_multiplier(846, RECORD)  # the stage's jump
    for step in (1270, 1271, 1285):
        assert train_gpt.lr_multiplier(step, RECORD) == 0.15


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
    """3, 7, 11 over steps 0-422, 423-846 and 847-1269 (from round(k x 1270 / 3)); 13 for the 15 extension steps and
    the final validation at 1285."""
    assert (RECORD.window_stages, RECORD.final_window, RECORD.num_iterations) == ((3, 7, 11), 13, 1285)
    values = {0: 3, 422: 3, 423: 7, 846: 7, 847: 11, 1269: 11, 1270: 13, 1284: 13, 1285: 13}
    assert {step: train_gpt.window_at(step, RECORD) for step in values} == values
    # 5 stages over 254 scheduled steps (from round(k x 254 / 5): 51, 102, 152, 203), then 6 extension steps and the
    # validation at the final window
    cpu_steps = (0, 50, 51, 101, 102, 151, 152, 202, 203, 253, 254, 259, 260)
    assert [train_gpt.window_at(step, CPU) for step in cpu_steps] == [2, 2, 4, 4, 8, 8, 16, 16, 32, 32, 32, 32, 32]
    # 5 stages over 10 steps, no extension: two steps each, then final_window for the validation
    short = dataclasses.replace(RECORD, num_iterations=10, extension_steps=0, window_stages=(1, 2, 3, 4, 5), final_window=6)
    assert [train_gpt.window_at(step, short) for step in range(11)] == [1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6]


class RecordsTrainingSchedule:
    """The 2026-03-22 record's TrainingSchedule (HEAD's, less its prefix-token weights), written out in its form: stages of durations 1/3, 1/3, 1/3 and an
    extension; ends at round(c N) for the running sums c of the durations; each step's stage and the fraction t of it
    gone; lr the stage's lr_mul, from cd_start = int(N (1 - cooldown_frac)) lr (1 - t') + 0.15 t',
    t' = min(1, (step - cd_start) / (N - cd_start)); the multi-token weights a + (b - a) t from each stage's start
    list to its end list; each stage's train_max_seq_len; the split at the third stage's first step | 1."""

    STAGES = [  # (duration, batch tokens, windows (short, long), lr_mul, mtp start, mtp end, train_max_seq_len)
        (1 / 3, 8 * 2048 * 8, (1, 3), 1.0, [1.0, 0.5, 0.25], [1.0, 0.5, 0.0], 896),
        (1 / 3, 16 * 2048 * 8, (3, 7), 1.52, [1.0, 0.5], [1.0, 0.0], 2048),
        (1 / 3, 24 * 2048 * 8, (5, 11), 1.73, [1.0], [1.0], 2048),
        (None, 24 * 2048 * 8, (6, 13), 1.0, [1.0], [1.0], 2048),
    ]

    def __init__(self, scheduled, extension, cooldown_frac=0.60):
        self.scheduled, self.cooldown_frac = scheduled, cooldown_frac
        ends = [0] + [round(c * scheduled) for c in itertools.accumulate(s[0] for s in self.STAGES[:-1])]
        self.boundaries = list(itertools.pairwise(ends + [scheduled + extension]))
        self.split_step = self.boundaries[2][0] | 1

    def lookup(self, step):
        for i, (start, end) in enumerate(self.boundaries):
            if step < end:
                return self.STAGES[i], (step - start) / (end - start)
        return self.STAGES[-1], 1.0

    def lr(self, step):
        stage, _ = self.lookup(step)
        lr = stage[3]
        cd_start = int(self.scheduled * (1 - self.cooldown_frac))
        if step >= cd_start:
            t = min(1.0, (step - cd_start) / (self.scheduled - cd_start))
            lr = lr * (1 - t) + 0.15 * t
        return lr

    def mtp(self, step):
        stage, t = self.lookup(step)
        return tuple(a + (b - a) * t for a, b in zip(stage[4], stage[5]))


def test_the_records_schedules_at_every_step():
    """1270 scheduled steps and 15 more (1285: HEAD's, whose stages are the 2026-03-22 record's), at every step against
    the record's TrainingSchedule written out (RecordsTrainingSchedule): lr, multi-token weights, the long window, the
    batch and the documents' clip of the stage in effect (the extension's after 1270), Muon's momentum (down over the
    last 50 steps), and the untie after its split step 847 (the same float operations: equal). Other lengths too, and
    the shapes the warm-up compiles."""
    args = RECORD
    assert (args.num_iterations, args.extension_steps, args.batch_slots) == (1285, 15, 8)
    record = RecordsTrainingSchedule(1270, 15)
    for step in range(args.num_iterations + 1):
        assert train_gpt.lr_multiplier(step, args) == record.lr(step), step
        assert train_gpt.mtp_weights_at(step, args) == record.mtp(step), step
        if step < args.num_iterations:
            stage, _ = record.lookup(step)
            assert train_gpt.window_at(step, args) == stage[2][1], step
            assert args.batch_slots * train_gpt.seq_len_at(step, args) == stage[1], step
            assert train_gpt.doc_len_at(step, args) == stage[6], step
    for step in range(args.num_iterations):
        if step < 300:
            expected = 0.85 + (step / 300) * (0.95 - 0.85)
        else:
            expected = 0.95 - ((step - 1235) / 50) * (0.95 - 0.85) if step > 1235 else 0.95
        assert train_gpt.muon_momentum(step, args) == expected, step
    assert train_gpt.untie_step(args) == record.split_step == 847
    assert [train_gpt.embed_tied_at(step, args) for step in (0, 846, 847, 848, 1285)] == [True] * 3 + [False] * 2
    for scheduled in (30, 99, 254, 1450, 1880):  # other lengths: the record's expressions, and Adam's (odd) steps
        other = dataclasses.replace(args, num_iterations=scheduled + args.extension_steps)
        record = RecordsTrainingSchedule(scheduled, args.extension_steps)
        assert train_gpt.untie_step(other) == record.split_step
        assert all(train_gpt.lr_multiplier(step, other) == record.lr(step) and
                   train_gpt.mtp_weights_at(step, other) == record.mtp(step) for step in range(other.num_iterations + 1))
    short = dataclasses.replace(args, num_iterations=3, extension_steps=0)  # unties after step 3: tied all run
    assert train_gpt.untie_step(short) == 3 and all(train_gpt.embed_tied_at(step, short) for step in range(4))
    # the shapes the warm-up compiles: three batch stages with 3, 2 and 1 predictions, and the extension (the tie
    # changes no graph: the embedding is a copy, from 2026-01-18)
    assert train_gpt.training_shapes(args) == {(16384, 3, 3): 0, (32768, 7, 2): 423, (49152, 11, 1): 847,
                                               (49152, 13, 1): 1270}


HEADS_PREFIX_WEIGHTS = [(0.25, 0.25), (0.25, 0.0), (0.0, 0.0), (0.0, 0.0)]  # (start, end) of each of its stages


def test_the_prefix_weight_at_every_step_of_the_1285_step_schedule():
    """The prefix token's weight (records from 2026-07-13) at every step of upstream HEAD's 1270 scheduled steps and
    15 more, and the validation's 1285, against its TrainingSchedule written out: its stages and the fraction t of
    each gone as RecordsTrainingSchedule finds them (the same code), start + (end - start) t of the stage's
    HEADS_PREFIX_WEIGHTS, then rounded to float32 as its torch.tensor([pw]) makes it: equal. 0.25 flat over [0, 423),
    fading over [423, 847), 0 after."""
    args = dataclasses.replace(RECORD, num_iterations=1285, extension_steps=15)
    head = RecordsTrainingSchedule(1270, 15)
    assert head.boundaries == [(0, 423), (423, 847), (847, 1270), (1270, 1285)]
    weights = []
    for step in range(1286):
        stage, t = head.lookup(step)
        start, end = HEADS_PREFIX_WEIGHTS[head.STAGES.index(stage)]
        weights.append(train_gpt.prefix_weight_at(step, args))
        assert weights[-1] == torch.tensor([start + (end - start) * t]).item(), step
    assert train_gpt.PREFIX_WEIGHT == 0.25 and set(weights[:423]) == {0.25} and set(weights[847:]) == {0.0}
    assert all(a > b for a, b in itertools.pairwise(weights[423:848]))


@pytest.mark.parametrize("scheduled", [400, 31])
def test_mtp_weights_fade_within_each_part(scheduled):
    """Other run lengths: in part k of the n = 3 (steps round(k S / 3) to round((k + 1) S / 3) - 1), the first n - k
    MTP_WEIGHTS, the last of several falling linearly from its value at the part's first step toward 0 at the next
    part's (exact fractions by hand; the weight's three roundings, of values at most 0.5); the next token's alone in
    the last part."""
    base, n = train_gpt.MTP_WEIGHTS, len(train_gpt.MTP_WEIGHTS)
    assert base == (1.0, 0.5, 0.25)
    args = dataclasses.replace(RECORD, num_iterations=scheduled + RECORD.extension_steps)
    starts = [round(Fraction(k * scheduled, n)) for k in range(n)] + [scheduled]
    for step in range(args.num_iterations):
        part = max(k for k in range(n) if step >= starts[k])
        expected = list(base[:n - part])
        if len(expected) > 1:
            expected[-1] = float(Fraction(expected[-1]) * (1 - Fraction(step - starts[part], starts[part + 1] - starts[part])))
        assert train_gpt.mtp_weights_at(step, args) == pytest.approx(expected, abs=4 * UNIT_ROUNDOFF[torch.float64]), step


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
    model = train_gpt.build_model(dataclasses.replace(RECORD, model_dim=64, num_heads=2, head_dim=32), 128)
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
    cpu_changes = [(51, (2, 4)), (102, (4, 8)), (152, (8, 16)), (203, (16, 32))]  # round(254 k / 5)
    for args, expected in ((RECORD, [(423, (3, 7)), (847, (7, 11)), (1270, (11, 13))]),
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
    """NorMuon's step as the records from 2025-12-11 compute it, in plain Python over the matrices of an update (rows,
    cols) or a stack (k, rows, cols): per row of each matrix, the EMA of the mean square (second_moment: k lists),
    division by its root (floored at NORMUON_EPS), rescaling to the matrix's own Frobenius norm."""
    *stack, rows, cols = update.shape
    outputs, moments = [], []
    for matrix, moment in zip(update.reshape(-1, rows, cols).tolist(), second_moment):
        mean_square = [sum(v * v for v in row) / cols for row in matrix]
        moment = [beta2 * s + (1 - beta2) * m for s, m in zip(moment, mean_square)]
        divisor = [math.sqrt(max(s, train_gpt.NORMUON_EPS)) for s in moment]
        divided = [[matrix[r][c] / divisor[r] for c in range(cols)] for r in range(rows)]
        norm = lambda m: math.sqrt(sum(v * v for row in m for v in row))
        scale = norm(matrix) / max(norm(divided), train_gpt.NORMUON_EPS)
        outputs += [v * scale for row in divided for v in row]
        moments.append(moment)
    return outputs, moments


@pytest.mark.parametrize("shape", [(3, 2), (2, 3), (2, 2), (4, 3, 2), (4, 2, 3)])
def test_normuon_normalizes_per_neuron_as_computed_by_hand(shape):
    """Two steps on a tall, a wide and a square matrix, a q, k, v, o stack and a stack of wide head-pair blocks: per row
    of each matrix, per column of a wide one (the records from 2026-04-08; per row from 2025-12-11 before), in float32
    against the same float32 updates by hand in float64. The other axis, and a stack rescaled to its whole norm rather
    than each matrix's, fall outside."""
    muon = train_gpt.Muon([torch.nn.Parameter(torch.zeros(shape))], lr=0.1, momentum=0.9, neuron_beta2=0.95)
    p = muon.param_groups[0]["params"][0]
    *stack, rows, cols = shape
    wide = rows < cols
    fresh = lambda lines: [[0.0] * lines for _ in range(math.prod(stack))]
    rows_moment, columns_moment, pooled_moment = fresh(rows), fresh(cols), [[0.0] * (math.prod(stack) * rows)]
    # the hand computation is per row: a wide matrix's columns are its transpose's rows
    averaged, other = (rows, cols) if wide else (cols, rows)
    for step, seed in enumerate((1, 2)):
        update = torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * (1 + step)
        per_row, rows_moment = hand_neuron_normalization(update, rows_moment, 0.95)
        per_column, columns_moment = hand_neuron_normalization(update.mT, columns_moment, 0.95)
        pooled, pooled_moment = hand_neuron_normalization(update.reshape(1, -1, cols), pooled_moment, 0.95)
        per_row = torch.tensor(per_row, dtype=torch.float64).view(shape)
        per_column = torch.tensor(per_column, dtype=torch.float64).view(*stack, cols, rows).mT
        got = muon._normalize_neurons(p, update.clone())
        # relative roundings, of positive terms only (first order, a square root halving its argument's): the mean
        # square m = averaged + 2 (squares, sums, the mean); the moment m + 4 a lerp (weight, difference, product,
        # sum); the step size half the moment's and rsqrt's 2 EXP_ULPS; the norms half of m + other + 1 (sums, a
        # product by averaged) and of m + other + 2 + twice the step size's, a square root each; quotient and products
        mean_square_roundings = averaged + 2
        moment_roundings = mean_square_roundings + 4 * (step + 1)
        output_roundings = moment_roundings + 4 * EXP_ULPS + mean_square_roundings + other + 7
        expected, outside = (per_column, per_row) if wide else (per_row, per_column)
        bound = gamma(output_roundings) * expected.abs()
        assert_within(got, expected, bound, "normalized update", gamma(output_roundings))
        expected_moment = torch.tensor(columns_moment if wide else rows_moment, dtype=torch.float64)
        stored = muon.state[p]["neuron_second_moment"]
        assert stored.dtype == p.dtype and stored.shape == ((*stack, 1, cols) if wide else (*stack, rows, 1))
        assert_within(stored.reshape(expected_moment.shape), expected_moment,
                      gamma(moment_roundings) * expected_moment, "second moment", gamma(moment_roundings))
        if step and rows != cols:
            with pytest.raises(AssertionError, match="times the derived bound"):
                assert_within(got, outside, bound, "the other axis", gamma(output_roundings))
        if step and stack and not wide:
            with pytest.raises(AssertionError, match="times the derived bound"):
                assert_within(got, torch.tensor(pooled, dtype=torch.float64).view(shape), bound, "one norm",
                              gamma(output_roundings))


def test_normuon_keeps_its_statistics_and_momentum_in_float32():
    """The records from 2026-01-04 keep Muon's momentum and NorMuon's second moment in float32, one moment per row of
    each matrix (per column of a wide one, from 2026-04-08), for bf16 matrices as for float32 ones; a bf16 matrix's
    owner keeps its value's low half (uint16)."""
    for dtype in (torch.bfloat16, torch.float32):
        params = [torch.nn.Parameter(torch.zeros(12, 6, dtype=dtype)), torch.nn.Parameter(torch.zeros(4, 4, 8, dtype=dtype))]
        muon = train_gpt.Muon(params, lr=0.1, momentum=0.9, neuron_beta2=0.95)
        for p in params:
            p.grad = torch.randn(p.shape).to(p.dtype)
        muon.step()
        assert [tuple(muon.state[p]["neuron_second_moment"].shape) for p in params] == [(12, 1), (4, 1, 8)]
        assert {muon.state[p][key].dtype for p in params for key in ("neuron_second_moment", "momentum_buffer")} == {
            torch.float32}
        assert [muon.state[p].get("low_half", torch.empty(0)).dtype for p in params] == (
            [torch.uint16] * 2 if dtype == torch.bfloat16 else [torch.float32] * 2)
    with pytest.raises(ValueError, match="share a dtype"):
        train_gpt.Muon([torch.nn.Parameter(torch.zeros(2, 2)), torch.nn.Parameter(torch.zeros(2, 2).bfloat16())], lr=0.1,
                       momentum=0.9)


def first_muon_update(grad, momentum):
    """Muon's first step direction, independently: momentum buffer (1 - m) g, 1 - m in float32 from m's float32 value
    (the record's), Nesterov g.lerp(buf, m)."""
    buffer = (1 - torch.tensor(momentum, dtype=torch.float32)) * grad
    return train_gpt.orthogonalize(grad.lerp(buffer, momentum), torch.float32)


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
    float64 by hand, within float32's bound of the records' p - p m (wd lr) lr - update lr (2025-12-11): the decay term
    A within 5u (lr to float32, wd lr, then two products), B = update lr within 2u, then two subtractions:
    |error| <= u (5 |A| + 2 |B| + |p - A| + |expected|)."""
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
    decay = lr * lr * weight_decay * agree * start
    bound = u * (5 * decay.abs() + 2 * lr * update.abs() + (start - decay).abs() + expected.abs())
    assert_within(p.detach(), expected, bound, "cautious weight decay", 5 * u)
    for wrong, name in ((start - lr * update, "the step without the decay"),
                        (start - lr * (update + lr * weight_decay * start), "decay everywhere"),
                        (start * (1 - lr * weight_decay * agree) - lr * update, "decay decoupled from the lr")):
        with pytest.raises(AssertionError, match="times the derived bound"):
            assert_within(p.detach(), wrong, bound, name, 5 * u)


def test_muon_lr_mul_scales_one_matrix_s_step():
    """lr_mul (the records' 2 on each MLP's down-projection): from zero, without momentum or decay, a matrix's step is
    -orth(g) * (mul lr) with mul lr in float32 and the product in bf16 (the same operations: equal), the others'
    -orth(g) * lr."""
    torch.manual_seed(3)
    fast, plain = torch.nn.Parameter(torch.zeros(16, 64)), torch.nn.Parameter(torch.zeros(16, 64))
    fast.grad, plain.grad = torch.randn(16, 64), torch.randn(16, 64)
    lr = 0.03
    train_gpt.Muon([fast, plain], lr=lr, momentum=0.0, nesterov=False, lr_mul={fast: 2.0}).step()
    assert torch.equal(fast.detach(), -(train_gpt.orthogonalize(fast.grad) * (torch.tensor(2.0) * lr)).float())
    assert torch.equal(plain.detach(), -(train_gpt.orthogonalize(plain.grad) * (torch.tensor(1.0) * lr)).float())


def test_the_record_s_muon_gets_the_down_projections_lr_mul_the_mlps_add_apart_and_the_weight_decay():
    """build_optimizers hands Muon MLP_DOWN_LR_MUL for every c_proj (nothing else), adding apart for every MLP matrix
    (nothing else), and muon_cautious_wd, which the training step leaves alone (the decay follows the lr through the
    lr alone). The lr factors are the records' (2026-01-18): 1 for each head pair's q or k block (2 d / heads, d) and
    for v and o (d, d) (from 2026-04-08), 2 for the (4d, d) up-projection, 2 x 2 for the down-projection; no gates
    (Adam's from 2025-12-31). The blocks' NorMuon moments are per column (wide), the others' per row."""
    args = dataclasses.replace(RECORD, model_dim=64, num_heads=4, head_dim=16, seq_len=(128,), val_seq_len=128,
                               batch_slots=1, dtype="float32", num_iterations=4, extension_steps=1, compile=False,
                               vocab_size=1024)
    trainer = train_gpt.Trainer(args, 0, 1, train_gpt.plan_device(args, torch.device("cpu")))
    blocks, muon = trainer.model.blocks, trainer.muon
    down = {block.mlp.c_proj for block in blocks}
    assert len(down) == args.num_layers and muon.lr_mul == dict.fromkeys(down, 2.0)
    assert muon.add_apart == {p for block in blocks for p in (block.mlp.c_fc, block.mlp.c_proj)}
    expected = {**{w: 1.0 for block in blocks if block.attn is not None for w in (block.attn.qk_w, block.attn.vo_w)},
                **{block.mlp.c_fc: 2.0 for block in blocks}, **dict.fromkeys(down, 4.0)}
    assert set(muon.lr_factor) == set(expected)
    assert muon.lr_factor == expected
    tokens = torch.randint(0, 1024, (129,))
    for step in range(2):
        trainer.train_step(step, [(tokens[:-1].int(), tokens[1:])])
        assert trainer.muon.param_groups[0]["weight_decay"] == args.muon_cautious_wd == 1.2
    moments = {tuple(muon.state[p]["neuron_second_moment"].shape) for block in blocks if block.attn for p in
               (block.attn.qk_w, block.attn.vo_w)}
    assert {block.attn.qk_w.shape for block in blocks if block.attn} == {(4, 32, 64)} and moments == {(4, 1, 64), (2, 64, 1)}


def records_normuon(v_chunk, second_momentum_buffer, beta2, red_dim=-1):
    """The 2025-12-14 record's apply_normuon_variance_reduction, written out (its red_dim -1 for every matrix there;
    -2 for 2026-04-08's wide blocks)."""
    v_mean = v_chunk.float().square().mean(dim=red_dim, keepdim=True)
    red_dim_size = v_chunk.size(red_dim)
    v_norm = v_mean.sum(dim=(-2, -1), keepdim=True).mul_(red_dim_size).sqrt_()
    second_momentum_buffer.lerp_(v_mean.to(dtype=second_momentum_buffer.dtype), 1 - beta2)
    step_size = second_momentum_buffer.clamp_min(1e-10).rsqrt_()
    scaled_sq_sum = (v_mean * red_dim_size) * step_size.float().square()
    v_norm_new = scaled_sq_sum.sum(dim=(-2, -1), keepdim=True).sqrt_()
    final_scale = step_size * (v_norm / v_norm_new.clamp_min_(1e-10))
    return v_chunk.mul_(final_scale.type_as(v_chunk))


def records_cautious_update(p, v, wd_tensor, lr_tensor):
    """The 2025-12-31 record's cautious_wd_and_update_inplace, written out (a float32 run's form)."""
    mask = (v * p) >= 0
    wd_factor, lr_factor = wd_tensor.to(p.dtype), lr_tensor.to(p.dtype)
    p.copy_(p - (p * mask * wd_factor * lr_factor) - (v * lr_factor))


def records_mantissa_update(p, mantissa, grad, wd_tensor, lr_tensor):
    """The 2026-01-04 record's cautious_wd_and_update_inplace on a bf16 p and its uint16 mantissa, written out with
    int64 arithmetic in place of its uint32 (which the CPU does not shift): the float32 value p's bits then the
    mantissa's, updated, split again into its high half (p) and low half."""
    raw = ((p.view(torch.uint16).to(torch.int64) << 16) | mantissa.to(torch.int64)).to(torch.int32)
    precise = raw.view(torch.float32)
    grad = grad.float()
    wd_factor, lr_factor = wd_tensor.to(torch.float32), lr_tensor.to(torch.float32)
    mask = (grad * precise) >= 0
    precise.copy_(precise - (precise * mask * wd_factor * lr_factor) - (grad * lr_factor))
    unsigned = precise.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    p.view(torch.uint16).copy_((unsigned >> 16).to(torch.uint16))
    mantissa.copy_((unsigned & 0xFFFF).to(torch.uint16))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_muon_steps_replay_the_records_expressions(dtype):
    """Three steps of Muon as the record configures it (Polar Express in bf16, NorMuon 0.9, cautious wd 1.2, lr 0.023,
    momentum 0.95) on attention's q and k head-pair blocks (4, 8, 16), its v and o (2, 16, 16) and an MLP's c_fc and
    c_proj (64, 16) (lr_mul 2, adding apart), against the 2026-04-08 record's step written out: the gradient in float32,
    momentum lerps in float32 with the momentum a float32 tensor (1 - m made from it), its NorMuon (statistics in
    float32, per row; per column of the wide blocks: its red_dim), its cautious update with its lr factors 1, 1, 2 and 4
    (max(1, rows / cols)^0.5 of each matrix, times lr_mul), each factor times lr and wd lr made in double and rounded
    once to float32 (fill_); bf16 matrices updated on their float32 values (mantissa), float32 ones in the 2025-12-31
    form (the record's in float32). The same operations: equal to the bit. Orthogonalization is train_gpt's (tested
    above); a c_proj factor of 2 would differ, and so would the blocks' NorMuon per row and bf16 matrices updated in
    bf16."""
    g = torch.Generator().manual_seed(0)
    shapes = [(4, 8, 16), (2, 16, 16), (64, 16), (64, 16)]
    starts = [(torch.randn(s, generator=g) * 0.1).to(dtype) for s in shapes]
    grads = [[torch.randn(s, generator=g).to(dtype) for s in shapes] for _ in range(3)]
    params = [torch.nn.Parameter(t.clone()) for t in starts]
    qk, vo, c_fc, c_proj = params
    lr, momentum, beta2, wd = 0.023, 0.95, 0.9, 1.2
    muon = train_gpt.Muon(params, lr=lr, momentum=momentum, neuron_beta2=beta2,
                          weight_decay=wd, lr_mul={c_proj: 2.0}, add_apart=[c_fc, c_proj])
    for step_grads in grads:
        for p, grad in zip(params, step_grads):
            p.grad = grad.clone()
        muon.step()

    def replay(lr_mults, mantissa=True, red_dims=None):
        eff_lr, eff_wd, momentum_t = torch.tensor(0.0), torch.tensor(0.0), torch.tensor(momentum)
        by_hand = [t.clone() for t in starts]
        buffers = [torch.zeros_like(t, dtype=torch.float32) for t in starts]
        # the record's red_dim and second moment's shape
        red_dims = red_dims or [-1 if s[-2] >= s[-1] else -2 for s in shapes]
        moments = [torch.zeros(*s[:-1], 1) if d == -1 else torch.zeros(*s[:-2], 1, s[-1]) for s, d in zip(shapes, red_dims)]
        mantissas = [torch.zeros_like(t, dtype=torch.uint16) for t in starts]
        for step_grads in grads:
            for k, grad in enumerate(step_grads):
                eff_lr.fill_(lr_mults[k] * lr)
                eff_wd.fill_(1.0 * wd * lr)
                grad = grad.float()
                buffers[k].lerp_(grad, 1 - momentum_t)
                updated = grad.lerp_(buffers[k], momentum_t)
                v = train_gpt.orthogonalize(updated, torch.bfloat16, add_apart=k in (2, 3))
                v = records_normuon(v, moments[k], beta2, red_dims[k])
                if dtype == torch.bfloat16 and mantissa:
                    records_mantissa_update(by_hand[k], mantissas[k], v, eff_wd, eff_lr)
                else:
                    records_cautious_update(by_hand[k], v, eff_wd, eff_lr)
        return by_hand, moments, mantissas

    # the record's shape_mult of each matrix, (8, 16), (16, 16), (64, 16), (64, 16), times lr_mul
    by_hand, moments, mantissas = replay([1.0, 1.0, 2.0, 2.0 * 2.0])
    for k, (p, expected, start) in enumerate(zip(params, by_hand, starts)):
        assert not torch.equal(p.detach(), start)
        assert torch.equal(p.detach(), expected), k
        assert torch.equal(muon.state[p]["neuron_second_moment"], moments[k]), k
        if dtype == torch.bfloat16:
            assert torch.equal(muon.state[p]["low_half"], mantissas[k]) and mantissas[k].any(), k
    assert not torch.equal(c_proj.detach(), replay([1.0, 1.0, 2.0, 2.0])[0][3])
    assert not torch.equal(vo.detach(), replay([2.0, 2.0, 2.0, 4.0])[0][1])  # the attention's factor before 2026-01-18
    assert not torch.equal(qk.detach(), replay([1.0, 1.0, 2.0, 4.0], red_dims=[-1] * 4)[0][0])
    if dtype == torch.bfloat16:
        assert not torch.equal(c_fc.detach(), replay([1.0, 1.0, 2.0, 4.0], mantissa=False)[0][2])


def test_a_bf16_matrix_and_its_low_half_hold_its_float32_value_through_updates():
    """cautious_update with low_half: a float32 value split into its bf16 truncation and low half, updated there, equals
    the float32 update of that value, bit for bit (its 32 bits in the two halves), over several steps; the bf16 matrix
    is the value truncated, not rounded to nearest."""
    g = torch.Generator().manual_seed(4)
    value = torch.randn(300, generator=g)
    bits = value.view(torch.int32)
    p = ((bits >> 16) & 0xFFFF).to(torch.uint16).view(torch.bfloat16).clone()
    low = (bits & 0xFFFF).to(torch.uint16)
    reference = value.clone()
    for step in range(5):
        update = torch.randn(300, generator=g).bfloat16()
        wd, lr = torch.tensor(0.02 * (step + 1)), torch.tensor(0.3 / (step + 1))
        train_gpt.cautious_update(p, update, wd, lr, low)
        records_cautious_update(reference, update.float(), wd, lr)  # the update in float32, as the records' from 01-04
        joined = (p.view(torch.uint16).to(torch.int64) << 16 | low.to(torch.int64)).to(torch.int32).view(torch.float32)
        assert torch.equal(joined, reference), step
        truncated = (reference.view(torch.int32) & ~0xFFFF).view(torch.float32)
        assert torch.equal(p.float(), truncated) and not torch.equal(p, reference.bfloat16())


def test_adding_apart_computes_the_same_iteration_rounded_once_more():
    """add_apart (the records' MLP path from 2025-12-11: B X, then a X added) against the one scaled product and sum:
    in float64 within the iteration's derived float64 bound of each other (both evaluate one iteration; the step bound
    counts B X and a X rounded apart); in float32 each within its float32 bound of the float64 iteration; in bf16 the
    extra rounding of B X shows: the two differ."""
    G = random_matrices((2, 12, 20), 0)
    together = train_gpt.orthogonalize(G.double(), torch.float64)
    apart = train_gpt.orthogonalize(G.double(), torch.float64, add_apart=True)
    assert_within(apart, together, 2 * orthogonalization_error(G, torch.float64), "float64, apart")
    bound = orthogonalization_error(G, torch.float32) + orthogonalization_error(G, torch.float64)
    assert_within(train_gpt.orthogonalize(G, torch.float32, add_apart=True), together, bound, "float32, apart")
    bf16 = [train_gpt.orthogonalize(G, add_apart=flag) for flag in (False, True)]
    assert all(t.dtype == torch.bfloat16 for t in bf16) and not torch.equal(*bf16)


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
    adam = train_gpt.Adam([dict(params=[ours[0]], lr=lrs[0], betas=betas), dict(params=[ours[1]], lr=lrs[1], betas=betas)],
                          eps=eps)
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


def test_adam_keeps_float32_moments_and_decays_cautiously():
    """The records' Adam from 2025-12-31: float32 moments for bf16 and float32 parameters alike (kept so through
    load_state_dict, whose base class would cast them to bf16), and cautious weight decay: lr^2 wd wd_mul p joins the
    update where the update and p agree in sign. Step 1 by hand in float64: m = (1 - b1) g, v = (1 - b2) g^2, the move
    lr sqrt(1 - b2) / (1 - b1) m / (sqrt(v) + eps). Each of the move's roundings in float32 (m, v, the sqrt, the eps
    sum, the quotient, the product by the step size) is within e = 4u of the value it rounds (the step size's own 3u
    included), the sqrt halving v's: the move lies within (1 + e)^4 / (1 - e)^3 - 1 of its own magnitude; the decay
    term (its factor rounded to float32, the product, the sum) within 3u of its own; the parameter's subtraction
    rounds in its dtype. Decaying every entry, not the agreeing ones alone, falls outside the bound."""
    g = torch.Generator().manual_seed(0)
    params = [torch.randn(64, generator=g), torch.randn(64, generator=g).bfloat16()]
    grads = [torch.randn(64, generator=g).to(p.dtype) for p in params]
    lr, (beta1, beta2), eps, wd, wd_mul = 0.05, (0.65, 0.95), 1e-8, 0.5, 3.0
    copies = [p.clone().requires_grad_() for p in params]
    adam = train_gpt.Adam([dict(params=copies, lr=lr, wd_mul=wd_mul, betas=(beta1, beta2))], eps=eps, weight_decay=wd)
    for p, grad in zip(copies, grads):
        p.grad = grad.clone()
    adam.step()
    u = UNIT_ROUNDOFF[torch.float32]
    for p0, grad, got in zip(params, grads, copies):
        assert adam.state[got]["exp_avg"].dtype == adam.state[got]["exp_avg_sq"].dtype == torch.float32
        e = 4 * u
        gd, pd = grad.double(), p0.double()
        move = lr * math.sqrt(1 - beta2) / (1 - beta1) * ((1 - beta1) * gd) / (((1 - beta2) * gd * gd).sqrt() + eps)
        agree = move * pd > 0
        assert 10 < int(agree.sum()) < 54  # both kinds of entries
        decay = lr * lr * wd * wd_mul * pd
        expected = pd - move - torch.where(agree, decay, 0)
        bound = ((1 + e) ** 4 / (1 - e) ** 3 - 1) * move.abs() + 3 * u * decay.abs() + UNIT_ROUNDOFF[p0.dtype] * expected.abs() * 1.01
        assert_within(got.detach(), expected, bound, f"Adam on {p0.dtype}")
        with pytest.raises(AssertionError, match="times the derived bound"):
            assert_within(got.detach(), pd - move - decay, bound, "decaying every entry")
    reloaded = train_gpt.Adam([dict(params=[p.detach().clone().requires_grad_() for p in copies], lr=lr,
                                    betas=(beta1, beta2))], eps=eps)
    reloaded.load_state_dict(adam.state_dict())
    for mine, theirs in zip(reloaded.param_groups[0]["params"], copies):
        for key in ("exp_avg", "exp_avg_sq"):
            assert reloaded.state[mine][key].dtype == torch.float32
            assert torch.equal(reloaded.state[mine][key], adam.state[theirs][key])


def test_adam_without_decay_skips_its_terms_with_the_same_bits():
    """A decay of 0 (the groups with wd_mul 0) leaves out the mask and the decay's terms: the
    same parameters and moments, to the bit, as adding 0 times them."""
    g = torch.Generator().manual_seed(3)
    p0, grad = torch.randn(256, generator=g).bfloat16(), torch.randn(256, generator=g).bfloat16()
    results = []
    for decays in (True, False):
        p, m, v = p0.clone(), torch.zeros(256), torch.zeros(256)
        train_gpt.adam_update(p, grad, m, v, torch.tensor(0.01), torch.tensor(0.0), 0.65, 0.95, 1e-8, decays)
        results.append((p, m, v))
    assert all(torch.equal(a, b) for a, b in zip(*results)) and not torch.equal(results[0][0], p0)


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
        adam = train_gpt.Adam([dict(params=copies[:1], lr=initial_lrs[0], betas=betas),
                               dict(params=copies[1:], lr=initial_lrs[1], betas=betas)], eps=eps, compiled=compiled)
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
