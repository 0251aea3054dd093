"""The composed attention (the 2026-05-27 record's layer-10 correction: composed_attention_correction, its weights
composition_weights, its documents document_starts) against a float64 loop written from the rule, not from the code:
query i at position p, head h, takes the softmax of scale q.k over the keys j with max(start of its document,
p - 111) <= j <= p; those softmaxes, weighted by the query's mix over the heads, sum to one pattern; head h adds
its gain times its values under that pattern to y. Tolerances are first-order bounds derived from the float32
arithmetic (tests/rounding.py), each rounding's count stated where it is summed."""

import functools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pytest
import torch

import train_gpt
from rounding import EXP_ULPS, UNIT_ROUNDOFF, assert_within, gamma

pytestmark = pytest.mark.numerics

EOT, WINDOW = train_gpt.EOT_TOKEN, 112
T, H, D = 320, 4, 16
SCALE = 0.12
# Documents of 45 tokens (no EOT at 0), 7, 118 and 150: two longer than the window, one shorter than a chunk.
DOCUMENT_STARTS = (45, 52, 170)
U = UNIT_ROUNDOFF[torch.float32]


@functools.cache
def tokens_of(num_tokens: int = T) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, EOT, (num_tokens,), generator=g)
    tokens[list(DOCUMENT_STARTS)] = EOT
    return tokens


def make_inputs(dtype: torch.dtype, seed: int = 1, num_tokens: int = T) -> dict:
    """y, q, k, v (1, H, T, D) and the weights (1, T, H) in dtype; q and k twice unit normal: logits of std about 2."""
    g = torch.Generator().manual_seed(seed)
    q, k = (2 * torch.randn(1, H, num_tokens, D, generator=g) for _ in range(2))
    y, v = (torch.randn(1, H, num_tokens, D, generator=g) for _ in range(2))
    mix, gain = train_gpt.composition_weights(*torch.randn(2, 1, num_tokens, H, generator=g), dtype)
    return dict(y=y.to(dtype), q=q.to(dtype), k=k.to(dtype), v=v.to(dtype), mix=mix, gain=gain)


def key_ranges(tokens: torch.Tensor, num_queries: int, window: int = WINDOW) -> list[range]:
    """Each query's keys (the queries the last num_queries positions), by a loop over the tokens."""
    start, starts = 0, []
    for position, token in enumerate(tokens.tolist()):
        start = position if token == EOT else start
        starts.append(start)
    first_query = len(starts) - num_queries
    return [range(max(starts[p], p - window + 1), p + 1) for p in range(first_query, len(starts))]


def loop_reference(y, q, k, v, mix, gain, tokens, window: int = WINDOW) -> torch.Tensor:
    """float64, per query and head: the explicit softmax over the query's keys, the heads' mix, times v."""
    y, q, k, v, mix, gain = (t[0].double() for t in (y, q, k, v, mix, gain))
    heads, rows = q.size(0), []
    for i, keys in enumerate(key_ranges(tokens, q.size(1), window)):
        keys = torch.tensor(keys)
        pattern = 0
        for h in range(heads):
            logits = SCALE * (k[h, keys] @ q[h, i])
            powers = torch.exp(logits - logits.max())
            pattern = pattern + mix[i, h] * powers / powers.sum()
        rows.append(torch.stack([y[h, i] + gain[i, h] * (pattern @ v[h, keys]) for h in range(heads)]))
    return torch.stack(rows, dim=1)[None]


def composed(inputs: dict, tokens: torch.Tensor, **kwargs) -> torch.Tensor:
    starts = train_gpt.document_starts(tokens)[tokens.numel() - inputs["q"].size(2):]
    return train_gpt.composed_attention_correction(inputs["y"], inputs["q"], inputs["k"], inputs["v"], inputs["mix"],
                                                   inputs["gain"], starts, SCALE, **kwargs)


def error_bounds(inputs: dict, tokens: torch.Tensor, exact_out: torch.Tensor, grad: torch.Tensor | None = None) -> dict:
    """First-order bounds on |computed - exact| of the output and (grad given: a float32 run's) the gradients: float64
    magnitudes over the allowed (query, key) pairs times the relative errors entering them (n products summed in any
    order: within gamma(n) of their magnitudes); "relative", the largest such error, for assert_within.
    A logit (natural units) errs by its D-term dot product, its product with fl(fl(scale) fl(log2 e)) (4 roundings)
    and the row's max subtracted (u of a difference within twice the row's largest |logit|). A probability, relative
    (rho): two logits' errors (its own, the sum's), exp2 within EXP_ULPS ulps (2u each) for each power, the sum of n
    positive powers, the division (or a reciprocal and a product). The softmax's backward p_j (dp_j - sum_k p_k dp_k),
    dp = mix da: both probabilities' errors, da's (a D-term dot product, a sum over the heads), a product; then a
    division, the weighted sum (3 roundings a term, window terms), an addition, exp2's backward (its result, ln 2 in
    float32, a product), log2_scale's roundings: gamma(window + 12) for these."""
    q, k, v = (inputs[name][0].double() for name in "qkv")  # (H, T, D)
    mix, gain = (inputs[name][0].double().T for name in ("mix", "gain"))  # (H, Tq)
    u_weight, u_out = (UNIT_ROUNDOFF[inputs[name].dtype] if inputs[name].dtype != torch.float32 else 0.0
                       for name in ("v", "y"))  # the casts of each head's weights to v's dtype, of the output to y's
    allowed = torch.zeros(q.size(1), k.size(1), dtype=torch.bool)
    for i, keys in enumerate(key_ranges(tokens, q.size(1))):
        allowed[i, keys.start:keys.stop] = True
    logits = SCALE * q @ k.transpose(1, 2)
    probs = logits.masked_fill(~allowed, float("-inf")).softmax(-1)  # (H, Tq, Tk)
    largest = logits.abs().masked_fill(~allowed, 0).amax(-1, keepdim=True)
    logit_error = gamma(D) * SCALE * q.abs() @ k.abs().transpose(1, 2) + gamma(4) * logits.abs() + 2 * U * largest
    logit_error = logit_error.masked_fill(~allowed, 0).amax(-1)  # (H, Tq)
    terms = torch.tensor([gamma(n) for n in allowed.sum(-1).tolist()], dtype=torch.float64)
    rho = 2 * logit_error + 4 * EXP_ULPS * U + terms + 2 * U
    spread = (mix.abs()[..., None] * probs).sum(0)  # (Tq, Tk): the pattern's magnitude
    pattern_error = (mix.abs()[..., None] * probs * (rho[..., None] + gamma(H))).sum(0)  # H products summed
    weight = gain.abs()[..., None] * spread  # (H, Tq, Tk)
    # Times the gain (u), then the cast, |fl(x') - x| <= (1 + u_cast) |x' - x| + u_cast |x|: kept whole, the terms a
    # first-order bound drops stay products of float32 errors.
    weight_error = gain.abs()[..., None] * ((pattern_error + U * spread) * (1 + u_weight) + u_weight * spread)
    # The output: window products (exact or a rounding) summed, y added (u), the sum cast.
    sum_error = (weight_error + gamma(WINDOW + 1) * (1 + u_weight) * weight) @ v.abs() + U * exact_out[0].abs()
    bounds = dict(out=(1 + u_out) * sum_error + u_out * exact_out[0].abs(),
                  relative=float(rho.max()) + gamma(H) + gamma(WINDOW + 1) + 2 * U)
    if grad is None:
        return bounds
    g = grad[0].double()
    grad_weight = g.abs() @ v.abs().transpose(1, 2)  # (H, Tq, Tk): a weight's gradient, a D-term dot product
    grad_pattern = (gain.abs()[..., None] * grad_weight).sum(0)  # (Tq, Tk): da, H products summed
    grad_prob = mix.abs()[..., None] * grad_pattern
    grad_logit = SCALE * probs * (grad_prob + (probs * grad_prob).sum(-1, keepdim=True))
    logit_grad_error = (2 * rho + gamma(D) + gamma(H) + U + gamma(WINDOW + 12))[..., None] * grad_logit
    gain_grad = ((gamma(D) + gamma(WINDOW)) * spread + pattern_error) * grad_weight  # window products summed
    mix_grad = (rho[..., None] + gamma(D) + gamma(H) + gamma(WINDOW)) * probs * grad_pattern
    bounds.update(dq=(logit_grad_error + gamma(WINDOW + 1) * grad_logit) @ k.abs(),
                  dk=(logit_grad_error + gamma(WINDOW + 1) * grad_logit).transpose(1, 2) @ q.abs(),
                  dv=(weight_error + gamma(WINDOW + 1) * weight).transpose(1, 2) @ g.abs(),
                  dy=torch.zeros_like(g), dgain=gain_grad.sum(-1).T, dmix=mix_grad.sum(-1).T,
                  relative=max(bounds["relative"], float(2 * rho.max()) + gamma(D) + gamma(H) + gamma(WINDOW + 12)))
    return bounds


@functools.cache
def float32_case() -> tuple[dict, torch.Tensor, dict, dict]:
    """The float32 inputs, a gradient for the output, the exact output and gradients (float64 autograd of the
    loop) and their bounds."""
    inputs = make_inputs(torch.float32)
    grad = torch.randn(1, H, T, D, generator=torch.Generator().manual_seed(2))
    leaves = {name: t.double().requires_grad_() for name, t in inputs.items()}
    exact = loop_reference(**leaves, tokens=tokens_of())
    exact.backward(grad.double())
    exact_values = dict(out=exact.detach(), **{name: t.grad for name, t in leaves.items()})
    return inputs, grad, exact_values, error_bounds(inputs, tokens_of(), exact.detach(), grad)


def computed_with_grads(inputs: dict, grad: torch.Tensor, tokens: torch.Tensor, **kwargs) -> dict:
    leaves = {name: t.clone().requires_grad_() for name, t in inputs.items()}
    out = composed(leaves, tokens, **kwargs)
    out.backward(grad.to(out.dtype))
    return dict(out=out.detach(), **{name: t.grad for name, t in leaves.items()})


def test_document_starts_are_each_positions_last_end_of_text():
    tokens = tokens_of()
    expected = [max([0] + [s for s in DOCUMENT_STARTS if s <= p]) for p in range(T)]
    assert train_gpt.document_starts(tokens).tolist() == expected
    assert train_gpt.document_starts(torch.tensor([EOT, 3, EOT, EOT, 4])).tolist() == [0, 0, 2, 3, 3]


def test_composition_weights_norm_mix_over_the_heads_in_float32():
    """mix / sqrt(mean over the heads of mix^2 + 1e-6), the gain as it is, both cast: rms_norm's mean of H squares, a
    square root and a division within gamma(H + 2) and sqrt's 4 ulps (tests/rounding.py), then the cast's u. Entries
    of 1e-3 make the eps count: without it they would norm to 1, with it to 1 / sqrt(2)."""
    g = torch.Generator().manual_seed(3)
    for raw in (torch.randn(2, 7, H, generator=g), torch.full((1, 3, H), 1e-3)):
        gain = torch.randn(raw.shape, generator=g)
        for dtype in (torch.float32, torch.bfloat16):
            mix, cast_gain = train_gpt.composition_weights(raw, gain, dtype)
            exact = raw.double() / (raw.double().square().mean(-1, keepdim=True) + 1e-6).sqrt()
            cast = UNIT_ROUNDOFF[dtype] if dtype != torch.float32 else 0.0
            bound = (gamma(H + 2) + (2 * EXP_ULPS + 2) * U + cast) * exact.abs()
            assert mix.dtype == cast_gain.dtype == dtype and torch.equal(cast_gain, gain.to(dtype))
            assert_within(mix, exact, bound, f"mix in {dtype}")
    tiny = train_gpt.composition_weights(torch.full((1, 1, H), 1e-3), torch.ones(1, 1, H), torch.float32)[0]
    assert abs(float(tiny[0, 0, 0]) - 2 ** -0.5) < 1e-6


def test_the_loop_itself():
    """The reference on a hand-made case: one head, q = 0 (every allowed key weighs alike), mix and gain 1, y 0, window
    2, documents at 0 and 1 of 5 tokens: each output is the mean of its keys' values."""
    tokens = torch.tensor([5, EOT, 7, 8, 9])
    v = torch.arange(5.0).view(1, 1, 5, 1)
    ones, zeros = torch.ones(1, 5, 1), torch.zeros(1, 1, 5, 1)
    out = loop_reference(zeros, zeros, zeros, v, ones, ones, tokens, window=2)
    assert out.flatten().tolist() == [0.0, 1.0, 1.5, 2.5, 3.5]
    assert [list(r) for r in key_ranges(tokens, 2, window=2)] == [[2, 3], [3, 4]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_correction_matches_the_loop(dtype):
    """In float32 from the inputs' values: bf16 inputs add the casts of each head's weights and of the output."""
    inputs = make_inputs(dtype)
    exact = loop_reference(**inputs, tokens=tokens_of())
    bounds = error_bounds(inputs, tokens_of(), exact)
    out = composed(inputs, tokens_of())
    assert out.dtype == dtype and out.shape == (1, H, T, D)
    assert_within(out, exact, bounds["out"][None], f"output in {dtype}", bounds["relative"])


def test_gradients_match_float64_autograd_of_the_loop():
    inputs, grad, exact, bounds = float32_case()
    computed = computed_with_grads(inputs, grad, tokens_of())
    for name in ("out", "q", "k", "v", "y", "mix", "gain"):
        bound = bounds["d" + name if name != "out" else "out"]
        assert_within(computed[name], exact[name], bound[None], name, bounds["relative"])


@pytest.mark.parametrize("change", ["window 113", "no documents"])
def test_a_wrong_rule_fails_the_comparison(change):
    """Controls: a window of one key more, or documents ignored, leave the bound."""
    inputs, _, exact, bounds = float32_case()
    if change == "window 113":
        out = composed(inputs, tokens_of(), window=WINDOW + 1)
    else:
        out = train_gpt.composed_attention_correction(*(inputs[n] for n in ("y", "q", "k", "v", "mix", "gain")),
                                                      torch.zeros(T, dtype=torch.long), SCALE)
    with pytest.raises(AssertionError, match="times the derived bound"):
        assert_within(out, exact["out"], bounds["out"][None], change, bounds["relative"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_no_result_depends_on_the_chunk(dtype):
    """The output and every gradient to the bit, from chunks of 16 to 256 queries (T = 320: uneven last chunks)."""
    inputs = make_inputs(dtype)
    grad = torch.randn(1, H, T, D, generator=torch.Generator().manual_seed(2))
    results = {chunk: computed_with_grads(inputs, grad, tokens_of(), chunk=chunk) for chunk in (16, 48, 100, 128, 256)}
    for chunk, result in results.items():
        for name, value in result.items():
            assert torch.equal(value, results[128][name]), (dtype, chunk, name)


def test_queries_as_the_last_of_the_keys_give_the_full_computations_rows():
    """Generation's case: the last Tq queries against all T keys and values, to the bit."""
    inputs = make_inputs(torch.bfloat16)
    full = composed(inputs, tokens_of())
    for num_queries in (1, 37, 200, T - 1):
        last = dict(inputs, y=inputs["y"][:, :, -num_queries:], q=inputs["q"][:, :, -num_queries:],
                    mix=inputs["mix"][:, -num_queries:], gain=inputs["gain"][:, -num_queries:])
        assert torch.equal(composed(last, tokens_of()), full[:, :, -num_queries:]), num_queries


@pytest.mark.slow
def test_compiled_equals_eager_within_the_bound():
    """torch.compile'd (all queries at once, inductor's own sums and exp2): the output and gradients within the derived
    bound of the exact ones, which holds for any order of the sums; so within twice it of eager's."""
    inputs, grad, exact, bounds = float32_case()
    eager = computed_with_grads(inputs, grad, tokens_of())
    compiled_fn = torch.compile(train_gpt.composed_attention_correction, dynamic=False)
    leaves = {name: t.clone().requires_grad_() for name, t in inputs.items()}
    out = compiled_fn(*(leaves[n] for n in ("y", "q", "k", "v", "mix", "gain")), train_gpt.document_starts(tokens_of()),
                      SCALE)
    out.backward(grad)
    compiled = dict(out=out.detach(), **{name: t.grad for name, t in leaves.items()})
    for name in ("out", "q", "k", "v", "y", "mix", "gain"):
        bound = bounds["d" + name if name != "out" else "out"][None]
        assert_within(compiled[name], exact[name], bound, f"compiled {name}", bounds["relative"])
        assert_within(compiled[name], eager[name], 2 * bound, f"compiled {name} against eager", bounds["relative"])
