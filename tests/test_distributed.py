"""train_gpt.py on the real launcher: torchrun spawns the ranks, gloo on CPU, the tiny fp32 model.

One process and two (or four) train the same model on the same tokens, to the bit: every launch runs
one thread per process (and MKL's conditional reproducibility), so each micro-step's gradient comes from
the same kernels in every run, and the tiny runs switch on exact_grad_sum (off in the cpu preset), which
sums them in float64: exact for a few float32 terms within 2^26 of each other in size, so the order of
the sum (one process: g0 + g1 + g2 + g3; two ranks: (g0 + g1) + (g2 + g3)) cannot show; wider apart, an
order's last float64 bit could still show, in the float32 result only at a rounding tie. Validation sums
per-sequence losses in float64 too. Runs that switch something off, record what the buckets do or inject
a failure go through tests/dist_helpers.py, which imports train_gpt.
"""

import functools
import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from conftest import ROOT, TINY_FORMS, TINY_RUN, TINY_VOCAB

import train_gpt

pytestmark = pytest.mark.numerics

TRAIN_GPT = ROOT / "train_gpt.py"
HELPERS = ROOT / "tests" / "dist_helpers.py"
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
ITERATIONS = 8
VAL_EVERY = 2
LAUNCH_TIMEOUT = 240  # seconds; a launch that takes longer has hung
VAL_LINE = re.compile(r"^step:(\d+)/(\d+) val_loss:(\d+\.\d+) ", re.MULTILINE)


def env() -> dict:
    e = {k: v for k, v in os.environ.items()
         if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    # two ranks on two cores: one thread each; the malloc settings ./run.sh uses on CPU
    e.update(OMP_NUM_THREADS="1", MALLOC_MMAP_MAX_="0", MALLOC_TRIM_THRESHOLD_="68719476736", PYTHONUNBUFFERED="1",
             MKL_CBWR="AUTO,STRICT")  # MKL's kernels independent of the data's alignment in memory
    return e


@dataclass
class Run:
    returncode: int
    output: str  # stdout and stderr of the launcher and every rank
    seconds: float
    log_dir: Path
    checkpoint: Path

    @property
    def logs(self) -> list[Path]:
        return sorted(self.log_dir.glob("*.txt"))

    @property
    def log(self) -> str:
        assert len(self.logs) == 1, f"expected one log (rank 0's), found {self.logs}"
        return self.logs[0].read_text()

    def val_losses(self) -> dict[int, float]:
        body = self.log.split(train_gpt.support.SEPARATOR, 1)[1]  # after the logged source
        return {int(m[1]): float(m[3]) for m in VAL_LINE.finditer(body)}

    def params(self) -> dict[str, torch.Tensor]:
        return torch.load(self.checkpoint, map_location="cpu", weights_only=True)["model"]


def start(cmd, cwd: Path, extra_env=None) -> subprocess.Popen:
    return subprocess.Popen([str(c) for c in cmd], cwd=cwd, env={**env(), **(extra_env or {})}, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)


def finish(proc: subprocess.Popen, timeout: float) -> tuple[int, str]:
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the launcher and its ranks: the session this test started
        out, _ = proc.communicate()
        pytest.fail(f"{proc.args[:6]} ... did not finish within {timeout}s; output:\n{out[-4000:]}")
    return proc.returncode, out


def train_args(tmp: Path, batch_slots: int, *extra, iterations=ITERATIONS, val_every=VAL_EVERY) -> list[str]:
    return [*TINY_RUN, "--exact_grad_sum=true", f"--batch_slots={batch_slots}", f"--num_iterations={iterations}",
            f"--val_loss_every={val_every}", "--save_checkpoint", "--run_id=run", f"--log_dir={tmp / 'logs'}",
            f"--checkpoint_dir={tmp / 'ckpt'}", *extra]


def launch(tmp: Path, launcher: list, script: Path, args: list, mode: str | None = None, extra_env=None,
           check: bool = True) -> Run:
    tmp.mkdir(parents=True, exist_ok=True)
    iterations = int(next(a for a in reversed(args) if a.startswith("--num_iterations=")).split("=")[1])
    t0 = time.perf_counter()
    code, out = finish(start([*launcher, script, *([mode] if mode else []), *args], tmp, extra_env), LAUNCH_TIMEOUT)
    run = Run(code, out, time.perf_counter() - t0, tmp / "logs", tmp / "ckpt" / "run" / f"step_{iterations:06d}.pt")
    if check:
        assert code == 0, out[-4000:]
    return run


def torchrun(nproc: int) -> list:
    return [*TORCHRUN, "--standalone", f"--nproc_per_node={nproc}"]


def max_differences(a: Run, b: Run) -> tuple[float, float]:
    """The largest difference of a logged val loss and of a final parameter."""
    va, vb, pa, pb = a.val_losses(), b.val_losses(), a.params(), b.params()
    return max(abs(va[s] - vb[s]) for s in va), max((pa[k] - pb[k]).abs().max().item() for k in pa)


def assert_runs_agree(a: Run, b: Run):
    """Every logged val loss and every final parameter equal."""
    va, vb, pa, pb = a.val_losses(), b.val_losses(), a.params(), b.params()
    assert sorted(va) == sorted(vb) and len(va) >= 3 and pa.keys() == pb.keys()
    assert va == vb and all(torch.equal(pa[k], pb[k]) for k in pa), \
        "max |d val loss| {:.2e}, max |d param| {:.2e}".format(*max_differences(a, b))


@pytest.fixture(scope="module")
def one_process(tiny_shards, tmp_path_factory) -> Run:
    """The reference: plain `python train_gpt.py`, world size 1, two micro-steps per step."""
    tmp = tmp_path_factory.mktemp("one_process")
    run = launch(tmp, [sys.executable], TRAIN_GPT, train_args(tmp, 2, *tiny_shards))
    assert "distributed: world size 1, no gradient communication" in run.log
    assert "batch: 2 sequences x 128 tokens per step = 1 ranks x 2 micro-steps" in run.log
    return run


@pytest.fixture(scope="module")
def two_processes(tiny_shards, tmp_path_factory) -> Run:
    """The same run on two processes, one micro-step each, with a checkpoint at step 4 (a checkpoint changes nothing
    a run computes: the run must still equal one_process)."""
    tmp = tmp_path_factory.mktemp("two_processes")
    return launch(tmp, torchrun(2), TRAIN_GPT, train_args(tmp, 2, *tiny_shards, "--checkpoint_every=4"))


def test_two_processes_train_like_one(one_process, two_processes):
    two = two_processes
    log = two.log  # exactly one log: rank 1 writes none
    assert log.startswith(TRAIN_GPT.read_text())
    assert "hardware: 2x CPU" in log
    assert "distributed: world size 2, backend gloo, " in log
    assert "batch: 2 sequences x 128 tokens per step = 2 ranks x 1 micro-steps" in log
    assert_runs_agree(one_process, two)


@pytest.mark.parametrize("nproc, batch_slots", [(2, 8), (4, 4)])
def test_processes_with_accumulation_train_like_one(nproc, batch_slots, tiny_shards, tmp_path):
    """2 ranks x 4 micro-steps and 4 ranks x 1 against one process accumulating 8 or 4 micro-steps, with the records'
    pieces: multi-token prediction, the embedding tied until step 3 (its gradient folded into the lm_head's in the
    buckets until then; 3 of the 6 steps are the extension), Adam every other step with cautious decay, the gates, the
    bigram hash embedding (each rank's sequences hashed where they are), the record's softcap. The sums run in other
    orders, which exact_grad_sum makes irrelevant."""
    pieces = ["--extension_steps=3", "--logit_cap=23", "--logit_offset=5"]
    one = launch(tmp_path / "one", [sys.executable], TRAIN_GPT,
                 train_args(tmp_path / "one", batch_slots, *tiny_shards, *pieces, iterations=6))
    assert "gradient sum: float64 over micro-steps and ranks" in one.log
    many = launch(tmp_path / "many", torchrun(nproc), TRAIN_GPT,
                  train_args(tmp_path / "many", batch_slots, *tiny_shards, *pieces, iterations=6))
    assert (f"batch: {batch_slots} sequences x 128 tokens per step = {nproc} ranks x {batch_slots // nproc} micro-steps"
            in many.log)
    assert_runs_agree(one, many)


def test_without_gradient_sync_the_comparison_fails(one_process, tiny_shards, tmp_path):
    """The same 2-process run with the bucket all-reduces switched off must fail assert_runs_agree."""
    nosync = launch(tmp_path, torchrun(2), HELPERS, train_args(tmp_path, 2, *tiny_shards), mode="nosync")
    assert nosync.log.startswith(TRAIN_GPT.read_text())
    with pytest.raises(AssertionError, match=r"max \|d val loss\|"):
        assert_runs_agree(one_process, nosync)
    print("sync off: max |d val loss| {:.1e}, max |d param| {:.1e}".format(*max_differences(one_process, nosync)))


RECORDED = ["--bucket_mb=0.2", "--model_dim=96", "--head_dim=48"]  # no Muon matrix shaped as an Adam tensor


@pytest.fixture(scope="module")
def recorded(tiny_shards, tmp_path_factory) -> tuple[Run, Path]:
    """4 slots on 2 ranks (2 micro-steps per step), small buckets, every all-reduce launch recorded (dist_helpers'
    record mode): the run and the folder of its records."""
    tmp = tmp_path_factory.mktemp("recorded")
    run = launch(tmp, torchrun(2), HELPERS, train_args(tmp, 4, *tiny_shards, *RECORDED), mode="record",
                 extra_env=dict(DIST_HELPERS_OUT=str(tmp / "events")))
    return run, tmp / "events"


def test_each_bucket_is_reduced_once_per_step_on_the_last_micro_step(recorded):
    """4 slots on 2 ranks: 2 micro-steps per step. Small buckets, several holding more than one tensor. Adam's buckets
    (deferred) are reduced on its steps alone, the odd ones; the embedding's own bucket only on those after the untie
    (tied, its gradient joins the lm_head's)."""
    run, out = recorded
    log = run.log
    assert "batch: 4 sequences x 128 tokens per step = 2 ranks x 2 micro-steps" in log
    num_buckets = int(re.search(r"distributed: world size 2, backend gloo, (\d+) gradient buckets of \[", log)[1])
    assert num_buckets >= 3
    # every launch, as each rank saw it
    lm_head = [train_gpt.next_multiple(TINY_VOCAB, 128), 96]
    for rank in (0, 1):
        [record] = json.loads((out / f"rank{rank}.json").read_text())
        deferred = record["deferred"]
        [embed] = [b for b, shapes in enumerate(record["bucket_shapes"]) if b and shapes == [lm_head]]
        untie = train_gpt.untie_step(train_gpt.parse_args([f"--num_iterations={ITERATIONS}", *TINY_FORMS], "cpu")[0])
        assert untie == 5  # round(2/3 x 8) | 1: the embedding's own bucket is reduced on step 7
        expected = [1 if b == embed else ITERATIONS // 2 if adam else ITERATIONS for b, adam in enumerate(deferred)]
        assert len(record["bucket_shapes"]) == num_buckets and any(deferred) and not all(deferred)
        assert sum(len(b) > 1 for b in record["bucket_shapes"]) >= 2  # coalesced buckets are exercised
        assert record["bucket_shapes"][0] == [lm_head]  # its gradient is ready first in backward
        assert record["steps"] == ITERATIONS and record["reductions"] == expected
        events = record["events"]
        assert all(e["last_micro_step"] and e["micro_step"] == 1 for e in events), events
        for step in range(ITERATIONS):
            # each bucket due once, launched when its last gradient is ready: the lm_head's first, but tied it waits
            # for the embedding's, among the last (the dense connections make the order differ from the buckets')
            due = [b for b in range(num_buckets) if (b != embed or step > untie) and (step % 2 or not deferred[b])]
            launched = [e for e in events if e["step"] == step]
            order = [e["bucket"] for e in launched]
            assert sorted(order) == due, order
            if step % 2:  # Adam's steps reduce the lm_head's bucket
                assert (order[0] == 0) == (step > untie), order
            # overlap: the first is on the wire before the last gradient of the backward is ready
            assert launched[0]["grads_ready"] < record["num_params"]
        # the float64 sums are copied into the gradients' dtype (float32) once a reduction (the counter sees copies)
        numels = [sum(math.prod(s) for s in shapes) for shapes in record["bucket_shapes"]]
        assert record["grad_bytes"] == 4 * sum(numels)
        assert record["copied_bytes"] == 4 * sum(n * times for n, times in zip(numels, expected))
    # the counters the run logs
    counted = re.search(r"gradient buckets: (\d+), all-reduces per bucket \[([\d, ]+)\] over (\d+) synchronized steps", log)
    assert int(counted[1]) == num_buckets
    assert [int(n) for n in counted[2].split(",")] == expected
    assert int(counted[3]) == ITERATIONS


def test_adam_every_second_step_reduces_its_gradients_on_that_step_alone(recorded, tiny_shards, tmp_path):
    """ADAM_EVERY = 2 (the records from 2025-09-30): Adam steps on the odd steps, on two steps' summed gradients. On 2
    ranks x 2 micro-steps, Muon's buckets are reduced on every step and Adam's (the lm_head, the embeddings, the
    scalars; no bucket mixes the two) on the odd steps' last micro-step alone, once. Muon
    all-gathers its updates a round at a time, the same on every step. The run equals one process's."""
    one = launch(tmp_path / "one", [sys.executable], TRAIN_GPT, train_args(tmp_path / "one", 4, *tiny_shards, *RECORDED))
    two, out = recorded
    assert_runs_agree(one, two)
    padded = train_gpt.next_multiple(TINY_VOCAB, 128)
    args = train_gpt.parse_args([*TINY_RUN, *RECORDED], "cpu")[0]
    adam, muon = train_gpt.build_optimizers(train_gpt.build_model(args, 128), args)
    adam_shapes, muon_shapes = ({tuple(p.shape) for group in o.param_groups for p in group["params"]} for o in (adam, muon))
    assert not adam_shapes & muon_shapes  # a bucket's shapes tell whose it is
    for rank in (0, 1):
        [record] = json.loads((out / f"rank{rank}.json").read_text())
        is_adam = [all(tuple(s) in adam_shapes for s in shapes) for shapes in record["bucket_shapes"]]
        assert record["deferred"] == is_adam and any(is_adam) and not all(is_adam)
        assert all(is_adam[b] or not any(tuple(s) in adam_shapes for s in shapes)
                   for b, shapes in enumerate(record["bucket_shapes"]))  # no bucket mixes Adam's and Muon's
        # the embedding's own bucket: on Adam's step after the untie alone (tied, its gradient joins the lm_head's)
        untie = train_gpt.untie_step(train_gpt.parse_args([f"--num_iterations={ITERATIONS}", *TINY_FORMS], "cpu")[0])
        [embed] = [b for b, shapes in enumerate(record["bucket_shapes"]) if b and shapes == [[padded, 96]]]
        assert record["reductions"] == [1 if b == embed else ITERATIONS // 2 if adam else ITERATIONS
                                        for b, adam in enumerate(is_adam)]
        for step in range(ITERATIONS):
            launched = [e["bucket"] for e in record["events"] if e["step"] == step]
            due = [b for b, adam in enumerate(is_adam) if (b != embed or step > untie) and (step % 2 or not adam)]
            assert sorted(launched) == due, step  # each once (the order: the test above)
        assert all(e["last_micro_step"] for e in record["events"])
        # Muon's updates travel stacked: one all-gather a round, each rank's matrix in a slot of the round's largest size
        muon = record["muon"]
        muon_shapes = [s for shapes, adam in zip(record["bucket_shapes"], is_adam) if not adam for s in shapes]
        slots = [s for round_shapes in muon["rounds"] for s in round_shapes if s is not None]
        assert sorted(slots) == sorted(muon_shapes)  # every matrix in one slot
        assert [r[rank] for r in muon["rounds"] if r[rank] is not None] == muon["mine"]
        assert len(muon["rounds"]) < len(muon_shapes) and all(len(r) == 2 for r in muon["rounds"])
        sizes = [max(math.prod(s) for s in r if s is not None) for r in muon["rounds"]]
        assert len(muon["gathers"]) == ITERATIONS  # odd and even steps alike
        for gathers in muon["gathers"]:
            assert [(g["sent"], g["received"]) for g in gathers] == [(size, 2 * size) for size in sizes]
            assert {g["element_bytes"] for g in gathers} == {4}  # --dtype=float32: Muon's updates are float32


def test_buckets_copy_no_gradient_bytes(tiny_shards, tmp_path):
    """Without the float64 sums, gradients are views of their bucket's buffer: backward adds into it and
    the all-reduce averages it in place, so the hooks and the wait copy nothing, in a 2-process step
    with several buckets of several tensors; and every step's gradient is, to the bit, the float32
    sum those views make: each rank's two backward gradients added, then the two ranks' sums averaged. Adam's
    (deferred) gradients add up over two steps, each rank's own on the even ones, averaged on the odd; the tied pair,
    the lm_head and the embedding, is left to the runs above (the embedding's joins the lm_head's)."""
    out = tmp_path / "events"
    args = train_args(tmp_path, 4, *tiny_shards, "--bucket_mb=0.2", "--exact_grad_sum=false", iterations=4)
    launch(tmp_path, torchrun(2), HELPERS, args, mode="record", extra_env=dict(DIST_HELPERS_OUT=str(out)))
    for rank in (0, 1):
        [record] = json.loads((out / f"rank{rank}.json").read_text())
        assert sum(len(b) > 1 for b in record["bucket_shapes"]) >= 2 and record["steps"] == 4
        assert record["copied_bytes"] == 0
    grads = [torch.load(out / f"rank{rank}_grads.pt", weights_only=True) for rank in (0, 1)]
    shapes = [s for bucket in record["bucket_shapes"] for s in bucket]  # by parameter, in the order they are ready
    deferred = [adam for adam, bucket in zip(record["deferred"], record["bucket_shapes"]) for _ in bucket]
    tied = [i for i, s in enumerate(shapes) if s == shapes[0]]  # the lm_head, ready first, and the embedding
    assert len(tied) == 2 and any(deferred) and not all(deferred)
    orders_differ = False
    for step in range(4):
        for i in range(len(grads[0]["reduced"][step])):
            (a0, a1), (b0, b1) = (g["backward"][step][i] for g in grads)
            rank_sums = a0 + a1, b0 + b1  # float32 additions, in the order backward adds into the view
            if deferred[i]:
                if i in tied:
                    continue
                if step % 2 == 0:  # not reduced: each rank's own sum, which the next step adds to
                    assert all(torch.equal(g["reduced"][step][i], s) for g, s in zip(grads, rank_sums)), (step, i)
                    continue
                rank_sums = tuple((g["reduced"][step - 1][i] + x) + y for g, (x, y) in zip(
                    grads, ((a0, a1), (b0, b1))))
            # halving a float32 at least twice the smallest normal is exact: sum-then-halve and halve-then-sum agree
            assert not any(x.abs().lt(2 * torch.finfo(x.dtype).tiny).logical_and(x != 0).any() for x in rank_sums)
            expected = (rank_sums[0] + rank_sums[1]) / 2
            for g in grads:
                assert torch.equal(g["reduced"][step][i], expected), (step, i)
            # one process adds the four in turn: the data can tell that order from the ranks' one, so
            # the equal runs with exact_grad_sum above owe their equality to the float64 sums
            orders_differ |= not torch.equal(expected, (((a0 + a1) + b0) + b1) / 2)
    assert orders_differ


def test_a_two_process_checkpoint_resumes_in_one_process_to_the_same_bits(one_process, two_processes, tiny_shards,
                                                                          tmp_path):
    """Muon's ranks keep only their own matrices' momentum; a checkpoint gathers it all, so two processes
    saved at step 4 and one process resuming there end exactly as one process all along."""
    assert "distributed: world size 2, backend gloo" in two_processes.log
    halfway = two_processes.checkpoint.with_name("step_000004.pt")
    momentum = torch.load(halfway, map_location="cpu", weights_only=True)["optimizers"][1]["state"]
    muon_params = [n for n, p in one_process.params().items() if p.ndim >= 2 and n.startswith("blocks.") and "gate" not in n]
    assert len(momentum) == len(muon_params)
    resumed = launch(tmp_path / "one", [sys.executable], TRAIN_GPT,
                     train_args(tmp_path / "one", 2, *tiny_shards, f"--resume={halfway}"))
    pa, pb = one_process.params(), resumed.params()
    assert all(torch.equal(pa[k], pb[k]) for k in pa)
    assert {s: v for s, v in one_process.val_losses().items() if s >= 4} == resumed.val_losses()


def test_each_ranks_fp8_activation_scales_resume_with_it(tiny_shards, tmp_path):
    """With FP8 MLPs (the lm_head's left out: dist_helpers) each rank scales its activations by the amax of its own
    last forward (as HEAD's ranks do), so the ranks' scales differ; a checkpoint holds each rank's, and two processes
    resumed at step 18, after the delayed scaling took over from the bootstrap, end exactly as the run that went on."""
    def run(name, *extra):
        args = train_args(tmp_path / name, 4, *tiny_shards, *extra, iterations=20, val_every=5)
        return launch(tmp_path / name, torchrun(2), HELPERS, args, mode="fp8")

    whole = run("whole", "--checkpoint_every=18")
    assert "fp8 lm_head and MLPs: on (faked on CPU)" in whole.log
    halfway = tmp_path / "whole" / "ckpt" / "run" / "step_000018.pt"
    state = torch.load(halfway, map_location="cpu", weights_only=True)
    scales = state["activation_scales"]
    assert scales.shape == (2, 4) and not torch.equal(scales[0], scales[1]) and (scales != 1).all()
    assert torch.equal(scales[0], torch.stack([state["model"][f"blocks.{i}.mlp.act_scale"] for i in range(4)]))
    resumed = run("resumed", f"--resume={halfway}")
    pa, pb = whole.params(), resumed.params()
    assert pa.keys() == pb.keys() and all(torch.equal(pa[k], pb[k]) for k in pa)
    assert {s: v for s, v in whole.val_losses().items() if s > 18} == resumed.val_losses()


def test_a_failing_rank_brings_the_job_down(tiny_shards, tmp_path):
    """Rank 1 raises instead of its 3rd gradient all-reduce while rank 0 waits in it: torchrun must stop both."""
    run = launch(tmp_path, torchrun(2), HELPERS, train_args(tmp_path, 2, *tiny_shards), mode="fail", check=False)
    assert run.returncode != 0
    assert "RuntimeError: injected failure on rank 1" in run.output
    assert run.seconds < 90, f"took {run.seconds:.0f}s"  # the process group's own timeout is 10 minutes


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_nodes_train_like_one_process(one_process, tiny_shards, tmp_path):
    """Two torchrun invocations, one process each, meeting through c10d rendezvous on 127.0.0.1."""
    port, rdzv_id = free_port(), uuid.uuid4().hex
    args = train_args(tmp_path, 2, *tiny_shards)
    t0 = time.perf_counter()
    nodes = [start([*TORCHRUN, "--nnodes=2", "--nproc_per_node=1", f"--node_rank={node}", "--rdzv-backend=c10d",
                    f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id={rdzv_id}", TRAIN_GPT, *args], tmp_path)
             for node in (0, 1)]
    try:
        results = [finish(node, LAUNCH_TIMEOUT) for node in nodes]
    finally:
        for node in nodes:  # the other node, when one timed out
            if node.poll() is None:
                os.killpg(node.pid, signal.SIGKILL)
                node.communicate()
    for code, out in results:
        assert code == 0, out[-4000:]
    run = Run(0, "".join(out for _, out in results), time.perf_counter() - t0, tmp_path / "logs",
              tmp_path / "ckpt" / "run" / f"step_{ITERATIONS:06d}.pt")
    assert "distributed: world size 2, backend gloo, " in run.log  # one log: the node that got rank 0
    assert_runs_agree(one_process, run)


def order_sensitive_gradients(seed: int = 0):
    """Three parameters in two dtypes (so two buckets) and, per micro-step, a coefficient tensor whose
    magnitudes span 2^-20..2^20: loss = sum(p * c) makes c the gradient, and float32 sums of such
    numbers depend on their order."""
    g = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.zeros(n, dtype=dtype)) for n, dtype in
              ((1000, torch.float32), (300, torch.float32), (500, torch.bfloat16))]
    coeffs = [[(torch.randn(p.numel(), generator=g) * 2.0 ** torch.randint(-20, 21, (p.numel(),), generator=g))
               .to(p.dtype) for p in params] for _ in range(6)]
    return params, coeffs


def accumulate(params, coeffs, order, buckets=None) -> list[torch.Tensor]:
    for i, k in enumerate(order):
        if buckets is not None:
            buckets.last_micro_step = i == len(order) - 1
        sum((p * c).sum().float() for p, c in zip(params, coeffs[k])).backward()
    if buckets is not None:
        buckets.wait_for_gradients()
    grads = [p.grad.clone() for p in params]
    for p in params:
        p.grad = None
    return grads


def test_float64_gradient_sum_is_exact_and_independent_of_the_order():
    """exact_grad_sum in one process: GradientBuckets with sum_dtype=float64 and world size 1 must give
    the float64 sum of the micro-step gradients, rounded once, whatever the order of the micro-steps,
    where autograd's own float32/bfloat16 accumulation gives different bits in another order."""
    params, coeffs = order_sensitive_gradients()
    native = [accumulate(params, coeffs, order) for order in ([0, 1, 2, 3, 4, 5], [5, 3, 1, 0, 4, 2])]
    assert any(not torch.equal(a, b) for a, b in zip(*native))  # the data can tell orders apart
    buckets = train_gpt.GradientBuckets(list(reversed(params)), bucket_bytes=10**9, world_size=1,
                                        sum_dtype=torch.float64)
    assert len(buckets.buckets) == 2  # the bfloat16 parameter is a bucket of its own
    reference = [sum(coeffs[k][i].double() for k in range(6)).to(p.dtype) for i, p in enumerate(params)]
    for step, order in enumerate(([0, 1, 2, 3, 4, 5], [5, 3, 1, 0, 4, 2], [2, 4, 0, 5, 1, 3])):
        grads = accumulate(params, coeffs, order, buckets)
        for grad, ref, p in zip(grads, reference, params):
            assert grad.dtype == p.dtype
            assert torch.equal(grad, ref), f"step {step}: {(grad.double() - ref.double()).abs().max():.3e}"
    assert buckets.steps == 3 and buckets.reductions == [0, 0]  # world size 1: nothing on the wire


@pytest.mark.parametrize("sum_dtype", [None, torch.float64])
def test_a_folded_gradient_joins_its_targets_once_before_the_reduction(sum_dtype):
    """The tie of the records from 2026-01-18: a source (the embedding: idle, deferred, a bucket of its own) whose
    gradient, summed over two steps of three micro-steps, joins its target's (the lm_head's), summed likewise, on the
    last micro-step of the step that reduces them, in the target's dtype (lm_head.grad += embed.grad), then starts again
    from zero; on the other step nothing moves. The data tell this from summing both in each backward (the tie of
    the records before). With sum_dtype=float64, both sums exact and rounded once."""
    g = torch.Generator().manual_seed(0)
    target, source = (torch.nn.Parameter(torch.zeros(500, dtype=torch.bfloat16)) for _ in range(2))
    other = torch.nn.Parameter(torch.zeros(300))
    coeffs = [[(torch.randn(p.numel(), generator=g) * 2.0 ** torch.randint(-8, 9, (p.numel(),), generator=g)).to(p.dtype)
               for p in (target, source, other)] for _ in range(6)]
    buckets = train_gpt.GradientBuckets([target, other, source], 10**9, 1, sum_dtype, deferred=[target, source],
                                        alone=[source])
    buckets.idle, buckets.fold = {source}, (source, target)
    for step in range(2):
        buckets.reduce_deferred = step == 1
        for i in range(3):
            buckets.last_micro_step = i == 2
            sum((p * c).sum().float() for p, c in zip((target, source, other), coeffs[3 * step + i])).backward()
        buckets.wait_for_gradients()
        if step == 0:
            assert source.grad is None if sum_dtype else source.grad.any()
            unfolded = target.grad.clone() if sum_dtype is None else None
            buckets.zero_grad()
    if sum_dtype is None:
        summed = [coeffs[0][j] for j in range(2)]
        for k in range(1, 6):
            summed = [summed[j] + coeffs[k][j] for j in range(2)]  # autograd's accumulation, rounded each time
        expected = summed[0] + summed[1]
        assert torch.equal(unfolded, functools.reduce(torch.add, (coeffs[k][0] for k in range(3))))
        assert not source.grad.any()
        per_backward = functools.reduce(torch.add, (coeffs[k][0] + coeffs[k][1] for k in range(6)))
        assert not torch.equal(per_backward, expected)
    else:
        expected = sum(coeffs[k][j].double() for k in range(6) for j in range(2)).to(torch.bfloat16)
        assert source.grad is None
    assert torch.equal(target.grad, expected)
    assert torch.equal(other.grad, coeffs[3][2] + coeffs[4][2] + coeffs[5][2] if sum_dtype is None else
                       sum(coeffs[k][2].double() for k in (3, 4, 5)).float())


def test_a_parameter_without_gradient_is_reported():
    params, coeffs = order_sensitive_gradients()
    buckets = train_gpt.GradientBuckets(list(reversed(params)), bucket_bytes=10**9, world_size=1,
                                        sum_dtype=torch.float64)
    sum((p * c).sum().float() for p, c in zip(params[:2], coeffs[0][:2])).backward()  # params[2] unused
    with pytest.raises(RuntimeError, match=r"gradient bucket 0 was not reduced: 1 of its 1 parameters got no gradient"):
        buckets.wait_for_gradients()


def test_a_gradient_taken_out_of_its_bucket_is_reported():
    """Gradients are views of their bucket's buffer; one set to None and made again by autograd would
    go unreduced, so the hook refuses it, naming the remedy."""
    params, coeffs = order_sensitive_gradients()
    buckets = train_gpt.GradientBuckets(list(reversed(params)), bucket_bytes=10**9, world_size=1)
    sum((p * c).sum().float() for p, c in zip(params, coeffs[0])).backward()
    buckets.wait_for_gradients()
    assert torch.equal(params[0].grad, coeffs[0][0])  # the view holds the gradient
    buckets.zero_grad()
    assert not params[0].grad.any()
    params[1].grad = None
    with pytest.raises(RuntimeError, match=r"left its bucket's buffer \(was .grad set to None\?\)"):
        sum((p * c).sum().float() for p, c in zip(params, coeffs[1])).backward()


def test_a_second_backward_on_the_last_micro_step_is_reported():
    params, coeffs = order_sensitive_gradients()
    buckets = train_gpt.GradientBuckets(list(reversed(params)), bucket_bytes=10**9, world_size=1)
    sum((p * c).sum().float() for p, c in zip(params, coeffs[0])).backward()
    with pytest.raises(RuntimeError, match=r"gradient bucket 0 got more gradients than it has parameters in one step"):
        sum((p * c).sum().float() for p, c in zip(params, coeffs[0])).backward()


@pytest.mark.parametrize("world_size, batch_slots", [(3, 8), (16, 8), (3, 2), (4, 2)])
def test_a_world_size_that_does_not_divide_the_batch_is_refused(world_size, batch_slots):
    args, _ = train_gpt.parse_args([*TINY_RUN, f"--batch_slots={batch_slots}", "--val_tokens=49152"], "cpu")
    with pytest.raises(train_gpt.ConfigError, match=rf"world size {world_size} must divide batch_slots={batch_slots}; use "):
        train_gpt.check_hyperparameters(args, world_size)


@pytest.mark.parametrize("world_size", [1, 2, 4, 8])
def test_the_divisors_of_the_batch_are_accepted(world_size):
    args, _ = train_gpt.parse_args([*TINY_RUN, "--batch_slots=8", "--val_tokens=1024"], "cpu")
    train_gpt.check_hyperparameters(args, world_size)


def test_allreduce_benchmark_prints_both_modes(tmp_path):
    """tools/bench_allreduce.py at its smallest: it launches itself through torchrun and prints a row per mode."""
    code, out = finish(start([sys.executable, ROOT / "tools" / "bench_allreduce.py", "--num_layers=4", "--model_dim=64",
                              "--num_heads=2", "--head_dim=32", "--seq_len=128", "--steps=1", "--warmup=0",
                              "--bucket_mb=0.1"], tmp_path), LAUNCH_TIMEOUT)
    assert code == 0, out[-4000:]
    assert re.search(r"^one all-reduce after backward +\d+\.\d +1\.00x$", out, re.MULTILINE), out
    assert re.search(r"^bucketed hooks \(GradientBuckets\) +\d+\.\d +\d+\.\d\dx$", out, re.MULTILINE), out
    assert re.search(r"^model: [\d,]+ parameters .*; (\d+) gradient buckets of ", out, re.MULTILINE), out
