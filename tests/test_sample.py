"""Generation (tools/sample.py: next_token_logits, through the model's cache hook): the KV cache against
the full forward, sampling, the chunked validation loss, and the tool's handling of bad checkpoints."""

import copy
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import CYCLE_STEPS, EOT, ROOT
from test_model import randomize_, summed_loss

import run_support
import train_gpt
from rounding import UNIT_ROUNDOFF, assert_within, first_order_bound

sys.path.insert(0, str(ROOT / "tools"))
import sample  # noqa: E402

pytestmark = pytest.mark.numerics

SAMPLE_TOOL = ROOT / "tools" / "sample.py"


@pytest.fixture(autouse=True)
def one_thread():
    """These models are tiny: on 2 busy cores, two threads mostly wait on each other at every op."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def save_edited(state: dict, path):
    """An edited checkpoint sealed at path, its optimizer state left empty: the sampler reads the weights and the
    settings alone, and the run's optimizer state is most of the file."""
    torch.save(run_support.seal({**state, "optimizers": []}, "cycle", "edited", None), path)


def test_loaded_rotary_follows_the_checkpoints_yarn(trained, tmp_path):
    """yarn=false: the base frequencies at any step; a checkpoint saved before the setting existed was
    made with YaRN on, so its frequencies are rescaled (from window 2 to 3 here), as yarn=true's are."""
    checkpoint = trained[0]
    state = torch.load(checkpoint, weights_only=True)
    rescaled = train_gpt.Rotary(32, 512)  # the trained model's head_dim
    rescaled.rescale(2, 3)
    for yarn, expected in ((False, train_gpt.Rotary(32, 512).freqs), (None, rescaled.freqs), (True, rescaled.freqs)):
        if yarn is None:
            state["hyperparameters"].pop("yarn")
        else:
            state["hyperparameters"]["yarn"] = yarn
        save_edited(state, tmp_path / "edited.pt")
        model, window, _ = sample.load_model(tmp_path / "edited.pt", torch.device("cpu"), 512, "float32")
        assert window == 3 and torch.equal(model.rotary.freqs, expected), yarn


def test_a_checkpoint_holding_a_setting_since_removed_is_refused_naming_it(trained, tmp_path, capsys):
    """A checkpoint of an earlier train_gpt.py may hold a form that is now fixed otherwise (the key offset off, say,
    which changes no weight's shape): load_model refuses it in one line naming the setting, and sample.py exits 2."""
    state = torch.load(trained[0], weights_only=True)
    state["hyperparameters"].update(key_offset=False, smear=False)
    path = tmp_path / "earlier.pt"
    save_edited(state, path)
    message = (f"{path}: made by an earlier train_gpt.py, with settings since removed (key_offset, smear); load it "
               f"with the tools of the commit that made it")
    with pytest.raises(train_gpt.ConfigError) as error:
        sample.load_model(path, torch.device("cpu"))
    assert str(error.value) == message
    assert sample.main([str(path), "--device=cpu"]) == 2 and capsys.readouterr().err.strip() == f"error: {message}"


def refusal(state: dict, path) -> str:
    """The one line load_model refuses state with, sealed at path."""
    save_edited(state, path)
    with pytest.raises(train_gpt.ConfigError) as error:
        sample.load_model(path, torch.device("cpu"))
    return str(error.value)


def test_a_checkpoint_from_before_the_2026_03_22_stream_is_refused(trained, tmp_path):
    """A checkpoint of the 02-03 form (a packed_doc_len of one int, the stream's lambdas then lived in
    the scalars) is refused in one line saying so, not with a TypeError of its int."""
    state = torch.load(trained[0], weights_only=True)
    state["hyperparameters"]["packed_doc_len"] = 0
    path = tmp_path / "0203.pt"
    assert refusal(state, path) == (f"{path}: made by an earlier train_gpt.py, before the 2026-03-22 record's residual "
                                    f"stream; load it with the tools of the commit that made it")


def test_a_checkpoint_from_before_the_2026_04_08_head_pairs_is_refused(trained, tmp_path):
    """A checkpoint whose attention weights are one (4, D, D) qkvo_w a layer (before 2026-04-08) is refused by the
    sampler in one line saying so, and by a run resuming it in one line naming the weight that does not fit, before
    its log is written (the log folder stays empty)."""
    state = torch.load(trained[0], weights_only=True)
    for name in [name for name in state["model"] if name.endswith(".attn.qk_w")]:
        qk, vo = state["model"].pop(name), state["model"].pop(name.replace("qk_w", "vo_w"))
        state["model"][name.replace("qk_w", "qkvo_w")] = torch.cat([qk.reshape(2, *vo.shape[1:]), vo])
    path = tmp_path / "0322.pt"
    assert refusal(state, path) == (f"{path}: made by an earlier train_gpt.py, before the 2026-04-08 record's head-pair "
                                    f"matrices; load it with the tools of the commit that made it")
    argv = [f"--{k}={','.join(map(str, v)) if isinstance(v, tuple) else v}" for k, v in state["hyperparameters"].items()
            if k not in ("resume", "log_dir", "checkpoint_dir")]
    with pytest.raises(train_gpt.ConfigError) as error:
        train_gpt.main([*argv, f"--resume={path}", f"--log_dir={tmp_path / 'logs'}",
                        f"--checkpoint_dir={tmp_path / 'checkpoints'}"])
    assert str(error.value).startswith(f"{path}: the weights do not fit the model its hyperparameters describe (9 differ, "
                                       f"first blocks.0.attn.qk_w: missing in the file, (2, 64, 64) expected)")
    assert not (tmp_path / "logs").exists() or not any((tmp_path / "logs").iterdir())


def test_a_final_checkpoint_samples_with_its_last_validations_long_window(trained, tmp_path):
    """final_long_window widens the long layers at a run's last validation: load_model hands it over for the
    checkpoint of the last step, and none for an earlier step's or a run without it."""
    checkpoint = trained[0]
    state = torch.load(checkpoint, weights_only=True)
    assert state["step"] == state["hyperparameters"]["num_iterations"]
    for final_long_window, step, expected in ((0, CYCLE_STEPS, None), (4, CYCLE_STEPS, 4), (4, CYCLE_STEPS - 1, None)):
        state["hyperparameters"]["final_long_window"], state["step"] = final_long_window, step
        save_edited(state, tmp_path / "edited.pt")
        _, _, long_window = sample.load_model(tmp_path / "edited.pt", torch.device("cpu"), 512, "float32")
        assert long_window == expected


def test_loaded_model_gives_the_runs_final_validation_loss(trained):
    """load_model's model (float32, as trained) at the checkpoint's window (3) gives the validation loss
    the run logged at its last step, both within the derived float32 bound of the float64 loss (the
    sampler's lm_head layout takes other kernels): its rotary was rescaled from window 2 as the run's was.
    With the unscaled rotary tables the loss falls outside that bound."""
    checkpoint, _, result = trained
    model, window, _ = sample.load_model(checkpoint, torch.device("cpu"), 512, "float32")
    assert window == 3
    val = train_gpt.validation_sequences(str(checkpoint.parent.parent.parent / "cycle_val_*.bin"), 512, 256, 50257)

    def loss():
        with torch.no_grad():
            return sum(model(seq[:-1].int(), seq[1:], window).item() for seq in val) / len(val)

    # the training forward's summed loss over the whole logits, whose ops bound the chunked evaluation's too;
    # eval divides it by the positions (one more rounding), validation averages the sequences in float64
    exact_model = copy.deepcopy(model).double().train()
    positions, u = val.size(1) - 1, UNIT_ROUNDOFF[torch.float32]
    sums = [first_order_bound(lambda seq=seq: summed_loss(exact_model, seq[:-1].int(), seq[1:], window)) for seq in val]
    exact = sum(value for value, _ in sums) / positions / len(val)
    bound = sum(bound / positions + u * value / positions for value, bound in sums) / len(val)
    assert abs(result["val_losses"][CYCLE_STEPS] - exact) <= bound
    assert abs(loss() - exact) <= bound
    # The target logits at a few positions, each within its own bound; the unscaled rotary tables move some outside.
    seq, picks = val[0], torch.tensor([63, 127, 191, 255])

    def target_logits(m):
        return m.softcapped_logits(m.trunk(seq[:-1].int(), window)[0, picks])[torch.arange(len(picks)), seq[1:][picks]]

    exact_logits, logit_bounds = first_order_bound(lambda: target_logits(exact_model))
    with torch.no_grad():
        assert ((target_logits(model).double() - exact_logits).abs() <= logit_bounds).all()
        model.rotary = train_gpt.Rotary(model.blocks[0].attn.head_dim, model.max_seq_len)
        assert ((target_logits(model).double() - exact_logits).abs() > logit_bounds).any()


def assert_top_logits_agree(exact_model, sequence, window, cached, full, long_window=None):
    """The cached and the full forward's two largest logits both within the derived float32 bound of the float64
    full forward's (tests/rounding.py: the cached path rounds the same ops, on other row counts), and apart by
    more than their bounds: no float32 evaluation picks another greedy token."""
    largest = full.topk(2).indices
    exact, bound = first_order_bound(
        lambda: sample.next_token_logits(exact_model, torch.tensor(sequence), window, long_window=long_window)[largest])
    for name, logits in (("cached", cached), ("full", full)):
        assert_within(logits[largest], exact, bound, f"{name} logits")
    assert exact[0] - exact[1] > bound[0] + bound[1]
    assert int(cached.argmax()) == int(full.argmax()) == int(largest[0])


GREEDY_STEPS = 24  # the long window cuts the second document from the 5th generated token on


def test_cached_greedy_generation_equals_greedy_over_the_full_prefix(trained):
    """At every step, the cached path (one new position) and the training forward over the whole prefix
    give the same logits and the same greedy token. The prefix holds a document boundary, crosses
    three 128-blocks, and its second document outgrows both windows (long 3 blocks, short 1) within the first few
    generated tokens: the cached path's mask rows cut its keys as the full forward's do."""
    checkpoint, successor, _ = trained
    model, window, _ = sample.load_model(checkpoint, torch.device("cpu"), 512)
    assert window == 3
    start = 5
    walk = [start]
    while len(walk) < 400:
        walk.append(int(successor[walk[-1]]))
    prompt = [EOT, *walk[:20], EOT, *walk[20:]]  # a second document from position 21
    cache, new, sequence = sample.KVCache(model.num_layers), torch.tensor(prompt), list(prompt)
    exact_model = copy.deepcopy(model).double().requires_grad_()
    with torch.no_grad():
        for _ in range(GREEDY_STEPS):
            cached = sample.next_token_logits(model, new, window, cache)
            full = sample.next_token_logits(model, torch.tensor(sequence), window)
            assert_top_logits_agree(exact_model, sequence, window, cached, full)
            sequence.append(int(full.argmax()))
            new = torch.tensor(sequence[-1:])
        assert len(sequence) - 2 - 21 > 3 * model.window_unit  # the last query checked lost the document's start
        # the windows cut the prefix: the model's other window would have given other logits
        assert (sample.next_token_logits(model, torch.tensor(sequence), 2) - full).abs().max() > 1e-2
    generated = sequence[len(prompt):]
    assert len(set(generated)) > 10  # the model walks the cycle, not one token
    assert list(sample.generate(model, prompt, GREEDY_STEPS, window, temperature=0)) == generated
    assert list(sample.generate(model, prompt, 5, window, temperature=0, use_cache=False)) == generated[:5]


@pytest.fixture(scope="module")
def randomized_gpt():
    """An untrained 4-layer model whose zero-initialized weights and initial scalars are replaced by
    random ones, so every path, attention included, moves the logits; it knows windows of 1, 2 and 3
    blocks."""
    torch.manual_seed(0)
    model = train_gpt.GPT(train_gpt.GPTConfig(50257, 4, num_heads=2, head_dim=16, model_dim=32, max_seq_len=512,
                                              windows=(1, 2, 3), backout_layer=2))
    return randomize_(model, seed=0).eval()


@pytest.mark.parametrize("backend", ["eager", *(pytest.param(b, marks=pytest.mark.slow) for b in ("aot_eager", "inductor"))])
def test_compiled_generation_gives_the_eager_tokens(randomized_gpt, backend):
    """tools/sample.py --compile: dynamo traces the cache's updates (buffers, lengths, the new positions'
    mask rows) into a few graphs and their guards; aot_eager adds functionalization and inductor its
    kernels (a minute or more), so those two are slow. Greedy tokens through a document start and
    three blocks equal the eager ones."""
    model = randomized_gpt
    prompt = [EOT, *range(100, 160), EOT, 7]
    eager = list(sample.generate(model, prompt, 240, 2, temperature=0))
    try:
        sample.compile_for_generation(model, backend)
        compiled = list(sample.generate(model, prompt, 240, 2, temperature=0))
    finally:
        del model.trunk, model.softcapped_logits  # back to the class's eager methods
    assert compiled == eager
    assert len(set(eager)) > 20


def test_weights_cast_once_give_the_logits_of_weights_cast_at_every_call(randomized_gpt):
    """sample.in_dtype(bfloat16) against bfloat16 embeddings (and the coefficient networks' weights, which the forward
    takes uncast) with float32 weights that the forward casts at every call: the same logits to the bit, token after
    token through the cache."""
    training_layout = copy.deepcopy(randomized_gpt)
    for p in (training_layout.embed.weight, training_layout.bigram_embed.weight, training_layout.value_embeds,
              *[p for net in (training_layout.gates, training_layout.mudd) for p in (net.w1, net.w2, net.b2)]):
        p.data = p.data.bfloat16()
    training_layout.bigram_signs = training_layout.bigram_signs.bfloat16()
    cast_once = sample.in_dtype(copy.deepcopy(randomized_gpt), torch.bfloat16)
    assert cast_once.lm_head.weight.dtype == torch.bfloat16 and cast_once.scalars.dtype == torch.float32
    caches = [sample.KVCache(4), sample.KVCache(4)]
    with torch.no_grad():
        for tokens in ([EOT, *range(100, 150)], [7], [8], [EOT], [9]):
            tokens = torch.tensor(tokens)
            logits = [sample.next_token_logits(model, tokens, 2, cache) for model, cache in zip((training_layout, cast_once), caches)]
            assert torch.equal(logits[0], logits[1])


@pytest.fixture(scope="module")
def randomized_records_structure_gpt():
    """randomized_gpt with more of the records' structure: the 6-layer U without its layer 0, the key offset on its
    long layer 4 (whose first new position reads the cached raw key before it), the smear (likewise the cached token),
    the skip 0 into the attention-free 3, layers 3 and 4 attending over block 2's output, XSA in layer 2 (over the new
    positions' own values), and paired heads in layers 0 and 1 (their cache holds each token's two positions)."""
    torch.manual_seed(0)
    model = train_gpt.GPT(train_gpt.GPTConfig(50257, 5, num_heads=2, head_dim=16, model_dim=32, max_seq_len=512,
                                              windows=(1, 2, 3), backout_layer=2, paired_layers=(0, 1),
                                              xsa_layers=(2,)))
    return randomize_(model, seed=0).eval()


@pytest.mark.parametrize("structure", ["randomized_gpt", "randomized_records_structure_gpt"])
@pytest.mark.parametrize("window, long_window", [(1, None), (2, None), (3, None), (2, 3)])
def test_feeding_the_cache_in_any_pieces_matches_the_full_forward(request, structure, window, long_window):
    """Pieces of 1, 127, 12, 100 and 160 tokens; documents start mid-block, twice inside a block that
    the cache already holds part of; window 1 leaves the short layers each query's own key alone; the long
    layers' own wider window as after a run's last validation (final_long_window). After every piece the
    next-token logits equal those of the forward over everything fed so far, and the cached path ran each
    position once."""
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, EOT, (400,), generator=g)
    tokens[[0, 100, 230, 300]] = EOT
    model = request.getfixturevalue(structure)
    exact_model = copy.deepcopy(model).double().requires_grad_()
    cache, fed, ran = sample.KVCache(model.num_layers), 0, []
    trunk = model.trunk

    def counted(tokens, window, masks=None, cache=None, long_window=None):
        if cache is not None:
            ran.append(tokens.numel())
        return trunk(tokens, window, masks, cache, long_window)

    model.trunk = counted
    try:
        with torch.no_grad():
            for piece in (1, 127, 12, 100, 160):
                cached = sample.next_token_logits(model, tokens[fed:fed + piece], window, cache, long_window)
                fed += piece
                assert len(cache) == fed
                full = sample.next_token_logits(model, tokens[:fed], window, long_window=long_window)
                assert_top_logits_agree(exact_model, tokens[:fed].tolist(), window, cached, full, long_window)
    finally:
        del model.trunk  # back to the class's method
    assert ran == [1, 127, 12, 100, 160]


def test_generation_never_picks_a_padding_row(randomized_gpt):
    """The vocabulary (50257) is padded to 50304 rows: with the padding rows' logits made the largest,
    greedy and sampled tokens still come from the real vocabulary."""
    model = copy.deepcopy(randomized_gpt)
    assert model.vocab_size == 50257 and model.lm_head.weight.size(0) == 50304
    with torch.no_grad():
        model.lm_head.weight[50257:] = 0.875  # the padding rows' logits: far above any real token's
    greedy = list(sample.generate(model, [EOT, 5], 8, 2, temperature=0))
    drawn = list(sample.generate(model, [EOT, 5], 8, 2, temperature=1.0, generator=torch.Generator().manual_seed(0)))
    assert max(greedy + drawn) < 50257


def test_same_seed_same_sample_and_top_k_1_is_greedy(randomized_gpt):
    model = randomized_gpt
    prompt = [EOT, 11, 22, 33]

    def draw(seed, **kwargs):
        return list(sample.generate(model, prompt, 30, 2, generator=torch.Generator().manual_seed(seed), **kwargs))

    first = draw(0, temperature=1.0)
    assert draw(0, temperature=1.0) == first
    assert draw(1, temperature=1.0) != first
    greedy = list(sample.generate(model, prompt, 30, 2, temperature=0))
    assert draw(0, temperature=1.0, top_k=1) == greedy
    assert draw(5, temperature=2.0, top_k=1) == greedy


@pytest.mark.parametrize("temperature, top_k", [(1.0, 0), (2.0, 0), (0.5, 0), (1.0, 2)])
def test_draws_follow_the_tempered_top_k_softmax(temperature, top_k):
    """Frequencies of 3,000 draws against softmax(logits / temperature) over the top_k logits."""
    logits = torch.tensor([0.5, 2.0, -1.0, 1.0, 0.0])
    generator = torch.Generator().manual_seed(0)
    counts = np.bincount([sample.choose(logits, temperature, top_k, generator) for _ in range(3000)], minlength=5)
    keep = logits >= logits.topk(top_k).values[-1] if top_k else torch.ones(5, dtype=torch.bool)
    expected = torch.where(keep, (logits / temperature).exp(), 0.0)
    expected = (expected / expected.sum()).numpy()
    assert np.abs(counts / counts.sum() - expected).max() < 0.03  # a standard error is 0.009 at most
    assert (counts[~keep.numpy()] == 0).all()


def test_temperature_zero_is_argmax():
    logits = torch.tensor([0.1, 3.0, 2.9, -4.0])
    assert sample.choose(logits, 0, 0, None) == 1
    assert sample.choose(logits, 0, 3, None) == 1


@pytest.fixture(scope="module")
def validation_case(randomized_gpt):
    """A 512-token validation sequence with documents, and its loss as one cross-entropy over all
    logits, written out from the model's definition (float32)."""
    g = torch.Generator().manual_seed(2)
    sequence = torch.randint(0, EOT, (513,), generator=g)
    sequence[[0, 140, 300]] = EOT
    inputs, targets = sequence[:-1], sequence[1:]
    with torch.no_grad():
        x = randomized_gpt.trunk(inputs, 2)
        z = randomized_gpt.lm_head(train_gpt.norm(x[0])).float()
        logits = randomized_gpt.logit_cap * torch.sigmoid((z + randomized_gpt.logit_offset) / 7.5)
        return inputs, targets, F.cross_entropy(logits, targets).item()


@pytest.mark.parametrize("chunk", [512, 128, 200, 100, 37])  # 1 to 14 chunks; 200, 100 and 37 end part-full
def test_chunked_validation_loss_equals_the_unchunked_one(randomized_gpt, validation_case, monkeypatch, chunk):
    """Eval computes the loss EVAL_LOSS_CHUNK positions at a time: the same mean as one cross-entropy
    over all logits, with no logits tensor larger than a chunk."""
    inputs, targets, unchunked = validation_case
    monkeypatch.setattr(train_gpt, "EVAL_LOSS_CHUNK", chunk)
    with torch.no_grad(), LogitsRows(randomized_gpt.lm_head.out_features) as rows:
        chunked = randomized_gpt(inputs, targets, 2).item()
    assert chunked == pytest.approx(unchunked, rel=1e-6, abs=0)
    assert rows == [chunk] * (512 // chunk) + ([512 % chunk] if 512 % chunk else [])


class LogitsRows(torch.overrides.TorchFunctionMode, list):
    """The row counts of the vocabulary-wide matmul results made inside the block, in order: one
    per logits chunk."""

    def __init__(self, vocab: int):
        super().__init__()
        self.vocab = vocab

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in (torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, F.linear) and out.size(-1) == self.vocab:
            self.append(out.shape[0])
        return out


def test_prompt_starts_a_document(gpt2_encoding):
    assert sample.prompt_tokens(gpt2_encoding, "") == [EOT]
    assert sample.prompt_tokens(gpt2_encoding, "ROMEO:") == [EOT, *gpt2_encoding.encode("ROMEO:")]
    assert sample.prompt_tokens(gpt2_encoding, "a<|endoftext|>b") == [EOT, 64, EOT, 65]
    assert sample.prompt_tokens(gpt2_encoding, "<|endoftext|>b") == [EOT, 65]


def run_tool(*args, env=None):
    return subprocess.run([sys.executable, str(SAMPLE_TOOL), *map(str, args)], capture_output=True, text=True,
                          timeout=300, env=dict(os.environ, **(env or {})), cwd=ROOT)


def test_the_tool_streams_the_prompt_and_what_generate_draws(trained, gpt2_ranks_file, gpt2_encoding):
    checkpoint, _, _ = trained
    proc = run_tool(checkpoint, "--prompt", "To be", "--max_new_tokens", 12, "--seed", 3, "--temperature", 1.0,
                    "--top_k", 5, "--device", "cpu", env={"GPT2_TIKTOKEN_FILE": str(gpt2_ranks_file)})
    assert proc.returncode == 0, proc.stderr
    model, window, _ = sample.load_model(checkpoint, torch.device("cpu"), 64)
    prompt = sample.prompt_tokens(gpt2_encoding, "To be")
    tokens = []
    for token in sample.generate(model, prompt, 12, window, 1.0, 5, torch.Generator().manual_seed(3)):
        if token == EOT:
            break
        tokens.append(token)
    assert proc.stdout == gpt2_encoding.decode(prompt[1:] + tokens) + "\n"
    assert f"({len(tokens)} tokens in" in proc.stderr


def corrupt(tmp_path, checkpoint):
    path = tmp_path / "corrupt.pt"
    path.write_bytes(checkpoint.read_bytes()[:5000])
    return path


def other_shape(tmp_path, checkpoint):
    """The weights of the checkpoint under hyperparameters of a wider model."""
    state = torch.load(checkpoint, weights_only=True)
    state["hyperparameters"].update(model_dim=128, head_dim=64)
    path = tmp_path / "other_shape.pt"
    save_edited(state, path)
    return path


def not_a_checkpoint(tmp_path, checkpoint):
    path = tmp_path / "weights.pt"
    torch.save({"embed.weight": torch.zeros(3)}, path)
    return path


@pytest.mark.parametrize("make, message", [
    (lambda tmp_path, checkpoint: tmp_path / "missing.pt", "no such checkpoint"),
    (corrupt, "not a readable checkpoint of train_gpt.py"),
    (other_shape, "the weights do not fit the model its hyperparameters describe ("),
    (not_a_checkpoint, "not a checkpoint of train_gpt.py"),
])
def test_a_bad_checkpoint_is_one_line_naming_the_file(trained, tmp_path, capsys, make, message):
    path = make(tmp_path, trained[0])
    assert sample.main([str(path), "--max_new_tokens=5", "--device=cpu"]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert len(err.strip().splitlines()) == 1, err
    assert err.startswith(f"error: {path}: ") and message in err


def test_the_tool_exits_non_zero_without_a_traceback(tmp_path):
    proc = run_tool(tmp_path / "missing.pt")
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.startswith(f"error: {tmp_path / 'missing.pt'}: no such checkpoint") and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
