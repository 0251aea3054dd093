"""Generate text from a checkpoint written by train_gpt.py, streaming it as it comes.

    python tools/sample.py checkpoints/<run_id>/step_000100.pt --prompt "ROMEO:" --max_new_tokens 200
    python tools/sample.py CHECKPOINT --num_samples 3 --temperature 0.8 --top_k 50 --seed 1

The checkpoint alone describes the model (its hyperparameters are stored in it); the prompt starts a
new document, as every training document does, so <|endoftext|> goes before it. Generation stops
at <|endoftext|> or after --max_new_tokens. A KV cache (here, fed by the model's cache hook) makes each new token one position's forward.
"""

import time

STARTED = time.perf_counter()  # the whole run is reported, imports and loading included

import codecs
import dataclasses
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "data"))

import torch

import run_support
import train_gpt
from gpt2_tokenizer import ENDOFTEXT, TokenizerError, get_gpt2_encoding

EOT = train_gpt.EOT_TOKEN
PAD_TOKEN = 0  # fills a partial last block; no earlier position attends to it


def pad_to_blocks(tokens: torch.Tensor) -> torch.Tensor:
    padding = train_gpt.next_multiple(tokens.numel(), train_gpt.BLOCK_SIZE) - tokens.numel()
    return torch.nn.functional.pad(tokens, (0, padding), value=PAD_TOKEN)


class LayerCache:
    """One attention layer's rotated keys and mixed values (1, H, positions, D) for generation, in
    buffers that double when full (or are made for reserve positions at once), so adding a token
    copies one position, not the whole history. The attention layer appends to it (its cache hook),
    and with the key offset keeps the last position's key from before the offset in last_key."""

    def __init__(self, reserve: int = 0):
        self.keys = self.values = self.last_key = None
        self.length, self.reserve = 0, reserve

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Adds k, v (1, H, T, D) after the cached positions; returns every position's keys and values."""
        end = self.length + k.size(2)
        if self.keys is None or end > self.keys.size(2):
            capacity = max(end, 2 * self.length, train_gpt.BLOCK_SIZE, self.reserve)
            grown = [t.new_empty(*t.shape[:2], capacity, t.size(3)) for t in (k, v)]
            if self.keys is not None:
                grown[0][:, :, :self.length] = self.keys[:, :, :self.length]
                grown[1][:, :, :self.length] = self.values[:, :, :self.length]
            self.keys, self.values = grown
        self.keys[:, :, self.length:end] = k
        self.values[:, :, self.length:end] = v
        self.length = end
        return self.keys[:, :, :end], self.values[:, :, :end]


class KVCache:
    """What next_token_logits() needs to run only new positions: the tokens so far (their documents
    decide the masks) and each layer's keys and values (the attention-free layer's stay empty). Batch
    size 1, like training. reserve: the positions expected, to hold from the start (a compiled step
    then sees one buffer size)."""

    def __init__(self, num_layers: int, reserve: int = 0):
        self.tokens: torch.Tensor | None = None
        self.layers = [LayerCache(reserve) for _ in range(num_layers)]

    def __len__(self) -> int:
        return 0 if self.tokens is None else self.tokens.numel()


def next_token_logits(model: train_gpt.GPT, tokens: torch.Tensor, window: int, cache: KVCache | None = None,
                      long_window: int | None = None) -> torch.Tensor:
    """The logits (padded vocab,) of the token that follows tokens (T,), with a long window of window
    units (of model.window_unit tokens): one of the model's windows, each of which has its softmax scale;
    long_window, if given, widens the long layers' alone (a run's last validation with final_long_window).

    Without a cache, tokens is the whole sequence and this is the training forward (same trunk,
    same masks) on the sequence padded to whole blocks with PAD_TOKEN. With a cache, tokens
    continue the cached ones and only their positions run, under the rows of the whole sequence's
    masks for those positions; their keys and values join the cache. A query's keys are decided by
    its own and earlier tokens alone, so what the cache holds never needs to run again."""
    n, start = tokens.numel(), 0 if cache is None else len(cache)
    if start + n > model.max_seq_len:
        raise ValueError(f"{start + n} positions exceed the model's max_seq_len={model.max_seq_len}")
    if cache is None:
        x = model.trunk(pad_to_blocks(tokens), window, long_window=long_window)
        return model.softcapped_logits(x[0, n - 1])
    seen = tokens if cache.tokens is None else torch.cat([cache.tokens, tokens])
    masks = train_gpt.attention_masks(seen, window, "sdpa", first_query=start, unit=model.window_unit,
                                      long_window=long_window, paired=any(model.paired))
    x = model.trunk(tokens, window, masks, cache)
    cache.tokens = seen
    return model.softcapped_logits(x[0, -1])


def load_model(path, device: torch.device, min_seq_len: int = 0,
               dtype: str | None = None) -> tuple[train_gpt.GPT, int, int | None]:
    """The model of a train_gpt.py checkpoint in eval mode, with room for min_seq_len positions, in
    dtype (in_dtype), by default the one it trained in; the long window (in window units) it had at the
    checkpoint's step, its rotary frequencies as training left them (they are not in the checkpoint):
    rescaled at every window change up to there when its yarn is on; and the long layers' own window where
    the run's last validation widened it (final_long_window), else None. A file that does not hold such a
    model raises a one-line ConfigError naming it."""
    path = Path(path)
    state = run_support.read_checkpoint(path)
    known = {f.name for f in dataclasses.fields(train_gpt.Hyperparameters)}
    removed = sorted(set(state["hyperparameters"]) - known)  # what they chose may differ from what is now fixed
    saved = state["hyperparameters"]
    before = [record for record, earlier in (
        ("the 2026-01-07 record's layouts", isinstance(saved.get("seq_len"), int) or "paired_head_layers" not in saved),
        ("the 2026-03-22 record's residual stream", isinstance(saved.get("packed_doc_len"), int)),
        ("the 2026-04-08 record's head-pair matrices", any(name.endswith(".qkvo_w") for name in state["model"])))
        if earlier]
    if removed or before:
        why = f"with settings since removed ({', '.join(removed)})" if removed else f"before {before[0]}"
        raise train_gpt.ConfigError(f"{path}: made by an earlier train_gpt.py, {why}; load it with the tools of the "
                                    f"commit that made it")
    args = train_gpt.Hyperparameters(**state["hyperparameters"])
    try:
        train_gpt.check_hyperparameters(args, 1)
        max_seq_len = max(*args.seq_len, args.val_seq_len, train_gpt.next_multiple(min_seq_len, train_gpt.BLOCK_SIZE))
        model = train_gpt.build_model(args, max_seq_len)
    except (ValueError, RuntimeError) as e:  # ConfigError is a ValueError
        raise train_gpt.ConfigError(f"{path}: its hyperparameters describe no valid model ({e})") from None
    train_gpt.check_weights_fit(path, state["model"], model)
    model.load_state_dict(state["model"])
    run_dtype = train_gpt.DTYPES[dtype or args.dtype]
    model.rotary.to(run_dtype)  # the tables in the dtype the model runs in, as training held them
    window = train_gpt.replay_windows(model, state["step"], args)
    long_window = train_gpt.long_window_at(state["step"], args)
    model = in_dtype(model, run_dtype)
    return generation_layout(model.to(device).eval()), window, long_window


def in_dtype(model: train_gpt.GPT, dtype: torch.dtype) -> train_gpt.GPT:
    """The embeddings in dtype, hence the activations, as in training; and the weight matrices too,
    which the forward casts to the activations' dtype at every call (in bfloat16, a copy of every
    matrix per generated token): cast once, they hold the same values. Scalars stay float32."""
    for p in model.parameters():
        if p.ndim >= 2:
            p.data = p.data.to(dtype)
    return model


def generation_layout(model: train_gpt.GPT) -> train_gpt.GPT:
    """On CPU, the lm_head's weight stored transposed (same values and shape): a generated token reads
    all of it for one position, and x @ W^T streams a contiguous W^T faster than the training layout
    (records/track_cpu/README.md, performance notes)."""
    weight = model.lm_head.weight
    if weight.device.type == "cpu":
        weight.data = weight.data.T.contiguous().T
    return model


def compile_for_generation(model: train_gpt.GPT, backend: str = "inductor") -> train_gpt.GPT:
    """torch.compile the trunk and the logits for generation, with dynamic shapes: a growing prefix
    then takes a few graphs (about a minute to compile on CPU, less once inductor has cached them),
    and a cached token runs a few fused kernels instead of some 300 eager operations."""
    model.trunk = torch.compile(model.trunk, dynamic=True, backend=backend)
    model.softcapped_logits = torch.compile(model.softcapped_logits, dynamic=True, backend=backend)
    return model


def choose(logits: torch.Tensor, temperature: float, top_k: int, generator: torch.Generator) -> int:
    """Greedy at temperature 0; otherwise a draw from softmax(logits / temperature) over the top_k
    logits (all of them when top_k is 0)."""
    if temperature == 0:
        return int(logits.argmax())
    values, indices = logits.topk(min(top_k, logits.numel())) if top_k else (logits, None)
    pick = torch.multinomial(torch.softmax(values / temperature, dim=-1), 1, generator=generator)
    return int(pick if indices is None else indices[pick])


@torch.no_grad()
def generate(model: train_gpt.GPT, prompt: list[int], max_new_tokens: int, window: int, temperature: float = 1.0,
             top_k: int = 0, generator: torch.Generator | None = None, use_cache: bool = True,
             long_window: int | None = None):
    """Yields up to max_new_tokens tokens that follow prompt, <|endoftext|> included (the caller
    decides whether a new document may follow). use_cache=False re-runs the whole prefix each step."""
    device = model.embed.weight.device
    new = sequence = torch.tensor(prompt, dtype=torch.long, device=device)
    cache = KVCache(model.num_layers, len(prompt) + max_new_tokens) if use_cache else None
    vocab_size = model.vocab_size  # the lm_head's (and embeddings') padding rows are no tokens
    for _ in range(max_new_tokens):
        logits = next_token_logits(model, new if use_cache else sequence, window, cache, long_window)
        token = choose(logits[:vocab_size], temperature, top_k, generator)
        yield token
        new = torch.tensor([token], device=device)
        if not use_cache:
            sequence = torch.cat([sequence, new])


def text_of(encoding, tokens):
    """The text of tokens up to the first <|endoftext|>: a piece per token (a character's bytes split between tokens
    wait for the rest of it), then what the decoder holds at the end."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    for token in tokens:
        if token == EOT:
            break
        yield decoder.decode(encoding.decode_single_token_bytes(token))
    yield decoder.decode(b"", final=True)


def prompt_tokens(encoding, text: str) -> list[int]:
    tokens = encoding.encode(text, allowed_special={ENDOFTEXT})
    return tokens if tokens[:1] == [EOT] else [EOT, *tokens]


def main(argv: list[str] | None = None) -> int:
    parser = run_support.OneLineParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", help="a .pt file written by train_gpt.py")
    parser.add_argument("--prompt", default="", help="text to continue (default: none, a new document)")
    parser.add_argument("--max_new_tokens", type=int, default=500)
    parser.add_argument("--temperature", type=float, default=0.8, help="0: greedy")
    parser.add_argument("--top_k", type=int, default=200, help="sample among the k most likely tokens; 0: all")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num_samples", type=int, default=1)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--compile", action="store_true", help="torch.compile generation: for CUDA and long "
                        "samples (about a minute of compilation on CPU, where it saves little)")
    parser.add_argument("--dtype", choices=[*train_gpt.DTYPES, "checkpoint"], default=None,
                        help="activations: default the checkpoint's on CUDA, float32 on CPU, where bfloat16 "
                             "matmuls are slow without native support (8x on AVX2)")
    args = parser.parse_args(argv)
    for name in ("max_new_tokens", "top_k", "num_samples"):
        if getattr(args, name) < (1 if name == "num_samples" else 0):
            parser.error(f"--{name} must be at least {1 if name == 'num_samples' else 0}")
    if args.temperature < 0:
        parser.error("--temperature must be at least 0")
    device = torch.device(args.device)
    # Every token is at least one byte of the prompt, so this bounds the positions before encoding it.
    positions = 1 + len(args.prompt.encode()) + args.max_new_tokens
    try:
        dtype = args.dtype or ("checkpoint" if device.type == "cuda" else "float32")
        model, window, long_window = load_model(args.checkpoint, device, positions,
                                                None if dtype == "checkpoint" else dtype)
        if args.compile:
            compile_for_generation(model)
        encoding = get_gpt2_encoding()
        prompt = prompt_tokens(encoding, args.prompt)
    except (train_gpt.ConfigError, TokenizerError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    generator = torch.Generator(device).manual_seed(args.seed)
    generated, t0 = 0, time.perf_counter()
    for i in range(args.num_samples):
        if args.num_samples > 1:
            print(f"{'-' * 20} sample {i + 1}/{args.num_samples}", flush=True)
        print(encoding.decode(prompt[1:]), end="", flush=True)
        pieces = text_of(encoding, generate(model, prompt, args.max_new_tokens, window, args.temperature, args.top_k,
                                            generator, long_window=long_window))
        for count, piece in enumerate(pieces):
            print(piece, end="", flush=True)
        generated += count  # the last piece is the decoder's remainder, not a token
        print(flush=True)
    now = time.perf_counter()
    print(f"({generated} tokens in {now - t0:.1f} s, {1000 * (now - t0) / max(generated, 1):.1f} ms per token on "
          f"{device}{', compilation included' if args.compile else ''}; {now - STARTED:.1f} s in all, with loading)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
