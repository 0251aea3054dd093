"""Evaluate a checkpoint of train_gpt.py on tasks of EleutherAI's lm-evaluation-harness: HellaSwag, ARC, PIQA,
LAMBADA, Winogrande, wikitext and the rest, with the harness's own prompts, preprocessing and metrics.

    ./run.sh eval checkpoints/<run_id>/step_002225.pt --tasks hellaswag,arc_easy
    ./run.sh eval CHECKPOINT --tasks hellaswag_local --limit 200
    ./run.sh eval CHECKPOINT --tasks my_task --include_path DIR

The harness reads a task's data from the Hugging Face hub (HF_ENDPOINT names a mirror, HF_DATASETS_OFFLINE=1
keeps to the local cache), or from local files that a task YAML names: those of tools/eval_tasks (HellaSwag
from data/hellaswag/hellaswag_val.jsonl, the held-out Shakespeare works), or of --include_path; relative paths
are from the working directory (./run.sh runs in the repository). The results JSON (and, with --log_samples,
each task's samples) goes beside the checkpoint, or into --output.

Every request is a document of its own, <|endoftext|> first as in training; many are packed into one sequence
per forward, each as if alone (the model's document masks, rotary positions from 0), and the lm_head runs only
where a token is scored.
"""

import argparse
import bisect
import json
import logging
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "data"))
sys.path.insert(0, str(ROOT / "tools"))

import torch

import sample
import train_gpt
from atomic_file import atomic_write
from gpt2_tokenizer import ENDOFTEXT, TokenizerError, get_gpt2_encoding

try:
    from lm_eval.api.model import TemplateLM
except ImportError:  # main() says how to install it
    TemplateLM = object

EOT = train_gpt.EOT_TOKEN
LOCAL_TASKS = ROOT / "tools" / "eval_tasks"  # the repository's task YAMLs of local files, always included
DEFAULT_MAX_LENGTH = 1024  # GPT-2's context, under which its published scores were made
# Scored positions whose logits a CPU makes at once: few enough that the passes over them (softcap, log-softmax,
# argmax) stay in its cache. A GPU makes a sequence's at once.
CPU_LOGIT_ROWS = 32


def default_batch_tokens(device: torch.device, max_length: int) -> int:
    """A packed forward's positions: on CPU one request's longest, since its dense attention costs the square of a
    sequence's length; on a GPU 8192, enough to keep it busy."""
    return max(max_length, train_gpt.BLOCK_SIZE) if device.type == "cpu" else max(8192, max_length)


class EvaluationError(ValueError):
    """A request the model cannot score as asked (main() reports it in one line)."""


def pack(lengths: list[int], starts_document: list[bool], capacity: int) -> list[list[int]]:
    """The requests (by index) in sequences of at most capacity positions: longest first, each into the fullest
    sequence with room (best fit decreasing). A request that does not start a document (a truncated one, a rolling
    window after the first) only opens a sequence: no document may come before it."""
    packs, rooms = [], []  # rooms: (room left, pack), sorted
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        if lengths[i] > capacity:
            raise ValueError(f"a request of {lengths[i]} positions exceeds the {capacity} of a sequence")
        k = bisect.bisect_left(rooms, (lengths[i], -1)) if starts_document[i] else len(rooms)
        if k < len(rooms):
            room, p = rooms.pop(k)
            packs[p].append(i)
        else:
            room, p = capacity, len(packs)
            packs.append([i])
        bisect.insort(rooms, (room - lengths[i], p))
    return packs


@torch.no_grad()
def score(model: train_gpt.GPT, window: int, long_window: int | None, requests: list[tuple[list[int], int]],
          capacity: int, every_position: bool = False) -> list[tuple[float, bool]]:
    """For each request (tokens, n): the log-probability of its last n tokens given the tokens before them, and
    whether each of them was the most likely token. Requests are packed into sequences of capacity positions (a
    request of T tokens takes T - 1: its last token is only predicted). every_position: the lm_head and softcap
    at all positions, the scored ones picked after (tools/bench_evaluate.py's comparison)."""
    device = model.embed.weight.device
    lengths = [len(tokens) - 1 for tokens, _ in requests]
    results = [None] * len(requests)
    for members in pack(lengths, [tokens[0] == EOT for tokens, _ in requests], capacity):
        inputs, starts, positions, targets, offset = [], [], [], [], 0
        for i in members:
            tokens, n = requests[i]
            inputs += tokens[:-1]
            starts.append(offset)
            positions += range(offset + lengths[i] - n, offset + lengths[i])
            targets += tokens[-n:]
            offset += lengths[i]
        sequence = sample.pad_to_blocks(torch.tensor(inputs, device=device))
        restarts = torch.zeros(sequence.numel(), dtype=torch.bool, device=device)
        restarts[starts] = True  # each request as if alone: rotary positions from 0, no smear from the one before
        x = model.trunk(sequence, window, long_window=long_window, restarts=restarts)[0]
        if every_position:
            x = model.softcapped_logits(x)
        logprobs, greedy, chunk = [], [], CPU_LOGIT_ROWS if device.type == "cpu" else len(positions)
        for rows, wanted in zip(torch.tensor(positions, device=device).split(chunk),
                                torch.tensor(targets, device=device).split(chunk)):
            logits = (x[rows] if every_position else model.softcapped_logits(x[rows])).float()[:, :model.vocab_size]
            logprobs.append(logits.log_softmax(-1).gather(1, wanted[:, None])[:, 0].double())
            greedy.append(logits.argmax(-1) == wanted)  # the padding rows are no tokens: cut off above
        logprobs, greedy = torch.cat(logprobs), torch.cat(greedy)
        counts = [requests[i][1] for i in members]
        for i, lp, g in zip(members, logprobs.split(counts), greedy.split(counts)):
            results[i] = (lp.sum().item(), bool(g.all()))
    return results


class CheckpointLM(TemplateLM):
    """A train_gpt.py model as the harness's language model: loglikelihood, loglikelihood_rolling (perplexity
    tasks) and generate_until (greedy, or sampled where a task asks, through tools/sample.py's KV cache)."""

    def __init__(self, model: train_gpt.GPT, window: int, long_window: int | None, encoding, batch_tokens: int,
                 max_length: int = DEFAULT_MAX_LENGTH, seed: int = 0):
        super().__init__()
        if not 0 < max_length <= batch_tokens:
            raise EvaluationError(f"--max_length={max_length} must be positive and at most --batch_tokens={batch_tokens}")
        self.model, self.window, self.long_window, self.encoding = model, window, long_window, encoding
        self.batch_tokens = batch_tokens
        self.max_length = max_length  # the positions of the longest request; longer ones lose their start
        self.generator = torch.Generator(model.embed.weight.device).manual_seed(seed)  # one stream: repeats differ

    @property
    def eot_token_id(self) -> int:
        return EOT

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        return self.encoding.encode(string, allowed_special={ENDOFTEXT})

    def tok_decode(self, tokens: list[int]) -> str:
        return self.encoding.decode(tokens)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        scored = []
        for (context_text, continuation_text), context, continuation in requests:
            if not 0 < len(continuation) <= self.max_length:
                raise EvaluationError(f"a continuation of {len(continuation)} tokens cannot be scored within "
                                      f"--max_length={self.max_length}: {continuation_text[:60]!r}")
            tokens = context + continuation
            if tokens[0] != EOT:
                tokens = [EOT, *tokens]  # a new document, as every training document starts
            scored.append((tokens[-(self.max_length + 1):], len(continuation)))
        return score(self.model, self.window, self.long_window, scored, self.batch_tokens)

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

        windows, owners = [], []
        for k, request in enumerate(requests):
            for context, continuation in map(make_disjoint_window, get_rolling_token_windows(
                    self.tok_encode(request.args[0]), EOT, self.max_length, 1)):
                windows.append((context + continuation, len(continuation)))
                owners.append(k)
        totals = [0.0] * len(requests)
        for k, (logprob, _) in zip(owners, score(self.model, self.window, self.long_window, windows, self.batch_tokens)):
            totals[k] += logprob
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        return [self.generate(*request.args) for request in requests]

    def generate(self, context: str, gen_kwargs: dict) -> str:
        """The continuation of context up to the first stop string (the harness's until) or <|endoftext|>, at most
        max_gen_toks tokens: greedy unless the task samples (at its temperature and top_k)."""
        from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs

        kwargs = normalize_gen_kwargs(gen_kwargs)
        until = [stop for stop in handle_stop_sequences(kwargs.pop("until", None), None) if isinstance(stop, str)]
        max_new = kwargs["max_gen_toks"]
        room = self.max_length - max_new
        if room < 1:
            raise EvaluationError(f"max_gen_toks={max_new} leaves no room for a prompt within --max_length={self.max_length}")
        prompt = sample.prompt_tokens(self.encoding, context)[-room:]
        temperature = float(kwargs.get("temperature", 0.0)) if kwargs["do_sample"] else 0.0
        tokens = sample.generate(self.model, prompt, max_new, self.window, temperature,
                                 int(kwargs.get("top_k", 0)), self.generator, long_window=self.long_window)
        text = ""
        for piece in sample.text_of(self.encoding, tokens):
            text += piece
            stops = [text.find(stop) for stop in until if stop in text]
            if stops:
                return text[:min(stops)]
        return text


def load_tasks(task_manager, names: list[str]):
    """The tasks' data loaded once (the harness then reads its cache), or a ConfigError of one line that names the
    task and what to do."""
    unknown = [name for name in names if name not in task_manager.all_tasks]
    if unknown:
        raise train_gpt.ConfigError(f"--tasks: unknown task {unknown[0]}; `lm-eval ls tasks` lists them, and a task "
                                    f"YAML of your own goes in a folder named by --include_path")
    for name in names:
        try:
            task_manager.load([name])
        except Exception as e:  # datasets, the hub and a task's own code raise many kinds
            message = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
            data = isinstance(e, (OSError, ConnectionError)) or any(
                word in type(e).__name__ for word in ("NotFound", "Offline", "Connection", "HTTP"))
            hint = ("without network, give a local copy through a task YAML (tools/eval_tasks, --include_path; "
                    "relative paths are from the working directory), or set HF_ENDPOINT to a mirror" if data else
                    "see the task's YAML and its functions")
            raise train_gpt.ConfigError(f"task {name}: could not be loaded ({message}); {hint}") from None


def results_path(directory: Path, checkpoint: Path, names: list[str], suffix: str) -> Path:
    return directory / f"{checkpoint.stem}_{'+'.join(names)}{suffix}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("checkpoint", help="a .pt file written by train_gpt.py")
    parser.add_argument("--tasks", required=True, help="comma-separated lm-eval task names, e.g. hellaswag,arc_easy")
    parser.add_argument("--limit", type=float, default=None, help="at most this many examples a task (or a fraction)")
    parser.add_argument("--num_fewshot", type=int, default=None, help="examples in each prompt (default: the task's)")
    parser.add_argument("--max_length", type=int, default=DEFAULT_MAX_LENGTH,
                        help="positions of the longest request; a longer one loses its start (rolling windows' length)")
    parser.add_argument("--batch_tokens", type=int, default=None,
                        help="positions of one packed forward (default: --max_length on CPU, 8192 on a GPU)")
    parser.add_argument("--dtype", choices=["auto", *train_gpt.DTYPES], default="auto",
                        help="activations: auto is bfloat16 on CUDA and on CPUs that multiply it natively")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--output", type=Path, default=None, help="folder of the results (default: the checkpoint's)")
    parser.add_argument("--include_path", default=None, help="a folder of task YAMLs of your own (local data), "
                        "beside tools/eval_tasks")
    parser.add_argument("--log_samples", action="store_true", help="also write every example's requests and scores")
    args = parser.parse_args(argv)
    try:
        device = torch.device(args.device)
    except RuntimeError:
        parser.error(f"--device={args.device}: not a device torch knows (cpu, cuda, cuda:1, ...)")
    if args.max_length < 1:
        parser.error(f"--max_length={args.max_length} must be at least 1")
    if args.batch_tokens is None:
        args.batch_tokens = default_batch_tokens(device, args.max_length)
    if args.batch_tokens < max(args.max_length, train_gpt.BLOCK_SIZE):
        parser.error(f"--batch_tokens={args.batch_tokens} must hold --max_length={args.max_length} and be at least "
                     f"{train_gpt.BLOCK_SIZE}")
    try:
        import lm_eval
        from lm_eval.tasks import TaskManager
        from lm_eval.utils import handle_non_serializable, make_table
    except ImportError:
        print("error: lm-eval is not installed: ./run.sh eval installs it (requirements-eval.txt)", file=sys.stderr)
        return 2
    logging.getLogger("lm_eval").setLevel(logging.WARNING)
    checkpoint = Path(args.checkpoint)
    names = [name for name in args.tasks.split(",") if name]
    output = args.output or checkpoint.parent
    try:
        dtype = train_gpt.auto_dtype(device)[0] if args.dtype == "auto" else args.dtype
        model, window, long_window = sample.load_model(checkpoint, device, args.batch_tokens, dtype)
        if device.type == "cuda":
            sample.compile_for_generation(model)
        lm = CheckpointLM(model, window, long_window, get_gpt2_encoding(), args.batch_tokens, args.max_length)
        task_manager = TaskManager(include_path=[str(LOCAL_TASKS), *([args.include_path] if args.include_path else [])])
        load_tasks(task_manager, names)
        output.mkdir(parents=True, exist_ok=True)
        if not os.access(output, os.W_OK | os.X_OK):
            raise train_gpt.ConfigError(f"--output={output}: not a folder this user can write to")
        results = lm_eval.simple_evaluate(model=lm, tasks=names, task_manager=task_manager, limit=args.limit,
                                          num_fewshot=args.num_fewshot, log_samples=args.log_samples,
                                          verbosity="WARNING")
    except (train_gpt.ConfigError, TokenizerError, EvaluationError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    samples = results.pop("samples", {})
    print(make_table(results))
    if "groups" in results:
        print(make_table(results, "groups"))
    written = [results_path(output, checkpoint, names, ".json")]
    try:
        with atomic_write(written[0]) as f:
            f.write(json.dumps(results, indent=2, default=handle_non_serializable).encode())
        for task, task_samples in samples.items():
            written.append(results_path(output, checkpoint, [task], "_samples.jsonl"))
            with atomic_write(written[-1]) as f:
                f.writelines(json.dumps(s, default=handle_non_serializable).encode() + b"\n" for s in task_samples)
    except OSError as e:
        print(f"error: {written[-1]}: could not be written ({e.strerror or e})", file=sys.stderr)
        return 2
    print(f"results: {', '.join(map(str, written))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
