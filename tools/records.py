"""Records: list, diff, test, plot, check and submit speedrun runs.

    python tools/records.py list [TRACK]                   records, newest first, stats computed from their logs
    python tools/records.py diff A B                       source (then hyperparameters) diff of two logs or record folders
    python tools/records.py stats PATH... [--target X]     final val losses, mean, std, one-sided t-test p-value
    python tools/records.py plot PATH... -o FILE.png       val loss against training time and against step
    python tools/records.py check LOG                      is LOG's source exactly the current train_gpt.py (and companion)?
    python tools/records.py source LOG DIR                 write the files LOG ran into DIR, to run them again
    python tools/records.py submit LOG... --track T --name NAME [--date YYYY-MM-DD]

A log is what train_gpt.py writes to logs/<run_id>.txt: the exact source of train_gpt.py, then that
of each file it logs after it (run_support.py), each after a header naming it; a line of 100 '=', the
environment, the hyperparameters, then speedrun step lines such as
    step:1770/1770 val_loss:3.2794 train_time:178412ms step_avg:100.80ms
Only the step-line fields are needed, so logs of other speedrun forks work too. A run's final val
loss is the val_loss of its last validation line, and its training time that line's train_time. A
run diverged when that loss is above its step-0 one (without a step-0 line, above ln of its logged
vocab_size padded as the lm_head is: the loss of uniform predictions): stats notes it, submit refuses it.
A PATH may also be a record folder (records/<track>/<YYYY-MM-DD>_<Name>/), meaning its *.txt logs,
or a track folder (records/<track>/), meaning the logs of all its records, oldest first.

scipy and matplotlib are imported only by the commands that need them, so list/diff/check start fast.
"""

import argparse
import ast
import datetime
import difflib
import math
import operator
import os
import re
import shlex
import shutil
import statistics
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]  # the repository: train_gpt.py and records/ live here
DEFAULT_RECORDS_DIR = ROOT / "records"
SEPARATOR = "=" * 100  # train_gpt.py writes it after the source
SECTION_RULE = "-" * 40  # before and after the "# NAME" line that starts each logged file after the first
FIRST_FILE = "train_gpt.py"  # the logged source's first file (older logs hold only it)
VOCAB_PADDING = 128  # train_gpt.py, as upstream, widens the lm_head to a multiple of this many tokens

P_THRESHOLD = 0.01  # the rules: mean final val loss below the target with p < 0.01 (one-sided t-test)
CPU_TARGET = 5.43  # track_cpu's target: one nat below the unigram entropy (6.4312) of its val tokens


@dataclass(frozen=True)
class Track:
    target: float
    description: str


TRACKS = {
    "track_1_short": Track(target=3.28, description="8xH100, FineWeb; val loss on the first 10,485,760 "
                                                   "FineWeb validation tokens"),
    "track_cpu": Track(target=CPU_TARGET, description="CPU, Shakespeare corpus; val loss on the cpu "
                                                      "preset's validation tokens"),
}

# The environment behind each CPU fast path a log reports as on: what ./run.sh sets, in its order.
CPU_ENV_SETTINGS = {"  glibc malloc tuning: on": ["MALLOC_MMAP_MAX_=0", "MALLOC_TRIM_THRESHOLD_=68719476736"],
                    "  huge pages: on": ["THP_MEM_ALLOC_ENABLE=1"]}

# Speedrun step lines; other fields may sit between these, and their order beyond step: is free.
STEP_RE = re.compile(r"\s*step:(\d+)/(\d+)(?=\s|$)")
VAL_LOSS_RE = re.compile(r"(?:^|\s)val_loss:([0-9.]+|nan|inf)(?=\s|$)")
TRAIN_TIME_RE = re.compile(r"(?:^|\s)train_time:(\d+)ms(?=\s|$)")
HPARAMS_HEADER_RE = re.compile(r"hyperparameters(?: \(preset (\S+)\))?:$")
HPARAM_LINE_RE = re.compile(r"  (\w+): (.*)$")
WORLD_SIZE_RE = re.compile(r"distributed: world size (\d+)")
RECORD_DIR_RE = re.compile(r"(\d{4}-\d{2}-\d{2})_([A-Za-z0-9_-]+)$")
NAME_RE = re.compile(r"[A-Za-z0-9_-]+")
NOT_IN_COMMAND = ("run_id", "log_dir")  # differ from run to run and do not change what is trained


class RecordsError(Exception):
    """A user-facing failure: printed as one line 'error: ...', exit status 2."""


# ------------------------------------------------------------------------------------------------
# Parsing logs


@dataclass
class ValPoint:
    step: int
    total: int
    loss: float
    time_ms: int | None


@dataclass
class Log:
    path: Path
    source: str | None  # everything before the first separator line; None when there is none
    sources: dict[str, str]  # the files source holds, by name, train_gpt.py first (split_sources)
    header: list[str]  # environment lines after the separator: versions, hardware
    preset: str | None
    hparam_lines: list[str]  # the "hyperparameters (preset P):" line and its "  name: value" lines
    hparams: dict[str, str]  # name -> the logged repr
    vals: list[ValPoint]
    world_size: int | None
    cpu_env: list[str]  # the memory settings the log says a CPU run had, as NAME=VALUE (./run.sh's)
    resumed: bool

    @property
    def label(self) -> str:
        run_id = literal_or_none(self.hparams.get("run_id"))
        return run_id if isinstance(run_id, str) and run_id else self.path.stem

    @property
    def final(self) -> ValPoint | None:
        return self.vals[-1] if self.vals else None

    @property
    def complete(self) -> bool:
        return bool(self.vals) and self.vals[-1].step == self.vals[-1].total

    def require_source(self) -> str:
        if self.source is None:
            raise RecordsError(f"{self.path}: no embedded source (no line of {len(SEPARATOR)} '=' ends one); "
                               f"is this a train_gpt.py log?")
        return self.source

    def require_sources(self) -> dict[str, str]:
        self.require_source()
        return self.sources


def labels(logs: list[Log]) -> list[str]:
    """Each log's label; a label shared by several logs gets its folder name in front."""
    plain = [log.label for log in logs]
    return [f"{log.path.parent.name}/{label}" if plain.count(label) > 1 else label
            for log, label in zip(logs, plain)]


def literal_or_none(text: str | None):
    if text is None:
        return None
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return None


def split_sources(source: str, path: Path) -> dict[str, str]:
    """The files a logged source holds, by name: train_gpt.py first, then each file it logged after
    itself, which begins after a blank line, SECTION_RULE, "# NAME", SECTION_RULE and a blank line.
    A name that is no plain file name, or that comes twice, makes the log unusable (path names it)."""
    lines = source.splitlines(keepends=True)
    stripped = [line.rstrip("\r\n") for line in lines]
    starts = [i for i in range(1, len(lines) - 3)
              if stripped[i] == stripped[i + 2] == SECTION_RULE and stripped[i + 1].startswith("# ")
              and not stripped[i - 1] and not stripped[i + 3]]
    names = [FIRST_FILE] + [stripped[i + 1][2:] for i in starts]
    bad = next((n for n in names if Path(n).name != n or n in ("", ".", "..") or names.count(n) > 1), None)
    if bad is not None:
        raise RecordsError(f"{path}: the logged file name {bad!r} is no file name, or comes twice; "
                           f"was the log edited?")
    begins = [0] + [i + 4 for i in starts]  # each file's first line
    ends = [i - 1 for i in starts] + [len(lines)]  # past its last line: the blank line before the next header
    return {name: "".join(lines[begin:end]) for name, begin, end in zip(names, begins, ends)}


def parse_log(path: Path) -> Log:
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError as e:
        raise RecordsError(f"{path}: cannot read ({e.strerror or e})") from None
    lines = text.splitlines(keepends=True)
    sep = next((i for i, line in enumerate(lines) if line.rstrip("\r\n") == SEPARATOR), None)
    source = "".join(lines[:sep]) if sep is not None else None
    body = [line.rstrip("\r\n") for line in (lines[sep + 1:] if sep is not None else lines)]

    header = []
    if sep is not None:
        for line in body:
            if (line == SEPARATOR or HPARAMS_HEADER_RE.match(line) or STEP_RE.match(line)
                    or line.startswith("fast paths:")):
                break
            header.append(line)
        while header and not header[-1].strip():
            header.pop()

    preset, hparam_lines, hparams = None, [], {}
    start = next((i for i, line in enumerate(body) if HPARAMS_HEADER_RE.match(line)), None)
    if start is not None:
        preset = HPARAMS_HEADER_RE.match(body[start]).group(1)
        hparam_lines.append(body[start])
        for line in body[start + 1:]:
            m = HPARAM_LINE_RE.match(line)
            if not m:
                break
            hparam_lines.append(line)
            hparams[m.group(1)] = m.group(2)

    vals, world_size, cpu_env, resumed = [], None, [], False
    for line in body:
        m = STEP_RE.match(line)
        if m:
            loss = VAL_LOSS_RE.search(line)
            if loss:
                time_ms = TRAIN_TIME_RE.search(line)
                vals.append(ValPoint(int(m.group(1)), int(m.group(2)), parse_loss(loss.group(1)),
                                     int(time_ms.group(1)) if time_ms else None))
            continue
        if line.startswith("distributed: "):
            ws = WORLD_SIZE_RE.match(line)
            world_size = int(ws.group(1)) if ws else world_size
        elif line.startswith("resumed from "):
            resumed = True
        else:
            cpu_env += [setting for prefix, env in CPU_ENV_SETTINGS.items() if line.startswith(prefix) for setting in env]
    sources = split_sources(source, path) if source is not None else {}
    return Log(path, source, sources, header, preset, hparam_lines, hparams, vals, world_size, cpu_env, resumed)


def parse_loss(text: str) -> float:
    try:
        return float(text)
    except ValueError:  # "1.2.3": a malformed number; treat it as no loss at all
        return math.nan


def divergence(log: Log) -> str | None:
    """Why the run diverged, or None: train_gpt.py's rule (run_support.divergence), redone on the logged (rounded)
    losses so that it also judges upstream's logs and ours from before the rule. None where nothing logged compares."""
    final, start = log.final, next((v.loss for v in log.vals if v.step == 0), None)
    if final is None:
        return None
    if start is not None:
        named = f"step 0's {start:.4f}"
    else:
        vocab = literal_or_none(log.hparams.get("vocab_size"))
        if type(vocab) is not int or vocab < 1:
            return None
        width = -(-vocab // VOCAB_PADDING) * VOCAB_PADDING
        start = math.log(width)
        named = f"ln({width}) = {start:.4f}, the loss of uniform predictions"
    return f"final val loss {final.loss:.4f} is above {named}" if final.loss > round(start, 4) else None


def record_logs(folder: Path) -> list[Path]:
    return sorted(p for p in folder.glob("*.txt") if p.is_file())


def expand_paths(paths: list[str]) -> list[Path]:
    """Log files as given; record folders as their *.txt logs, sorted; a track folder as its records' logs,
    oldest record first."""
    out = []
    for text in paths:
        path = Path(text)
        if path.is_dir():
            logs = record_logs(path) or [log for folder in reversed(record_folders(path)) for log in record_logs(folder)]
            if not logs:
                raise RecordsError(f"{path}: a folder with no *.txt logs")
            out.extend(logs)
        elif path.is_file():
            out.append(path)
        else:
            raise RecordsError(f"{path}: no such log file or record folder")
    return out


def first_log(text: str) -> Path:
    """The log a PATH names: a log file, or a folder's first log as expand_paths lists them."""
    return expand_paths([text])[0]


# ------------------------------------------------------------------------------------------------
# Statistics


@dataclass
class Summary:
    n: int
    losses: list[float]
    times_ms: list[int]
    mean: float
    std: float | None  # sample std (ddof=1); None when n < 2
    mean_time_ms: float | None
    target: float | None
    p_value: float | None
    p_note: str  # why p_value is None, or ""


def t_test_less(losses: list[float], target: float) -> float:
    import warnings

    from scipy import stats

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return float(stats.ttest_1samp(losses, target, alternative="less").pvalue)


def summarize(logs: list[Log], target: float | None, target_note: str = "") -> Summary:
    finals = [log.final for log in logs if log.final is not None]
    losses = [v.loss for v in finals]
    times = [v.time_ms for v in finals if v.time_ms is not None]
    n = len(losses)
    mean = statistics.fmean(losses) if losses else math.nan
    finite = all(math.isfinite(x) for x in losses)
    std = (statistics.stdev(losses) if finite else math.nan) if n >= 2 else None  # stdev fails on inf and nan
    mean_time = statistics.fmean(times) if times else None
    p, note = None, ""
    if n < 2:
        note = f"n/a (n={n}: a t-test needs at least 2 runs)"
    elif target is None:
        note = f"n/a (no target: {target_note or 'pass --target X'})"
    elif not finite:
        note = "n/a (a final val loss is not finite)"
    elif std == 0:
        note = "n/a (every run has the same final val loss, so the t-test is undefined; vary --seed)"
    else:
        p = t_test_less(losses, target)
    return Summary(n, losses, times, mean, std, mean_time, target, p, note)


def track_of_path(path: Path) -> str | None:
    parts = path.resolve().parts
    return next((part for part in reversed(parts[:-1]) if part in TRACKS), None)


def track_of_hparams(log: Log) -> str | None:
    val_files = log.hparams.get("val_files", "").lower()
    if "fineweb" in val_files:
        return "track_1_short"
    if "shakespeare" in val_files:
        return "track_cpu"
    return None


def infer_target(logs: list[Log]) -> tuple[float | None, str]:
    """(target, where it came from) or (None, why there is none)."""
    tracks = {}
    for log in logs:
        track = track_of_path(log.path)
        how = "from the path"
        if track is None:
            track, how = track_of_hparams(log), "from val_files"
        tracks.setdefault(track, (log, how))
    if None in tracks:
        return None, f"{tracks[None][0].path} belongs to no known track; pass --target X"
    if len(tracks) > 1:
        return None, f"the logs belong to different tracks ({', '.join(sorted(tracks))}); pass --target X"
    (track, (_, how)), = tracks.items()
    return TRACKS[track].target, f"{track}, {how}"


def fmt_p(p: float | None, note: str = "") -> str:
    return f"{p:.4g}" if p is not None else note or "n/a"


def fmt_seconds(ms: float | None) -> str:
    return "n/a" if ms is None else f"{ms / 1000:.1f} s"


# ------------------------------------------------------------------------------------------------
# Presets from a logged source, for the command that reproduces a record

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}


def _constant(node: ast.AST):
    """The value of a constant expression: literals, arithmetic, tuples/lists/dicts, dict(k=v)."""
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _constant(node.operand)
        return -value if isinstance(node.op, ast.USub) else +value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        left, right = _constant(node.left), _constant(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > 64:
            raise ValueError("exponent too large")
        return _OPS[type(node.op)](left, right)
    if isinstance(node, (ast.Tuple, ast.List)):
        values = [_constant(e) for e in node.elts]
        return tuple(values) if isinstance(node, ast.Tuple) else values
    if isinstance(node, ast.Dict) and None not in node.keys:
        return {_constant(k): _constant(v) for k, v in zip(node.keys, node.values)}
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "dict"
            and not node.args and all(kw.arg for kw in node.keywords)):
        return {kw.arg: _constant(kw.value) for kw in node.keywords}
    raise ValueError(f"not a constant: {ast.dump(node)[:60]}")


def preset_values(source: str, preset: str) -> dict:
    """Hyperparameters(**PRESETS[preset]) as the logged source defined them, read without running it
    (a field whose default is not a constant is left out). Raises ValueError when it cannot."""
    tree = ast.parse(source)
    defaults, presets = {}, None
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == "Hyperparameters":
            for item in node.body:
                if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name) and item.value:
                    try:
                        defaults[item.target.id] = _constant(item.value)
                    except (ValueError, TypeError, ArithmeticError):
                        pass
        elif (isinstance(node, ast.Assign) and len(node.targets) == 1
              and isinstance(node.targets[0], ast.Name) and node.targets[0].id == "PRESETS"):
            presets = _constant(node.value)
    if not defaults or not isinstance(presets, dict) or preset not in presets:
        raise ValueError(f"no Hyperparameters class or preset {preset!r} in the source")
    return {**defaults, **presets[preset]}


def same_value(a, b) -> bool:
    return isinstance(a, bool) == isinstance(b, bool) and a == b


def command_lines(logs: list[Log]) -> list[str]:
    """The command that reproduces the runs: the preset plus every logged hyperparameter that differs
    from that preset's value, then the ones that varied from run to run."""
    first = logs[0]
    if not first.hparams:
        return ["The logs record no hyperparameters; see the source and the logs."]
    if first.preset is None:
        return ["The logs name no preset; their hyperparameters:", "", "```",
                *first.hparam_lines[1:], "```"]
    try:
        base = preset_values(first.require_sources()[FIRST_FILE], first.preset)
    except (ValueError, TypeError, SyntaxError, ArithmeticError, RecursionError) as e:
        return [f"(could not read preset {first.preset!r} from the logged source: {e}) The hyperparameters:",
                "", "```", *first.hparam_lines, "```"]

    def option(name, value):  # as train_gpt.py parses it: a tuple as comma-separated items
        if isinstance(value, bool):
            text = "true" if value else "false"
        else:
            text = ",".join(map(str, value)) if isinstance(value, tuple) else str(value)
        return shlex.quote(f"--{name}={text}")

    fixed, varied = [], []
    for name, text in first.hparams.items():
        if name in NOT_IN_COMMAND:
            continue
        values = [literal_or_none(log.hparams.get(name)) for log in logs]
        if all(same_value(v, values[0]) for v in values):
            if name not in base or not same_value(values[0], base[name]):
                fixed.append(option(name, values[0]))
        else:
            varied.append(f"`--{name}`: " + ", ".join(repr(v) for v in values))
    launcher = "python train_gpt.py"
    if first.world_size and first.world_size > 1:
        launcher = f"torchrun --standalone --nproc_per_node={first.world_size} train_gpt.py"
    if first.cpu_env:
        launcher = " ".join([*first.cpu_env, launcher])
    lines = ["```", " ".join([launcher, "--preset", first.preset, *fixed]), "```"]
    if varied:
        lines += ["", "Varied from run to run (in the order of the results above): " + "; ".join(varied)]
    return lines


# ------------------------------------------------------------------------------------------------
# Output helpers

COLORS = {"-": "\033[31m", "+": "\033[32m", "@": "\033[36m"}
RESET = "\033[0m"


def use_color(mode: str) -> bool:
    if mode == "always":
        return True
    if mode == "never":
        return False
    return sys.stdout.isatty() and not os.environ.get("NO_COLOR")


def print_diff(lines, color: bool):
    for line in lines:
        line = line.rstrip("\n")
        code = None
        if line.startswith("@@"):
            code = COLORS["@"]
        elif line.startswith("-") and not line.startswith("---"):
            code = COLORS["-"]
        elif line.startswith("+") and not line.startswith("+++"):
            code = COLORS["+"]
        print(f"{code}{line}{RESET}" if color and code else line)


def records_dir(args) -> Path:
    return Path(getattr(args, "records_dir", None) or os.environ.get("RECORDS_DIR") or DEFAULT_RECORDS_DIR)


SUBMITTED_RE = re.compile(r"^- submitted:[ \t]*(\S.*?)[ \t]*$", re.MULTILINE)
NOT_SUBMITTED = datetime.datetime.min.replace(tzinfo=datetime.timezone.utc)  # a README that gives no time


def submitted_at(folder: Path) -> datetime.datetime:
    """When the record was submitted, as its README says (ISO 8601); NOT_SUBMITTED where it does not."""
    try:
        match = SUBMITTED_RE.search((folder / "README.md").read_text(encoding="utf-8"))
        if not match:
            return NOT_SUBMITTED
        when = datetime.datetime.fromisoformat(match[1])
        return when if when.tzinfo else when.replace(tzinfo=datetime.timezone.utc)
    except (OSError, UnicodeDecodeError, ValueError):
        return NOT_SUBMITTED


def record_date(folder_name: str) -> str:
    """YYYY-MM-DD of a record folder's name."""
    return RECORD_DIR_RE.fullmatch(folder_name)[1]


def record_folders(track_dir: Path) -> list[Path]:
    """Record folders of a track, newest first: by date, then (records of one date) by submission
    time, then by name."""
    if not track_dir.is_dir():
        return []
    folders = [p for p in track_dir.iterdir() if p.is_dir() and RECORD_DIR_RE.fullmatch(p.name)]
    return sorted(folders, key=lambda p: (record_date(p.name), submitted_at(p), p.name), reverse=True)


# ------------------------------------------------------------------------------------------------
# Commands


def cmd_list(args) -> int:
    root = records_dir(args)
    if args.track is not None and args.track not in TRACKS:
        raise RecordsError(f"unknown track {args.track!r}; tracks: {', '.join(TRACKS)}")
    tracks = [args.track] if args.track else list(TRACKS)
    for i, name in enumerate(tracks):
        track = TRACKS[name]
        if i:
            print()
        print(f"{name}: {track.description}; target val loss {track.target:g}")
        folders = record_folders(root / name)
        if not folders:
            print("  (no records yet)")
            continue
        rows, errors = [("date", "name", "mean time", "mean val loss", "runs", "p-value")], []
        for folder in folders:
            date, record = RECORD_DIR_RE.fullmatch(folder.name).groups()
            try:
                logs = [parse_log(p) for p in expand_paths([str(folder)])]
            except RecordsError as e:
                rows.append((date, record, "-", "-", "0", "-"))
                errors.append(f"  {folder.name}: {e}")
                continue
            s = summarize(logs, track.target)
            rows.append((date, record, fmt_seconds(s.mean_time_ms), f"{s.mean:.4f}", str(s.n),
                         fmt_p(s.p_value, "n/a")))
        widths = [max(len(row[c]) for row in rows) for c in range(len(rows[0]))]
        for row in rows:
            print("  " + "  ".join(cell.ljust(w) if c < 2 else cell.rjust(w)
                                   for c, (cell, w) in enumerate(zip(row, widths))).rstrip())
        for line in errors:
            print(line)
    return 0


def cmd_diff(args) -> int:
    a, b = parse_log(first_log(args.a)), parse_log(first_log(args.b))
    sources_a, sources_b = a.require_sources(), b.require_sources()
    color = use_color(args.color)
    if sources_a == sources_b:
        print(f"sources are identical ({sum(len(text.splitlines()) for text in sources_a.values())} lines in "
              f"{', '.join(sources_a)})")
    for name in [*sources_a, *(n for n in sources_b if n not in sources_a)]:
        old, new = sources_a.get(name, ""), sources_b.get(name, "")
        if old != new:
            print_diff(difflib.unified_diff(old.splitlines(), new.splitlines(), f"{a.path} ({name})",
                                            f"{b.path} ({name})", lineterm=""), color)
    print()
    missing = [str(log.path) for log in (a, b) if not log.hparam_lines]
    if missing:
        print(f"note: no hyperparameters block in {' or '.join(missing)}; hyperparameters not compared")
    elif a.hparam_lines == b.hparam_lines:
        print("hyperparameters are identical")
    else:
        print_diff(difflib.unified_diff(a.hparam_lines, b.hparam_lines, f"{a.path} (hyperparameters)",
                                        f"{b.path} (hyperparameters)", lineterm=""), color)
    return 0


def cmd_stats(args) -> int:
    logs = [parse_log(p) for p in expand_paths(args.paths)]
    if args.target is not None:
        target, how = args.target, "--target"
    else:
        target, how = infer_target(logs)
    names = labels(logs)
    width = max(len(name) for name in names)
    print(f"{'run'.ljust(width)}  {'final val loss':>14}  {'train_time':>12}  note")
    for log, name in zip(logs, names):
        final = log.final
        diverged = divergence(log)
        note = ("no validation line" if final is None else
                f"last validation at step {final.step} of {final.total}: incomplete" if not log.complete else
                f"diverged: {diverged}" if diverged else "")
        loss = f"{final.loss:.4f}" if final else "-"
        time_ms = f"{final.time_ms}ms" if final and final.time_ms is not None else "-"
        print(f"{name.ljust(width)}  {loss:>14}  {time_ms:>12}  {note}".rstrip())
    s = summarize(logs, target, how)
    print(f"n: {s.n}")
    print(f"mean final val loss: {s.mean:.6f}")
    print(f"std final val loss: {s.std:.6f} (sample, ddof=1)" if s.std is not None else
          f"std final val loss: n/a (n={s.n}: needs at least 2 runs)")
    print(f"mean training time: {s.mean_time_ms:.1f}ms ({fmt_seconds(s.mean_time_ms)})" if s.mean_time_ms is not None
          else "mean training time: n/a")
    if target is not None:
        print(f"target: {target:g} ({how})")
    print(f"p-value (one-sided t-test that the mean is below the target): {fmt_p(s.p_value, s.p_note)}")
    return 0


PLOT_WIDTH = 12.0  # inches; the PNG is PLOT_WIDTH * dpi pixels wide
ZOOM_HEIGHT, FULL_HEIGHT = 4.0, 2.4  # inches: the zoomed panels, and the whole-run panels under them
ZOOM_MARGIN = 0.08  # of a zoom's span, added beyond its extremes so no point sits on the frame
LEGEND_FONTSIZE = 8  # points
RUN_COLORS = ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown", "tab:pink",
              "tab:olive", "tab:cyan", "tab:gray")  # matplotlib's tab10, grey last: the target line is black
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")
LINESTYLES = ("-", "--", ":", "-.")
UUID_RE = re.compile(r"[0-9a-f]{8}(?:-[0-9a-f]{4}){3}-[0-9a-f]{12}", re.IGNORECASE)


def plot_labels(logs: list[Log]) -> list[str]:
    """'<record folder>/<run name>' for each log: its run_id (else file name), a uuid (the name upstream's logs
    and train_gpt.py's default run_id have) cut to its first 8 hex digits; where that repeats (a resumed run's
    logs share their run_id), the file name instead."""
    def short(name: str) -> str:
        return name[:8] if UUID_RE.fullmatch(name) else name

    names = [f"{log.path.parent.name}/{short(log.label)}" for log in logs]
    return [f"{log.path.parent.name}/{short(log.path.stem)}" if names.count(name) > 1 else name
            for log, name in zip(logs, names)]


def run_styles(logs: list[Log]) -> list[dict]:
    """Line properties for each log. With logs from several folders the colour names the record and
    the marker the run within it; from one folder the colour names the run. Each pass through
    RUN_COLORS changes the line style and shifts the markers, so that 40 runs stay distinct."""
    folders = list(dict.fromkeys(log.path.resolve().parent for log in logs))
    groups = [folders.index(log.path.resolve().parent) if len(folders) > 1 else i for i, log in enumerate(logs)]
    styles = []
    for i, group in enumerate(groups):
        cycle = group // len(RUN_COLORS)
        styles.append(dict(color=RUN_COLORS[group % len(RUN_COLORS)], linestyle=LINESTYLES[cycle % len(LINESTYLES)],
                           marker=MARKERS[(groups[:i].count(group) + cycle) % len(MARKERS)]))
    return styles


def padded(low: float, high: float) -> tuple[float, float]:
    """low..high widened by ZOOM_MARGIN of its span each way; a span of 0 by that of its size instead."""
    pad = ZOOM_MARGIN * ((high - low) or max(abs(high), 1.0))
    return low - pad, high + pad


def zoom_window(logs: list[Log], target: float | None) -> tuple[float, float] | None:
    """The val losses where records are decided, padded: from the lowest loss shown (or the target,
    if lower) up to the target or the highest final loss, whichever is higher. Final losses are
    those of the complete runs that did not diverge, or of all runs when there are none (a run
    still going, stopped early or diverged would stretch the zoom to its current loss). Without a target the final losses
    alone bound it above. None when no loss is finite."""
    ends = [log.final.loss for log in ([log for log in logs if log.complete and not divergence(log)] or logs)]
    levels = [x for x in [*ends, target] if x is not None and math.isfinite(x)]
    lows = [v.loss for log in logs for v in log.vals if math.isfinite(v.loss)] + levels
    if not lows:
        return None
    return padded(min(lows), max(levels or lows))


def x_window(curves: list[list[tuple[float, float]]], bottom: float, top: float) -> tuple[float, float] | None:
    """The x range, padded, of each curve's (x, loss) points within bottom..top, and of where the
    segment before its first one there crosses top, so the line entering the zoom from above shows.
    None when no point is within."""
    xs = []
    for points in curves:
        inside = [i for i, (_, loss) in enumerate(points) if bottom <= loss <= top]
        if inside:
            first, last = inside[0], inside[-1]
            xs += [x for x, _ in points[first:last + 1]]
            if first and math.isfinite(points[first - 1][1]):
                (x0, y0), (x1, y1) = points[first - 1:first + 1]
                xs.append(x1 - (x1 - x0) * (top - y1) / (y0 - y1))
    return padded(min(xs), max(xs)) if xs else None


def legend_layout(entries: list[str], renderer) -> tuple[int, float]:
    """(columns, height in inches) of a legend of these entries across PLOT_WIDTH: as many columns as
    fit, each as wide as the widest entry and its line sample, with matplotlib's spacings around.
    Text is measured as renderer draws it: at a low dpi it is relatively wider."""
    import matplotlib
    from matplotlib.font_manager import FontProperties

    rc = matplotlib.rcParams
    font = FontProperties(size=LEGEND_FONTSIZE)
    widest = max(renderer.get_text_width_height_descent(text, font, ismath=False)[0]
                 for text in entries) * 72 / renderer.dpi
    column = widest + (rc["legend.handlelength"] + rc["legend.handletextpad"]) * LEGEND_FONTSIZE  # points
    gap = rc["legend.columnspacing"] * LEGEND_FONTSIZE
    frame = 2 * (rc["legend.borderpad"] + rc["legend.borderaxespad"]) * LEGEND_FONTSIZE
    columns = max(1, min(len(entries), int((PLOT_WIDTH * 72 - frame + gap) // (column + gap))))
    rows = math.ceil(len(entries) / columns)
    return columns, (rows * (1 + rc["legend.labelspacing"]) * LEGEND_FONTSIZE + frame) / 72


def plot_figure(logs: list[Log], target: float | None, dpi: int):
    """The figure cmd_plot saves, for logs with validation lines: val loss against training time
    (left) and step (right), above zoomed to zoom_window with the x range x_window gives, below over
    the whole runs; the target a dashed black line; under it all one legend naming each run by
    plot_labels. Points without a train_time are left out of the time panels."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    names = plot_labels(logs)
    entries = names + ([f"target {target:g}"] if target is not None else [])
    fig = Figure(dpi=dpi, layout="constrained")
    FigureCanvasAgg(fig)  # a figure made without pyplot needs a canvas to draw on
    columns, legend_height = legend_layout(entries, fig.canvas.get_renderer())
    fig.set_size_inches(PLOT_WIDTH, ZOOM_HEIGHT + FULL_HEIGHT + legend_height)
    (zoom_time, zoom_step), (full_time, full_step) = fig.subplots(2, 2, height_ratios=(ZOOM_HEIGHT, FULL_HEIGHT))
    window = zoom_window(logs, target)
    styles = run_styles(logs)
    by_time = [[(v.time_ms / 1000, v.loss) for v in log.vals if v.time_ms is not None] for log in logs]
    by_step = [[(v.step, v.loss) for v in log.vals] for log in logs]
    for zoom, full, curves, xlabel in ((zoom_time, full_time, by_time, "training time (s)"),
                                       (zoom_step, full_step, by_step, "step")):
        for ax, size in ((zoom, 5), (full, 3)):
            for points, style, label in zip(curves, styles, names):
                ax.plot([x for x, _ in points], [loss for _, loss in points], label=label, markersize=size,
                        linewidth=1.2, **style)
            if target is not None:
                ax.axhline(target, color="black", linestyle="--", linewidth=1, label=entries[-1])
            ax.set_xlabel(xlabel)
            ax.set_ylabel("val loss")
            ax.grid(True, alpha=0.3)
            if not any(curves):
                ax.text(0.5, 0.5, "no train_time in these logs", transform=ax.transAxes, ha="center")
        if window:
            zoom.set_ylim(window)
        xs = x_window(curves, *window) if window else None
        if xs:  # steps are whole: an interval holding none would get fractional ticks
            zoom.set_xlim((math.floor(xs[0]), math.ceil(xs[1])) if zoom is zoom_step else xs)
        zoom.ticklabel_format(axis="y", useOffset=False)
    for ax in (zoom_step, full_step):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    zoom_time.set_title("val loss against training time (zoomed)")
    zoom_step.set_title("val loss against step (zoomed)")
    for full in (full_time, full_step):
        full.set_title("whole runs", fontsize="medium")
    fig.legend(handles=zoom_step.get_lines(), loc="outside lower center", ncols=columns, fontsize=LEGEND_FONTSIZE)
    return fig


def cmd_plot(args) -> int:
    out = Path(args.output)
    if out.exists() and not args.force:
        raise RecordsError(f"{out} exists; pass --force to overwrite it")
    logs = [parse_log(p) for p in expand_paths(args.paths)]
    plotted = [log for log in logs if log.vals]
    for log in logs:
        if not log.vals:
            print(f"warning: {log.path}: no validation lines; not plotted", file=sys.stderr)
    if not plotted:
        raise RecordsError("no validation lines in any log; nothing to plot")
    target = args.target if args.target is not None else infer_target(logs)[0]
    fig = plot_figure(plotted, target, args.dpi)

    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            fig.savefig(f, format="png", dpi=args.dpi)
        if args.force:
            os.replace(tmp, out)
        else:
            os.link(tmp, out)  # fails, rather than overwrites, if out appeared meanwhile
            os.unlink(tmp)
    except FileExistsError:
        raise RecordsError(f"{out} exists; pass --force to overwrite it") from None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    print(f"wrote {out} ({len(plotted)} runs)")
    return 0


def cmd_check(args) -> int:
    log = parse_log(Path(args.log))
    script = Path(args.script)
    # the first logged file against --script, the files logged after it against their namesakes beside it
    files = {name: script if name == FIRST_FILE else script.parent / name for name in log.require_sources()}
    diff = []
    for name, path in files.items():
        if not path.exists():
            diff.append(f"{path}: not in this checkout (the log holds {name})")
            continue
        try:
            current = path.read_text(encoding="utf-8", errors="replace")
        except OSError as e:
            raise RecordsError(f"{path}: cannot read ({e.strerror or e})") from None
        # blank lines at the end do not count: other forks log a file with one more
        diff += difflib.unified_diff(current.rstrip("\n").splitlines(), log.sources[name].rstrip("\n").splitlines(),
                                     f"{path}", f"{log.path} ({name})", n=1, lineterm="")
    if not diff:
        print(f"{log.path}: source is exactly {', '.join(map(str, files.values()))}")
        return 0
    print(f"{log.path}: source differs from {', '.join(map(str, files.values()))}:")
    limit = 40
    print_diff(diff[:limit], use_color(args.color))
    if len(diff) > limit:
        print(f"... {len(diff) - limit} more diff lines (tools/records.py diff shows them all)")
    return 1


def cmd_source(args) -> int:
    """Writes each file the log holds into DIR under its own name: all of them or none, never over an
    existing file (each is written to a temporary file, then linked to its name)."""
    log = parse_log(Path(args.log))
    sources = log.require_sources()
    folder = Path(args.dir)
    taken = [str(folder / name) for name in sources if (folder / name).exists()]
    if taken:
        raise RecordsError(f"{', '.join(taken)} exists; pick an empty folder for {log.path}'s source")
    umask = os.umask(0)
    os.umask(umask)
    temporary, linked = [], []
    try:
        folder.mkdir(parents=True, exist_ok=True)
        for name, text in sources.items():
            fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=folder)
            temporary.append(tmp)
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(text)
            os.chmod(tmp, 0o666 & ~umask)  # as a file made with open(); mkstemp makes it 0600
        for name, tmp in zip(sources, temporary):
            os.link(tmp, folder / name)  # fails, instead of overwriting, when the name was taken meanwhile
            linked.append(folder / name)
    except OSError as e:
        for path in linked:
            path.unlink()
        raise RecordsError(f"{e.filename or folder}: cannot write there ({e.strerror or e})") from None
    finally:
        for tmp in temporary:
            os.unlink(tmp)
    print(f"wrote {', '.join(str(folder / name) for name in sources)}; run them from the repository root with "
          f"python {folder / FIRST_FILE} and the logged hyperparameters")
    return 0


def diff_stat(old: str, new: str) -> tuple[int, int, int]:
    """(lines added, lines removed, hunks) from old to new."""
    added = removed = hunks = 0
    for line in difflib.unified_diff(old.splitlines(), new.splitlines(), lineterm=""):
        if line.startswith("@@"):
            hunks += 1
        elif line.startswith("+") and not line.startswith("+++"):
            added += 1
        elif line.startswith("-") and not line.startswith("---"):
            removed += 1
    return added, removed, hunks


def previous_record_note(track_dir: Path, folder_name: str, files: dict[str, str]) -> str:
    """The diff line against the newest record of the same date or earlier (a record submitted now
    is the newest of its date)."""
    older = [p for p in record_folders(track_dir) if record_date(p.name) <= record_date(folder_name)]
    if not older:
        return "This is the first record of this track."
    prev = older[0]
    rel = f"records/{track_dir.name}/{prev.name}"
    try:
        logs = record_logs(prev)
        if not logs:
            return f"The previous record, `{rel}`, holds no logs to compare with."
        prev_files = parse_log(logs[0]).require_sources()
    except RecordsError as e:
        return f"The previous record, `{rel}`, could not be compared: {e}"
    if prev_files == files:
        return f"The source is identical to that of the previous record, `{rel}`."
    stats = [(name, *diff_stat(prev_files.get(name, ""), files.get(name, "")))
             for name in [*files, *(n for n in prev_files if n not in files)]]
    changed = "; ".join(f"{name}, {added} insertion(s)(+), {removed} deletion(s)(-) in {hunks} hunk(s)"
                        for name, added, removed, hunks in stats if added or removed) or "line endings only"
    return (f"Source diff against the previous record, `{rel}`: {changed}; "
            f"`python tools/records.py diff {rel} records/{track_dir.name}/{folder_name}` shows it.")


def readme_text(track_name: str, name: str, date: str, logs: list[Log], prev_note: str, submitted: str) -> str:
    track = TRACKS[track_name]
    s = summarize(logs, track.target)
    meets = s.p_value is not None and s.p_value < P_THRESHOLD and s.mean < track.target
    lines = [f"# {name}", "",
             f"Track `{track_name}` ({track.description}; target val loss {track.target:g}), {date}.", "",
             "## What changed", "", "TODO: describe the change", "", prev_note, "",
             "## Results", "",
             "| run | final val loss | training time |", "|---|---|---|"]
    for log in logs:
        lines.append(f"| `{log.path.name}` | {log.final.loss:.4f} | {fmt_seconds(log.final.time_ms)} |")
    lines += ["",
              f"- runs: {s.n}",
              f"- mean final val loss: {s.mean:.4f}",
              f"- std: {s.std:.5f} (sample, ddof=1)" if s.std is not None else f"- std: n/a (n={s.n})",
              f"- p-value, one-sided t-test that the mean is below {track.target:g} "
              f"(scipy.stats.ttest_1samp, alternative=\"less\"): {fmt_p(s.p_value, s.p_note)}",
              f"- mean training time: {fmt_seconds(s.mean_time_ms)}"
              + (f" ({s.mean_time_ms:.0f}ms)" if s.mean_time_ms is not None else ""),
              f"- meets the rule (mean below {track.target:g} with p < {P_THRESHOLD}): {'yes' if meets else 'no'}",
              f"- submitted: {submitted}",
              "", "## Hardware and software (as logged)", "", "```", *(logs[0].header or ["(not logged)"]), "```"]
    if any(log.header != logs[0].header for log in logs[1:]):
        lines += ["", "(as logged by the first run; the other logs' environment lines differ, see the logs)"]
    lines += ["", "## Command", "", *command_lines(logs), ""]
    return "\n".join(lines)


def submittable_logs(paths: list[Path]) -> list[Log]:
    """The parsed logs of one record's runs: each finished, not diverged, not resumed, and all of the same source."""
    for path in paths:
        if not path.is_file():
            raise RecordsError(f"{path}: no such log file")
    names = [p.name for p in paths]
    if len(set(names)) != len(names):
        raise RecordsError(f"two logs share a file name ({', '.join(sorted({n for n in names if names.count(n) > 1}))}); "
                           f"each run needs its own run_id")
    logs = [parse_log(p) for p in paths]
    for log in logs:
        log.require_source()
        if log.final is None:
            raise RecordsError(f"{log.path}: no final val loss (no validation line)")
        if not log.complete:
            raise RecordsError(f"{log.path}: no final val loss (the last validation is at step {log.final.step} "
                               f"of {log.final.total}; did the run finish?)")
        if not math.isfinite(log.final.loss):
            raise RecordsError(f"{log.path}: the final val loss is {log.final.loss}")
        diverged = divergence(log)
        if diverged:
            raise RecordsError(f"{log.path}: the run diverged: {diverged}")
        if log.resumed:
            raise RecordsError(f"{log.path}: a resumed run; its train_time does not cover the whole run")
    for log in logs[1:]:
        if log.source != logs[0].source:
            added, removed, _ = diff_stat(logs[0].source, log.source)
            raise RecordsError(f"the logs' sources differ: {log.path} vs {logs[0].path} (+{added} -{removed} lines; "
                               f"tools/records.py diff shows them); a record's runs must all run the same code")
    return logs


def cmd_submit(args) -> int:
    if args.track not in TRACKS:
        raise RecordsError(f"unknown track {args.track!r}; tracks: {', '.join(TRACKS)}")
    if not NAME_RE.fullmatch(args.name):
        raise RecordsError(f"name {args.name!r} may hold only letters, digits, '-' and '_'")
    date = datetime.date.today().isoformat() if args.date is None else args.date  # --date '' is refused
    try:
        if not re.fullmatch(r"\d{4}-\d{2}-\d{2}", date):
            raise ValueError
        datetime.date.fromisoformat(date)
    except ValueError:
        raise RecordsError(f"--date {date!r} is not a date of the form YYYY-MM-DD") from None
    paths = [Path(p) for p in args.logs]
    logs = submittable_logs(paths)
    track_dir = records_dir(args) / args.track
    folder = track_dir / f"{date}_{args.name}"
    if folder.exists():
        raise RecordsError(f"{folder} exists; pick another --name or --date")

    submitted = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="microseconds")  # orders records of one date
    readme = readme_text(args.track, args.name, date, logs, previous_record_note(track_dir, folder.name, logs[0].sources),
                         submitted)
    track_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".submit-{folder.name}.", dir=track_dir))
    try:
        for path in paths:
            shutil.copy2(path, tmp / path.name)
        (tmp / "README.md").write_text(readme, encoding="utf-8")
        os.chmod(tmp, 0o755)  # mkdtemp makes it 0700
        if folder.exists():
            raise RecordsError(f"{folder} exists; pick another --name or --date")
        os.rename(tmp, folder)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    s = summarize(logs, TRACKS[args.track].target)
    print(f"created {folder}: {len(logs)} logs and README.md; mean final val loss {s.mean:.4f}, "
          f"p-value {fmt_p(s.p_value, s.p_note)} (target {TRACKS[args.track].target:g})")
    print(f"now edit {folder / 'README.md'}: describe what changed")
    return 0


# ------------------------------------------------------------------------------------------------
# Command line


def build_parser() -> argparse.ArgumentParser:
    records_opt = argparse.ArgumentParser(add_help=False)
    records_opt.add_argument("--records-dir", default=argparse.SUPPRESS,
                             help=f"the records folder (default: $RECORDS_DIR or {DEFAULT_RECORDS_DIR})")
    color_opt = argparse.ArgumentParser(add_help=False)
    color_opt.add_argument("--color", choices=("auto", "always", "never"), default="auto",
                           help="colour diffs: auto (on a terminal unless NO_COLOR is set), always, never")
    target_opt = argparse.ArgumentParser(add_help=False)
    target_opt.add_argument("--target", type=float, help="target val loss (default: the track's, from the path "
                                                         "records/<track>/... or the logged val_files)")

    parser = argparse.ArgumentParser(prog="tools/records.py", parents=[records_opt],
                                     description="List, diff, test, plot, check and submit speedrun records.",
                                     epilog=f"tracks: {', '.join(f'{k} (target {v.target:g})' for k, v in TRACKS.items())}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("list", parents=[records_opt], help="records of one track or all, newest first")
    p.add_argument("track", nargs="?", metavar="TRACK")
    p.set_defaults(func=cmd_list)

    p = sub.add_parser("diff", parents=[color_opt], help="diff the source and hyperparameters two runs logged")
    p.add_argument("a", metavar="A", help="log file, or record or track folder (its first log)")
    p.add_argument("b", metavar="B", help="log file, or record or track folder (its first log)")
    p.set_defaults(func=cmd_diff)

    p = sub.add_parser("stats", parents=[target_opt], help="final val losses, mean, std, t-test p-value")
    p.add_argument("paths", nargs="+", metavar="PATH", help="log files, record folders or track folders")
    p.set_defaults(func=cmd_stats)

    p = sub.add_parser("plot", parents=[target_opt], help="val loss against training time and step, to a PNG",
                       description="Val loss against training time and against step: above, zoomed from the "
                                   "lowest loss shown to just above the target (records/README.md says how); below, "
                                   "the whole runs; each run named <record folder>/<run_id>.")
    p.add_argument("paths", nargs="+", metavar="PATH", help="log files, record folders or track folders")
    p.add_argument("-o", "--output", required=True, metavar="FILE.png")
    p.add_argument("--force", action="store_true", help="overwrite FILE.png if it exists")
    p.add_argument("--dpi", type=int, default=100, help=f"pixels per inch; the figure is {PLOT_WIDTH:g} in wide")
    p.set_defaults(func=cmd_plot)

    p = sub.add_parser("check", parents=[color_opt], help="is a log's source exactly the current train_gpt.py "
                                                          "(and the files it logs beside it)?")
    p.add_argument("log", metavar="LOG")
    p.add_argument("--script", default=str(ROOT / "train_gpt.py"), help="compare with this file instead "
                                                                      "(and its folder's namesakes of the other files)")
    p.set_defaults(func=cmd_check)

    p = sub.add_parser("source", help="write the files a log ran (train_gpt.py and run_support.py) into DIR")
    p.add_argument("log", metavar="LOG")
    p.add_argument("dir", metavar="DIR", help="a folder holding none of those files yet (made if missing)")
    p.set_defaults(func=cmd_source)

    p = sub.add_parser("submit", parents=[records_opt], help="create records/<track>/<date>_<name>/ from logs")
    p.add_argument("logs", nargs="+", metavar="LOG")
    p.add_argument("--track", required=True, help=f"one of {', '.join(TRACKS)}")
    p.add_argument("--name", required=True, help="letters, digits, '-' and '_'")
    p.add_argument("--date", help="YYYY-MM-DD (default: today)")
    p.set_defaults(func=cmd_submit)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    except SystemExit as e:  # --help (0) or a usage error (2, already printed)
        return e.code if isinstance(e.code, int) else 2
    try:
        return args.func(args)
    except RecordsError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `records.py diff ... | head`: stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
