"""Time per generated token with the KV cache against re-running the whole prefix for every token.

    python tools/bench_sample.py                         # the cpu preset's model (random weights)
    python tools/bench_sample.py CHECKPOINT --tokens 500

Both generate the same number of tokens greedily from <|endoftext|> (continuing past any
<|endoftext|> they produce), so they do the same work per position apart from the cache.
"""

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch

import sample
import train_gpt


def preset_model(preset: str, device: torch.device, dtype: str | None) -> tuple[train_gpt.GPT, int]:
    """A model of the preset's shape at its end-of-training window, with random weights everywhere
    (the zero-initialized output layers too, so the greedy tokens vary)."""
    args = train_gpt.Hyperparameters(**train_gpt.PRESETS[preset])
    torch.manual_seed(0)
    model = train_gpt.GPT(args.vocab_size, args.num_layers, args.num_heads, args.head_dim, args.model_dim,
                          max(args.seq_len, args.val_seq_len))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("c_proj.weight") or name == "lm_head.weight":
                p.normal_(0, 0.5 * p.size(1) ** -0.5)
    for table in [model.embed, *model.value_embeds]:
        table.to(train_gpt.DTYPES[dtype or args.dtype])
    return model.to(device).eval(), train_gpt.window_blocks(args.num_iterations, args)


def timed_generation(model: train_gpt.GPT, window: int, tokens: int, use_cache: bool) -> tuple[float, list[int]]:
    device = model.embed.weight.device
    t0 = time.perf_counter()
    generated = list(sample.generate(model, [train_gpt.EOT_TOKEN], tokens, window, temperature=0, use_cache=use_cache))
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / tokens, generated


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", nargs="?", help="a train_gpt.py checkpoint (default: the cpu preset's shape)")
    parser.add_argument("--tokens", type=int, default=500)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=list(train_gpt.DTYPES), help="activations; default as tools/sample.py: "
                        "the model's own on CUDA, float32 on CPU")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    dtype = args.dtype or (None if device.type == "cuda" else "float32")
    if args.checkpoint:
        try:
            model, window = sample.load_model(args.checkpoint, device, args.tokens + 1, dtype)
        except sample.CheckpointError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        source = args.checkpoint
    else:
        model, window = preset_model("cpu", device, dtype)
        source = "the cpu preset's model, random weights"
    threads = f", {torch.get_num_threads()} threads" if device.type == "cpu" else ""
    print(f"{source}: {sum(p.numel() for p in model.parameters()):,} parameters, {model.embed.weight.dtype} "
          f"embeddings, long window {window} blocks, on {device}{threads}; {args.tokens} tokens from <|endoftext|>")
    timed_generation(model, window, 8, use_cache=True)  # warm-up: first-call allocations and kernel choices
    cached, cached_tokens = timed_generation(model, window, args.tokens, use_cache=True)
    print(f"  KV cache:                {1000 * cached:8.2f} ms per token", flush=True)
    full, full_tokens = timed_generation(model, window, args.tokens, use_cache=False)
    print(f"  whole prefix every token: {1000 * full:8.2f} ms per token")
    same = next((i for i, (a, b) in enumerate(zip(cached_tokens, full_tokens)) if a != b), args.tokens)
    print(f"  the cache is {full / cached:.1f}x faster per token; the two agree on the first {same} of "
          f"{args.tokens} tokens")
    return 0


if __name__ == "__main__":
    sys.exit(main())
