"""Time per generated token with the KV cache against re-running the whole prefix for every token.

    python tools/bench_sample.py                         # the cpu preset's model (random weights)
    python tools/bench_sample.py CHECKPOINT --tokens 500
    python tools/bench_sample.py --compile               # every way through torch.compile

Each way generates the same number of tokens greedily from <|endoftext|> (continuing past any
<|endoftext|> it produces). Re-running the prefix is timed twice: with the lm_head on the last
position only (generate(use_cache=False), the cheapest way without a cache) and as the training
forward computes it, with logits at every position. Each way runs once untimed first (first-call
allocations; with --compile, the whole run, so that every graph it needs is compiled).
"""

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch

import sample
import train_gpt


def preset_model(preset: str, device: torch.device, dtype: str | None) -> tuple[train_gpt.GPT, int, int | None]:
    """A model of the preset's shape at its end-of-training windows (its rotary as training leaves it: rescaled
    at each window change when the preset's yarn is on; the long layers' final_long_window), with random weights everywhere (the zero-initialized output layers
    too, so the greedy tokens vary)."""
    args = train_gpt.Hyperparameters(**train_gpt.PRESETS[preset])
    torch.manual_seed(0)
    model = train_gpt.build_model(args, max(args.seq_len, args.val_seq_len))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.c_proj") or name == "lm_head.weight":
                p.normal_(0, 0.5 * p.size(1) ** -0.5)
            elif name.endswith("vo_w"):
                p[1].normal_(0, 0.5 * p.size(-1) ** -0.5)
    window = train_gpt.replay_windows(model, args.num_iterations, args)
    trained_in = train_gpt.auto_dtype(device)[0] if args.dtype == "auto" else args.dtype
    model = sample.in_dtype(model, train_gpt.DTYPES[dtype or trained_in])
    return sample.generation_layout(model.to(device).eval()), window, train_gpt.long_window_at(args.num_iterations, args)


@torch.no_grad()
def every_position_generation(model: train_gpt.GPT, window: int, long_window: int | None, tokens: int):
    """Greedy generation through the training forward's computation: logits at every position."""
    sequence = torch.tensor([train_gpt.EOT_TOKEN], device=model.embed.weight.device)
    for _ in range(tokens):
        x = model.trunk(sample.pad_to_blocks(sequence), window, long_window=long_window)
        logits = model.softcapped_logits(x[0])[sequence.numel() - 1, :model.vocab_size]
        token = int(logits.argmax())
        yield token
        sequence = torch.cat([sequence, sequence.new_tensor([token])])


def timed(generation, tokens: int) -> tuple[float, list[int]]:
    """Seconds per token, and the tokens."""
    t0 = time.perf_counter()
    generated = list(generation)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / tokens, generated


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", nargs="?", help="a train_gpt.py checkpoint (default: the cpu preset's shape)")
    parser.add_argument("--tokens", type=int, default=500)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=list(train_gpt.DTYPES), help="activations; default as tools/sample.py: "
                        "the model's own on CUDA, float32 on CPU")
    parser.add_argument("--compile", action="store_true", help="torch.compile the trunk and the logits "
                        "(tools/sample.py --compile), for every way")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    dtype = args.dtype or (None if device.type == "cuda" else "float32")
    if args.checkpoint:
        try:
            model, window, long_window = sample.load_model(args.checkpoint, device, args.tokens + 1, dtype)
        except train_gpt.ConfigError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        source = args.checkpoint
    else:
        model, window, long_window = preset_model("cpu", device, dtype)
        source = "the cpu preset's model, random weights"
    if args.compile:
        sample.compile_for_generation(model)
    threads = f", {torch.get_num_threads()} threads" if device.type == "cpu" else ""
    print(f"{source}: {sum(p.numel() for p in model.parameters()):,} parameters, {model.embed.weight.dtype} "
          f"embeddings, long window {window} blocks, on {device}{threads}{', compiled' if args.compile else ''}; "
          f"{args.tokens} tokens from <|endoftext|>")
    prompt = [train_gpt.EOT_TOKEN]
    ways = [("KV cache, one position per token",
             lambda n: sample.generate(model, prompt, n, window, temperature=0, long_window=long_window)),
            ("whole prefix, lm_head on the last position",
             lambda n: sample.generate(model, prompt, n, window, temperature=0, use_cache=False, long_window=long_window)),
            ("whole prefix, logits at every position", lambda n: every_position_generation(model, window, long_window, n))]
    cached = cached_tokens = None
    for name, generation in ways:
        warm_up = args.tokens if args.compile else 8
        t0 = time.perf_counter()
        timed(generation(warm_up), warm_up)
        untimed = f" (untimed first run: {time.perf_counter() - t0:.1f} s)" if args.compile else ""
        seconds, tokens = timed(generation(args.tokens), args.tokens)
        if cached is None:
            cached, cached_tokens = seconds, tokens
            print(f"  {name + ':':44s} {1000 * seconds:8.2f} ms per token{untimed}", flush=True)
            continue
        same = next((i for i, (a, b) in enumerate(zip(cached_tokens, tokens)) if a != b), args.tokens)
        print(f"  {name + ':':44s} {1000 * seconds:8.2f} ms per token: the cache is {seconds / cached:.1f}x faster "
              f"(same first {same} tokens){untimed}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
