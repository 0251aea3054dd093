"""Check a GPU machine before spending money on record attempts: the pieces the record relies on, each
against an independent reference, with numbers, in a few minutes.

    python tools/gpu_check.py

Prints one row per check (PASS, FAIL or SKIP with the reason) and exits 1 if any check fails:
  environment        torch is a release the suite passes on (requirements.txt's pin or another tested one) and
                     can use the NVIDIA GPUs the driver lists; FP8 capability
  fp8 matmul         the FP8 lm_head op against a bf16 matmul, forward and both gradients (record shapes on CUDA)
  fp8 mlp            the MLP in training with FP8 against the same MLP in bf16, output and gradients (record width)
  flex forward       compiled FlexAttention against SDPA with the same dense masks (record windows and scales; the
                     first stage's on CPU; windows that end inside a block)
  flex backward      the same for the gradients of q, k and v (CUDA: FlexAttention has no backward on CPU)
  composition        the composed attention correction (the 2026-05-27 record's layer 10) in bf16 against dense
                     float64 matrices of the same rule, each element within its rounding's allowance
  training steps     the record model compiled on one GPU at a reduced sequence length: step time, tokens/s, MFU
  all-reduce         train_gpt's bucketed all-reduce across processes against the average computed in one
                     (NCCL over every GPU; gloo over 2 CPU processes without CUDA)
Without CUDA the checks that can run on CPU run at small sizes; the rest are SKIP.

    python tools/gpu_check.py --bench [--steps=5] [--processes=N] [--stage=K] [--key=value ...]

--bench times the record preset's training step (the cpu preset's without CUDA; --key=value overrides
either) as a run on this machine computes it: one process per GPU, each running its share of the step's
micro-steps, on packed synthetic documents read through the training loader, compiled, at each stage
(batch size and window) after untimed steps, whose time (the stage's compilation) it reports beside the step's.
--stage=K times the K-th stage alone (1: the first), for a machine lent for less time than the whole compiles in.
It prints ms per step, tokens/s, MFU and peak memory per stage, and the projected training time of the stages
timed here and on 8 such GPUs.
"""

import argparse
import dataclasses
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PUBLISHED_RECORD = ("upstream modded-nanogpt HEAD (f411b3d3) computes: 1285 steps, 1.23 min on 8xH100 in the "
                    "upstream README; no published log of that exact configuration (the nearest, the 2026-07-17 "
                    "record's, logged val 3.2784 after 79.69 s of training, the means of its 13 logs, at 1390 steps); "
                    "unmeasured by us")
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch._inductor.kernel.flex.flex_cpu import check_cpu_supported  # noqa: E402

import run_support  # noqa: E402
import train_gpt  # noqa: E402

sys.path.insert(0, str(ROOT / "data"))
import shards  # noqa: E402

FP8_TOLERANCE = 0.08  # relative error of e4m3/e5m2 against bf16: above FP8 rounding, far below a wrong result
# A rounding to e4m3 (3 mantissa bits) errs by ulp / sqrt(12) RMS, relative 2^-3 sqrt(E[1/m^2] / 12) for a mantissa m
# log-uniform in [1, 2) (E[1/m^2] = 3 / (8 ln 2))
E4M3_RMS_ERROR = 2**-3 * (3 / (8 * math.log(2)) / 12) ** 0.5
FP8_MLP_MARGIN = 1.5  # the fp8 mlp check's limits over the errors that e4m3's roundings predict: a 20% error fails
ATTENTION_TOLERANCE = 2e-2  # bf16 rounding on CUDA; float32 on CPU agrees far more closely
BF16_UNIT_ROUNDOFF = 2.0**-8  # a rounding to bf16 (8 significant bits) moves a value by at most this of it
COMPOSITION_FLOAT32_ERROR = 1e-3  # the composed attention's float32 arithmetic, relative (check_composition says why)
CHECK_SEQ_LEN = 8 * 1024  # tokens per training step in the training check: compiles and runs in well under a minute
BENCH_UNTIMED_STEPS = 2  # per training shape of a stage before timing: the first compiles the shape's graphs
BENCH_DOC_TOKENS = 670  # mean synthetic document: FineWeb's sample-10BT holds about 10B GPT-2 tokens in 15M documents
RECORD_GPUS = 8


class Skip(Exception):
    """A check that cannot run here; the message says why."""


class UnusableGPUs(AssertionError):
    """NVIDIA GPUs that this torch cannot use: the other checks would test the CPU instead."""


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach().float() - b.detach().float()).norm() / b.detach().float().norm())


def relative_errors(names: tuple[str, ...], got: tuple, want: tuple, limits: list[float]) -> str:
    """Each result's relative error against its bf16 twin, 'name error, ...'; an AssertionError past its limit."""
    errors = [relative_error(a, b) for a, b in zip(got, want, strict=True)]
    text = ", ".join(f"{name} {error:.3f}" for name, error in zip(names, errors, strict=True))
    if any(error > limit for error, limit in zip(errors, limits, strict=True)):
        raise AssertionError(f"relative error {text} (limit {', '.join(f'{limit:.3f}' for limit in limits)})")
    return text


def check_environment(device: torch.device) -> str:
    unusable_gpus = run_support.unusable_gpus_message()
    if unusable_gpus:
        raise UnusableGPUs(unusable_gpus)
    untested = run_support.untested_torch_message()
    if untested:  # training still runs on it, with this warning; the check says what the figures below rest on
        raise AssertionError(untested)
    if device.type != "cuda":
        return f"{run_support.torch_description()}; no CUDA"
    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    fp8_ok, fp8_why = train_gpt.fp8_supported(device)
    return (f"{run_support.torch_description()}, CUDA {torch.version.cuda}; {len(gpus)}x {gpus[0]}; "
            f"FP8 {'yes' if fp8_ok else 'no'} ({fp8_why})")


def check_fp8(device: torch.device, tokens: int, model_dim: int = 768, vocab: int = 50304) -> str:
    """The training loss with the lm_head's FP8 matmul (record scales, the e5m2 gradient) against the same loss in bf16:
    the logits (fp8_mm's against the bf16 product), the per-token losses and the gradients of x and w."""
    if device.type == "cuda" and not train_gpt.fp8_supported(device)[0]:
        raise Skip(train_gpt.fp8_supported(device)[1])
    g = torch.Generator(device).manual_seed(0)
    x = train_gpt.norm(torch.randn(tokens, model_dim, device=device, generator=g)).bfloat16()
    w = (torch.randn(vocab, model_dim, device=device, generator=g) * 0.02).bfloat16()
    targets = torch.randint(0, vocab, (tokens,), device=device, generator=g)
    ones = torch.ones(1, device=device)
    scales = train_gpt.LM_HEAD_FP8_SCALES

    def loss(xi, wi, fp8_scales):
        return train_gpt.SoftcappedLoss.apply(xi, wi, targets, ones, train_gpt.LOGIT_SOFTCAP, train_gpt.LOGIT_OFFSET,
                                              fp8_scales)

    results = {}
    for name, fp8_scales, logits in (("fp8", scales, train_gpt.fp8_mm(x, w, *scales[:2])[0]),
                                     ("bf16", None, F.linear(x, w))):
        xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
        losses = loss(xi, wi, fp8_scales)
        losses.sum().backward()
        results[name] = (logits, losses, xi.grad, wi.grad)
    errors = relative_errors(("out", "loss", "grad x", "grad w"), results["fp8"], results["bf16"], [FP8_TOLERANCE] * 4)
    summary = f"{tokens}x{model_dim} @ {vocab}: rel. error {errors}"
    if device.type == "cuda":
        def step(fp8_scales):
            xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
            loss(xi, wi, fp8_scales).sum().backward()
        times = {name: cuda_ms(lambda: step(fp8_scales)) for name, fp8_scales in (("fp8", scales), ("bf16", None))}
        summary += f"; loss forward and backward {times['fp8']:.2f} ms vs bf16 {times['bf16']:.2f} ms"
    return summary


def fp8_mlp_expected_errors() -> list[float]:
    """The relative errors that e4m3's roundings predict for the fp8 mlp check's (out, grad x, grad w_up, grad w_down):
    two rounded operands give pre sqrt(2) E4M3_RMS_ERROR of its spread (random signs); relu^2 of a normal pre gives post
    sqrt(4/3) x that; the down-projection adds its two operands'. The gradients take post's (grad w_down), or through
    sqrt(post) pre's (grad x, grad w_up)."""
    pre = 2**0.5 * E4M3_RMS_ERROR
    post = (4 / 3) ** 0.5 * pre
    return [(post**2 + 2 * E4M3_RMS_ERROR**2) ** 0.5, pre, pre, post]


def check_fp8_mlp(device: torch.device, tokens: int, model_dim: int = 768) -> str:
    """The MLP in training with FP8 against itself in bf16, output and gradients: normed normal inputs, both matrices
    drawn as the record draws the up-projection (a trained down-projection is no longer zero), the down-projection's
    input scale from another batch (as each forward's comes from the one before). Each error within FP8_MLP_MARGIN x
    what e4m3's roundings predict (fp8_mlp_expected_errors)."""
    if device.type == "cuda" and not train_gpt.fp8_supported(device)[0]:
        raise Skip(train_gpt.fp8_supported(device)[1])
    g = torch.Generator(device).manual_seed(5)
    earlier, x = (train_gpt.norm(torch.randn(tokens, model_dim, device=device, generator=g)).bfloat16() for _ in range(2))
    bound = train_gpt.init_bound(model_dim)
    weights = [((torch.rand(4 * model_dim, model_dim, device=device, generator=g) * 2 - 1) * bound) for _ in range(2)]
    grad = torch.randn(tokens, model_dim, device=device, generator=g).bfloat16()
    results = {}
    for fp8 in (True, False):
        mlp = train_gpt.MLP(model_dim, torch.bfloat16, fp8).to(device).train()
        with torch.no_grad():
            mlp.c_fc.copy_(weights[0])
            mlp.c_proj.copy_(weights[1])
        train_gpt.refresh_down_scales([mlp.c_proj], [mlp.down_scale], [mlp.next_down_scale], bootstrap=True)
        mlp(earlier)
        xi = x.clone().requires_grad_()
        out = mlp(xi)
        out.backward(grad)
        results[fp8] = (out, xi.grad, mlp.c_fc.grad, mlp.c_proj.grad)
    expected = fp8_mlp_expected_errors()
    errors = relative_errors(("out", "grad x", "grad w_up", "grad w_down"), results[True], results[False],
                             [FP8_MLP_MARGIN * e for e in expected])
    return (f"{tokens}x{model_dim} -> {4 * model_dim}: rel. error {errors} (predicted "
            f"{', '.join(f'{e:.3f}' for e in expected)})")


def cuda_ms(fn, repeats: int = 10) -> float:
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    torch.cuda.synchronize()
    return 1000 * (time.perf_counter() - t0) / repeats


def record_like_tokens(num_tokens: int, device: torch.device) -> torch.Tensor:
    """Random tokens with documents of varied length, some shorter than a block, starting at 0."""
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 50000, (num_tokens,), generator=g)
    starts = torch.cumsum(torch.randint(30, 3 * train_gpt.BLOCK_SIZE, (num_tokens // 30,), generator=g), 0)
    tokens[starts[starts < num_tokens]] = train_gpt.EOT_TOKEN
    tokens[0] = train_gpt.EOT_TOKEN
    return tokens.to(device)


def check_flex(device: torch.device, num_tokens: int, backward: bool, heads: int = 6, head_dim: int = 128,
               stages: int | None = None) -> str:
    """Compiled FlexAttention against SDPA with the dense mask of the same rule, for the long and short
    windows of the record's first `stages` window stages (all by default) with their softmax scales,
    for two windows that end inside a block, and for the paired-head layers' short windows over their
    sequence of twice the tokens (half the heads)."""
    if backward and device.type != "cuda":
        raise Skip(f"FlexAttention has no backward on {device.type} in torch {torch.__version__}")
    if device.type == "cpu" and not check_cpu_supported():
        raise Skip("FlexAttention's compiled CPU kernel needs AVX2 and ATEN_CPU_CAPABILITY other than default")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    tokens = record_like_tokens(num_tokens, device)
    record = train_gpt.Hyperparameters()
    windows = (*record.window_stages, record.final_window)
    scales = train_gpt.attention_scales(windows, record.attention_scale, record.attention_scale_growth)
    # (window in tokens, scale): as the attention layers see them, then two that are no multiple of a block
    cases = [(blocks * train_gpt.BLOCK_SIZE, scales[w], False) for w in windows[:stages] for blocks in (w, w // 2)]
    cases += [(train_gpt.BLOCK_SIZE + 1, scales[windows[0]], False), (3 * train_gpt.BLOCK_SIZE - 50, scales[windows[0]], False)]
    cases += [(w // 2 * train_gpt.BLOCK_SIZE, scales[w], True) for w in windows[:stages]]

    # The window as a tensor: one graph per scale serves every window (an int, as in training, compiles
    # one per window: minutes on CPU).
    @torch.compile(dynamic=False)
    def flex(q, k, v, window, scale, paired):
        return train_gpt.attend(q, k, v, train_gpt.attention_mask(tokens, window, "flex", paired=paired), scale)

    worst = 0.0
    g = torch.Generator(device).manual_seed(2)
    for window, scale, paired in cases:
        shape = (1, max(heads // 2, 1), 2 * num_tokens, head_dim) if paired else (1, heads, num_tokens, head_dim)
        qkv = [torch.randn(shape, device=device, generator=g, dtype=dtype).requires_grad_(backward) for _ in range(3)]
        out = flex(*qkv, torch.tensor(window, device=device), scale, paired)
        ref_qkv = [t.detach().clone().requires_grad_(backward) for t in qkv]
        mask = train_gpt.attention_mask(tokens, window, "sdpa", paired=paired)
        ref = F.scaled_dot_product_attention(*ref_qkv, attn_mask=mask, scale=scale)
        if backward:
            grad = torch.randn(out.shape, device=device, generator=g, dtype=dtype)
            got = torch.autograd.grad(out, qkv, grad)
            want = torch.autograd.grad(ref, ref_qkv, grad)
            worst = max(worst, *(relative_error(a, b) for a, b in zip(got, want)))
        else:
            worst = max(worst, relative_error(out, ref))
    if worst > ATTENTION_TOLERANCE:
        raise AssertionError(f"relative error {worst:.2e} (limit {ATTENTION_TOLERANCE:.0e})")
    paired = sorted({w for w, _, pair in cases if pair})
    return (f"{num_tokens} tokens, {heads} heads, windows of {', '.join(map(str, sorted({w for w, _, _ in cases})))} tokens "
            f"(paired heads: {', '.join(map(str, paired))}) at scales {', '.join(f'{s:.4f}' for s in sorted({s for _, s, _ in cases}))}: "
            f"max relative error {worst:.1e}")


def check_composition(device: torch.device, num_tokens: int, heads: int = 6, head_dim: int = 128) -> str:
    """The composed attention correction in bf16 (eager: chunks of queries) against the same rule as dense float64
    matrices: causal, within COMPOSITION_WINDOW keys, within documents (record-like tokens), QK-normed q and k at the
    record's first scale. Allowance, per element: it rounds to bf16 only each head's weights (2^-8 of each, so of the
    magnitude sum_j |gain a_j| |v_j|, a_j <= sum_h |mix_h| p_hj) and the output (2^-8 of it); the rest is float32 on
    exact bf16 inputs, whose first-order bound (tests/test_composition.py) is twice gamma(D) of the logits' magnitude
    (scale x D for QK-normed q and k: under 2e-4 at D = 128, scale 0.1), plus gamma(window) and a few u, of the
    magnitude and output: COMPOSITION_FLOAT32_ERROR is well above it."""
    g = torch.Generator(device).manual_seed(5)
    tokens = record_like_tokens(num_tokens, device)
    q, k = (train_gpt.norm(torch.randn(1, heads, num_tokens, head_dim, device=device, generator=g)).bfloat16()
            for _ in range(2))
    y, v = (torch.randn(1, heads, num_tokens, head_dim, device=device, generator=g).bfloat16() for _ in range(2))
    mix, gain = train_gpt.composition_weights(*torch.randn(2, 1, num_tokens, heads, device=device, generator=g),
                                              torch.bfloat16)
    scale = train_gpt.Hyperparameters().attention_scale
    starts = train_gpt.document_starts(tokens)
    out = train_gpt.composed_attention_correction(y, q, k, v, mix, gain, starts, scale)

    positions, docs = torch.arange(num_tokens, device=device), (tokens == train_gpt.EOT_TOKEN).cumsum(0)
    back = positions[:, None] - positions[None, :]
    allowed = (back >= 0) & (back < train_gpt.COMPOSITION_WINDOW) & (docs[:, None] == docs[None, :])
    q64, k64, v64, y64 = (t[0].double() for t in (q, k, v, y))
    mix64, gain64 = (t[0].double().T[..., None] for t in (mix, gain))  # (H, T, 1)
    probs = (scale * q64 @ k64.transpose(1, 2)).masked_fill(~allowed, float("-inf")).softmax(-1)
    exact = y64 + gain64 * ((mix64 * probs).sum(0) @ v64)
    magnitude = gain64.abs() * ((mix64.abs() * probs).sum(0) @ v64.abs())
    allowance = (BF16_UNIT_ROUNDOFF + COMPOSITION_FLOAT32_ERROR) * (magnitude + exact.abs())
    worst = float(((out[0].double() - exact).abs() / allowance).max())
    if worst > 1:
        raise AssertionError(f"an error {worst:.2f} times its allowance")
    summary = (f"{num_tokens} tokens, {heads} heads x {head_dim}, bf16, window {train_gpt.COMPOSITION_WINDOW}: worst "
               f"error {worst:.2f} of its allowance")
    if device.type == "cuda":
        ms = cuda_ms(lambda: train_gpt.composed_attention_correction(y, q, k, v, mix, gain, starts, scale))
        summary += f"; {ms:.1f} ms eager"
    return summary


def check_training(device: torch.device, args: train_gpt.Hyperparameters, steps: int = 6, warmup: int = 2) -> str:
    """A few steps of the model (compiled on CUDA) fitting one repeated batch: the loss must fall, and the
    timed steps give step time, tokens/s and MFU."""
    if device.type != "cuda" and args.compile:
        raise Skip("needs CUDA: the record model compiled takes minutes per step on CPU")
    plan = train_gpt.plan_device(args, device)
    trainer = train_gpt.Trainer(args, 0, 1, plan)
    g = torch.Generator().manual_seed(3)
    batch = [(t[:-1].to(device, torch.int32), t[1:].to(device)) for t in
             [torch.randint(0, args.vocab_size, (args.seq_len[0] + 1,), generator=g) for _ in range(trainer.grad_accum_steps)]]
    losses = [float(trainer.train_step(step, batch)) for step in range(warmup)]
    trainer.synchronize()
    t0 = time.perf_counter()
    timed = [trainer.train_step(step, batch) for step in range(warmup, warmup + steps)]
    trainer.synchronize()
    step_ms = 1000 * (time.perf_counter() - t0) / steps
    losses += [float(loss) for loss in timed]
    if not all(map(math.isfinite, losses)) or not losses[-1] < losses[0] - 0.5:
        raise AssertionError(f"the loss did not fall on a repeated batch: {[round(x, 3) for x in losses]}")
    tokens_per_second = args.batch_slots * args.seq_len[0] / (step_ms / 1000)
    achieved = run_support.flops_per_token(trainer.model, args) * tokens_per_second
    peak, source = run_support.matmul_peak(device, train_gpt.DTYPES[plan.dtype])
    mfu = f"{achieved / 1e12:.2f} TFLOP/s, MFU {100 * achieved / peak:.1f}% of {source}"
    return (f"{args.num_layers} layers x {args.model_dim}, {args.batch_slots} x {args.seq_len[0]} tokens: loss "
            f"{losses[0]:.2f} -> {losses[-1]:.2f}; {step_ms:.1f} ms/step, {tokens_per_second:,.0f} tokens/s, {mfu}")


def allreduce_worker(backend: str, out_path: str):
    """One rank (under torchrun): gradients seeded by rank through GradientBuckets' hooks, compared with
    the average of every rank's gradients computed here; rank 0 writes the figures."""
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if backend == "nccl" else torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(device)
    dist.init_process_group(backend)
    # the record's hidden matrix shapes and an lm_head-sized one, in the order backward makes them ready
    shapes = [(50304, 768), *[(768, 3072), (768, 3072), (6, 12), (4, 768, 768)] * 4]
    if backend == "gloo":
        shapes = [(*s[:-1], max(1, s[-1] // 8)) for s in shapes]  # keep CPU processes quick
    params = [torch.nn.Parameter(torch.zeros(s, device=device)) for s in shapes]
    buckets = train_gpt.GradientBuckets(params, 25_000_000, world_size)

    def grads_of(r):
        g = torch.Generator().manual_seed(r)
        return [torch.randn(s, generator=g).to(device) for s in shapes]

    times = []
    for _ in range(3):
        dist.barrier()
        t0 = time.perf_counter()
        sum((p * g).sum() for p, g in zip(params, grads_of(rank))).backward()
        buckets.wait_for_gradients()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        got = [p.grad.clone() for p in params]
        buckets.zero_grad()  # the gradients are views of the buckets' buffers: zeroed there, not dropped
    expected = [torch.stack(gs).mean(0) for gs in zip(*(grads_of(r) for r in range(world_size)))]
    error = max(float((a - b).abs().max()) for a, b in zip(got, expected))
    megabytes = sum(p.numel() * p.element_size() for p in params) / 1e6
    if rank == 0:
        Path(out_path).write_text(json.dumps(dict(error=error, world_size=world_size, buckets=len(buckets.buckets),
                                                  megabytes=megabytes, ms=1000 * min(times))))
    dist.destroy_process_group()


def run_workers(nproc: int, worker_argv: list[str], timeout: float) -> dict:
    """This script under torchrun in nproc processes, its arguments worker_argv with the path of the JSON that
    rank 0 writes appended; returns what rank 0 wrote."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
                               str(Path(__file__).resolve()), *worker_argv, str(out)],
                              capture_output=True, text=True, timeout=timeout, env={**os.environ, "OMP_NUM_THREADS": "1"})
        if proc.returncode != 0 or not out.exists():
            errors = [line for line in (proc.stderr + proc.stdout).splitlines() if "Error" in line] or ["no error message"]
            raise AssertionError(f"{nproc} processes failed (exit {proc.returncode}): {errors[-1].strip()}")
        return json.loads(out.read_text())


def check_allreduce(device: torch.device, timeout: float = 120) -> str:
    if device.type == "cuda":
        if torch.cuda.device_count() < 2:
            raise Skip("needs 2 or more GPUs")
        backend, nproc = "nccl", torch.cuda.device_count()
    else:
        backend, nproc = "gloo", 2
    r = run_workers(nproc, ["--allreduce-worker", backend], timeout)
    if r["error"] > 1e-5:
        raise AssertionError(f"max difference {r['error']:.1e} from the average computed in one process")
    return (f"{backend}, {r['world_size']} processes, {r['megabytes']:.0f} MB in {r['buckets']} buckets: max difference "
            f"{r['error']:.1e} from the single-process average; {r['ms']:.1f} ms backward + all-reduce")


def write_synthetic_shard(path: Path, num_tokens: int, seed: int = 4):
    """Random GPT-2 token ids in documents of geometric length (mean BENCH_DOC_TOKENS), each beginning with the
    end-of-text token, as the training shards' documents do."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, train_gpt.EOT_TOKEN, num_tokens)
    starts = np.cumsum(rng.geometric(1 / BENCH_DOC_TOKENS, 2 * num_tokens // BENCH_DOC_TOKENS + 1))
    tokens[0] = train_gpt.EOT_TOKEN
    tokens[starts[starts < num_tokens]] = train_gpt.EOT_TOKEN
    shards.write_shard(path, tokens)


def stage_steps(args: train_gpt.Hyperparameters) -> dict[tuple[int, int], list[int]]:
    """Each stage's training steps, by (seq_len, window), in the order the run reaches them."""
    steps = {}
    for step in range(args.num_iterations):
        steps.setdefault((train_gpt.seq_len_at(step, args), train_gpt.window_at(step, args)), []).append(step)
    return steps


def bench_stages(args: train_gpt.Hyperparameters, train_files: str, steps: int, rank: int, world_size: int,
                 device: torch.device, only_stage: int = 0) -> dict:
    """This rank's share of real training steps, at the first steps of each stage (seq_len, window), or of the
    only_stage-th alone: ms per step over `steps` after the untimed ones (BENCH_UNTIMED_STEPS from the first step of
    each training shape in the stage: the untie's within the third), the untimed steps' seconds (they compile), and
    the peak memory."""
    plan = train_gpt.plan_device(args, device)
    trainer = train_gpt.Trainer(args, rank, world_size, plan)
    stream = train_gpt.TokenStream(train_files, max(args.seq_len), args.batch_slots, device, args.vocab_size,
                                   plan.pinned_memory, min(args.packed_doc_len))
    barrier = dist.barrier if world_size > 1 else (lambda: None)
    stages, first_steps = [], set(train_gpt.training_shapes(args).values())
    for number, ((seq_len, window), run_steps) in enumerate(stage_steps(args).items(), 1):
        if only_stage and number != only_stage:
            continue
        start = time.perf_counter()
        untimed = max(i for i, step in enumerate(run_steps) if step in first_steps) + BENCH_UNTIMED_STEPS
        for i in range(untimed + steps):
            if i == untimed:
                trainer.synchronize()
                barrier()
                t0 = time.perf_counter()
            step = run_steps[min(i, len(run_steps) - 1)]  # the schedules of the stage's steps; the window of all
            trainer.move_window(step)
            trainer.train_step(step, stream.next_batch(rank, world_size, seq_len, train_gpt.doc_len_at(step, args)))
        trainer.synchronize()
        ms = 1000 * (time.perf_counter() - t0) / steps
        flops = run_support.stage_flops_per_token(trainer.model, args, seq_len, window)
        stages.append((seq_len, window, ms, flops, untimed, t0 - start))
        if rank == 0:  # progress, with the time of the untimed steps, which compile
            print(f"{args.batch_slots} x {seq_len} tokens, window {window}: {untimed} untimed steps in "
                  f"{t0 - start:.1f} s, then {ms:.1f} ms/step", file=sys.stderr, flush=True)
    trainer.stop_if_nonfinite()
    return dict(stages=stages, peak_memory=run_support.peak_memory_line(device), dtype=plan.dtype, compile=plan.compile,
                micro_steps=trainer.grad_accum_steps)


def bench_worker(overrides: str, train_files: str, steps: str, only_stage: str, out_path: str):
    """One rank of --bench under torchrun; rank 0 writes the figures."""
    rank, world_size, device = train_gpt.setup_distributed()
    args, _ = train_gpt.parse_args(json.loads(overrides), "record" if device.type == "cuda" else "cpu")
    result = bench_stages(args, train_files, int(steps), rank, world_size, device, int(only_stage))
    if rank == 0:
        Path(out_path).write_text(json.dumps(result))
    dist.destroy_process_group()


def bench_report(args: train_gpt.Hyperparameters, preset: str, result: dict, processes: int, device: torch.device) -> str:
    """The figures of bench_stages, and the whole run's training time projected from them."""
    dtype = train_gpt.DTYPES[result["dtype"]]
    peak, peak_source = run_support.matmul_peak(device, dtype)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    lines = [f"bench: preset {preset}, {args.num_layers} layers x {args.model_dim}, {args.batch_slots} x "
             f"{'/'.join(map(str, args.seq_len))} tokens a step; {processes} process(es) on {device.type} ({name}), {result['micro_steps']} micro-step(s) "
             f"each; dtype {result['dtype']}, compile {result['compile']}; {run_support.torch_description()}"]
    projected_ms, all_stages, timed_steps = 0.0, stage_steps(args), 0
    for seq_len, window, ms, flops, untimed, compile_s in result["stages"]:
        run_steps = all_stages[seq_len, window]
        projected_ms += len(run_steps) * ms
        timed_steps += len(run_steps)
        tokens_per_second = args.batch_slots * seq_len / (ms / 1000)
        lines.append(f"{args.batch_slots} x {seq_len} tokens, window {window} ({window * args.window_unit} tokens), "
                     f"{len(run_steps)} steps: {ms:.1f} ms/step, {tokens_per_second:,.0f} tokens/s, MFU "
                     f"{100 * flops * tokens_per_second / (peak * processes):.1f}%; its {untimed} untimed steps, "
                     f"which compile, {compile_s:.1f} s")
    lines.append(f"MFU against {peak_source} per process; rank 0's {result['peak_memory']}")
    timed = (f"{args.num_iterations} steps" if timed_steps == args.num_iterations else
             f"the {timed_steps} steps of the stage timed (of {args.num_iterations})")
    projection = f"projected training time of {timed}: {projected_ms / 1000:.1f} s here"
    if args.batch_slots % RECORD_GPUS == 0:
        projection += (f", {projected_ms * processes / RECORD_GPUS / 1000:.1f} s on {RECORD_GPUS} such GPUs (assumed: "
                       f"step time in proportion to the micro-steps per GPU; communication unmeasured)")
    lines.append(projection + "; validation and compilation excluded, as in the speedrun's train_time")
    return "\n".join(lines)


def bench_main(argv: list[str]) -> str:
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    own, rest = run_support.split_tool_options(argv, dict(steps=5, processes=max(1, torch.cuda.device_count()), stage=0))
    args, preset = train_gpt.parse_args(rest, "record" if device.type == "cuda" else "cpu")
    train_gpt.check_hyperparameters(args, own["processes"])
    if own["stage"] > len(stage_steps(args)):
        raise train_gpt.ConfigError(f"--stage={own['stage']}: the run has {len(stage_steps(args))} stages (1 to "
                                    f"{len(stage_steps(args))})")
    if args.vocab_size <= train_gpt.EOT_TOKEN:
        raise train_gpt.ConfigError(f"vocab_size={args.vocab_size}: --bench needs the GPT-2 vocabulary (above the "
                                    f"end-of-text id {train_gpt.EOT_TOKEN} that starts its synthetic documents)")
    if device.type == "cuda" and own["processes"] > torch.cuda.device_count():
        raise train_gpt.ConfigError(f"--processes={own['processes']}: this machine has {torch.cuda.device_count()} GPU(s)")
    untested = run_support.untested_torch_message()
    if untested:
        print(f"warning: {untested}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        shard = Path(tmp) / "synthetic_train_000000.bin"
        write_synthetic_shard(shard, 4 * args.batch_slots * (max(args.seq_len) + 1))
        if own["processes"] == 1:
            result = bench_stages(args, str(shard), own["steps"], 0, 1, device, own["stage"])
        else:
            result = run_workers(own["processes"], ["--bench-worker", json.dumps(rest), str(shard), str(own["steps"]),
                                                    str(own["stage"])], timeout=3600)
    report = bench_report(args, preset, result, own["processes"], device)
    print(report, flush=True)
    return report


def run_checks(device: torch.device) -> list[tuple[str, str, str]]:
    """(name, PASS/FAIL/SKIP, figures or reason) per check."""
    cuda = device.type == "cuda"
    record = train_gpt.Hyperparameters()
    training = dataclasses.replace(record, seq_len=(CHECK_SEQ_LEN,), batch_slots=1, num_iterations=100, warmup_steps=0)
    checks = [
        ("environment", lambda: check_environment(device)),
        ("fp8 matmul", lambda: check_fp8(device, *((max(record.seq_len), 768, 50304) if cuda else (64, 768, 512)))),
        ("fp8 mlp", lambda: check_fp8_mlp(device, max(record.seq_len) if cuda else 256, record.model_dim)),
        ("flex forward", lambda: check_flex(device, 4096 if cuda else 1024, backward=False,
                                            **({} if cuda else dict(heads=2, head_dim=32, stages=1)))),
        ("flex backward", lambda: check_flex(device, 4096, backward=True)),
        ("composition", lambda: check_composition(device, *((4096,) if cuda else (1024, 2, 32)))),
        ("training steps", lambda: check_training(device, training)),
        ("all-reduce", lambda: check_allreduce(device)),
    ]
    rows, unusable_gpus = [], False
    for name, check in checks:
        t0 = time.perf_counter()
        try:
            if unusable_gpus:
                raise Skip("NVIDIA GPUs that this torch cannot use (environment)")
            status, detail = "PASS", check()
        except Skip as why:
            status, detail = "SKIP", str(why)
        except Exception as e:  # a check that breaks is a FAIL with its reason, and the others still run
            status, detail = "FAIL", f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
            unusable_gpus = isinstance(e, UnusableGPUs)
        rows.append((name, status, f"{detail} [{time.perf_counter() - t0:.1f}s]"))
        print(f"{name:<16} {status:<5} {rows[-1][2]}", flush=True)
    return rows


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--allreduce-worker"]:
        return allreduce_worker(*argv[1:])
    if argv[:1] == ["--bench-worker"]:
        return bench_worker(*argv[1:])
    train_gpt.configure_cuda_allocator()  # as the training script does, before CUDA initializes
    if "--bench" in argv:
        try:
            return bench_main([arg for arg in argv if arg != "--bench"])
        except (train_gpt.ConfigError, train_gpt.DataError) as e:
            print(f"error: {e}", file=sys.stderr)
            sys.exit(2)
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                            formatter_class=argparse.RawDescriptionHelpFormatter).parse_args(argv)
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    print(f"The record preset computes what the {PUBLISHED_RECORD}.")
    print(f"{'check':<16} {'result':<5} figures")
    rows = run_checks(device)
    failed = [name for name, status, _ in rows if status == "FAIL"]
    print(f"{len(rows) - len(failed) - sum(s == 'SKIP' for _, s, _ in rows)} passed, {len(failed)} failed, "
          f"{sum(s == 'SKIP' for _, s, _ in rows)} skipped")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
