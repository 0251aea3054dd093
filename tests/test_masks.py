"""Document-causal sliding-window attention masks, windows in tokens: the dense SDPA masks and
FlexAttention's BlockMasks against a plain per-query loop written from the rule, not from the code:
query q sees key k when k <= q, q - k <= window and both are in one document (each starts at EOT)."""

import functools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import flex_attention

import train_gpt
from conftest import needs_flex_on_cpu
from rounding import assert_within, attention_bounds

pytestmark = pytest.mark.numerics

EOT, BLOCK, SCALE = 50256, 128, 0.12
T = 768  # 6 blocks
# no window, one key back, ends just inside, at and past a block edge, in the middle of a block, three
# blocks exactly, and longer than the sequence
WINDOWS = [0, 1, 127, 128, 129, 300, 384, 1000]


def make_tokens(kind, T, seed):
    """Random tokens with document starts (EOT) placed by kind."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, EOT, (T,), generator=g, dtype=torch.int32)
    if kind == "few":
        tokens[torch.randint(1, T, (3,), generator=g)] = EOT
    elif kind == "many":
        tokens[torch.rand(T, generator=g) < 0.02] = EOT
    elif kind == "block_edges":  # documents start exactly at block starts (and at 0)
        tokens[torch.arange(0, T, BLOCK)[torch.rand(T // BLOCK, generator=g) < 0.6]] = EOT
    elif kind == "before_edges":  # documents start on the last token of blocks
        tokens[torch.arange(BLOCK - 1, T, BLOCK)[torch.rand(T // BLOCK, generator=g) < 0.6]] = EOT
    elif kind == "long_document":  # short documents straddling block edges around one of 4+ blocks (100..649)
        tokens[[0, 40, 100, 650, 700]] = EOT
    else:
        assert kind == "none"
    return tokens


TOKEN_KINDS = ["none", "few", "many", "block_edges", "before_edges", "long_document"]


def per_query_loop(tokens, window, repeats=1):
    """(T, T) booleans from a loop over each query's keys; repeats: each token that many positions in a row (the
    paired-head layers' sequence: 2)."""
    doc, docs = 0, []
    for token in tokens.tolist():
        doc += token == EOT
        docs += [doc] * repeats
    rows = []
    for q in range(len(docs)):
        row = [False] * len(docs)
        for k in range(max(0, q - window), q + 1):
            row[k] = docs[k] == docs[q]
        rows.append(row)
    return torch.tensor(rows)


@functools.cache
def tokens_of(kind):
    return make_tokens(kind, T, seed=0)


@functools.cache
def loop_mask(kind, window, repeats=1):
    return per_query_loop(tokens_of(kind), window, repeats)


def test_the_loop_itself():
    """The reference on a hand-made case: documents at 0 and 3 of 6 tokens, window 1."""
    expected = torch.tensor([[1, 0, 0, 0, 0, 0],
                             [1, 1, 0, 0, 0, 0],
                             [0, 1, 1, 0, 0, 0],
                             [0, 0, 0, 1, 0, 0],
                             [0, 0, 0, 1, 1, 0],
                             [0, 0, 0, 0, 1, 1]], dtype=torch.bool)
    assert torch.equal(per_query_loop(torch.tensor([EOT, 5, 6, EOT, 7, 8]), 1), expected)
    assert torch.equal(loop_mask("long_document", 0), torch.eye(T, dtype=torch.bool))  # window 0: each query alone


@pytest.mark.parametrize("kind", TOKEN_KINDS)
def test_dense_mask_equals_the_loop(kind):
    for window in WINDOWS:
        mask = train_gpt.attention_mask(tokens_of(kind), window, "sdpa")
        assert mask.dtype == torch.bool and mask.shape == (T, T)
        assert torch.equal(mask, loop_mask(kind, window)), (kind, window)


def test_dense_rows_from_first_query_are_the_last_rows():
    """Generation's hook: the rows of the queries from first_query on, against every key."""
    for first_query in (0, 1, 300, T - 1):
        rows = train_gpt.attention_mask(tokens_of("many"), 129, "sdpa", first_query=first_query)
        assert torch.equal(rows, loop_mask("many", 129)[first_query:])


def visited_pairs(block_mask):
    """The (T, T) pairs FlexAttention computes with a BlockMask: every pair of each query block's full
    key blocks, and the pairs of its partial key blocks that the mask_mod allows. Also checks that no
    key block is listed as both, which would count its keys twice."""
    num_blocks = block_mask.kv_num_blocks.size(-1)
    visited = torch.zeros(num_blocks * BLOCK, num_blocks * BLOCK, dtype=torch.bool)
    full_blocks = torch.zeros(num_blocks, num_blocks, dtype=torch.bool)
    for i in range(num_blocks):
        queries = torch.arange(i * BLOCK, (i + 1) * BLOCK)
        partial = block_mask.kv_indices[0, 0, i, :block_mask.kv_num_blocks[0, 0, i]].tolist()
        full = block_mask.full_kv_indices[0, 0, i, :block_mask.full_kv_num_blocks[0, 0, i]].tolist()
        assert not set(partial) & set(full) and len(set(partial)) == len(partial) and len(set(full)) == len(full)
        for j in full:
            visited[i * BLOCK:(i + 1) * BLOCK, j * BLOCK:(j + 1) * BLOCK] = True
            full_blocks[i, j] = True
        for j in partial:
            keys = torch.arange(j * BLOCK, (j + 1) * BLOCK)
            visited[i * BLOCK:(i + 1) * BLOCK, j * BLOCK:(j + 1) * BLOCK] = block_mask.mask_mod(0, 0, queries[:, None], keys[None, :])
    return visited, full_blocks


@pytest.mark.parametrize("kind", TOKEN_KINDS)
def test_block_mask_visits_exactly_the_loops_pairs(kind):
    """And a key block is full exactly when the loop allows every pair in it."""
    for window in WINDOWS:
        visited, full_blocks = visited_pairs(train_gpt.attention_mask(tokens_of(kind), window, "flex"))
        expected = loop_mask(kind, window)
        assert torch.equal(visited, expected), (kind, window)
        all_pairs = expected.view(T // BLOCK, BLOCK, T // BLOCK, BLOCK).all(3).all(1)
        assert torch.equal(full_blocks, all_pairs), (kind, window)


@pytest.mark.parametrize("kind", ["many", "block_edges", "long_document"])
def test_paired_masks_equal_the_loop_over_each_token_twice(kind):
    """The paired-head layers' masks: over 2T positions, each token's two in a row in its document, the window in
    positions (the record's FA3 call on doubled cu_seqlens): dense, block mask, and generation's rows."""
    for window in WINDOWS:
        expected = loop_mask(kind, window, 2)
        dense = train_gpt.attention_mask(tokens_of(kind), window, "sdpa", paired=True)
        assert dense.shape == (2 * T, 2 * T) and torch.equal(dense, expected), (kind, window)
        assert torch.equal(visited_pairs(train_gpt.attention_mask(tokens_of(kind), window, "flex", paired=True))[0],
                           expected), (kind, window)
    rows = train_gpt.attention_mask(tokens_of(kind), 129, "sdpa", first_query=300, paired=True)
    assert torch.equal(rows, loop_mask(kind, 129, 2)[600:])


def test_long_and_short_masks():
    """attention_masks(): the long window is window_blocks blocks of tokens, the short one half as many
    blocks rounded down; 0 blocks leave each query its own key alone; the paired-head layers' kinds when asked."""
    tokens = tokens_of("long_document")
    for window_blocks, short_tokens in [(1, 0), (3, 128), (7, 384)]:
        for backend in ("sdpa", "flex"):
            masks = train_gpt.attention_masks(tokens, window_blocks, backend, paired=True)
            if backend == "flex":
                masks = {kind: visited_pairs(mask)[0] for kind, mask in masks.items()}
            for paired in (False, True):
                repeats = 2 if paired else 1
                assert torch.equal(masks[paired, True], loop_mask("long_document", window_blocks * BLOCK, repeats))
                assert torch.equal(masks[paired, False], loop_mask("long_document", short_tokens, repeats))
    assert set(train_gpt.attention_masks(tokens, 3, "sdpa")) == {(False, True), (False, False)}
    # in units of another size (window_unit): 5 units of 24 tokens, the short window 2 of them
    masks = train_gpt.attention_masks(tokens, 5, "sdpa", unit=24)
    assert torch.equal(masks[False, True], loop_mask("long_document", 120))
    assert torch.equal(masks[False, False], loop_mask("long_document", 48))


HEADS, HEAD_DIM = 2, 16


def random_qkv(seed, T=T):
    torch.manual_seed(seed)
    return [torch.randn(1, HEADS, T, HEAD_DIM) for _ in range(3)]


@pytest.fixture(scope="module")
def compiled_flex():
    """Builds the BlockMask inside the compiled function, as training does (FlexAttention's eager CPU
    path applies the mask_mod to every pair and ignores the block lists). The window is a tensor, so
    that one graph serves every window; an int, as in training, compiles one per window."""

    @torch.compile(dynamic=False)
    def attend(q, k, v, tokens, window):
        return flex_attention(q, k, v, block_mask=train_gpt.attention_mask(tokens, window, "flex"), scale=SCALE)

    return attend


@needs_flex_on_cpu
@pytest.mark.parametrize("kind", ["many", "long_document"])
def test_compiled_flex_sdpa_and_reference_attention_agree(compiled_flex, kind):
    """Compiled FlexAttention and SDPA with the dense mask both give float64 attention over the loop's
    mask, within the float32 rounding bound derived in tests/rounding.py, for windows that are and are
    not whole blocks; attention without each query's oldest key is outside that bound."""
    q, k, v = random_qkv(1)
    tokens = tokens_of(kind)
    for window in [129, 300, 384]:
        flex = compiled_flex(q, k, v, tokens, torch.tensor(window))
        sdpa = F.scaled_dot_product_attention(q, k, v, attn_mask=train_gpt.attention_mask(tokens, window, "sdpa"),
                                              scale=SCALE)
        exact = attention_bounds(q, k, v, loop_mask(kind, window), SCALE)
        for name, out in (("flex", flex), ("sdpa", sdpa)):
            assert_within(out, exact["out"], exact["out_bound"], f"{name}, window {window}", exact["relative"])
        narrower = attention_bounds(q, k, v, without_oldest_key(loop_mask(kind, window)), SCALE)
        with pytest.raises(AssertionError, match="times the derived bound"):
            assert_within(flex, narrower["out"], narrower["out_bound"], "", narrower["relative"])


def without_oldest_key(allowed):
    """The mask with each query's first allowed key taken away, where it has another."""
    oldest = allowed.int().argmax(-1)
    rows = torch.arange(allowed.size(0))[allowed.sum(-1) > 1]
    narrower = allowed.clone()
    narrower[rows, oldest[rows]] = False
    return narrower


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_eager_flex_applies_the_whole_rule():
    """The mask_mod holds the whole rule (the block lists only skip work): eager flex_attention, which
    on CPU applies it to every pair, gives the windowed attention too, for a window inside a block."""
    q, k, v = random_qkv(2)
    eager = flex_attention(q, k, v, block_mask=train_gpt.attention_mask(tokens_of("none"), 300, "flex"), scale=SCALE)
    windowed = attention_bounds(q, k, v, loop_mask("none", 300), SCALE)
    unwindowed = attention_bounds(q, k, v, loop_mask("none", T), SCALE)
    assert_within(eager, windowed["out"], windowed["out_bound"], "eager flex", windowed["relative"])
    with pytest.raises(AssertionError, match="times the derived bound"):
        assert_within(eager, unwindowed["out"], unwindowed["out_bound"], "", unwindowed["relative"])


@pytest.mark.parametrize("queries", [slice(0, 640), slice(64, 640), slice(639, 640)])
def test_attend_in_query_blocks_matches_the_reference(queries):
    """attend() runs dense-mask SDPA SDPA_QUERY_BLOCK queries at a time against the keys up to each
    block's last query: outputs and gradients equal float64 attention over the loop's mask within the
    derived float32 bound, for all 640 positions (three blocks, the last part-full), for the last 576
    against all keys (as a KV cache's new positions: three blocks after 64 cached keys) and for the
    last one alone."""
    assert train_gpt.SDPA_QUERY_BLOCK == 256
    torch.manual_seed(5)
    q = torch.randn(1, 2, 640, 32)[:, :, queries].requires_grad_()
    k, v = (torch.randn(1, 2, 640, 32, requires_grad=True) for _ in range(2))
    probe = torch.randn(1, 2, q.size(2), 32)
    for window in (300, 128):
        mask = train_gpt.attention_mask(tokens_of("many")[:640], window, "sdpa")[queries]
        out = train_gpt.attend(q, k, v, mask, SCALE)
        exact = attention_bounds(q.detach(), k.detach(), v.detach(), loop_mask("many", window)[:640, :640][queries],
                                 SCALE, grad_out=probe)
        assert_within(out, exact["out"], exact["out_bound"], f"output, window {window}", exact["relative"])
        grads = torch.autograd.grad((out * probe).sum(), (q, k, v))
        for name, grad in zip(("dq", "dk", "dv"), grads):
            assert_within(grad, exact[name], exact[f"{name}_bound"], f"{name}, window {window}", exact["relative"])
