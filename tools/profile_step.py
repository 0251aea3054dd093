"""Where a training step's time goes: the top operations of real training steps by self time.

    python tools/profile_step.py                              # the cpu preset (record with CUDA)
    python tools/profile_step.py --top=40 --steps=3 --model_dim=256

Options other than --top (rows to print, default 25) and --steps (profiled steps, default 2) are
train_gpt.py's --key=value overrides. The steps run through train_gpt's own Trainer, on random tokens
(the same work as real ones), after one unprofiled step that warms caches (and compiles, if on).
A compiled model (the cpu preset's) shows each compiled graph as one row; --compile=false lists the
operations inside them.
"""

import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

import run_support  # noqa: E402
import train_gpt  # noqa: E402


def main(argv=None) -> str:
    argv = sys.argv[1:] if argv is None else argv
    own, rest = run_support.split_tool_options(argv, dict(top=25, steps=2))
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    args, preset = train_gpt.parse_args(rest, "record" if device.type == "cuda" else "cpu")
    train_gpt.check_hyperparameters(args, 1)
    train_gpt.settle_vector_math()  # as train_gpt.main() does, so the model is the one a run builds
    plan = train_gpt.plan_device(args, device)
    trainer = train_gpt.Trainer(args, 0, 1, plan)
    g = torch.Generator().manual_seed(0)

    def batch():
        tokens = torch.randint(0, args.vocab_size, (trainer.grad_accum_steps, args.seq_len[0] + 1), generator=g)
        return [(t[:-1].to(device, torch.int32), t[1:].to(device)) for t in tokens]

    trainer.train_step(0, batch())
    trainer.synchronize()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        for step in range(1, 1 + own["steps"]):
            trainer.train_step(step, batch())
        trainer.synchronize()
        step_ms = 1000 * (time.perf_counter() - t0) / own["steps"]
    sort_by = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    report = "\n".join([
        f"preset {preset}: {args.num_layers} layers x {args.model_dim}, {args.batch_slots} x {args.seq_len[0]} tokens a step (the first stage's), "
        f"dtype {plan.dtype}, compile {plan.compile}; {device.type}, {torch.get_num_threads()} threads",
        f"{own['steps']} profiled steps, {step_ms:.0f} ms a step (under the profiler); top {own['top']} operations by self time:",
        prof.key_averages().table(sort_by=sort_by, row_limit=own["top"]),
        *(line for line in (run_support.cpu_memory_lines(plan.dtype) if device.type == "cpu" else [])
          if line.startswith(("glibc malloc tuning: off", "huge pages: off"))),  # ./run.sh's settings, when missing
    ])
    print(report)
    return report


if __name__ == "__main__":
    try:
        main()
    except train_gpt.ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
