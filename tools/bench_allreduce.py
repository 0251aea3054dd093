"""Step time with train_gpt.GradientBuckets (all-reduce launched from the gradient hooks, overlapping
backward) versus one all-reduce after backward, on CPU processes with gloo: the overlap measured.

    python tools/bench_allreduce.py                                   # 2 processes, through torchrun
    python tools/bench_allreduce.py --model_dim=384 --num_layers=6 --steps=20 --bucket_mb=5

Each step is forward + backward of train_gpt's GPT on random tokens (no optimizer step), timed from a
barrier to the moment every rank holds the averaged gradients (the slowest rank counts). Modes run
interleaved, one step each per round, so drift in the machine's load hits them alike:
  no communication                 backward only: the floor
  one all-reduce after backward    after backward, every gradient of a dtype is copied into one flat
                                   buffer, all-reduced (average) at once, and copied back; the same
                                   copies the buckets make, with nothing overlapped
  bucketed hooks (GradientBuckets) train_gpt's buckets: each launched asynchronously as soon as its
                                   last gradient is ready, all waited for after backward
"""

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MODES = ("no communication", "one all-reduce after backward", "bucketed hooks (GradientBuckets)")
BASELINE = MODES[1]


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc", type=int, default=2, help="processes (torchrun --nproc_per_node)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per process")
    p.add_argument("--num_layers", type=int, default=4)
    p.add_argument("--model_dim", type=int, default=256)
    p.add_argument("--num_heads", type=int, default=2)
    p.add_argument("--head_dim", type=int, default=128)
    p.add_argument("--vocab_size", type=int, default=50257)
    p.add_argument("--seq_len", type=int, default=512, help="tokens per micro-step (a multiple of 128)")
    p.add_argument("--micro_steps", type=int, default=1, help="backward passes per step; only the last communicates")
    p.add_argument("--bucket_mb", type=float, default=25.0)
    p.add_argument("--steps", type=int, default=10, help="timed steps per mode")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per mode first")
    return p.parse_args(argv)


def launch(argv, args):
    """Not under torchrun: start args.nproc copies of this script through it."""
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}",
           str(Path(__file__).resolve()), *argv]
    return subprocess.run(cmd, env=env).returncode


def bench(args):
    import torch
    import torch.distributed as dist

    import train_gpt

    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    window = max(1, args.seq_len // train_gpt.BLOCK_SIZE)  # the whole sequence, in blocks
    torch.manual_seed(0)
    model = train_gpt.GPT(train_gpt.GPTConfig(args.vocab_size, args.num_layers, args.num_heads, args.head_dim,
                                              args.model_dim, args.seq_len, windows=(window,),
                                              backout_layer=train_gpt.attention_free_layer(args.num_layers)))
    for p in model.parameters():
        dist.broadcast(p.detach(), 0)
    params = list(model.parameters())
    buckets = train_gpt.GradientBuckets(list(reversed(params)), int(args.bucket_mb * 1e6), world_size)
    by_dtype = {}
    for p in params:
        by_dtype.setdefault(p.dtype, []).append(p)
    flat = {dtype: torch.empty(sum(p.numel() for p in ps), dtype=dtype) for dtype, ps in by_dtype.items()}

    g = torch.Generator().manual_seed(1 + rank)
    tokens = torch.randint(0, args.vocab_size, (args.micro_steps, args.seq_len + 1), generator=g)
    tokens[:, 0] = train_gpt.EOT_TOKEN

    def one_all_reduce_after_backward():
        for dtype, ps in by_dtype.items():
            torch.cat([p.grad.view(-1) for p in ps], out=flat[dtype])
            dist.all_reduce(flat[dtype], op=dist.ReduceOp.AVG)
            offset = 0
            for p in ps:
                p.grad.view(-1).copy_(flat[dtype][offset:offset + p.numel()])
                offset += p.numel()

    def step(mode) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        for i in range(args.micro_steps):
            buckets.last_micro_step = mode == MODES[2] and i == args.micro_steps - 1
            model(tokens[i, :-1].int(), tokens[i, 1:], window).backward()
        if mode == MODES[1]:
            one_all_reduce_after_backward()
        elif mode == MODES[2]:
            buckets.wait_for_gradients()
        elapsed = torch.tensor(time.perf_counter() - t0, dtype=torch.float64)
        buckets.zero_grad()  # the gradients are views of the buckets' buffers: zeroed there, not dropped
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slowest rank sets the step time
        return 1000 * float(elapsed)

    times = {mode: [] for mode in MODES}
    for round_ in range(args.warmup + args.steps):
        for mode in MODES:
            ms = step(mode)
            if round_ >= args.warmup:
                times[mode].append(ms)

    if rank == 0:
        sizes = [round(b / 1e6, 2) for b in buckets.bucket_bytes()]
        grad_mb = sum(p.numel() * p.element_size() for p in params) / 1e6
        print(f"model: {sum(p.numel() for p in params):,} parameters ({grad_mb:.1f} MB of gradients); "
              f"{len(buckets.buckets)} gradient buckets of {sizes} MB (bucket_mb {args.bucket_mb})")
        print(f"world size {world_size} (gloo, CPU), {args.threads} thread(s) per process, {args.micro_steps} "
              f"micro-step(s) of {args.seq_len} tokens per step; median of {args.steps} steps after {args.warmup} warm-up")
        median = {mode: statistics.median(t) for mode, t in times.items()}
        print(f"{'mode':<34} {'median step ms':>15} {'speedup vs after-backward':>26}")
        for mode in MODES:
            print(f"{mode:<34} {median[mode]:>15.1f} {median[BASELINE] / median[mode]:>25.2f}x")
        comm = median[MODES[1]] - median[MODES[0]]
        if comm > 0:
            hidden = (median[MODES[1]] - median[MODES[2]]) / comm
            print(f"communication after backward costs {comm:.1f} ms a step; the hooks hide {100 * hidden:.0f}% of it")
    dist.destroy_process_group()


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    args = parse(argv)
    if "RANK" not in os.environ:
        sys.exit(launch(argv, args))
    bench(args)


if __name__ == "__main__":
    main()
