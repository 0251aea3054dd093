"""tools/evaluate.py, the lm-evaluation-harness adapter: packed loglikelihoods against each request's own full
forward within the derived float32 bound, rolling windows, the harness's HellaSwag scoring by hand, generation
against tools/sample.py, checkpoints of both presets, and one line for each kind of bad input. Offline: the tasks
read files written here."""

import copy
import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from conftest import EOT, FAST_ADAM_LRS, ROOT, cycle_shards
from rounding import assert_within, first_order_bound
from test_sample import one_thread, randomized_gpt, randomized_records_structure_gpt  # noqa: F401  (fixtures;
# one_thread autouse; the cycle model, trained, is conftest's)

STRUCTURES = {"u-net": "randomized_gpt", "records": "randomized_records_structure_gpt"}  # test_sample's models

import train_gpt

sys.path.insert(0, str(ROOT / "tools"))
import evaluate  # noqa: E402
import sample  # noqa: E402

pytestmark = pytest.mark.numerics
TASKS = ROOT / "tools" / "eval_tasks"


def alone(model: train_gpt.GPT, tokens: list[int], n: int, window: int, long_window: int | None = None) -> torch.Tensor:
    """The log-probability of the last n tokens: one full forward of this request alone, minus its summed loss."""
    sequence = torch.tensor(tokens[:-1])
    x = model.trunk(sample.pad_to_blocks(sequence), window, long_window=long_window)[0, :sequence.numel()]
    logits = model.softcapped_logits(x[len(tokens) - 1 - n:])[:, :model.vocab_size]
    return -F.cross_entropy(logits, torch.tensor(tokens[-n:]), reduction="sum")


def requests_of(seed: int) -> list[tuple[list[int], int]]:
    """Documents of 2 to 300 tokens (a few crossing 128-blocks, some with an EOT inside), scoring 1 to 40 tokens, and
    a request that starts mid-document, as a truncated one or a rolling window does."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for length in (2, 5, 40, 129, 300, 17, 256, 3, 90):
        tokens = [EOT, *torch.randint(0, EOT, (length - 1,), generator=g).tolist()]
        if length > 50:
            tokens[length // 3] = EOT
        out.append((tokens, min(length - 1, 1 + length % 40)))
    out.append((torch.randint(0, EOT, (60,), generator=g).tolist(), 30))
    return out


@pytest.mark.parametrize("structure", ["u-net", "records"])
def test_packed_loglikelihoods_equal_each_request_alone_within_the_derived_bound(request, structure):
    """Requests packed 3 or 4 to a 512-position forward, and one per forward, against each request's own full
    forward in float64, within the first-order bound of that forward's float32 rounding (tests/rounding.py): the
    packed forward rounds the same operations on the same values, on other row counts. In the records' structure
    the smear would carry each request's last token into the next one's first: without restarts, packing fails."""
    model, window = request.getfixturevalue(STRUCTURES[structure]), 2
    requests = requests_of(1)
    exact_model = copy.deepcopy(model).double().requires_grad_()
    expected = [first_order_bound(lambda t=tokens, n=n: alone(exact_model, t, n, window)) for tokens, n in requests]
    assert len(evaluate.pack([len(t) - 1 for t, _ in requests], [t[0] == EOT for t, _ in requests], 512)) == 3
    packed = evaluate.score(model, window, None, requests, 512)
    one_by_one = [evaluate.score(model, window, None, [request], 512)[0] for request in requests]
    for (value, bound), (p, _), (o, _), (tokens, _) in zip(expected, packed, one_by_one, requests):
        assert_within(torch.tensor(p), torch.tensor(value), bound, f"packed, {len(tokens)} tokens")
        assert_within(torch.tensor(o), torch.tensor(value), bound, f"alone, {len(tokens)} tokens")
    if structure == "records":  # the smear reads the token before: each request's first must keep its own
        original = model.trunk
        model.trunk = lambda *args, restarts=None, **kwargs: original(*args, **kwargs)  # the restarts ignored
        try:
            leaky = evaluate.score(model, window, None, requests, 512)
        finally:
            del model.trunk
        assert any(abs(a - value) > bound for (a, _), (value, bound) in zip(leaky, expected))


def test_packing_fills_sequences_and_starts_one_at_each_mid_document_request():
    """Longest first, each into the sequence with the least room that holds it; the request that starts mid-document
    (3) opens its own sequence though the first has room for it."""
    lengths = [100, 300, 50, 200, 60, 10]
    starts = [True, True, True, False, True, True]
    assert evaluate.pack(lengths, starts, 400) == [[1, 0], [3, 4, 2, 5]]
    assert evaluate.pack([5, 5, 5], [True] * 3, 10) == [[0, 1], [2]]
    with pytest.raises(ValueError, match="a request of 11 positions exceeds the 10 of a sequence"):
        evaluate.pack([11], [True], 10)


class Request:  # the harness's Instance, as far as the adapter reads it
    def __init__(self, *args):
        self.args = args


def test_rolling_loglikelihood_sums_the_windows_each_alone(randomized_records_structure_gpt, gpt2_encoding):
    """loglikelihood_rolling over 300 tokens with 128-position windows, as the harness cuts them: the first
    after an EOT; the second after the one token before it; the last the 44 tokens left, after the 84 before them
    (each window 128 positions). Their sum against those three requests' full forwards in float64, within the sum
    of their derived bounds; the whole document in one forward gives another sum."""
    model, window = randomized_records_structure_gpt, 3
    text = " ".join(f"word{i}" for i in range(150))
    tokens = gpt2_encoding.encode(text)
    assert len(tokens) > 256
    lm = evaluate.CheckpointLM(model, window, None, gpt2_encoding, 128, max_length=128)
    [rolling] = lm.loglikelihood_rolling([Request(text)])
    exact_model = copy.deepcopy(model).double().requires_grad_()
    windows = [([EOT, *tokens[:128]], 128), (tokens[127:256], 128), (tokens[-129:], len(tokens) - 256)]
    parts = [first_order_bound(lambda t=t, n=n: alone(exact_model, t, n, window)) for t, n in windows]
    assert abs(rolling - sum(v for v, _ in parts)) <= sum(b for _, b in parts)
    whole, _ = first_order_bound(lambda: alone(exact_model, [EOT, *tokens], len(tokens), window))
    assert abs(rolling - whole) > sum(b for _, b in parts)  # the windows' short contexts: not the whole document's


def test_loglikelihood_puts_an_eot_before_each_context_and_truncates_from_the_left(randomized_gpt, gpt2_encoding):
    model, window = randomized_gpt, 2
    lm = evaluate.CheckpointLM(model, window, None, gpt2_encoding, 128, max_length=128)
    context, continuation = "The cat sat on the", " mat"
    [(logprob, _)] = lm.loglikelihood([Request(context, continuation)])
    tokens = [EOT, *gpt2_encoding.encode(context + continuation)]
    [(expected, _)] = evaluate.score(model, window, None, [(tokens, 1)], 128)
    assert logprob == expected
    long_context = " ".join(["again"] * 200)
    [(logprob, _)] = lm.loglikelihood([Request(long_context, continuation)])
    tokens = gpt2_encoding.encode(long_context + continuation)
    [(expected, _)] = evaluate.score(model, window, None, [(tokens[-129:], 1)], 128)
    assert logprob == expected


def rotated(items: list, k: int) -> list:
    k %= len(items)
    return items[k:] + items[:k]


def write_hellaswag(path):
    """20 invented examples in HellaSwag's format (the fields its validation file has), some with WikiHow's
    bracketed artifacts, which the harness's preprocessing removes; the endings' order turns every third example, so
    that no one position wins everywhere."""
    rows = []
    for i in range(20):
        rows.append(dict(ind=i, activity_label=f"Cooking step {i}", ctx_a=f"A cook picks up pan number {i}.",
                         ctx_b="then [header] the cook" if i % 3 == 0 else "she",
                         endings=rotated([f"puts it on the stove {i}.", "throws it out the window [title] badly.",
                                          f"sings to the pan {i % 4}.", "eats the pan."], i // 3), label=str(i % 4),
                         split="val", split_type="indomain", source_id=f"invented~{i}"))
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return rows


def by_hand_preprocess(text):
    text = text.strip().replace(" [title]", ". ")
    return re.sub(r"\[.*?\]", "", text).replace("  ", " ")


@pytest.fixture
def hellaswag_task(tmp_path):
    """The repository's local HellaSwag task as a task of another name, its data file an invented one."""
    folder = tmp_path / "tasks"
    folder.mkdir()
    shutil.copy(TASKS / "utils.py", folder)
    rows = write_hellaswag(tmp_path / "hellaswag_val.jsonl")
    text = (TASKS / "hellaswag_local.yaml").read_text()
    assert "task: hellaswag_local\n" in text and "data/hellaswag/hellaswag_val.jsonl" in text
    (folder / "hellaswag_invented.yaml").write_text(text.replace("task: hellaswag_local", "task: hellaswag_invented")
                                                    .replace("data/hellaswag/hellaswag_val.jsonl",
                                                             str(tmp_path / "hellaswag_val.jsonl")))
    return folder, rows


def test_hellaswag_through_the_harness_scores_acc_and_acc_norm_as_by_hand(trained, hellaswag_task, tmp_path,
                                                                          gpt2_ranks_file, gpt2_encoding, monkeypatch,
                                                                          capsys):
    """The harness's own HellaSwag preprocessing and metrics on a local file: its table printed, its results JSON
    and samples written; acc and acc_norm (log-likelihood over the ending's characters) equal those computed by
    hand from the adapter's scores of the by-hand prompts."""
    monkeypatch.setenv("GPT2_TIKTOKEN_FILE", str(gpt2_ranks_file))
    folder, rows = hellaswag_task
    checkpoint = trained[0]
    out = tmp_path / "results"
    assert evaluate.main([str(checkpoint), "--tasks=hellaswag_invented", f"--include_path={folder}", f"--output={out}",
                          "--dtype=float32", "--device=cpu", "--log_samples"]) == 0
    printed = capsys.readouterr().out
    assert re.search(r"\|hellaswag_invented\|.*\|acc\s*\|", printed) and "acc_norm" in printed
    results = json.loads((out / f"{checkpoint.stem}_hellaswag_invented.json").read_text())["results"]["hellaswag_invented"]
    model, window, long_window = sample.load_model(checkpoint, torch.device("cpu"), evaluate.DEFAULT_MAX_LENGTH, "float32")
    lm = evaluate.CheckpointLM(model, window, long_window, gpt2_encoding, evaluate.DEFAULT_MAX_LENGTH)  # as main()
    samples = [json.loads(line) for line in
               (out / f"{checkpoint.stem}_hellaswag_invented_samples.jsonl").read_text().splitlines()]
    assert sorted(sample_["doc_id"] for sample_ in samples) == list(range(20))
    prompts = []
    for row in rows:
        query = by_hand_preprocess(f"{row['activity_label']}: {row['ctx_a']} {row['ctx_b'].capitalize()}")
        prompts += [(query, " " + by_hand_preprocess(e)) for e in row["endings"]]
    # the harness's 80 requests at once (so packed as it packs them)
    all_scores = [lp for lp, _ in lm.loglikelihood([Request(*prompt) for prompt in prompts])]
    correct = correct_norm = 0
    picks = set()
    for d, (row, logged) in enumerate(zip(rows, sorted(samples, key=lambda sample_: sample_["doc_id"]))):
        assert [tuple(arguments) for arguments in logged["arguments"]] == prompts[4 * d:4 * d + 4]
        scores, endings = all_scores[4 * d:4 * d + 4], [ending[1:] for _, ending in prompts[4 * d:4 * d + 4]]
        assert [float(resp[0][0]) for resp in logged["resps"]] == scores
        gold = int(row["label"])
        picks.add(max(range(4), key=lambda k: scores[k]))
        correct += max(range(4), key=lambda k: scores[k]) == gold
        correct_norm += max(range(4), key=lambda k: scores[k] / len(endings[k])) == gold
    assert results["acc,none"] == correct / 20 and results["acc_norm,none"] == correct_norm / 20
    assert correct != correct_norm or results["acc,none"] not in (0, 1)  # the scores decide, not a constant
    assert len(picks) > 1  # nor one ending picked everywhere (which scores 0.25 here)


def cycle_lm(trained, encoding, max_length: int) -> tuple[evaluate.CheckpointLM, list[int]]:
    """The cycle model as the harness's model (float32, 512-position packs), and 40 tokens of its cycle from 3."""
    checkpoint, successor, _ = trained
    model, window, long_window = sample.load_model(checkpoint, torch.device("cpu"), 512, "float32")
    walk = [3]
    while len(walk) < 40:
        walk.append(int(successor[walk[-1]]))
    return evaluate.CheckpointLM(model, window, long_window, encoding, 512, max_length=max_length), walk


def test_generation_stops_at_its_stop_string_and_equals_greedy_sampling(trained, gpt2_encoding, capsys):
    """generate_until on the cycle model: up to the first stop string, or max_gen_toks tokens of greedy
    tools/sample.py (its own output, run in this process)."""
    checkpoint = trained[0]
    lm, walk = cycle_lm(trained, gpt2_encoding, 512)
    walk = walk[:10]
    prompt = gpt2_encoding.decode(walk)
    assert sample.main([str(checkpoint), "--prompt", prompt, "--temperature=0", "--max_new_tokens=30",
                        "--device=cpu", "--dtype=float32"]) == 0
    greedy = capsys.readouterr().out.removeprefix(prompt).removesuffix("\n")
    assert len(greedy) >= 20
    [whole] = lm.generate_until([Request(prompt, dict(until=["NEVER"], max_gen_toks=30))])
    assert whole == greedy
    stop = greedy[12:14]
    [cut] = lm.generate_until([Request(prompt, dict(until=["NEVER", stop], max_gen_toks=30))])
    assert cut == greedy[:greedy.index(stop)] and len(cut) <= 12
    [alias, short] = lm.generate_until([Request(prompt, dict(until=[], max_new_tokens=5)),  # the harness's alias
                                        Request(prompt, dict(until=[], max_gen_toks=5))])
    assert alias == short and greedy.startswith(short) and len(short) < len(greedy)
    assert len(short) == 5  # the cycle's tokens (0 to 63) decode to a character each
    with pytest.raises(evaluate.EvaluationError, match="max_gen_toks=512 leaves no room for a prompt"):
        lm.generate_until([Request(prompt, dict(until=[], max_gen_toks=512))])


def test_the_greedy_flag_and_requests_that_cannot_be_scored(trained, gpt2_encoding):
    """On the cycle model: a continuation that follows the cycle is each model's most likely token (greedy), one
    token off the cycle is not; an empty continuation or one longer than max_length is refused in one line."""
    lm, walk = cycle_lm(trained, gpt2_encoding, 256)
    successor = trained[1]
    wrong = (walk[38] + 1) % 64 if (walk[38] + 1) % 64 != successor[walk[38]] else (walk[38] + 2) % 64
    off = walk[30:39] + [wrong]  # as long as the on-cycle continuation, its last token off the cycle
    [(on_lp, on_greedy), (off_lp, off_greedy)] = lm._loglikelihood_tokens(
        [(("", ""), [EOT, *walk[:30]], walk[30:]), (("", ""), [EOT, *walk[:30]], off)])
    assert on_greedy and not off_greedy and off_lp < on_lp
    with pytest.raises(evaluate.EvaluationError, match="a continuation of 0 tokens cannot be scored"):
        lm._loglikelihood_tokens([(("a", ""), [EOT, 5], [])])
    with pytest.raises(evaluate.EvaluationError, match="a continuation of 257 tokens cannot be scored within "
                                                      "--max_length=256"):
        lm._loglikelihood_tokens([(("a", "b" * 257), [EOT, 5], [6] * 257)])
    with pytest.raises(evaluate.EvaluationError, match="--max_length=1024 must be positive and at most --batch_tokens=512"):
        evaluate.CheckpointLM(lm.model, lm.window, lm.long_window, gpt2_encoding, 512)


@pytest.fixture(scope="module")
def record_preset_checkpoint(tmp_path_factory):
    """The record preset's own settings at a tiny size (an odd depth, the key offset, the smear, the gated skip into
    the attention-free layer, the backout, paired heads in layers 0 and 1, XSA in 2, bf16 where the record rounds, Adam
    every other step) trained 4 steps on the cycle data, compiled off."""
    folder = tmp_path_factory.mktemp("record")
    cycle_shards(folder)
    result = train_gpt.main([
        "--preset=record", "--num_layers=5", "--model_dim=64", "--num_heads=2", "--head_dim=32", "--seq_len=256",
        "--paired_head_layers=0,1", "--xsa_layers=2",
        "--val_seq_len=256", "--val_tokens=512", "--batch_slots=1", "--num_iterations=4", "--extension_steps=0",
        "--window_stages=1,2", "--final_window=2", "--final_long_window=3", "--backout_layer=2",
        "--muon_momentum_warmup_steps=2", "--muon_momentum_cooldown_steps=1", "--compile=false", "--warmup_steps=0",
        "--val_loss_every=0", *FAST_ADAM_LRS, "--save_checkpoint",
        f"--train_files={folder}/cycle_train_*.bin", f"--val_files={folder}/cycle_val_*.bin",
        f"--log_dir={folder / 'logs'}", f"--checkpoint_dir={folder / 'ckpt'}", "--run_id=record"])
    return result["checkpoints"][-1]


@pytest.mark.parametrize("preset", ["cpu", "record"])
def test_a_checkpoint_of_each_preset_scores_as_its_model_alone(request, preset):
    """Loaded as the tool loads it (windows and rotary as training left them; float32, where rounding has a
    first-order bound), each preset's checkpoint, the record's with its bf16 lm_head and gates, scores packed
    requests as one forward of each alone does."""
    checkpoint = request.getfixturevalue("trained" if preset == "cpu" else "record_preset_checkpoint")
    checkpoint = checkpoint[0] if preset == "cpu" else checkpoint
    model, window, long_window = sample.load_model(checkpoint, torch.device("cpu"), 512, "float32")
    assert any(block.attn is not None and block.attn.key_offset for block in model.blocks)  # requests keep their keys
    assert (long_window == 3) == (preset == "record")
    requests = requests_of(2)[:6]
    packed = evaluate.score(model, window, long_window, requests, 512)
    exact_model = copy.deepcopy(model).double().requires_grad_()
    for (tokens, n), (value, _) in zip(requests, packed):
        exact, bound = first_order_bound(lambda t=tokens, n=n: alone(exact_model, t, n, window, long_window))
        assert_within(torch.tensor(value), torch.tensor(exact), bound, f"{preset}, {len(tokens)} tokens")


def one_line_exit(argv: list[str], capsys) -> str:
    """evaluate.main's exit status, which must be 2 with one line on stderr and nothing on stdout; that line."""
    try:
        code = evaluate.main(argv)
    except SystemExit as e:
        code = e.code
    stdout, stderr = capsys.readouterr()
    assert code == 2 and stdout == "" and len(stderr.strip().splitlines()) == 1, (code, stdout, stderr)
    assert stderr.startswith("error: ") and "Traceback" not in stderr, stderr
    return stderr.strip()


def perplexity_task(folder, name: str, data) -> str:
    """A task named name in folder, of the form of our shakespeare_val.yaml, reading data (a path)."""
    folder.mkdir(exist_ok=True)
    text = (TASKS / "shakespeare_val.yaml").read_text()
    assert "task: shakespeare_val\n" in text and "data/shakespeare/shakespeare_val.jsonl" in text
    (folder / f"{name}.yaml").write_text(text.replace("task: shakespeare_val", f"task: {name}")
                                         .replace("data/shakespeare/shakespeare_val.jsonl", str(data)))
    return str(folder)


@pytest.mark.parametrize("make_args, message", [
    (lambda tmp, ckpt: [str(tmp / "missing.pt"), "--tasks=hellaswag_local"], "no such checkpoint"),
    (lambda tmp, ckpt: [str(ckpt), "--tasks=no_such_task", f"--include_path={perplexity_task(tmp / 'mine', 'x', tmp)}"],
     f"--tasks: unknown task no_such_task: neither one of lm-eval's (`lm-eval ls tasks` lists them) nor in "
     f"{TASKS} or "),
    (lambda tmp, ckpt: [str(ckpt), "--tasks=hellaswag_local"],
     f"task hellaswag_local ({TASKS / 'hellaswag_local.yaml'}): its data file data/hellaswag/hellaswag_val.jsonl does "
     f"not exist (relative paths are from the working directory, "),
])
def test_bad_input_is_one_line_and_exit_2(trained, tmp_path, capsys, monkeypatch, gpt2_ranks_file, make_args,
                                          message):
    """A file that is no checkpoint, a task the harness does not know (the folders searched named), a task whose
    data is not here (the repository's local HellaSwag task without its file): one line naming it, exit 2, and no
    --output folder made."""
    monkeypatch.setenv("GPT2_TIKTOKEN_FILE", str(gpt2_ranks_file))
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)  # the task's relative data path leads nowhere here
    out = tmp_path / "out" / "deeper"
    assert message in one_line_exit([*make_args(tmp_path, trained[0]), f"--output={out}", "--device=cpu"], capsys)
    assert not (tmp_path / "out").exists()


def broken_yaml(tmp):
    (tmp / "tasks").mkdir()
    (tmp / "tasks" / "fine.yaml").write_text("task: fine\ndataset_path: json\n")
    (tmp / "tasks" / "broken.yaml").write_text("task: broken\ndataset_path: json\n  extra: indented: wrongly\n")
    return ["--tasks=hellaswag", f"--include_path={tmp / 'tasks'}"]


def broken_json_line(tmp):
    (tmp / "docs.jsonl").write_text('{"text": "one"}\n\n{"text": "two\n{"text": "three"}\n')
    return ["--tasks=docs", f"--include_path={perplexity_task(tmp / 'tasks', 'docs', tmp / 'docs.jsonl')}"]


def not_objects(tmp):
    (tmp / "docs.json").write_text('[{"text": "one"}, ["text", "two"]]')
    return ["--tasks=docs", f"--include_path={perplexity_task(tmp / 'tasks', 'docs', tmp / 'docs.json')}"]


def an_empty_folder(tmp):
    (tmp / "tasks").mkdir()
    (tmp / "tasks" / "notes.txt").write_text("task: not a yaml\n")
    return ["--tasks=hellaswag", f"--include_path={tmp / 'tasks'}"]


def a_file_in_the_way(tmp):
    (tmp / "results").write_text("")
    return ["--tasks=hellaswag", f"--output={tmp / 'results' / 'here'}"]


@pytest.mark.parametrize("make_args, message", [
    (lambda tmp: ["--tasks=hellaswag", "--limit=0"], "--limit=0: give a number of examples a task (1, 2, ...) or a "
                                                     "fraction of each task (between 0 and 1)"),
    (lambda tmp: ["--tasks=hellaswag", "--limit=-1"], "--limit=-1: give a number of examples"),
    (lambda tmp: ["--tasks=hellaswag", "--limit=2.5"], "--limit=2.5: give a number of examples"),
    (lambda tmp: ["--tasks=,"], "--tasks names no task; give one or more task names separated by commas"),
    (lambda tmp: ["--tasks= , ,"], "--tasks names no task"),
    (lambda tmp: ["--tasks=hellaswag", "--num_fewshot=-1"], "--num_fewshot=-1 must be at least 0"),
    (lambda tmp: ["--tasks=hellaswag", "--max_length=0"], "--max_length=0 must be at least 1"),
    (lambda tmp: ["--tasks=hellaswag", "--max_length=2048", "--batch_tokens=1024"],
     "--batch_tokens=1024 must hold --max_length=2048"),
    (lambda tmp: ["--tasks=hellaswag", "--device=bogus"], "--device=bogus: not a device torch knows"),
    (lambda tmp: ["--tasks=hellaswag", "--batch_tokens=0"], "--batch_tokens=0 must hold --max_length=1024"),
    (lambda tmp: ["--tasks=hellaswag", "--bogus=1"], "unrecognized arguments: --bogus=1"),
    (lambda tmp: ["--tasks=hellaswag", f"--include_path={tmp / 'nowhere'}"], "--include_path=TMP/nowhere: no such folder"),
    (an_empty_folder, "--include_path=TMP/tasks: holds no task YAML"),
    (broken_yaml, "TMP/tasks/broken.yaml, line 3: not a task YAML (mapping values are not allowed here)"),
    (broken_json_line, "TMP/docs.jsonl, line 3: not valid JSON (Unterminated string starting at: column 10); task docs "
                       "(TMP/tasks/docs.yaml) reads it"),
    (not_objects, "TMP/docs.json: a JSON list where an object (one document) belongs; task docs"),
    (a_file_in_the_way, "--output=TMP/results/here: TMP/results is a file, not a folder"),
])
def test_bad_options_are_refused_in_one_line_before_the_harness_or_a_model_loads(trained, tmp_path, capsys, monkeypatch,
                                                                                  make_args, message):
    """Each option checked first: a limit that is neither a count nor a fraction, no task named, a folder of task
    YAMLs that is missing, holds none or holds one that does not parse (its line named), task data with a line that
    is no JSON object (its line named), an output that cannot be a folder. One line, exit 2, the checkpoint unread,
    the harness untouched, nothing made."""
    def never(*args, **kwargs):
        raise AssertionError("reached past the checks of the options")

    monkeypatch.setattr(sample, "load_model", never)
    monkeypatch.setattr(evaluate, "quiet_harness", never)
    options = make_args(tmp_path)
    before = sorted(tmp_path.rglob("*"))
    device = [] if any(option.startswith("--device") for option in options) else ["--device=cpu"]
    assert message.replace("TMP", str(tmp_path)) in one_line_exit([str(trained[0]), *options, *device], capsys)
    assert sorted(tmp_path.rglob("*")) == before


def test_a_failed_write_of_the_results_leaves_nothing_it_made(tmp_path):
    """The results JSON written, then a samples file that cannot be (its task name holds a folder that is not there):
    an OSError naming that file, the results JSON and the folders made for them removed."""
    output = tmp_path / "new" / "results"
    checkpoint = tmp_path / "step_000006.pt"
    with pytest.raises(OSError, match=re.escape(f"{output}/step_000006_a/b_samples.jsonl: could not be written (")):
        evaluate.write_results(output, checkpoint, ["t"], {"results": {}}, {"t": [], "a/b": [{"doc_id": 0}]})
    assert list(tmp_path.iterdir()) == []
    written = evaluate.write_results(output, checkpoint, ["t"], {"results": {"t": 1}}, {"t": [{"doc_id": 0}]})
    assert sorted(output.iterdir()) == sorted(written) and json.loads(written[0].read_text()) == {"results": {"t": 1}}


def test_our_shakespeare_task_runs_without_a_warning(trained, tmp_path, gpt2_ranks_file):
    """tools/eval_tasks/shakespeare_val.yaml on two documents, offline, as a user runs it from a folder (not a git
    checkout) that holds its data: the table and results, and nothing on stderr but the harness's progress bars."""
    (tmp_path / "data" / "shakespeare").mkdir(parents=True)
    (tmp_path / "data" / "shakespeare" / "shakespeare_val.jsonl").write_text(
        "".join(json.dumps({"text": text}) + "\n" for text in ("To be, or not to be.", "Now is the winter.")))
    env = dict(os.environ, GPT2_TIKTOKEN_FILE=str(gpt2_ranks_file), HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1")
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "evaluate.py"), str(trained[0]), "--tasks=shakespeare_val",
                           f"--output={tmp_path / 'out'}", "--device=cpu"], capture_output=True, text=True, timeout=300,
                          env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert re.search(r"^\|shakespeare_val\|.*\|bits_per_byte", proc.stdout, re.M), proc.stdout
    said = [line for line in re.split(r"[\r\n]", proc.stderr) if line.strip() and not re.search(r"\d+/\d+ \[", line)]
    assert said == [], proc.stderr
    results = json.loads((tmp_path / "out" / f"{trained[0].stem}_shakespeare_val.json").read_text())
    assert results["n-samples"]["shakespeare_val"]["effective"] == 2
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    if commit.returncode == 0:  # the results name this project's commit, not the working directory's
        assert results["git_hash"].startswith(commit.stdout.strip())


def test_run_sh_eval_runs_the_tool(trained, hellaswag_task, tmp_path, gpt2_ranks_file):
    """./run.sh eval: lm-eval already in the venv (./run.sh test installed it), the tool on a trained checkpoint and
    a local HellaSwag-format task, offline; its table and results file."""
    folder, _ = hellaswag_task
    env = dict(os.environ, GPT2_TIKTOKEN_FILE=str(gpt2_ranks_file), HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1")
    proc = subprocess.run([str(ROOT / "run.sh"), "eval", str(trained[0]), "--tasks=hellaswag_invented",
                           f"--include_path={folder}", f"--output={tmp_path / 'out'}", "--limit=8", "--device=cpu"],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert re.search(r"^\|hellaswag_invented\|.*\|acc +\|.*\n\| +\|.*\|acc_norm\|", proc.stdout, re.M), proc.stdout
    assert "installing" not in proc.stderr
    results = json.loads((tmp_path / "out" / f"{trained[0].stem}_hellaswag_invented.json").read_text())
    assert results["n-samples"]["hellaswag_invented"]["effective"] == 8
