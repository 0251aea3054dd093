"""A checkpoint is written only by the run that owns it, and a file that does not hold what its run sealed into it
is never loaded: two real processes on one folder, two writers of one name, and files mixed, edited or renamed by
hand, each refused in one line by the resume and by the tools."""

import copy
import io
import json
import os
import re
import subprocess
import signal
import sys

import pytest
import torch
from conftest import ROOT, TINY_RUN
from test_distributed import TRAIN_GPT, env, finish, start, torchrun
from test_evaluate import perplexity_task
from test_preemption import assert_one_line_error, run_script

import run_support
import train_gpt

sys.path.insert(0, str(ROOT / "tools"))
import sample  # noqa: E402

LAUNCH_LINE = re.compile(r"^checkpoints: (.+), held by this launch \((\w+)\) while it runs$", re.MULTILINE)


def owned_run(tmp_path, tiny_shards, seed: int, iterations: int, logs: str) -> list[str]:
    """A run of run_id 'shared' in the one checkpoint folder tmp/ck, saving after every Adam step (every second),
    logging to logs."""
    return [sys.executable, TRAIN_GPT, *TINY_RUN, *tiny_shards, f"--seed={seed}", f"--num_iterations={iterations}",
            "--checkpoint_every=2", "--save_checkpoint", "--run_id=shared", f"--checkpoint_dir={tmp_path / 'ck'}",
            f"--log_dir={tmp_path / logs}", "--val_loss_every=0"]


def test_two_runs_started_at_once_on_one_folder_never_mix_their_checkpoints(tiny_shards, tmp_path):
    """Seeds 0 and 1, one run_id and checkpoint folder, separate log folders, started together: one trains and saves
    every step; the other refuses in one line naming the folder, before its log exists. A third, started while the
    winner is held still mid-run, is told who holds the folder. Every file left loads, sealed by the winner's launch, with
    its seed, and a digest of its own contents."""
    runs = {seed: start(owned_run(tmp_path, tiny_shards, seed, 24, f"logs{seed}"), tmp_path) for seed in (0, 1)}
    first_line = {seed: proc.stdout.readline() for seed, proc in runs.items()}  # the loser's error, or a winner's line
    losers = [seed for seed, line in first_line.items() if line.startswith("error: ")]
    assert len(losers) == 1, first_line
    [winner] = {0, 1} - set(losers)
    while not re.match(r"step:2/24 ", runs[winner].stdout.readline() or "step:2/24 "):
        pass
    runs[winner].send_signal(signal.SIGSTOP)  # held still while training, the folder locked
    try:
        late = subprocess.run(owned_run(tmp_path, tiny_shards, 2, 24, "logs2"), cwd=tmp_path, env=env(),
                              capture_output=True, text=True, timeout=120)
    finally:
        runs[winner].send_signal(signal.SIGCONT)
    assert_one_line_error(late, f"{tmp_path / 'ck' / 'shared'}: the checkpoint folder of run 'shared' is in use by "
                                f"another live process (pid {runs[winner].pid} on ")
    assert f"logging to {tmp_path / f'logs{winner}' / 'shared.txt'}" in late.stderr
    for seed, proc in runs.items():
        code, rest = finish(proc, 300)
        if seed == winner:
            assert code == 0, rest[-3000:]
        else:
            assert code == 2 and rest == "", rest[-3000:]  # the one line was all it wrote
            assert f"{tmp_path / 'ck' / 'shared'}" in first_line[seed] and "Traceback" not in first_line[seed]
            assert not (tmp_path / f"logs{seed}").exists()
    assert not (tmp_path / "logs2").exists()
    launch = LAUNCH_LINE.search((tmp_path / f"logs{winner}" / "shared.txt").read_text())[2]
    saved = sorted((tmp_path / "ck" / "shared").glob("step_*.pt"))
    assert [p.name for p in saved] == [f"step_{step:06d}.pt" for step in range(2, 25, 2)]
    for path in saved:
        state = run_support.read_checkpoint(path)
        assert state["identity"]["launch"] == launch and state["hyperparameters"]["seed"] == winner
    assert not list((tmp_path / "ck" / "shared").glob(".*.tmp"))
    owner = json.loads((tmp_path / "ck" / "shared" / run_support.OWNER_FILE).read_text())
    assert owner["launch"] == launch and owner["pid"] == runs[winner].pid


def test_a_new_run_refuses_a_folder_of_checkpoints_that_a_resumed_run_continues(tiny_shards, tmp_path):
    """After the first run has ended: a new run of its run_id (another log folder) would overwrite its checkpoints and
    is refused, naming the earlier run's log, before its own log exists; a run resuming from one of them continues in
    the folder (to the same model, sealed anew)."""
    first = train_gpt.main(owned_run(tmp_path, tiny_shards, 0, 4, "logs0")[2:])
    folder = tmp_path / "ck" / "shared"
    before = {p.name: p.read_bytes() for p in folder.glob("step_*.pt")}
    with pytest.raises(run_support.ConfigError, match=re.escape(
            f"{folder}: holds checkpoints of an earlier run of run_id 'shared' (step_000004.pt the last; its log: "
            f"{first['log_path']}), which this run would overwrite")):
        train_gpt.main(owned_run(tmp_path, tiny_shards, 1, 4, "logs1")[2:])
    assert {p.name: p.read_bytes() for p in folder.glob("step_*.pt")} == before and not (tmp_path / "logs1").exists()
    resumed = train_gpt.main([*owned_run(tmp_path, tiny_shards, 0, 4, "logs0")[2:], f"--resume={folder / 'step_000002.pt'}"])
    again, first_end = (torch.load(folder / "step_000004.pt", weights_only=True),
                        torch.load(io.BytesIO(before["step_000004.pt"]), weights_only=True))
    assert again["identity"]["log"] == str(resumed["log_path"]) == str(tmp_path / "logs0" / "shared.resume1.txt")
    assert all(torch.equal(again["model"][name], first_end["model"][name]) for name in first_end["model"])


def test_every_rank_of_a_refused_launch_stops_at_once(tiny_shards, tmp_path):
    """Under torchrun, only rank 0 claims the folder: when another process holds it (this test, here), both ranks end
    with its refusal, exit 2, rather than rank 1 waiting for a rank 0 that has gone."""
    held = run_support.CheckpointFolder(tmp_path / "ck" / "shared", "shared", tmp_path / "elsewhere.txt", None)
    try:
        code, output = finish(start([*torchrun(2), *owned_run(tmp_path, tiny_shards, 0, 4, "logs")[1:]], tmp_path), 120)
    finally:
        held.release()
    refusal = (f"error: {tmp_path / 'ck' / 'shared'}: the checkpoint folder of run 'shared' is in use by another live "
               f"process (pid {os.getpid()} on ")
    assert code != 0 and output.count(refusal) == 2, output[-3000:]  # one a rank (their lines may interleave)
    assert not (tmp_path / "logs").exists() and not (tmp_path / "ck" / "shared").exists()


WRITER = """
import sys, torch
sys.path.insert(0, {root!r})
import run_support
seed, path = int(sys.argv[1]), run_support.Path(sys.argv[2])
g = torch.Generator().manual_seed(seed)
state = dict(step=7, model={{f"w{{i}}": torch.randn(256, 1024, generator=g) for i in range(8)}}, optimizers=[], data={{}},
             hyperparameters=dict(seed=seed), clock={{}})
for _ in range(30):
    run_support.write_checkpoint(path, run_support.seal(state, "same", f"writer{{seed}}", None))
"""


def test_two_processes_writing_one_checkpoint_name_leave_one_whole_file(tmp_path):
    """Two processes write 8 MB checkpoints under one name 30 times each, at once: both succeed (neither's temporary
    file is the other's), and the file left is one writer's, whole, its digest its own."""
    path = tmp_path / "step_000007.pt"
    writers = [subprocess.Popen([sys.executable, "-c", WRITER.format(root=str(ROOT)), str(seed), str(path)],
                                stderr=subprocess.PIPE, text=True) for seed in (0, 1)]
    for writer in writers:
        assert writer.wait(timeout=180) == 0, writer.stderr.read()[-2000:]
    state = run_support.read_checkpoint(path)
    seed = state["hyperparameters"]["seed"]
    g = torch.Generator().manual_seed(seed)
    assert all(torch.equal(state["model"][f"w{i}"], torch.randn(256, 1024, generator=g)) for i in range(8))
    assert state["identity"]["launch"] == f"writer{seed}" and sorted(tmp_path.iterdir()) == [path]


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory, tiny_shards):
    """The final checkpoints of two 2-step runs, seeds 0 and 1, and the folder they are in."""
    folder = tmp_path_factory.mktemp("two_runs")
    paths = [train_gpt.main([*TINY_RUN, *tiny_shards, f"--seed={seed}", "--num_iterations=2", "--save_checkpoint",
                             f"--run_id=seed{seed}", f"--checkpoint_dir={folder / 'ck'}",
                             f"--log_dir={folder / 'logs'}"])["checkpoints"][-1] for seed in (0, 1)]
    return paths, folder


def mixed(state: dict, other: dict) -> dict:
    """state's metadata and identity with 8 of its model tensors taken from other, as the interleaved writes left."""
    names = list(state["model"])[:8]
    return {**state, "model": {**state["model"], **{name: other["model"][name] for name in names}}}


def edited(state, other):
    return {**state, "hyperparameters": {**state["hyperparameters"], "seed": 7}}


def unsealed(state, other):
    return {key: value for key, value in state.items() if key != "identity"}


@pytest.mark.parametrize("make, saved_as, message", [
    (mixed, "step_000002.pt", "its contents do not match the digest run 'seed0' sealed it with (two processes wrote it, "
                              "or it was damaged): refused"),
    (edited, "step_000002.pt", "its contents do not match the digest run 'seed0' sealed it with"),
    (lambda state, other: state, "step_000005.pt", "holds step 2 of run 'seed0', sealed as step 2, named step 5: refused"),
    (unsealed, "step_000002.pt", "made by train_gpt.py before checkpoints carried their run's identity and digest"),
])
def test_a_file_that_is_not_what_its_run_sealed_is_refused_in_one_line(two_runs, tmp_path, capsys, make, saved_as,
                                                                       message):
    """Seed 0's checkpoint with 8 of seed 1's model tensors (the mix two writers once left), with an edited seed,
    under another step's name, or without its identity: the reader every tool uses refuses it, and tools/sample.py
    says so in one line, exit 2. The untouched file loads."""
    (ours, theirs), _ = two_runs
    state, other = torch.load(ours, weights_only=True), torch.load(theirs, weights_only=True)
    assert run_support.read_checkpoint(ours)["identity"]["run_id"] == "seed0"
    path = tmp_path / saved_as
    torch.save(make(state, other), path)
    with pytest.raises(run_support.ConfigError, match=re.escape(f"{path}: {message}")):
        run_support.read_checkpoint(path)
    assert sample.main([str(path), "--device=cpu"]) == 2
    stdout, stderr = capsys.readouterr()
    assert stdout == "" and stderr.strip() == stderr.strip().splitlines()[0] and f"{path}: {message}" in stderr


def test_a_mixed_file_is_refused_by_the_resume_and_both_tools(two_runs, tiny_shards, tmp_path):
    """The mixed file through the commands a user runs: --resume, tools/sample.py and tools/evaluate.py each end
    with the one line and exit 2; the resume leaves no log and claims no folder."""
    (ours, theirs), _ = two_runs
    path = tmp_path / "step_000002.pt"
    torch.save(mixed(torch.load(ours, weights_only=True), torch.load(theirs, weights_only=True)), path)
    message = f"{path}: its contents do not match the digest run 'seed0' sealed it with"
    resumed = run_script(tmp_path, *tiny_shards, "--num_iterations=4", f"--resume={path}", "--run_id=seed0",
                         f"--log_dir={tmp_path / 'logs'}", f"--checkpoint_dir={tmp_path / 'ck'}")
    assert_one_line_error(resumed, message)
    assert not (tmp_path / "logs").exists() and not (tmp_path / "ck").exists()
    (tmp_path / "docs.jsonl").write_text('{"text": "To be, or not to be."}\n')
    task = ["--tasks=docs", f"--include_path={perplexity_task(tmp_path / 'tasks', 'docs', tmp_path / 'docs.jsonl')}"]
    for tool, options in (("sample.py", []), ("evaluate.py", task)):
        proc = subprocess.run([sys.executable, str(ROOT / "tools" / tool), str(path), *options, "--device=cpu"],
                              capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env())
        assert_one_line_error(proc, message)


def test_the_digest_reads_every_tensor_and_value(two_runs):
    """One bit of any tensor, a value's type (1 against 1.0, a list against a tuple) or the order of the entries
    changes the digest; the identity does not enter it."""
    (ours, _), _ = two_runs
    state = torch.load(ours, weights_only=True)
    digest = run_support.checkpoint_digest(state)
    assert digest == state["identity"]["digest"]
    assert run_support.checkpoint_digest({**state, "identity": {}}) == digest
    name, tensor = next((n, t) for n, t in state["model"].items() if t.numel() > 1000)
    flipped = tensor.clone()
    flipped.view(-1).view(torch.int32)[777] ^= 1
    changes = [{**state, "model": {**state["model"], name: flipped}},
               {**state, "step": 2.0},
               {**state, "hyperparameters": {**state["hyperparameters"], "seq_len": list(state["hyperparameters"]["seq_len"])}},
               {**state, "model": dict(reversed(state["model"].items()))}]
    assert len({run_support.checkpoint_digest(s) for s in changes} | {digest}) == len(changes) + 1



def test_the_mlp_fp8_scales_are_checkpoint_state_across_the_bootstrap(monkeypatch):
    """With FP8 (faked on CPU, whose FP8 paths compute the GPU's math; the lm_head's left out, its CPU _scaled_mm takes
    seconds), the MLPs' scales are model state: a Trainer restored from step 16's checkpoint (saved and read back; the
    last bootstrap update came after step 15) goes on through the first delayed ones to step 18's state equal to the
    uninterrupted one's, every tensor, the scales too; a warm-up leaves them as it found them. At 18 each
    down-projection's scale is the delayed one made from the weight before the last step, not the weight's own, and each
    activation scale has left 1."""
    monkeypatch.setattr(train_gpt, "fp8_supported", lambda device: (True, "faked on CPU"))
    args, _ = train_gpt.parse_args([*TINY_RUN, "--num_iterations=18", "--warmup_steps=2"], "cpu")
    plan = train_gpt.plan_device(args, torch.device("cpu"))
    tokens = torch.randint(0, args.vocab_size, (18, 2, 129), generator=torch.Generator().manual_seed(0))
    batches = [[(t[:-1].int(), t[1:]) for t in step_tokens] for step_tokens in tokens]

    def trainer():
        t = train_gpt.Trainer(args, 0, 1, plan)
        t.model.fp8_scales = None
        assert all(block.mlp.fp8 for block in t.model.blocks)
        return t

    whole = trainer()
    before = copy.deepcopy(whole.model.state_dict())
    whole.warm_up(0)
    assert all(torch.equal(tensor, whole.model.state_dict()[name]) for name, tensor in before.items())
    for step in range(18):
        if step == 16:
            saved = io.BytesIO()
            torch.save(dict(step=step, model=whole.model.state_dict(), clock={},
                            optimizers=[o.state_dict() for o in whole.optimizers]), saved)
        whole.move_window(step)
        whole.train_step(step, batches[step])
    resumed = trainer()
    saved.seek(0)
    assert train_gpt.restore_checkpoint(torch.load(saved, weights_only=True), resumed) == (16, {})
    for step in range(16, 18):
        resumed.move_window(step)
        resumed.train_step(step, batches[step])
    ends = [t.model.state_dict() for t in (whole, resumed)]
    assert all(torch.equal(tensor, ends[1][name]) for name, tensor in ends[0].items())
    for block in whole.model.blocks:
        w = block.mlp.c_proj.detach().bfloat16()
        assert block.mlp.act_scale != 1 and block.mlp.down_scale != train_gpt.current_scale(w)
        assert block.mlp.next_down_scale == train_gpt.headroom_scale(w.abs().amax(), train_gpt.DOWN_WEIGHT_HEADROOM)
