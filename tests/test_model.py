"""The GPT: layer layout rules, U-net wiring, initialization, rotary and its YaRN rescale, gradients,
backends, and the gradient-ready order that GradientBuckets relies on."""

import copy
import functools
import math
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pytest
import torch

import train_gpt
from conftest import needs_flex_on_cpu
from rounding import (EXP_ULPS, UNIT_ROUNDOFF, TorchCalls, assert_within, cos_sin_bound, first_order_bound, gamma,
                      probabilistic_bound, worst_case_gamma)

pytestmark = pytest.mark.numerics

EOT = 50256
VOCAB = 50257  # the real vocabulary, so EOT (50256) can start documents
T = 512  # 4 blocks of 128
WINDOWS = (1, 2, 4)  # the long windows (in blocks) the tests' models know: each has its softmax scale


# The record's settings that a model of a few layers can take (as conftest.TINY_FORMS): every U-net skip and no
# backout, since the record's skip (into layer 6) and backout (after layer 7) need its depth; no paired heads.
FEW_LAYERS = dict(skip_layers="all", backout_layer=-1, paired_head_layers="none")


def tiny_gpt(num_layers=4, backend="sdpa", vocab=VOCAB, seed=0, paired_layers=()):
    """Width 32, 2 heads of 16 (a multiple of 4, as rotary needs); every U-net skip, no backout."""
    torch.manual_seed(seed)
    return train_gpt.GPT(train_gpt.GPTConfig(vocab, num_layers, num_heads=2, head_dim=16, model_dim=32, max_seq_len=T,
                                             attention_backend=backend, windows=WINDOWS, paired_layers=paired_layers))


def randomize_(model, seed=1):
    """Replace the zero-initialized weights (output projections, gates, value embeddings, lm_head) and the
    scalars' and the stream's lambdas' initial values with random ones, so that every layer and every path changes the
    output (x0's share too, zero at init); the lm_head spans the record's FP8 range (|w| <= 448 * 2^-9) so the
    softcapped logits, and the loss, depend clearly on the hidden state."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.c_proj") or name.endswith("gate.weight"):
                p.uniform_(-0.2, 0.2)
            elif name.endswith("vo_w"):
                p[1].uniform_(-0.2, 0.2)
        model.lm_head.weight.uniform_(-0.875, 0.875)
        model.scalars.add_(0.3 * torch.randn_like(model.scalars))
        if model.value_embeds is not None:  # last: the draws before keep their values
            model.value_embeds.normal_(0, 0.5)
        model.bigram_embed.weight.normal_(0, 0.1)  # smaller: a table as large as the value embeddings' swamps the context
        # the stream's lambdas after them, so that the draws before keep their values
        for lambdas in (model.resid_lambdas, model.post_lambdas, model.x0_lambdas, model.bigram_lambdas):
            lambdas.add_(0.3 * torch.randn_like(lambdas))
    return model


def documents(seed=0, n=T):
    """Random tokens with a few EOTs: several documents, one starting mid-block."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, EOT, (n + 1,), generator=g)
    tokens[[0, 100, 230, 300]] = EOT
    return tokens[:-1].int(), tokens[1:]


# Layouts from the docstrings' rules: a value-embedding table of its own on min(2, L // 4) layers from layer 1 and on
# the last min(3, (L + 1) // 4); the attention-free layer is the U's second decoder layer, moved earlier when that
# layer has a value embedding; long windows on every fourth encoder layer of the U from the first, mirrored in the
# decoder; each decoder layer's skip partner is its mirror. An odd depth is the U one layer deeper without its layer
# 0: every index one lower, and the skip into the U's last layer gone.
LAYOUTS = {
    12: dict(ve=[None, 0, 1, None, None, None, None, None, None, 2, 3, 4], attention_free=7, long=[0, 4, 7, 11],
             skips={6: 5, 7: 4, 8: 3, 9: 2, 10: 1, 11: 0}),
    11: dict(ve=[None, 0, 1, None, None, None, None, None, 2, 3, 4], attention_free=6, long=[3, 6, 10],
             skips={5: 4, 6: 3, 7: 2, 8: 1, 9: 0}),
    8: dict(ve=[None, 0, 1, None, None, None, 2, 3], attention_free=5, long=[0, 7], skips={4: 3, 5: 2, 6: 1, 7: 0}),
    5: dict(ve=[None, 0, None, None, 1], attention_free=3, long=[4], skips={2: 1, 3: 0}),
    4: dict(ve=[None, 0, None, 1], attention_free=2, long=[0, 3], skips={2: 1, 3: 0}),
    3: dict(ve=[None, None, 0], attention_free=1, long=[2], skips={1: 0}),
}


def ve_table(model, table):
    """Value-embedding table `table` of the model's one parameter, (padded vocabulary, D)."""
    return model.value_embeds.view(model.ve_tables, -1, model.value_embeds.size(1))[table]


@pytest.mark.parametrize("depth", sorted(LAYOUTS))
def test_layer_layout(depth):
    """Value-embedding tables, attention-free layer, long-window layers and U-net skips per depth (11: the record's
    value embeddings on 1, 2, 8, 9, 10, layer 6 without attention, long windows on 3 and 10, the skip 3 into 6)."""
    expected = LAYOUTS[depth]
    assert train_gpt.value_embedding_layout(depth) == expected["ve"]
    assert train_gpt.attention_free_layer(depth) == expected["attention_free"]
    long = train_gpt.long_window_layers(depth)
    assert [i for i, is_long in enumerate(long) if is_long] == expected["long"]
    assert list(train_gpt.skip_receivers(depth)) == list(expected["skips"])
    assert {i: train_gpt.skip_partner(depth, i) for i in expected["skips"]} == expected["skips"]
    # the attention-free layer must not have a value embedding: it would be unused
    assert expected["ve"][expected["attention_free"]] is None


def test_an_odd_depth_is_the_next_even_one_without_its_first_layer():
    """Depth 2L - 1 against depth 2L for L = 2..8, the U's helpers: the long-window layout loses its first entry,
    the skips (receiver and partner) move one down, and the skip whose partner was layer 0 is gone. (The value
    embeddings are placed on the model's layers, not the U's: test_layer_layout.)"""
    for half in range(2, 9):
        even, odd = 2 * half, 2 * half - 1
        assert train_gpt.u_layers(odd) == (even, 1) and train_gpt.u_layers(even) == (even, 0)
        assert train_gpt.long_window_layers(odd) == train_gpt.long_window_layers(even)[1:]
        kept = [i for i in train_gpt.skip_receivers(even) if train_gpt.skip_partner(even, i) != 0]
        assert list(train_gpt.skip_receivers(odd)) == [i - 1 for i in kept]
        assert len(kept) == len(train_gpt.skip_receivers(even)) - 1
        assert [train_gpt.skip_partner(odd, i - 1) for i in kept] == [train_gpt.skip_partner(even, i) - 1 for i in kept]


@pytest.mark.parametrize("depth", sorted(LAYOUTS))
def test_gpt_structure(depth):
    """Scalars: the lambdas on each layer's attention q/k/v and output weights (0.5, 1), interleaved, the smear's lambda
    0, skip weights (one per skip receiver) -1.5. The stream's lambdas, as the 2026-03-22 record makes them, each a
    float32 parameter of its own (the records' Adam gives them betas of their own), none of them in the scalars: per
    layer and sub-layer (attention, MLP) the stream's scale sqrt(1.1) and the output's weight 1, per layer x0's weight 0
    and the bigram embedding's 0.05. One parameter of the value-embedding tables; the bigram table, zero; the
    attention-free block; an MLP in every block; the key offset on the long-window layers' attention alone; an attention
    gate in every attention layer, a value-embedding gate in those with a table."""
    expected = LAYOUTS[depth]
    torch.manual_seed(0)
    model = train_gpt.GPT(train_gpt.GPTConfig(256, depth, num_heads=2, head_dim=16, model_dim=32, max_seq_len=T))
    L, S = depth, len(expected["skips"])
    assert model.scalars.numel() == 2 * L + 1 + S and model.smear_index == 2 * L
    assert torch.equal(model.scalars[:2 * L], torch.tensor([0.5, 1.0]).repeat(L))
    assert model.scalars[2 * L] == 0
    assert torch.equal(model.scalars[2 * L + 1:], torch.full((S,), -1.5))
    stream = dict(resid_lambdas=torch.full((L, 2), 1.1**0.5), post_lambdas=torch.ones(L, 2),
                  x0_lambdas=torch.zeros(L), bigram_lambdas=0.05 * torch.ones(L))  # the record's inits
    parameters = dict(model.named_parameters())
    for name, init in stream.items():
        p = getattr(model, name)
        assert parameters[name] is p and p.dtype == torch.float32 and torch.equal(p, init), name
    assert len({id(model.scalars), *(id(getattr(model, name)) for name in stream)}) == 5
    assert model.ve_tables == L - expected["ve"].count(None) and model.value_embeds.shape == (model.ve_tables * 256, 32)
    assert not model.bigram_embed.weight.any()
    for i, block in enumerate(model.blocks):
        assert (block.attn is None) == (i == expected["attention_free"])
        assert block.mlp is not None
        if block.attn is not None:
            assert block.attn.key_offset == (i in expected["long"])
            assert block.attn.attn_gate is not None
            assert (block.attn.ve_gate is not None) == (expected["ve"][i] is not None)


@pytest.mark.parametrize("depth", [4, 11, 12])
def test_unet_wiring(depth):
    """Observed with hooks on every block: layer 0 gets x0 (the smeared embeddings, normed) plus the bigram embedding
    (the record's hash) times layer 0's bigram lambda, added there alone; each later layer chains from the previous
    one's output, plus, in a skip receiver i, its partner's output (and no other layer's) times sigmoid(skip weight i -
    (first receiver)) 2 sigmoid(v . x0[:12]); without a backout, each layer's attention reads its own input; each layer
    gets its value-embedding table (or none), its long or short mask, the one rotary, the window's softmax scale, its
    own lambdas (attention's pair; the stream's scale and output weight per sub-layer), and, where it has attention,
    what joins after it: x0 l_0 in layer 0, x0 l_i + bigram b_i in the others (the 2026-03-22 record's x0_inject);
    the attention-free layer none."""
    model = randomize_(tiny_gpt(depth))
    L, skips, free = depth, LAYOUTS[depth]["skips"], LAYOUTS[depth]["attention_free"]
    inputs, outputs = {}, {}
    for i, block in enumerate(model.blocks):
        block.register_forward_pre_hook(lambda m, args, i=i: inputs.__setitem__(i, args))
        block.register_forward_hook(lambda m, args, out, i=i: outputs.__setitem__(i, out.detach()))
    tokens, targets = documents()
    window = 4
    with torch.no_grad():
        model(tokens, targets, window)
        x0 = train_gpt.norm(model.smear(model.embed(tokens))[None])
        masks = train_gpt.attention_masks(tokens, window, "sdpa")
        s, skip = model.scalars, model.scalars[-len(skips):]
        skip_input_gate = 2 * torch.sigmoid(torch.nn.functional.linear(x0[..., :12], model.skip_gate.weight))
        bigram = model.bigram_embed(records_bigram_hash(tokens, model.bigram_embed.num_embeddings))[None]
        x0_lambdas, bigram_lambdas = model.x0_lambdas, model.bigram_lambdas
        for i in range(L):
            x, attention_input, ve, resid, post, injected, attn, mask, rotary, scale, cache, _, restarts = inputs[i]
            assert attention_input is x and cache is None and restarts is None
            assert rotary is model.rotary and scale == model.attention_scales[window]
            assert torch.equal(resid, model.resid_lambdas[i]) and torch.equal(post, model.post_lambdas[i])
            assert torch.equal(attn, s[2 * i:2 * i + 2])
            if i == free:
                assert injected is None
            else:
                joins = x0 * x0_lambdas[0] if i == 0 else x0 * x0_lambdas[i] + bigram * bigram_lambdas[i]
                torch.testing.assert_close(injected, joins, atol=0, rtol=0)
            table = LAYOUTS[L]["ve"][i]
            if table is None:
                assert ve is None
            else:
                torch.testing.assert_close(ve, ve_table(model, table)[tokens][None], atol=0, rtol=0)
            assert torch.equal(mask, masks[False, i in LAYOUTS[L]["long"]])
            if i == 0:
                torch.testing.assert_close(x, x0 + bigram * bigram_lambdas[0], atol=0, rtol=0)
                continue
            if i not in skips:
                torch.testing.assert_close(x, outputs[i - 1], atol=0, rtol=0)
            else:
                # GPT.trunk forms the receiver's input with these very ops on these values: equal, to the bit
                gate = torch.sigmoid(skip[i - min(skips)]) * skip_input_gate
                matches = [j for j in range(i) if torch.equal(x, outputs[i - 1] + gate * outputs[j])]
                assert matches == [skips[i]], (i, matches)


def offset_by_loop(k, before=None, restarts=None):
    """The partial key offset position by position: in dims D/2..D position t takes position t-1's key, position 0
    before's (or keeps its own), a restart keeps its own; every other dim untouched."""
    D = k.size(-1)
    moved = [*range(D // 2, D)]
    out = k.clone()
    for t in range(k.size(1)):
        if (restarts is not None and restarts[t]) or (t == 0 and before is None):
            continue
        source = before[:, 0] if t == 0 else k[:, t - 1]
        out[:, t, :, moved] = source[:, :, moved]
    return out


def test_offset_keys_moves_the_second_half_one_position_on():
    """offset_keys against offset_by_loop on random keys (2, 9, 3, 16), without and with a key before and restarts
    (at 0, 4 and 5): equal, values moved whole. The moved dims, the second half, are those the rotary leaves still
    (the records from 2026-01-19; from 01-07 to 01-18 the second and fourth quarters). Gradients: each position's moved dims get the next position's incoming gradient, a
    restart's also its own, and before the first position's; autograd through the loop's copies gives the same sums of
    at most two terms: equal."""
    g = torch.Generator().manual_seed(0)
    k, before = torch.randn(2, 9, 3, 16, generator=g), torch.randn(2, 1, 3, 16, generator=g)
    restarts = torch.zeros(9, dtype=torch.bool)
    restarts[[0, 4, 5]] = True
    rotary = train_gpt.Rotary(16, max_seq_len=9)
    still = [*range(8, 16)]  # the moved dims
    assert [d for d in range(16) if rotary.freqs[d] == 0] == still
    for kwargs in (dict(), dict(before=before), dict(restarts=restarts), dict(before=before, restarts=restarts)):
        inputs = {name: t.clone().requires_grad_() for name, t in dict(k=k, before=before).items()}
        loop_inputs = {name: t.detach().clone().requires_grad_() for name, t in inputs.items()}
        args = {key: inputs[key] if key == "before" else value for key, value in kwargs.items()}
        loop_args = {key: loop_inputs[key] if key == "before" else value for key, value in kwargs.items()}
        out = train_gpt.offset_keys(inputs["k"], **args)
        expected = offset_by_loop(loop_inputs["k"], **loop_args)
        assert torch.equal(out, expected), kwargs
        rotating = [d for d in range(16) if d not in still]
        assert torch.equal(out[..., rotating], k[..., rotating])
        assert not torch.equal(out, k)
        incoming = torch.randn(out.shape, generator=g)
        out.backward(incoming)
        expected.backward(incoming)
        assert torch.equal(inputs["k"].grad, loop_inputs["k"].grad), kwargs
        if "before" in kwargs:  # a restart at 0 leaves before unread: the loop's gradient None, offset_keys' zero
            loop_grad = loop_inputs["before"].grad
            assert torch.equal(inputs["before"].grad, torch.zeros_like(before) if loop_grad is None else loop_grad)
            assert (loop_grad is None) == ("restarts" in kwargs)
    # written out: 1 feeds 2; 3 feeds none (4 restarts); 5 restarts and feeds 6, so it sums both
    k = k.clone().requires_grad_()
    incoming = torch.randn(k.shape, generator=g)
    train_gpt.offset_keys(k, restarts=restarts).backward(incoming)
    assert torch.equal(k.grad[:, 1, :, still], incoming[:, 2, :, still])
    assert not k.grad[:, 3, :, still].any()
    assert torch.equal(k.grad[:, 5, :, still], incoming[:, 5, :, still] + incoming[:, 6, :, still])


def test_the_key_offset_in_the_model_computes_the_records_forward():
    """Four layers (long windows on 0 and 3, short on 1, none in 2), random weights and lambdas: the logits equal, to
    the bit, those of the 2026-03-22 record's forward written out (records_forward: records_attention with the
    record's in-place key shift on the long layers alone, the first layer's included, the smear, the bigram embedding,
    the gated U-net skips 1 into 2 and 0 into 3, the stream's lambdas per sub-layer); the same forward written out
    without the shift differs."""
    model = randomize_(tiny_gpt())
    tokens, _ = long_document()
    window, F = 2, torch.nn.functional
    with torch.no_grad():
        logits = {shift: train_gpt.softcap(F.linear(train_gpt.norm(records_forward(
            model, tokens, window, LAYOUTS[4]["skips"], key_offset=shift)), model.lm_head.weight))
            for shift in (True, False)}
        assert torch.equal(model.softcapped_logits(model.trunk(tokens, window)), logits[True])
        assert (logits[True] - logits[False]).abs().max() > 1e-2


def uniform_eval_loss_bound(padded: int, positions: int) -> float:
    """How far eval's chunked mean loss over positions lies from ln(padded) when every logit is 15 (a zero lm_head):
    exp2 of 15 log2(e), rounded, in each of the padded equal terms; their sum, whose equal partial sums round alike;
    log's ulps; the row's subtraction; then the sum of equal row losses and its division."""
    u, log_vocab = UNIT_ROUNDOFF[torch.float32], math.log(padded)
    return ((15 + 2 * EXP_ULPS) * u - math.log1p(-worst_case_gamma(padded - 1)) + 2 * EXP_ULPS * u * (15 + log_vocab)
            + u * log_vocab + worst_case_gamma(positions - 1) * log_vocab)


def test_a_zero_lm_head_gives_uniform_logits():
    """The MLP's output projections start at zero (attention's four matrices and the up-projection drawn); with the lm_head
    zeroed (it starts drawn: test_the_records_structure_starts_as_the_record_does) every logit is the same value, the
    softcap of 0 (exp(0) is 1 in every library, after the max is taken out) and the loss is ln(50304), in both train
    (sum) and eval (mean), within the derived bound of float32's roundings: every row computes the same values, so the
    sums of equal terms (V in eval's softmax, T rows) take worst_case_gamma."""
    model = tiny_gpt()
    for block in model.blocks:
        assert block.mlp.c_proj.abs().max() == 0 and block.mlp.c_fc.abs().min(dim=-1).values.min() > 0
        if block.attn is not None:
            assert all(w.abs().min(dim=-1).values.min() > 0 for w in (block.attn.qk_w, block.attn.vo_w))  # none zero
    assert model.lm_head.weight.abs().min(dim=-1).values.min() > 0
    with torch.no_grad():
        model.lm_head.weight.zero_()
    tokens, targets = documents()
    with torch.no_grad():
        logits = model.softcapped_logits(model.trunk(tokens, 4))
        assert (logits == train_gpt.softcap(torch.zeros(()))).all() and 15 < logits[0, 0, 0] < 16
        train_loss = model(tokens, targets, 4)
        model.eval()
        eval_loss = model(tokens, targets, 4)
    u, padded = UNIT_ROUNDOFF[torch.float32], 50304
    log_vocab, rows = math.log(padded), worst_case_gamma(T - 1) * math.log(padded)
    # train: SoftcappedLoss's blocks sum V ones exactly (each rescale by exp(0) = 1); then log (within EXP_ULPS ulps,
    # like exp) and two roundings of at most 16 + ln V per row
    train_bound = 2 * EXP_ULPS * u * log_vocab + 2 * u * (16 + log_vocab) + rows
    assert_within(train_loss / T, torch.tensor(log_vocab, dtype=torch.float64), train_bound, "train loss")
    assert_within(eval_loss, torch.tensor(log_vocab, dtype=torch.float64), uniform_eval_loss_bound(padded, T),
                  "eval loss")


@pytest.mark.parametrize("vocab, padded", [(50257, 50304), (1000, 1024), (1024, 1024), (1025, 1152)])
def test_vocab_padded_to_multiple_of_128(vocab, padded):
    assert train_gpt.next_multiple(vocab, 128) == padded
    if vocab == 50257:
        model = tiny_gpt(vocab=vocab)
        assert model.lm_head.weight.shape == (padded, 32)
        assert model.embed.weight.shape == ve_table(model, 0).shape == (padded, 32)


HEAD_DIM = 16
# Rotary's float32 base frequencies: linspace puts each exponent within three roundings of at most 1 (its step,
# a multiple, a subtraction from the end), which the power scales by ln 1024; then pow's ulps (EXP_ULPS, as exp)
BASE_FREQUENCY_ERROR = math.log(1024) * gamma(3) + 2 * EXP_ULPS * UNIT_ROUNDOFF[torch.float32]


def rotate(x, positions):
    """Rotary applied to the vector x (H, D) placed at the given positions of a sequence."""
    rotary = train_gpt.Rotary(HEAD_DIM, max_seq_len=64)
    seq = x[None, None].expand(1, 64, *x.shape).clone()
    return rotary(seq)[0, positions]


def base_frequencies_by_hand(head_dim):
    """The rotary frequencies in float64 from the formula, per dim: (1/1024)^(k / (D/4 - 1)) for both dims of pair k
    = (2k, 2k + 1), k < D/4; then D/2 zeros."""
    quarter = head_dim // 4
    return torch.tensor([(1 / 1024) ** (d // 2 / (quarter - 1)) for d in range(2 * quarter)] + [0.0] * (2 * quarter),
                        dtype=torch.float64)


def rotation_by_hand(x, positions):
    """x (H, D) rotated at the given positions in float64 by the documented frequencies, pair (2k, 2k + 1) turning
    as (x cos + y sin, y cos - x sin); and an elementwise bound on rotate()'s error: each float32 angle within
    BASE_FREQUENCY_ERROR and one rounding of the exact one, its cos and sin within cos_sin_bound, then two float32
    products and their sum."""
    angle = torch.as_tensor(positions, dtype=torch.float64)[:, None, None] * base_frequencies_by_hand(x.size(-1))[0::2]
    cos, sin = angle.cos(), angle.sin()
    first, second = x.double()[..., 0::2], x.double()[..., 1::2]
    tables = (first.abs() + second.abs()) * cos_sin_bound(angle, BASE_FREQUENCY_ERROR + UNIT_ROUNDOFF[torch.float32])
    rotated = torch.stack([first * cos + second * sin, second * cos - first * sin], -1).flatten(-2)
    bound = torch.stack([tables + gamma(2) * ((first * cos).abs() + (second * sin).abs()),
                         tables + gamma(2) * ((second * cos).abs() + (first * sin).abs())], -1).flatten(-2)
    return rotated, bound


def test_rotary_rotates_adjacent_pairs_by_the_documented_frequencies():
    """Pair k = (dim 2k, dim 2k + 1) turns by position * (1/1024)^(k / (D/4 - 1)) for k < D/4, within the derived
    bound of float32's roundings (which a bf16 rounding of the result exceeds); the dims of the second half have
    frequency zero and never change, and the others move by more than it."""
    torch.manual_seed(0)
    x = torch.randn(2, HEAD_DIM)
    positions = torch.arange(64)
    out = rotate(x, positions)
    expected, bound = rotation_by_hand(x, positions)
    assert_within(out, expected, bound, "rotated", BASE_FREQUENCY_ERROR)
    with pytest.raises(AssertionError, match="times the derived bound"):
        assert_within(out.bfloat16(), expected, bound, "rotated, in bf16", BASE_FREQUENCY_ERROR)
    half = HEAD_DIM // 2
    assert torch.equal(out[:, :, half:], x[:, half:].expand(64, -1, -1))
    assert ((out[1:, :, :half] - x[:, :half]).abs() > bound[1:, :, :half]).float().mean() > 0.9


def test_paired_rotary_turns_each_pair_of_heads_at_two_positions():
    """paired=True on (B, T, H/2, 2D): the first head of each pair turned at position 2t, the second at 2t + 1, as the
    plain rotary turns them there (the same table rows and operations: equal), from a first position or each
    token's own."""
    torch.manual_seed(3)
    rotary, x = train_gpt.Rotary(HEAD_DIM, max_seq_len=64), torch.randn(1, 10, 4, HEAD_DIM)
    paired = rotary(x.view(1, 10, 2, 2 * HEAD_DIM), 5, paired=True).view(1, 10, 4, HEAD_DIM)
    at = torch.arange(5, 15)
    assert torch.equal(paired[:, :, 0::2], rotary(x[:, :, 0::2], 2 * at)) and torch.equal(paired[:, :, 1::2],
                                                                                          rotary(x[:, :, 1::2], 2 * at + 1))
    assert torch.equal(rotary(x.view(1, 10, 2, 2 * HEAD_DIM), at, paired=True), paired.view(1, 10, 2, 2 * HEAD_DIM))
    assert not torch.equal(paired, rotary(x, 5))


def test_rotary_at_each_tokens_own_position_equals_the_slice_from_a_first_position():
    """Rotary.forward with a position per token (evaluation's packed requests, each from 0) reads the same table rows
    as with the first position of a run of them: equal to the bit, also for positions that restart."""
    torch.manual_seed(2)
    rotary, x = train_gpt.Rotary(HEAD_DIM, max_seq_len=64), torch.randn(1, 10, 2, HEAD_DIM)
    assert torch.equal(rotary(x, torch.arange(7, 17)), rotary(x, 7))
    restarted = rotary(x, torch.tensor([0, 1, 2, 3, 0, 1, 2, 3, 4, 5]))
    assert torch.equal(restarted[:, :4], rotary(x[:, :4])) and torch.equal(restarted[:, 4:], rotary(x[:, 4:]))


def test_rotary_dot_product_depends_only_on_offset():
    """<R_m q, R_n k> = <R_(m-n) q, k>: each float32 dot product, its positions shifted or not, lies within
    its derived bound of that float64 function of the offset; two offsets' dot products lie further apart
    than their bounds."""
    torch.manual_seed(1)
    q, k = torch.randn(1, HEAD_DIM), torch.randn(1, HEAD_DIM)

    def dot_and_bound(m, n):
        (rotated_q, q_bound), (rotated_k, k_bound) = rotation_by_hand(q, [m]), rotation_by_hand(k, [n])
        # the rotated vectors' errors, then D float32 products and their sum
        bound = ((q_bound * rotated_k.abs() + rotated_q.abs() * k_bound).sum()
                 + gamma(HEAD_DIM) * (rotated_q * rotated_k).abs().sum())
        return (rotate(q, [m]) * rotate(k, [n])).sum(), bound

    for m, n in [(5, 2), (10, 10), (3, 40)]:
        by_offset = (rotation_by_hand(q, [m - n])[0] * k.double()).sum()
        for shift in [0, 1, 7, 20]:
            dot, bound = dot_and_bound(m + shift, n + shift)
            assert_within(dot, by_offset, bound, f"dot product at {m + shift}, {n + shift}", BASE_FREQUENCY_ERROR)
    (dot, bound), (other_dot, other_bound) = dot_and_bound(5, 2), dot_and_bound(9, 2)
    assert abs(dot - other_dot) > bound + other_bound  # but it does depend on the offset


def rescaled_by_hand(freqs, old, new, unit):
    """freqs (float64 values of float32 ones) after a window change old -> new (in units of unit tokens) by the
    formulas: f turns unit old f / (2 pi) times over the old window, w = clamp((turns - 1) / 31, 0, 1), and f
    becomes f (s + w (1 - s)) with s = old / new; and an elementwise bound on Rotary.rescale's float32 error."""
    turns = unit * old * freqs / (2 * math.pi)
    s = old / new
    w = ((turns - 1) / 31).clamp(0, 1)
    factor = s + w * (1 - s)
    # turns: a product, 2 pi to float32, a division (or a reciprocal and a product); then the subtraction and
    # the division by 31 (or a reciprocal and a product); the clamp carries the error no further
    w_error = (gamma(4) * turns + gamma(3) * (turns - 1).abs()) / 31
    # s and 1 - s to float32, a product and a sum (within 3u of the factor); then f times the factor
    return freqs * factor, (w_error * (1 - s) + gamma(4) * factor) * freqs


RECORD_CHANGES = [(3, 7), (7, 11), (11, 13)]


def test_yarn_rescale_follows_the_formula_and_rebuilds_the_tables():
    """At each of the record's three window changes the frequencies follow the float64 formula applied to the
    float32 ones before it, within the derived bound of float32's roundings (some slowed by 3/13 in all, the
    fastest unchanged, the rest between); cos and sin equal those of position x frequency within cos_sin_bound
    (the angle's float32 rounding, the functions' ulps); the frequency-zero half stays zero, its cos 1 and its
    sin 0. Windows in units of 32 tokens turn each frequency a quarter as often over the old window."""
    rotary = train_gpt.Rotary(128, max_seq_len=512)
    small = train_gpt.Rotary(128, max_seq_len=16, window_unit=32)
    base = rotary.freqs.clone()
    by_hand = base_frequencies_by_hand(128)
    assert_within(base, by_hand, BASE_FREQUENCY_ERROR * by_hand, "base frequencies")
    for old, new in RECORD_CHANGES:
        for rope in (rotary, small):
            expected, bound = rescaled_by_hand(rope.freqs.double(), old, new, rope.window_unit)
            rope.rescale(old, new)
            assert_within(rope.freqs, expected, bound, f"unit {rope.window_unit}: {old} -> {new}", gamma(4))
    assert rotary.freqs.dtype == torch.float32 and rotary.freqs.device.type == "cpu"
    ratio = (rotary.freqs / base)[:64]
    assert ratio[0] == ratio[1] == 1 and ((ratio > 3 / 13) & (ratio < 1)).any() and torch.equal(ratio[0::2], ratio[1::2])
    # the slowest frequency never blends (it turns under once): three float32 ratios, three products, a division
    assert_within(ratio[-1], torch.tensor(3 / 13, dtype=torch.float64), gamma(7) * 3 / 13, "slowest frequency's ratio")
    assert not rotary.freqs[64:].any()
    # each float32 angle is the exact product of two float32 values, rounded once; twice 512 positions; sin's odd
    # entries negated (the x sin term of a pair's second dim is subtracted)
    angles = torch.outer(torch.arange(1024, dtype=torch.float64), rotary.freqs.double())
    signs = torch.tensor([1.0, -1.0]).repeat(64)
    assert_within(rotary.cos, angles.cos(), cos_sin_bound(angles, UNIT_ROUNDOFF[torch.float32]), "cos")
    assert_within(rotary.sin, angles.sin() * signs, cos_sin_bound(angles, UNIT_ROUNDOFF[torch.float32]), "sin")
    assert (rotary.cos[:, 64:] == 1).all() and (rotary.sin[:, 64:] == 0).all()
    assert not torch.equal(small.freqs, rotary.freqs)
    # the tables moved: the unscaled ones are far from these
    assert (train_gpt.Rotary(128, max_seq_len=512).cos - rotary.cos).abs().max() > 0.5


def test_rotary_in_bf16_computes_what_the_records_from_2026_01_07_do():
    """Rotary tables in the run's dtype: the 2026-01-07 record's Yarn and YarnPairedHead written out (reset, apply with
    YaRN 3 -> 7, rotary): tables made in float32 over twice the positions, rounded to bf16, every second sin negated;
    q and k rotated in bf16 without an upcast as factor1 x + factor2 x_flip, the paired layers' on (B, T, H/2, 2D) with
    the rows of positions 2t and 2t + 1 side by side. The same operations: equal to the bit. build_model gives a bf16
    run bf16 tables, and float32 ones without a plan (inference on CPU)."""
    head_dim, positions = 64, 256
    rotary = train_gpt.Rotary(head_dim, positions, dtype=torch.bfloat16)
    x = torch.randn(1, positions, 2, head_dim).bfloat16()
    freqs = (1 / 1024) ** torch.linspace(0, 1, steps=head_dim // 4, dtype=torch.float32)
    freqs = torch.cat([freqs.repeat_interleave(2), freqs.new_zeros(head_dim // 2)])

    def records_rotary(factor1, factor2, x_BTHD):
        factor1, factor2 = factor1[None, :x_BTHD.size(-3), None, :], factor2[None, :x_BTHD.size(-3), None, :]
        x_flip = x_BTHD.view(*x_BTHD.shape[:-1], x_BTHD.shape[-1] // 2, 2).flip(-1).view(x_BTHD.shape)
        return factor1 * x_BTHD + factor2 * x_flip

    for change in (None, (3, 7)):
        if change:
            rotary.rescale(*change)
            rotations = train_gpt.BLOCK_SIZE * 3 * freqs / (2 * torch.pi)
            freqs *= 3 / 7 + torch.clamp((rotations - 1) / (32 - 1), 0, 1) * (1 - 3 / 7)
        t = torch.arange(2 * positions, dtype=torch.float32)
        theta = torch.outer(t, freqs)
        factor1, factor2 = theta.cos().to(torch.bfloat16), theta.sin().to(torch.bfloat16)
        factor2[..., 1::2] *= -1
        assert torch.equal(rotary.cos, factor1) and torch.equal(rotary.sin, factor2)
        assert torch.equal(rotary(x), records_rotary(factor1, factor2, x))
        theta1, theta2 = torch.outer(2 * t, freqs), torch.outer(2 * t + 1, freqs)
        paired1 = torch.cat((theta1.cos(), theta2.cos()), dim=-1).to(torch.bfloat16)
        paired2 = torch.cat((theta1.sin(), theta2.sin()), dim=-1).to(torch.bfloat16)
        paired2[..., 1::2] *= -1
        pairs = x.view(1, positions, 1, 2 * head_dim)
        assert torch.equal(rotary(pairs, paired=True), records_rotary(paired1, paired2, pairs))
    args = train_gpt.Hyperparameters(**FEW_LAYERS, num_layers=2, num_heads=1, head_dim=32, model_dim=32, vocab_size=256)
    plan = train_gpt.plan_device(args, torch.device("cpu"))
    assert plan.dtype == "bfloat16"
    for built, dtype in ((train_gpt.build_model(args, 256), torch.float32),
                         (train_gpt.build_model(args, 256, plan), torch.bfloat16)):
        assert built.rotary.cos.dtype == built.rotary.sin.dtype == dtype


def test_rotary_without_rescale_keeps_the_base_frequencies():
    """A model's rotary starts at the base frequencies, and a window that does not change leaves them
    (and the tables) as they were, bit for bit."""
    args = train_gpt.Hyperparameters(**FEW_LAYERS, num_layers=2, model_dim=32, num_heads=2, head_dim=16, window_stages=(2, 2, 4),
                                     final_window=4, num_iterations=8, extension_steps=0)
    model = train_gpt.build_model(args, T)
    by_hand = base_frequencies_by_hand(16)
    assert_within(model.rotary.freqs, by_hand, BASE_FREQUENCY_ERROR * by_hand, "base frequencies")
    freqs, cos = model.rotary.freqs.clone(), model.rotary.cos.clone()
    window = train_gpt.window_at(0, args)
    for step in range(5):  # the first two stages (from round(8 k / 3): 0, 3, 5), both of window 2
        window = train_gpt.move_window(model, window, step, args)
        assert window == 2
    assert torch.equal(model.rotary.freqs, freqs) and torch.equal(model.rotary.cos, cos)
    expected, bound = rescaled_by_hand(freqs.double(), 2, 4, model.rotary.window_unit)
    assert train_gpt.move_window(model, window, 5, args) == 4
    assert_within(model.rotary.freqs, expected, bound, "frequencies after 2 -> 4", gamma(4))


def expected_nonzero_grads(L):
    """Where the gradient is nonzero, per tensor of lambdas: attention's lambdas (on its q/k/v weights and on its
    output projection's) wherever there is attention, the smear's lambda and the skip weights always (randomize_ fills
    the gates and the bigram table); of the stream's lambdas, the MLP's scale and weight in every layer, the attention's
    and the weights of x0 and the bigram embedding in the attention layers alone (both join after attention), and layer
    0's bigram lambda also there (the embedding's one share before the layers)."""
    free = train_gpt.attention_free_layer(L)
    attention = torch.tensor([i != free for i in range(L)])
    sub_layers = torch.stack([attention, torch.ones(L, dtype=torch.bool)], dim=1)
    return dict(scalars=torch.cat([attention.repeat_interleave(2), torch.ones(1 + len(LAYOUTS[L]["skips"]),
                                                                              dtype=torch.bool)]),
                resid_lambdas=sub_layers, post_lambdas=sub_layers, x0_lambdas=attention, bigram_lambdas=attention)


def test_forward_backward_fp32_reaches_every_parameter():
    """fp32, SDPA backend, several documents, the key offset on the long layers: every parameter gets a finite
    gradient, nonzero wherever it is used (per entry of the scalars and the stream's lambdas: exactly the entries the
    forward uses; the attention-free layer's x0 and bigram lambdas and its attention sub-layer's scale and weight
    none)."""
    model = randomize_(tiny_gpt())
    tokens, targets = documents()
    model(tokens, targets, 2).backward()
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        assert torch.isfinite(p.grad).all(), name
        assert p.grad.abs().max() > 0, name
    for name, nonzero in expected_nonzero_grads(4).items():
        assert torch.equal(getattr(model, name).grad != 0, nonzero), name


def test_bf16_embeddings_path():
    """Embedding tables (the token's, the value and bigram ones) stored in bf16, as training stores them, make the
    whole forward bf16: the other weights are cast to it, lambdas rounded to it, results rounded to it up to the
    float32 logits; rms_norm's eps stays float32's (torch norms bf16 in float32, with float32's eps, which the tied
    embedding's small initial rows show). It runs forward and backward, and its loss
    lies within the probabilistic first-order bound (tests/rounding.py) of a float64 twin with float32's eps; that
    twin gives the fp32 loss within first_order_bound."""
    model = randomize_(tiny_gpt())
    tokens, targets = documents()
    float64_model = copy.deepcopy(model).double()
    fp32_exact, fp32_bound = first_order_bound(lambda: summed_loss(float64_model, tokens, targets, 2))
    with torch.no_grad():
        assert abs(model(tokens, targets, 2).item() - fp32_exact) <= fp32_bound
    for table in [model.embed, model.bigram_embed]:
        table.to(torch.bfloat16)
    model.value_embeds.data = model.value_embeds.data.bfloat16()
    with TorchCalls() as bf16_forward:
        loss = summed_loss(model, tokens, targets, 2)
    loss.backward()
    with TorchCalls(norm_dtype=torch.float32) as float64_forward:
        float64_loss = summed_loss(float64_model, tokens, targets, 2)
    tables = [float64_model.embed.weight, float64_model.value_embeds, float64_model.bigram_embed.weight]
    bound = probabilistic_bound(bf16_forward, float64_forward, float64_loss, tables)
    assert_within(loss.detach(), float64_loss.detach(), bound, "bf16 loss")
    assert model.embed.weight.grad.dtype == torch.bfloat16
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


def long_document():
    """documents(3) with two of its document starts removed: documents at 0..99 and 100..511."""
    tokens, targets = documents(3)
    tokens = tokens.clone()
    tokens[[230, 300]] = 1
    return tokens, targets


def summed_loss(model, tokens, targets, window):
    """The training loss of the next token alone as plain differentiable operations, which tests/rounding.py traces:
    the summed cross-entropy of the float32 softcap, what SoftcappedLoss computes with weights (1,)."""
    logits = model.softcapped_logits(model.trunk(tokens, window))
    return torch.nn.functional.cross_entropy(logits.view(-1, logits.size(-1)), targets, reduction="sum")


def exact_loss_and_bound(model, tokens, targets, window):
    """The model's summed training loss in float64 and the first-order bound on the error of any float32
    evaluation (tests/rounding.py): SDPA and FlexAttention kernels, eager or compiled, round within it."""
    exact = copy.deepcopy(model).double()
    return first_order_bound(lambda: summed_loss(exact, tokens, targets, window))


@needs_flex_on_cpu
def test_compiled_flex_model_matches_sdpa(monkeypatch):
    """The flex backend under torch.compile (BlockMasks built inside the graph, the window an int as in
    training) gives the SDPA backend's training loss for the same weights (fp32), both within the derived
    bound of the float64 loss, on a document longer than both windows: a window of 2 blocks cuts the long
    layers' keys (256) and the short ones' (128); layer 1's heads paired, over its doubled sequence. Inductor's CPU
    FlexAttention template takes no epilogue (torch 2.13: NotImplementedError), so the attention gate's product
    after it stays a kernel of its own here (CPU training attends by SDPA). randomize_'s seed 2: weights under which
    the far keys move the loss past the bound (not all draws do), as the control at the end asserts."""
    monkeypatch.setattr(torch._inductor.config, "epilogue_fusion", False)
    sdpa = randomize_(tiny_gpt(backend="sdpa", paired_layers=(1,)), seed=2)
    flex = tiny_gpt(backend="flex", paired_layers=(1,))
    flex.load_state_dict(sdpa.state_dict())
    compiled = torch.compile(flex, dynamic=False)
    tokens, targets = long_document()
    exact, bound = exact_loss_and_bound(sdpa, tokens, targets, 2)
    with torch.no_grad():
        assert abs(sdpa(tokens, targets, 2).item() - exact) <= bound
        assert abs(compiled(tokens, targets, 2).item() - exact) <= bound
        # the same scale with the masks of a 1-block window, outside the bound: a wrong window would show
        logits = sdpa.softcapped_logits(sdpa.trunk(tokens, 2, train_gpt.attention_masks(tokens, 1, "sdpa", paired=True)))
        assert abs(torch.nn.functional.cross_entropy(logits[0], targets, reduction="sum").item() - exact) > bound


@needs_flex_on_cpu
def test_uncompiled_flex_model_compiles_the_attention_kernel_alone(monkeypatch):
    """With compile=false the flex backend still attends through FlexAttention's compiled kernel (eager
    flex_attention would materialize every score, and warns that it does): the float64 loss within the
    derived bound, as with SDPA and the dense masks, for a window that cuts both masks, and no such warning."""
    import torch.nn.attention.flex_attention as flex_module
    monkeypatch.setattr(flex_module, "_WARNINGS_SHOWN", set())  # it warns once per process
    sdpa = randomize_(tiny_gpt(backend="sdpa"))
    flex = tiny_gpt(backend="flex")
    flex.load_state_dict(sdpa.state_dict())
    tokens, targets = long_document()
    exact, bound = exact_loss_and_bound(sdpa, tokens, targets, 2)
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert abs(flex(tokens, targets, 2).item() - exact) <= bound
    assert not [w for w in caught if "without torch.compile" in str(w.message)]


def test_gradients_become_ready_in_reversed_parameter_order():
    """GradientBuckets packs parameters in reversed(model.parameters()) order, assuming that is the
    order in which backward finishes them. Recorded with post-accumulate-grad hooks: lm_head first,
    then the blocks from last to first (each block's parameters before any of an earlier block's),
    then scalars, the stream's lambdas, embeddings and the gates of the smear and of the skips' input, used throughout
    or first: the skips' gate on x0 is made once before the layers (the record's skip_gate_out), so its gradient is
    complete only once backward has left the blocks, although the first skip receiver (layer 4) is the last to add to
    it. Listed after every block, the skip's gate is in bucket order too."""
    model = randomize_(tiny_gpt(8))
    L = 8
    order = []
    for name, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(lambda p, name=name: order.append(name))

    def stage(name):  # 0: lm_head, 1..L: blocks L-1..0, L+1: used by every layer, or made before them
        if name == "lm_head.weight":
            return 0
        if name.startswith("blocks."):
            return L - int(name.split(".")[1])
        return L + 1

    tokens, targets = documents()
    model(tokens, targets, 2).backward()
    assert sorted(order) == sorted(name for name, _ in model.named_parameters())
    assert order[0] == "lm_head.weight"
    ready = [stage(name) for name in order]
    assert ready == sorted(ready), order
    listed = [name for name, _ in reversed(list(model.named_parameters()))]
    bucket_order = [stage(name) for name in listed]
    assert bucket_order == sorted(bucket_order)
    assert listed[listed.index("skip_gate.weight") - 1] == "blocks.0.attn.qk_w"  # listed after every block


def softcapped_loss_bounds(xn, w, targets):
    """The float64 summed cross-entropy of softcapped logits xn @ w^T, with a first-order bound on the error of
    chunked_eval_loss's float32 evaluation from these exact inputs: s = softcap / cap, exp2 of s * cap * log2(e), no
    max taken out."""
    u, cap, scale = UNIT_ROUNDOFF[torch.float32], train_gpt.LOGIT_SOFTCAP, 1 / train_gpt.LOGIT_SOFTCAP_SPREAD
    x, w = xn.double(), w.double()
    (T, D), V = x.shape, w.size(0)
    z = x @ w.T + train_gpt.LOGIT_OFFSET
    s = torch.sigmoid(z * scale)
    # the dot product, the offset's sum, then the scaling (a division, or a rounded 1/spread and a product), sigmoid;
    # then the product by cap and the division by it (or a rounded 1/cap and a product)
    s_err = (s * (1 - s) * scale * (gamma(D) * x.abs() @ w.abs().T + 3 * u * z.abs()) + (2 * EXP_ULPS + 2) * u * s
             + 3 * u * s)
    # each exp term's relative error: its argument's (s's, and two roundings of a logit up to cap), then exp's
    term_err = (cap * s_err + 2 * u * cap + 2 * EXP_ULPS * u).amax(-1, keepdim=True)
    logits = cap * s
    lse = logits.logsumexp(-1, keepdim=True)
    one_hot = torch.nn.functional.one_hot(targets, V).double()
    target_s, target_s_err = (s * one_hot).sum(-1, keepdim=True), (s_err * one_hot).sum(-1, keepdim=True)
    rows = lse - cap * target_s
    # a row: the terms' errors, the sum of V terms, log's ulp, the target logit's error and rounding, the subtraction
    row_err = term_err + gamma(V) + 2 * u * lse.abs() + cap * target_s_err + 2 * u * cap * target_s + u * rows.abs()
    loss_err = row_err.sum() + gamma(2 * T) * rows.abs().sum()  # chunk sums, then a running total
    return dict(loss=rows.sum(), loss_bound=loss_err, relative=float(term_err.max()) + gamma(V))


@functools.cache
def softcapped_loss_case():
    """Normed inputs, an lm_head weight spanning the FP8 range and targets over several documents, with
    softcapped_loss_bounds' float64 loss and bound for them."""
    model = randomize_(tiny_gpt())
    torch.manual_seed(2)
    xn, w = train_gpt.norm(torch.randn(T, 32)), model.lm_head.weight.detach()
    _, targets = documents(seed=3)
    return xn, w, targets, softcapped_loss_bounds(xn, w, targets)


@pytest.mark.parametrize("chunk, compiled", [(7, False), (100, False), (512, False), (4096, False), (100, True)])
def test_the_eval_loss_in_float32_is_the_float64_loss(chunk, compiled, monkeypatch):
    """chunked_eval_loss at float32, EVAL_LOSS_CHUNK rows at a time for chunks that divide T, that do not (7, 100),
    and that exceed it, eager and compiled (inductor fuses the pass over the logits): the float64 summed cross-entropy
    of the softcapped logits within the derived float32 bound; a loss 1% off is outside it."""
    xn, w, targets, exact = softcapped_loss_case()
    monkeypatch.setattr(train_gpt, "EVAL_LOSS_CHUNK", chunk)
    loss_fn = train_gpt.chunked_eval_loss
    if compiled:
        torch._dynamo.reset()
        loss_fn = torch.compile(loss_fn, fullgraph=True)
    with torch.no_grad():
        loss = loss_fn(xn, w, targets, train_gpt.LOGIT_SOFTCAP, train_gpt.LOGIT_OFFSET)
    assert loss.dtype == torch.float32
    assert_within(loss, exact["loss"], exact["loss_bound"], "loss", exact["relative"])
    with pytest.raises(AssertionError, match="times the derived bound"):
        assert_within(loss * 1.01, exact["loss"], exact["loss_bound"], "", exact["relative"])


@pytest.mark.parametrize("fp8", [False, True])
def test_the_model_takes_its_losses_from_softcapped_loss_and_the_eval_loss(fp8):
    """GPT.forward in training: the summed loss and every parameter gradient are those of SoftcappedLoss on the normed
    trunk output and the lm_head's weight (the next token alone), to the bit, with the model's FP8 scales where it
    takes them (the record's x and w scales, its grad scale times the loss scale), else none; the lm_head itself has no
    FP8 (generation's and evaluation's logits: a plain matmul in training too). In evaluation, the mean of
    chunked_eval_loss over the normed trunk output, to the bit. (A vocabulary of 1000: the loss's cost is its logits'.)"""
    inputs, targets = (tokens % 1000 for tokens in documents())
    torch.manual_seed(0)
    model = randomize_(train_gpt.GPT(train_gpt.GPTConfig(1000, 4, num_heads=2, head_dim=16, model_dim=32, max_seq_len=T,
                                                         windows=WINDOWS, fp8=fp8, loss_scale=0.5))).train()
    x_s, w_s, grad_s = train_gpt.LM_HEAD_FP8_SCALES
    assert model.fp8_scales == ((x_s, w_s, 0.5 * grad_s) if fp8 else None)
    assert not hasattr(model.lm_head, "fp8_scales")
    by_hand = copy.deepcopy(model)
    loss = model(inputs, targets, 4)
    loss.backward()
    x = train_gpt.norm(by_hand.trunk(inputs, 4))
    assert torch.equal(by_hand.lm_head(x), torch.nn.functional.linear(x, by_hand.lm_head.weight))
    expected = train_gpt.SoftcappedLoss.apply(x.view(-1, x.size(-1)), by_hand.lm_head.weight, targets, torch.ones(1),
                                              by_hand.logit_cap, by_hand.logit_offset, by_hand.fp8_scales).sum()
    expected.backward()
    assert torch.equal(loss, expected)
    for (name, p), twin in zip(model.named_parameters(), by_hand.parameters()):
        assert torch.equal(p.grad, twin.grad), name
    with torch.no_grad():
        val = model.eval()(inputs, targets, 4)
        x = train_gpt.norm(model.trunk(inputs, 4))
        assert torch.equal(val, train_gpt.chunked_eval_loss(x[0], model.lm_head.weight, targets, model.logit_cap,
                                                            model.logit_offset) / T)


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
@pytest.mark.parametrize("lm_head", ["fp8", "plain"])
def test_the_captured_graphs_compute_eager_s_numbers(backend, lm_head):
    """torch.compile's capture (backend eager: dynamo's graph) and its forward and backward graphs (aot_eager: AOT
    autograd's) run eager's kernels, so the loss and every parameter gradient equal eager's to the bit: on the
    record's path (the lm_head's FP8 matmul; dense masks stand in for FlexAttention, whose backward needs CUDA) and the
    CPU's (without FP8), both inside the whole-logits loss (SoftcappedLoss). torch 2.11's capture gave zero
    gradients for a loss that an autograd.Function summed in place; inductor's kernels round apart, within the
    bounds derived above."""
    results = []
    for compiled in (False, True):
        torch.manual_seed(0)
        model = randomize_(train_gpt.GPT(train_gpt.GPTConfig(VOCAB, 4, num_heads=2, head_dim=16, model_dim=32,
                                                             max_seq_len=T, fp8=lm_head == "fp8",
                                                             windows=WINDOWS))).train()
        inputs, targets = documents()
        torch._dynamo.reset()
        forward = torch.compile(model, backend=backend, fullgraph=True, dynamic=False) if compiled else model
        loss = forward(inputs, targets, 4)
        loss.backward()
        results.append([loss.detach(), *(p.grad for p in model.parameters())])
    assert all(g.abs().sum() > 0 for g in results[0])  # every parameter has a gradient to lose
    for (name, _), eager, captured in zip([("loss", None), *model.named_parameters()], *results):
        assert torch.equal(captured, eager), name


def records_structure_gpt(num_layers=11, backout_layer=7, windows=WINDOWS, seed=0, skip_layers=(6,),
                          paired_layers=(0, 2, 5, 9)):
    """The records' structure of 2026-03-22, at width 32: the 12-layer U without its layer 0, the smear, attention
    gates, value embeddings on 1, 2, 8, 9, 10 with their gates, one sigmoid-gated skip (3 into 6; None: every
    receiver, 4..0 into 5..9) with its input gate, the stream's lambdas per sub-layer, the backout (after block 7,
    whose output the later layers' attention reads), the key offset on the long-window layers, the heads paired in
    layers 0, 2, 5 and 9, q/k/v/o drawn with std 0.5 / sqrt(d), the lm_head with std 0.005 and the embedding its copy,
    the bigram hash embedding."""
    torch.manual_seed(seed)
    return train_gpt.GPT(train_gpt.GPTConfig(VOCAB, num_layers, num_heads=2, head_dim=16, model_dim=32, max_seq_len=T,
                                             windows=windows, skip_layers=skip_layers, backout_layer=backout_layer,
                                             paired_layers=paired_layers))


def replay_records_draws(D: int, layers: int, attention_layers: int, vocab: int, value_tables: int = 5,
                         seed: int = 0, heads: int = 2, one_bank: bool = False) -> dict:
    """The 2026-02-03 record's construction (the 2026-03-22 record's draws the same: its stream lambdas draw nothing),
    its draws in its own form up to the lm_head's (the embedding's and the bigram table's after it are replaced or
    zeroed): the smear's and skip's nn.Linear(12, 1), the value embeddings 0.01 randn (value_tables x vocab, D), one
    uniform_ on the whole attention bank and one on the MLP bank's up-projections (one padding MLP), both with std
    0.5 / sqrt(D), the lm_head drawn (D, vocab) with std 0.005. The attention bank as the 2026-04-08 record draws it,
    its q and k head-pair blocks (attention_layers x 2 x heads / 2, 2 D / heads, D) first, then its v and o, or
    (one_bank) as one bank of each layer's q, k, v and o (the records before)."""
    torch.manual_seed(seed)
    for _ in range(2):
        torch.nn.Linear(min(12, D), 1, bias=False)
    value_embeds = 0.01 * torch.randn(value_tables * vocab, D)
    bound = 3**0.5 * (0.5 * D**-0.5)
    if one_bank:
        qkvo = torch.empty(attention_layers, 4 * D, D).uniform_(-bound, bound).view(attention_layers, 4, D, D)
        qk, vo = qkvo[:, :2].reshape(attention_layers, heads, 2 * D // heads, D), qkvo[:, 2:]
    else:
        qk = torch.empty(attention_layers * heads, 2 * D // heads, D).uniform_(-bound, bound)
        vo = torch.empty(2 * attention_layers, D, D).uniform_(-bound, bound)
    mlp_bank = torch.empty(layers + 1, 2, 4 * D, D)
    mlp_bank[:, 0].uniform_(-bound, bound)
    return dict(value_embeds=value_embeds, qk=qk.view(attention_layers, heads, 2 * D // heads, D),
                vo=vo.view(attention_layers, 2, D, D), c_fc=mlp_bank[:layers, 0],
                lm_head=torch.empty(D, vocab).normal_(0, 0.005))


def drawn_attention_equal(model, drawn) -> list[bool]:
    """For each attention layer of model, in order: whether its q and k blocks, and its v and o, are drawn's."""
    layers = [block.attn for block in model.blocks if block.attn is not None]
    return [torch.equal(attn.qk_w, qk) and torch.equal(attn.vo_w, vo)
            for attn, qk, vo in zip(layers, drawn["qk"], drawn["vo"], strict=True)]


def test_the_records_structure_starts_as_the_record_does():
    """Attention in every layer but 6 (its key offset on 3 and 10), an MLP in each; 29 scalars: the (0.5, 1) lambdas of
    each layer's attention, the smear's lambda at 0, the backout's at 0.5, five skip weights at -1.5; the stream's
    lambdas as the 2026-03-22 record makes them ((11, 2) scales sqrt(1.1), (11, 2) output weights 1, x0's 0 and the
    bigram's 0.05), Adam's alone, each with the record's betas (0.9, 0.95) and no decay, the scales at the scalars' lr
    and the weights at a fifth of it (the record's lr multipliers 5 and 1); the gates (smear, skip, attention, value
    embeddings) and the bigram table zero; the value embeddings, the matrices, the lm_head and the embedding (its copy)
    as the record's construction draws them (replay_records_draws); a replay from another seed differs in each."""
    model = records_structure_gpt()
    assert [i for i, b in enumerate(model.blocks) if b.attn is not None] == [0, 1, 2, 3, 4, 5, 7, 8, 9, 10]
    assert [i for i, b in enumerate(model.blocks) if b.attn is not None and b.attn.key_offset] == [3, 10]
    assert [i for i, b in enumerate(model.blocks) if b.attn is not None and b.attn.ve_gate is not None] == [1, 2, 8, 9, 10]
    expected = torch.cat([torch.tensor([0.5, 1.0]).repeat(11), torch.tensor([0.0, 0.5]), torch.full((5,), -1.5)])
    assert torch.equal(model.scalars.detach(), expected)
    stream = dict(resid_lambdas=torch.full((11, 2), 1.1**0.5), post_lambdas=torch.ones(11, 2),
                  x0_lambdas=torch.zeros(11), bigram_lambdas=0.05 * torch.ones(11))  # the record's inits
    for name, init in stream.items():
        assert torch.equal(getattr(model, name).detach(), init), name
    args = train_gpt.Hyperparameters()
    adam, muon = train_gpt.build_optimizers(model, args)
    group_of = {id(p): group for group in adam.param_groups for p in group["params"]}
    assert not {id(getattr(model, name)) for name in stream} & {id(p) for g in muon.param_groups for p in g["params"]}
    for name in stream:
        group = group_of[id(getattr(model, name))]
        assert tuple(group["betas"]) == (0.9, 0.95) and group["wd_mul"] == 0, name
        assert group["lr"] == (args.scalar_lr if name == "resid_lambdas" else args.scalar_lr / 5), name
    assert train_gpt.SCALAR_LR_MUL == 5 and tuple(group_of[id(model.scalars)]["betas"]) == (0.9, 0.99)
    gates = [model.smear_gate, model.skip_gate] + [g for b in model.blocks if b.attn is not None
                                                   for g in (b.attn.attn_gate, b.attn.ve_gate) if g is not None]
    assert len(gates) == 17 and all(g.weight.size(1) == 12 and not g.weight.any() for g in gates)
    assert model.bigram_embed.weight.shape == (5 * 50304, 32) and not model.bigram_embed.weight.any()
    padded = train_gpt.next_multiple(VOCAB, 128)
    for seed, same in ((0, True), (1, False)):
        drawn = replay_records_draws(32, 11, 10, padded, seed=seed)
        found = [torch.equal(model.value_embeds, drawn["value_embeds"]), *drawn_attention_equal(model, drawn)]
        found += [torch.equal(b.mlp.c_fc, r) for b, r in zip(model.blocks, drawn["c_fc"])]
        found += [torch.equal(model.lm_head.weight, drawn["lm_head"].T), torch.equal(model.embed.weight, drawn["lm_head"].T)]
        assert found == [same] * 24, seed
    # the draws of the records before 2026-04-08, a bank per layer: other attention weights, the same rest
    assert drawn_attention_equal(model, replay_records_draws(32, 11, 10, padded, one_bank=True)) == [False] * 10
    assert {id(g.weight) for g in gates} <= set(group_of)


def records_bigram_hash(tokens, rows):
    """The 2026-01-19 record's get_bigram_hash as it wrote it, in place: the first position's row the last, then
    (36313 t XOR 27191 p) mod (rows - 1) in int32 from the tensor whose first entry it has just overwritten."""
    x = tokens.to(torch.int32).clone()
    x[0] = rows - 1
    x[1:] = torch.bitwise_xor(36313 * x[1:], 27191 * x[:-1]) % (rows - 1)
    return x


def records_attention(attn, x, ve, sa_lambdas, mask, rotary, scale, key_offset):
    """The 2026-01-07 record's CausalSelfAttention.forward written out (its dense-mask attention through attend):
    sa_lambdas[0] on the q/k/v weights, QK norm, rotary, the key offset of dims D/2..D (2026-01-19), v + 2 sigmoid(gate)
    ve, its gate reading cat(x[:6], ve[:6]) (2026-02-03), the gate, sa_lambdas[1] on the output weights; and its
    PairedHeadCausalSelfAttention.forward where attn is paired: q and k viewed (B, T, H/2, 2d) for the rotary at
    positions 2t, 2t + 1 (paired=True), then (B, 2T, H/2, d), v reshaped so, the value-embedding gate reading x[:12]
    viewed (B, 2T, H/2, 1), the output viewed back (B, T, H, d)."""
    B, T, D = x.shape
    H, d = attn.num_heads, attn.head_dim
    qkvo_w = torch.cat([attn.qk_w.flatten(end_dim=1), attn.vo_w.flatten(end_dim=1)])  # its banks' rows, as it joins them
    q, k, v = torch.nn.functional.linear(x, sa_lambdas[0] * qkvo_w[:3 * D].type_as(x)).view(
        B, T, 3 * H, d).chunk(3, dim=-2)
    q, k = train_gpt.norm(q), train_gpt.norm(k)
    if attn.paired:
        q = rotary(q.view(B, T, H // 2, 2 * d), paired=True).view(B, 2 * T, H // 2, d)
        k = rotary(k.view(B, T, H // 2, 2 * d), paired=True).view(B, 2 * T, H // 2, d)
        v = v.reshape(B, 2 * T, H // 2, d)
    else:
        q, k = rotary(q), rotary(k)
    if key_offset:  # the record's in-place shift, its right side read before the write (as compiled)
        k = k.clone()
        k[:, 1:, :, d // 2:] = k[:, :-1, :, d // 2:].clone()
    if ve is not None:
        gate_input = x[..., :12] if attn.paired else torch.cat([x[..., :6], ve[0][None, ..., :6]], dim=-1)
        gate = 2 * torch.sigmoid(torch.nn.functional.linear(gate_input, attn.ve_gate.weight))
        v = v + gate.view(B, 2 * T, H // 2, 1) * ve.view_as(v) if attn.paired else v + gate.view(B, T, H, 1) * ve.view_as(v)
    y = train_gpt.attend(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask, scale).transpose(1, 2)
    y = y.contiguous().view(B, T, H, d)
    y = y * torch.sigmoid(torch.nn.functional.linear(x[..., :12], attn.attn_gate.weight)).view(B, T, H, 1)
    return torch.nn.functional.linear(y.contiguous().view(B, T, D), sa_lambdas[1] * qkvo_w[3 * D:].type_as(y))


def records_forward(model, tokens, window, skips, long_window=None, backout_layer=-1, key_offset=True,
                    backout_attention=True, inject="after attention", lambda_dtype=None):
    """The 2026-03-22 record's GPT.forward written out up to the final stream (before its norm), on the layers of
    LAYOUTS[L] (L the model's depth) with the skips {receiver: partner} given: the smear, x = x0 = norm(smeared); x +
    bigram b_0 once (the bigram embedding's rows by the record's hash); x0_inject, made before the layers: x0 l_0, then
    x0 l_i + bigram b_i; in layer i, a skip receiver first adds its partner's output times sigmoid(w) 2 sigmoid(v .
    x0[:12]) (the record's skip_gate_out); an attention layer computes attn_out by records_attention on norm(x), or,
    past the backout layer, on norm of the stream as that layer left it (the record's x_backout), then x = r_a x + p_a
    attn_out + x0_inject_i; every layer x = r_m x + p_m mlp(norm(x)); the backout layer's output times its lambda taken
    out at the end. The long layers attend over (long_window or window) blocks with the key offset, the others over half
    the window, over the doubled sequence where the model pairs their heads. The stream's four lambda tensors in the
    stream's dtype (the record's .bfloat16()). Controls: lambda_dtype keeps them in another; backout_attention=False
    attends over the stream itself past the backout layer; inject="into the input" adds x0_inject_i to the layer's input
    before its attention reads it, as the records before 2026-02-12 added x0 and the bigram to each layer's input."""
    F, norm, L = torch.nn.functional, train_gpt.norm, model.num_layers
    layout = LAYOUTS[L]
    s = model.scalars
    sa_lambdas, smear_lambda, backout_lambda = s[:2 * L].view(L, 2), s[2 * L], s[2 * L + 1]
    skip_weights, first_receiver = s[s.numel() - len(layout["skips"]):], min(layout["skips"])
    e = model.embed(tokens)
    gate = smear_lambda * torch.sigmoid(F.linear(e[1:, :12], model.smear_gate.weight))
    x = x0 = norm(torch.cat([e[:1], e[1:] + gate * e[:-1]])[None])
    resid, post, x0_lambdas, bigram_lambdas = (p.to(lambda_dtype or x.dtype) for p in (
        model.resid_lambdas, model.post_lambdas, model.x0_lambdas, model.bigram_lambdas))
    bigram = model.bigram_embed(records_bigram_hash(tokens, model.bigram_embed.num_embeddings))[None]
    x = x + bigram * bigram_lambdas[0]
    x0_inject = (x0 * x0_lambdas[0],) + tuple(x0 * x0_lambdas[i] + bigram * bigram_lambdas[i] for i in range(1, L))
    skip_gate_out = {i: torch.sigmoid(skip_weights[i - first_receiver]) * 2 * torch.sigmoid(
        F.linear(x0[..., :12], model.skip_gate.weight)) for i in skips}
    ve = [None if t is None else ve_table(model, t)[tokens][None] for t in layout["ve"]]
    long_mask = train_gpt.attention_mask(tokens, (long_window or window) * train_gpt.BLOCK_SIZE, "sdpa")
    short_mask = train_gpt.attention_mask(tokens, window // 2 * train_gpt.BLOCK_SIZE, "sdpa")
    paired_mask = train_gpt.attention_mask(tokens, window // 2 * train_gpt.BLOCK_SIZE, "sdpa", paired=True)
    outputs, x_backout = {}, None
    for i, block in enumerate(model.blocks):
        if i in skips:
            x = x + skip_gate_out[i] * outputs[skips[i]]
        if inject == "into the input":
            x = x + x0_inject[i]
        if i != layout["attention_free"]:
            long = i in layout["long"]
            mask = long_mask if long else paired_mask if block.attn.paired else short_mask
            attn_in = x_backout if x_backout is not None and backout_attention else x
            attn_out = records_attention(block.attn, norm(attn_in), ve[i], sa_lambdas[i], mask, model.rotary,
                                         model.attention_scales[window], key_offset=key_offset and long)
            if inject == "after attention":
                x = resid[i, 0] * x + post[i, 0] * attn_out + x0_inject[i]
            else:
                x = resid[i, 0] * x + post[i, 0] * attn_out
        x = resid[i, 1] * x + post[i, 1] * F.linear(F.relu(F.linear(norm(x), block.mlp.c_fc.type_as(x))).square(),
                                                    block.mlp.c_proj.T.type_as(x))
        outputs[i] = x
        if i == backout_layer:
            x_backout = x
    return x if x_backout is None else x - backout_lambda * x_backout


@pytest.mark.parametrize("listing", ["2025-12-14", "full U"])
@pytest.mark.parametrize("window, long_window", [(1, None), (2, None), (4, None), (2, 4)])
def test_the_records_structure_computes_the_records_forward(window, long_window, listing):
    """The trunk against the 2026-03-22 record's GPT.forward written out, blocks included (records_forward; and a U-net
    of every skip, 4..0 into 5..9): the smear; the bigram embedding once before layer 0 and, with x0, after each later
    attention (x0 alone after layer 0's); layer 3's output added through a sigmoid gate times 2 sigmoid(v . x0[:12])
    where layer 6 has no attention; each sub-layer's r x + p out; attention by records_attention, the heads paired in
    0, 2, 5 and 9 (their short window over the doubled sequence), the key shifted on the long layers 3 and 10; layers
    8, 9 and 10 attending over the stream as layer 7 left it, which times its lambda is taken out at the end; the final
    validation's wider long window on 3 and 10 alone. The same operations in the same order: equal to the bit, with
    every weight and lambda random. Controls, each differing: layers 8..10 attending over their own input (the records
    before 2026-03-06), x0 and the bigram joining each layer's input before its attention (before 2026-02-12)."""
    unet = listing == "full U"
    model = randomize_(records_structure_gpt(skip_layers=None if unet else (6,)))
    tokens, _ = documents()
    skips = LAYOUTS[11]["skips"] if unet else {6: 3}
    forward = functools.partial(records_forward, model, tokens, window, skips, long_window, backout_layer=7)
    with torch.no_grad():
        trunk = model.trunk(tokens, window, long_window=long_window)
        assert torch.equal(trunk, forward())
        assert not torch.equal(trunk, forward(backout_attention=False))
        assert not torch.equal(trunk, forward(inject="into the input"))


def test_the_smear_by_hand():
    """e'_0 = e_0 and e'_t = e_t + lambda sigmoid(w . e_t[:12]) e_(t-1), token by token in float64 from the float64
    model's own weights, on both sides: the 12-term dot within gamma(12) of sum |w e| (sigmoid's slope, at most 1/4,
    shrinks it), the gate's exp within EXP_ULPS units and three more roundings, the product and the sum one each."""
    model = randomize_(records_structure_gpt()).double()
    e = torch.randn(40, 32, dtype=torch.float64)
    w, lam = model.smear_gate.weight[0].detach(), model.scalars[model.smear_index].item()
    smeared = model.smear(e).detach()
    continued = model.smear(e[10:], e[9:10]).detach()  # generation's form: tokens after a known one, smeared by it
    assert torch.equal(smeared[0], e[0])
    for t in range(1, 40):
        dot = sum(w[k].item() * e[t, k].item() for k in range(12))
        gate = lam / (1 + math.exp(-dot))
        expected = e[t] + gate * e[t - 1]
        dot_error = worst_case_gamma(12, torch.float64) * sum(abs(w[k].item() * e[t, k].item()) for k in range(12))
        gate_error = 2 * (abs(lam) * dot_error / 4 + worst_case_gamma(2 * EXP_ULPS + 3, torch.float64) * abs(gate))
        bound = gate_error * e[t - 1].abs() + 2 * worst_case_gamma(2, torch.float64) * (e[t].abs() + abs(gate) * e[t - 1].abs())
        assert_within(smeared[t], expected, bound, f"token {t}")
        if t >= 10:
            assert_within(continued[t - 10], expected, bound, f"token {t} after token {t - 1}")


def gated_attention_and_twin(width: int, heads: int):
    """An attention layer with a value-embedding gate and random weights (output projection included), and its twin,
    the same weights and zero gates: 2 sigmoid(0) = 1 exactly on the value embedding, sigmoid(0) = 1/2 exactly on the
    output; and the rest of their arguments: a value embedding, lambdas, a mask over documents, a rotary and a scale.
    Called with inputs x."""
    torch.manual_seed(0)
    gated = train_gpt.CausalSelfAttention(width, heads, width // heads, ve_gate=True, key_offset=False, paired=False)
    with torch.no_grad():
        gated.qk_w.uniform_(-0.2, 0.2)
        gated.vo_w.uniform_(-0.2, 0.2)
    twin = copy.deepcopy(gated)
    x, ve = torch.randn(1, T, width), torch.randn(1, T, width)
    mask = train_gpt.attention_mask(documents()[0], 300, "sdpa")
    # the output projection's lambda a power of two: an identity projection then passes heads exactly scaled
    rest = (torch.tensor([0.7, 0.5]), mask, train_gpt.Rotary(width // heads, T), 0.12)
    return gated, twin, x, ve, rest


def test_value_embedding_gate_scales_each_head_by_2_sigmoid():
    """A layer with a random value-embedding gate equals its zero-gated twin (whose gate is 1) given the value
    embedding multiplied, per position and head, by 2 sigmoid(w . (x[:6], ve[:6])) computed here (the records' from
    2026-02-03, where heads attend alone), to the bit: with the gate's own ops; the gate starts at zero. The gate of
    the records before, on x[:12], differs."""
    gated, twin, x, ve, rest = gated_attention_and_twin(32, 2)
    assert gated.ve_gate.weight.shape == (2, 12) and not gated.ve_gate.weight.any()
    with torch.no_grad():
        gated.ve_gate.weight.normal_()
        for gate_input, same in ((torch.cat([x[..., :6], ve[..., :6]], dim=-1), True), (x[..., :12], False)):
            gate = 2 * torch.sigmoid(torch.nn.functional.linear(gate_input, gated.ve_gate.weight))  # (1, T, heads)
            expected = twin(x, (ve.view(1, T, 2, 16) * gate[..., None]).view(1, T, 32), *rest)
            assert torch.equal(gated(x, ve, *rest), expected) == same
        assert not torch.equal(expected, twin(x, ve, *rest))  # the gate matters: a layer ignoring it fails


def test_attention_gate_scales_each_heads_output_by_sigmoid_before_the_projection():
    """Width 128, 2 heads: the gate reads x[:12] (12 at any width from the 2025-09-10 record on). The per-head
    attention output, read through the zero-gated twin with an identity output projection (exact: every sum adds
    zeros to one term) and the twin's gate of 1/2 and lambda taken out (powers of two), multiplied by
    sigmoid(w . x[:12]) computed here, then projected, gives the gated layer's output to the bit: with the layer's own
    ops; at the zero init every gate is exactly 1/2."""
    gated, twin, x, ve, rest = gated_attention_and_twin(128, 2)
    assert gated.attn_gate.weight.shape == (2, 12) and not gated.attn_gate.weight.any()
    with torch.no_grad():
        w_o = gated.vo_w[1].clone()
        twin.vo_w[1].copy_(torch.eye(128))
        heads = (4 * twin(x, ve, *rest)).view(1, T, 2, 64)  # the attention output per head, unprojected and ungated
        assert torch.equal(gated(x, ve, *rest), torch.nn.functional.linear((heads * 0.5).view(1, T, 128), 0.5 * w_o))
        gated.attn_gate.weight.normal_()
        gate = torch.sigmoid(torch.nn.functional.linear(x[..., :12], gated.attn_gate.weight))  # (1, T, heads)
        expected = torch.nn.functional.linear((heads * gate[..., None]).view(1, T, 128), 0.5 * w_o)
        assert torch.equal(gated(x, ve, *rest), expected)


def test_attention_gates_train_with_adam_and_draw_nothing():
    """The record's gates (6 x 12 at width 768, 2 x 12 here) are Adam's at gate_lr with the decay's wd_mul 1 (from
    2025-12-31), zero and drawing nothing (from 2025-10-27): the matrices are the record's construction's, which has
    no draw of theirs (replay_records_draws)."""
    args = train_gpt.Hyperparameters(**FEW_LAYERS, num_layers=4, model_dim=128, num_heads=2, head_dim=64, vocab_size=256)
    torch.manual_seed(0)
    model = train_gpt.build_model(args, T)
    adam, muon = train_gpt.build_optimizers(model, args)
    gates = [block.attn.attn_gate.weight for block in model.blocks if block.attn is not None]
    assert len(gates) == 3 and all(g.shape == (2, 12) and not g.any() for g in gates)
    gate_group = next(group for group in adam.param_groups if any(p is gates[0] for p in group["params"]))
    assert {id(g) for g in gates} <= {id(p) for p in gate_group["params"]}  # with the value embeddings' gates
    assert (gate_group["lr"], gate_group["wd_mul"]) == (args.gate_lr, 1.0)
    assert not {id(g) for g in gates} & {id(p) for group in muon.param_groups for p in group["params"]}
    drawn = replay_records_draws(128, 4, 3, 256, value_tables=2)
    assert all(drawn_attention_equal(model, drawn))
    assert all(torch.equal(b.mlp.c_fc, r) for b, r in zip(model.blocks, drawn["c_fc"], strict=True))


def test_value_embedding_gates_sit_on_value_embedding_layers_and_train_with_adam():
    """A value-embedding gate on each layer with a table (1 and 3 of 4) and on no other; with the attention gates,
    exactly Adam's group at gate_lr with wd_mul 1; none of them Muon's."""
    args = train_gpt.Hyperparameters(**FEW_LAYERS, num_layers=4, model_dim=32, num_heads=2, head_dim=16, vocab_size=256)
    model = train_gpt.build_model(args, T)
    gated = [i for i, block in enumerate(model.blocks) if block.attn is not None and block.attn.ve_gate is not None]
    assert gated == [i for i, t in enumerate(model.ve_layout) if t is not None] == [1, 3]
    adam, muon = train_gpt.build_optimizers(model, args)
    gates = {id(model.blocks[i].attn.ve_gate.weight) for i in gated}
    gate_group = next(g for g in adam.param_groups if g["lr"] == args.gate_lr and g["wd_mul"] == 1.0)
    assert {id(p) for p in gate_group["params"]} == gates | {id(b.attn.attn_gate.weight) for b in model.blocks if b.attn}
    assert not gates & {id(p) for g in muon.param_groups for p in g["params"]}


@pytest.mark.parametrize("depth", [4, 11])
def test_the_draws_follow_the_records_construction(depth):
    """Other depths and skips, no backout, no paired heads: the smear's and the skip's gates (drawn, then zeroed), the
    value embeddings, every q and k, then every v and output projection, then every up-projection and the padding
    MLP's, then the lm_head, and the token embedding its copy, as the 2026-04-08 record's construction (replay_records_draws); the
    bigram table zero. A replay without the value embeddings' draw gives other weights."""
    torch.manual_seed(0)
    model = train_gpt.GPT(train_gpt.GPTConfig(256, depth, 2, 16, 32, T, windows=WINDOWS))
    assert not model.bigram_embed.weight.any()
    assert not model.smear_gate.weight.any() and not model.skip_gate.weight.any()
    attention = [block.attn for block in model.blocks if block.attn is not None]
    for tables, same in ((model.ve_tables, True), (0, False)):
        drawn = replay_records_draws(32, depth, len(attention), 256, value_tables=tables)
        found = [torch.equal(model.value_embeds, drawn["value_embeds"]), *drawn_attention_equal(model, drawn)]
        found += [torch.equal(b.mlp.c_fc, r) for b, r in zip(model.blocks, drawn["c_fc"])]
        found += [torch.equal(model.lm_head.weight, drawn["lm_head"].T), torch.equal(model.embed.weight, drawn["lm_head"].T)]
        assert found == [same] * len(found), tables


def test_the_bf16_softcap_rounds_after_each_operation():
    """softcap in z's dtype (the records' training loss from 2025-09-27): 23 sigmoid((z + 5) / 7.5) with each of its
    four operations rounded to bf16, against float64. Each rounding is within bf16's u of a float32 result that is within
    float32's of the exact one (the sigmoid's exp within EXP_ULPS ulps): the sum's and the quotient's, e1, move the
    sigmoid by at most |q| e1 / 4 (its slope is at most 1/4), the sigmoid's and the product's e2, e3 multiply it by
    (1 + e2)(1 + e3). The float32 softcap stays within float32's bound, 2^16 times smaller: the bf16 one must round."""
    z = (torch.randn(4096, generator=torch.Generator().manual_seed(0)) * 15).bfloat16()
    got, got32 = train_gpt.softcap(z, in_z_dtype=True), train_gpt.softcap(z)
    assert got.dtype == torch.bfloat16 and got32.dtype == torch.float32
    q = (z.double() + train_gpt.LOGIT_OFFSET) / train_gpt.LOGIT_SOFTCAP_SPREAD
    exact = train_gpt.LOGIT_SOFTCAP * torch.sigmoid(q)
    for dtype, result in ((torch.bfloat16, got), (torch.float32, got32)):
        u, u32 = UNIT_ROUNDOFF[dtype], UNIT_ROUNDOFF[torch.float32]
        e1, e2, e3 = 2 * (u + u32), u + 2 * EXP_ULPS * u32 + 2 * u32, u + u32
        sigmoid = exact / train_gpt.LOGIT_SOFTCAP  # whole, not first order: bf16's u is too large to drop products
        bound = train_gpt.LOGIT_SOFTCAP * ((sigmoid + q.abs() * e1 / 4) * (1 + e2) * (1 + e3) - sigmoid)
        assert_within(result, exact, bound, f"softcap in {dtype}")
    assert (got.double() - exact).abs().max() > 1000 * (got32.double() - exact).abs().max()


@pytest.mark.parametrize("chunk", [100, 4096])
def test_the_eval_loss_takes_the_softcap_in_the_run_dtype(chunk, monkeypatch):
    """chunked_eval_loss on bf16 inputs, EVAL_LOSS_CHUNK rows at a time: the summed cross-entropy of the
    bf16-softcapped logits L (the records' from 2025-09-27), against float64 over the same L. Per row, float32
    recovers s = L / cap and cap s (u each, |L| <= cap: 2 cap u in the target's term and in each exponent, whose exp2
    adds 2 EXP_ULPS u relative, moving the log-sum by as much), sums V exps (gamma(V)) and takes a log (2 EXP_ULPS u of
    it); the rows' sum adds gamma(T) of their magnitudes. The earlier records' softcap (30, no offset) gives a loss
    far outside that bound."""
    xn, w, targets, _ = softcapped_loss_case()
    xn, w = xn.bfloat16(), w.bfloat16()
    monkeypatch.setattr(train_gpt, "EVAL_LOSS_CHUNK", chunk)
    u, V = UNIT_ROUNDOFF[torch.float32], w.size(0)
    logits = train_gpt.softcap(xn @ w.T, in_z_dtype=True).double()
    rows = torch.logsumexp(logits, dim=-1) - logits.gather(1, targets[:, None]).squeeze(1)
    row_bound = 2 * 2 * train_gpt.LOGIT_SOFTCAP * u + 2 * EXP_ULPS * u + gamma(V) + 2 * EXP_ULPS * u * torch.logsumexp(logits, dim=-1)
    bound = row_bound.sum() + gamma(len(rows)) * rows.abs().sum()
    loss = train_gpt.chunked_eval_loss(xn, w, targets, train_gpt.LOGIT_SOFTCAP, train_gpt.LOGIT_OFFSET)
    assert loss.dtype == torch.float32
    assert_within(loss, rows.sum(), bound, f"chunks of {chunk}", gamma(V))
    earlier = train_gpt.chunked_eval_loss(xn, w, targets, 30.0, 0.0)
    assert (earlier.double() - rows.sum()).abs() > 10 * bound


def test_the_run_dtype_rounds_every_weight_and_the_losses_take_it():
    """GPTConfig.dtype bf16 (the records' run dtype): every parameter but the scalars, the stream's four lambda tensors
    and the value embeddings, and the rotary tables, is the float32 build's rounded to bf16 (each init draw made in
    float32, or in bf16 from the same numbers, and rounded once, so the draws are the same); the value embeddings, drawn
    in bf16 and scaled in it, are the record's bf16(0.01 bf16(z)) of the float32 build's draw z. With random weights:
    the trunk is the 2026-03-22 record's forward written out (records_forward) with the stream's lambdas rounded to bf16
    (the record's .bfloat16()), to the bit, and the same forward with them in float32 differs; training's loss is
    SoftcappedLoss's sum over the bf16 normed trunk output and lm_head weight, to the bit; validation's is
    chunked_eval_loss's mean over them, to the bit."""
    def build(dtype):
        torch.manual_seed(0)
        return train_gpt.GPT(train_gpt.GPTConfig(VOCAB, 4, num_heads=2, head_dim=16, model_dim=32, max_seq_len=T,
                                                 windows=WINDOWS, dtype=dtype))

    plain, rounded = build(torch.float32), build(torch.bfloat16)
    float32_parameters = ("scalars", "resid_lambdas", "post_lambdas", "x0_lambdas", "bigram_lambdas")
    for (name, p), q in zip(rounded.named_parameters(), plain.parameters(), strict=True):
        rounds = name not in float32_parameters
        assert p.dtype == (torch.bfloat16 if rounds else torch.float32), name
        assert torch.equal(p, q.to(p.dtype)) != (name == "value_embeds"), name
    torch.manual_seed(0)
    for _ in range(2):  # the smear's and the skip's gates' draws
        torch.empty(1, 12).uniform_()
    z = torch.randn(rounded.value_embeds.shape)
    assert torch.equal(plain.value_embeds, 0.01 * z)
    assert torch.equal(rounded.value_embeds, (0.01 * z.bfloat16().float()).bfloat16())
    for table in ("cos", "sin"):
        assert torch.equal(getattr(rounded.rotary, table), getattr(plain.rotary, table).bfloat16())
    rounded = randomize_(rounded)
    inputs, targets = documents()
    with torch.no_grad():
        trunk = rounded.trunk(inputs, 2)
        assert trunk.dtype == torch.bfloat16
        assert torch.equal(trunk, records_forward(rounded, inputs, 2, LAYOUTS[4]["skips"]))
        assert not torch.equal(trunk, records_forward(rounded, inputs, 2, LAYOUTS[4]["skips"],
                                                      lambda_dtype=torch.float32))
    loss = rounded.train()(inputs, targets, 2)
    x = train_gpt.norm(rounded.trunk(inputs, 2))
    assert loss.dtype == torch.float32 and x.dtype == rounded.lm_head.weight.dtype == torch.bfloat16
    assert torch.equal(loss, train_gpt.SoftcappedLoss.apply(x.view(-1, x.size(-1)), rounded.lm_head.weight, targets,
                                                            torch.ones(1), train_gpt.LOGIT_SOFTCAP,
                                                            train_gpt.LOGIT_OFFSET).sum())
    with torch.no_grad():
        val = rounded.eval()(inputs, targets, 2)
        expected = train_gpt.chunked_eval_loss(x[0], rounded.lm_head.weight, targets, train_gpt.LOGIT_SOFTCAP,
                                               train_gpt.LOGIT_OFFSET) / T
    assert torch.equal(val, expected)


def records_fused_loss(logits, targets, weights, grad, grad_s=1.0, block=2048, cap=23.0, offset=5.0, spread=7.5):
    """The 2026-03-22 record's fused_softcapped_entropy kernels written out, row by row, in their order, in float32 (its
    scalars float32, as Triton takes a Python float; torch's exp and log for Triton's). Forward: inv_C = 1 / C and
    B_div_C = B inv_C; s = 1 / (1 + exp(-(x inv_C + B_div_C))) (tl.sigmoid) of the float32 raw logits x, z = A s; lse
    by its loop over blocks of 2048 columns (the last padded with -inf): the running maximum m', the running sum times
    exp(m - m') plus the block's sum of exp(z - m'), then m + log(sum); loss_r = the sum over k in order of w_k (lse_r
    - z[target_(r+k)]) where r + k < T. Backward: with the upstream gradient g_r, S_w the sum of the valid w_k in
    order and term2 the weights aimed at each column summed in k's order, ((g_r (1 / grad_s)) (inv_C A)) (S_w exp(z -
    lse) - term2) s (1 - s), left to right; returned in float32, as before the kernel's rounding (to e5m2)."""
    T, V, n = targets.numel(), logits.size(1), weights.numel()
    one = torch.tensor(1.0)
    inv_C = one / spread
    B_div_C, inv_C_A, inv_grad_s = offset * inv_C, inv_C * cap, one / torch.tensor(grad_s)
    losses, grads = torch.zeros(T), torch.zeros(T, V)
    blocks = -(-V // block)
    for r in range(T):
        s = 1 / (1 + torch.exp(-(logits[r].float() * inv_C + B_div_C)))
        z = cap * s
        padded = torch.cat([z, z.new_full((blocks * block - V,), float("-inf"))])
        max_val, sum_exp = torch.tensor(float("-inf")), torch.tensor(0.0)
        for b in range(blocks):
            columns = padded[b * block:(b + 1) * block]
            new_max = torch.maximum(max_val, columns.max())
            sum_exp = sum_exp * torch.exp(max_val - new_max) + torch.exp(columns - new_max).sum()
            max_val = new_max
        lse = max_val + torch.log(sum_exp)
        loss, weight_sum, term2 = torch.zeros(()), torch.zeros(()), torch.zeros(V)
        for k in range(n):
            if r + k < T:
                loss = loss + weights[k] * (lse - z[targets[r + k]])
                weight_sum = weight_sum + weights[k]
                term2[targets[r + k]] += weights[k]
        losses[r] = loss
        grads[r] = grad[r] * inv_grad_s * inv_C_A * (weight_sum * torch.exp(z - lse) - term2) * s * (1 - s)
    return losses, grads


def loss_case_targets(g, T, V):
    """T random targets below V, some coinciding across the next three: the same column for k = 0, 1, 2 in row 7, for
    k = 0 and 2 (not 1) in row 15, and for the two k left in row T - 2, near the end."""
    targets = torch.randint(0, V, (T,), generator=g)
    targets[7] = targets[8] = targets[9]
    targets[15] = targets[17]
    targets[T - 2] = targets[T - 1]
    assert targets[16] != targets[15]
    return targets


def test_the_training_loss_is_the_records_fused_cross_entropy():
    """SoftcappedLoss without FP8 against the 2026-03-22 record's kernels written out (records_fused_loss), 50304
    columns (25 blocks, the last partly padding), 29 rows, with three predictions (loss_case_targets: targets that
    coincide across k, so the weights aimed at one column add, also in a row near the end, where fewer targets lie
    ahead) and with one. x = I and w = the bf16 raw logits transposed, so that the logits are exactly w^T and their
    gradient exactly grad_w^T: the per-row losses and that gradient, rounded once to bf16 from float32, equal to the
    bit, and grad_x = g w. Against a float64 loop of the same formula: the loss within its float32 roundings (each
    softcapped logit within (2 EXP_ULPS + 4) u of cap: its argument's products and sum move it by under 2 u, exp's ulps,
    the sum, the division and the product by cap the rest; the V-term sum and each block's rescale (an exp and two
    roundings), the exp and log, each term's difference and product, the k terms' sum), the gradient within its one
    bf16 rounding and 64 float32 ones of its terms' magnitudes. Controls, each giving other losses: counting the terms
    past the end (against padding targets), torch's logsumexp, the 2026-02-03 record's blocks of 1024 columns and
    its softcap argument (x + B) / C."""
    g = torch.Generator().manual_seed(0)
    T, V = 29, 50304
    logits = (torch.randn(T, V, generator=g) * 4).bfloat16()
    targets = loss_case_targets(g, T, V)
    z = train_gpt.kernel_softcap(logits, 23.0, 5.0)[0]
    assert not torch.equal(train_gpt.blockwise_logsumexp(z), torch.logsumexp(z, -1))  # the blocks' order shows
    upstream = torch.rand(T, generator=g) + 0.5
    u = UNIT_ROUNDOFF[torch.float32]
    for weights in (torch.tensor([1.0, 0.5, 0.1875]), torch.tensor([1.0])):
        x, w = torch.eye(T, dtype=torch.bfloat16).requires_grad_(), logits.T.contiguous().requires_grad_()
        losses = train_gpt.SoftcappedLoss.apply(x, w, targets, weights, 23.0, 5.0, None)
        losses.backward(upstream)
        by_hand, by_hand_grad = records_fused_loss(logits, targets, weights, upstream)
        by_hand_grad = by_hand_grad.bfloat16()
        assert torch.equal(losses, by_hand) and torch.equal(w.grad.T, by_hand_grad), weights
        assert torch.equal(x.grad, by_hand_grad.mm(logits.T))
        exact_logits = logits.double().requires_grad_()
        blocks = -(-V // train_gpt.LOSS_BLOCK)  # each block's rescale: an exp and two roundings
        z = 23 * torch.sigmoid((exact_logits + 5) / 7.5)
        lse = torch.logsumexp(z, -1)
        n = weights.numel()
        exact = torch.stack([sum(weights[k].double() * (lse[r] - z[r, targets[r + k]]) for k in range(n) if r + k < T)
                             for r in range(T)])
        (exact * upstream.double()).sum().backward()
        per_logit = (2 * EXP_ULPS + 4) * u * 23
        lse_error = per_logit + gamma(V) + blocks * (EXP_ULPS + 2) * u + (2 * EXP_ULPS + 1) * u * lse.detach().abs()
        terms = (lse.detach()[:, None] - z.detach()).abs().amax(-1)
        loss_bound = n * (lse_error + per_logit + 2 * u * terms) + gamma(n) * n * terms
        assert_within(losses, exact.detach(), loss_bound, f"{n} predictions")
        magnitude = upstream.double()[:, None] * n * (23 / 7.5) * 0.25  # |g| S_w max|dz/dx|: a bound of each entry
        grad_bound = UNIT_ROUNDOFF[torch.bfloat16] * exact_logits.grad.abs() + 64 * u * magnitude
        assert_within(w.grad.T, exact_logits.grad, grad_bound, f"{n} predictions' gradient")
    weights = torch.tensor([1.0, 0.5, 0.1875])
    kept = train_gpt.SoftcappedLoss.apply(torch.eye(T, dtype=torch.bfloat16), logits.T, targets, weights, 23.0, 5.0)
    counted = records_fused_loss(torch.cat([logits, logits[:2]]), torch.cat([targets, targets.new_zeros(2)]), weights,
                                 torch.ones(T + 2))[0][:T]
    assert torch.equal(kept[:T - 2], counted[:T - 2]) and not torch.equal(kept[T - 2:], counted[T - 2:])
    assert not torch.equal(kept, records_fused_loss(logits, targets, weights, upstream, block=1024)[0])
    earlier_softcap = 23 * (1 / (1 + torch.exp(-((logits.float() + 5) / 7.5))))
    assert not torch.equal(train_gpt.kernel_softcap(logits, 23.0, 5.0)[0], earlier_softcap)


def test_the_fp8_training_loss_is_the_records_fused_cross_entropy(monkeypatch):
    """SoftcappedLoss with the record's FP8 scales against the 2026-03-22 record's FusedSoftcappedCrossEntropy written
    out: its forward's e4m3 copies of x / x_s and of the lm_head weight / w_s (which it stores (model_dim, vocab)) and
    its bf16 logits by _scaled_mm, called as it calls it; its kernels (records_fused_loss, with grad_s) on 29 rows of
    normed x and 50304 columns of an lm_head spanning the FP8 range, three predictions, targets as in the test above
    (loss_case_targets); the gradient's e5m2 codes rounded once, from float32; its backward's grad_x (bf16) and grad_w
    (float32, then the bf16 weight's, as autograd rounds the record's) by _scaled_mm from those codes and the e4m3
    copies, as it calls it. The losses, the codes SoftcappedLoss hands fp8_mm_backward, grad_x and grad_w: equal to the
    bit. The codes made through bf16 (the float32 gradient rounded to bf16, then to e5m2) differ on some entries."""
    g = torch.Generator().manual_seed(1)
    T, V, D = 29, 50304, 32
    x = train_gpt.norm(torch.randn(T, D, generator=g)).bfloat16()
    w = (torch.rand(V, D, generator=g) * 1.75 - 0.875).bfloat16()
    targets = loss_case_targets(g, T, V)
    weights, upstream = torch.tensor([1.0, 0.5, 0.1875]), torch.rand(T, generator=g) + 0.5
    x_s, w_s, grad_s = scales = train_gpt.LM_HEAD_FP8_SCALES
    handed = []
    fp8_mm_backward = train_gpt.fp8_mm_backward
    monkeypatch.setattr(train_gpt, "fp8_mm_backward",
                        lambda g_f8, *args: handed.append(g_f8) or fp8_mm_backward(g_f8, *args))
    xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
    losses = train_gpt.SoftcappedLoss.apply(xi, wi, targets, weights, 23.0, 5.0, scales)
    losses.backward(upstream)
    # the record's forward, its lm_head weight stored (model_dim, vocab)
    lm_head_weight = w.T.contiguous()
    x_f8 = x.div(x_s).to(torch.float8_e4m3fn)
    w_f8 = lm_head_weight.div(w_s).to(torch.float8_e4m3fn)
    logits = torch._scaled_mm(x_f8, w_f8.T.contiguous().T, out_dtype=torch.bfloat16, use_fast_accum=True,
                              scale_a=x.new_tensor(x_s, dtype=torch.float32),
                              scale_b=x.new_tensor(w_s, dtype=torch.float32))
    by_hand, grad32 = records_fused_loss(logits, targets, weights, upstream, grad_s)
    grad_input = grad32.to(torch.float8_e5m2)
    # the record's backward
    x_scale, w_scale, grad_scale = (torch.tensor(scale, dtype=torch.float32) for scale in scales)
    grad_x = torch._scaled_mm(grad_input, w_f8.T, out_dtype=torch.bfloat16, scale_a=grad_scale, scale_b=w_scale,
                              use_fast_accum=False)
    grad_w = torch._scaled_mm(x_f8.T.contiguous(), grad_input.T.contiguous().T, out_dtype=torch.float32,
                              scale_a=x_scale, scale_b=grad_scale, use_fast_accum=False)
    assert torch.equal(losses.detach(), by_hand)
    assert len(handed) == 1 and torch.equal(handed[0].view(torch.uint8), grad_input.view(torch.uint8))
    assert torch.equal(xi.grad, grad_x) and torch.equal(wi.grad, grad_w.T.bfloat16())
    through_bf16 = grad32.bfloat16().to(torch.float8_e5m2)
    assert not torch.equal(through_bf16.view(torch.uint8), grad_input.view(torch.uint8))


def test_training_with_multi_token_weights_takes_the_records_loss():
    """The model's training loss with mtp_weights is SoftcappedLoss's sum over its normed final stream and the
    lm_head's weight with those weights, to the bit; None is the next token's alone (weights (1,)), the summed
    cross-entropy of the float32 softcap of the raw logits within float32's rounding."""
    model = randomize_(records_structure_gpt())
    model.train()
    tokens, targets = documents()
    weights = torch.tensor([1.0, 0.5, 0.2])
    xn = train_gpt.norm(model.trunk(tokens, 2)).view(T, -1)
    loss = train_gpt.SoftcappedLoss.apply(xn, model.lm_head.weight, targets, weights, model.logit_cap,
                                          model.logit_offset).sum()
    assert torch.equal(model(tokens, targets, 2, None, weights), loss)
    one = train_gpt.SoftcappedLoss.apply(xn, model.lm_head.weight, targets, torch.ones(1), model.logit_cap,
                                         model.logit_offset).sum()
    assert torch.equal(model(tokens, targets, 2), one) and not torch.equal(one, loss)
    logits = torch.nn.functional.linear(xn, model.lm_head.weight)
    plain = torch.nn.functional.cross_entropy(train_gpt.softcap(logits), targets, reduction="sum")
    assert abs(one.item() - plain.item()) <= gamma(T + 60) * plain.item()


def test_the_skip_input_gate_by_hand():
    """Layer 6's skip with the input gate (the records from 2025-12-29): x + sigmoid(lambda) 2 sigmoid(v . x0[:12]) h3
    before its MLP, in the record's order of operations, x0 the smeared embeddings normed: the trunk equals the one
    whose skip is written out."""
    model = randomize_(records_structure_gpt())
    assert model.skip_gate.weight.shape == (1, 12)
    tokens, _ = documents()
    seen = {}
    blocks = list(model.blocks)
    hooks = [blocks[3].register_forward_hook(lambda m, a, out: seen.__setitem__("h3", out)),
             blocks[6].register_forward_pre_hook(lambda m, a: seen.__setitem__("in6", a[0])),
             blocks[5].register_forward_hook(lambda m, a, out: seen.__setitem__("out5", out))]
    model.trunk(tokens, 2)
    for hook in hooks:
        hook.remove()
    x0 = train_gpt.norm(model.smear(model.embed(tokens))[None])
    weight = model.scalars[model.scalars.numel() - model.num_skip_weights + 1]
    gate = torch.sigmoid(weight) * 2 * torch.sigmoid(torch.nn.functional.linear(x0[..., :12], model.skip_gate.weight))
    assert torch.equal(seen["in6"], seen["out5"] + gate * seen["h3"])
    with torch.no_grad():
        model.skip_gate.weight.zero_()  # 2 sigmoid(0) = 1: the gate alone
    assert not torch.equal(model.trunk(tokens, 2), randomize_(records_structure_gpt()).trunk(tokens, 2))


def test_attention_past_the_backout_layer_reads_the_stream_that_layer_left():
    """Observed with hooks on every block of the records' structure (the backout after layer 7): the attention of
    layers 0..7 reads their own input (attention_input is x itself), that of layers 8, 9 and 10 layer 7's output (the
    records' from 2026-03-06), which from layer 9 on is not their input; with the backout after layer 4, that of layers
    5..10 layer 4's output. Each block
    computes from what it is given, to the bit: an attention layer h = r_a x + p_a attn(norm(attention_input)) +
    injected (attn as records_attention), then r_m h + p_m mlp(norm(h)); the attention-free layer 6, given no injection,
    the second alone, r_m x + p_m mlp(norm(x)) (neither x0 nor the bigram joins it, nor its attention lambdas)."""
    F, norm = torch.nn.functional, train_gpt.norm
    tokens, _ = documents()
    for backout_layer in (7, 4):
        model = randomize_(records_structure_gpt(backout_layer=backout_layer))
        inputs, outputs = {}, {}
        for i, block in enumerate(model.blocks):
            block.register_forward_pre_hook(lambda m, args, i=i: inputs.__setitem__(i, args))
            block.register_forward_hook(lambda m, args, out, i=i: outputs.__setitem__(i, out))
        with torch.no_grad():
            model.trunk(tokens, 2)
            for i, block in enumerate(model.blocks):
                x, attention_input, ve, resid, post, injected, attn_lambdas, mask, rotary, scale, *_ = inputs[i]
                if i <= backout_layer:
                    assert attention_input is x, (backout_layer, i)
                else:
                    assert attention_input is outputs[backout_layer], (backout_layer, i)
                    assert (attention_input is x) == (i == backout_layer + 1), (backout_layer, i)
                    assert torch.equal(attention_input, x) == (i == backout_layer + 1), (backout_layer, i)
                if block.attn is None:
                    assert i == 6 and injected is None
                    h = x
                else:
                    y = records_attention(block.attn, norm(attention_input), ve, attn_lambdas, mask, rotary, scale,
                                          key_offset=block.attn.key_offset)
                    h = model.resid_lambdas[i, 0] * x + model.post_lambdas[i, 0] * y + injected
                mlp = F.linear(F.relu(F.linear(norm(h), block.mlp.c_fc)).square(), block.mlp.c_proj.T)
                assert torch.equal(outputs[i], model.resid_lambdas[i, 1] * h + model.post_lambdas[i, 1] * mlp), i
