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
import contextlib
import glob
import importlib.util
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "data"))
sys.path.insert(0, str(ROOT / "tools"))

import torch
import yaml

import run_support as support
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


class TaskLoader(yaml.SafeLoader):
    """Reads a task YAML as the harness does, its !function tags kept as the names they give."""


TaskLoader.add_constructor("!function", lambda loader, node: loader.construct_scalar(node))


def read_task_yaml(path: Path) -> dict:
    """A task YAML's mapping, what it includes beneath it; a file that does not parse is a ConfigError naming it and
    the line."""
    try:
        config = yaml.load(path.read_text(), Loader=TaskLoader)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
        where = f", line {mark.line + 1}" if mark else ""
        raise train_gpt.ConfigError(f"{path}{where}: not a task YAML ({getattr(e, 'problem', None) or e}); fix it or "
                                    f"move it out of the folder") from None
    except (OSError, UnicodeDecodeError) as e:
        raise train_gpt.ConfigError(f"{path}: cannot be read ({getattr(e, 'strerror', None) or e})") from None
    if not isinstance(config, dict):
        raise train_gpt.ConfigError(f"{path}: not a task YAML (a mapping of keys such as task and dataset_path); fix "
                                    f"it or move it out of the folder")
    included = config.pop("include", None)
    if isinstance(included, str):
        config = {**read_task_yaml(path.parent / included), **config}
    return config


def tasks_in(folder: Path, option: str) -> dict[str, tuple[Path, dict]]:
    """The tasks that a folder's YAMLs (below it too) define: name -> (the YAML, its settings). A folder that is
    missing or holds no task YAML is a ConfigError naming option."""
    if not folder.is_dir():
        raise train_gpt.ConfigError(f"{option}={folder}: no such folder; give a folder of task YAMLs")
    tasks = {}
    for path in sorted(folder.glob("**/*.yaml")):
        if "__pycache__" not in path.parts:
            config = read_task_yaml(path)
            if isinstance(config.get("task"), str) or isinstance(config.get("group"), str):
                tasks[config.get("task") or config["group"]] = (path, config)
    if not tasks:
        raise train_gpt.ConfigError(f"{option}={folder}: holds no task YAML (a .yaml file with a task: key); give a "
                                    f"folder of task YAMLs")
    return tasks


def data_files(config: dict) -> list[str]:
    """The files a task YAML names in dataset_kwargs.data_files: one, a list, or one or a list per split."""
    named = (config.get("dataset_kwargs") or {}).get("data_files") or []
    named = named.values() if isinstance(named, dict) else [named]
    return [f for entry in named for f in ([entry] if isinstance(entry, str) else entry)]


def check_task_data(name: str, yaml_path: Path, config: dict):
    """The local files a task of ours reads, each there, and each line of its JSON Lines a JSON object: else a
    ConfigError naming the file and the line, before the harness (which would report it in several lines, not
    naming the line) reads it. Relative paths are from the working directory, as for the harness."""
    for named in data_files(config):
        if "://" in named:
            continue  # a remote file: the harness's to fetch
        paths = [Path(p) for p in sorted(glob.glob(named))] if glob.has_magic(named) else [Path(named)]
        if not paths or not paths[0].is_file():
            raise train_gpt.ConfigError(f"task {name} ({yaml_path}): its data file {named} does not exist (relative "
                                        f"paths are from the working directory, {Path.cwd()})")
        if config.get("dataset_path") != "json":
            continue
        for path in paths:
            check_json_documents(path, f"task {name} ({yaml_path})")


def check_json_documents(path: Path, reader: str):
    """A JSON file as the datasets library reads one: a list of objects, or JSON Lines (an object a line, blank
    lines aside). Else a ConfigError naming the file and the line."""
    text = path.read_text(encoding="utf-8", errors="replace")
    whole = text.lstrip().startswith("[")
    lines = [text] if whole else text.splitlines()
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            documents = json.loads(line)
        except json.JSONDecodeError as e:
            where = f"line {e.lineno}" if whole else f"line {number}"
            raise train_gpt.ConfigError(f"{path}, {where}: not valid JSON ({e.msg}: column {e.colno}); {reader} reads "
                                        f"it") from None
        for document in documents if whole and isinstance(documents, list) else [documents]:
            if not isinstance(document, dict):
                where = "" if whole else f", line {number}"
                raise train_gpt.ConfigError(f"{path}{where}: a JSON {type(document).__name__} where an object (one "
                                            f"document) belongs; {reader} reads it")


def check_output(output: Path):
    """A results folder that exists and can be written, or one that can be made (nothing is made before results are
    there to write); else a ConfigError naming --output."""
    existing = output
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise train_gpt.ConfigError(f"--output={output}: {existing} is a file, not a folder; give a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise train_gpt.ConfigError(f"--output={output}: {existing} is not a folder this user can write to; give another")


def checked_options(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """The command line, every option checked (the task YAMLs of ours and of --include_path read) before the
    harness is imported or the checkpoint loaded; a bad one ends here in one line, exit 2."""
    args = parser.parse_args(argv)
    try:
        args.device = torch.device(args.device)
    except RuntimeError:
        parser.error(f"--device={args.device}: not a device torch knows (cpu, cuda, cuda:1, ...)")
    if args.max_length < 1:
        parser.error(f"--max_length={args.max_length} must be at least 1")
    if args.batch_tokens is None:
        args.batch_tokens = default_batch_tokens(args.device, args.max_length)
    if args.batch_tokens < max(args.max_length, train_gpt.BLOCK_SIZE):
        parser.error(f"--batch_tokens={args.batch_tokens} must hold --max_length={args.max_length} and be at least "
                     f"{train_gpt.BLOCK_SIZE}")
    if args.limit is not None and not (0 < args.limit < 1 or (args.limit >= 1 and args.limit.is_integer())):
        parser.error(f"--limit={args.limit:g}: give a number of examples a task (1, 2, ...) or a fraction of each task "
                     f"(between 0 and 1)")
    if args.num_fewshot is not None and args.num_fewshot < 0:
        parser.error(f"--num_fewshot={args.num_fewshot} must be at least 0")
    args.tasks = list(dict.fromkeys(name.strip() for name in args.tasks.split(",") if name.strip()))
    if not args.tasks:
        parser.error("--tasks names no task; give one or more task names separated by commas, e.g. hellaswag,arc_easy")
    if not args.checkpoint.is_file():
        parser.exit(2, f"error: {args.checkpoint}: no such checkpoint\n")
    if importlib.util.find_spec("lm_eval") is None:
        parser.exit(2, "error: lm-eval is not installed: ./run.sh eval installs it (requirements-eval.txt)\n")
    args.output = args.output or args.checkpoint.parent
    try:
        args.local_tasks = tasks_in(LOCAL_TASKS, "tools/eval_tasks")
        for folder in args.include_path:
            args.local_tasks.update(tasks_in(Path(folder), "--include_path"))
        for name in args.tasks:
            if name in args.local_tasks:
                check_task_data(name, *args.local_tasks[name])
        check_output(args.output)
    except train_gpt.ConfigError as e:
        parser.exit(2, f"error: {e}\n")
    return args


def load_tasks(task_manager, names: list[str], folders: list[str]):
    """The tasks' data loaded once (the harness then reads its cache), or a ConfigError of one line that names the
    task and what to do."""
    unknown = [name for name in names if name not in task_manager.all_tasks]
    if unknown:
        raise train_gpt.ConfigError(f"--tasks: unknown task {unknown[0]}: neither one of lm-eval's (`lm-eval ls tasks` "
                                    f"lists them) nor in {' or '.join(folders)}; a task YAML of your own goes in a "
                                    f"folder named by --include_path")
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


def project_commit() -> str | None:
    """This checkout's commit, for the results' git_hash; None outside a git checkout, without a word on stderr."""
    found = subprocess.run(["git", "-C", str(ROOT), "describe", "--always", "--dirty"], capture_output=True, text=True)
    return found.stdout.strip() if found.returncode == 0 else None


def quiet_harness():
    """The harness's warnings, and none of the datasets library's progress bars or notes: a run prints the table.
    The results' git_hash names this project's commit, where the harness asks git about the working directory (and
    git complains on stderr outside a checkout)."""
    import datasets
    import lm_eval.evaluator

    logging.getLogger("lm_eval").setLevel(logging.WARNING)
    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    lm_eval.evaluator.get_git_commit_hash = project_commit


def write_results(output: Path, checkpoint: Path, names: list[str], results: dict, samples: dict) -> list[Path]:
    """The results JSON and each task's samples in output, made now if need be; on a failure, the files and folders
    made here are removed and the OSError names the file."""
    from lm_eval.utils import handle_non_serializable

    made = [folder for folder in [output, *output.parents] if not folder.exists()]
    written = [results_path(output, checkpoint, names, ".json")]
    try:
        output.mkdir(parents=True, exist_ok=True)
        with atomic_write(written[0]) as f:
            f.write(json.dumps(results, indent=2, default=handle_non_serializable).encode())
        for task, task_samples in samples.items():
            written.append(results_path(output, checkpoint, [task], "_samples.jsonl"))
            with atomic_write(written[-1]) as f:
                f.writelines(json.dumps(s, default=handle_non_serializable).encode() + b"\n" for s in task_samples)
    except OSError as e:
        for path in written[:-1]:
            path.unlink(missing_ok=True)
        for folder in made:
            with contextlib.suppress(OSError):
                folder.rmdir()
        raise OSError(f"{written[-1]}: could not be written ({e.strerror or e})") from None
    return written


def main(argv: list[str] | None = None) -> int:
    parser = support.OneLineParser(description=__doc__.split("\n\n")[0],
                                   formatter_class=argparse.RawDescriptionHelpFormatter,
                                   epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("checkpoint", type=Path, help="a .pt file written by train_gpt.py")
    parser.add_argument("--tasks", required=True, help="comma-separated lm-eval task names, e.g. hellaswag,arc_easy")
    parser.add_argument("--limit", type=float, default=None,
                        help="at most this many examples a task, or this fraction of each (between 0 and 1)")
    parser.add_argument("--num_fewshot", type=int, default=None, help="examples in each prompt (default: the task's)")
    parser.add_argument("--max_length", type=int, default=DEFAULT_MAX_LENGTH,
                        help="positions of the longest request; a longer one loses its start (rolling windows' length)")
    parser.add_argument("--batch_tokens", type=int, default=None,
                        help="positions of one packed forward (default: --max_length on CPU, 8192 on a GPU)")
    parser.add_argument("--dtype", choices=["auto", *train_gpt.DTYPES], default="auto",
                        help="activations: auto is bfloat16 on CUDA and on CPUs that multiply it natively")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--output", type=Path, default=None, help="folder of the results (default: the checkpoint's)")
    parser.add_argument("--include_path", action="append", default=[],
                        help="a folder of task YAMLs of your own (local data), beside tools/eval_tasks; may be repeated")
    parser.add_argument("--log_samples", action="store_true", help="also write every example's requests and scores")
    args = checked_options(parser, argv)
    try:
        dtype = train_gpt.auto_dtype(args.device)[0] if args.dtype == "auto" else args.dtype
        model, window, long_window = sample.load_model(args.checkpoint, args.device, args.batch_tokens, dtype)
        if args.device.type == "cuda":
            sample.compile_for_generation(model)
        lm = CheckpointLM(model, window, long_window, get_gpt2_encoding(), args.batch_tokens, args.max_length)
        import lm_eval  # the harness, once the checkpoint is known to be sound
        from lm_eval.tasks import TaskManager
        from lm_eval.utils import make_table

        quiet_harness()
        folders = [str(LOCAL_TASKS), *args.include_path]
        task_manager = TaskManager(include_path=folders)
        load_tasks(task_manager, args.tasks, folders)
        results = lm_eval.simple_evaluate(model=lm, tasks=args.tasks, task_manager=task_manager, limit=args.limit,
                                          num_fewshot=args.num_fewshot, log_samples=args.log_samples,
                                          verbosity="WARNING")
        samples = results.pop("samples", {})
        written = write_results(args.output, args.checkpoint, args.tasks, results, samples)
    except (train_gpt.ConfigError, TokenizerError, EvaluationError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(make_table(results))
    if "groups" in results:
        print(make_table(results, "groups"))
    print(f"results: {', '.join(map(str, written))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
