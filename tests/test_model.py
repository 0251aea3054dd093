"""The GPT: layer layout rules, HEAD's structure (gate networks, dense connections, XSA, the sign-trick bigram), its
construction's draws, the trunk against HEAD's forward written out, rotary and its YaRN rescale, gradients, backends,
the losses, and the gradient-ready order that GradientBuckets relies on."""

import copy
import functools
import hashlib
import math
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pytest
import torch

import run_support
import train_gpt
from conftest import needs_flex_on_cpu
from rounding import (EXP_ULPS, UNIT_ROUNDOFF, TorchCalls, assert_within, cos_sin_bound, first_order_bound, gamma,
                      probabilistic_bound, worst_case_gamma)

pytestmark = pytest.mark.numerics

F = torch.nn.functional
EOT = 50256
VOCAB = 50257  # the real vocabulary, so EOT (50256) can start documents
T = 512  # 4 blocks of 128
WINDOWS = (1, 2, 4)  # the long windows (in blocks) the tests' models know: each has its softmax scale


# The record's structure at 4 layers (the cpu preset's): the backout after layer 2, between the skip's source (1) and
# the last layer; no paired heads or XSA unless a test asks for them.
FEW_LAYERS = dict(num_layers=4, backout_layer=2, paired_head_layers="none", xsa_layers="none")


def tiny_gpt(num_layers=4, backend="sdpa", vocab=VOCAB, seed=0, paired_layers=(), xsa_layers=(), dtype=torch.float32):
    """Width 32, 2 heads of 16 (a multiple of 4, as rotary needs); the backout one layer past the skip's source."""
    torch.manual_seed(seed)
    return train_gpt.GPT(train_gpt.GPTConfig(vocab, num_layers, num_heads=2, head_dim=16, model_dim=32, max_seq_len=T,
                                             attention_backend=backend, windows=WINDOWS, paired_layers=paired_layers,
                                             xsa_layers=xsa_layers, backout_layer=train_gpt.skip_source(num_layers) + 1,
                                             dtype=dtype))


def records_shape_gpt(dtype=torch.float32, seed=0):
    """HEAD's structure at width 48: 11 layers, 6 heads of 8, the backout after layer 7, the heads paired in 0, 2, 5 and
    9, XSA in 1, 3, 4 and 7, the real vocabulary (so its bigram table's 7.5 rows per token: 377,280)."""
    torch.manual_seed(seed)
    return train_gpt.GPT(train_gpt.GPTConfig(VOCAB, 11, num_heads=6, head_dim=8, model_dim=48, max_seq_len=T,
                                             windows=WINDOWS, backout_layer=7, paired_layers=(0, 2, 5, 9),
                                             xsa_layers=(1, 3, 4, 7), dtype=dtype))


def randomize_(model, seed=1):
    """Replace the zero-initialized weights (the MLPs' output projections, the value-embedding and smear gates, the
    coefficient networks' output layers, the bigram table), the value embeddings and the lm_head with random ones, and
    move the scalars, the stream's lambdas, the networks' biases and learned scale off their initial values, so that
    every path changes the output and the coefficients differ per token; the lm_head spans the record's FP8 range
    (|w| <= 448 * 2^-9) so the softcapped logits, and the loss, depend clearly on the hidden state."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("mlp.c_proj", "ve_gate.weight", "smear_gate.weight", ".w2")):
                p.uniform_(-0.5, 0.5)
        model.lm_head.weight.uniform_(-0.875, 0.875)
        for p in (model.scalars, model.resid_lambdas, model.post_lambdas, model.gates.b2, model.mudd.b2,
                  model.gates.scale):
            p.add_(0.3 * torch.randn_like(p))
        model.value_embeds.normal_(0, 0.5)
        model.bigram_embed.weight.normal_(0, 0.1)  # smaller: a table as large as the value embeddings' swamps the context
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
# decoder; each decoder layer's mirror partner in the U (skips), the attention-free layer's the skip's source. An odd
# depth is the U one layer deeper without its layer 0: every index one lower, the partner of the U's last layer gone.
LAYOUTS = {
    12: dict(ve=[None, 0, 1, None, None, None, None, None, None, 2, 3, 4], attention_free=7, long=[0, 4, 7, 11],
             skips={6: 5, 7: 4, 8: 3, 9: 2, 10: 1, 11: 0}, source=4),
    11: dict(ve=[None, 0, 1, None, None, None, None, None, 2, 3, 4], attention_free=6, long=[3, 6, 10],
             skips={5: 4, 6: 3, 7: 2, 8: 1, 9: 0}, source=3),
    8: dict(ve=[None, 0, 1, None, None, None, 2, 3], attention_free=5, long=[0, 7], skips={4: 3, 5: 2, 6: 1, 7: 0},
            source=2),
    5: dict(ve=[None, 0, None, None, 1], attention_free=3, long=[4], skips={2: 1, 3: 0}, source=0),
    4: dict(ve=[None, 0, None, 1], attention_free=2, long=[0, 3], skips={2: 1, 3: 0}, source=1),
    3: dict(ve=[None, None, 0], attention_free=1, long=[2], skips={1: 0}, source=0),
}


def ve_table(model, table):
    """Value-embedding table `table` of the model's one parameter, (padded vocabulary, D)."""
    return model.value_embeds.view(model.ve_tables, -1, model.value_embeds.size(1))[table]


@pytest.mark.parametrize("depth", sorted(LAYOUTS))
def test_layer_layout(depth):
    """Value-embedding tables, attention-free layer, long-window layers, mirror partners and the skip's source per depth
    (11: the record's value embeddings on 1, 2, 8, 9, 10, layer 6 without attention, long windows on 3 and 10, the
    skip 3 into 6)."""
    expected = LAYOUTS[depth]
    assert train_gpt.value_embedding_layout(depth) == expected["ve"]
    assert train_gpt.attention_free_layer(depth) == expected["attention_free"]
    long = train_gpt.long_window_layers(depth)
    assert [i for i, is_long in enumerate(long) if is_long] == expected["long"]
    assert {i: train_gpt.skip_partner(depth, i) for i in expected["skips"]} == expected["skips"]
    assert train_gpt.skip_source(depth) == expected["source"] == expected["skips"][expected["attention_free"]]
    # the attention-free layer must not have a value embedding: it would be unused
    assert expected["ve"][expected["attention_free"]] is None


def test_an_odd_depth_is_the_next_even_one_without_its_first_layer():
    """Depth 2L - 1 against depth 2L for L = 2..8, the U's helpers: the long-window layout loses its first entry, the
    decoder layers' mirror partners move one down, and the partner that was layer 0 is gone. (The value embeddings are
    placed on the model's layers, not the U's: test_layer_layout.)"""
    for half in range(2, 9):
        even, odd = 2 * half, 2 * half - 1
        assert train_gpt.u_layers(odd) == (even, 1) and train_gpt.u_layers(even) == (even, 0)
        assert train_gpt.long_window_layers(odd) == train_gpt.long_window_layers(even)[1:]
        kept = [i for i in range(half, even) if train_gpt.skip_partner(even, i) != 0]
        assert len(kept) == half - 1
        assert [train_gpt.skip_partner(odd, i - 1) for i in kept] == [train_gpt.skip_partner(even, i) - 1 for i in kept]


@pytest.mark.parametrize("depth", [4, 5, 8, 11, 12])
def test_gpt_structure(depth):
    """Scalars: the lambdas on each layer's attention q/k/v and output weights (0.5, 1), interleaved, the smear's lambda
    0, the skip's -1.5 (HEAD's, without its padding to a multiple of 8 ranks: none at 11 layers). The stream's lambdas,
    each a float32 parameter of its own: per layer and sub-layer (attention, MLP) the stream's scale sqrt(1.1) and the
    output's weight 1. One parameter of the value-embedding tables; the bigram table (7.5 rows per padded token), zero;
    its sign table, a buffer of +-1; the attention-free block; an MLP in every block; the key offset on the long-window
    layers' attention alone; a value-embedding gate (heads x 12, zero) on the layers with a table but the last (its
    dense connections gate it). The two coefficient networks: the gates' (2, 64, D) first layer, their zero output
    layers as wide as the wider layout, a learned float32 scale 0.1; the dense connections' 14 and 5 coefficients, a
    fixed scale 0.1. No other parameter."""
    expected = LAYOUTS[depth]
    torch.manual_seed(0)
    model = train_gpt.GPT(train_gpt.GPTConfig(256, depth, num_heads=2, head_dim=16, model_dim=32, max_seq_len=T,
                                              backout_layer=expected["source"] + 1))
    L = depth
    assert torch.equal(model.scalars, torch.cat([torch.tensor([0.5, 1.0]).repeat(L), torch.tensor([0.0, -1.5])]))
    stream = dict(resid_lambdas=torch.full((L, 2), 1.1**0.5), post_lambdas=torch.ones(L, 2))  # the record's inits
    for name, init in stream.items():
        p = getattr(model, name)
        assert p.dtype == torch.float32 and torch.equal(p, init), name
    assert model.ve_tables == L - expected["ve"].count(None) and model.value_embeds.shape == (model.ve_tables * 256, 32)
    assert model.bigram_embed.weight.shape == (1920, 32) and not model.bigram_embed.weight.any()
    assert model.bigram_signs.shape == (8192, 32) and set(model.bigram_signs.unique().tolist()) == {-1.0, 1.0}
    assert "bigram_signs" in dict(model.named_buffers())
    for i, block in enumerate(model.blocks):
        assert (block.attn is None) == (i == expected["attention_free"])
        assert block.mlp is not None
        if block.attn is not None:
            assert block.attn.key_offset == (i in expected["long"])
            gated = expected["ve"][i] is not None and i < L - 1
            assert (block.attn.ve_gate is not None) == gated
            assert not gated or (block.attn.ve_gate.weight.shape == (2, 12) and not block.attn.ve_gate.weight.any())
    widths = [max(s.stop for s in layout.values()) for layout in model.gate_layouts]
    assert model.gates.w1.shape == (2, 64, 32) and model.gates.w2.shape == (2, max(widths), 64)
    assert model.mudd.w1.shape == (2, 64, 32) and model.mudd.w2.shape == (2, 14, 64) and model.mudd.b2.shape == (2, 14)
    assert not model.gates.w2.any() and not model.mudd.w2.any()
    assert model.gates.num_coefficients == tuple(widths) and model.mudd.num_coefficients == (14, 5)
    assert model.gates.scale.dtype == torch.float32 and torch.equal(model.gates.scale, torch.tensor(0.1))
    assert model.mudd.scale == 0.1 and not isinstance(model.mudd.scale, torch.Tensor)
    blocks = {f"blocks.{i}.{name}" for i, block in enumerate(model.blocks) for name, _ in block.named_parameters()}
    assert {name for name, _ in model.named_parameters()} == blocks | {
        "embed.weight", "smear_gate.weight", "bigram_embed.weight", "value_embeds", "scalars", "resid_lambdas",
        "post_lambdas", "gates.w1", "gates.w2", "gates.b2", "gates.scale", "mudd.w1", "mudd.w2", "mudd.b2",
        "lm_head.weight"}


def heads_gate_lanes() -> tuple[dict, dict]:
    """HEAD's unpack_pre_mudd_gate and unpack_post_mudd_gate (11 layers, 6 heads, XSA on 1, 3, 4, 7) written out: each
    coefficient's lanes in the gate networks' outputs, 26 and 41."""
    pre = {("xsa", 1): slice(0, 6), ("xsa", 3): slice(6, 12), ("output", 3): slice(12, 18)}
    for layer, offset in zip((0, 1, 2, 3), range(18, 26, 2)):
        pre["x0", layer], pre["bigram", layer] = slice(offset, offset + 1), slice(offset + 1, offset + 2)
    post = {("xsa", 4): slice(0, 6), ("xsa", 7): slice(6, 12), ("output", 10): slice(12, 18)}
    for layer, offset in zip((4, 5, 7, 8, 9), range(18, 28, 2)):
        post["x0", layer], post["bigram", layer] = slice(offset, offset + 1), slice(offset + 1, offset + 2)
    post.update(skip=slice(28, 29), w1=slice(29, 35), w2=slice(35, 41))
    return pre, post


def heads_gate_biases() -> torch.Tensor:
    """HEAD's init_mudd_gate bias table (2, 41), float32: output gates 0.25, bigram shares 0.05, the skip's gate 0.5,
    the composition's first weighting 1.0, each over the scale 0.1."""
    b = torch.zeros(2, 41)
    b[0, 12:18].fill_(0.25 / 0.1)
    b[0, 19:26:2].fill_(0.05 / 0.1)
    b[1, 12:18].fill_(0.25 / 0.1)
    b[1, 19:28:2].fill_(0.05 / 0.1)
    b[1, 28].fill_(0.5 / 0.1)
    b[1, 29:35].fill_(1.0 / 0.1)
    return b


def heads_mudd_biases() -> torch.Tensor:
    """HEAD's init_mudd bias table (2, 14), float32: the last layer's value-embedding gate lanes 2.0, its stream scales
    sqrt(1.1), output weights 1.0 and bigram share 0.05, and after the loop the backout layer's state -0.5, each over
    the scale 0.1."""
    b = torch.zeros(2, 14)
    b[0, 6] = b[0, 7] = 2.0 / 0.1
    b[0, 8] = b[0, 12] = 1.1**0.5 / 0.1
    b[0, 9] = b[0, 13] = 1.0 / 0.1
    b[0, 11] = 0.05 / 0.1
    b[1, 1] = -0.5 / 0.1
    return b


def test_the_gate_layouts_are_heads():
    """gate_layouts at 11 layers and 6 heads, XSA on 1, 3, 4 and 7: HEAD's lanes (heads_gate_lanes), each of the 26 and
    41 once, in its order; the first network serves layers 0..3 (to the skip's source), the second 4..9 but the
    attention-free 6, and the last layer's output gate, the skip's gate and the composition. At the cpu preset's 4
    layers and 2 heads (XSA on 0, the skip's source 1, attention-free 2), by hand: XSA 0, layer 1's output gate, x0's
    and the bigram's shares of 0 and 1; then the last layer's output gate, the skip's gate and the composition's two
    weightings, no layer between."""
    layouts = train_gpt.gate_layouts(11, 6, (1, 3, 4, 7))
    assert layouts == heads_gate_lanes()
    for layout, width in zip(layouts, (26, 41)):
        lanes = [lane for s in layout.values() for lane in range(s.start, s.stop)]
        assert lanes == list(range(width))  # each lane once, in the dict's order
    cpu = train_gpt.gate_layouts(4, 2, (0,))
    assert cpu == ({("xsa", 0): slice(0, 2), ("output", 1): slice(2, 4), ("x0", 0): slice(4, 5),
                    ("bigram", 0): slice(5, 6), ("x0", 1): slice(6, 7), ("bigram", 1): slice(7, 8)},
                   {("output", 3): slice(0, 2), "skip": slice(2, 3), "w1": slice(3, 5), "w2": slice(5, 7)})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_coefficient_networks_start_at_heads_biases(dtype):
    """At HEAD's shape the networks' biases are HEAD's tables (heads_gate_biases, heads_mudd_biases) in the run's
    dtype, to the bit, unused lanes zero. Each coefficient starts where HEAD means it to (its output layer is zero): on
    any input, bias times scale as the forward computes it is HEAD's intended value rounded to bf16, to the bit, in
    bf16 (the record's storage, the gates' scale rounded to bf16 first); in float32 within the three roundings of the
    bias, the scale and their product (3 u relative)."""
    model = records_shape_gpt(dtype)
    assert torch.equal(model.gates.b2, heads_gate_biases().to(dtype))
    assert torch.equal(model.mudd.b2, heads_mudd_biases().to(dtype))
    intended_gates = torch.zeros(2, 41)
    for net, lanes in enumerate(heads_gate_lanes()):
        for name, s in lanes.items():
            kind = name if isinstance(name, str) else name[0]
            intended_gates[net, s] = dict(output=0.25, bigram=0.05, skip=0.5, w1=1.0).get(kind, 0.0)
    intended_mudd = torch.zeros(2, 14, dtype=torch.float64)
    intended_mudd[0, 6:14] = torch.tensor([2.0, 2.0, 1.1**0.5, 1.0, 0.0, 0.05, 1.1**0.5, 1.0], dtype=torch.float64)
    intended_mudd[1, 1] = -0.5
    x = torch.randn(1, 5, 48).to(dtype)
    with torch.no_grad():
        for net, width in enumerate((26, 41)):
            started = model.gates(x, net)
            assert started.shape == (1, 5, width)
            check(started, intended_gates[net, :width].double(), dtype)
        for net, width in enumerate((14, 5)):
            check(model.mudd(x, net), intended_mudd[net, :width], dtype)


def check(started, intended, dtype):
    """Every token's coefficients against their intended values: bf16's rounding of them, or within 3 float32 u."""
    if dtype == torch.bfloat16:
        assert torch.equal(started, intended.to(dtype).expand_as(started))
    else:
        assert_within(started, intended.expand_as(started), 3 * UNIT_ROUNDOFF[torch.float32] * intended.abs(), "inits")


def test_bigram_sign_ids_by_loop():
    """Each position's sign row as HEAD writes it (its sign_idx, per position): 0 at the first, else (p XOR t) mod 8192,
    p the token before, across documents; where restarts (evaluation's) is true, 0 as at a sequence's first. The
    bigram embedding is the table's row (bigram_ids) times that sign row."""
    tokens, _ = documents()
    restarts = torch.zeros(T, dtype=torch.bool)
    restarts[[100, 101, 300]] = True
    for given in (None, restarts):
        expected = [0 if t == 0 or (given is not None and given[t]) else (int(tokens[t - 1]) ^ int(tokens[t])) % 8192
                    for t in range(T)]
        assert train_gpt.bigram_sign_ids(tokens, given).tolist() == expected
    assert train_gpt.BIGRAM_SIGN_ROWS == 8192 and train_gpt.bigram_sign_ids(tokens).max() > 4096
    model = randomize_(tiny_gpt())
    rows = train_gpt.bigram_ids(tokens, model.bigram_embed.num_embeddings, restarts)
    expected = model.bigram_embed.weight[rows] * model.bigram_signs[train_gpt.bigram_sign_ids(tokens, restarts)]
    assert torch.equal(model.bigram_embeddings(tokens, restarts), expected)


STRUCTURE_ERRORS = [
    (dict(num_layers=3, backout_layer=1), "num_layers must be >= 4 and num_heads even"),
    (dict(num_heads=3, head_dim=16, model_dim=48), "num_layers must be >= 4 and num_heads even"),
    (dict(backout_layer=1), "backout_layer must lie between the skip's source 1 and the last layer 3, got 1"),
    (dict(backout_layer=3), "backout_layer must lie between the skip's source 1 and the last layer 3, got 3"),
    (dict(paired_layers=(0,)), r"paired_layers=0: layers with attention and without the key offset \(not the "
                               r"long-window layers \[0, 3\]\)"),
    (dict(paired_layers=(2,)), "paired_layers=2: layers with attention"),
    (dict(paired_layers=(1,), xsa_layers=(1,)), "xsa_layers=1: layers with attention, heads alone, not the last"),
    (dict(xsa_layers=(2,)), "xsa_layers=2: layers with attention"),
    (dict(xsa_layers=(3,)), "xsa_layers=3: layers with attention"),
    (dict(xsa_layers=(4,)), "xsa_layers=4: layers with attention"),
]


@pytest.mark.parametrize("changes, message", STRUCTURE_ERRORS)
def test_check_structure_names_what_does_not_fit(changes, message):
    """check_structure against configs the record's structure cannot take at 4 layers (the skip's source 1, layer 2
    attention-free, 0 and 3 long): too few layers or an odd head count, the backout outside (1, 3), paired heads on a
    long-window or attention-free layer, XSA on a paired, attention-free, last or missing layer: a ValueError of one
    line naming it. The cpu preset's structure passes."""
    config = dict(vocab_size=256, num_layers=4, num_heads=2, head_dim=16, model_dim=32, max_seq_len=T, backout_layer=2)
    with pytest.raises(ValueError, match=message) as raised:
        train_gpt.check_structure(train_gpt.GPTConfig(**{**config, **changes}))
    assert "\n" not in str(raised.value)
    train_gpt.check_structure(train_gpt.GPTConfig(**config, paired_layers=(1,), xsa_layers=(0,)))


def heads_construction(D: int, heads: int, vocab: int, seed: int = 0) -> dict:
    """HEAD's GPT.__init__ (11 layers) replayed in its own form and order of draws, with the record's casts to bf16
    after it: the lm_head normal (D, vocab) in bf16; the embedding's nn.Embedding draw (it becomes the lm_head's copy);
    the value embeddings 0.01 randn (5 vocab, D) in bf16; the q/k bank's head pairs (10 layers x heads / 2 x 2, 2 D /
    heads, D) and the v/o bank's 20 matrices, uniform with bound sqrt(3) 0.5 / sqrt(D), their padding to 8 ranks
    zero; the MLP bank's 12 up-projections (one padding MLP) drawn through its strided view, its down-projections
    zero; the smear gate's nn.Linear(12, 1) and the bigram table's nn.Embedding(vocab 15 // 2, D) drawn (both then
    zeroed); the sign table randn(8192, D).sign(); the dense connections' and then the gates' first layers, kaiming
    uniform (a = sqrt(5)) per network."""
    torch.manual_seed(seed)
    lm_head = torch.zeros(D, vocab, dtype=torch.bfloat16)
    torch.nn.init.normal_(lm_head, mean=0, std=0.005)
    torch.nn.Embedding(vocab, D)
    value_embeds = 0.01 * torch.randn(5 * vocab, D, dtype=torch.bfloat16)
    qk_groups, vo_matrices = 10 * 2 * (heads // 2), 10 * 2
    qk_bank = torch.empty(train_gpt.next_multiple(qk_groups, 8), 2 * D // heads, D)
    vo_bank = torch.empty(train_gpt.next_multiple(vo_matrices, 8), D, D)
    std = 0.5 * D**-0.5
    bound = (3**0.5) * std
    qk_bank[:qk_groups].uniform_(-bound, bound)
    vo_bank[:vo_matrices].uniform_(-bound, bound)
    mlp_bank = torch.empty(12, 2, 4 * D, D)
    mlp_bank[:, 0].uniform_(-bound, bound)
    torch.nn.Linear(12, 1, bias=False)
    torch.nn.Embedding(vocab * 15 // 2, D)
    signs = torch.randn(8192, D).sign().to(torch.bfloat16)
    first_layers = []
    for _ in ("mudd", "gates"):
        w1 = torch.empty(2, 64, D)
        for j in range(2):
            torch.nn.init.kaiming_uniform_(w1.data[j], a=math.sqrt(5))
        first_layers.append(w1.bfloat16())
    return dict(lm_head=lm_head, value_embeds=value_embeds, qk=qk_bank[:qk_groups].bfloat16().view(10, heads, -1, D),
                vo=vo_bank[:vo_matrices].bfloat16().view(10, 2, D, D), c_fc=mlp_bank[:11, 0].bfloat16(), signs=signs,
                mudd_w1=first_layers[0], gates_w1=first_layers[1], rng=torch.get_rng_state())


def test_the_construction_draws_as_heads_does():
    """HEAD's shape in bf16 (the record's): every drawn parameter and the sign table equal HEAD's construction replayed
    (heads_construction), to the bit, and so does the random state after it (the same draws, in the same order, of
    the same sizes); the embedding is the lm_head's copy; everything else starts as HEAD's does: zero (the MLPs' output
    projections, the value-embedding and smear gates, the bigram table, the networks' output layers), HEAD's bias
    tables (test_the_coefficient_networks_start_at_heads_biases), the gates' scale 0.1 in float32. A replay from
    another seed differs in every drawn tensor."""
    model = records_shape_gpt(torch.bfloat16)
    after = torch.get_rng_state()
    padded = train_gpt.next_multiple(VOCAB, 128)
    attention = [block.attn for block in model.blocks if block.attn is not None]
    drawn = lambda replay: [  # noqa: E731
        torch.equal(model.lm_head.weight, replay["lm_head"].T), torch.equal(model.embed.weight, replay["lm_head"].T),
        torch.equal(model.value_embeds, replay["value_embeds"]), torch.equal(model.bigram_signs, replay["signs"]),
        torch.equal(model.mudd.w1, replay["mudd_w1"]), torch.equal(model.gates.w1, replay["gates_w1"]),
        *[torch.equal(attn.qk_w, qk) and torch.equal(attn.vo_w, vo)
          for attn, qk, vo in zip(attention, replay["qk"], replay["vo"], strict=True)],
        *[torch.equal(block.mlp.c_fc, c_fc) for block, c_fc in zip(model.blocks, replay["c_fc"], strict=True)]]
    replay = heads_construction(48, 6, padded)
    assert drawn(replay) == [True] * 27 and torch.equal(after, replay["rng"])
    assert drawn(heads_construction(48, 6, padded, seed=1)) == [False] * 27
    zero = [model.smear_gate.weight, model.bigram_embed.weight, model.gates.w2, model.mudd.w2,
            *[block.mlp.c_proj for block in model.blocks], *[attn.ve_gate.weight for attn in attention if attn.ve_gate]]
    assert len(zero) == 19 and not any(p.any() for p in zero)
    assert model.gates.scale.dtype == torch.float32 and model.gates.scale == torch.tensor(0.1)


def test_the_run_dtype_rounds_every_weight():
    """GPTConfig.dtype bf16 (the record's run dtype): every parameter but the scalars, the stream's lambdas and the
    gates' scale, and the sign table and the rotary tables, is the float32 build's rounded to bf16 (each draw made in
    float32, or in bf16 from the same numbers, and rounded once, so the draws are the same); the value embeddings,
    drawn in bf16 and scaled in it, are HEAD's bf16(0.01 bf16(z)) of the float32 build's draw z."""
    plain, rounded = records_shape_gpt(torch.float32), records_shape_gpt(torch.bfloat16)
    float32_parameters = ("scalars", "resid_lambdas", "post_lambdas", "gates.scale")
    for (name, p), q in zip(rounded.named_parameters(), plain.parameters(), strict=True):
        assert p.dtype == (torch.float32 if name in float32_parameters else torch.bfloat16), name
        assert torch.equal(p, q.to(p.dtype)) != (name == "value_embeds"), name
    padded = train_gpt.next_multiple(VOCAB, 128)
    torch.manual_seed(0)
    torch.empty(48, padded).normal_(0, 0.005)  # the lm_head's and the embedding's draws before
    torch.nn.Embedding(padded, 48)
    z = torch.randn(plain.value_embeds.shape)
    assert torch.equal(plain.value_embeds, 0.01 * z)
    assert torch.equal(rounded.value_embeds, (0.01 * z.bfloat16().float()).bfloat16())
    assert torch.equal(rounded.bigram_signs, plain.bigram_signs.bfloat16())
    for table in ("cos", "sin"):
        assert torch.equal(getattr(rounded.rotary, table), getattr(plain.rotary, table).bfloat16())


def heads_bigram_hash(tokens, rows):
    """HEAD's get_bigram_hash (the 2026-01-19 record's) as it writes it, in place: the first position's row the last,
    then (36313 t XOR 27191 p) mod (rows - 1) in int32 from the tensor whose first entry it has just overwritten."""
    x = tokens.to(torch.int32).clone()
    x[0] = rows - 1
    x[1:] = torch.bitwise_xor(36313 * x[1:], 27191 * x[:-1]) % (rows - 1)
    return x


def heads_coefficients(x, w1, w2, b2, scale, n):
    """HEAD's forward_mudd and forward_mudd_gate: n coefficients (gelu(x w1^T) w2[:n]^T + b2[:n]) scale."""
    hidden = F.gelu(F.linear(x, w1))
    return (F.linear(hidden, w2[:n]) + b2[:n]) * scale


def heads_attention(x, qkvo_w, sa_lambdas, mask, rotary, scale, paired, key_offset, aux_v, xsa_alpha, gate, dc_w,
                    starts):
    """HEAD's CausalSelfAttention.forward written out (6 heads; its dense-mask attention through attend, whose masks and
    kernel test_masks checks): sa_lambdas[0] on the q/k/v rows, QK norm; alone, the rotary, the key shift of dims
    d/2..d on the long layers (in place, its right side read before the write, as compiled), aux_v added to v; paired,
    q and k viewed (B, T, H/2, 2d) for the paired rotary, then (B, 2T, H/2, d), v reshaped so, aux_v added; the
    composition's correction where dc_w (its dc_gate as composition_weights); XSA where alone with a strength; the
    output gate; sa_lambdas[1] on the output rows."""
    B, T, D = x.shape
    H = 6
    d = D // H
    q, k, v = F.linear(x, sa_lambdas[0] * qkvo_w[:3 * D].type_as(x)).view(B, T, 3 * H, d).chunk(3, dim=-2)
    q, k = train_gpt.norm(q), train_gpt.norm(k)
    if not paired:
        q, k = rotary(q), rotary(k)
        if key_offset:
            k = k.clone()
            k[:, 1:, :, d // 2:] = k[:, :-1, :, d // 2:].clone()
        if aux_v is not None:
            v = v + aux_v.view_as(v)
    else:
        q = q.view(B, T, H // 2, 2 * d)
        k = k.view(B, T, H // 2, 2 * d)
        v = v.reshape(B, 2 * T, H // 2, d)
        q, k = rotary(q, paired=True), rotary(k, paired=True)
        q = q.view(B, 2 * T, H // 2, d)
        k = k.view(B, 2 * T, H // 2, d)
        if aux_v is not None:
            v = v + aux_v.view_as(v)
    # (B, H, T, d) for attention and the composition (theirs, tested apart: test_composition.py)
    q_h, k_h, v_h = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    y = train_gpt.attend(q_h, k_h, v_h, mask, scale)
    if dc_w is not None:
        y = train_gpt.composed_attention_correction(y, q_h, k_h, v_h, *train_gpt.composition_weights(*dc_w, x.dtype),
                                                    starts, scale)
    y = y.transpose(1, 2).reshape(B, T, H, d)
    if xsa_alpha is not None and not paired:
        dot = (y * v).sum(-1, keepdim=True)
        denom = v.square().sum(-1, keepdim=True).clamp_min(1e-8)
        alpha = torch.tanh(xsa_alpha).type_as(y).view(B, T, H, 1)
        y = y - alpha * (dot / denom) * v
    if gate is not None:
        y = y * gate.type_as(y).view(B, T, H, 1)
    y = y.contiguous().view(B, T, D)
    return F.linear(y, sa_lambdas[1] * qkvo_w[3 * D:].type_as(y))


def heads_forward(model, tokens, window, control=None):
    """HEAD's GPT.forward (f411b3d3) written out up to its final norm, statement by statement in its order, on the
    model's parameters in HEAD's layout (the q/k and v/o banks stacked from the layers', the value-embedding gates'
    bank from theirs; the MLP the model's block, as HEAD's ReLUSqrdMLP): the parameters unbound first (the stream's
    lambdas cast to the run dtype, HEAD's .bfloat16()); the embedding, the bigram rows by HEAD's hash times the sign
    rows, the value embeddings; the smear, x0; the first gate network and its lanes (heads_gate_lanes); the stream as
    x0's clone with the bigram added in place; layer by layer: the second gate network at layer 4, the skip into 6,
    attention over norm of layer 7's output from layer 8 on, the last layer's dense connections, each layer's x0 and
    bigram shares added after its attention (the bigram in place), the MLP; the dense connections after the loop.
    The window of its long layers (3, 10) and half of it for the others, over the doubled sequence where paired.
    Controls: "own input", layers 8..10 attend over their own input; "stream before v", the last layer recombines the
    stream before it mixes v (the same values in another order of statements)."""
    L, H = model.num_layers, 6
    paired_layers, long_layers, gated_outputs, composed = (0, 2, 5, 9), (3, 10), (3, 10), (10,)
    unit = train_gpt.BLOCK_SIZE
    masks = {(paired, long): train_gpt.attention_mask(tokens, (window if long else window // 2) * unit, "sdpa",
                                                       paired=paired)
             for paired in (False, True) for long in (False, True)}
    sa_lambdas = model.scalars[:2 * L].view(-1, 2)
    smear_lambda = model.scalars[2 * L]
    skip_lambda = model.scalars[2 * L + 1]
    dtype = model.embed.weight.dtype
    resid_attn = model.resid_lambdas[:, 0].to(dtype).unbind(0)
    resid_mlp = model.resid_lambdas[:, 1].to(dtype).unbind(0)
    post_attn = model.post_lambdas[:, 0].to(dtype).unbind(0)
    post_mlp = model.post_lambdas[:, 1].to(dtype).unbind(0)
    ve_gates = [block.attn.ve_gate.weight if block.attn is not None and block.attn.ve_gate is not None else None
                for block in model.blocks]
    attn_gates, dc_weights, xsa_alphas, x0_gates, bigram_gates = ([None] * L for _ in range(5))
    attention = [block.attn for block in model.blocks if block.attn is not None]
    qk_all = torch.stack([attn.qk_w for attn in attention]).view(len(attention), -1, model.embed.weight.size(1))
    vo_flat = torch.stack([attn.vo_w for attn in attention]).flatten(1, 2)
    attn_weights = torch.cat([qk_all, vo_flat], dim=1).unbind(0)

    x = model.embed(tokens)
    sign_idx = torch.zeros_like(tokens)
    sign_idx[1:] = (tokens[:-1] ^ tokens[1:]) % model.bigram_signs.size(0)
    bigram_signs = model.bigram_signs[sign_idx]
    x0_bigram = (model.bigram_embed(heads_bigram_hash(tokens, model.bigram_embed.num_embeddings)) * bigram_signs)[None]
    ve = model.value_embeds.view(5, -1, model.value_embeds.size(1))[:, tokens]
    ve = [None, ve[0], ve[1], *[None] * (L - 6), ve[2], ve[3], ve[4]]
    smear_gate_out = smear_lambda * torch.sigmoid(F.linear(x[1:, :12], model.smear_gate.weight))
    x = torch.cat([x[:1], x[1:] + smear_gate_out * x[:-1]])
    x = x0 = train_gpt.norm(x[None])
    pre_lanes, post_lanes = heads_gate_lanes()
    nets, mudd = model.gates, model.mudd

    def unpack(gate, lanes):
        for (kind, layer), s in ((name, s) for name, s in lanes.items() if not isinstance(name, str)):
            dict(xsa=xsa_alphas, output=attn_gates, x0=x0_gates, bigram=bigram_gates)[kind][layer] = gate[..., s]

    unpack(heads_coefficients(x0, nets.w1[0], nets.w2[0], nets.b2[0], nets.scale.type_as(x0), 26), pre_lanes)
    D = x.size(-1)
    x = x0.clone()
    x[..., :D] = x[..., :D] + x0_bigram * bigram_gates[0]
    cache = {0: x}
    starts = train_gpt.document_starts(tokens, None)
    scale = model.attention_scales[window]
    for i in range(L):
        mu = None
        if i == 4:
            post_gate = heads_coefficients(x, nets.w1[1], nets.w2[1], nets.b2[1], nets.scale.type_as(x), 41)
            unpack(post_gate, post_lanes)
            post_skip_gate = post_gate[..., post_lanes["skip"]]
            dc_weights[10] = (post_gate[..., post_lanes["w1"]], post_gate[..., post_lanes["w2"]])
        if i == 6:
            skip_gate_out = torch.sigmoid(skip_lambda) * post_skip_gate
            x = x + skip_gate_out * cache[3]
        else:
            qkvo_w = attn_weights[i - (i > 6)]
            attn_in_normed = train_gpt.norm(x if control == "own input" else cache.get(7, x))
            B, T = attn_in_normed.shape[:2]
            if i == L - 1:
                cache[9] = x
                mu = heads_coefficients(x, mudd.w1[0], mudd.w2[0], mudd.b2[0], 0.1, 14).split(1, dim=-1)
                if control == "stream before v":
                    stream = (1 + mu[5]) * x + mu[3] * cache[0] + mu[4] * cache[7]
                v_mudd = (mu[0] * cache[0] + mu[1] * cache[7] + mu[2] * x).view(B, T, H, -1)
                x = stream if control == "stream before v" else (1 + mu[5]) * x + mu[3] * cache[0] + mu[4] * cache[7]
                ve_gate = torch.cat([mu[6], mu[7]], dim=-1).repeat_interleave(H // 2, dim=-1).unsqueeze(-1)
                aux_v = (ve_gate * ve[i].view(B, T, H, -1) + v_mudd).view(B, T, -1)
            elif ve[i] is not None:
                gate_in = torch.cat([attn_in_normed[..., :6], ve[i][None, ..., :6]], dim=-1)
                ve_gate_out = 2 * torch.sigmoid(F.linear(gate_in, ve_gates[i])).view(B, T, H, 1)
                aux_v = (ve_gate_out * ve[i].view(B, T, H, -1)).view(B, T, -1)
            else:
                aux_v = None
            paired, long = i in paired_layers, i in long_layers
            gate, dc_w = attn_gates[i] if i in gated_outputs else None, dc_weights[i] if i in composed else None
            attn_out = heads_attention(attn_in_normed, qkvo_w, sa_lambdas[i], masks[paired, long], model.rotary, scale,
                                       paired, long, aux_v, xsa_alphas[i], gate, dc_w, starts)
            if mu is not None:
                x = mu[8] * x + mu[9] * attn_out + mu[10] * cache[0]
                x[..., :D] = x[..., :D] + mu[11] * x0_bigram
            else:
                x = resid_attn[i] * x + post_attn[i] * attn_out + x0 * x0_gates[i]
                if i != 0:
                    x[..., :D] = x[..., :D] + x0_bigram * bigram_gates[i]
        normed = train_gpt.norm(x)
        if mu is not None:
            x = mu[12] * x + mu[13] * model.blocks[i].mlp(normed)
        else:
            x = resid_mlp[i] * x + post_mlp[i] * model.blocks[i].mlp(normed)
        if i in (3, 7):
            cache[i] = x
    mu = heads_coefficients(x, mudd.w1[1], mudd.w2[1], mudd.b2[1], 0.1, 5).split(1, dim=-1)
    ve_bank0 = ve[1][None].to(dtype=x.dtype)
    return x + mu[0] * cache[0] + mu[1] * cache[7] + mu[2] * cache[9] + mu[3] * ve_bank0 + mu[4] * cache[3]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_trunk_computes_heads_forward(dtype):
    """HEAD's structure at width 48 (records_shape_gpt), random weights, gates and coefficients, three documents, a
    window of 2 blocks that cuts the last one (282 tokens) in every kind of layer (long 256 tokens, short 128, paired
    128 positions): the trunk equals HEAD's forward written out (heads_forward), to the bit, and so does
    every parameter's gradient through a fixed random weighting of it (the order of operations sets the order in which
    the gradients of the tensors used again and again sum: x0, the bigram rows, the cached states, the value
    embeddings). The lm_head alone, unused by the trunk, gets none. Controls: attending past layer 7 over the layers'
    own input gives another stream; recombining the last layer's stream before mixing its v, the same stream and other
    gradients."""
    model = randomize_(records_shape_gpt(dtype))
    twin = copy.deepcopy(model)
    tokens = documents()[0].clone()
    tokens[300] = 1  # documents at 0, 100 and 230
    weighting = torch.randn(1, T, 48, generator=torch.Generator().manual_seed(5)).to(dtype)
    trunk = model.trunk(tokens, 2)
    expected = heads_forward(twin, tokens, 2)
    assert trunk.dtype == dtype and torch.equal(trunk, expected)
    (trunk * weighting).sum().backward()
    (expected * weighting).sum().backward()
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        if name == "lm_head.weight":
            assert p.grad is None and q.grad is None
        else:
            assert p.grad.any() and torch.equal(p.grad, q.grad), name
    with torch.no_grad():
        assert not torch.equal(trunk, heads_forward(twin, tokens, 2, control="own input"))
    reordered = copy.deepcopy(model)
    reordered.zero_grad()
    stream = heads_forward(reordered, tokens, 2, control="stream before v")
    assert torch.equal(stream, trunk)
    (stream * weighting).sum().backward()
    assert not all(torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(), reordered.parameters())
                   if p.grad is not None)


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


def uniform_eval_loss_bound(padded: int, positions: int) -> float:
    """How far eval's chunked mean loss over positions lies from ln(padded) when every logit is 15 (a zero lm_head):
    exp2 of 15 log2(e), rounded, in each of the padded equal terms; their sum, whose equal partial sums round alike;
    log's ulps; the row's subtraction; then the sum of equal row losses and its division."""
    u, log_vocab = UNIT_ROUNDOFF[torch.float32], math.log(padded)
    return ((15 + 2 * EXP_ULPS) * u - math.log1p(-worst_case_gamma(padded - 1)) + 2 * EXP_ULPS * u * (15 + log_vocab)
            + u * log_vocab + worst_case_gamma(positions - 1) * log_vocab)


def test_a_zero_lm_head_gives_uniform_logits():
    """The MLP's output projections start at zero (attention's four matrices and the up-projection drawn); with the lm_head
    zeroed (it starts drawn: test_the_construction_draws_as_heads_does) every logit is the same value, the
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
    args = train_gpt.Hyperparameters(**FEW_LAYERS, num_heads=2, head_dim=16, model_dim=32, vocab_size=256)
    plan = train_gpt.plan_device(args, torch.device("cpu"))
    assert plan.dtype == "bfloat16"
    for built, dtype in ((train_gpt.build_model(args, 256), torch.float32),
                         (train_gpt.build_model(args, 256, plan), torch.bfloat16)):
        assert built.rotary.cos.dtype == built.rotary.sin.dtype == dtype


def test_rotary_without_rescale_keeps_the_base_frequencies():
    """A model's rotary starts at the base frequencies, and a window that does not change leaves them
    (and the tables) as they were, bit for bit."""
    args = train_gpt.Hyperparameters(**FEW_LAYERS, model_dim=32, num_heads=2, head_dim=16, window_stages=(2, 2, 4),
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



def test_forward_backward_fp32_reaches_every_parameter():
    """fp32, SDPA backend, several documents, the cpu preset's structure (heads paired in layer 1, XSA in 0): every
    parameter gets a finite gradient, nonzero wherever it is used: per entry of the scalars, the attention lambdas of
    the attention layers, the smear's and the skip's; of the stream's lambdas, every layer's but the last (whose factors
    the dense connections make, as HEAD's) and the attention-free layer's attention pair; of the coefficient networks'
    biases, the lanes their layouts use (8 and 7 of 8 gate lanes, 14 and 5 of 14 dense ones)."""
    model = randomize_(tiny_gpt(paired_layers=(1,), xsa_layers=(0,)))
    tokens, targets = documents()
    summed_loss(model, tokens, targets, 2).backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().max() > 0, name
    attention = torch.tensor([True, True, False, True])
    expected = torch.cat([attention.repeat_interleave(2), torch.ones(2, dtype=torch.bool)])
    assert torch.equal(model.scalars.grad != 0, expected)
    used = torch.tensor([[True, True], [True, True], [False, True], [False, False]])
    assert torch.equal(model.resid_lambdas.grad != 0, used) and torch.equal(model.post_lambdas.grad != 0, used)
    lanes = lambda widths, total: torch.stack([torch.arange(total) < n for n in widths])  # noqa: E731
    assert torch.equal(model.gates.b2.grad != 0, lanes((8, 7), 8))
    assert torch.equal(model.mudd.b2.grad != 0, lanes((14, 5), 14))


def test_gradients_become_ready_in_reversed_parameter_order():
    """GradientBuckets packs parameters in reversed(model.parameters()) order, assuming that is the order in which
    backward finishes them. Recorded with post-accumulate-grad hooks at 8 layers: the lm_head first; then the last
    layer's block and the dense connections (after the loop and at the last layer's input); the blocks from the one
    before to layer 1 (each block's parameters before any of an earlier block's); then layer 0's with the parameters
    used by every layer or before them: the gate networks (the second reads layer 2's output, the first x0), scalars,
    embeddings, the smear's gate, and the stream's lambdas, whose last use, layer 0's residual, comes before its
    attention weights' gradients. Listed so, the registration order is that order reversed, stage by stage."""
    model = randomize_(tiny_gpt(8))
    L = 8
    order = []
    for name, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(lambda p, name=name: order.append(name))

    def stage(name):  # 0: lm_head, 1: the last layer with its dense connections, 2..L-1: blocks L-2..1, L: the rest
        if name == "lm_head.weight":
            return 0
        if name.startswith("mudd."):
            return 1
        if name.startswith("blocks.") and name.split(".")[1] != "0":
            return L - int(name.split(".")[1])
        return L

    tokens, targets = documents()
    summed_loss(model, tokens, targets, 2).backward()
    assert sorted(order) == sorted(name for name, _ in model.named_parameters())
    assert order[0] == "lm_head.weight"
    ready = [stage(name) for name in order]
    assert ready == sorted(ready), order
    bucket_order = [stage(name) for name, _ in reversed(list(model.named_parameters()))]
    assert bucket_order == sorted(bucket_order)


def test_the_smear_by_hand():
    """e'_0 = e_0 and e'_t = e_t + lambda sigmoid(w . e_t[:12]) e_(t-1), lambda the scalars' entry after the layers'
    lambdas, token by token in float64 from the float64 model's own weights, on both sides: the 12-term dot within
    gamma(12) of sum |w e| (sigmoid's slope, at most 1/4, shrinks it), the gate's exp within EXP_ULPS units and three
    more roundings, the product and the sum one each."""
    model = randomize_(tiny_gpt()).double()
    e = torch.randn(40, 32, dtype=torch.float64)
    w, lam = model.smear_gate.weight[0].detach(), model.scalars[2 * model.num_layers].item()
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


def test_the_value_embedding_gate_by_hand():
    """CausalSelfAttention.value_input: per position and head, the value embedding's head slice times
    2 sigmoid(w . (x[:6], ve[:6])) (the records' gate from 2026-02-03, on every gated layer from 2026-05-27), in float64
    by a loop from the same float32 inputs: the 12-term dot within gamma(12) of sum |w g|, moving the sigmoid by at most
    a quarter of that; sigmoid's exp within EXP_ULPS ulps and its two roundings, the doubling exact, the product one
    rounding. The gate of the records before, on x[:12], is outside that bound."""
    torch.manual_seed(0)
    attn = train_gpt.CausalSelfAttention(32, 2, 16, ve_gate=True, key_offset=False, paired=False)
    with torch.no_grad():
        attn.ve_gate.weight.normal_()
    x, ve = torch.randn(1, 20, 32), torch.randn(20, 32)
    w = attn.ve_gate.weight.detach().double()
    got = attn.value_input(x, ve)
    u = UNIT_ROUNDOFF[torch.float32]
    for reads, inside in (("x[:6], ve[:6]", True), ("x[:12]", False)):
        expected, bound = torch.empty(1, 20, 32, dtype=torch.float64), torch.empty(1, 20, 32, dtype=torch.float64)
        for t in range(20):
            g = torch.cat([x[0, t, :6], ve[t, :6]]) if inside else x[0, t, :12]
            for h in range(2):
                dot = float((w[h] * g.double()).sum())
                gate = 2 / (1 + math.exp(-dot))
                rows = slice(16 * h, 16 * h + 16)
                expected[0, t, rows] = gate * ve[t, rows].double()
                gate_error = gamma(12) * float((w[h] * g.double()).abs().sum()) / 2 + (2 * EXP_ULPS + 2) * u * gate
                bound[0, t, rows] = (gate_error + u * gate) * ve[t, rows].double().abs()
        if inside:
            assert_within(got, expected, bound, "value-embedding gate")
        else:
            with pytest.raises(AssertionError, match="times the derived bound"):
                assert_within(got, expected, bound, "the gate on x[:12]")


def test_xsa_takes_out_each_heads_output_along_its_own_value():
    """self_value_share (the records' gated XSA from 2026-04-29) against float64 per position and head from the same
    float32 inputs: tanh(s) (y . v / max(|v|^2, 1e-8)) v. In float32 each of the two 16-term sums within gamma(16) of
    its magnitudes, the quotient one rounding; tanh within EXP_ULPS ulps; the two products one rounding each. A head
    whose value is zero takes out nothing (the floor keeps the quotient finite)."""
    g = torch.Generator().manual_seed(0)
    y, v = torch.randn(1, 20, 3, 16, generator=g), torch.randn(1, 20, 3, 16, generator=g)
    s = torch.randn(1, 20, 3, generator=g)
    v[0, 4, 1] = 0
    got = train_gpt.self_value_share(y, v, s)
    assert not got[0, 4, 1].any() and torch.isfinite(got).all()
    yd, vd, u = y.double(), v.double(), UNIT_ROUNDOFF[torch.float32]
    dot, square = (yd * vd).sum(-1, keepdim=True), vd.square().sum(-1, keepdim=True).clamp_min(1e-8)
    strength = torch.tanh(s.double())[..., None]
    expected = strength * (dot / square) * vd
    along_error = (gamma(16) * (yd * vd).abs().sum(-1, keepdim=True) + dot.abs() * (gamma(16) + u)) / square
    bound = strength.abs() * along_error * vd.abs() + (2 * EXP_ULPS + 2) * u * expected.abs()
    assert_within(got, expected, bound, "XSA")


def test_training_with_multi_token_weights_takes_the_records_loss():
    """The model's training loss with mtp_weights is SoftcappedLoss's sum over its normed final stream and the
    lm_head's weight with those weights, to the bit; None is the next token's alone (weights (1,)), the summed
    cross-entropy of the float32 softcap of the raw logits within float32's rounding."""
    model = randomize_(tiny_gpt())
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
    logits = F.linear(xn, model.lm_head.weight)
    plain = F.cross_entropy(train_gpt.softcap(logits), targets, reduction="sum")
    assert abs(one.item() - plain.item()) <= gamma(T + 60) * plain.item()


def test_bf16_embeddings_path():
    """Embedding tables (the token's, the value and bigram ones, the bigram's signs) and the coefficient networks'
    weights and biases (which HEAD's forward takes uncast) stored in bf16, as training stores them, make the whole
    forward bf16: the other weights are cast to it, lambdas and the gates' scale rounded to it, results rounded to it up
    to the float32 logits; rms_norm's eps stays float32's (torch norms bf16 in float32, with float32's eps, which the tied
    embedding's small initial rows show). It runs forward and backward, and its loss
    lies within the probabilistic first-order bound (tests/rounding.py) of a float64 twin with float32's eps; that
    twin gives the fp32 loss within first_order_bound."""
    model = randomize_(tiny_gpt())
    tokens, targets = documents()
    float64_model = copy.deepcopy(model).double()
    fp32_exact, fp32_bound = first_order_bound(lambda: summed_loss(float64_model, tokens, targets, 2))
    with torch.no_grad():
        assert abs(model(tokens, targets, 2).item() - fp32_exact) <= fp32_bound
    stored = lambda m: [m.embed.weight, m.value_embeds, m.bigram_embed.weight,  # noqa: E731
                        *[p for net in (m.gates, m.mudd) for p in (net.w1, net.w2, net.b2)]]
    for p in stored(model):
        p.data = p.data.bfloat16()
    model.bigram_signs = model.bigram_signs.bfloat16()
    with TorchCalls() as bf16_forward:
        loss = summed_loss(model, tokens, targets, 2)
    loss.backward()
    with TorchCalls(norm_dtype=torch.float32) as float64_forward:
        float64_loss = summed_loss(float64_model, tokens, targets, 2)
    bound = probabilistic_bound(bf16_forward, float64_forward, float64_loss, stored(float64_model))
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
    return F.cross_entropy(logits.view(-1, logits.size(-1)), targets, reduction="sum")


def exact_loss_and_bound(model, tokens, targets, window):
    """The model's summed training loss in float64 and the first-order bound on the error of any float32
    evaluation (tests/rounding.py): SDPA and FlexAttention kernels, eager or compiled, round within it."""
    exact = copy.deepcopy(model).double()
    return first_order_bound(lambda: summed_loss(exact, tokens, targets, window))


@pytest.mark.slow  # the uncompiled flex test below runs the same kernel
@needs_flex_on_cpu
def test_compiled_flex_model_matches_sdpa(monkeypatch):
    """The flex backend under torch.compile (BlockMasks built inside the graph, the window an int as in
    training) gives the SDPA backend's training loss for the same weights (fp32), both within the derived
    bound of the float64 loss, on a document longer than both windows: a window of 2 blocks cuts the long
    layers' keys (256) and the short ones' (128); layer 1's heads paired, over its doubled sequence. Inductor's CPU
    FlexAttention template takes no epilogue (torch 2.13: NotImplementedError), so the output gate's product
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
        assert abs(F.cross_entropy(logits[0], targets, reduction="sum").item() - exact) > bound


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
    one_hot = F.one_hot(targets, V).double()
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
                                                         windows=WINDOWS, backout_layer=2, fp8=fp8,
                                                         loss_scale=0.5))).train()
    x_s, w_s, grad_s = train_gpt.LM_HEAD_FP8_SCALES
    assert model.fp8_scales == ((x_s, w_s, 0.5 * grad_s) if fp8 else None)
    assert not hasattr(model.lm_head, "fp8_scales")
    by_hand = copy.deepcopy(model)
    loss = model(inputs, targets, 4)
    loss.backward()
    x = train_gpt.norm(by_hand.trunk(inputs, 4))
    assert torch.equal(by_hand.lm_head(x), F.linear(x, by_hand.lm_head.weight))
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


def test_fp8_reaches_every_mlp_and_update_down_scales_refreshes_each():
    """GPTConfig.fp8 puts every MLP's training forward in FP8, as the lm_head's; update_down_scales gives each block's
    down-projection what refresh_down_scales gives it alone, bootstrap or not."""
    for fp8 in (False, True):
        model = randomize_(train_gpt.GPT(train_gpt.GPTConfig(VOCAB, 4, num_heads=2, head_dim=16, model_dim=32,
                                                             max_seq_len=T, windows=WINDOWS, backout_layer=2, fp8=fp8)))
        assert [block.mlp.fp8 for block in model.blocks] == [fp8] * 4 and (model.fp8_scales is not None) == fp8
    with torch.no_grad():  # a scale of its own for each
        for i, block in enumerate(model.blocks):
            block.mlp.c_proj.mul_(i + 1)
    for bootstrap in (True, False, False):
        twin = copy.deepcopy(model)
        model.update_down_scales(bootstrap)
        for block, alone in zip(model.blocks, twin.blocks):
            mlp = alone.mlp
            train_gpt.refresh_down_scales([mlp.c_proj], [mlp.down_scale], [mlp.next_down_scale], bootstrap)
            for name in ("down_scale", "next_down_scale"):
                assert torch.equal(getattr(block.mlp, name), getattr(mlp, name)), (bootstrap, name)
        with torch.no_grad():  # as an optimizer step would
            for block in model.blocks:
                block.mlp.c_proj.mul_(1.1)
    assert len({float(block.mlp.down_scale) for block in model.blocks}) == 4


def test_the_trainer_updates_the_down_scales_once_after_each_optimizer_step(monkeypatch):
    """After the step's optimizer steps have moved the MLPs' weights: bootstrap for steps below DOWN_BOOTSTRAP_STEPS
    (the records' step < 16, their update after steps 0..15), then not."""
    args = train_gpt.parse_args(["--preset=cpu", "--model_dim=32", "--num_heads=2", "--head_dim=16",
                                 "--seq_len=128", "--batch_slots=1", "--vocab_size=1000", "--num_iterations=20",
                                 "--compile=false", "--dtype=float32", *[f"--{k}={v}" for k, v in FEW_LAYERS.items()]],
                                "cpu")[0]
    trainer = train_gpt.Trainer(args, 0, 1, train_gpt.plan_device(args, torch.device("cpu")))
    calls = []
    real = train_gpt.GPT.update_down_scales

    def update(model, bootstrap):
        calls.append((bootstrap, not torch.equal(model.blocks[0].mlp.c_proj, weights)))
        real(model, bootstrap)

    monkeypatch.setattr(train_gpt.GPT, "update_down_scales", update)
    tokens = torch.randint(0, 1000, (129,), generator=torch.Generator().manual_seed(0))
    for step in (14, 15, 16, 17):
        weights = trainer.model.blocks[0].mlp.c_proj.detach().clone()
        trainer.train_step(step, [(tokens[:-1].int(), tokens[1:])])
    assert train_gpt.DOWN_BOOTSTRAP_STEPS == 16 and calls == [(True, True), (True, True), (False, True), (False, True)]


@pytest.mark.parametrize("backend", ["eager", pytest.param("aot_eager", marks=pytest.mark.slow)])  # one capture by default
@pytest.mark.parametrize("lm_head", ["fp8", "plain"])
def test_the_captured_graphs_compute_eager_s_numbers(backend, lm_head):
    """torch.compile's capture (backend eager: dynamo's graph) and its forward and backward graphs (aot_eager: AOT
    autograd's) run eager's kernels, so the loss and every parameter gradient equal eager's to the bit: on the
    record's path (the lm_head's FP8 matmul; dense masks stand in for FlexAttention, whose backward needs CUDA) and the
    CPU's (without FP8), both inside the whole-logits loss (SoftcappedLoss). torch 2.11's capture gave zero
    gradients for a loss that an autograd.Function summed in place; inductor's kernels round apart, within the
    bounds derived above. (A vocabulary of 1000: the loss's cost is its logits'.)"""
    results = []
    for compiled in (False, True):
        torch.manual_seed(0)
        model = randomize_(train_gpt.GPT(train_gpt.GPTConfig(1000, 4, num_heads=2, head_dim=16, model_dim=32,
                                                             max_seq_len=T, windows=WINDOWS, backout_layer=2,
                                                             fp8=lm_head == "fp8"))).train()
        inputs, targets = (tokens % 1000 for tokens in documents())
        torch._dynamo.reset()
        forward = torch.compile(model, backend=backend, fullgraph=True, dynamic=False) if compiled else model
        loss = forward(inputs, targets, 4)
        loss.backward()
        results.append([loss.detach(), *(p.grad for p in model.parameters())])
    assert all(g.abs().sum() > 0 for g in results[0])  # every parameter has a gradient to lose
    for (name, _), eager, captured in zip([("loss", None), *model.named_parameters()], *results):
        assert torch.equal(captured, eager), name


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


def kernel_loss(logits, targets, weights, prefix_targets, prefix_weight, grad_scale, grad_s=1.0, cap=23.0, offset=5.0,
                spread=7.5):
    """The fused CUDA kernel of the records from 2026-04-04 (ce_fwd_bwd_kernel, with the prefix term from 2026-07-13)
    written out row by row, each row as its block computes it, in float32 (its scalars float32 as it casts them; torch's
    tanh, exp and log for its fast-math ones): s = 0.5 + tanh(u / 2) / 2 at u = x inv_C + B_div_C (inv_C = 1 / C,
    B_div_C = B inv_C), stored in the logits' dtype; the row's max of A s before that rounding, the sum of exp(A s -
    max), lse = max + log(sum); the loss the sum, in order, of w_k (lse - A s[target_(r+k)]) where r + k < T, then
    prefix_weight (lse - A s[prefix]) where the prefix is not -1. S_w: the prefix weight where valid, then every w_k.
    Every column's gradient ((g (1 / C A)) (1 / grad_s)) (S_w exp(A s - lse) - term2) s (1 - s), left to right, term2
    0 but at the targets, each thread's (the k within the sequence, then the prefix) the weights aiming there in the
    same order. Returns the losses and the float32 gradient before its rounding (to e5m2: satfinite)."""
    T, V, n = targets.numel(), logits.size(1), weights.numel()
    one = torch.tensor(1.0)
    A, B, C, grad_scale, grad_s = (torch.tensor(value) for value in (cap, offset, spread, grad_scale, grad_s))
    prefix_weight = prefix_weight.reshape(())
    inv_C = one / C
    B_div_C = B * inv_C
    losses, grads = torch.zeros(T), torch.zeros(T, V)
    for r in range(T):
        sigmoid = 0.5 + torch.tanh((logits[r].float() * inv_C + B_div_C) * 0.5) * 0.5
        stored = sigmoid.to(logits.dtype).float()
        block_max = (A * sigmoid).max()
        lse = block_max + torch.log(torch.exp(A * stored - block_max).sum())
        prefix = int(prefix_targets[r])
        prefix_valid = prefix >= 0
        total = torch.tensor(0.0)
        for k in range(n):
            if r + k < T:
                total = total + weights[k] * (lse - A * stored[targets[r + k]])
        if prefix_valid:
            total = total + prefix_weight * (lse - A * stored[prefix])
        losses[r] = total
        S_w = prefix_weight if prefix_valid else torch.tensor(0.0)
        for k in range(n):
            S_w = S_w + weights[k]
        factor = grad_scale * (one / C * A) * (one / grad_s)
        grads[r] = factor * (S_w * torch.exp(A * stored - lse) - 0.0) * stored * (1.0 - stored)
        for thread in range(n + 1):
            if thread < n:
                valid = r + thread < T
                target = int(targets[r + thread]) if valid else -1
            else:
                target, valid = prefix, prefix_valid
            if valid:
                s_at = stored[target]
                term2 = torch.tensor(0.0)
                for k in range(n):
                    if r + k < T and targets[r + k] == target:
                        term2 = term2 + weights[k]
                if prefix_valid and prefix == target:
                    term2 = term2 + prefix_weight
                grads[r, target] = factor * (S_w * torch.exp(A * s_at - lse) - term2) * s_at * (1.0 - s_at)
    return losses, grads


def loss_case_targets(g, T, V):
    """T random targets below V, some coinciding across the next three: the same column for k = 0, 1, 2 in row 7, for
    k = 0 and 2 (not 1) in row 15, and for the two k left in row T - 2, near the end; and prefix targets, most random,
    -1 (none) in rows 0, 11 and 20, some on those columns: in row 7 (all three k's), row 15 (k = 0 and 2), row 3 (k =
    1), row T - 2 (the k = 0 and 1 of the row's two) and row T - 1 (its one k)."""
    targets = torch.randint(0, V, (T,), generator=g)
    targets[7] = targets[8] = targets[9]
    targets[15] = targets[17]
    targets[T - 2] = targets[T - 1]
    assert targets[16] != targets[15]
    prefixes = torch.randint(0, V, (T,), generator=g)
    prefixes[[0, 11, 20]] = -1
    prefixes[7], prefixes[15], prefixes[3] = targets[7], targets[15], targets[4]
    prefixes[T - 2] = prefixes[T - 1] = targets[T - 1]
    return targets, prefixes


LOSS_CASE_WEIGHTS = (torch.tensor([1.0, 0.5, 0.1875]), torch.tensor([1.0]))  # a stage-1 fade's, and the last stages'


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_training_loss_is_the_fused_kernel_s(dtype):
    """SoftcappedLoss without FP8 against the fused kernel written out (kernel_loss), bf16 logits (the records') and
    float32 (the CPU's float32 runs: s kept in float32), 50304 columns, 29 rows, three predictions and one, each with
    the prefix term (prefix targets on the predictions' columns, and none in some rows: loss_case_targets) and without
    it, grad_scale 1/8. x = I and w = the raw logits transposed, so that the logits are exactly w^T and their gradient
    exactly grad_w^T: the per-row losses and that gradient, rounded once to the logits' dtype, equal to the bit, and
    grad_x = g w. A prefix weight of 0 gives the losses and gradients without the term, to the bit. Control: the
    sigmoid in its exp form gives another s."""
    g = torch.Generator().manual_seed(0)
    T, V = 29, 50304
    logits = (torch.randn(T, V, generator=g) * 4).to(dtype)
    targets, prefixes = loss_case_targets(g, T, V)
    none, prefix_weight = torch.full((T,), -1), torch.tensor(0.1875)
    for weights in LOSS_CASE_WEIGHTS:
        results = {}
        for name, prefix_targets, pw in (("prefix", prefixes, prefix_weight), ("weight 0", prefixes, torch.tensor(0.0)),
                                         ("none", None, None)):
            x, w = torch.eye(T, dtype=dtype).requires_grad_(), logits.T.contiguous().requires_grad_()
            losses = train_gpt.SoftcappedLoss.apply(x, w, targets, weights, 23.0, 5.0, None, prefix_targets, pw)
            (losses.sum() * 0.125).backward()
            by_hand, by_hand_grad = kernel_loss(logits, targets, weights, none if pw is None else prefix_targets,
                                                torch.tensor(0.0) if pw is None else pw, 0.125)
            by_hand_grad = by_hand_grad.to(dtype)
            assert torch.equal(losses, by_hand) and torch.equal(w.grad.T, by_hand_grad), (name, weights)
            assert torch.equal(x.grad, by_hand_grad.mm(w.detach()))
            results[name] = (losses.detach(), w.grad)
        assert all(torch.equal(a, b) for a, b in zip(results["weight 0"], results["none"]))
        assert not torch.equal(results["prefix"][0], results["none"][0])
    u = logits.float() * train_gpt.INV_SPREAD + 5 * train_gpt.INV_SPREAD
    assert not torch.equal(train_gpt.kernel_sigmoid(logits, 5.0), torch.sigmoid(u))


@pytest.mark.parametrize("grad_s", [0.125 * 0.75 / 448, 2.0 ** -20])
def test_the_fp8_training_loss_is_the_fused_kernel_s(grad_s, monkeypatch):
    """SoftcappedLoss with the record's FP8 x and w scales against the record's FusedSoftcappedCrossEntropy written
    out: its forward's e4m3 copies of x / x_s and of the lm_head weight / w_s (which it stores (model_dim, vocab)) and
    its bf16 logits by _scaled_mm, called as it calls it; its kernel (kernel_loss, grad_scale 1/8 and grad_s, the
    record's at 1 GPU, and one so small that entries pass e5m2's largest, which the kernel's conversion saturates to)
    on 29 rows of normed x and 50304 columns of an lm_head spanning the FP8 range, three predictions and the prefix
    term (loss_case_targets); its backward's grad_x (bf16) and grad_w (float32, then the bf16 weight's, as autograd
    rounds the record's) by _scaled_mm from the e5m2 codes and the e4m3 copies, as it calls it. The losses, the codes
    SoftcappedLoss hands fp8_mm_backward, grad_x and grad_w: equal to the bit."""
    g = torch.Generator().manual_seed(1)
    T, V, D = 29, 50304, 32
    x = train_gpt.norm(torch.randn(T, D, generator=g)).bfloat16()
    w = (torch.rand(V, D, generator=g) * 1.75 - 0.875).bfloat16()
    targets, prefixes = loss_case_targets(g, T, V)
    weights, prefix_weight = LOSS_CASE_WEIGHTS[0], torch.tensor([0.25])  # the record's shape (1,)
    x_s, w_s = train_gpt.LM_HEAD_FP8_SCALES[:2]
    scales = (x_s, w_s, grad_s)
    handed = []
    fp8_mm_backward = train_gpt.fp8_mm_backward
    monkeypatch.setattr(train_gpt, "fp8_mm_backward",
                        lambda g_f8, *args: handed.append(g_f8) or fp8_mm_backward(g_f8, *args))
    xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
    losses = train_gpt.SoftcappedLoss.apply(xi, wi, targets, weights, 23.0, 5.0, scales, prefixes, prefix_weight)
    (losses.sum() * 0.125).backward()
    # the record's forward, its lm_head weight stored (model_dim, vocab)
    lm_head_weight = w.T.contiguous()
    x_f8 = x.div(x_s).to(torch.float8_e4m3fn)
    w_f8 = lm_head_weight.div(w_s).to(torch.float8_e4m3fn)
    logits = torch._scaled_mm(x_f8, w_f8.T.contiguous().T, out_dtype=torch.bfloat16, use_fast_accum=True,
                              scale_a=x.new_tensor(x_s, dtype=torch.float32),
                              scale_b=x.new_tensor(w_s, dtype=torch.float32))
    by_hand, grad32 = kernel_loss(logits, targets, weights, prefixes, prefix_weight, 0.125, grad_s)
    e5m2_max = torch.finfo(torch.float8_e5m2).max
    grad_input = grad32.clamp(-e5m2_max, e5m2_max).to(torch.float8_e5m2)  # cvt.rn.satfinite
    assert (grad32.abs().max() > e5m2_max) == (grad_s < 2 ** -19)
    # the record's backward
    x_scale, w_scale, grad_scale = (torch.tensor(scale, dtype=torch.float32) for scale in scales)
    grad_x = torch._scaled_mm(grad_input, w_f8.T, out_dtype=torch.bfloat16, scale_a=grad_scale, scale_b=w_scale,
                              use_fast_accum=False)
    grad_w = torch._scaled_mm(x_f8.T.contiguous(), grad_input.T.contiguous().T, out_dtype=torch.float32,
                              scale_a=x_scale, scale_b=grad_scale, use_fast_accum=False)
    assert torch.equal(losses.detach(), by_hand)
    assert len(handed) == 1 and torch.equal(handed[0].view(torch.uint8), grad_input.view(torch.uint8))
    assert torch.equal(xi.grad, grad_x) and torch.equal(wi.grad, grad_w.T.bfloat16())


def test_the_bf16_training_loss_is_the_float64_loss_within_s_s_rounding():
    """SoftcappedLoss on bf16 logits (three predictions and the prefix term, loss_case_targets) against float64: the
    exact loss, and the kernel's gradient, that of the loss plus each row's multi-token weights past the end times its
    log-sum-exp (its softmax part counts them), both within a bound derived from the arithmetic, s's rounding to bf16
    (u_b) above all: s within e = u_b s + du / 4 + (EXP_ULPS + 1) u of the exact sigmoid (u's error du = 3 u (|x| + 5)
    / 7.5: 1 / 7.5, B / 7.5 and u's two roundings; tanh within EXP_ULPS ulps and of slope <= 1 at u / 2; the sum with
    0.5), each A s within A e + u A s; the log-sum-exp within the largest of those (it is 1-Lipschitz in its terms)
    plus float32's: the differences (u A), exp (2 EXP_ULPS u), the V-term sum, log and its sum with the max. A row: each
    term's difference and product, and their sum. The gradient: g (A / 7.5) (S_w p - a) s (1 - s) with p within a
    factor exp(+-dp) (dp: the target's and the log-sum-exp's errors, exp's) and s (1 - s) within e |1 - 2 s| + e^2,
    taken whole (bf16's errors are too large to drop their products), eight float32 roundings of the products, then
    its rounding to bf16. The gradient of the loss alone lies outside that bound in the last row."""
    g = torch.Generator().manual_seed(2)
    T, V, cap, spread = 29, 50304, 23.0, 7.5
    logits = (torch.randn(T, V, generator=g) * 4).bfloat16()
    targets, prefixes = loss_case_targets(g, T, V)
    weights, prefix_weight = LOSS_CASE_WEIGHTS[0], torch.tensor(0.25)
    w = logits.T.contiguous().requires_grad_()
    losses = train_gpt.SoftcappedLoss.apply(torch.eye(T, dtype=torch.bfloat16), w, targets, weights, cap, 5.0, None,
                                            prefixes, prefix_weight)
    losses.sum().backward()
    u, u_b = UNIT_ROUNDOFF[torch.float32], UNIT_ROUNDOFF[torch.bfloat16]
    x = logits.double().requires_grad_()
    s = torch.sigmoid((x + 5) / spread)
    z = cap * s
    lse = torch.logsumexp(z, -1)
    columns, valid, term_weights = [], [], []
    for k in range(weights.numel()):
        rows = torch.arange(T) + k
        columns.append(targets[rows.clamp_max(T - 1)])
        valid.append(rows < T)
        term_weights.append(weights[k].double().expand(T))
    columns.append(prefixes.clamp_min(0))
    valid.append(prefixes >= 0)
    term_weights.append(prefix_weight.double().expand(T))
    columns, valid, term_weights = (torch.stack(t, 1) for t in (columns, valid, term_weights))
    term_weights = term_weights * valid
    terms = lse[:, None] - z.gather(1, columns)
    exact = (term_weights * terms).sum(1)
    past_end = (weights.double() * ~valid[:, :weights.numel()]).sum(1)  # weights of targets past the end
    (exact + past_end * lse).sum().backward()
    s, z, lse, terms = s.detach(), z.detach(), lse.detach(), terms.detach()
    e = u_b * s + 3 * u * (x.detach().abs() + 5) / spread / 4 + (EXP_ULPS + 1) * u
    z_error = cap * e + u * z
    lse_error = (z_error.amax(1) + u * cap + 2 * EXP_ULPS * u + gamma(V) + 2 * EXP_ULPS * u * lse.abs()
                 + u * lse.abs())
    term_error = lse_error[:, None] + z_error.gather(1, columns) + u * terms.abs()
    bound = (term_weights * (term_error + u * terms.abs())).sum(1) + gamma(4) * (term_weights * terms.abs()).sum(1)
    assert_within(losses, exact.detach(), bound, "losses", gamma(V))
    p = torch.exp(z - lse[:, None])
    weight_sum = (weights.sum() + prefix_weight * (prefixes >= 0)).double()[:, None]
    aimed = torch.zeros(T, V, dtype=torch.float64).scatter_add_(1, columns, term_weights)
    p_spread = torch.expm1(z_error + lse_error[:, None] + u * lse[:, None] + 2 * EXP_ULPS * u)
    slope_error = e * (1 - 2 * s).abs() + e ** 2
    before = (cap / spread) * (weight_sum * p * p_spread * (s * (1 - s) + slope_error)
                               + (weight_sum * p - aimed).abs() * slope_error) + 8 * u * x.grad.abs()
    grad_bound = before + u_b * (x.grad.abs() + before)
    assert_within(w.grad.T, x.grad, grad_bound, "gradient", gamma(V))
    exact_lse = torch.logsumexp(cap * torch.sigmoid((x + 5) / spread), -1)
    loss_alone = torch.autograd.grad(
        ((exact_lse[:, None] - cap * torch.sigmoid((x + 5) / spread).gather(1, columns)) * term_weights).sum(), x)[0]
    assert ((w.grad.T.double() - loss_alone).abs() > grad_bound)[T - 1].any()


def test_the_prefix_table_is_each_tokens_longest_prefix_token(gpt2_ranks_file):
    """prefix_table over the GPT-2 ranks (run_support.gpt2_ranks) against the record's algorithm written out: the
    tokens' bytes in sorted order, a stack of the tokens that are prefixes of the current one (every proper prefix
    sorts before its extensions, and so do the strings between them); -1 for EOT, the padding and tokens without one.
    Its sha256 over the int64 bytes is the record's table's. For a table of 1024 (a vocabulary of 1000, padded): the
    same over the ranks below 1024."""
    ranks = run_support.gpt2_ranks({"GPT2_TIKTOKEN_FILE": str(gpt2_ranks_file)})

    def by_stack(ranks, size):
        table, stack = [-1] * size, []
        for token, i in sorted(ranks.items()):
            while stack and not token.startswith(stack[-1][0]):
                stack.pop()
            if stack:
                table[i] = stack[-1][1]
            stack.append((token, i))
        return table

    table = train_gpt.prefix_table(ranks, 50304)
    assert table.dtype == torch.int64 and table.tolist() == by_stack(ranks, 50304)
    assert (hashlib.sha256(table.numpy().tobytes()).hexdigest()
            == "05f2e6adcf3c87e2415b6f6590239f7fc324a13a2aa82c6323bff1bd4a9df136")
    assert table[50256:].eq(-1).all() and (table >= 0).sum() == 50000
    assert table[ranks[b" the"]] == ranks[b" th"] and table[ranks[b"a"]] == -1
    small = {token: i for token, i in ranks.items() if i < 1024}
    assert train_gpt.prefix_table(ranks, 1024).tolist() == by_stack(small, 1024)


def test_training_takes_the_loss_with_the_multi_token_and_prefix_weights():
    """The model's training loss with mtp_weights and prefix_weight is SoftcappedLoss's sum over its normed final stream
    and the lm_head's weight with those weights and the prefix table's entries of the targets, to the bit; None is the
    next token's alone (weights (1,)) without the prefix term, the summed cross-entropy of the float32 softcap of the
    raw logits within float32's rounding; the table a model starts with (-1: no prefix) gives the loss without it."""
    model = randomize_(records_shape_gpt())
    model.train()
    tokens, targets = documents()
    weights, prefix_weight = torch.tensor([1.0, 0.5, 0.2]), torch.tensor(0.25)
    xn = train_gpt.norm(model.trunk(tokens, 2)).view(T, -1)
    without = train_gpt.SoftcappedLoss.apply(xn, model.lm_head.weight, targets, weights, model.logit_cap,
                                             model.logit_offset).sum()
    assert model.prefix_table.eq(-1).all() and "prefix_table" not in model.state_dict()
    assert torch.equal(model(tokens, targets, 2, None, weights, prefix_weight), without)
    torch.manual_seed(3)
    model.prefix_table.copy_(torch.randint(-1, VOCAB, model.prefix_table.shape))
    loss = train_gpt.SoftcappedLoss.apply(xn, model.lm_head.weight, targets, weights, model.logit_cap,
                                          model.logit_offset, None, model.prefix_table[targets], prefix_weight).sum()
    assert torch.equal(model(tokens, targets, 2, None, weights, prefix_weight), loss) and not torch.equal(loss, without)
    assert torch.equal(model(tokens, targets, 2, None, weights), without)
    one = train_gpt.SoftcappedLoss.apply(xn, model.lm_head.weight, targets, torch.ones(1), model.logit_cap,
                                         model.logit_offset).sum()
    assert torch.equal(model(tokens, targets, 2), one) and not torch.equal(one, without)
    logits = torch.nn.functional.linear(xn, model.lm_head.weight)
    plain = torch.nn.functional.cross_entropy(train_gpt.softcap(logits), targets, reduction="sum")
    assert abs(one.item() - plain.item()) <= gamma(T + 60) * plain.item()
