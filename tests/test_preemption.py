"""A run is never lost: bad input is refused before training with one line naming the file or value,
and SIGTERM / Ctrl-C finish the step, save a checkpoint and print the command that resumes it, whose
run then equals the uninterrupted one bit for bit (one process, and two under torchrun)."""

import glob
import re
import resource
import shlex
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
from conftest import TINY_RUN, TINY_VOCAB
from test_distributed import TRAIN_GPT, env, finish, start, torchrun

import run_support
import shards

RESUME_LINE = re.compile(r"^stopped by (SIG\w+) after step (\d+); resume with: (.+)$", re.MULTILINE)


def run_script(tmp_path, *args, timeout=180, file_size_limit=None):
    """train_gpt.py on the tiny run in a fresh process; file_size_limit: the largest file it may write
    (RLIMIT_FSIZE, as `ulimit -f`): a full disk, for one file at a time."""
    limit = None if file_size_limit is None else lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (file_size_limit,) * 2)
    proc = subprocess.run([sys.executable, str(TRAIN_GPT), *TINY_RUN, *args], cwd=tmp_path, env=env(),
                          capture_output=True, text=True, timeout=timeout, preexec_fn=limit)
    return proc


def assert_one_line_error(proc, expected: str):
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert lines[0].startswith("error: ") and expected in lines[0], lines[0]


@pytest.fixture
def corrupt_shards(tiny_shards, tmp_path):
    """Copies of the tiny shards in which the train (or val) shard holds token id 60000 at position 1234."""
    def make(which: str) -> list[str]:
        args = []
        for arg in tiny_shards:
            option, pattern = arg.split("=", 1)
            kind = "train" if option == "--train_files" else "val"
            tokens = shards.read_shard(glob.glob(pattern)[0]).astype(np.int64)
            if kind == which:
                tokens[1234] = 60000
            shards.write_shard(tmp_path / f"bad_{kind}_000000.bin", tokens)
            args.append(f"{option}={tmp_path}/bad_{kind}_*.bin")
        return args
    return make


@pytest.mark.parametrize("which", ["train", "val"])
def test_a_token_id_past_the_vocabulary_names_the_shard_and_position(corrupt_shards, tmp_path, which):
    proc = run_script(tmp_path, *corrupt_shards(which), f"--log_dir={tmp_path / 'logs'}")
    assert_one_line_error(proc, f"bad_{which}_000000.bin: token id 60000 at position 1234 is not below vocab_size={TINY_VOCAB}")
    assert not (tmp_path / "logs").exists()


def test_an_unwritable_checkpoint_dir_fails_before_training(tiny_shards, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    proc = run_script(tmp_path, *tiny_shards, "--num_iterations=50", "--checkpoint_every=10",
                      f"--checkpoint_dir={blocker / 'ckpt'}", f"--log_dir={tmp_path / 'logs'}")
    assert_one_line_error(proc, f"--checkpoint_dir={blocker / 'ckpt'}/")
    assert "cannot write there" in proc.stderr and "step:" not in proc.stdout
    assert not (tmp_path / "logs").exists()


def test_an_unwritable_log_dir_and_a_used_run_id_are_refused(tiny_shards, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    proc = run_script(tmp_path, *tiny_shards, f"--log_dir={blocker / 'logs'}")
    assert_one_line_error(proc, f"--log_dir={blocker / 'logs'}: cannot write the log there")
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "taken.txt").write_text("an earlier run's log\n")
    proc = run_script(tmp_path, *tiny_shards, f"--log_dir={tmp_path / 'logs'}", "--run_id=taken")
    assert_one_line_error(proc, f"{tmp_path / 'logs' / 'taken.txt'} already exists: run_id 'taken' was used before")
    assert (tmp_path / "logs" / "taken.txt").read_text() == "an earlier run's log\n"


def test_a_periodic_checkpoint_that_cannot_be_written_is_logged_and_training_goes_on(tiny_shards, tmp_path):
    """Checkpoints of the tiny run take about 2 MB; files of 1 MB at most may be written, so the log can
    be and the checkpoints cannot: each periodic save is logged, naming the file and the OS's reason,
    and the run ends normally, leaving no partial file."""
    proc = run_script(tmp_path, *tiny_shards, "--num_iterations=4", "--checkpoint_every=2", "--run_id=full",
                      f"--log_dir={tmp_path / 'logs'}", f"--checkpoint_dir={tmp_path / 'ck'}", file_size_limit=2**20)
    assert proc.returncode == 0, proc.stderr[-3000:]
    failed = tmp_path / "ck" / "full" / "step_000002.pt"
    assert (f"{failed}: the checkpoint could not be written (File too large); training goes on, the last checkpoint "
            f"is none yet") in (tmp_path / "logs" / "full.txt").read_text()
    assert "step:4/4 val_loss:" in proc.stdout and "Traceback" not in proc.stderr
    assert not (tmp_path / "ck" / "full").exists()  # no partial file; the folder, holding no checkpoint, let go


def test_a_final_checkpoint_that_cannot_be_written_ends_the_run_with_one_line(tiny_shards, tmp_path):
    proc = run_script(tmp_path, *tiny_shards, "--num_iterations=2", "--save_checkpoint", "--run_id=final",
                      f"--log_dir={tmp_path / 'logs'}", f"--checkpoint_dir={tmp_path / 'ck'}", file_size_limit=2**20)
    assert_one_line_error(proc, f"{tmp_path / 'ck' / 'final' / 'step_000002.pt'}: the checkpoint could not be "
                                f"written (File too large)")
    assert not (tmp_path / "ck" / "final").exists()


def test_a_log_that_cannot_be_written_ends_the_run_with_one_line(tiny_shards, tmp_path):
    """The log begins with about 110 KB of source; files of 64 KB at most may be written."""
    proc = run_script(tmp_path, *tiny_shards, "--num_iterations=2", "--run_id=nolog", f"--log_dir={tmp_path / 'logs'}",
                      file_size_limit=64 * 2**10)
    assert_one_line_error(proc, f"{tmp_path / 'logs' / 'nolog.txt'}: the log could not be written (File too large); "
                                f"the run stops")
    assert "step:" not in proc.stdout


@pytest.mark.parametrize("resume, expected", [
    ("notes.txt", "notes.txt: not a readable checkpoint of train_gpt.py"),
    ("missing.pt", "missing.pt: no such checkpoint"),
    ("latest", "--resume=latest needs --run_id"),
])
def test_resuming_from_something_that_is_no_checkpoint_is_refused(tiny_shards, tmp_path, resume, expected):
    (tmp_path / "notes.txt").write_text("just some text\n")
    proc = run_script(tmp_path, *tiny_shards, f"--resume={tmp_path / resume if resume != 'latest' else resume}",
                      f"--log_dir={tmp_path / 'logs'}")
    assert_one_line_error(proc, expected)
    assert not (tmp_path / "logs").exists()


def test_a_checkpoint_past_the_shards_that_match_is_refused_before_the_log(tiny_shards, tmp_path):
    """The data position is restored and its shard checked before the log exists, like every other input."""
    first = run_script(tmp_path, *tiny_shards, "--num_iterations=1", "--save_checkpoint", "--run_id=first",
                       f"--checkpoint_dir={tmp_path / 'ck'}", f"--log_dir={tmp_path / 'logs'}")
    assert first.returncode == 0, first.stderr[-2000:]
    state = torch.load(tmp_path / "ck" / "first" / "step_000001.pt", weights_only=True)
    state["data"]["shard_index"] = 1  # as if its shard had been deleted since: one train shard matches
    torch.save(run_support.seal(state, "first", "edited", None), tmp_path / "moved.pt")
    proc = run_script(tmp_path, *tiny_shards, "--num_iterations=1", "--run_id=second", f"--resume={tmp_path / 'moved.pt'}",
                      f"--log_dir={tmp_path / 'logs'}")
    assert_one_line_error(proc, "the checkpoint resumes in train shard 2 of the sorted list, but ")
    assert sorted(p.name for p in (tmp_path / "logs").iterdir()) == ["first.txt"]


def test_resume_latest_picks_the_highest_step_and_never_a_partial_write(tmp_path):
    folder = tmp_path / "ck" / "run"
    folder.mkdir(parents=True)
    for name in ("step_000003.pt", "step_000100.pt", "step_000012.pt", "step_000200.pt.tmp"):
        (folder / name).touch()
    assert run_support.latest_checkpoint(str(tmp_path / "ck"), "run") == folder / "step_000100.pt"


def test_resume_latest_without_checkpoints_names_the_folder(tiny_shards, tmp_path):
    proc = run_script(tmp_path, *tiny_shards, "--resume=latest", "--run_id=nothing", f"--checkpoint_dir={tmp_path / 'ck'}")
    assert_one_line_error(proc, f"--resume=latest: no checkpoints in {tmp_path / 'ck' / 'nothing'}")


ITERATIONS = 16


def interrupted(cmd, cwd, signum=signal.SIGTERM, after_step=4, timeout=240):
    """Runs cmd, sends signum to it once a later step than after_step is logged; returns (exit code, output)."""
    proc = start(cmd, cwd)
    seen, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        seen.append(line)
        if re.match(rf"step:{after_step + 1}/{ITERATIONS} ", line):
            proc.send_signal(signum)
            break
    code, rest = finish(proc, timeout)
    return code, "".join(seen) + rest


def final_state(ckpt_dir):
    return torch.load(ckpt_dir / f"step_{ITERATIONS:06d}.pt", map_location="cpu", weights_only=True)


def train_losses(output: str) -> dict[int, str]:
    return {int(m[1]): m[2] for m in re.finditer(r"^step:(\d+)/\d+ train_loss:(\S+) ", output, re.MULTILINE)}


@pytest.mark.parametrize("nproc, signum, resumed", [(1, signal.SIGTERM, True), (1, signal.SIGINT, False),
                                                    (2, signal.SIGTERM, False),
                                                    pytest.param(2, signal.SIGTERM, True, marks=pytest.mark.slow)])
def test_a_signal_saves_a_checkpoint_and_the_resumed_run_equals_the_uninterrupted_one(tiny_shards, tmp_path, nproc, signum,
                                                                                      resumed):
    """SIGTERM, in one process and under torchrun (both ranks agreeing on the step), stops at a checkpoint and its
    resume command; resumed: followed through the resume to the end and compared with an uninterrupted run (in one
    process; under torchrun -m slow, where test_distributed's two-process checkpoint resumes to the same bits by
    default). SIGINT takes the same path after the signal. Adam steps every second step: the run stops after an Adam
    step (a checkpoint between would drop the gradients Adam has summed), and the resume's warm-up leaves none
    behind."""
    launcher = [sys.executable] if nproc == 1 else torchrun(nproc)
    common = [*TINY_RUN, *tiny_shards, f"--num_iterations={ITERATIONS}", "--val_loss_every=8", "--train_loss_every=1",
              "--checkpoint_every=6", "--save_checkpoint", f"--log_dir={tmp_path / 'logs'}"]
    code, out = interrupted([*launcher, TRAIN_GPT, *common, "--run_id=cut", f"--checkpoint_dir={tmp_path / 'c'}"],
                            tmp_path, signum)
    # one process exits as the shell reports a signal's end; torchrun reports its own SignalException (exit 1)
    assert code == (128 + signum if nproc == 1 else 1), out[-3000:]
    (name, step, command), = RESUME_LINE.findall(out)
    step = int(step)
    assert name == signal.Signals(signum).name and 5 <= step < ITERATIONS and step % 2 == 0  # after an Adam step
    checkpoint = tmp_path / "c" / "cut" / f"step_{step:06d}.pt"
    assert checkpoint.exists() and not list((tmp_path / "c").rglob("*.tmp"))
    assert f"--resume={checkpoint}" in command and "--run_id=cut" in command
    assert command.startswith("python train_gpt.py " if nproc == 1 else f"torchrun --standalone --nproc_per_node={nproc} train_gpt.py ")
    assert f"stopped by {name} after step {step}; checkpoint: {checkpoint}" in (tmp_path / "logs" / "cut.txt").read_text()
    if not resumed:
        return

    whole = finish(start([*launcher, TRAIN_GPT, *common, "--run_id=whole", f"--checkpoint_dir={tmp_path / 'w'}"],
                         tmp_path), 240)
    assert whole[0] == 0, whole[1][-3000:]
    words = shlex.split(command)  # the printed command is quoted for a shell
    resume_args = words[words.index("train_gpt.py") + 1:]
    # warm-up steps, then the restore of the model and of every rank's optimizer states from the checkpoint
    resumed = finish(start([*launcher, TRAIN_GPT, *resume_args, "--warmup_steps=3"], tmp_path), 240)  # ends between Adam steps
    assert resumed[0] == 0, resumed[1][-3000:]
    continued = (tmp_path / "logs" / "cut.resume1.txt").read_text()
    assert f"resumed from {checkpoint} at step {step}; continues the log {tmp_path / 'logs' / 'cut.txt'}" in continued

    expected, got = final_state(tmp_path / "w" / "whole"), final_state(tmp_path / "c" / "cut")
    for key, tensor in expected["model"].items():
        assert torch.equal(tensor, got["model"][key]), key
    assert got["data"] == expected["data"]
    whole_losses, cut_losses, resumed_losses = train_losses(whole[1]), train_losses(out), train_losses(resumed[1])
    assert {s: cut_losses.get(s) for s in range(1, step + 1)} == {s: whole_losses[s] for s in range(1, step + 1)}, \
        out[-3000:]
    assert resumed_losses == {s: whole_losses[s] for s in range(step + 1, ITERATIONS + 1)}
