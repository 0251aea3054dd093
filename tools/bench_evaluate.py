"""How fast tools/evaluate.py scores on this machine: requests/s and tokens/s of HellaSwag-shaped requests (a
context and four endings, each a request of its own), for the cpu preset's model and the record's 124M-shaped
one, randomly initialized, in three ways: packed into --batch_tokens sequences with the lm_head at the scored
positions (the tool's way), one request a forward, and packed with the lm_head at every position.

    python tools/bench_evaluate.py [--contexts=25] [--batch_tokens=N] [--dtype=auto] [--presets=cpu,record]
"""

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))

import torch

import evaluate
import sample
import train_gpt


def hellaswag_shaped(contexts: int, vocab_size: int, seed: int = 0) -> list[tuple[list[int], int]]:
    """Each context of 30 to 90 tokens after an EOT, with four endings of 8 to 30 tokens: HellaSwag's lengths."""
    g = torch.Generator().manual_seed(seed)

    def draw(low, high):
        return torch.randint(0, vocab_size - 1, (int(torch.randint(low, high, (1,), generator=g)),), generator=g).tolist()

    requests = []
    for _ in range(contexts):
        context = [train_gpt.EOT_TOKEN, *draw(30, 90)]
        requests += [(context + ending, len(ending)) for ending in (draw(8, 30) for _ in range(4))]
    return requests


def timed(fn, repeats: int = 3) -> float:
    """The fastest of a few runs: the others lost time to what else ran on the machine."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def bench(preset: str, contexts: int, batch_tokens: int, dtype: str, device: torch.device, compile: bool) -> list[str]:
    args = train_gpt.parse_args([f"--preset={preset}"], preset)[0]
    model = sample.in_dtype(train_gpt.build_model(args, batch_tokens), train_gpt.DTYPES[dtype]).to(device).eval()
    if compile:
        sample.compile_for_generation(model)
    window, long_window = args.final_window, args.final_long_window or None
    requests = hellaswag_shaped(contexts, args.vocab_size)
    tokens = sum(len(t) - 1 for t, _ in requests)
    ways = {
        "packed, lm_head at scored positions": lambda: evaluate.score(model, window, long_window, requests, batch_tokens),
        "one request a forward": lambda: [evaluate.score(model, window, long_window, [r], batch_tokens) for r in requests],
        "packed, lm_head at every position": lambda: evaluate.score(model, window, long_window, requests, batch_tokens,
                                                                     every_position=True),
    }
    for fn in ways.values():  # first-call costs (compilation) off the clock
        fn()
    lines = [f"{preset} preset: {args.num_layers} layers x {args.model_dim}, {dtype}{', compiled' if compile else ''} on {device}, window "
             f"{window * args.window_unit} tokens; {len(requests)} requests, {tokens:,} positions, "
             f"{batch_tokens} a packed forward"]
    for name, fn in ways.items():
        seconds = timed(fn)
        lines.append(f"  {name:<38} {len(requests) / seconds:8.1f} requests/s {tokens / seconds:10,.0f} tokens/s")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--contexts", type=int, default=25, help="HellaSwag-shaped examples (4 requests each)")
    parser.add_argument("--batch_tokens", type=int, default=None, help="default: evaluate.py's")
    parser.add_argument("--dtype", choices=["auto", *train_gpt.DTYPES], default="auto")
    parser.add_argument("--presets", default="cpu,record")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--compile", default=None, choices=["true", "false"], help="default: on CUDA, as evaluate.py")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    batch_tokens = args.batch_tokens or evaluate.default_batch_tokens(device, evaluate.DEFAULT_MAX_LENGTH)
    dtype = train_gpt.auto_dtype(device)[0] if args.dtype == "auto" else args.dtype
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    with torch.no_grad():
        for preset in args.presets.split(","):
            compile = args.compile == "true" if args.compile else device.type == "cuda"
            print("\n".join(bench(preset, args.contexts, batch_tokens, dtype, device, compile)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
