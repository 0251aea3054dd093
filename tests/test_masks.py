"""Document-causal sliding-window attention masks: the dense SDPA masks and FlexAttention's
BlockMasks against a reference written from the rules in DESIGN.md, not from the code."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import flex_attention

import train_gpt

EOT, BLOCK, SCALE = 50256, 128, 0.12
WINDOWS = [1, 2, 3, 5, 8, 100]


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
    elif kind == "at_zero":
        tokens[0] = EOT
        tokens[T // 2 + 7] = EOT
    else:
        assert kind == "none"
    return tokens


TOKEN_KINDS = ["none", "few", "many", "block_edges", "before_edges", "at_zero"]


def document_causal(tokens):
    """(T, T) pairs allowed by causality and document membership alone; doc id = running EOT count."""
    doc = torch.cumsum(tokens == EOT, 0)
    pos = torch.arange(len(tokens))
    return (pos[None, :] <= pos[:, None]) & (doc[None, :] == doc[:, None])


def reference_mask(tokens, window):
    """Brute force from the rules: blocks of 128; a block (i, j) is full when all of its pairs are
    document-causal, partial when some but not all are. Query block i keeps its newest window - 1
    full blocks and its newest max(window - #full, 1) partial blocks; inside kept blocks the
    document-causal rule still decides each pair."""
    T = len(tokens)
    nb = T // BLOCK
    pairs = document_causal(tokens)
    per_block = pairs.view(nb, BLOCK, nb, BLOCK)
    any_pair, all_pairs = per_block.any(3).any(1), per_block.all(3).all(1)
    kept = torch.zeros(nb, nb, dtype=torch.bool)
    for i in range(nb):
        full = [j for j in range(nb) if all_pairs[i, j]]
        partial = [j for j in range(nb) if any_pair[i, j] and not all_pairs[i, j]]
        for j in sorted(full, reverse=True)[:window - 1]:
            kept[i, j] = True
        for j in sorted(partial, reverse=True)[:max(window - len(full), 1)]:
            kept[i, j] = True
    query_block, key_block = torch.arange(T)[:, None] // BLOCK, torch.arange(T)[None, :] // BLOCK
    return kept[query_block, key_block] & pairs


def reference_attention(q, k, v, mask):
    """Softmax over the allowed keys only, with the record's fixed scale, in float64."""
    scores = (q.double() @ k.double().transpose(-1, -2)) * SCALE
    scores = scores.masked_fill(~mask, float("-inf"))
    return (scores.softmax(-1) @ v.double()).float()


@pytest.mark.parametrize("T", [256, 1024])
@pytest.mark.parametrize("kind", TOKEN_KINDS)
def test_sdpa_masks_match_the_rules(T, kind):
    """Long and short (half, at least 1 block) dense masks equal the reference pair for pair."""
    torch.manual_seed(0)
    for seed in range(2):
        tokens = make_tokens(kind, T, seed)
        for window in WINDOWS:
            long, short = train_gpt.attention_masks(tokens, window, "sdpa")
            assert long.dtype == torch.bool and long.shape == (T, T)
            assert torch.equal(long, reference_mask(tokens, window)), (kind, seed, window)
            assert torch.equal(short, reference_mask(tokens, max(window // 2, 1))), (kind, seed, window)


def test_window_tensor_gives_the_same_masks():
    """Training passes the window as an int32 tensor (no recompiles); it must act like the int."""
    tokens = make_tokens("many", 1024, 3)
    for window in [1, 4, 7]:
        as_int = train_gpt.attention_masks(tokens, window, "sdpa")
        as_tensor = train_gpt.attention_masks(tokens, torch.tensor(window, dtype=torch.int32), "sdpa")
        assert all(torch.equal(a, b) for a, b in zip(as_int, as_tensor))


@pytest.mark.parametrize("kind", TOKEN_KINDS)
def test_full_window_is_document_causal(kind):
    """With at least as many window blocks as the sequence has, nothing is windowed away."""
    tokens = make_tokens(kind, 1024, 1)
    for window in [8, 16, 100]:
        long, short = train_gpt.attention_masks(tokens, window, "sdpa")
        assert torch.equal(long, document_causal(tokens))
        if window // 2 >= 8:
            assert torch.equal(short, document_causal(tokens))


def test_window_actually_limits():
    """A single document with window 1 keeps only the diagonal block (no earlier tokens)."""
    tokens = make_tokens("none", 512, 0)
    long, _ = train_gpt.attention_masks(tokens, 1, "sdpa")
    blocks = torch.arange(512) // BLOCK
    assert torch.equal(long, document_causal(tokens) & (blocks[:, None] == blocks[None, :]))


T_FLEX, HEADS, HEAD_DIM = 1024, 2, 16


@pytest.fixture(scope="module")
def compiled_flex():
    """Builds the BlockMasks inside the compiled function: FlexAttention's eager CPU path ignores the
    block counts, and a BlockMask built outside a compiled flex_attention is not supported here."""

    @torch.compile(dynamic=False)
    def attend(q, k, v, tokens, window):
        long, short = train_gpt.attention_masks(tokens, window, "flex")
        return flex_attention(q, k, v, block_mask=long, scale=SCALE), flex_attention(q, k, v, block_mask=short, scale=SCALE)

    return attend


def random_qkv(seed):
    torch.manual_seed(seed)
    return [torch.randn(1, HEADS, T_FLEX, HEAD_DIM) for _ in range(3)]


@pytest.mark.parametrize("kind", ["none", "many", "block_edges", "at_zero"])
def test_flex_sdpa_and_reference_attention_agree(compiled_flex, kind):
    """Compiled FlexAttention, SDPA with the dense masks, and brute-force attention over the
    reference mask give the same outputs (fp32, 1e-5), for several windows."""
    q, k, v = random_qkv(1)
    tokens = make_tokens(kind, T_FLEX, 4)
    for window in [1, 3, 8]:
        flex = compiled_flex(q, k, v, tokens, torch.tensor(window, dtype=torch.int32))
        masks = train_gpt.attention_masks(tokens, window, "sdpa")
        for w, out, mask in zip((window, max(window // 2, 1)), flex, masks):
            sdpa = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=SCALE)
            reference = reference_attention(q, k, v, reference_mask(tokens, w))
            torch.testing.assert_close(out, sdpa, atol=1e-5, rtol=0)
            torch.testing.assert_close(out, reference, atol=1e-5, rtol=0)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_eager_flex_ignores_the_window():
    """Why the tests compile: on CPU, eager flex_attention with the window-1 BlockMask of a single
    document attends to every earlier token, unlike the windowed mask."""
    q, k, v = random_qkv(2)
    tokens = make_tokens("none", T_FLEX, 0)
    long, _ = train_gpt.attention_masks(tokens, 1, "flex")
    eager = flex_attention(q, k, v, block_mask=long, scale=SCALE)
    windowed = reference_attention(q, k, v, reference_mask(tokens, 1))
    unwindowed = reference_attention(q, k, v, document_causal(tokens))
    assert (eager - windowed).abs().max() > 1e-2
    torch.testing.assert_close(eager, unwindowed, atol=1e-5, rtol=0)


@pytest.mark.parametrize("queries", [slice(0, 640), slice(64, 640), slice(639, 640)])
def test_attend_in_query_blocks_matches_the_reference(queries):
    """attend() runs dense-mask SDPA SDPA_QUERY_BLOCK queries at a time against the keys up to each
    block's last query: outputs and gradients equal float64 attention over the reference mask, for all
    640 positions (three blocks, the last part-full), for the last 576 against all keys (as a KV
    cache's new positions: three blocks after 64 cached keys) and for the last one alone."""
    assert train_gpt.SDPA_QUERY_BLOCK == 256
    tokens = make_tokens("many", 640, 5)
    torch.manual_seed(5)
    q = torch.randn(1, 2, 640, 32)[:, :, queries].requires_grad_()
    k, v = (torch.randn(1, 2, 640, 32, requires_grad=True) for _ in range(2))
    probe = torch.randn(1, 2, q.size(2), 32)
    for mask, window in zip(train_gpt.attention_masks(tokens, 3, "sdpa"), (3, 1)):
        mask = mask[queries]  # the selected queries' rows, against every key up to the last of them
        out = train_gpt.attend(q, k, v, mask, SCALE)
        reference = reference_attention(q, k, v, reference_mask(tokens, window)[queries])
        torch.testing.assert_close(out, reference, atol=1e-5, rtol=0)
        grads = torch.autograd.grad((out * probe).sum(), (q, k, v))
        reference_grads = torch.autograd.grad((reference * probe).sum(), (q, k, v))
        for grad, reference_grad in zip(grads, reference_grads):
            torch.testing.assert_close(grad, reference_grad, atol=1e-5, rtol=0)
