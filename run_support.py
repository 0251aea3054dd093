"""What a run of train_gpt.py needs that never changes what it computes: the command line, the run log
and its reports (the run's layout, hardware, memory, throughput and MFU), checkpoints, stop signals and
the resume command, the GPU guard, the GPT-2 ranks file (pinned by its sha256). train_gpt.py logs this file's source after its own, so a log still
holds every line that ran. This module imports nothing from train_gpt.py.
"""

import argparse
import base64
import contextlib
import dataclasses
import fcntl
import hashlib
import inspect
import json
import math
import os
import platform
import re
import resource
import secrets
import shlex
import signal
import subprocess
import sys
import time
import uuid
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

SEPARATOR = "=" * 100  # ends the logged sources; tools/records.py splits logs on it
SECTION_RULE = "-" * 40  # each logged file after the first: a blank line, the rule, "# NAME", the rule, a blank line
THP_MODE_FILE = Path("/sys/kernel/mm/transparent_hugepage/enabled")  # e.g. "always [madvise] never"
THP_SETTING = "THP_MEM_ALLOC_ENABLE"  # torch's CPU allocator reads it once, at start-up: 1 or 0
# Dense bf16 tensor-core peaks of NVIDIA's datasheets, by a part of torch's device name: the most specific first.
PEAK_BF16_FLOPS = [("H100 PCIe", 756e12), ("H100 NVL", 835e12), ("H100", 989e12), ("H200 NVL", 835e12), ("H200", 989e12),
                   ("H800 PCIe", 756e12), ("H800", 989e12), ("A100", 312e12), ("L40S", 362e12), ("L40", 181e12),
                   ("L4", 121e12), ("RTX 4090", 165e12)]
PEAK_MEASURE_SECONDS = 1.0  # long enough to average out a thread's warm-up, short beside any run
PEAK_MEASURE_SIZE = {"cpu": 2048, "cuda": 8192}  # square matmuls on the plateau of each device's speed


class ConfigError(ValueError):
    """A setting, path or checkpoint the run cannot use; the message names it and says what to do."""


class WriteError(OSError):
    """A checkpoint or the log could not be written: the message names the file and the OS's reason."""


def os_reason(error: BaseException) -> str | None:
    """The OS's own words for a failed write, which torch's serializer wraps in errors of its own; None if none."""
    while error is not None and not (isinstance(error, OSError) and error.strerror):
        error = error.__cause__ or error.__context__
    return error.strerror if error is not None else None


# ------------------------------------------------------------------------------------------------
# The command line: a preset, then --key=value overrides of its hyperparameters


class OneLineParser(argparse.ArgumentParser):
    """A tool's command line whose errors are one line on stderr and exit 2, as train_gpt.py's are."""

    def error(self, message: str):
        self.exit(2, f"error: {message} (--help lists the options)\n")


def _convert(field: dataclasses.Field, text: str):
    kind = field.type if isinstance(field.type, type) else type(field.default)
    if kind is tuple:
        item = type(field.default[0]) if field.default else int  # a tuple's items are of its default's kind
        try:
            return tuple(item(part) for part in text.split(","))
        except ValueError:
            raise ConfigError(f"--{field.name}={text}: expected {'integers' if item is int else 'numbers'} separated "
                              f"by commas") from None
    if kind is bool:
        if text.lower() in ("1", "true", "yes", "on"):
            return True
        if text.lower() in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"--{field.name}={text}: expected true or false")
    try:
        return kind(text)
    except ValueError:
        raise ConfigError(f"--{field.name}={text}: expected {'an integer' if kind is int else 'a number' if kind is float else kind.__name__}") from None


def parse_options(argv: list[str], hyperparameters: type, presets: dict, default_preset: str) -> tuple[object, str]:
    """The hyperparameters dataclass of --preset NAME plus --key=value (or --key value; a bare --flag sets a bool)."""
    fields = {f.name: f for f in dataclasses.fields(hyperparameters)}
    preset, overrides, i = default_preset, {}, 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--"):
            raise ConfigError(f"unexpected argument {arg!r}; options look like --key=value (see --help)")
        key, has_value, value = arg[2:].partition("=")
        if not has_value and key != "preset" and key in fields and fields[key].type in (bool, "bool"):
            value, has_value = "true", True
        if not has_value:
            if i + 1 == len(argv):
                raise ConfigError(f"--{key} needs a value")
            i, value = i + 1, argv[i + 1]
        if key == "preset":
            if value not in presets:
                raise ConfigError(f"unknown preset {value!r}; valid presets: {', '.join(presets)}")
            preset = value
        elif key not in fields:
            raise ConfigError(f"unknown hyperparameter {key!r}; valid ones: {', '.join(fields)}")
        else:
            overrides[key] = _convert(fields[key], value)
        i += 1
    args = dataclasses.replace(hyperparameters(**presets[preset]), **overrides)
    return args, preset


def split_tool_options(argv: list[str], own: dict[str, int]) -> tuple[dict[str, int], list[str]]:
    """A tool's own positive-integer options (own: their defaults) apart from the rest, train_gpt's overrides."""
    own, rest = dict(own), []
    for arg in argv:
        key, _, value = arg.removeprefix("--").partition("=")
        if arg.startswith("--") and key in own:
            if not value.isdigit() or int(value) < 1:
                raise ConfigError(f"--{key}={value}: expected a positive integer")
            own[key] = int(value)
        else:
            rest.append(arg)
    return own, rest


def usage(doc: str, hyperparameters: type, presets: dict) -> str:
    """--help: the script's docstring, the presets, and every hyperparameter with its default and comment."""
    lines = [doc.strip(), "", f"presets: {', '.join(presets)} (default: record with CUDA, cpu without; train_gpt.main)",
             "hyperparameters (record defaults):"]
    source = inspect.getsource(hyperparameters).splitlines()
    for f in dataclasses.fields(hyperparameters):
        comment = next((line.split("#", 1)[1].strip() for line in source if line.strip().startswith(f"{f.name}:")), "")
        shown = ",".join(map(str, f.default)) if isinstance(f.default, tuple) else repr(f.default)  # as --key=value takes it
        lines.append(f"  --{f.name}={shown:<40} {comment}")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------
# The run log and what it reports


def logged_sources(paths: list[Path]) -> str:
    """The first file exactly as it is, each later one after a header naming it (as upstream logs its kernels)."""
    parts = []
    for i, path in enumerate(paths):
        text = path.read_text()
        text += "" if text.endswith("\n") else "\n"
        parts.append(text if i == 0 else f"\n{SECTION_RULE}\n# {path.name}\n{SECTION_RULE}\n\n{text}")
    return "".join(parts)


class RunLog:
    """Rank 0 writes logs/<run_id>.txt and flushes every line; other ranks write nothing."""

    def __init__(self, path: Path | None):
        self.path, self.file = path, None
        if path is not None:
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                self.file = open(path, "x")  # "x": never overwrite another run's log
            except FileExistsError:
                raise ConfigError(f"{path} already exists: run_id {path.stem!r} was used before; pick another "
                                  f"--run_id (logs are never overwritten)") from None
            except OSError as e:
                raise ConfigError(f"--log_dir={path.parent}: cannot write the log there ({e.strerror}); "
                                  f"pick a writable folder") from None

    def __call__(self, message: str, console: bool = True):
        if self.file is None:
            return
        if console:
            print(message, flush=True)
        self.write(message + "\n")

    def write(self, text: str):
        try:
            self.file.write(text)
            self.file.flush()
        except OSError as e:  # a run whose log cannot be written stops: its record would be lost
            raise WriteError(f"{self.path}: the log could not be written ({os_reason(e) or e}); the run stops") from None

    def header(self, sources: str, args, preset: str, device: torch.device, world_size: int, choices):
        """The logged sources, then what a reader needs to reproduce or compare the run."""
        if self.file is not None:
            self.write(sources + SEPARATOR + "\n")
        self(f"python {sys.version.split()[0]} | {torch_description()}"
             f"{f' | CUDA {torch.version.cuda}' if torch.version.cuda else ''}", console=False)
        untested = untested_torch_message()
        if untested:
            self(f"warning: {untested}")
        for line in describe_hardware(device, world_size):
            self(line, console=False)
        self(f"hyperparameters (preset {preset}):", console=False)
        for name, value in dataclasses.asdict(args).items():
            self(f"  {name}: {value!r}", console=False)
        self("fast paths:", console=False)
        for line in [*choices, *(cpu_memory_lines(args.dtype) if device.type == "cpu" else [])]:
            self(f"  {line}", console=False)

    def close(self):
        if self.file is not None:
            with contextlib.suppress(OSError):  # what could not be written has ended the run already, naming the log
                self.file.close()


def describe_hardware(device: torch.device, world_size: int) -> list[str]:
    """A summary line that compares across runs, then nvidia-smi's table on CUDA."""
    if device.type == "cuda":
        try:
            details = subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=30).stdout.rstrip()
        except (OSError, subprocess.TimeoutExpired) as e:
            details = f"nvidia-smi unavailable: {e}"
        return [f"hardware: {world_size}x {torch.cuda.get_device_name(device)}", *([details] if details else [])]
    model = platform.processor() or platform.machine()
    with contextlib.suppress(OSError, StopIteration):
        model = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                     if line.startswith("model name"))
    return [f"hardware: {world_size}x CPU {model}, {os.cpu_count()} logical cores, "
            f"torch uses {torch.get_num_threads()} threads per process"]


def cpu_memory_lines(dtype: str) -> list[str]:
    """The memory settings ./run.sh makes for CPU runs, on or off (tools/records.py reads them back)."""
    malloc = os.environ.get("MALLOC_MMAP_MAX_") == "0"
    return [f"glibc malloc tuning: {'on' if malloc else 'off (MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=... not set; ./run.sh sets them)'}",
            huge_pages_line(dtype)]


def huge_pages_line(dtype: str, environ=os.environ, mode_file: Path = THP_MODE_FILE) -> str:
    """Whether large CPU tensors get 2 MB pages (THP_MEM_ALLOC_ENABLE=1 asks for them): they speed up bfloat16 and
    slow float32 (records/track_cpu/README.md), so ./run.sh asks in bfloat16 runs only."""
    try:
        mode = mode_file.read_text().split("[", 1)[1].split("]", 1)[0]
    except (OSError, IndexError):
        mode = "unknown"
    if mode in ("never", "always"):
        return f"huge pages: {'off' if mode == 'never' else 'on'} (the kernel's transparent huge pages are set to {mode})"
    if environ.get(THP_SETTING) != "1":
        why = f"{THP_SETTING}=1 not set" if dtype == "bfloat16" else dtype
        return f"huge pages: off ({why}: ./run.sh sets {THP_SETTING}=1 for bfloat16 runs; kernel mode {mode})"
    return (f"huge pages: on for tensors of 2 MB or more ({THP_SETTING}=1; kernel mode {mode})"
            + ("" if dtype == "bfloat16" else f", though {dtype} ran slower with them"))


def huge_page_kib(smaps: Path = Path("/proc/self/smaps_rollup")) -> int | None:
    """This process's memory in transparent huge pages (AnonHugePages), or None where Linux does not say."""
    try:
        return next(int(line.split()[1]) for line in smaps.read_text().splitlines() if line.startswith("AnonHugePages:"))
    except (OSError, StopIteration):
        return None


def peak_memory_line(device: torch.device) -> str:
    if device.type == "cuda":
        return (f"peak memory allocated: {torch.cuda.max_memory_allocated() // 2**20} MiB "
                f"reserved: {torch.cuda.max_memory_reserved() // 2**20} MiB")
    max_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    line = f"peak memory (RSS): {max_rss // (2**20 if sys.platform == 'darwin' else 2**10)} MiB"
    huge = huge_page_kib()
    return line if huge is None else f"{line}, {huge // 1024} MiB of it in 2 MB pages now"


def datasheet_peak(device_name: str) -> float | None:
    """The dense bf16 peak of a known GPU by torch's name for it; None for others, and for a MIG slice
    or a laptop part, whose peaks are their own."""
    if any(part in device_name for part in ("MIG", "Laptop")):
        return None
    return next((flops for gpu, flops in PEAK_BF16_FLOPS if gpu in device_name), None)


def matmul_peak(device: torch.device, dtype: torch.dtype, seconds: float = PEAK_MEASURE_SECONDS) -> tuple[float, str]:
    """FLOP/s of one process that MFU is measured against, and where the figure comes from: the
    datasheet's dense bf16 peak for known GPUs, else square matmuls in the run's dtype, timed here."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        known = datasheet_peak(name)
        if known:
            return known, f"{known / 1e12:.0f} TFLOP/s bf16 ({name} datasheet)"
    size = PEAK_MEASURE_SIZE[device.type if device.type == "cuda" else "cpu"]
    a, b = (torch.randn(size, size, device=device).to(dtype) for _ in range(2))
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    a @ b  # the first call allocates and warms up
    sync()
    repeats, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        a @ b
        sync()
        repeats += 1
    elapsed = time.perf_counter() - t0
    flops = 2 * size**3 * repeats / elapsed
    return flops, f"{flops / 1e9:.1f} GFLOP/s {str(dtype).removeprefix('torch.')} measured ({repeats} {size}x{size} matmuls in {elapsed:.2f}s)"


def flops_per_token(model, args) -> float:
    """Training FLOPs per token: 6 per matmul weight, plus QK^T and AV (forward and backward) over the keys a
    query sees on average, half its layer's window (or sequence), averaged over the window stages."""
    matmul_weights = sum(p.numel() for name, p in model.named_parameters() if p.ndim >= 2 and "embed" not in name)
    windows = [min((stage if long else stage // 2) * args.window_unit, max(args.seq_len)) / 2
               for block, long in zip(model.blocks, model.long_window) if block.attn is not None
               for stage in args.window_stages]
    keys = sum(windows) / len(args.window_stages)  # over the attention layers
    return 6 * matmul_weights + 12 * args.num_heads * args.head_dim * keys


def stage_flops_per_token(model, args, seq_len: int, window: int) -> float:
    """flops_per_token() of one stage: its sequence length and long window alone."""
    return flops_per_token(model, dataclasses.replace(args, seq_len=(seq_len,), window_stages=(window,)))


@dataclasses.dataclass
class TrainingClock:
    """Training time excludes validation, checkpoints and the warm-up steps (which compile), as in the
    speedrun logs; without warm-up steps the first step compiles on the clock. Validation is timed apart."""
    training_ms: float = 0.0
    timed_steps: int = 0
    timed_tokens: int = 0
    first_step_ms: float = 0.0  # step 1, which compiles (with compile on and no warm-up steps); 0 once resumed
    first_step_tokens: int = 0
    validation_ms: float = 0.0  # all validations so far (off the training clock)
    validations: int = 0  # how many that time covers
    stage: str = ""  # the stage (seq_len x window, as the log names it) of the steps being timed
    stages: dict = dataclasses.field(default_factory=dict)  # each stage's [steps, tokens, ms]

    def add_time(self, ms: float):
        """Training time since the clock last resumed, in the current stage."""
        self.training_ms += ms
        if self.stage:
            self.stages.setdefault(self.stage, [0, 0, 0.0])[2] += ms

    def count_step(self, tokens: int):
        self.timed_steps += 1
        self.timed_tokens += tokens
        counts = self.stages.setdefault(self.stage, [0, 0, 0.0])
        counts[0] += 1
        counts[1] += tokens

    def timed_validation(self, validate) -> float:
        """validate()'s loss, its time added to the validation total."""
        start = time.perf_counter()
        loss = validate()
        self.validation_ms += 1000 * (time.perf_counter() - start)
        self.validations += 1
        return loss

    def throughput_lines(self, flops_per_token: float, peak: tuple[float, str], world_size: int,
                         stage_flops: dict | None = None) -> list[str]:
        """Tokens/s and MFU over the timed steps, over the steps after step 1 (which may compile), and in each stage
        (step 1 included), at the stage's own FLOPs per token where stage_flops has them."""
        def rate(tokens: int, ms: float, flops: float = flops_per_token) -> str:
            tokens_per_second = tokens / max(ms / 1000, 1e-9)
            achieved = flops * tokens_per_second
            return (f"{tokens_per_second:.0f} tokens/s, {achieved / 1e9:.1f} GFLOP/s, "
                    f"MFU {100 * achieved / (peak[0] * world_size):.1f}%")

        lines = [f"throughput: {rate(self.timed_tokens, self.training_ms)} of {world_size} x {peak[1]}"]
        if self.timed_steps > 1 and self.first_step_ms:
            lines.append(f"throughput after step 1, which took {self.first_step_ms / 1000:.1f} s: "
                         f"{rate(self.timed_tokens - self.first_step_tokens, self.training_ms - self.first_step_ms)}")
        if len(self.stages) > 1:
            for stage, (steps, tokens, ms) in self.stages.items():
                flops = (stage_flops or {}).get(stage, flops_per_token)
                lines.append(f"stage {stage}: {steps} steps, step_avg:{ms / max(steps, 1):.2f}ms, {rate(tokens, ms, flops)}")
        return lines


def describe_run(trainer) -> list[str]:
    """The model, Muon's rounds, the distribution, batch, windows, embedding tie and gradient sum of a train_gpt
    Trainer."""
    args, model, buckets, world_size = trainer.args, trainer.model, trainer.buckets, trainer.world_size
    lines = [f"model: {sum(p.numel() for p in model.parameters()):,} parameters; value embeddings {model.ve_layout}; "
             f"attention-free layer {next((i for i, block in enumerate(model.blocks) if block.attn is None), None)}; key offset "
             f"on layers {[i for i, block in enumerate(model.blocks) if block.attn is not None and block.attn.key_offset]}; "
             f"long-window layers "
             f"{[i for i, long in enumerate(model.long_window) if long]}; heads paired on layers "
             f"{[i for i, paired in enumerate(model.paired) if paired]}; skip from layer "
             f"{model.skip_source}; later layers attend over layer {model.backout_layer}'s "
             f"output; XSA on layers {list(model.xsa_layers)}; matrices "
             f"{str(model.blocks[0].mlp.c_fc.dtype).removeprefix('torch.')}"]
    lines.append(f"muon: {len(trainer.muon.rounds)} rounds; orthogonalization GFLOPs per rank "
                 f"{[round(f / 1e9, 2) for f in trainer.muon.flops_per_rank]}")
    if world_size > 1:
        lines.append(f"distributed: world size {world_size}, backend {dist.get_backend()}, {len(buckets.buckets)} "
                     f"gradient buckets of {[round(b / 1e6, 2) for b in buckets.bucket_bytes()]} MB")
    else:
        lines.append("distributed: world size 1, no gradient communication")
    lines.append(f"batch: {args.batch_slots} sequences x {'/'.join(map(str, args.seq_len))} tokens per step "
                 f"{'(stages in equal parts of training) ' if len(args.seq_len) > 1 else ''}= {world_size} ranks x "
                 f"{trainer.grad_accum_steps} micro-steps; " + (f"documents packed, each clipped to {'/'.join(map(str, args.packed_doc_len))} tokens"
                                                                if any(args.packed_doc_len) else "consecutive tokens"))
    scales = ", ".join(f"{window}: {scale:.7f}" for window, scale in model.attention_scales.items())
    lines.append(f"windows (units of {args.window_unit} tokens; short layers half): {', '.join(map(str, args.window_stages))} "
                 f"in equal parts of training, {args.final_window} for the final validation; softmax scale by window {scales}; "
                 f"rotary {'rescaled (YaRN) at each change' if args.yarn else 'unchanged (yarn=false)'}")
    untie = trainer.untie_step
    lines.append(f"embedding: a copy of the lm_head until step {untie}'s update, then trained apart" if untie < args.num_iterations
                 else f"embedding: a copy of the lm_head all run (it would untie after step {untie})")
    lines.append("gradient sum: float64 over micro-steps and ranks, the same bits at any world size (exact_grad_sum=true)"
                 if args.exact_grad_sum else "gradient sum: in the parameters' dtypes; another world size sums in "
                 "another order (exact_grad_sum=false)")
    return lines


def unigram_entropy(sequences: torch.Tensor, vocab_size: int) -> float:
    """Entropy in nats of the validation targets' token frequencies: the loss of a model that knows only how
    often each token occurs."""
    counts = torch.bincount(sequences[:, 1:].reshape(-1), minlength=vocab_size).double()
    p = counts[counts > 0] / counts.sum()
    return float(-(p * p.log()).sum())


class Diverged(Exception):
    """The run finished worse than it started; the message says so and what to try."""

    exit_code = 3  # 2 is bad input, 128 + N a stop signal


def divergence(val_losses: dict, output_width: int) -> Diverged | None:
    """Diverged when the last validation loss is above the step-0 one or, without a step-0 validation (val_loss_every=0,
    a resumed run), above ln(output_width): the loss of uniform predictions, near which every run starts. Else None.
    Compared as the log prints them (4 decimals), so that tools/records.py, reading the log, judges alike."""
    final = val_losses[max(val_losses)]
    start = val_losses[0] if 0 in val_losses else math.log(output_width)
    if round(final, 4) <= round(start, 4):
        return None
    named = f"step 0's {start:.4f}" if 0 in val_losses else f"ln({output_width}) = {start:.4f}, the loss of uniform predictions"
    return Diverged(f"the run diverged: final val loss {final:.4f} is above {named}; "
                    f"lower the learning rates or check the data")


def final_report(log: RunLog, trainer, clock: TrainingClock, val_losses: dict, val_entropy: float,
                 checkpoints: list[Path], peak: tuple[float, str], diverged: Diverged | None):
    """Checkpoints, throughput and MFU, gradient buckets, the final loss against the unigram entropy, peak memory, and
    last the line saying that the run diverged, if it did (train_gpt.py's __main__ prints it on stderr)."""
    args, buckets = trainer.args, trainer.buckets
    for path in checkpoints:
        log(f"checkpoint: {path}", console=False)
    stage_flops = {stage: stage_flops_per_token(trainer.model, args, *map(int, stage.split("x"))) for stage in clock.stages}
    for line in clock.throughput_lines(flops_per_token(trainer.model, args), peak, trainer.world_size, stage_flops):
        log(line)
    if buckets is not None:
        log(f"gradient buckets: {len(buckets.buckets)}, all-reduces per bucket {buckets.reductions} "
            f"over {buckets.steps} synchronized steps", console=False)
    log(f"validation, off the training clock: {clock.validations} x {args.val_tokens:,} tokens in {clock.validation_ms / 1000:.1f} s")
    final = val_losses[args.num_iterations]
    log(f"final val loss {final:.4f} nats vs {val_entropy:.4f} for the validation tokens' unigram entropy: "
        f"{abs(final - val_entropy):.4f} nats {'above' if final > val_entropy else 'below'}")
    log(peak_memory_line(trainer.device))
    if diverged is not None:
        log(str(diverged), console=False)


# ------------------------------------------------------------------------------------------------
# Checkpoint and log files

CHECKPOINT_NAME = "step_{:06d}.pt"  # zero-padded: names sort by step
CHECKPOINT_KEYS = {"step", "model", "optimizers", "data", "hyperparameters", "clock"}  # and identity (seal)
IDENTITY_KEYS = {"run_id", "launch", "log", "step", "digest"}
OWNER_FILE = ".owner"  # in a run's checkpoint folder: locked by the run writing there, naming it (JSON)


def checkpoint_path(checkpoint_dir: str, run_id: str, step: int) -> Path:
    return Path(checkpoint_dir, run_id, CHECKPOINT_NAME.format(step))


def checkpoint_digest(state: dict) -> str:
    """sha256 of everything a checkpoint holds but its identity, in the order it is stored: each tensor's dtype,
    shape and bytes, every other value's repr. A file holding tensors that another process wrote cannot match."""
    digest = hashlib.sha256()

    def visit(value):
        if isinstance(value, torch.Tensor):
            tensor = value.detach().cpu().contiguous()
            digest.update(f"tensor {tensor.dtype} {tuple(tensor.shape)}:".encode())
            digest.update(tensor.reshape(-1).view(torch.uint8).numpy())
        elif isinstance(value, dict):
            digest.update(b"{")
            for key, item in value.items():
                digest.update(f"{key!r}:".encode())
                visit(item)
            digest.update(b"}")
        elif isinstance(value, (list, tuple)):
            digest.update(b"[" if isinstance(value, list) else b"(")
            for item in value:
                visit(item)
            digest.update(b"]")
        else:
            digest.update(f"{value!r};".encode())

    visit({key: value for key, value in state.items() if key != "identity"})
    return digest.hexdigest()


def seal(state: dict, run_id: str, launch: str, log_path: Path | None) -> dict:
    """state with the identity a checkpoint carries: its run, the launch (one process group) that wrote it, the log
    that records it, its step, and the digest of the rest."""
    identity = dict(run_id=run_id, launch=launch, log=str(log_path) if log_path else "", step=state["step"])
    return {**state, "identity": {**identity, "digest": checkpoint_digest(state)}}


def write_checkpoint(path: Path, state: dict):
    """Written to a temporary file that no other process can share, then renamed: a final name never holds a partial
    checkpoint, nor one that two processes wrote. A file that cannot be written (a full disk, a size limit) raises
    WriteError."""
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(8)}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        # O_EXCL: a name some other process made is never written into; 0o666 keeps the umask's permissions.
        with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), "wb") as f:
            torch.save(state, f)  # through a Python file, a failed write keeps the OS's error
            f.flush()
            os.fsync(f.fileno())  # on disk before it takes the final name; some file systems report a full disk only here
        os.replace(tmp, path)
    except (OSError, RuntimeError) as e:
        if os_reason(e) is None:  # not a failed write
            raise
        raise WriteError(f"{path}: the checkpoint could not be written ({os_reason(e)})") from None
    finally:
        with contextlib.suppress(OSError):  # a folder that became unwritable keeps the error above
            tmp.unlink(missing_ok=True)


def read_checkpoint(path: Path) -> dict:
    """A checkpoint holding at least CHECKPOINT_KEYS, loaded to CPU without running any pickled code, whose contents
    match the digest it was sealed with and whose step is the one its name gives."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such checkpoint") from None
    except Exception as e:  # unpickling raises many types; any of them means the same to the user
        raise ConfigError(f"{path}: not a readable checkpoint of train_gpt.py ({str(e).strip().splitlines()[0]})") from None
    if not isinstance(state, dict) or not CHECKPOINT_KEYS <= state.keys():
        raise ConfigError(f"{path}: not a checkpoint of train_gpt.py (it lacks {', '.join(sorted(CHECKPOINT_KEYS))})")
    identity = state.get("identity")
    if not isinstance(identity, dict) or not IDENTITY_KEYS <= identity.keys():
        raise ConfigError(f"{path}: made by train_gpt.py before checkpoints carried their run's identity and digest; "
                          f"load it with the commit that made it")
    if checkpoint_digest(state) != identity["digest"]:
        raise ConfigError(f"{path}: its contents do not match the digest run {identity['run_id']!r} sealed it with (two "
                          f"processes wrote it, or it was damaged): refused; use another checkpoint of the run")
    named = re.fullmatch(r"step_(\d+)\.pt", path.name)
    if identity["step"] != state["step"] or (named and int(named[1]) != state["step"]):
        raise ConfigError(f"{path}: holds step {state['step']} of run {identity['run_id']!r}, sealed as step "
                          f"{identity['step']}{f', named step {int(named[1])}' if named else ''}: refused; use another "
                          f"checkpoint of the run")
    return state


def latest_checkpoint(checkpoint_dir: str, run_id: str) -> Path:
    """The checkpoint of run_id with the highest step, for --resume=latest."""
    if not run_id:
        raise ConfigError("--resume=latest needs --run_id=<the run to continue>")
    found = sorted(Path(checkpoint_dir, run_id).glob("step_*.pt"))
    if not found:
        raise ConfigError(f"--resume=latest: no checkpoints in {Path(checkpoint_dir, run_id)}; "
                          f"check --run_id and --checkpoint_dir")
    return found[-1]


def owner_record(text: str) -> dict:
    """What an OWNER_FILE says of the run that holds, or last held, its folder; {} when it says nothing readable."""
    with contextlib.suppress(ValueError):
        record = json.loads(text)
        return record if isinstance(record, dict) else {}
    return {}


class CheckpointFolder:
    """A run's checkpoint folder, held by one launch of one run for as long as it lives: an exclusive lock on the
    folder's OWNER_FILE (the OS lets it go when the process ends, however it ends), which names the holder. Refuses,
    in one line, a folder that another live process holds, and one that holds checkpoints of another run, which this
    run would overwrite: only a run resuming from a checkpoint in the folder continues there."""

    def __init__(self, path: Path, run_id: str, log_path: Path, resume_from: Path | None):
        self.path, self.run_id, self.log_path = path, run_id, log_path
        self.launch = uuid.uuid4().hex  # this launch's checkpoints carry it (seal)
        self.owner = self._lock()
        self.owner.seek(0)
        before = self.owner.read().strip()
        earlier = sorted(path.glob("step_*.pt"))
        if earlier and (resume_from is None or resume_from.resolve().parent != path.resolve()):
            self.owner.close()
            made_by = f"; its log: {holder.get('log', '?')}" if (holder := owner_record(before)) else ""
            raise ConfigError(f"{path}: holds checkpoints of an earlier run of run_id {run_id!r} ({earlier[-1].name} the "
                              f"last{made_by}), which this run would overwrite; continue it with --resume=latest, or "
                              f"give this run another --run_id or --checkpoint_dir")
        for stale in path.glob(".step_*.tmp"):  # a write that a killed process left: no live process holds the folder
            stale.unlink(missing_ok=True)
        self.owner.seek(0)
        self.owner.truncate()
        self.owner.write(json.dumps(dict(log=str(log_path), pid=os.getpid(), host=platform.node(), launch=self.launch,
                                         since=time.strftime("%Y-%m-%d %H:%M:%S"))) + "\n")
        self.owner.flush()

    def _lock(self):
        """OWNER_FILE open and locked; a lock taken on a file that the last holder removed meanwhile is taken again."""
        while True:
            try:
                self.path.mkdir(parents=True, exist_ok=True)
                owner = open(self.path / OWNER_FILE, "a+")
            except OSError as e:
                raise ConfigError(f"--checkpoint_dir={self.path}: cannot write there ({e.strerror or e}); pick a "
                                  f"writable folder") from None
            try:
                fcntl.flock(owner, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                owner.seek(0)
                holder = owner_record(owner.read())
                owner.close()
                named = (f"pid {holder.get('pid')} on {holder.get('host')}, logging to {holder.get('log')}, since "
                         f"{holder.get('since')}" if holder else "it has not named itself yet")
                raise ConfigError(f"{self.path}: the checkpoint folder of run {self.run_id!r} is in use by another live "
                                  f"process ({named}); wait for it to end, or give this run another --run_id or "
                                  f"--checkpoint_dir") from None
            with contextlib.suppress(FileNotFoundError):
                if os.stat(self.path / OWNER_FILE).st_ino == os.fstat(owner.fileno()).st_ino:
                    return owner
            owner.close()

    def seal(self, state: dict) -> dict:
        return seal(state, self.run_id, self.launch, self.log_path)

    def release(self):
        """Lets the folder go; one left without checkpoints is removed, as if this run had never claimed it."""
        if not any(self.path.glob("step_*.pt")):
            with contextlib.suppress(OSError):
                (self.path / OWNER_FILE).unlink()  # while locked: a process waiting for it locks the new file
                self.path.rmdir()
        self.owner.close()  # closing the file lets the lock go


def check_resumable(state: dict, path: Path, args, resumable: set[str]):
    """Refuses a checkpoint whose hyperparameters differ from args in any setting outside resumable, or hold one that
    is no longer a setting (what it chose is now fixed, perhaps otherwise)."""
    saved, now = state["hyperparameters"], dataclasses.asdict(args)
    mismatched = [f"{k} (checkpoint {saved[k]!r}, now {now[k]!r})" if k in saved else
                  f"{k} (now {now[k]!r}; the checkpoint predates this setting)"
                  for k in now if k not in resumable and (k not in saved or saved[k] != now[k])]
    mismatched += [f"{k} (checkpoint {saved[k]!r}; no longer a setting)" for k in saved if k not in now]
    if mismatched:
        raise ConfigError(f"--resume={path}: the checkpoint was made with a different configuration: " + "; ".join(mismatched))


def save_checkpoint(trainer, stream, clock: TrainingClock, folder: CheckpointFolder | None, run_id: str, log: RunLog,
                    saved: list[Path], step: int, periodic: bool = False) -> Path:
    """Called on every rank (Muon gathers its state), sealed and written by rank 0, which holds folder; added to saved
    once every rank knows it was. A periodic save that fails is logged and training goes on; any other raises
    WriteError on every rank."""
    path = checkpoint_path(trainer.args.checkpoint_dir, run_id, step)
    state = dict(step=step, model=trainer.model.state_dict(), optimizers=[o.state_dict() for o in trainer.optimizers],
                 data=stream.state_dict(), hyperparameters=dataclasses.asdict(trainer.args),
                 clock=dataclasses.asdict(clock))
    scales = trainer.model.activation_scales()
    if scales is not None:  # each rank's FP8 activation scales, its own state: a row a rank
        rows = [scales]
        if trainer.world_size > 1:
            rows = [torch.empty_like(scales) for _ in range(trainer.world_size)]
            dist.all_gather(rows, scales)
        state["activation_scales"] = torch.stack(rows).cpu()
    failure = None
    if trainer.rank == 0:
        try:
            write_checkpoint(path, folder.seal(state))
        except WriteError as e:
            failure = e
    written = torch.tensor(int(failure is None), device=trainer.device)
    if trainer.world_size > 1:
        dist.broadcast(written, 0)
    if not written:
        failure = failure or WriteError(f"{path}: rank 0 could not write the checkpoint")
        if not periodic:
            raise failure
        log(f"{failure}; training goes on, the last checkpoint is {saved[-1] if saved else 'none yet'}")
        return path
    saved.append(path)
    return path


def claim_run_files(rank: int, world_size: int, log_path: Path, folder: Path, run_id: str,
                    resume_from: Path | None) -> tuple[RunLog, CheckpointFolder | None]:
    """On rank 0, the checkpoint folder claimed (every run may save one: a stop signal saves) and then the log made;
    a refusal is raised on every rank, which would otherwise wait for rank 0 forever. The other ranks get a log that
    writes nothing and no folder."""
    log, claimed, refusal = RunLog(None), None, None
    if rank == 0:
        try:
            claimed = CheckpointFolder(folder, run_id, log_path, resume_from)
            log = RunLog(log_path)
        except ConfigError as e:
            if claimed is not None:
                claimed.release()
            refusal = str(e)
    if world_size > 1:
        shared = [refusal]
        dist.broadcast_object_list(shared, src=0)
        refusal = shared[0]
    if refusal:
        raise ConfigError(refusal)
    return log, claimed


def log_path_for(log_dir: Path, run_id: str, resuming: bool) -> tuple[Path, Path | None]:
    """logs/<run_id>.txt; a resumed run whose log exists continues in <run_id>.resume<N>.txt, naming
    the newest log before it. Returns (path, the log it continues or None)."""
    logs = [log_dir / f"{run_id}.txt"]
    while resuming and logs[-1].exists():
        logs.append(log_dir / f"{run_id}.resume{len(logs)}.txt")
    return logs[-1], (logs[-2] if len(logs) > 1 else None)


# ------------------------------------------------------------------------------------------------
# Stop signals and resuming


class Preempted(Exception):
    """The run stopped on a signal after an optimizer step; the message says how to resume."""

    def __init__(self, signum: int, message: str):
        super().__init__(message)
        self.exit_code = 128 + signum  # the shell's convention for a process ended by that signal


class StopSignals:
    """SIGTERM (SLURM, cloud preemption) and SIGINT (Ctrl-C) let the optimizer step finish, then the loop saves
    a checkpoint and stops. Repeats are ignored: a launcher may forward the signal the process already got."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self, world_size: int):
        self.received = 0
        self.previous = {s: signal.signal(s, self._on_signal) for s in self.SIGNALS}
        self.group = dist.new_group(backend="gloo") if world_size > 1 else None
        self.in_flight = None  # (flag tensor, all-reduce work) launched at the previous check

    def _on_signal(self, signum, frame):
        self.received = self.received or signum

    def agreed(self) -> int:
        """The signal every rank stops on (0: none yet), once per step: a gloo all-reduce launched at one step and
        read at the next, so ranks stop after the same step without a GPU sync or waiting on a slower rank."""
        if self.group is None:
            return self.received
        agreed = 0
        if self.in_flight is not None:
            flag, work = self.in_flight
            work.wait()
            agreed = int(flag)
        flag = torch.full((1,), self.received, dtype=torch.int64)
        self.in_flight = (flag, dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group, async_op=True))
        return agreed

    def close(self):
        if self.in_flight is not None:
            self.in_flight[1].wait()
        for s, handler in self.previous.items():
            signal.signal(s, handler)


def stopped_after(signum: int, step: int, save, saved: list[Path], run_id: str, argv: list[str], world_size: int,
                  log: RunLog) -> Preempted:
    """Saves a checkpoint of the finished step unless saved holds one (save(step), on every rank, returns
    its path), and says how to resume from it."""
    name = signal.Signals(signum).name
    path = next((p for p in saved if p.name == CHECKPOINT_NAME.format(step)), None)
    try:
        path = path or save(step)
    except OSError as e:
        earlier = f"the last checkpoint is {saved[-1]}" if saved else "the run cannot be resumed from here"
        message = f"{name} after step {step}: no checkpoint saved ({e.strerror or e}); {earlier}"
        log(message)
        return Preempted(signum, message)
    kept = [a for a in argv if not a.startswith(("--resume", "--run_id"))]
    launcher = ["torchrun", "--standalone", f"--nproc_per_node={world_size}"] if world_size > 1 else ["python"]
    command = shlex.join([*launcher, "train_gpt.py", *kept, f"--run_id={run_id}", f"--resume={path}"])
    log(f"stopped by {name} after step {step}; checkpoint: {path}")
    return Preempted(signum, f"stopped by {name} after step {step}; resume with: {command}")


# ------------------------------------------------------------------------------------------------
# The GPT-2 tokenizer's ranks (train_gpt.prefix_table's), read offline

GPT2_RANKS_SHA256 = "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930"  # data/gpt2_tokenizer.py's pin
GPT2_RANKS_VARIABLE = "GPT2_TIKTOKEN_FILE"  # a copy of gpt2.tiktoken, as data/gpt2_tokenizer.py takes it
GPT2_RANKS_CACHE = Path(__file__).resolve().parent / "data" / "cache" / "gpt2.tiktoken"  # where that script fetches it


def gpt2_ranks(environ=os.environ) -> dict[bytes, int]:
    """The GPT-2 BPE ranks (token bytes -> id) from the file $GPT2_TIKTOKEN_FILE names, else GPT2_RANKS_CACHE, in
    tiktoken's format (a base64 token and its id a line), checked by sha256; a one-line ConfigError if unreadable."""
    named = environ.get(GPT2_RANKS_VARIABLE)
    where = f"{GPT2_RANKS_VARIABLE}={named}" if named else str(GPT2_RANKS_CACHE)
    todo = ("point it at an unmodified gpt2.tiktoken" if named else
            f"fetch it with: python data/gpt2_tokenizer.py (or set {GPT2_RANKS_VARIABLE} to a copy of gpt2.tiktoken)")
    try:
        data = Path(named or GPT2_RANKS_CACHE).read_bytes()
    except OSError as e:
        raise ConfigError(f"GPT-2 ranks {where}: {e.strerror}; {todo}") from e
    if hashlib.sha256(data).hexdigest() != GPT2_RANKS_SHA256:
        raise ConfigError(f"GPT-2 ranks {where}: not the pinned file (sha256 {GPT2_RANKS_SHA256}); {todo}")
    return {base64.b64decode(token): int(rank) for token, rank in (line.split() for line in data.splitlines() if line)}


# ------------------------------------------------------------------------------------------------
# The torch a run is on: requirements.txt's pin, and every release the whole suite has passed on

TORCH_PIN = "2.13.0"  # requirements.txt's torch==; a test holds the two equal
TESTED_TORCH = ("2.11.0", "2.13.0")  # ./run.sh test --torch=VERSION passes on each


def torch_release(version: str | None = None) -> str:
    """The release of a torch version string, without its build tag: 2.11.0+cu130 -> 2.11.0."""
    return (version or torch.__version__).split("+")[0]


def torch_description(version: str | None = None) -> str:
    version = version or torch.__version__
    return f"torch {version} (requirements.txt pins {TORCH_PIN}; tested on {', '.join(TESTED_TORCH)})"


def untested_torch_message(version: str | None = None) -> str | None:
    """One line when this torch is not a release the suite has passed on, else None: a warning, not a refusal, since
    rented GPU machines bring their own torch and no registry."""
    version = version or torch.__version__
    if torch_release(version) in TESTED_TORCH:
        return None
    return (f"torch {version} is not a release this project is tested on ({', '.join(TESTED_TORCH)}); results may differ "
            f"from a tested torch's: ./run.sh test --torch={torch_release(version)} runs the suite on it")


# ------------------------------------------------------------------------------------------------
# NVIDIA GPUs that this torch cannot use

CPU_ON_GPU_MACHINE = "TRAIN_GPT_ALLOW_CPU"  # =1: train on the CPU of a machine whose NVIDIA GPUs torch cannot use
CUDA_WHEEL_INDEX = "https://download.pytorch.org/whl/cu128"  # PyTorch's CUDA 12.8 builds
CUDA_12_MIN_DRIVER = 525  # the oldest driver series that runs CUDA 12 builds (minor-version compatibility)
DRIVER_VERSION = re.compile(r"\d+\.\d+(\.\d+)*")


def nvidia_gpus(proc: Path = Path("/proc/driver/nvidia")) -> tuple[list[str], str, str]:
    """The NVIDIA GPUs the driver lists (nvidia-smi, else /proc/driver/nvidia/gpus), its version, and
    nvidia-smi's complaint when it fails (a driver that does not work)."""
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
        rows = [line.rsplit(",", 1) for line in smi.stdout.splitlines() if "," in line] if smi.returncode == 0 else []
        failure = "" if smi.returncode == 0 else (smi.stdout + smi.stderr).strip().split("\n")[0]
    except (OSError, subprocess.TimeoutExpired):
        rows, failure = [], ""
    gpus = [name.strip() for name, _ in rows]
    driver = next((v.strip() for _, v in rows if DRIVER_VERSION.fullmatch(v.strip())), "")
    if not gpus and (proc / "gpus").is_dir():
        gpus = [f"PCI {entry.name}" for entry in sorted((proc / "gpus").iterdir())]
    if not driver and (proc / "version").is_file():  # "NVRM version: NVIDIA UNIX x86_64 Kernel Module  570.124.06 ..."
        driver = next((w for w in (proc / "version").read_text().split() if DRIVER_VERSION.fullmatch(w)), "")
    return gpus, driver or "unknown", failure


def unusable_gpus_message(environ=os.environ, proc: Path = Path("/proc/driver/nvidia")) -> str | None:
    """One line when NVIDIA GPUs are present but torch cannot use them (a run would fall back to the CPU silently);
    None when there are none, torch can use them, or the user opted out (TRAIN_GPT_ALLOW_CPU=1, GPUs hidden)."""
    if environ.get(CPU_ON_GPU_MACHINE) == "1" or environ.get("CUDA_VISIBLE_DEVICES") in ("", "-1"):
        return None
    with warnings.catch_warnings(record=True) as said:  # torch's own warning joins the one line
        warnings.simplefilter("always")
        if torch.cuda.is_available():
            return None
    gpus, driver, failure = nvidia_gpus(proc)
    if not gpus:
        return None
    torch_says = next((f" (torch: {str(w.message).splitlines()[0]})" for w in said), "")
    found = f"{len(gpus)} NVIDIA GPU(s) ({gpus[0]}) with driver {driver}"
    opt_out = f"or set {CPU_ON_GPU_MACHINE}=1 to train on the CPU"
    if failure:
        return f"{found}, but nvidia-smi fails ({failure}): the driver does not work; repair it, {opt_out}"
    built = f"built for CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
    version = torch.__version__.split("+")[0]
    if driver != "unknown" and int(driver.split(".")[0]) < CUDA_12_MIN_DRIVER:
        todo = f"update the NVIDIA driver to the R{CUDA_12_MIN_DRIVER} series or newer"
    else:
        todo = (f"install torch {version} built for a CUDA that driver supports: {sys.executable} -m pip install "
                f"torch=={version} --index-url {CUDA_WHEEL_INDEX}")
    return f"{found}, but torch {torch.__version__} ({built}) cannot use them{torch_says}; {todo} ({opt_out})"
