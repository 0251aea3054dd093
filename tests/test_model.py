"""The GPT: layer layout rules, U-net wiring, initialization, rotary and its YaRN rescale, gradients,
backends, and the gradient-ready order that GradientBuckets relies on."""

import copy
import dataclasses
import math
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pytest
import torch

import train_gpt

EOT = 50256
VOCAB = 50257  # the real vocabulary, so EOT (50256) can start documents
T = 512  # 4 blocks of 128
WINDOWS = (1, 2, 4)  # the long windows (in blocks) the tests' models know: each has its softmax scale


def tiny_gpt(num_layers=4, backend="sdpa", vocab=VOCAB, seed=0, loss_chunk=0, first_layer_mlp=False):
    """Width 32, 2 heads of 16 (a multiple of 4, as rotary needs)."""
    torch.manual_seed(seed)
    return train_gpt.GPT(vocab, num_layers, num_heads=2, head_dim=16, model_dim=32, max_seq_len=T,
                         attention_backend=backend, loss_chunk=loss_chunk, first_layer_mlp=first_layer_mlp,
                         windows=WINDOWS)


def randomize_(model, seed=1):
    """Replace the zero-initialized weights (output projections, gates, lm_head) and the scalars'
    initial values with random ones, so that every layer and every path changes the output; the
    lm_head spans the record's FP8 range (|w| <= 448 * 2^-9) so the softcapped logits, and the loss,
    depend clearly on the hidden state."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.c_proj") or name.endswith("gate.weight"):
                p.uniform_(-0.2, 0.2)
            elif name.endswith("qkvo_w"):
                p[3].uniform_(-0.2, 0.2)
        model.lm_head.weight.uniform_(-0.875, 0.875)
        model.scalars.add_(0.3 * torch.randn_like(model.scalars))
    return model


def documents(seed=0, n=T):
    """Random tokens with a few EOTs: several documents, one starting mid-block."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, EOT, (n + 1,), generator=g)
    tokens[[0, 100, 230, 300]] = EOT
    return tokens[:-1].int(), tokens[1:]


# Layouts from the docstrings' rules: value-embedding tables 0, 1, 2 on the first and last three layers
# (fewer when shallow, keeping two middle layers free); the attention-free layer is the second decoder
# layer, moved earlier when that layer has a value embedding; long windows on every fourth encoder
# layer from the first, mirrored in the decoder.
LAYOUTS = {
    12: dict(ve=[0, 1, 2, None, None, None, None, None, None, 0, 1, 2], attention_free=7, long=[0, 4, 7, 11]),
    8: dict(ve=[0, 1, 2, None, None, 0, 1, 2], attention_free=4, long=[0, 7]),
    4: dict(ve=[0, None, None, 0], attention_free=2, long=[0, 3]),
}


@pytest.mark.parametrize("depth", sorted(LAYOUTS))
def test_layer_layout(depth):
    """Value-embedding tables, attention-free layer and long-window layers per depth (12: the record)."""
    expected = LAYOUTS[depth]
    assert train_gpt.value_embedding_layout(depth) == expected["ve"]
    assert train_gpt.attention_free_layer(depth) == expected["attention_free"]
    long = train_gpt.long_window_layers(depth)
    assert [i for i, is_long in enumerate(long) if is_long] == expected["long"]
    # the attention-free layer must not have a value embedding: it would be unused
    assert expected["ve"][expected["attention_free"]] is None


@pytest.mark.parametrize("depth", sorted(LAYOUTS))
def test_gpt_structure(depth):
    """Skip weights (first depth//2 scalars, init 1), value-embedding tables, the attention-free block."""
    expected = LAYOUTS[depth]
    model = tiny_gpt(depth, vocab=256)
    L = depth
    assert model.scalars.numel() == L // 2 + 4 * L
    assert torch.equal(model.scalars[:L // 2], torch.ones(L // 2))
    assert torch.equal(model.scalars[L // 2:L // 2 + 2 * L], torch.tensor([1.0, 0.0]).repeat(L))
    assert torch.equal(model.scalars[L // 2 + 2 * L:], torch.tensor([0.5, 0.5]).repeat(L))
    assert len(model.value_embeds) == max(t for t in expected["ve"] if t is not None) + 1
    for i, block in enumerate(model.blocks):
        assert (block.attn is None) == (i == expected["attention_free"])


@pytest.mark.parametrize("depth", [4, 12])
def test_unet_wiring(depth):
    """Observed with hooks on every block: encoder layers chain; decoder layer i's input is layer i-1's
    output plus skip_weights[i - depth//2] times encoder layer (depth-1-i)'s output and no other; each
    layer gets its value-embedding table (or none), its long or short mask, the one rotary and the
    window's softmax scale."""
    model = randomize_(tiny_gpt(depth))
    L = depth
    inputs, outputs = {}, {}
    for i, block in enumerate(model.blocks):
        block.register_forward_pre_hook(lambda m, args, i=i: inputs.__setitem__(i, args))
        block.register_forward_hook(lambda m, args, out, i=i: outputs.__setitem__(i, out.detach()))
    tokens, targets = documents()
    window = 4
    with torch.no_grad():
        model(tokens, targets, window)
        x0 = train_gpt.norm(model.embed(tokens)[None])
        long, short = train_gpt.attention_masks(tokens, window, "sdpa")
        skip = model.scalars[:L // 2]
        for i in range(L):
            x, block_x0, ve, _, _, mask, rotary, scale = inputs[i][:8]
            assert rotary is model.rotary and scale == model.attention_scales[window]
            torch.testing.assert_close(block_x0, x0, atol=0, rtol=0)
            table = LAYOUTS[L]["ve"][i]
            if table is None:
                assert ve is None
            else:
                torch.testing.assert_close(ve, model.value_embeds[table](tokens)[None], atol=0, rtol=0)
            assert torch.equal(mask, long if i in LAYOUTS[L]["long"] else short)
            if i == 0:
                torch.testing.assert_close(x, x0, atol=0, rtol=0)
            elif i < L // 2:
                torch.testing.assert_close(x, outputs[i - 1], atol=0, rtol=0)
            else:
                matches = [j for j in range(L // 2)
                           if torch.allclose(x, outputs[i - 1] + skip[i - L // 2] * outputs[j], atol=1e-6, rtol=0)]
                assert matches == [L - 1 - i], (i, matches)


def test_zero_init_gives_uniform_logits():
    """Attention and MLP output projections and the lm_head start at zero, so every logit is
    30 * sigmoid(0) = 15 and the loss is exactly ln(50304) (fp32), in both train (sum) and eval (mean)."""
    model = tiny_gpt()
    assert model.blocks[0].mlp is None  # the record's layer 0 has none
    for block in model.blocks[1:]:
        assert block.mlp.c_proj.abs().max() == 0
        if block.attn is not None:
            assert block.attn.qkvo_w[3].abs().max() == 0
            assert block.attn.qkvo_w[:3].abs().min(dim=-1).values.max() > 0  # q, k, v are not zero
    assert model.lm_head.weight.abs().max() == 0
    assert model.blocks[1].mlp.c_fc.abs().max() > 0
    tokens, targets = documents()
    with torch.no_grad():
        train_loss = model(tokens, targets, 4)
        model.eval()
        eval_loss = model(tokens, targets, 4)
    assert eval_loss.item() == pytest.approx(math.log(50304), abs=1e-4)
    assert (train_loss / T).item() == pytest.approx(math.log(50304), abs=1e-4)


@pytest.mark.parametrize("vocab, padded", [(50257, 50304), (1000, 1024), (1024, 1024), (1025, 1152)])
def test_vocab_padded_to_multiple_of_128(vocab, padded):
    assert train_gpt.next_multiple(vocab, 128) == padded
    if vocab == 50257:
        model = tiny_gpt(vocab=vocab)
        assert model.lm_head.weight.shape == (padded, 32)
        assert model.embed.weight.shape == model.value_embeds[0].weight.shape == (padded, 32)


HEAD_DIM = 16


def rotate(x, positions):
    """Rotary applied to the vector x (H, D) placed at the given positions of a sequence."""
    rotary = train_gpt.Rotary(HEAD_DIM, max_seq_len=64)
    seq = x[None, None].expand(1, 64, *x.shape).clone()
    return rotary(seq)[0, positions]


def test_rotary_rotates_a_quarter_of_the_pairs_by_the_documented_frequencies():
    """Pair k = (dim k, dim k + D/2) turns by position * (1/1024)^(k / (D/4 - 1)) for k < D/4; the
    pairs k >= D/4 (dims D/4..D/2 and 3D/4..D) have frequency zero and never change."""
    torch.manual_seed(0)
    x = torch.randn(2, HEAD_DIM)
    positions = torch.arange(64)
    out = rotate(x, positions)
    quarter, half = HEAD_DIM // 4, HEAD_DIM // 2
    freqs = torch.cat([(1 / 1024) ** (torch.arange(quarter) / (quarter - 1)), torch.zeros(quarter)])
    angle = positions[:, None, None] * freqs  # (T, 1, D/2)
    x1, x2 = x[:, :half], x[:, half:]
    expected = torch.cat([x1 * angle.cos() + x2 * angle.sin(), x2 * angle.cos() - x1 * angle.sin()], -1)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=0)
    still = torch.cat([torch.arange(quarter, half), torch.arange(half + quarter, HEAD_DIM)])
    assert torch.equal(out[:, :, still], x[:, still].expand(64, -1, -1))
    moving = torch.cat([torch.arange(quarter), torch.arange(half, half + quarter)])
    assert ((out[1:, :, moving] - x[:, moving]).abs() > 1e-6).float().mean() > 0.9


def test_rotary_dot_product_depends_only_on_offset():
    """<R_m q, R_n k> is a function of m - n: shifting both positions leaves it unchanged."""
    torch.manual_seed(1)
    q, k = torch.randn(1, HEAD_DIM), torch.randn(1, HEAD_DIM)
    dot = lambda m, n: (rotate(q, [m]) * rotate(k, [n])).sum().item()
    for m, n in [(5, 2), (10, 10), (3, 40)]:
        for shift in [1, 7, 20]:
            assert dot(m + shift, n + shift) == pytest.approx(dot(m, n), abs=1e-4)
    assert abs(dot(5, 2) - dot(9, 2)) > 1e-3  # but it does depend on the offset


def yarn_by_hand(head_dim, changes, unit=128):
    """The rotary frequencies in float64 from the formulas: (1/1024)^(k / (D/4 - 1)) for k < D/4, then D/4
    zeros; at each window change old -> new (in units of unit tokens), f turns unit old f / (2 pi) times
    over the old window, w = clamp((turns - 1) / 31, 0, 1), and f becomes f (s + w (1 - s)) with s = old / new."""
    quarter = head_dim // 4
    freqs = [(1 / 1024) ** (k / (quarter - 1)) for k in range(quarter)] + [0.0] * quarter
    for old, new in changes:
        s = old / new
        for i, f in enumerate(freqs):
            w = min(max((unit * old * f / (2 * math.pi) - 1) / 31, 0.0), 1.0)
            freqs[i] = f * (s + w * (1 - s))
    return torch.tensor(freqs, dtype=torch.float64)


RECORD_CHANGES = [(3, 7), (7, 11), (11, 13)]


def test_yarn_rescale_follows_the_formula_and_rebuilds_the_tables():
    """After the record's three window changes: the frequencies equal the float64 formula to float32
    rounding (some slowed by 3/13 in all, the fastest unchanged, the rest between); cos and sin equal
    those of position x frequency (the angle's float32 rounding, up to 1024 x 2^-24 rad, allowed); the
    frequency-zero half stays zero, its cos 1 and its sin 0."""
    rotary = train_gpt.Rotary(128, max_seq_len=1024)
    base = rotary.freqs.clone()
    torch.testing.assert_close(base.double(), yarn_by_hand(128, []), rtol=1e-6, atol=0)
    for old, new in RECORD_CHANGES:
        rotary.rescale(old, new)
    expected = yarn_by_hand(128, RECORD_CHANGES)
    assert rotary.freqs.dtype == torch.float32 and rotary.freqs.device.type == "cpu"
    torch.testing.assert_close(rotary.freqs.double(), expected, rtol=2e-6, atol=0)
    ratio = (rotary.freqs / base)[:32]
    assert ratio[0] == 1 and ratio[-1] == pytest.approx(3 / 13, rel=1e-6) and ((ratio > 3 / 13) & (ratio < 1)).any()
    assert not rotary.freqs[32:].any()
    angles = torch.outer(torch.arange(1024, dtype=torch.float64), rotary.freqs.double())
    torch.testing.assert_close(rotary.cos.double(), angles.cos(), rtol=0, atol=1e-4)
    torch.testing.assert_close(rotary.sin.double(), angles.sin(), rtol=0, atol=1e-4)
    assert (rotary.cos[:, 32:] == 1).all() and (rotary.sin[:, 32:] == 0).all()
    # windows in units of 32 tokens turn each frequency a quarter as often over the old window
    small = train_gpt.Rotary(128, max_seq_len=16, window_unit=32)
    for old, new in RECORD_CHANGES:
        small.rescale(old, new)
    torch.testing.assert_close(small.freqs.double(), yarn_by_hand(128, RECORD_CHANGES, unit=32), rtol=2e-6, atol=0)
    assert not torch.equal(small.freqs, rotary.freqs)
    # the tables moved: the unscaled ones are far from these
    assert (train_gpt.Rotary(128, max_seq_len=1024).cos - rotary.cos).abs().max() > 0.5


def test_rotary_without_rescale_keeps_the_base_frequencies():
    """A model's rotary starts at the base frequencies, and a window that does not change leaves them
    (and the tables) as they were, bit for bit."""
    args = train_gpt.Hyperparameters(num_layers=2, model_dim=32, num_heads=2, head_dim=16, window_stages=(2, 2, 4),
                                     final_window=4, num_iterations=8)
    model = train_gpt.build_model(args, T)
    torch.testing.assert_close(model.rotary.freqs.double(), yarn_by_hand(16, []), rtol=1e-6, atol=0)
    freqs, cos = model.rotary.freqs.clone(), model.rotary.cos.clone()
    window = train_gpt.window_at(0, args)
    for step in range(6):  # the first two stages, both of window 2
        window = train_gpt.move_window(model, window, step, args)
        assert window == 2
    assert torch.equal(model.rotary.freqs, freqs) and torch.equal(model.rotary.cos, cos)
    assert train_gpt.move_window(model, window, 6, args) == 4
    torch.testing.assert_close(model.rotary.freqs.double(), yarn_by_hand(16, [(2, 4)]), rtol=2e-6, atol=0)


def expected_nonzero_scalar_grads(L):
    """Skip weights and block lambdas always matter; attention lambda 0 (v) only with attention,
    lambda 1 (value embedding) only with attention and a value embedding."""
    layout, free = train_gpt.value_embedding_layout(L), train_gpt.attention_free_layer(L)
    attn = [[i != free, i != free and layout[i] is not None] for i in range(L)]
    return torch.tensor([True] * (L // 2 + 2 * L) + [b for pair in attn for b in pair])


def test_forward_backward_fp32_reaches_every_parameter():
    """fp32, SDPA backend, several documents: every parameter gets a finite gradient, nonzero
    wherever it is used (per scalar entry: exactly the entries the forward uses)."""
    model = randomize_(tiny_gpt())
    tokens, targets = documents()
    model(tokens, targets, 2).backward()
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        assert torch.isfinite(p.grad).all(), name
        assert p.grad.abs().max() > 0, name
    assert torch.equal(model.scalars.grad != 0, expected_nonzero_scalar_grads(4))


def test_bf16_embeddings_path():
    """Embeddings stored in bf16 (as training does) make the whole forward bf16; it runs forward and
    backward and its loss is within bf16 precision of the fp32 loss (measured 0.01% apart)."""
    model = randomize_(tiny_gpt())
    tokens, targets = documents()
    with torch.no_grad():
        fp32_loss = model(tokens, targets, 2).item()
    for table in [model.embed, *model.value_embeds]:
        table.to(torch.bfloat16)
    loss = model(tokens, targets, 2)
    loss.backward()
    assert loss.item() == pytest.approx(fp32_loss, rel=5e-3)
    assert model.embed.weight.grad.dtype == torch.bfloat16
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


def long_document():
    """documents(3) with two of its document starts removed: documents at 0..99 and 100..511."""
    tokens, targets = documents(3)
    tokens = tokens.clone()
    tokens[[230, 300]] = 1
    return tokens, targets


def test_compiled_flex_model_matches_sdpa():
    """The flex backend under torch.compile (BlockMasks built inside the graph, the window an int as in
    training) gives the SDPA backend's training loss for the same weights (fp32), on a document longer
    than both windows: a window of 2 blocks cuts the long layers' keys (256) and the short ones' (128)."""
    sdpa = randomize_(tiny_gpt(backend="sdpa"))
    flex = tiny_gpt(backend="flex")
    flex.load_state_dict(sdpa.state_dict())
    compiled = torch.compile(flex, dynamic=False)
    tokens, targets = long_document()
    with torch.no_grad():
        loss = (sdpa(tokens, targets, 2) / T).item()
        assert (compiled(tokens, targets, 2) / T).item() == pytest.approx(loss, abs=1e-4)
        # the same scale without the window's cut, five times the tolerance away: a wrong window would show
        logits = sdpa.softcapped_logits(sdpa.trunk(tokens, 2, train_gpt.attention_masks(tokens, 4, "sdpa")))
        assert abs(torch.nn.functional.cross_entropy(logits[0], targets).item() - loss) > 5e-4


def test_uncompiled_flex_model_compiles_the_attention_kernel_alone(monkeypatch):
    """With compile=false the flex backend still attends through FlexAttention's compiled kernel (eager
    flex_attention would materialize every score, and warns that it does): the same loss as SDPA with
    the dense masks, for a window that cuts both masks, and no such warning."""
    import torch.nn.attention.flex_attention as flex_module
    monkeypatch.setattr(flex_module, "_WARNINGS_SHOWN", set())  # it warns once per process
    sdpa = randomize_(tiny_gpt(backend="sdpa"))
    flex = tiny_gpt(backend="flex")
    flex.load_state_dict(sdpa.state_dict())
    tokens, targets = long_document()
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert (flex(tokens, targets, 2) / T).item() == pytest.approx((sdpa(tokens, targets, 2) / T).item(), abs=1e-4)
    assert not [w for w in caught if "without torch.compile" in str(w.message)]


def test_gradients_become_ready_in_reversed_parameter_order():
    """GradientBuckets packs parameters in reversed(model.parameters()) order, assuming that is the
    order in which backward finishes them. Recorded with post-accumulate-grad hooks: lm_head first,
    then the blocks from last to first (each block's parameters before any of an earlier block's),
    then scalars and embeddings, which are used throughout."""
    model = randomize_(tiny_gpt(8))
    L = 8
    order = []
    for name, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(lambda p, name=name: order.append(name))

    def stage(name):  # 0: lm_head, 1..L: blocks L-1..0, L+1: used by every layer
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
    bucket_order = [stage(name) for name, _ in reversed(list(model.named_parameters()))]
    assert bucket_order == sorted(bucket_order)


def whole_logits_loss_and_grads(model, x, targets, dtype):
    """The unchunked loss in dtype and its gradients for x and the lm_head, times 2.5 (an incoming gradient)."""
    model = copy.deepcopy(model).to(dtype)
    x = x.detach().to(dtype).requires_grad_()
    logits = model.softcapped_logits(x)
    loss = torch.nn.functional.cross_entropy(logits.view(-1, logits.size(-1)), targets, reduction="sum")
    return loss, torch.autograd.grad(2.5 * loss, [x, model.lm_head.weight])


@pytest.mark.parametrize("chunk, compiled", [(7, False), (100, False), (512, False), (4096, False), (100, True)])
def test_chunked_loss_equals_the_whole_logits_loss(chunk, compiled):
    """ChunkedSoftcapLoss against softcapped_logits + F.cross_entropy on the whole sequence, for chunks
    that divide T, that do not (7, 100), and that exceed it, eager and compiled (inductor fuses the
    pass over the logits and writes the target entries apart): the same loss, and gradients for x and
    the lm_head within float32 rounding of the float64 truth, as the unchunked float32 ones are: a
    gradient sums 50304 vocabulary terms that nearly cancel, and a BLAS kernel for few rows (chunk 7)
    sums them less carefully, ~2e-5 of the gradient's scale (1e-6 for the whole matmul)."""
    model = randomize_(tiny_gpt())
    torch.manual_seed(2)
    x = torch.randn(1, T, 32, requires_grad=True)
    _, targets = documents(seed=3)
    reference, ref_grads = whole_logits_loss_and_grads(model, x, targets, torch.float32)
    truth, true_grads = whole_logits_loss_and_grads(model, x, targets, torch.float64)
    chunked_loss = train_gpt.ChunkedSoftcapLoss.apply
    if compiled:
        chunked_loss = torch.compile(chunked_loss, fullgraph=True)
    loss = chunked_loss(train_gpt.norm(x[0]), model.lm_head.weight, targets, chunk)
    grads = torch.autograd.grad(2.5 * loss, [x, model.lm_head.weight])
    torch.testing.assert_close(loss, reference, rtol=1e-6, atol=0)
    for got, want, true in zip(grads, ref_grads, true_grads):
        scale = true.abs().max().item()
        chunked_error, whole_error = ((g.double() - true).abs().max().item() / scale for g in (got, want))
        assert whole_error < 4e-5 and chunked_error < 4e-5, (chunked_error, whole_error)


def test_model_with_chunked_loss_trains_the_same():
    """GPT.forward in training with loss_chunk set: the same loss and parameter gradients as without."""
    inputs, targets = documents()
    results = []
    for loss_chunk in (0, 96):
        model = randomize_(tiny_gpt(loss_chunk=loss_chunk)).train()
        loss = model(inputs, targets, 4)
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (loss0, grads0), (loss1, grads1) = results
    torch.testing.assert_close(loss1, loss0, rtol=1e-6, atol=0)
    assert grads0.keys() == grads1.keys()
    for name in grads0:
        torch.testing.assert_close(grads1[name], grads0[name], rtol=1e-4, atol=1e-5 * grads0[name].abs().max().item(),
                                   msg=lambda m: f"{name}: {m}")


def test_chunked_loss_without_grad_is_the_loss_alone():
    model = randomize_(tiny_gpt())
    x = torch.randn(T, 32)
    _, targets = documents(seed=4)
    with torch.no_grad():
        loss = train_gpt.ChunkedSoftcapLoss.apply(train_gpt.norm(x), model.lm_head.weight, targets, 128)
        logits = model.softcapped_logits(x)
        reference = torch.nn.functional.cross_entropy(logits, targets, reduction="sum")
    torch.testing.assert_close(loss, reference, rtol=1e-6, atol=0)


# The alternate layout: every other layer from the first, half as many tables (rounded up), used in turn.
ALTERNATE = {
    12: dict(ve=[0, None, 1, None, 2, None, 0, None, 1, None, 2, None], attention_free=7),
    8: dict(ve=[0, None, 1, None, 0, None, 1, None], attention_free=5),
    4: dict(ve=[0, None, 0, None], attention_free=3),
    6: dict(ve=[0, None, 1, None, 0, None], attention_free=3),
}


@pytest.mark.parametrize("depth", sorted(ALTERNATE))
def test_alternate_value_embedding_layout(depth):
    expected = ALTERNATE[depth]
    assert train_gpt.value_embedding_layout(depth, "alternate") == expected["ve"]
    assert train_gpt.attention_free_layer(depth, "alternate") == expected["attention_free"]
    torch.manual_seed(0)
    model = train_gpt.GPT(256, depth, 2, 16, 32, T, value_embed_layout="alternate")
    assert len(model.value_embeds) == max(t for t in expected["ve"] if t is not None) + 1
    assert [block.attn is None for block in model.blocks] == [i == expected["attention_free"] for i in range(depth)]


def gated_and_plain_attention(width: int, heads: int, gate: str):
    """Two attention layers with the same random weights (output projection included), one with the
    named zero-initialized gate; and the rest of their arguments: a value embedding, lambdas, a mask
    over documents, a rotary and a scale. Called with inputs x."""
    torch.manual_seed(0)
    gated = train_gpt.CausalSelfAttention(width, heads, width // heads, **{gate: True})
    plain = train_gpt.CausalSelfAttention(width, heads, width // heads)
    plain.load_state_dict({k: v for k, v in gated.state_dict().items() if not k.startswith(gate)})
    with torch.no_grad():
        gated.qkvo_w[3].uniform_(-0.2, 0.2)
        plain.qkvo_w[3].copy_(gated.qkvo_w[3])
    x, ve = torch.randn(1, T, width), torch.randn(1, T, width)
    mask = train_gpt.attention_mask(documents()[0], 300, "sdpa")
    rest = (torch.tensor([0.7, 0.4]), mask, train_gpt.Rotary(width // heads, T), 0.12)
    return gated, plain, x, ve, rest


def test_value_embedding_gate_scales_each_head_by_2_sigmoid():
    """A gated attention layer equals an ungated one (same weights) whose value embedding was multiplied,
    per position and head, by 2 sigmoid(w . x[:12]) computed here; at the zero init the gate is 1."""
    gated, plain, x, ve, rest = gated_and_plain_attention(32, 2, "ve_gate")
    with torch.no_grad():
        torch.testing.assert_close(gated(x, ve, *rest), plain(x, ve, *rest), atol=0, rtol=0)
        gated.ve_gate.weight.normal_()
        w = gated.ve_gate.weight  # (heads, 12)
        gate = 2 / (1 + torch.exp(-(x[0, :, :12] @ w.T)))  # (T, heads)
        expected = plain(x, (ve.view(1, T, 2, 16) * gate[None, :, :, None]).view(1, T, 32), *rest)
        torch.testing.assert_close(gated(x, ve, *rest), expected, atol=1e-5, rtol=1e-5)


def test_attention_gate_scales_each_heads_output_by_sigmoid_before_the_projection():
    """Width 128, 2 heads: the gate reads x[:12] (12 at any width from the 2025-09-10 record on). A gated
    layer equals the ungated one (same weights) whose per-head attention output, read through an
    identity output projection, is multiplied by sigmoid(w . x[:12]) computed here, then projected; at
    the zero init every gate is exactly 1/2."""
    gated, plain, x, ve, rest = gated_and_plain_attention(128, 2, "attn_gate")
    assert gated.attn_gate.weight.shape == (2, 12) and not gated.attn_gate.weight.any()
    with torch.no_grad():
        torch.testing.assert_close(gated(x, ve, *rest), 0.5 * plain(x, ve, *rest), atol=0, rtol=0)
        gated.attn_gate.weight.normal_()
        w_o = plain.qkvo_w[3].clone()
        plain.qkvo_w[3].copy_(torch.eye(128))
        heads = plain(x, ve, *rest).view(1, T, 2, 64)  # the attention output per head, unprojected
        gate = 1 / (1 + torch.exp(-(x[0, :, :12] @ gated.attn_gate.weight.T)))  # (T, heads)
        expected = (heads * gate[None, :, :, None]).view(1, T, 128) @ w_o.T
        torch.testing.assert_close(gated(x, ve, *rest), expected, atol=1e-5, rtol=1e-5)


def test_attention_gates_train_with_muon_and_draw_before_being_zeroed():
    """The record's gates are Muon matrices (6 x 12 at width 768, 2 x 12 here); each is drawn (then
    zeroed), so the model with gates draws its later weights from a later point of the random stream."""
    args = train_gpt.Hyperparameters(num_layers=4, model_dim=128, num_heads=2, head_dim=64)
    assert args.attn_gates  # the record's default
    torch.manual_seed(0)
    model = train_gpt.build_model(args, T)
    adam, muon = train_gpt.build_optimizers(model, args)
    gates = [block.attn.attn_gate.weight for block in model.blocks if block.attn is not None]
    assert len(gates) == 3 and all(g.shape == (2, 12) and not g.any() for g in gates)
    assert {id(g) for g in gates} <= {id(p) for group in muon.param_groups for p in group["params"]}
    torch.manual_seed(0)
    ungated = train_gpt.build_model(dataclasses.replace(args, attn_gates=False), T)
    assert torch.equal(model.blocks[0].attn.qkvo_w, ungated.blocks[0].attn.qkvo_w)  # drawn before the gate
    assert not torch.equal(model.blocks[1].attn.qkvo_w, ungated.blocks[1].attn.qkvo_w)  # drawn after it


def test_gates_sit_on_value_embedding_layers_and_train_with_the_scalars():
    args = train_gpt.Hyperparameters(num_layers=4, model_dim=32, num_heads=2, head_dim=16, value_embed_gates=True)
    model = train_gpt.build_model(args, T)
    gated = [i for i, block in enumerate(model.blocks) if block.attn is not None and block.attn.ve_gate is not None]
    assert gated == [i for i, t in enumerate(model.ve_layout) if t is not None] == [0, 3]
    adam, muon = train_gpt.build_optimizers(model, args)
    gates = {id(model.blocks[i].attn.ve_gate.weight) for i in gated}
    scalar_group = next(g for g in adam.param_groups if g["lr"] == args.scalar_lr)
    assert {id(p) for p in scalar_group["params"]} == gates | {id(model.scalars)}
    assert not gates & {id(p) for g in muon.param_groups for p in g["params"]}


def test_layer_0_has_an_mlp_only_when_asked_and_the_draws_follow_the_layers():
    """The record's layer 0 has no MLP (first_layer_mlp adds it). Both models equal a replay of the draws
    in the documented order from the same seed: token and value embeddings, then per layer the attention
    (q, k, v; the gates) and the MLP's up-projection where there is one; so without layer 0's MLP,
    layer 0's attention is the same and every later draw comes earlier in the stream."""
    models = {}
    for flag in (False, True):
        torch.manual_seed(0)
        models[flag] = train_gpt.GPT(VOCAB, 4, 2, 16, 32, T, attn_gates=True, first_layer_mlp=flag, windows=WINDOWS)
    assert models[False].blocks[0].mlp is None and models[True].blocks[0].mlp is not None
    assert all(block.mlp is not None for model in models.values() for block in model.blocks[1:])
    free = train_gpt.attention_free_layer(4)
    for flag, model in models.items():
        torch.manual_seed(0)
        for _ in range(1 + len(model.value_embeds)):
            torch.nn.Embedding(50304, 32)
        for i, block in enumerate(model.blocks):
            if i != free:
                assert torch.equal(block.attn.qkvo_w, train_gpt.CausalSelfAttention(32, 2, 16, attn_gate=True).qkvo_w), (flag, i)
            if i > 0 or flag:
                assert torch.equal(block.mlp.c_fc, train_gpt.MLP(32).c_fc), (flag, i)
    assert torch.equal(models[False].blocks[0].attn.qkvo_w, models[True].blocks[0].attn.qkvo_w)
    assert not torch.equal(models[False].blocks[1].attn.qkvo_w, models[True].blocks[1].attn.qkvo_w)
