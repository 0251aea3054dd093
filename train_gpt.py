"""GPT-2 speedrun training script: one self-logging file, from one CPU core to 8xH100.

    torchrun --standalone --nproc_per_node=8 train_gpt.py            # the record preset on 8 GPUs
    python train_gpt.py --preset cpu --num_iterations=50              # anywhere
    python train_gpt.py --help                                        # presets and every hyperparameter

This file holds every line that can change what a run computes. What only reports or controls a
run (the command line, the log and its reports, checkpoint saving, stop signals) is in run_support.py,
whose source every log holds after this file's. Sections, in the order of the published record:
setup, FP8 custom ops, optimizers, model (layers, masks, attention, loss, GPT), gradient
synchronization, data, hyperparameters, the device plan, the training step and loop, main.
"""

# ------------------------------------------------------------------------------------------------
# Setup: imports, the process group, the CUDA allocator, CPU vector math

import copy
import dataclasses
import datetime
import functools
import glob
import itertools
import math
import os
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
if dist.is_available():
    # Before init_process_group: imported later (by torch.compile), its defaults hold the default group
    # past destroy_process_group, and gloo's threads, alive at interpreter exit, abort it (SIGABRT).
    import torch.distributed.nn  # noqa: F401
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask, flex_attention

import run_support as support
from run_support import ConfigError


class DataError(ValueError):
    """A data file the run cannot use; the message names it and says what to do."""


def configure_cuda_allocator(environ=os.environ) -> str:
    """Expandable segments let the CUDA caching allocator grow blocks in place instead of fragmenting
    (the record sets them). Must run before CUDA initializes; a user's own setting wins."""
    for name in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"):
        if name in environ:
            return f"{name}={environ[name]} (set by the user)"
    environ["PYTORCH_ALLOC_CONF"] = "expandable_segments:True"
    return "PYTORCH_ALLOC_CONF=expandable_segments:True"


PROCESS_GROUP_TIMEOUT = datetime.timedelta(minutes=10)


def setup_distributed() -> tuple[int, int, torch.device]:
    rank, world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    unusable_gpus = support.unusable_gpus_message()  # GPUs that this torch cannot use: never a silent CPU run
    if unusable_gpus:
        raise ConfigError(unusable_gpus)
    device = torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.empty(1, device="cuda", requires_grad=True).backward()  # the record's: prevents a bug on some systems
    if world_size > 1 and not dist.is_initialized():
        # A rank that dies is noticed by torchrun, which stops the others; the timeout bounds the
        # wait of a rank whose peer hangs without dying.
        if device.type == "cuda":
            dist.init_process_group("nccl", device_id=device, timeout=PROCESS_GROUP_TIMEOUT)
        else:
            dist.init_process_group("gloo", timeout=PROCESS_GROUP_TIMEOUT)
    return rank, world_size, device


SETTLE_ELEMENTS_PER_THREAD = 32768  # more than any elementwise op's grain (exp's is 2048): at::parallel_for gives every thread a chunk


def settle_vector_math():
    """On a thread that ran float32 matmuls, the first MKL exp, cos or sin came out slightly off in some
    processes (the rotary tables then differed between runs): this makes that first call, on every thread."""
    torch.ones(SETTLE_ELEMENTS_PER_THREAD * torch.get_num_threads()).exp()


def float32(value: float) -> float:
    """value rounded to float32, as a Python float: a record's float32 constant, exact in float32 arithmetic."""
    return float(np.float32(value))


# ------------------------------------------------------------------------------------------------
# FP8 in training: the lm_head's matmul as custom ops (inside the loss: SoftcappedLoss), x, w in e4m3 forward, the
# gradient in e5m2 backward, each divided by the record's fixed scale; the MLPs' forward matmuls with scales from amaxes.

LOGIT_SOFTCAP = 23.0  # logits = LOGIT_SOFTCAP * sigmoid((z + LOGIT_OFFSET) / LOGIT_SOFTCAP_SPREAD), z the lm_head's output
LOGIT_OFFSET = 5.0  # (records from 2025-12-26; 30 and 0 before)
LOGIT_SOFTCAP_SPREAD = 7.5
LM_HEAD_FP8_SCALES = (100 / 448, 1.6 / 448, 0.75 / 448)  # the record's (x, w, grad) scales (records from 2025-12-29),
# the grad's times the loss scale (from 2026-01-30)
LOSS_SCALE = 1.0  # training backpropagates each micro-batch's summed loss times this / accumulation steps (2026-01-30;
# 2 until 2026-02-10)


def softcap(z: Tensor, in_z_dtype: bool = False, cap: float = LOGIT_SOFTCAP, offset: float = LOGIT_OFFSET) -> Tensor:
    """Logits in (0, cap) from the lm_head's output z: in float32, or rounded to z's dtype (bf16) after each
    operation, as the records from 2025-09-27 compute validation's (and, until 2026-01-16, training's) loss."""
    return cap * torch.sigmoid(((z if in_z_dtype else z.float()) + offset) / LOGIT_SOFTCAP_SPREAD)


def _fp8_forward(x: Tensor, w: Tensor, x_s: float, w_s: float) -> tuple[Tensor, Tensor, Tensor]:
    x_f8 = x.div(x_s).to(torch.float8_e4m3fn)
    w_f8 = w.div(w_s).to(torch.float8_e4m3fn)
    out = torch._scaled_mm(x_f8, w_f8.T, out_dtype=torch.bfloat16, use_fast_accum=True,
                           scale_a=x.new_tensor(x_s, dtype=torch.float32),
                           scale_b=x.new_tensor(w_s, dtype=torch.float32))
    return out, x_f8, w_f8


def _fp8_backward(g_f8: Tensor, x_f8: Tensor, w_f8: Tensor, x_s: float, w_s: float, grad_s: float) -> tuple[Tensor, Tensor]:
    scale = lambda s: g_f8.new_tensor(s, dtype=torch.float32)
    # _scaled_mm wants its first operand row-major and its second column-major
    grad_x = torch._scaled_mm(g_f8, w_f8.T.contiguous().T, out_dtype=torch.bfloat16,
                              scale_a=scale(grad_s), scale_b=scale(w_s))
    grad_w = torch._scaled_mm(x_f8.T.contiguous(), g_f8.T.contiguous().T, out_dtype=torch.float32,
                              scale_a=scale(x_s), scale_b=scale(grad_s)).T
    return grad_x, grad_w


@functools.cache
def compiled_on_first_use(fn):
    """fn under torch.compile, for CUDA paths that run outside the compiled model (the FP8 scaling and
    casts, which then fuse; the MLPs' FP8 scale updates; the optimizers' updates; FlexAttention). Made on first use:
    importing stays cheap."""
    return torch.compile(fn, dynamic=False)


@torch.library.custom_op("nanogpt::fp8_mm", mutates_args=())
def fp8_mm(x: Tensor, w: Tensor, x_s: float, w_s: float) -> tuple[Tensor, Tensor, Tensor]:
    """x @ w.T in FP8 -> (bf16 result, x in e4m3, w in e4m3). x: (N, in), w: (out, in)."""
    return (compiled_on_first_use(_fp8_forward) if x.is_cuda else _fp8_forward)(x, w, x_s, w_s)


@fp8_mm.register_fake
def _(x, w, x_s, w_s):
    # The real op always returns bf16, whatever the input dtype; the fake must agree.
    return (x.new_empty(x.size(0), w.size(0), dtype=torch.bfloat16),
            torch.empty_like(x, dtype=torch.float8_e4m3fn), torch.empty_like(w, dtype=torch.float8_e4m3fn))


@torch.library.custom_op("nanogpt::fp8_mm_backward", mutates_args=())
def fp8_mm_backward(g_f8: Tensor, x_f8: Tensor, w_f8: Tensor, x_s: float, w_s: float, grad_s: float) -> tuple[Tensor, Tensor]:
    """Gradients of fp8_mm from the output's gradient g_f8 in e5m2, divided by grad_s: (grad_x in bf16, grad_w in
    fp32)."""
    return (compiled_on_first_use(_fp8_backward) if g_f8.is_cuda else _fp8_backward)(g_f8, x_f8, w_f8, x_s, w_s, grad_s)


@fp8_mm_backward.register_fake
def _(g_f8, x_f8, w_f8, x_s, w_s, grad_s):
    # grad_w is the transpose of a row-major (in, out) result; the fake must have the same strides
    return (x_f8.new_empty(x_f8.shape, dtype=torch.bfloat16),
            w_f8.new_empty(w_f8.shape[::-1], dtype=torch.float32).T)


E4M3_MAX = 448.0  # float8_e4m3fn's largest finite value: an FP8 scale maps a tensor's amax (times a headroom) onto it
AMAX_FLOOR = 1e-12  # under every amax, so that an all-zero tensor's scale stays finite (the records')
# The MLP's down-projection scales late (records from 2026-07-17): its input by 1.8 x the amax of the previous forward's,
# its weight by 1.12 x the amax before the last optimizer step, headroom for what the step changed
ACT_SCALE_HEADROOM = 1.8
DOWN_WEIGHT_HEADROOM = 1.12
DOWN_BOOTSTRAP_STEPS = 16  # the updates after steps 0..15 scale the down weight by its own amax: from zero it grows fast


def rounded_to(x: Tensor, dtype: torch.dtype = torch.bfloat16) -> Tensor:
    """float32 x rounded to dtype (to nearest, ties to even), kept in float32, where the records' kernels round and go
    on in float32. Inductor drops a bfloat16 round trip inside a fused kernel: compiled, bf16 rounds the bits."""
    if dtype != torch.bfloat16 or not torch.compiler.is_compiling():
        return x.to(dtype).float()
    bits = x.view(torch.int32)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -0x10000  # half a bf16 ulp less one, plus the lsb kept: ties to even
    return torch.where(x.isnan(), x, bits.view(torch.float32))


def current_scale(w: Tensor) -> Tensor:
    """The FP8 scale of a bf16 weight from its own amax: amax (floored) / E4M3_MAX, float32, each step rounded to bf16 as
    the records compute it on the weight (2026-05-19). A quotient of bf16 values is never near a bf16 tie, so a division
    within a few float32 ulps rounds alike (inductor's on CUDA: a product with 1/448's float32)."""
    amax = rounded_to(w.detach().abs().amax().float().clamp(min=AMAX_FLOOR))
    return rounded_to(amax / E4M3_MAX)


def headroom_scale(amax: Tensor, headroom: float) -> Tensor:
    """A delayed FP8 scale: an earlier amax (floored) times headroom / E4M3_MAX in float32 (2026-07-17)."""
    return amax.float().clamp(min=AMAX_FLOOR) * (headroom / E4M3_MAX)


def scaled_product(a: Tensor, b: Tensor, scale_a: Tensor, scale_b: Tensor) -> Tensor:
    """a @ b in bf16 for e4m3 a (row-major) and b (column-major): the products summed in float32, times scale_a
    scale_b (float32), rounded once. CUDA: _scaled_mm, with the records' fast accumulation; elsewhere the sum exact (in
    float64: e4m3 products are multiples of 2^-18 below 2^18) for fewer than 2^17 terms, rounded once to float32."""
    if a.is_cuda:
        return torch._scaled_mm(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=torch.bfloat16, use_fast_accum=True)
    return rounded_to((a.double() @ b.double()).float() * (scale_a * scale_b)).bfloat16()


def fp8_mlp_forward(x: Tensor, w_up: Tensor, w_down: Tensor, act_scale: Tensor, down_scale: Tensor) -> tuple[Tensor, Tensor]:
    """post = relu(x @ w_up.T)^2 and post @ w_down in bf16 through e4m3 copies (x (N, D), the weights (4D, D) bf16) as
    the records' kernels compute them: x scaled by its amax, w_up by its own (2026-05-19); post by act_scale, w_down by
    down_scale, made from earlier amaxes (2026-07-17). Returns (post, output)."""
    up_scale = current_scale(w_up)
    w_up_f8 = rounded_to(w_up.float() / up_scale).to(torch.float8_e4m3fn)  # the quotient in bf16, as the weight's
    x_amax = x.abs().amax().float().clamp(min=AMAX_FLOOR)
    x_f8 = (x.float() * (E4M3_MAX / x_amax)).to(torch.float8_e4m3fn)  # as torch computes 448 / amax: 448 x (1 / amax)
    # the record's compiled graph divides by 448 as inductor does on CUDA: times 1/448's float32
    pre = scaled_product(x_f8, w_up_f8.T, up_scale * x_amax * (1 / E4M3_MAX), torch.ones_like(up_scale))
    post = rounded_to(F.relu(pre.float()).square())
    post_f8 = (post * act_scale.reciprocal()).clamp(max=E4M3_MAX).to(torch.float8_e4m3fn)
    w_down_f8 = (w_down.T.float() / down_scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).contiguous().T
    return post.bfloat16(), scaled_product(post_f8, w_down_f8, act_scale, down_scale)


def refresh_down_scales(weights: list[Tensor], scales: list[Tensor], next_scales: list[Tensor], bootstrap: bool):
    """After an optimizer step, each down-projection weight (bf16) takes the scale made after the step before (bootstrap:
    its own amax's instead) and makes the next from its amax now, headroom DOWN_WEIGHT_HEADROOM (2026-07-17)."""
    for w, scale, next_scale in zip(weights, scales, next_scales, strict=True):
        w = w.detach().bfloat16()
        if bootstrap:
            next_scale.copy_(current_scale(w))
        scale.copy_(next_scale)
        next_scale.copy_(headroom_scale(w.abs().amax(), DOWN_WEIGHT_HEADROOM))


# ------------------------------------------------------------------------------------------------
# Optimizers: Muon for hidden matrices, the record's Adam for everything else

# Polar Express (arXiv 2505.16932), 5 iterations, safety factor 2e-2, cushion 2: one (a, b, c) per
# iteration of X <- a*X + (b*A + c*A^2)*X with A = X*X^T (a tall X: X*(b*A + c*A^2) with A = X^T*X).
POLAR_EXPRESS_COEFFS = [
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
]
POLAR_EXPRESS_SAFETY = 2e-2
ORTHOGONALIZATION_STEPS = len(POLAR_EXPRESS_COEFFS)


def orthogonalize(G: Tensor, dtype: torch.dtype = torch.bfloat16, add_apart: bool = False) -> Tensor:
    """Approximately replace each matrix in the last two dims of G by U V^T (its polar factor) with Polar Express (the
    records' from 2025-09-29), computed in dtype: bf16 for speed; float32 where runs are compared (bf16 rounding
    amplifies tiny differences). add_apart: the product (B X, or X B for a tall X) and a X added apart (two roundings),
    as the records from 2025-12-11 do for MLPs."""
    X = G.to(dtype)
    tall = X.size(-2) > X.size(-1)  # then the smaller Gram matrix is X^T X, multiplied from the right (from 2026-02-16)
    X = X / (X.norm(dim=(-2, -1), keepdim=True) * (1 + POLAR_EXPRESS_SAFETY) + 1e-6)
    # Each line rounds once, as the record's kernels do: A, B = b A + c A A^T, X = a X + B X (or X B), the last two as
    # one scaled product and sum each (add_apart: the last twice); a lone matrix as a stack of one, as the record's.
    shape = X.shape
    X = X.reshape(-1, *shape[-2:]).contiguous()
    for a, b, c in POLAR_EXPRESS_COEFFS:
        A = X.mT @ X if tall else X @ X.mT
        B = torch.baddbmm(A, A, A.mT, beta=b, alpha=c)
        left, right = (X, B) if tall else (B, X)
        X = torch.bmm(left, right).add_(X, alpha=a) if add_apart else torch.baddbmm(X, left, right, beta=a)
    return X.view(shape)


def orthogonalization_flops(shape) -> int:
    """Matmul FLOPs of orthogonalize() on one parameter: per iteration X X^T, A A and B X on the
    short side m of each (m, n) matrix, i.e. 4 m^2 n + 2 m^3."""
    *batch, rows, cols = shape
    m, n = min(rows, cols), max(rows, cols)
    return math.prod(batch) * ORTHOGONALIZATION_STEPS * (4 * m * m * n + 2 * m**3)


def deal_by_cost(costs: list[int], world_size: int) -> list[list[int]]:
    """Indices of costs dealt to world_size ranks, largest first, each to the least-loaded rank (lowest
    rank on ties), so every rank gets about the same total. Each rank's list is largest first."""
    loads, dealt = [0] * world_size, [[] for _ in range(world_size)]
    for i in sorted(range(len(costs)), key=lambda i: -costs[i]):
        rank = loads.index(min(loads))
        dealt[rank].append(i)
        loads[rank] += costs[i]
    return dealt


NORMUON_EPS = 1e-10  # the floor of NorMuon's second moments and norms (the record's clamp_min): finite at zero


def cautious_update(p: Tensor, update: Tensor, wd_factor: Tensor, lr_factor: Tensor, low_half: Tensor | None = None):
    """p -= lr' (update + lr wd mask p), mask where the update moves p toward zero (or leaves it), in the records'
    (2025-12-11) one expression; lr_factor and wd_factor are CPU scalars, cast to p's dtype. low_half: p is bfloat16,
    the high half of a float32 value whose low 16 bits low_half holds (uint16): the update is made on that value, in
    float32, which p then truncates (the records from 2026-01-04)."""
    if low_half is None:
        mask = (update * p) >= 0
        wd_factor, lr_factor = wd_factor.to(p.dtype), lr_factor.to(p.dtype)
        p.copy_(p - (p * mask * wd_factor * lr_factor) - (update * lr_factor))
        return
    bits = (p.view(torch.uint16).to(torch.int32) << 16) | low_half.to(torch.int32)
    value, update = bits.view(torch.float32), update.float()
    mask = (update * value) >= 0
    wd_factor, lr_factor = wd_factor.to(torch.float32), lr_factor.to(torch.float32)
    value.copy_(value - (value * mask * wd_factor * lr_factor) - (update * lr_factor))
    p.view(torch.uint16).copy_((bits >> 16).to(torch.uint16))  # the int32's upper half: its sign bits fall away
    low_half.copy_(bits.to(torch.uint16))


def neuron_axis(shape) -> int:
    """The axis NorMuon averages over: each row's mean square, or each column's in a wide matrix (the records' from
    2026-04-08, whose head-pair blocks are the first wide ones)."""
    return -1 if shape[-2] >= shape[-1] else -2


def normalize_neurons(update: Tensor, second_moment: Tensor, beta2: float) -> Tensor:
    """NorMuon (Li et al., 2025) as the records from 2025-12-11 compute it, in place: divide each matrix of the stack by
    the root of second_moment, an EMA of each row's (neuron_axis) mean square, then scale it back to its Frobenius
    norm; the statistics in float32, both norms from the mean squares."""
    axis = neuron_axis(update.shape)
    mean_square = update.float().square().mean(dim=axis, keepdim=True)
    norm_before = (mean_square.sum(dim=(-2, -1), keepdim=True) * update.size(axis)).sqrt_()
    second_moment.lerp_(mean_square.to(second_moment.dtype), 1 - beta2)
    step_size = second_moment.clamp_min(NORMUON_EPS).rsqrt_()
    norm_after = ((mean_square * update.size(axis)) * step_size.float().square()).sum(dim=(-2, -1), keepdim=True).sqrt_()
    return update.mul_((step_size * (norm_before / norm_after.clamp_min_(NORMUON_EPS))).type_as(update))


def restore_state_dtypes(optimizer: torch.optim.Optimizer, state_dict: dict):
    """After Optimizer.load_state_dict, which casts each floating state tensor to its parameter's dtype (a bfloat16
    matrix's float32 momentum, say): every state tensor as it was saved."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for index, saved in state_dict["state"].items():
        for key, value in saved.items():
            if isinstance(value, Tensor):
                optimizer.state[params[index]][key] = value.to(params[index].device, copy=True)


class Muon(torch.optim.Optimizer):
    """Nesterov momentum, then orthogonalization, for hidden matrices (..., rows, cols). Each rank owns the matrices
    dealt to it by FLOPs, orthogonalizes and updates each alone and all-gathers the updated values: the same bits at
    any world size. Its momentum and second moments are float32; a bfloat16 matrix's update is made on its float32
    value, whose low half the owner keeps (cautious_update). lr_mul: {parameter: factor on its lr}, the others 1;
    add_apart: the parameters whose orthogonalization adds apart."""

    def __init__(self, params, lr: float, momentum: float, nesterov: bool = True,
                 dtype: torch.dtype = torch.bfloat16, rank: int = 0, world_size: int = 1, neuron_beta2: float = 0.0,
                 weight_decay: float = 0.0, lr_mul: dict | None = None, add_apart=(), compiled: bool = False):
        # Larger matrices first: rounds then pair matrices of similar size, wasting little padding.
        params = sorted(params, key=lambda p: -p.numel())
        super().__init__([dict(params=params)], dict(lr=lr, momentum=momentum, nesterov=nesterov,
                                                     weight_decay=weight_decay))
        self.dtype, self.rank, self.world_size = dtype, rank, world_size
        if len({p.dtype for p in params}) > 1:
            raise ValueError("Muon's matrices must share a dtype: the ranks gather them in one")
        self.neuron_beta2 = neuron_beta2
        # The records' per-matrix lr factor: sqrt(max(1, rows/cols)) of each matrix of the stack (of q, k, v and o
        # alone from 2026-01-18; 1 for q's and k's head pairs from 2026-04-08), times lr_mul. Each step's lr' and wd
        # lr are made in double precision, then held in float32 CPU scalars (rounded once, as the records' from
        # 2026-01-18), inputs of the compiled update.
        self.lr_mul, self.add_apart = lr_mul or {}, set(add_apart)
        self.lr_factor = {p: max(1.0, p.size(-2) / p.size(-1)) ** 0.5 * self.lr_mul.get(p, 1.0) for p in params}
        self.step_lr, self.decay = torch.zeros(()), torch.zeros(())
        self.orthogonalize = compiled_on_first_use(orthogonalize) if compiled else orthogonalize
        self.normalize = compiled_on_first_use(normalize_neurons) if compiled else normalize_neurons
        self.update = compiled_on_first_use(cautious_update) if compiled else cautious_update
        costs = [orthogonalization_flops(p.shape) for p in params]
        dealt = deal_by_cost(costs, world_size)
        self.dealt = [[params[i] for i in indices] for indices in dealt]  # the matrices each rank owns
        self.flops_per_rank = [sum(costs[i] for i in indices) for indices in dealt]  # the log reports the balance
        self.rounds = [[mine[r] if r < len(mine) else None for mine in self.dealt]
                       for r in range(max(map(len, self.dealt)))]

    @torch.no_grad()
    def step(self):
        group = self.param_groups[0]
        momentum = group["momentum"]
        self.decay.fill_(group["weight_decay"] * group["lr"])
        for p in self.dealt[self.rank]:
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p, dtype=torch.float32)
            # 1 - momentum in float32, as the record's fused update makes it (from 2026-02-16)
            state["momentum_buffer"].lerp_(p.grad.float(), float32(1 - np.float32(momentum)))
        in_flight = None
        for round_params in self.rounds:
            size = max(p.numel() for p in round_params if p is not None)
            local = round_params[self.rank]
            out = torch.zeros(size, dtype=group["params"][0].dtype, device=group["params"][0].device)
            if local is not None:
                self._update(local, group)
                out[:local.numel()] = local.flatten()
            if self.world_size > 1:
                gathered = out.new_empty(size * self.world_size)
                handle = dist.all_gather_into_tensor(gathered, out, async_op=True)
                if in_flight is not None:  # take the previous round's values while this one is gathered
                    self._receive(*in_flight)
                in_flight = (round_params, gathered, handle, size)
        if in_flight is not None:
            self._receive(*in_flight)

    def _update(self, p: Tensor, group: dict):
        """Orthogonalizes the Nesterov momentum of p, one of this rank's, normalizes its rows (NorMuon) and updates p.
        Cautious weight decay: lr wd p joins the update only where the update moves p toward zero (or leaves it), so
        the step decays p by lr' lr wd, in proportion to lr^2."""
        state = self.state[p]
        momentum = state["momentum_buffer"]
        grad = p.grad.float().lerp(momentum, group["momentum"]) if group["nesterov"] else momentum
        update = self.orthogonalize(grad, self.dtype, p in self.add_apart)
        if self.neuron_beta2:
            update = self._normalize_neurons(p, update)
        if p.dtype == torch.bfloat16 and "low_half" not in state:  # its value so far: exactly the bfloat16 one
            state["low_half"] = torch.zeros_like(p, dtype=torch.uint16)
        self.step_lr.fill_(self.lr_factor[p] * group["lr"])
        self.update(p, update, self.decay, self.step_lr, state.get("low_half"))

    def _normalize_neurons(self, p: Tensor, update: Tensor) -> Tensor:
        state = self.state[p]
        if "neuron_second_moment" not in state:  # per row (column) of each matrix of the stack, float32 (from 2026-01-04)
            shape = list(p.shape)
            shape[neuron_axis(shape)] = 1
            state["neuron_second_moment"] = torch.zeros(shape, dtype=torch.float32, device=p.device)
        return self.normalize(update, state["neuron_second_moment"], self.neuron_beta2)

    def _receive(self, round_params: list, gathered: Tensor, handle, size: int):
        """The other ranks' matrices of a round, as their owners updated them."""
        handle.wait()
        for k, p in enumerate(round_params):
            if p is not None and k != self.rank:
                p.copy_(gathered[k * size:k * size + p.numel()].view_as(p))

    def state_dict(self) -> dict:
        """Every matrix's state, gathered from its owner: a collective, which every rank calls. Off the
        clock and rare, so the owners' states travel pickled, through the host."""
        state = super().state_dict()
        if self.world_size > 1:
            index = {p: i for i, p in enumerate(self.param_groups[0]["params"])}  # the state dict's keys
            owned = {index[p]: {k: v.cpu() for k, v in self.state[p].items()} for p in self.dealt[self.rank]
                     if p in self.state}
            gathered = [None] * self.world_size
            dist.all_gather_object(gathered, owned)
            for rank, states in enumerate(gathered):
                if rank != self.rank:
                    state["state"].update(states)
        return state

    def load_state_dict(self, state_dict: dict):
        super().load_state_dict(state_dict)
        restore_state_dtypes(self, state_dict)
        mine = set(self.dealt[self.rank])
        for p in [p for p in self.state if p not in mine]:
            del self.state[p]


def adam_update(p: Tensor, grad: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, step_size: Tensor, decay: Tensor,
                beta1: float, beta2: float, eps: float, decays: bool = True):
    """One Adam step of p in place, as the records from 2025-12-31 compute it: eps is added to sqrt(v), not to
    sqrt(v) / sqrt(1 - beta2^t); step_size holds the lr and both bias corrections. Cautious weight decay: decay p
    joins the update where the update moves p toward zero (the mask > 0 of the records from 2025-12-22); decays=False
    leaves that out, for a decay of 0 (the same result, without the work)."""
    exp_avg.mul_(beta1).add_(grad, alpha=1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    update = exp_avg.div(exp_avg_sq.sqrt().add_(eps)).mul_(step_size)
    if decays:
        mask = (update * p) > 0
        update.add_(p.to(update.dtype) * mask * decay)  # the record's addcmul_ of mask, p and decay: no host read of decay
    p.add_(update, alpha=-1.0)


class Adam(torch.optim.Optimizer):
    """Adam with cautious weight decay, each group with its own lr, lr_mul (a factor on the scheduled lr), betas and
    wd_mul (decay lr^2 wd wd_mul: the lr twice, so that the decay follows the schedule); its moments in float32 at least (the records' from 2025-12-31). Compiled on
    CUDA, as in the record. Parameters in idle (the embedding while it is tied) are not stepped."""

    def __init__(self, param_groups: list[dict], eps: float, weight_decay: float = 0.0, compiled: bool = False):
        if any("betas" not in group for group in param_groups):
            raise ValueError("each Adam group names its betas (the records' per parameter kind, from 2026-01-04)")
        super().__init__(param_groups, dict(eps=eps, weight_decay=weight_decay, wd_mul=1.0, lr_mul=1.0))
        self.update = compiled_on_first_use(adam_update) if compiled else adam_update
        self.idle = set()
        # The step size and decay of each update, computed in double precision as the record's Python floats, then
        # held in CPU float32 scalars: inputs of the compiled update (a Python float would recompile it at every value).
        self.step_size, self.decay = torch.zeros(()), torch.zeros(())

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            (beta1, beta2), eps = group["betas"], group["eps"]
            lr = group["lr"] * group["lr_mul"]  # the scheduled lr, then the group's factor (the records' order)
            for p in group["params"]:
                if p.grad is None or p in self.idle:
                    continue
                state = self.state[p]
                if not state:
                    moment = lambda: torch.zeros_like(p, dtype=torch.promote_types(p.dtype, torch.float32))
                    state.update(step=0, exp_avg=moment(), exp_avg_sq=moment())
                state["step"] += 1
                t = state["step"]
                self.step_size.fill_(lr * ((1 - beta2**t) ** 0.5 / (1 - beta1**t)))
                self.decay.fill_(lr * lr * group["weight_decay"] * group["wd_mul"])
                self.update(p, p.grad, state["exp_avg"], state["exp_avg_sq"], self.step_size, self.decay, beta1, beta2, eps,
                            group["weight_decay"] * group["wd_mul"] != 0)

    def copy_state(self, source: nn.Parameter, target: nn.Parameter):
        """target takes source's values and moments, and its step count (the untie of the records from 2025-12-22)."""
        target.data.copy_(source.data)
        self.state[target] = {k: v.clone() if isinstance(v, Tensor) else v for k, v in self.state[source].items()}

    def load_state_dict(self, state_dict: dict):
        super().load_state_dict(state_dict)
        restore_state_dtypes(self, state_dict)


# ------------------------------------------------------------------------------------------------
# Model: layers, masks, attention, loss, GPT

BLOCK_SIZE = 128  # FlexAttention block; sequence lengths and windows are counted in these
EOT_TOKEN = 50256  # <|endoftext|> starts every document in the shards


def next_multiple(n: int, k: int) -> int:
    return -(-n // k) * k


def norm(x: Tensor) -> Tensor:
    return F.rms_norm(x, (x.size(-1),))


def init_bound(fan_in: int, std_scale: float = 0.5) -> float:
    """Weights start uniform in +-bound: std std_scale / sqrt(fan_in) (in the record's order of operations)."""
    return 3**0.5 * (std_scale * fan_in**-0.5)


class CastedLinear(nn.Linear):
    """A bias-free linear layer with its weights cast to the activations' dtype. Zero-initialized, drawing nothing
    (records from 2025-10-27)."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__(in_features, out_features, bias=False)

    def reset_parameters(self):
        with torch.no_grad():
            self.weight.zero_()

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight.type_as(x))


YARN_ALPHA, YARN_BETA = 1, 32  # YaRN's defaults (the record's): rotations over the window below which a frequency
# is fully interpolated, and above which it is kept


class Rotary(nn.Module):
    """Rotary embedding on adjacent pairs of dims (2i, 2i+1) of the first half of each head's, the second half still
    (the records from 2026-01-07; the halves (i, i + D/4) before), one table for every layer. freqs is a float32 CPU
    tensor, not a buffer: the tables are made on the CPU and copied, so every device holds the same values. They hold
    cos and sin (every second entry negated) for twice max_seq_len positions, the paired-head layers' interleaved
    sequence; they are stored in dtype, rounded from float32, and q and k rotate in it (float32: upcast and back)."""

    def __init__(self, head_dim: int, max_seq_len: int, window_unit: int = BLOCK_SIZE, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.window_unit = window_unit  # tokens per unit of the windows rescale() is given
        freqs = (1 / 1024) ** torch.linspace(0, 1, steps=head_dim // 4, dtype=torch.float32)
        self.freqs = torch.cat([freqs.repeat_interleave(2), freqs.new_zeros(head_dim // 2)])
        self.cos = nn.Buffer(torch.empty(2 * max_seq_len, head_dim, dtype=dtype), persistent=False)
        self.sin = nn.Buffer(torch.empty(2 * max_seq_len, head_dim, dtype=dtype), persistent=False)
        self._fill_tables()

    def _fill_tables(self):
        theta = torch.outer(torch.arange(self.cos.size(0), dtype=torch.float32), self.freqs)
        self.cos.copy_(theta.cos())
        self.sin.copy_(theta.sin())
        self.sin[:, 1::2] *= -1

    def rescale(self, old_window: int, new_window: int):
        """YaRN (arXiv 2309.00071) as the 2025-09-10 record applies it at a window change (in window units): frequencies
        turning under YARN_ALPHA times over the old window slow by old/new, over YARN_BETA keep theirs; between, blend."""
        rotations = self.window_unit * old_window * self.freqs / (2 * torch.pi)
        ratio = old_window / new_window
        blend = torch.clamp((rotations - YARN_ALPHA) / (YARN_BETA - YARN_ALPHA), 0, 1)
        self.freqs *= ratio + blend * (1 - ratio)
        self._fill_tables()

    def forward(self, x: Tensor, positions: int | Tensor = 0, paired: bool = False) -> Tensor:
        """x (B, T, H, D) at positions, the first one's (the others follow it) or each token's (T,). paired: x is
        (B, T, H/2, 2D), each pair of heads one vector whose halves turn at positions 2t and 2t + 1 (the records'
        paired-head layers from 2026-01-07)."""
        cos, sin = (self.cos, self.sin) if not paired else (self.cos.view(-1, 2 * self.cos.size(1)),
                                                            self.sin.view(-1, 2 * self.sin.size(1)))
        at = slice(positions, positions + x.size(-3)) if isinstance(positions, int) else positions
        cos, sin = cos[None, at, None, :], sin[None, at, None, :]
        rotated = x.to(cos.dtype)
        swapped = rotated.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)  # (x1, x0, x3, x2, ...)
        return (cos * rotated + sin * swapped).type_as(x)


def attention_mask(tokens: Tensor, window: int, backend: str, first_query: int = 0, paired: bool = False):
    """Causal attention within documents (each starts at EOT_TOKEN) to keys at most window positions back: a BlockMask
    for backend "flex", a dense boolean mask of exactly its pairs for "sdpa" (generation: rows from first_query's).
    paired: over the paired-head layers' sequence, each token twice in a row (two positions of its document)."""
    docs = (tokens == EOT_TOKEN).cumsum(0)
    per_token = 2 if paired else 1  # positions of each token

    def allowed(b, h, q_idx, kv_idx):
        same_doc = docs[q_idx // 2] == docs[kv_idx // 2] if paired else docs[q_idx] == docs[kv_idx]
        return (q_idx >= kv_idx) & (q_idx - kv_idx <= window) & same_doc

    if backend != "flex":
        pos = torch.arange(per_token * tokens.numel(), device=tokens.device)
        return allowed(None, None, pos[per_token * first_query:, None], pos[None, :])
    # Per (query block, key block): full when every pair is allowed, partial when some may be.
    position_docs = docs.repeat_interleave(per_token) if paired else docs
    num_blocks = position_docs.numel() // BLOCK_SIZE
    first = position_docs.view(num_blocks, BLOCK_SIZE)[:, 0]
    last = position_docs.view(num_blocks, BLOCK_SIZE)[:, -1]
    blocks = torch.arange(num_blocks, device=tokens.device)
    distance = BLOCK_SIZE * (blocks[:, None] - blocks)  # between the blocks' first tokens
    some = (distance >= 0) & (distance - (BLOCK_SIZE - 1) <= window) & (first[:, None] <= last) & (last[:, None] >= first)
    every = (distance > 0) & (distance + (BLOCK_SIZE - 1) <= window) & (first[:, None] == last) & (last[:, None] == first)

    def listed(mask):  # each row's count, and its blocks first
        order = torch.argsort(mask.logical_not().to(torch.int8), dim=-1, stable=True)
        return mask.sum(-1, dtype=torch.int32)[None, None], order.to(torch.int32)[None, None]

    return BlockMask.from_kv_blocks(*listed(some & ~every), *listed(every), BLOCK_SIZE=BLOCK_SIZE, mask_mod=allowed)


def attention_masks(tokens: Tensor, window: int, backend: str, first_query: int = 0, unit: int = BLOCK_SIZE,
                    long_window: int | None = None, paired: bool = False) -> dict[tuple[bool, bool], object]:
    """The mask of each kind of layer, by (paired, long), for a long window of window units of unit tokens: that many
    units (or long_window's) for the long layers, half of window (rounded down) for the short ones, as many positions
    in the paired-head layers' sequence (the record's window in tokens: half as many tokens there); paired: those
    layers' masks too."""
    return {(pair, long): attention_mask(tokens, (long_window or window if long else window // 2) * unit, backend,
                                         first_query, pair)
            for pair in ((False, True) if paired else (False,)) for long in (True, False)}


# Dense-mask attention runs this many queries at a time, each block against the keys up to its last
# query; smaller blocks mean more, smaller SDPA calls (records/track_cpu/README.md).
SDPA_QUERY_BLOCK = 256


def attend(q: Tensor, k: Tensor, v: Tensor, mask, scale: float) -> Tensor:
    """Attention over (B, H, T, D) with a mask from attention_masks(): the queries are the last T of
    the keys' positions (all of them in training; a KV cache's new ones in generation)."""
    if isinstance(mask, BlockMask):
        # Outside a compiled graph, flex_attention runs a reference path that materializes every
        # score (tens of GB at the record's 48K tokens); its compiled kernel alone does not.
        kernel = flex_attention if torch.compiler.is_compiling() else compiled_on_first_use(flex_attention)
        if v.is_cpu:  # torch 2.13's compiled CPU kernel misreads a v that is a view of the qkv projection
            v = v.clone()
        return kernel(q, k, v, block_mask=mask, scale=scale)
    # SDPA computes every score a dense mask covers, and no query sees a later key: query blocks that
    # skip the keys after them do less work, with the same result up to float rounding.
    num_queries, first_query = q.size(2), k.size(2) - q.size(2)
    if num_queries <= SDPA_QUERY_BLOCK:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    blocks = []
    for start in range(0, num_queries, SDPA_QUERY_BLOCK):
        stop = min(start + SDPA_QUERY_BLOCK, num_queries)
        keys = first_query + stop
        blocks.append(F.scaled_dot_product_attention(q[:, :, start:stop], k[:, :, :keys], v[:, :, :keys],
                                                     attn_mask=mask[..., start:stop, :keys], scale=scale))
    return torch.cat(blocks, dim=2)


LOG2E = math.log2(math.e)  # exp(x) = exp2(x * LOG2E)
COMPOSITION_WINDOW = 112  # keys of each query's composed attention, its own the newest (the 2026-05-27 record's)
COMPOSITION_EPS = 1e-6  # the rms norm's eps of each token's head-mixing weights (2026-05-27)
COMPOSITION_CHUNK = 128  # queries at a time in eager runs: their window's products take chunk x window x D a head


def document_starts(tokens: Tensor, restarts: Tensor | None = None) -> Tensor:
    """Each position's document's first position (T,): the last EOT_TOKEN (or restart, evaluation's) at or before it,
    0 before the first (the documents of attention_mask())."""
    positions = torch.arange(tokens.numel(), device=tokens.device)
    firsts = tokens == EOT_TOKEN if restarts is None else (tokens == EOT_TOKEN) | restarts
    return torch.where(firsts, positions, 0).cummax(0).values


def composition_weights(mix: Tensor, gain: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """The composed attention's per-token weights (B, T, H) in dtype (the activations'), from a gate's outputs: mix
    rms-normed over the heads in float32 (the 2026-05-27 record's), gain as it is."""
    return F.rms_norm(mix.float(), (mix.size(-1),), eps=COMPOSITION_EPS).to(dtype), gain.to(dtype)


def composed_attention_correction(y: Tensor, q: Tensor, k: Tensor, v: Tensor, mix: Tensor, gain: Tensor,
                                  starts: Tensor, scale: float, window: int = COMPOSITION_WINDOW,
                                  chunk: int = COMPOSITION_CHUNK) -> Tensor:
    """y (B, H, Tq, D), attend()'s output, plus the 2026-05-27 record's composed attention (post-softmax only, its
    layer 10's): each head's softmax over the query's last `window` keys within its document, at attend's scale;
    those patterns summed over the heads, weighted by mix, into one per query; each head adding its values under that
    pattern times its gain. q: (B, H, Tq, D), the last Tq positions of k's and v's (B, H, Tk, D) (in generation a KV
    cache's new ones); mix, gain: (B, Tq, H) from composition_weights(); starts: (Tq,) each query's document's first
    key (document_starts()). Computed in float32 from the inputs' values, as the record's kernel: each head's weights
    rounded to v's dtype before the product with v, y + the correction to y's dtype."""
    Tq, Tk = q.size(2), k.size(2)
    # Slot s of query i holds key Tk - Tq + i - (window - 1) + s; slots before key 0 hold zeros, masked as outside the
    # document. Eager, chunk queries at a time; compiled, all at once: inductor sums the products without storing them.
    first = Tk - Tq - (window - 1)
    # (B, H, Tq, D, window) views of one unfold: backward sums each key's gradient over its queries in one pass,
    # whatever the chunk (eager, holding window x D a query and head).
    keys, values = (F.pad(t[:, :, max(first, 0):].float(), (0, 0, max(-first, 0), 0)).unfold(2, window, 1)
                    for t in (k, v))
    slots = torch.arange(first, first + Tq, device=q.device)[:, None] + torch.arange(window, device=q.device)
    allowed = slots >= starts[:, None]
    # The record's kernel takes exp2 of logits times scale * log2(e), that product in float32.
    log2_scale = float32(float32(scale) * float32(LOG2E))
    mix, gain = (w.float().transpose(1, 2) for w in (mix, gain))
    chunk = Tq if torch.compiler.is_compiling() else chunk
    corrections = [composed_chunk(*inputs, log2_scale, v.dtype) for inputs in zip(
        q.float().split(chunk, 2), keys.split(chunk, 2), values.split(chunk, 2), allowed.split(chunk),
        mix.split(chunk, 2), gain.split(chunk, 2))]
    return (y.float() + torch.cat(corrections, dim=2)).to(y.dtype)


def composed_chunk(q: Tensor, keys: Tensor, values: Tensor, allowed: Tensor, mix: Tensor, gain: Tensor,
                   log2_scale: float, weight_dtype: torch.dtype) -> Tensor:
    """composed_attention_correction()'s correction of a chunk of C queries q (B, H, C, D), float32, against their
    window's slots: keys, values (B, H, C, D, window), allowed (C, window), mix, gain (B, H, C). Every sum runs over
    the same slots in the same order whatever the chunk: no result depends on it."""
    logits = ((q[..., None] * keys).sum(-2) * log2_scale).masked_fill(~allowed, -math.inf)
    # Softmax is unchanged by the shift: the max takes no gradient.
    powers = torch.exp2(logits - logits.amax(-1, keepdim=True).detach())
    probs = powers / powers.sum(-1, keepdim=True)
    pattern = mix[:, 0, :, None] * probs[:, 0]
    for h in range(1, q.size(1)):  # over the heads in order, as the kernel adds them
        pattern = pattern + mix[:, h, :, None] * probs[:, h]
    weights = gain[..., None] * pattern[:, None]
    weights = rounded_to(weights, weight_dtype)
    return (weights[..., None, :] * values).sum(-1)


def attention_scales(windows, first_scale: float, growth: float) -> dict[int, float]:
    """The softmax scale (QK-normed, so no 1/sqrt(d)) for each window of a run in order: first_scale,
    times 1 + growth ln(new / previous) at each new window (longer windows, sharper attention)."""
    distinct = list(dict.fromkeys(windows))
    scales = [first_scale]
    for previous, new in zip(distinct, distinct[1:]):
        scales.append(scales[-1] * (growth * math.log(new / previous) + 1))
    return dict(zip(distinct, scales))


GATE_INPUTS = 12  # the smear's gate reads the embedding's first dims; the value-embedding gates half x's, half ve's
SKIP_LAMBDA_INIT = -1.5  # the skip's weight starts at sigmoid(-1.5) times its gate (records from 2025-09-11)
XSA_FLOOR = 1e-8  # XSA divides by |v|^2 no smaller than this (the 2026-04-29 record's clamp)


def offset_keys(k: Tensor, before: Tensor | None = None, restarts: Tensor | None = None) -> Tensor:
    """Keys k (B, T, H, D) whose second half, the rotary's stationary dims, holds the previous position's, across
    documents (the 2025-12-14 record's partial key offset, out of place; on these dims from 2026-01-19). The first
    position keeps its own, or takes before (B, 1, H, D), generation's previous raw key; so does each position where
    restarts (T,) is true."""
    previous = torch.cat([k[:, :1] if before is None else before, k[:, :-1]], dim=1)
    if restarts is not None:
        previous = torch.where(restarts[None, :, None, None], k, previous)
    half = k.size(-1) // 2
    return torch.cat([k[..., :half], previous[..., half:]], dim=-1)


BIGRAM_MULTIPLIERS = (36313, 27191)  # the 2026-01-19 record's hash: these times the token and the one before it
BIGRAM_ROWS_PER_TOKEN = 7.5  # its table: 15 x 50304 // 2 rows in the records from 2026-05-20 (5 per token before)
BIGRAM_SIGN_ROWS = 8192  # rows of the fixed random +-1 table each bigram's row is multiplied by (2026-05-20's sign trick)


def bigram_ids(tokens: Tensor, rows: int, restarts: Tensor | None = None) -> Tensor:
    """Each position's row of the bigram hash embedding, as the 2026-01-19 record hashes a sequence: the last row at its
    first position, elsewhere (36313 t XOR 27191 p) mod (rows - 1) in int32 (the products wrap), p the token before;
    its in-place hash leaves the second position's p the last row's index. Across documents; restarts (T,)
    (evaluation's): each such position as a sequence's first."""
    last = rows - 1
    x = tokens.to(torch.int32)
    first = sequence_firsts(x, restarts)
    second = torch.cat([first.new_zeros(1), first[:-1]])
    previous = torch.where(second, last, torch.cat([x[:1], x[:-1]]))
    hashed = torch.bitwise_xor(BIGRAM_MULTIPLIERS[0] * x, BIGRAM_MULTIPLIERS[1] * previous) % last
    return torch.where(first, last, hashed)


def bigram_sign_ids(tokens: Tensor, restarts: Tensor | None = None) -> Tensor:
    """Each position's row of the sign table (the 2026-05-20 record's): (p XOR t) mod BIGRAM_SIGN_ROWS, p the token
    before, row 0 at a sequence's first position (restarts as bigram_ids)."""
    x = tokens.long()
    ids = torch.bitwise_xor(torch.cat([x[:1], x[:-1]]), x) % BIGRAM_SIGN_ROWS
    return torch.where(sequence_firsts(x, restarts), 0, ids)


def sequence_firsts(tokens: Tensor, restarts: Tensor | None) -> Tensor:
    """(T,) bool: position 0, and each position where restarts is true."""
    first = torch.arange(tokens.numel(), device=tokens.device) == 0  # not first[0] = True: that makes a host tensor a step
    return first if restarts is None else first | restarts


@dataclass
class LayerGates:
    """What the gate networks give one layer's attention, per token (None: not on this layer): XSA's strength
    (1, T, H), the output gate (1, T, H) and the composition's two head weightings (1, T, H) each."""
    xsa: Tensor | None = None
    output: Tensor | None = None
    composition: tuple[Tensor, Tensor] | None = None


class CausalSelfAttention(nn.Module):
    """Multi-head attention, its weights in matrix_dtype (the records' bf16 from 2026-01-04), zero until GPT draws them
    (draw_matrices): q's and k's rows a head pair to a Muon matrix (qk_w), v and the output projection a matrix each
    (vo_w). paired: the heads attend in pairs over a sequence twice as long (the records from 2026-01-07): for each
    token, the first half of its heads' q, k, v rows at position 2t and the second half at 2t + 1, so that head h
    shares keys with head h + H/2; each pair (h, h + 1) turns as one vector at 2t and 2t + 1. ve_gate: this layer's
    value embedding joins v through a gate of its own (all but the last layer's, whose dense connections gate it)."""

    def __init__(self, model_dim: int, num_heads: int, head_dim: int, ve_gate: bool, key_offset: bool, paired: bool,
                 matrix_dtype: torch.dtype = torch.float32):
        super().__init__()
        self.num_heads, self.head_dim, self.key_offset, self.paired = num_heads, head_dim, key_offset, paired
        if num_heads * head_dim != model_dim:
            raise ValueError(f"num_heads x head_dim must equal model_dim, got {num_heads} x {head_dim} != {model_dim}")
        # Muon orthogonalizes q and k a head pair at a time (the records from 2026-04-08), a head at a time if the heads
        # cannot pair: (2 H / g, g head_dim, D), q's blocks first; v and the output projection whole: (2, D, D).
        group = 2 if num_heads % 2 == 0 else 1
        self.qk_w = nn.Parameter(torch.zeros(2 * num_heads // group, group * head_dim, model_dim, dtype=matrix_dtype))
        self.vo_w = nn.Parameter(torch.zeros(2, model_dim, model_dim, dtype=matrix_dtype))
        # Per head, 2 sigmoid(w . (x[:6], ve[:6])) (records from 2026-02-03; on every such layer from 2026-05-27).
        self.ve_gate = CastedLinear(min(GATE_INPUTS, model_dim), num_heads) if ve_gate else None

    def value_input(self, x: Tensor, ve: Tensor) -> Tensor:
        """The gated value embedding v takes, (1, T, D), from the attention's input x (normed) and its table's rows ve."""
        half = self.ve_gate.in_features // 2
        gate = 2 * torch.sigmoid(self.ve_gate(torch.cat([x[..., :half], ve[None, ..., :half]], dim=-1)))
        return (gate.view(*x.shape[:2], self.num_heads, 1) * ve.view(*x.shape[:2], self.num_heads, -1)).flatten(2)

    def forward(self, x: Tensor, extra_v: Tensor | None, lambdas: Tensor, mask, rotary: Rotary, scale: float,
                gates: LayerGates, starts: Tensor | None = None, cache=None, positions: int | Tensor = 0,
                restarts: Tensor | None = None) -> Tensor:
        """x: the normed input; extra_v (1, T, D): what joins v (value embeddings, dense connections); lambdas: (on q,
        k and v's weights, on the output projection's); starts: each query's document start (the composition's);
        cache: generation's hook (tools/sample.py), holding this layer's earlier keys and values; positions: x's for
        the rotary (Rotary.forward); restarts: evaluation's (GPT.trunk)."""
        B, T, H, D = x.size(0), x.size(1), self.num_heads, self.head_dim
        qkv = F.linear(x, lambdas[0] * torch.cat([self.qk_w.flatten(end_dim=1), self.vo_w[0]]).type_as(x))
        q, k, v = qkv.view(B, T, 3 * H, D).chunk(3, dim=-2)
        q, k = norm(q), norm(k)
        if self.paired:
            q = rotary(q.view(B, T, H // 2, 2 * D), positions, paired=True).view(B, 2 * T, H // 2, D)
            k = rotary(k.view(B, T, H // 2, 2 * D), positions, paired=True).view(B, 2 * T, H // 2, D)
            v = v.reshape(B, 2 * T, H // 2, D)
        else:
            q, k = rotary(q, positions), rotary(k, positions)
        if self.key_offset:
            before = cache.last_key if cache is not None and cache.length else None
            if cache is not None:
                cache.last_key = k[:, -1:]
            k = offset_keys(k, before, restarts)
        if extra_v is not None:
            v = v + extra_v.view_as(v)
        own_v = v  # XSA's: this step's values, without a cache's earlier ones
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if cache is not None:
            k, v = cache.append(k, v)
        y = attend(q, k, v, mask, scale)
        if gates.composition is not None:
            y = composed_attention_correction(y, q, k, v, *composition_weights(*gates.composition, x.dtype), starts, scale)
        y = y.transpose(1, 2).reshape(B, T, H, D)
        if gates.xsa is not None:
            y = y - self_value_share(y, own_v, gates.xsa)
        if gates.output is not None:
            y = y * gates.output.type_as(y).view(B, T, H, 1)
        return F.linear(y.reshape(B, T, -1), lambdas[1] * self.vo_w[1].type_as(y))


def self_value_share(y: Tensor, v: Tensor, strength: Tensor) -> Tensor:
    """Gated XSA (arXiv 2603.09078, the records from 2026-04-29): tanh(strength) times each head's output y along its
    own value v, (y . v / |v|^2) v; y, v (B, T, H, D), strength (B, T, H)."""
    along = (y * v).sum(-1, keepdim=True) / v.square().sum(-1, keepdim=True).clamp_min(XSA_FLOOR)
    return torch.tanh(strength).type_as(y).view(*y.shape[:3], 1) * along * v


def relu_squared_mlp(x: Tensor, w_up: Tensor, w_down: Tensor) -> tuple[Tensor, Tensor]:
    """(relu(x @ w_up.T)^2 @ w_down, post = relu(x @ w_up.T)^2) in x's dtype."""
    post = F.relu(F.linear(x, w_up)).square()
    return F.linear(post, w_down.T), post


def relu_squared_backward(grad_post: Tensor, post: Tensor) -> Tensor:
    """The gradient of pre from post's, post = relu(pre)^2: 2 grad relu(pre), relu(pre) recovered as sqrt(post), in
    float32, rounded once to grad_post's dtype (the records' kernel from 2026-06-11)."""
    return (2 * grad_post.float() * post.float().sqrt()).to(grad_post.dtype)


class ReluSquaredMLP(torch.autograd.Function):
    """relu_squared_mlp in bf16, or with the down-projection's FP8 scales (act_scale, down_scale) through e4m3 copies
    (fp8_mlp_forward); the backward in bf16 from x, the weights and post = relu(pre)^2, as the records' from 2026-06-11
    (theirs saves neither pre nor an FP8 copy). Returns the output and post (no gradient)."""

    @staticmethod
    def forward(ctx, x: Tensor, w_up: Tensor, w_down: Tensor, act_scale: Tensor | None, down_scale: Tensor | None):
        if act_scale is None:
            out, post = relu_squared_mlp(x, w_up, w_down)
        else:
            post, out = fp8_mlp_forward(x.flatten(0, -2), w_up, w_down, act_scale, down_scale)
            post, out = post.view(*x.shape[:-1], -1), out.view(x.shape)
        ctx.save_for_backward(x, w_up, w_down, post)
        ctx.mark_non_differentiable(post)
        return out, post

    @staticmethod
    def backward(ctx, grad_out: Tensor, _):
        x, w_up, w_down, post = ctx.saved_tensors
        g, post = grad_out.flatten(0, -2), post.flatten(0, -2)
        grad_pre = relu_squared_backward(g @ w_down.T, post)
        # The weights' gradients as products with a batch of one, as the records' (their stream is (1, T, D)): CPU
        # kernels sum a long batched product otherwise than a plain one.
        grad_up, grad_down = ((a.T @ b[None])[0] for a, b in ((grad_pre, x.flatten(0, -2)), (post, g)))
        return (grad_pre @ w_up).view(x.shape), grad_up, grad_down, None, None


class MLP(nn.Module):
    """Both matrices stored (4 model_dim, model_dim) in matrix_dtype, one row per hidden unit, the down-projection
    applied transposed (the records from 2025-12-11: their draws, and NorMuon's rows); zero until GPT draws the
    up-projection (draw_matrices). With fp8, training runs it in bf16 through FP8 copies (ReluSquaredMLP); its
    down-projection's scales are state, in checkpoints: act_scale, made by each such forward for the next, and down_scale
    (next_down_scale after the next step), made by refresh_down_scales after each step. In bf16 its backward is the
    records' from post (ReluSquaredMLP) with or without FP8."""

    def __init__(self, model_dim: int, matrix_dtype: torch.dtype = torch.float32, fp8: bool = False):
        super().__init__()
        self.fp8 = fp8
        self.c_fc = nn.Parameter(torch.zeros(4 * model_dim, model_dim, dtype=matrix_dtype))
        self.c_proj = nn.Parameter(torch.zeros(4 * model_dim, model_dim, dtype=matrix_dtype))
        for name in ("act_scale", "down_scale", "next_down_scale"):
            self.register_buffer(name, torch.ones(()))
        refresh_down_scales([self.c_proj], [self.down_scale], [self.next_down_scale], bootstrap=True)

    def forward(self, x: Tensor) -> Tensor:
        if self.fp8 and self.training:
            out, post = ReluSquaredMLP.apply(x.bfloat16(), self.c_fc.bfloat16(), self.c_proj.bfloat16(), self.act_scale,
                                             self.down_scale)
            with torch.no_grad():
                self.act_scale.copy_(headroom_scale(post.amax(), ACT_SCALE_HEADROOM))
            return out.type_as(x)
        w_up, w_down = self.c_fc.type_as(x), self.c_proj.type_as(x)
        if x.dtype == torch.bfloat16:
            return ReluSquaredMLP.apply(x, w_up, w_down, None, None)[0]
        return relu_squared_mlp(x, w_up, w_down)[0]  # in float32, autograd's is the records' gradient: sqrt(r^2) is r


class Block(nn.Module):
    """A layer's attention (None in the attention-free layer) and MLP; GPT.trunk wires them to the stream."""

    def __init__(self, model_dim: int, num_heads: int, head_dim: int, has_attention: bool, ve_gate: bool,
                 key_offset: bool, paired: bool, matrix_dtype: torch.dtype = torch.float32, fp8: bool = False):
        super().__init__()
        self.attn = (CausalSelfAttention(model_dim, num_heads, head_dim, ve_gate, key_offset, paired, matrix_dtype)
                     if has_attention else None)
        self.mlp = MLP(model_dim, matrix_dtype, fp8)


def u_layers(num_layers: int) -> tuple[int, int]:
    """The U-net an architecture of num_layers is cut from: (its even depth, how many of its first layers are gone).
    An odd depth is the U one layer deeper without its layer 0 (the records from 2025-12-14: their 11 layers)."""
    return num_layers + num_layers % 2, num_layers % 2


def value_embedding_layout(num_layers: int) -> list[int | None]:
    """Each layer's value-embedding table, a table a layer, as the records from 2026-02-03 place them: on min(2, L // 4)
    layers from layer 1 and on the last min(3, (L + 1) // 4) (11 layers: None, 0, 1, None x 5, 2, 3, 4; 4 layers:
    None, 0, None, 1)."""
    first, last = min(2, num_layers // 4), min(3, (num_layers + 1) // 4)
    placed = [None] * num_layers
    for t, layer in enumerate([*range(1, 1 + first), *range(num_layers - last, num_layers)]):
        placed[layer] = t
    return placed


def attention_free_layer(num_layers: int) -> int:
    """The layer without attention: the U's second decoder layer (7 of 12, 6 of 11, as in the records), or the
    nearest earlier one without a value embedding, whose only use is attention."""
    depth, cut = u_layers(num_layers)
    table_of_layer = value_embedding_layout(num_layers)
    return max(i for i in range(min(depth // 2 + 2, depth) - cut) if table_of_layer[i] is None)


def skip_partner(num_layers: int, layer: int) -> int:
    """The encoder layer whose output a decoder layer's U-net skip adds: its mirror in the U."""
    depth, cut = u_layers(num_layers)
    return depth - 1 - (layer + cut) - cut


def skip_source(num_layers: int) -> int:
    """The layer whose output the attention-free layer adds (the records' one skip, 3 into 6 at 11 layers)."""
    return skip_partner(num_layers, attention_free_layer(num_layers))


def long_window_layers(num_layers: int) -> list[bool]:
    """Every fourth encoder layer of the U from its first uses the long window, mirrored in the decoder (12 layers: long
    at 0, 4, 7, 11; 11 layers: 3 and 10, with 6 attention-free; the rest short)."""
    depth, cut = u_layers(num_layers)
    return [min(i, depth - 1 - i) % 4 == 0 for i in range(cut, depth)]


# Validation's loss this many positions at a time: its float32 logits take 1.6 GB whatever val_seq_len
# is, where the record's 262,144 positions would need 53 GB at once.
EVAL_LOSS_CHUNK = 8192


def chunked_eval_loss(xn: Tensor, w: Tensor, targets: Tensor, cap: float, offset: float) -> Tensor:
    """Validation's summed cross-entropy of the softcapped logits xn @ w^T, EVAL_LOSS_CHUNK rows at a time, never
    holding (T, vocab) float32 logits: the softcap in xn's dtype (the run's), rounded after each operation as the
    records from 2025-09-27 compute it, the cross-entropy in float32."""
    total = torch.zeros((), dtype=torch.float32, device=xn.device)
    for start in range(0, xn.size(0), EVAL_LOSS_CHUNK):
        rows, t = xn[start:start + EVAL_LOSS_CHUNK], targets[start:start + EVAL_LOSS_CHUNK]
        s = softcap(rows @ w.T, True, cap, offset).float().div_(cap)
        # Logits in (0, cap): exp cannot overflow, so no max pass. s / cap, then exp2: the validation losses
        # logged so far were computed so (the training loss's chunked form); the same ops keep their bits.
        sum_exp = torch.exp2(s * (cap * LOG2E)).sum(dim=-1)
        total = total + (sum_exp.log() - cap * s.gather(1, t[:, None]).squeeze(1)).sum()
    return total


def targets_ahead(targets: Tensor, n: int) -> tuple[Tensor, Tensor]:
    """(T, n): row t holds the targets t..t+n-1, and whether each lies within the sequence (multi-token prediction
    counts no term past its end; none is masked at a document's)."""
    T = targets.numel()
    ahead = F.pad(targets, (0, n - 1)).unfold(0, n, 1)
    return ahead, torch.arange(T, device=targets.device)[:, None] + torch.arange(n, device=targets.device) < T


def prefix_table(ranks: dict[bytes, int], size: int) -> Tensor:
    """(size,) int64: for each token id below size, the token whose bytes are the longest proper prefix of its bytes
    among the tokens below size (ranks: bytes -> id, tiktoken's); -1 where none, and for ids no bytes have (EOT, the
    padding). The prefix token's loss term (the record's from 2026-07-13) aims at it."""
    table = [-1] * size
    for token, i in ranks.items():
        if i < size:
            shorter = (ranks.get(token[:n], size) for n in range(len(token) - 1, 0, -1))
            table[i] = next((j for j in shorter if j < size), -1)
    return torch.tensor(table, dtype=torch.int64)


INV_SPREAD = float32(np.float32(1) / np.float32(LOGIT_SOFTCAP_SPREAD))  # the kernel's 1 / 7.5 in float32 (correctly
# rounded; the kernel's fast-math division on the GPU may differ by an ulp)
E5M2_MAX = torch.finfo(torch.float8_e5m2).max  # the kernel's conversion to e5m2 saturates here (torch's would give inf)


def kernel_sigmoid(logits: Tensor, offset: float) -> Tensor:
    """s = sigmoid(z / 7.5 + offset / 7.5) in float32 as the fused kernel makes it (the records from 2026-04-04): 0.5 +
    tanh(u / 2) / 2, both divisions by 7.5 products with its float32 reciprocal."""
    u = logits.float() * INV_SPREAD + float32(np.float32(offset) * np.float32(INV_SPREAD))
    return 0.5 + torch.tanh(u * 0.5) * 0.5


def loss_terms(targets: Tensor, weights: Tensor, prefix_targets: Tensor | None,
               prefix_weight: Tensor | None) -> list[tuple[Tensor, Tensor, Tensor]]:
    """Each position's cross-entropy terms in the kernel's order, as (column (T, 1), valid (T,), weight): the next
    len(weights) targets (multi-token prediction), then the prefix token of the next target where it has one."""
    ahead, valid = targets_ahead(targets, weights.numel())
    terms = [(ahead[:, k:k + 1], valid[:, k], weights[k]) for k in range(weights.numel())]
    if prefix_targets is not None:
        terms.append((prefix_targets.clamp_min(0)[:, None], prefix_targets >= 0, prefix_weight.reshape(())))
    return terms


class SoftcappedLoss(torch.autograd.Function):
    """Training's lm_head and loss as the records from 2026-04-04 compute them (their fused CUDA kernel's math, in
    PyTorch): the logits x @ w^T (FP8, fp8_mm, given fp8_scales (x_s, w_s, grad_s)); s = kernel_sigmoid, kept in the
    logits' dtype (bf16 in the records); the log-sum-exp of cap s about the largest cap s before that rounding; each
    position's weighted cross-entropies (loss_terms: the next targets, then, given prefix_targets (T,), the prefix
    token at prefix_weight, from 2026-07-13) summed in order. The logits' gradient is made in float32 from the saved s
    and log-sum-exps in the kernel's order of operations, its softmax part weighted by every weight (a multi-token
    target past the end's too), divided by grad_s and rounded once: to e5m2 with FP8, else to the logits' dtype."""

    @staticmethod
    def forward(ctx, x: Tensor, w: Tensor, targets: Tensor, weights: Tensor, cap: float, offset: float,
                fp8_scales: tuple[float, float, float] | None = None, prefix_targets: Tensor | None = None,
                prefix_weight: Tensor | None = None) -> Tensor:
        if fp8_scales is None:
            w = w.type_as(x)
            logits = F.linear(x, w)
        else:
            logits, x, w = fp8_mm(x, w, *fp8_scales[:2])  # the matmul's operands as the backward takes them: in e4m3
        s = kernel_sigmoid(logits, offset)
        row_max = (cap * s).amax(dim=-1)
        kept = rounded_to(s, logits.dtype)  # the kernel stores s in the logits' dtype
        s, z = kept.to(logits.dtype), cap * kept
        lse = row_max + torch.log(torch.exp(z - row_max[:, None]).sum(dim=-1))
        terms = loss_terms(targets, weights, prefix_targets, prefix_weight)
        losses = torch.zeros_like(lse)
        for column, valid, weight in terms:
            losses = losses + torch.where(valid, weight * (lse - z.gather(1, column)[:, 0]), 0)
        # The softmax's weight: the prefix term's where it has one, then every multi-token weight, as the kernel adds.
        weight_sum = (torch.zeros_like(lse) if prefix_targets is None else
                      torch.where(prefix_targets >= 0, prefix_weight.reshape(()), 0))
        for k in range(weights.numel()):
            weight_sum = weight_sum + weights[k]
        ctx.save_for_backward(s, lse, weight_sum, targets, weights, prefix_targets, prefix_weight, x, w)
        ctx.cap, ctx.fp8_scales = cap, fp8_scales
        return losses

    @staticmethod
    def backward(ctx, grad: Tensor):
        s, lse, weight_sum, targets, weights, prefix_targets, prefix_weight, x, w = ctx.saved_tensors
        fp8 = ctx.fp8_scales is not None
        grad_s = ctx.fp8_scales[2] if fp8 else 1.0
        # The kernel's factors of each row, in float32: the loss's gradient times cap / 7.5, then 1 / grad_s.
        inv_grad_s, cap_spread = float32(np.float32(1) / np.float32(grad_s)), float32(np.float32(INV_SPREAD) * np.float32(ctx.cap))
        row_scale = (grad * cap_spread * inv_grad_s)[:, None]
        sf = rounded_to(s.float(), s.dtype)  # rounded even if the compiler recomputes s
        scaled_softmax = weight_sum[:, None] * torch.exp(ctx.cap * sf - lse[:, None])
        grad_logits = row_scale * scaled_softmax * sf * (1 - sf)
        # At each term's column, the weights of every term aiming there taken away, summed in the terms' order.
        terms = loss_terms(targets, weights, prefix_targets, prefix_weight)
        for column, valid, _ in terms:
            aimed = torch.zeros_like(lse)
            for other, other_valid, weight in terms:
                aimed = aimed + torch.where(other_valid & (other[:, 0] == column[:, 0]), weight, 0)
            s_at = sf.gather(1, column)
            at = row_scale * (scaled_softmax.gather(1, column) - aimed[:, None]) * s_at * (1 - s_at)
            grad_logits.scatter_(1, column, torch.where(valid[:, None], at, grad_logits.gather(1, column)))
        if fp8:
            grad_x, grad_w = fp8_mm_backward(grad_logits.clamp(-E5M2_MAX, E5M2_MAX).to(torch.float8_e5m2), x, w,
                                             *ctx.fp8_scales)
        else:
            grad_logits = grad_logits.to(s.dtype)
            grad_x, grad_w = grad_logits.mm(w), grad_logits.t().mm(x)
        return grad_x, grad_w, None, None, None, None, None, None, None


RESIDUAL_LAMBDA_INIT = 1.1**0.5  # each sub-layer scales the stream by this before adding its output, 1.1 a layer (from 2026-02-12)
HEAD_INIT_STD = 0.005  # the lm_head starts normal with this std (records from 2025-12-19)
VE_INIT_STD = 0.01  # the value embeddings start normal with this std (records from 2026-02-03; zero before)
COEFFICIENT_NET_WIDTH = 64  # hidden width of the dense connections' and the gates' coefficient networks (2026-04-22, 05-27)
MUDD_SCALE = 0.1  # the dense connections' coefficients: their network's output times this (2026-04-22)
GATE_NETS_SCALE_INIT = 0.1  # the gate networks' output times a learned scale starting here (2026-05-27)
# Effective initial coefficients (the networks start at their biases): the output gates', the bigram's share, the skip's
# gate, the composition's first weighting, the last layer's value-embedding gate, the backout's share after the loop.
OUTPUT_GATE_INIT, BIGRAM_INIT, SKIP_GATE_INIT, COMPOSITION_W1_INIT = 0.25, 0.05, 0.5, 1.0
MUDD_VE_GATE_INIT, BACKOUT_INIT = 2.0, -0.5


def draw_matrices(blocks: nn.ModuleList, model_dim: int):
    """The records' draws from 2026-04-08: every layer's q and k, then every layer's v and output projection, then every
    up-projection and one more (the record's padding MLP, discarded), all uniform with one bound, each in float32 and
    rounded once to its parameter's dtype."""
    layers = [block.attn for block in blocks if block.attn is not None]
    attention = [attn.qk_w for attn in layers] + [attn.vo_w for attn in layers]
    up = [block.mlp.c_fc for block in blocks]
    with torch.no_grad():
        for w in [*attention, *up]:
            w.copy_(torch.empty(w.shape).uniform_(-init_bound(model_dim), init_bound(model_dim)))
        torch.empty(up[0].shape).uniform_()


class CoefficientNets(nn.Module):
    """Two small networks that make per-token coefficients from a stream state x: (gelu(x w1^T) w2^T + b2) times scale
    (the 2026-04-22 record's dense connections, the 2026-05-27 record's gate networks); biases start at init / scale,
    so each coefficient starts at its init. w1 drawn as nn.Linear's (kaiming uniform), w2 zero; scale fixed, or
    learned (a 0-d float32 parameter) if learned_scale."""

    def __init__(self, model_dim: int, inits: tuple[list[float], list[float]], scale: float, learned_scale: bool):
        super().__init__()
        width = max(map(len, inits))
        self.num_coefficients = tuple(map(len, inits))
        self.w1 = nn.Parameter(torch.empty(2, COEFFICIENT_NET_WIDTH, model_dim))
        for j in range(2):
            nn.init.kaiming_uniform_(self.w1.data[j], a=math.sqrt(5))
        self.w2 = nn.Parameter(torch.zeros(2, width, COEFFICIENT_NET_WIDTH))
        # init / scale in double precision, then float32 (the record's Python floats)
        self.b2 = nn.Parameter(torch.tensor([[v / scale for v in init] + [0.0] * (width - len(init)) for init in inits]))
        self.scale = nn.Parameter(torch.tensor(scale)) if learned_scale else scale

    def forward(self, x: Tensor, net: int) -> Tensor:
        n = self.num_coefficients[net]
        hidden = F.gelu(F.linear(x, self.w1[net]))
        scale = self.scale.type_as(x) if isinstance(self.scale, Tensor) else self.scale
        return (F.linear(hidden, self.w2[net, :n]) + self.b2[net, :n]) * scale


def gate_layouts(num_layers: int, num_heads: int, xsa_layers: tuple) -> tuple[dict, dict]:
    """Which coefficients the two gate networks make ({name: slice}), in the 2026-05-27 record's order. The first, from
    x0, serves the layers up to the skip's source: XSA strengths, the source's output gate, each layer's x0 and bigram
    shares. The second, from the source's output, the layers after it: XSA, the last layer's output gate, the x0 and
    bigram shares up to the last layer, the skip's gate, the last layer's composition weights."""
    source, no_attention = skip_source(num_layers), attention_free_layer(num_layers)
    first, second = range(source + 1), [i for i in range(source + 1, num_layers - 1) if i != no_attention]
    layouts = []
    for layers, gated, tail in ((first, source, ()), (second, num_layers - 1,
                                                       (("skip", 1), ("w1", num_heads), ("w2", num_heads)))):
        sizes = [(("xsa", i), num_heads) for i in layers if i in xsa_layers] + [(("output", gated), num_heads)]
        sizes += [((kind, i), 1) for i in layers for kind in ("x0", "bigram")] + list(tail)
        ends = list(itertools.accumulate(size for _, size in sizes))
        layouts.append({name: slice(end - size, end) for (name, size), end in zip(sizes, ends)})
    return layouts[0], layouts[1]


def gate_inits(layout: dict) -> list[float]:
    """Each coefficient's initial value in a gate layout."""
    inits = dict(output=OUTPUT_GATE_INIT, bigram=BIGRAM_INIT, skip=SKIP_GATE_INIT, w1=COMPOSITION_W1_INIT)
    values = [0.0] * max(s.stop for s in layout.values())
    for name, lanes in layout.items():
        values[lanes] = [inits.get(name if isinstance(name, str) else name[0], 0.0)] * (lanes.stop - lanes.start)
    return values


# The dense connections at the last layer (2026-04-22 and HEAD): v's sources (x at layer 0, after the backout layer, the
# last layer's input), the stream's recombination of them, the value embedding's 2-lane gate, the layer's own stream
# factors (resid, post after attention; x0's, bigram's shares; resid, post after the MLP); after the loop, 5 more.
MUDD_LAST_LAYER = ("v0", "v_backout", "v_x", "x0_state", "backout_state", "x_self", "ve0", "ve1", "resid_attn",
                   "post_attn", "x0", "bigram", "resid_mlp", "post_mlp")
MUDD_LAST_LAYER_INITS = dict(ve0=MUDD_VE_GATE_INIT, ve1=MUDD_VE_GATE_INIT, resid_attn=RESIDUAL_LAMBDA_INIT,
                             post_attn=1.0, bigram=BIGRAM_INIT, resid_mlp=RESIDUAL_LAMBDA_INIT, post_mlp=1.0)
MUDD_AFTER_LOOP = ("state0", "backout", "last_input", "value_embed", "skip_source")


@dataclass(frozen=True)
class GPTConfig:
    """What a GPT is built from; gpt_config() makes it from the hyperparameters and the device plan, in one place."""
    vocab_size: int  # tokens; the embeddings and the lm_head are padded to a multiple of 128
    num_layers: int  # an odd depth is the U one layer deeper without its layer 0 (u_layers)
    num_heads: int  # attention heads
    head_dim: int  # dims per head; num_heads x head_dim = model_dim
    model_dim: int  # residual stream width
    max_seq_len: int  # positions of the rotary tables (twice as many: the paired-head layers' sequence)
    windows: tuple = (3, 7, 11, 13)  # every long window of a run in order, in window units: each its softmax scale
    window_unit: int = BLOCK_SIZE  # tokens per window unit
    attention_scale: float = 0.1  # the softmax scale at the first window
    attention_scale_growth: float = 0.2  # each new window multiplies the scale by 1 + this x ln(new / previous)
    backout_layer: int = 7  # the layers after it attend over the stream it leaves (records from 2026-03-06), a source of the last layer's dense connections (from 2026-04-22)
    paired_layers: tuple = ()  # layers whose heads attend in pairs over a sequence twice as long
    xsa_layers: tuple = ()  # layers whose heads take out a gated share of their output along their own value (XSA)
    logit_cap: float = LOGIT_SOFTCAP  # logits = cap sigmoid((z + offset) / 7.5)
    logit_offset: float = LOGIT_OFFSET
    dtype: torch.dtype = torch.float32  # every parameter but the scalars, and the rotary tables
    attention_backend: str = "sdpa"  # flex: FlexAttention block masks; sdpa: the same masks, dense
    fp8: bool = False  # the lm_head's and the MLPs' training matmuls in FP8
    loss_scale: float = LOSS_SCALE  # training's factor on each micro-batch's loss (loss_scale()), in FP8's grad scale too


def check_structure(c: GPTConfig):
    """A ValueError unless the config's layers fit the record's structure (GPT's docstring)."""
    L = c.num_layers
    if L < 4 or c.num_heads % 2:
        raise ValueError(f"num_layers must be >= 4 and num_heads even (the last layer's 2-lane value-embedding gate), "
                         f"got {L} and {c.num_heads}")
    if not skip_source(L) < c.backout_layer < L - 1:
        raise ValueError(f"backout_layer must lie between the skip's source {skip_source(L)} and the last layer "
                         f"{L - 1}, got {c.backout_layer}")
    long, no_attention = long_window_layers(L), attention_free_layer(L)
    if any(i == no_attention or long[i] for i in c.paired_layers):
        raise ValueError(f"paired_layers={','.join(map(str, c.paired_layers))}: layers with attention and without the "
                         f"key offset (not the long-window layers {[i for i, b in enumerate(long) if b]})")
    if any(i in c.paired_layers or i in (no_attention, L - 1) or not 0 <= i < L for i in c.xsa_layers):
        raise ValueError(f"xsa_layers={','.join(map(str, c.xsa_layers))}: layers with attention, heads alone, not "
                         f"the last")


class GPT(nn.Module):
    """The U-net GPT of the records (an odd depth: the U one layer deeper without its layer 0) as HEAD computes it:
    one attention-free layer, which adds the skip's source's output (skip_source) through a gate; the layers past the
    backout layer attend over the stream that layer left; per-token gate networks (CoefficientNets) make the XSA
    strengths, output gates, skip gate, x0's and the bigram embedding's shares, and the composition's weights; dense
    connections (MUDD) make the last layer's stream factors and v from earlier states, and recombine the stream after
    the loop. Modules registered in forward order: reversed(parameters()) is about the order in which gradients
    become ready, which the buckets follow. The input embedding starts as a copy of the lm_head, and the training keeps
    it one until the untie (Trainer.tie_embedding)."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        c = config
        check_structure(c)
        L, D, H = c.num_layers, c.model_dim, c.num_heads
        self.vocab_size, self.num_layers, self.max_seq_len = c.vocab_size, L, c.max_seq_len
        self.attention_backend, self.backout_layer = c.attention_backend, c.backout_layer
        self.ve_layout = value_embedding_layout(L)
        self.long_window = long_window_layers(L)
        self.paired = [i in c.paired_layers for i in range(L)]
        self.xsa_layers, self.skip_source = c.xsa_layers, skip_source(L)
        no_attention = attention_free_layer(L)
        padded_vocab = next_multiple(c.vocab_size, 128)  # embeddings and lm_head; the extra rows never see a token
        # Built in HEAD's order of random draws, registered below in forward order; modules that start at zero after a
        # draw the record discards (its nn.Linear's and nn.Embedding's) draw it here too.
        self.logit_cap, self.logit_offset = c.logit_cap, c.logit_offset
        x_s, w_s, grad_s = LM_HEAD_FP8_SCALES
        self.fp8_scales = (x_s, w_s, c.loss_scale * grad_s) if c.fp8 else None  # the lm_head's in training
        lm_head = CastedLinear(D, padded_vocab)
        with torch.no_grad():  # drawn as the record stores it from 2026-01-18, (model_dim, vocab), in its dtype
            lm_head.weight.copy_(torch.empty(D, padded_vocab, dtype=c.dtype).normal_(0, HEAD_INIT_STD).T)
        embed = nn.Embedding(padded_vocab, D)
        with torch.no_grad():  # the record's copy of the lm_head, after the draw it discards
            embed.weight.copy_(lm_head.weight)
        # The value-embedding tables, one parameter (tables x padded_vocab, D), drawn in the run's dtype.
        self.ve_tables = sum(t is not None for t in self.ve_layout)
        value_embeds = nn.Parameter(VE_INIT_STD * torch.randn(self.ve_tables * padded_vocab, D, dtype=c.dtype))
        blocks = nn.ModuleList(Block(D, H, c.head_dim, i != no_attention, self.ve_layout[i] is not None and i < L - 1,
                                     self.long_window[i], self.paired[i], c.dtype, c.fp8)
                               for i in range(L))
        draw_matrices(blocks, D)
        smear_gate = CastedLinear(GATE_INPUTS, 1)
        torch.empty(smear_gate.weight.shape).uniform_()
        # A token's bigram (hashed with the one before) looks up a row (records from 2026-01-19), times a fixed random
        # sign row (from 2026-05-20); the table drawn, then zeroed, as the record's.
        bigram_embed = nn.Embedding(int(BIGRAM_ROWS_PER_TOKEN * padded_vocab), D)
        with torch.no_grad():
            bigram_embed.weight.zero_()
        self.register_buffer("bigram_signs", torch.randn(BIGRAM_SIGN_ROWS, D).sign().to(c.dtype))
        mudd_inits = [MUDD_LAST_LAYER_INITS.get(name, 0.0) for name in MUDD_LAST_LAYER]
        after_loop_inits = [BACKOUT_INIT if name == "backout" else 0.0 for name in MUDD_AFTER_LOOP]
        mudd = CoefficientNets(D, (mudd_inits, after_loop_inits), MUDD_SCALE, learned_scale=False)
        self.gate_layouts = gate_layouts(L, H, c.xsa_layers)
        gates = CoefficientNets(D, tuple(map(gate_inits, self.gate_layouts)), GATE_NETS_SCALE_INIT, learned_scale=True)
        self.embed, self.smear_gate, self.bigram_embed, self.value_embeds = embed, smear_gate, bigram_embed, value_embeds
        # Scalars, one Adam tensor: per layer attention's (q k v, output) lambdas, the smear's, the skip's.
        self.scalars = nn.Parameter(torch.cat([torch.tensor([0.5, 1.0]).repeat(L), torch.zeros(1),
                                               torch.full((1,), SKIP_LAMBDA_INIT)]))
        self.resid_lambdas = nn.Parameter(torch.full((L, 2), RESIDUAL_LAMBDA_INIT))
        self.post_lambdas = nn.Parameter(torch.ones(L, 2))
        self.gates, self.blocks, self.mudd = gates, blocks, mudd
        self.window_unit = c.window_unit
        self.rotary = Rotary(c.head_dim, c.max_seq_len, c.window_unit, c.dtype)
        self.attention_scales = attention_scales(c.windows, c.attention_scale, c.attention_scale_growth)
        self.lm_head = lm_head
        # Each token's prefix token (prefix_table()), which training's loss also predicts; -1 everywhere until a run
        # gives it one (Trainer): no prefix term. Not a weight: checkpoints leave it out.
        self.register_buffer("prefix_table", torch.full((padded_vocab,), -1, dtype=torch.int64), persistent=False)
        for module in self.modules():
            if isinstance(module, (nn.Embedding, CastedLinear)):
                module.to(c.dtype)
        for p in (mudd.w1, mudd.w2, mudd.b2, gates.w1, gates.w2, gates.b2):
            p.data = p.data.to(c.dtype)

    def forward(self, input_seq: Tensor, target_seq: Tensor, window: int, long_window: int | None = None,
                mtp_weights: Tensor | None = None, prefix_weight: Tensor | None = None) -> Tensor:
        """input_seq, target_seq: (T,) tokens; window: the long window in window units (long_window, if given, widens
        the long layers' alone). Training returns the summed loss (SoftcappedLoss; mtp_weights: each position's next
        targets' weights, the next one's alone if None; prefix_weight: the weight of the next target's prefix token
        (prefix_table), no such term if None), eval the mean (chunked_eval_loss)."""
        x = self.trunk(input_seq, window, long_window=long_window)
        if not self.training:
            return chunked_eval_loss(norm(x[0]), self.lm_head.weight.type_as(x), target_seq, self.logit_cap,
                                     self.logit_offset) / target_seq.numel()
        weights = torch.ones(1, device=x.device) if mtp_weights is None else mtp_weights
        prefix_targets = None if prefix_weight is None else self.prefix_table[target_seq]
        return SoftcappedLoss.apply(norm(x).view(-1, x.size(-1)), self.lm_head.weight, target_seq, weights,
                                    self.logit_cap, self.logit_offset, self.fp8_scales, prefix_targets,
                                    prefix_weight).sum()

    def trunk(self, tokens: Tensor, window: int, masks: tuple | None = None, cache=None,
              long_window: int | None = None, restarts: Tensor | None = None) -> Tensor:
        """The final residual stream (1, T, D) of tokens (T,) at a long window of window units, in HEAD's order of
        operations (which sets the order in which shared tensors' gradients sum). Generation's hooks (tools/sample.py):
        masks, attention_masks() rows for these positions; cache, a KV cache with a layer per block. restarts (T,)
        bool, evaluation's (tools/evaluate.py): where a sequence of its own starts, as if at position 0, the smear
        passing nothing into it (with an EOT there, attention already stops)."""
        L, source = self.num_layers, self.skip_source
        seen = tokens if cache is None or not len(cache) else torch.cat([cache.tokens, tokens])
        masks = masks or attention_masks(tokens, window, self.attention_backend, unit=self.window_unit,
                                         long_window=long_window, paired=any(self.paired))
        positions = 0 if cache is None else len(cache)
        if restarts is not None:
            if cache is not None:
                raise ValueError("restarts are for whole sequences: not with a cache")
            index = torch.arange(tokens.numel(), device=tokens.device)
            positions = index - torch.where(restarts, index, 0).cummax(0).values
        ve = self.value_embeds.view(self.ve_tables, -1, self.value_embeds.size(1))[:, tokens]
        ve = [None if t is None else ve[t] for t in self.ve_layout]  # each table's rows selected once
        bigram = self.bigram_embeddings(seen, restarts)[-tokens.numel():][None]
        x = self.smear(self.embed(tokens), self.embed(cache.tokens[-1:]) if cache is not None and len(cache) else None,
                       restarts)
        x = x0 = norm(x[None])
        gates = self.unpack_gates(0, x0)
        x = x0 + bigram * gates["bigram", 0]
        states = {0: x}  # the stream before layer 0, after the skip's source and the backout layer: later layers read them
        run = dict(masks=masks, scale=self.attention_scales[window], starts=document_starts(seen, restarts)[-tokens.numel():],
                   cache=cache, positions=positions, restarts=restarts)
        for i in range(L):
            if i == source + 1:
                gates |= self.unpack_gates(1, x)
            if self.blocks[i].attn is None:
                x = x + torch.sigmoid(self.scalars[2 * L + 1]) * gates["skip"] * states[source]
            elif i < L - 1:
                x = self.attention_layer(i, x, x0, bigram, ve[i], gates, states, run)
            else:
                x, mu = self.last_attention_layer(x, bigram, ve[i], gates, states, run)
            normed = norm(x)
            factors = (mu["resid_mlp"], mu["post_mlp"]) if i == L - 1 else self.stream_factors(i, x)[2:]
            x = factors[0] * x + factors[1] * self.blocks[i].mlp(normed)
            if i in (source, self.backout_layer):
                states[i] = x
        mu = dict(zip(MUDD_AFTER_LOOP, self.mudd(x, 1).split(1, dim=-1)))
        last_ve = ve[self.ve_layout.index(0)][None].to(x.dtype)
        return (x + mu["state0"] * states[0] + mu["backout"] * states[self.backout_layer]
                + mu["last_input"] * states["last_input"] + mu["value_embed"] * last_ve + mu["skip_source"] * states[source])

    def attention_layer(self, i: int, x: Tensor, x0: Tensor, bigram: Tensor, ve: Tensor | None, gates: dict,
                        states: dict, run: dict) -> Tensor:
        """Layer i's attention sub-layer below the last: x = r x + p attn + x0 g_x0 (+ bigram g_bigram past layer 0);
        past the backout layer it attends over the stream that layer left."""
        attn = self.blocks[i].attn
        attention_input = norm(states.get(self.backout_layer, x))
        extra_v = attn.value_input(attention_input, ve) if ve is not None else None
        y = self.attend_layer(i, attention_input, extra_v, LayerGates(gates.get(("xsa", i)), gates.get(("output", i))),
                              run)
        resid, post = self.stream_factors(i, x)[:2]
        x = resid * x + post * y + x0 * gates["x0", i]
        return x + bigram * gates["bigram", i] if i else x

    def last_attention_layer(self, x: Tensor, bigram: Tensor, ve: Tensor, gates: dict, states: dict,
                             run: dict) -> tuple[Tensor, dict]:
        """The last layer's attention sub-layer with its dense connections (MUDD): v takes a mix of the stream's
        states, the stream is recombined from them, and the layer's stream factors are per token; returns x and them."""
        L, H = self.num_layers, self.blocks[-1].attn.num_heads
        attention_input = norm(states.get(self.backout_layer, x))
        states["last_input"] = x
        mu = dict(zip(MUDD_LAST_LAYER, self.mudd(x, 0).split(1, dim=-1)))
        backout = states[self.backout_layer]
        mixed_v = (mu["v0"] * states[0] + mu["v_backout"] * backout + mu["v_x"] * x).view(*x.shape[:2], H, -1)
        x = (1 + mu["x_self"]) * x + mu["x0_state"] * states[0] + mu["backout_state"] * backout
        ve_gate = torch.cat([mu["ve0"], mu["ve1"]], dim=-1).repeat_interleave(H // 2, dim=-1).unsqueeze(-1)
        extra_v = (ve_gate * ve.view(*x.shape[:2], H, -1) + mixed_v).flatten(2)
        y = self.attend_layer(L - 1, attention_input, extra_v,
                              LayerGates(output=gates["output", L - 1], composition=(gates["w1"], gates["w2"])), run)
        x = mu["resid_attn"] * x + mu["post_attn"] * y + mu["x0"] * states[0]
        return x + mu["bigram"] * bigram, mu

    def attend_layer(self, i: int, attention_input: Tensor, extra_v: Tensor | None, gates: LayerGates, run: dict):
        return self.blocks[i].attn(attention_input, extra_v, self.scalars[2 * i:2 * i + 2],
                                   run["masks"][self.paired[i], self.long_window[i]], self.rotary, run["scale"], gates,
                                   run["starts"], None if run["cache"] is None else run["cache"].layers[i],
                                   run["positions"], run["restarts"])

    def stream_factors(self, i: int, x: Tensor) -> tuple[Tensor, ...]:
        """Layer i's (resid, post) after attention and after the MLP, in the stream's dtype (records from 2026-02-12)."""
        return (*self.resid_lambdas[i, :1].type_as(x), *self.post_lambdas[i, :1].type_as(x),
                *self.resid_lambdas[i, 1:].type_as(x), *self.post_lambdas[i, 1:].type_as(x))

    def unpack_gates(self, net: int, x: Tensor) -> dict:
        """Gate network net's coefficients from x, by name (gate_layouts)."""
        coefficients = self.gates(x, net)
        return {name: coefficients[..., lanes] for name, lanes in self.gate_layouts[net].items()}

    def bigram_embeddings(self, tokens: Tensor, restarts: Tensor | None = None) -> Tensor:
        """(T, D): each position's bigram row times its sign row (the records from 2026-05-20)."""
        rows = self.bigram_embed(bigram_ids(tokens, self.bigram_embed.num_embeddings, restarts))
        return rows * self.bigram_signs[bigram_sign_ids(tokens, restarts)].type_as(rows)  # +-1: exact in any dtype

    @torch.no_grad()
    def update_down_scales(self, bootstrap: bool):
        """After each optimizer step (Trainer.train_step): the MLPs' down-projection weight scales (refresh_down_scales),
        bootstrap for the first DOWN_BOOTSTRAP_STEPS steps' updates. Restoring a state restores them: they are buffers."""
        mlps = [block.mlp for block in self.blocks]
        refresh = compiled_on_first_use(refresh_down_scales) if mlps[0].c_proj.is_cuda else refresh_down_scales
        refresh([m.c_proj for m in mlps], [m.down_scale for m in mlps], [m.next_down_scale for m in mlps], bootstrap)

    def activation_scales(self) -> Tensor | None:
        """The FP8 MLPs' activation scales, (layers,), or None without FP8 MLPs: each rank's own, from its last forward
        (as HEAD's ranks keep theirs), so a checkpoint holds every rank's (support.save_checkpoint)."""
        if not self.blocks[0].mlp.fp8:
            return None
        return torch.stack([block.mlp.act_scale for block in self.blocks])

    def smear(self, e: Tensor, before: Tensor | None = None, restarts: Tensor | None = None) -> Tensor:
        """Token embeddings e (T, D) with a gated share of each one's predecessor added (the 2025-09-18 record's
        smear): e_t + lambda sigmoid(w . e_t[:12]) e_(t-1), across documents; the first token keeps its own, unless
        generation passes the embedding before it, and so does each token where restarts (T,) is true."""
        if before is not None:
            e = torch.cat([before, e])
        gate = self.scalars[2 * self.num_layers] * torch.sigmoid(self.smear_gate(e[1:, :self.smear_gate.in_features]))
        if restarts is not None:
            gate = gate.masked_fill(restarts[1:, None], 0)
        e = torch.cat([e[:1], e[1:] + gate * e[:-1]])
        return e if before is None else e[1:]

    def softcapped_logits(self, x: Tensor) -> Tensor:
        """Float32 logits over the padded vocabulary from the final residual stream (generation's, evaluation's)."""
        return softcap(self.lm_head(norm(x)), False, self.logit_cap, self.logit_offset)


# ------------------------------------------------------------------------------------------------
# Gradient synchronization: bucketed all-reduce launched from post-accumulate-grad hooks


class GradientBuckets:
    """Gradient averaging over ranks in buckets of about bucket_bytes: on the last micro-step, the hook of a bucket's
    last ready gradient launches its async all-reduce. Each .grad is a view of its bucket's flat buffer (no copies).
    Buckets of deferred parameters (Adam's, which steps every second step) are reduced only on the steps that set
    reduce_deferred; in between, their gradients add up in the buffers, as each rank's own. Parameters in idle get no
    gradient of their own: their buckets are reduced without them, or not at all; a parameter in alone gets a bucket of
    its own, skipped whole while it is idle. fold, (source, target): on the steps that reduce target, source's gradient
    (the tied embedding's) joins target's before target's bucket is reduced, then starts again from zero."""

    def __init__(self, params_in_ready_order: list[nn.Parameter], bucket_bytes: int, world_size: int,
                 sum_dtype: torch.dtype | None = None, deferred: list[nn.Parameter] = (), alone: list[nn.Parameter] = ()):
        # sum_dtype=torch.float64: each .grad is added into float64 buffers and dropped, and a sum of a few float32 or
        # bf16 numbers is exact there, so its order no longer matters: any world size gets the same gradient bits.
        self.world_size, self.sum_dtype = world_size, sum_dtype
        self.buckets: list[list[nn.Parameter]] = []
        deferred_ids, alone_ids = set(map(id, deferred)), set(map(id, alone))
        size, kind = bucket_bytes, None
        for p in params_in_ready_order:
            if size >= bucket_bytes or (p.dtype, id(p) in deferred_ids, id(p) in alone_ids and id(p)) != kind:
                self.buckets.append([])
                size, kind = 0, (p.dtype, id(p) in deferred_ids, id(p) in alone_ids and id(p))
            self.buckets[-1].append(p)
            size += p.numel() * self._wire_bytes(p)
        self.deferred = [id(bucket[0]) in deferred_ids for bucket in self.buckets]
        self.reduce_deferred = True  # this step reduces the deferred buckets too
        self.idle = set()
        self.fold = None
        self.bucket_of = {p: b for b, bucket in enumerate(self.buckets) for p in bucket}
        self.offset_of = {p: sum(q.numel() for q in bucket[:i])
                          for bucket in self.buckets for i, p in enumerate(bucket)}
        self.flat = [torch.zeros(sum(p.numel() for p in bucket), dtype=sum_dtype or bucket[0].dtype, device=bucket[0].device)
                     for bucket in self.buckets]
        if sum_dtype is None:
            for p in params_in_ready_order:
                p.grad = self._slice(p).view_as(p)
        self.ready = [0] * len(self.buckets)
        self.handles = [None] * len(self.buckets)
        self.reductions = [0] * len(self.buckets)  # all-reduces launched per bucket over the run
        self.steps = 0  # optimizer steps synchronized
        self.last_micro_step = True
        for p in params_in_ready_order:
            p.register_post_accumulate_grad_hook(self._on_grad_ready)

    def _wire_bytes(self, p: nn.Parameter) -> int:
        return p.element_size() if self.sum_dtype is None else self.sum_dtype.itemsize

    def bucket_bytes(self) -> list[int]:
        return [sum(p.numel() * self._wire_bytes(p) for p in bucket) for bucket in self.buckets]

    def _slice(self, p: nn.Parameter) -> Tensor:
        start = self.offset_of[p]
        return self.flat[self.bucket_of[p]][start:start + p.numel()]

    def _on_grad_ready(self, p: nn.Parameter):
        if self.sum_dtype is not None:
            self._slice(p).add_(p.grad.reshape(-1))
            p.grad = None
        elif p.grad.data_ptr() != self._slice(p).data_ptr():  # else each rank would step on its own gradient
            raise RuntimeError(f"the gradient of a {tuple(p.shape)} parameter left its bucket's buffer (was .grad "
                               f"set to None?): zero gradients with GradientBuckets.zero_grad()")
        if self.fold is not None and p is self.fold[0]:  # one of the target's bucket's gradients
            p = self.fold[1]
        b = self.bucket_of[p]
        if not self.last_micro_step or not self._due(b):
            return
        self.ready[b] += 1
        if self.ready[b] > self._expected(b):
            raise RuntimeError(f"gradient bucket {b} got more gradients than it has parameters in one step")
        if self.ready[b] < self._expected(b):
            return
        if self.fold is not None and b == self.bucket_of[self.fold[1]]:
            source, target = self.fold  # the record's lm_head.grad += embed.grad, in their dtype
            self._slice(target).add_(self._slice(source))
            self._slice(source).zero_()
        if self.world_size == 1:
            return
        self.handles[b] = dist.all_reduce(self.flat[b], op=dist.ReduceOp.AVG, async_op=True)
        self.reductions[b] += 1

    def _due(self, b: int) -> bool:
        return (self.reduce_deferred or not self.deferred[b]) and self._expected(b) > 0

    def _expected(self, b: int) -> int:
        folded = self.fold is not None and self.bucket_of[self.fold[1]] == b
        return sum(p not in self.idle for p in self.buckets[b]) + folded

    def wait_for_gradients(self):
        for b, bucket in enumerate(self.buckets):
            if not self._due(b):
                continue
            if self.ready[b] < self._expected(b):
                raise RuntimeError(f"gradient bucket {b} was not reduced: {self._expected(b) - self.ready[b]} "
                                   f"of its {self._expected(b)} parameters got no gradient this step")
            if self.handles[b] is not None:
                self.handles[b].wait()
            if self.sum_dtype is not None:
                for p in bucket:
                    if p not in self.idle:
                        p.grad = self._slice(p).view_as(p).to(p.dtype, copy=True)
                self.flat[b].zero_()
        self.ready = [0] * len(self.buckets)
        self.handles = [None] * len(self.buckets)
        self.steps += 1

    def reset(self):
        """Every gradient from zero, whatever step this is (after the warm-up): deferred and idle buckets too."""
        for flat in self.flat:
            flat.zero_()
        for p in self.bucket_of:
            p.grad = None if self.sum_dtype is not None else self._slice(p).view_as(p)
        self.ready = [0] * len(self.buckets)
        self.handles = [None] * len(self.buckets)

    def zero_grad(self):
        """After the optimizer step: the gradients it used start again from zero, in their buffers."""
        for b, (bucket, flat) in enumerate(zip(self.buckets, self.flat)):
            if not self._due(b):
                continue
            if self.sum_dtype is None:
                flat.zero_()
            else:
                for p in bucket:
                    p.grad = None


# ------------------------------------------------------------------------------------------------
# Data: shards of the llm.c format (256 int32 header: magic, version, token count; then uint16)

SHARD_MAGIC, SHARD_VERSION, SHARD_HEADER_INTS = 20240520, 1, 256


def shard_token_count(path: Path) -> int:
    """The token count a shard's header gives, checked against the header's fields and the file's size."""
    size = path.stat().st_size
    header = np.fromfile(path, dtype="<i4", count=SHARD_HEADER_INTS)
    if header.size < SHARD_HEADER_INTS:
        raise DataError(f"{path}: {size} bytes is shorter than the {4 * SHARD_HEADER_INTS}-byte shard header")
    if header[0] != SHARD_MAGIC:
        raise DataError(f"{path}: bad magic {header[0]} (expected {SHARD_MAGIC}); not a token shard")
    if header[1] != SHARD_VERSION:
        raise DataError(f"{path}: unsupported shard version {header[1]} (expected {SHARD_VERSION})")
    num_tokens = int(header[2])
    expected_size = 4 * SHARD_HEADER_INTS + 2 * num_tokens
    if size != expected_size:
        raise DataError(f"{path}: header says {num_tokens} tokens ({expected_size} bytes with the header) but the file "
                        f"has {size} bytes; the file is truncated or corrupt")
    return num_tokens


def load_shard(path: Path, vocab_size: int | None, pin_memory: bool = False) -> Tensor:
    """All tokens of one shard as a uint16 tensor, validated: its header and size, and every id below
    vocab_size unless that is None (the caller checks them later with check_token_ids)."""
    tokens = torch.empty(shard_token_count(path), dtype=torch.uint16, pin_memory=pin_memory)
    with open(path, "rb", buffering=0) as f:
        f.seek(4 * SHARD_HEADER_INTS)
        f.readinto(tokens.numpy())
    if vocab_size is not None:
        check_token_ids(path, tokens, vocab_size)
    return tokens


def check_token_ids(path: Path, tokens: Tensor, vocab_size: int):
    """One pass over a shard: an id past the embedding would crash deep inside the model (on CUDA as a
    device-side assert in every rank) without naming the file."""
    ids = tokens.numpy()
    if ids.size and ids.max() >= vocab_size:
        position = int(np.argmax(ids >= vocab_size))
        raise DataError(f"{path}: token id {ids[position]} at position {position} is not below vocab_size={vocab_size}; "
                        f"the shard is corrupt or made with another tokenizer")


def shard_paths(pattern: str, what: str) -> list[Path]:
    paths = [Path(p) for p in sorted(glob.glob(pattern))]
    if not paths:
        raise DataError(f"no {what} shards match {pattern!r} (run ./run.sh to fetch or build the data, "
                        f"or pass --{what}_files=GLOB)")
    return paths


class TokenStream:
    """Each step's batch: num_slots sequences of seq_len + 1 tokens (each step's own, at most max_seq_len), rank r of W
    taking slots r, r + W, ...: consecutive tokens, or packed documents (the record), each clipped to packed_doc_len
    tokens or the batch's own clip, not shorter. A shard is read when first needed, on the clock, as the record does."""

    def __init__(self, pattern: str, max_seq_len: int, num_slots: int, device: torch.device, vocab_size: int,
                 pin_memory: bool = False, packed_doc_len: int = 0):
        self.pattern, self.paths = pattern, shard_paths(pattern, "train")
        self.max_seq_len, self.num_slots, self.device, self.vocab_size = max_seq_len, num_slots, device, vocab_size
        self.pin_memory, self.packed_doc_len = pin_memory, packed_doc_len
        for path in self.paths:  # every header and length now: a bad shard would stop the run when reached
            length = shard_token_count(path)
            if not packed_doc_len and length < num_slots * max_seq_len + 2:
                raise DataError(f"{path}: {length} tokens, fewer than the {num_slots * max_seq_len + 2} that one batch "
                                f"of {num_slots} x {max_seq_len} reads")
        self.shard_index, self.pos, self.epoch = 0, 0, 0
        self.checked = set()  # the shards whose token ids were checked
        self._read(0)
        self.check_shard()
        self.tokens = None  # read again, on the clock, for the first batch

    def _read(self, index: int):
        self.tokens = load_shard(self.paths[index], None, self.pin_memory)
        self.shard_length = len(self.tokens)
        if self.packed_doc_len:  # the constructor checked an unpacked shard's length
            self.doc_starts = np.flatnonzero(self.tokens.numpy() == EOT_TOKEN)
            if self._packed_segments(0, self.max_seq_len, self.packed_doc_len) is None:
                raise DataError(f"{self.paths[index]}: its documents, clipped to packed_doc_len={self.packed_doc_len} "
                                f"tokens, cannot fill one batch of {self.num_slots} x {self.max_seq_len + 1} tokens "
                                f"(pass --packed_doc_len=0 for consecutive tokens)")

    @property
    def unchecked(self) -> bool:
        return self.tokens is not None and self.shard_index not in self.checked

    def check_shard(self):
        """Checks the current shard's token ids, once: not the record's check, so the loop runs it off the clock (the
        first shard's, or a resumed run's, when the stream is made or restored: before anything is written)."""
        if self.unchecked:
            check_token_ids(self.paths[self.shard_index], self.tokens, self.vocab_size)
            self.checked.add(self.shard_index)

    def state_dict(self) -> dict:
        return dict(shard_index=self.shard_index, pos=self.pos, epoch=self.epoch)

    def load_state_dict(self, state: dict):
        if state["shard_index"] >= len(self.paths):
            raise DataError(f"the checkpoint resumes in train shard {state['shard_index'] + 1} of the sorted list, but "
                            f"{self.pattern!r} matches {len(self.paths)}; resume with the shards it trained on")
        self.shard_index, self.pos, self.epoch = state["shard_index"], state["pos"], state["epoch"]
        self._read(self.shard_index)
        self.check_shard()
        self.tokens = None

    def _next_shard(self):
        self.shard_index = (self.shard_index + 1) % len(self.paths)
        self.epoch += self.shard_index == 0
        self.pos = 0
        self._read(self.shard_index)

    def _packed_segments(self, pos: int, seq_len: int, doc_len: int) -> tuple[list[list[tuple[int, int]]], int] | None:
        """Each slot's (start, end) document segments from the first document at or after pos, each clipped to doc_len
        tokens, and where the next batch starts; None when the shard's documents run out first."""
        starts, i = self.doc_starts, int(np.searchsorted(self.doc_starts, pos))
        slots = []
        for _ in range(self.num_slots):
            segments, missing = [], seq_len + 1
            while missing:
                if i == len(starts):
                    return None
                start = int(starts[i])
                end = min(int(starts[i + 1]) if i + 1 < len(starts) else self.shard_length,
                          start + doc_len, start + missing)
                segments.append((start, end))
                missing -= end - start
                i += 1
            slots.append(segments)
        return slots, int(starts[i]) if i < len(starts) else self.shard_length

    def next_batch(self, rank: int, world_size: int, seq_len: int, doc_len: int | None = None) -> list[tuple[Tensor, Tensor]]:
        """doc_len: packed documents' clip in this batch (the records' shorter first stage); None: packed_doc_len,
        which the constructor checked that a shard's documents can fill a batch at."""
        doc_len = doc_len or self.packed_doc_len
        if seq_len > self.max_seq_len:
            raise ValueError(f"seq_len={seq_len} is above the stream's max_seq_len={self.max_seq_len}")
        if self.packed_doc_len:
            if self.tokens is None:
                self._read(self.shard_index)
            packed = self._packed_segments(self.pos, seq_len, doc_len)
            if packed is None:
                self._next_shard()
                packed = self._packed_segments(0, seq_len, doc_len)
            slots, self.pos = packed
            mine = [torch.cat([self.tokens[start:end] for start, end in segments]) for segments in slots[rank::world_size]]
        else:
            span = self.num_slots * seq_len
            if self.pos + span + 1 >= self.shard_length:
                self._next_shard()
            elif self.tokens is None:
                self._read(self.shard_index)
            mine = [self.tokens[start:start + seq_len + 1]
                    for start in range(self.pos + rank * seq_len, self.pos + span, world_size * seq_len)]
            self.pos += span
        return [(buf[:-1].to(self.device, torch.int32, non_blocking=self.pin_memory),
                 buf[1:].to(self.device, torch.int64, non_blocking=self.pin_memory)) for buf in mine]


def validation_sequences(pattern: str, num_tokens: int, seq_len: int, vocab_size: int) -> Tensor:
    """The first num_tokens + 1 validation tokens as (num_tokens // seq_len, seq_len + 1) windows
    (targets overlap the next input by one token), identical for every run and world size."""
    tokens, have = [], 0
    for path in shard_paths(pattern, "val"):
        if have > num_tokens:
            break
        tokens.append(load_shard(path, vocab_size))
        have += len(tokens[-1])
    if have < num_tokens + 1:
        raise DataError(f"val_tokens={num_tokens} but the files matching {pattern!r} hold only {have} tokens")
    flat = torch.cat(tokens)[:num_tokens + 1].long()
    starts = torch.arange(0, num_tokens, seq_len)
    return torch.stack([flat[s:s + seq_len + 1] for s in starts])


# ------------------------------------------------------------------------------------------------
# Hyperparameters: the defaults are the 8xH100 record (upstream HEAD f411b3d3, 2026-08-01); presets override some of them


@dataclass
class Hyperparameters:
    # data
    train_files: str = "data/fineweb10B/fineweb_train_*.bin"  # glob of training shards, read in sorted order
    val_files: str = "data/fineweb10B/fineweb_val_*.bin"  # glob of validation shards
    val_tokens: int = 10_485_760  # validation tokens; fixed so runs stay comparable
    seq_len: tuple = (16 * 1024, 32 * 1024, 48 * 1024)  # training tokens per sequence, one per equal part of the scheduled steps, the last also for the extension (batch stages: records from 2025-11-29)
    val_seq_len: int = 4 * 64 * 1024  # tokens per validation sequence
    batch_slots: int = 8  # sequences per optimizer step; world size must divide it (the rest is accumulation)
    packed_doc_len: tuple = (896, 2048, 2048)  # training sequences pack documents from their first token, each clipped to this many tokens, one per equal part as seq_len (896 first: records from 2026-02-10); 0: consecutive tokens
    # schedule
    num_iterations: int = 1285  # optimizer steps
    extension_steps: int = 15  # the last of num_iterations run past the schedules: the lr flat at its end, the window at final_window
    cooldown_frac: float = 0.6  # final fraction of the scheduled steps (all but the extension) in which the lr decays linearly to LR_FLOOR
    val_loss_every: int = 250  # validate every N steps from step 0, and at the end; 0: only at the end
    train_loss_every: int = 0  # log rank 0's training loss every N steps (a device sync); 0: never
    window_stages: tuple = (3, 7, 11)  # long sliding window in window units, one per equal part of the scheduled steps; short-window layers get half (rounded down)
    final_window: int = 13  # long window in window units for the extension steps and the final validation
    final_long_window: int = 20  # the long layers' window at the final validation, after YaRN to final_window; 0: final_window
    window_unit: int = 128  # tokens per window unit (the record: one 128-token block)
    yarn: bool = True  # rescale the rotary frequencies (YaRN) at each window change, as the record; false: keep them
    # model
    vocab_size: int = 50257  # GPT-2 tokens; the lm_head is padded to a multiple of 128
    num_layers: int = 11  # a U-net's: the first half feeds the second through skips; odd: the U one deeper without its layer 0 (records from 2025-12-14)
    num_heads: int = 6  # attention heads
    head_dim: int = 128  # dims per head; rotary uses half of them
    model_dim: int = 768  # residual stream width
    backout_layer: int = 7  # the layers after it attend over the stream it leaves (records from 2026-03-06), which the dense connections mix into the last layer and the final stream (from 2026-04-22); between the skip's source and the last layer
    paired_head_layers: str = "0,2,5,9"  # layers (comma-separated) whose heads attend in pairs over a sequence twice as long (records from 2026-01-07); none
    xsa_layers: str = "1,3,4,7"  # layers (comma-separated) whose heads take out a gated share of their output along their own value (XSA, records from 2026-04-29); none
    logit_cap: float = LOGIT_SOFTCAP  # logits = cap sigmoid((z + offset) / 7.5) (records from 2025-12-26; 30 and 0 before)
    logit_offset: float = LOGIT_OFFSET  # the softcap's offset above
    attention_scale: float = 0.1  # softmax scale in the first window stage
    attention_scale_growth: float = 0.2  # each new window multiplies the softmax scale by 1 + this x ln(new / previous); 0: constant
    # optimizers
    head_lr: float = 0.008  # Adam lr for the lm_head
    embed_lr: float = 0.008  # Adam lr for the token embedding, once untied
    value_embed_lr: float = 0.6  # Adam lr for the value embeddings and the bigram embedding (the records give both the same)
    scalar_lr: float = 0.04  # Adam lr for the smear's, the skip's and attention's lambdas and the stream's resid scales (/ SCALAR_LR_MUL: its post scales)
    gate_lr: float = 0.008  # Adam lr for the value-embedding gates; x GATE_NETS_LR_MUL the gate networks', x MUDD_LR_MUL the dense connections'
    smear_gate_lr: float = 8e-5  # Adam lr for the smear's gate (records from 2025-12-21; Muon's before)
    adam_eps: float = 1e-10  # Adam epsilon
    muon_lr: float = 0.023  # Muon lr for hidden matrices
    muon_momentum_start: float = 0.85  # Muon momentum at step 0
    muon_momentum_end: float = 0.95  # Muon momentum after the warm-up
    muon_momentum_warmup_steps: int = 300  # steps over which the momentum rises linearly
    muon_momentum_cooldown_steps: int = 50  # the last steps, over which it falls linearly back to muon_momentum_start (records from 2025-09-30)
    muon_neuron_beta2: float = 0.9  # NorMuon (Li et al., 2025) as the records from 2025-10-27 compute it: EMA decay of each neuron's update mean square; 0: off
    muon_cautious_wd: float = 1.2  # cautious weight decay on Muon's matrices (Chen et al., 2025), x the lr: p -= lr' (v + lr wd mask p) (records from 2025-11-10); 0: off
    # systems
    dtype: str = "bfloat16"  # parameters (the scalars float32), activations and Muon's orthogonalization: bfloat16, float32 (to compare runs), or auto (auto_dtype: bfloat16 where multiplied natively)
    compile: bool = True  # torch.compile the model
    warmup_steps: int = 30  # steps on random tokens before training, to compile (each training shape from its first step, in turn); state restored afterwards
    fp8: bool = True  # FP8 lm_head and MLP matmuls in training where the GPU supports it (compute capability >= 8.9)
    bucket_mb: float = 25.0  # gradient all-reduce bucket size in MB (multi-process runs)
    exact_grad_sum: bool = False  # sum gradients over micro-steps and ranks in float64: the same bits at any world size
    seed: int = 0  # initialization seed (rank 0's parameters are broadcast to all ranks)
    # run
    run_id: str = ""  # log and checkpoint name; default: a new uuid
    log_dir: str = "logs"  # where logs/<run_id>.txt goes
    checkpoint_dir: str = "checkpoints"  # where checkpoints/<run_id>/step_NNNNNN.pt go
    save_checkpoint: bool = False  # save model, optimizers, step and data position at the end
    checkpoint_every: int = 0  # also save every N steps; 0: never
    resume: str = ""  # checkpoint to continue from, or latest: the newest of --run_id in checkpoint_dir


PRESETS = {
    "record": {},  # the 8xH100 record: the defaults above
    "cpu": dict(  # no GPU: the record scaled down, on Shakespeare; each departure measured in records/track_cpu
        train_files="data/shakespeare/shakespeare_train_*.bin",
        val_files="data/shakespeare/shakespeare_val_*.bin",
        val_tokens=32 * 8192,  # most of the validation shard
        seq_len=(512, 1024, 1536),  # the record's batch stages, 1 : 2 : 3
        val_seq_len=1024,
        batch_slots=2,  # per token, 2 x 1024 a step learned the most of 1, 2, 4 and 8 x 1024 (before the stages)
        packed_doc_len=(0,),  # documents are whole plays: clipped ones would skip most tokens
        num_iterations=260,
        extension_steps=6,  # the record's 40 of 1600 steps, scaled
        cooldown_frac=1.0,  # the decay from the first step (within each stage's peak): lower losses than 0.6-0.9
        val_loss_every=0,  # a validation costs as much as dozens of steps: only at the end
        train_loss_every=1,
        window_stages=(2, 4, 8, 16, 32),  # 64 to 1024 tokens: 128-token units start too wide for 260 steps
        final_window=32,
        final_long_window=0,  # the final window already spans a validation sequence
        window_unit=32,  # (records/track_cpu/README.md)
        yarn=False,  # the record's rescale at each of these four window changes gave higher losses here
        attention_scale=0.12,
        attention_scale_growth=0.0,  # constant: the record's growth gave higher losses here
        num_layers=4,
        num_heads=2,  # two heads, so that layer 1's attend in pairs as half the record's short-window layers do
        head_dim=64,
        model_dim=128,  # the 50304-wide lm_head dominates; width 128 learned as much per token as 256
        backout_layer=2,
        paired_head_layers="1",
        xsa_layers="0",
        logit_cap=30.0,  # the record's 23 and 5 gave higher losses on every seed here: a width-128 model needs the range
        logit_offset=0.0,
        head_lr=0.11 / 128**0.5,  # 0.11 when the head divided z by sqrt(width): the same steps on the logits
        embed_lr=0.11 / 128**0.5,  # the lm_head's, as the record's (the embedding starts as its copy)
        value_embed_lr=0.3,  # Adam lrs x0.5 of the record's (the bigram table's too): better at 2 x 1024 tokens a step
        scalar_lr=0.02,
        muon_lr=0.025,  # x the shape factors: attention 0.025, the MLP's up 0.05 and down 0.1 (MLP_DOWN_LR_MUL)
        muon_momentum_warmup_steps=30,  # set for 85 steps of 8 x 1024, kept since; unmeasured against the record's 300 scaled
        muon_momentum_cooldown_steps=8,  # the record's 50 of 1600 steps, scaled
        muon_cautious_wd=20.0,  # the records' form, tied to lr^2: 10 and 40 alike at muon_lr 0.05 (records/track_cpu/README.md)
        dtype="auto",  # bf16 where the CPU multiplies it natively (auto_dtype); emulated bf16 is many times slower
        compile=True,  # faster steps, for a compile that inductor's cache shortens
        warmup_steps=0,
    ),
}

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}

# The settings that take one of a few values, and those values: check_hyperparameters() validates them.
CHOICES = {
    "dtype": ("auto", *DTYPES),
}

# Settings that may differ between a checkpoint and the run resuming it.
RESUMABLE_CHANGES = {"run_id", "log_dir", "checkpoint_dir", "save_checkpoint", "checkpoint_every", "resume",
                     "compile", "warmup_steps", "val_loss_every", "train_loss_every", "bucket_mb",
                     "exact_grad_sum"}


def layer_indices(args: Hyperparameters, name: str, allowed: range, choices: str) -> tuple[int, ...]:
    """The comma-separated layers of setting name, each in allowed, or a ConfigError naming the choices."""
    text = getattr(args, name)
    layers = tuple(int(i) for i in text.split(",") if i.isdigit())
    if len(layers) != len(text.split(",")) or any(i not in allowed for i in layers):
        raise ConfigError(f"{name}={text}: {choices}, comma-separated ({allowed.start} to {allowed.stop - 1} here)")
    return layers


def listed_layers(args: Hyperparameters, name: str) -> tuple[int, ...]:
    """A setting of comma-separated layers (paired_head_layers, xsa_layers) as GPT takes it; a ConfigError unless
    none or layers of the model."""
    return () if getattr(args, name) == "none" else layer_indices(args, name, range(args.num_layers), "none, or layers")


def parse_args(argv: list[str], default_preset: str) -> tuple[Hyperparameters, str]:
    """Hyperparameters of --preset NAME and --key=value overrides (run_support.parse_options)."""
    return support.parse_options(argv, Hyperparameters, PRESETS, default_preset)


def check_hyperparameters(args: Hyperparameters, world_size: int):
    for name, values in (("seq_len", args.seq_len), ("val_seq_len", (args.val_seq_len,))):
        if not values or any(value <= 0 or value % BLOCK_SIZE for value in values):
            raise ConfigError(f"{name}={','.join(map(str, values))} must be positive multiples of {BLOCK_SIZE} (the "
                              f"attention block size)")
    if args.head_dim % 4:
        raise ConfigError(f"head_dim={args.head_dim} must be a multiple of 4 (rotary on half of the dims, in pairs)")
    if args.num_heads * args.head_dim != args.model_dim:
        raise ConfigError(f"num_heads x head_dim = {args.num_heads} x {args.head_dim} must equal model_dim={args.model_dim} "
                          f"(q, k, v and the output projection are model_dim x model_dim)")
    if args.batch_slots % world_size:
        raise ConfigError(f"world size {world_size} must divide batch_slots={args.batch_slots}; "
                          f"use {', '.join(str(n) for n in range(1, args.batch_slots + 1) if args.batch_slots % n == 0)} processes")
    if args.val_tokens <= 0 or args.val_tokens % (args.val_seq_len * world_size):
        raise ConfigError(f"val_tokens={args.val_tokens} must be a positive multiple of val_seq_len x world size "
                          f"({args.val_seq_len} x {world_size})")
    for name, valid in CHOICES.items():
        if getattr(args, name) not in valid:
            raise ConfigError(f"{name}={getattr(args, name)!r}; choose one of {', '.join(valid)}")
    if not 0 <= args.cooldown_frac <= 1:
        raise ConfigError(f"cooldown_frac={args.cooldown_frac} must be within [0, 1]")
    if not 0 <= args.muon_neuron_beta2 < 1:
        raise ConfigError(f"muon_neuron_beta2={args.muon_neuron_beta2} must be within [0, 1) (0: NorMuon off)")
    if args.muon_cautious_wd < 0:
        raise ConfigError(f"muon_cautious_wd={args.muon_cautious_wd} must be >= 0 (0: off)")
    if args.num_iterations < 1:
        raise ConfigError(f"num_iterations={args.num_iterations} must be at least 1")
    # Logits up to cap and no max taken out: the sum of exp over the padded vocabulary must stay finite in float32.
    largest_cap = math.log(torch.finfo(torch.float32).max / next_multiple(args.vocab_size, 128))
    if not 0 < args.logit_cap < largest_cap:
        raise ConfigError(f"logit_cap={args.logit_cap} must be within (0, {largest_cap:.1f}) (float32's exp over the "
                          f"vocabulary)")
    if args.checkpoint_every % ADAM_EVERY:
        raise ConfigError(f"checkpoint_every={args.checkpoint_every} must be a multiple of {ADAM_EVERY}, Adam's steps: "
                          f"a checkpoint between them would drop the gradients Adam has summed so far")
    for name in ("extension_steps", "muon_momentum_cooldown_steps"):
        if not 0 <= getattr(args, name) < args.num_iterations:
            raise ConfigError(f"{name}={getattr(args, name)} must be within [0, num_iterations={args.num_iterations})")
    try:
        check_structure(gpt_config(args, training_seq_len(args)))
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if args.final_long_window < 0:
        raise ConfigError(f"final_long_window={args.final_long_window} must be >= 0 (0: final_window)")
    if not args.window_stages or min(*args.window_stages, args.final_window, args.window_unit) < 1:
        raise ConfigError(f"window_stages={','.join(map(str, args.window_stages))}, final_window={args.final_window} and "
                          f"window_unit={args.window_unit} must be at least 1")
    if not args.packed_doc_len or min(args.packed_doc_len) < 0 or 0 in args.packed_doc_len and any(args.packed_doc_len):
        raise ConfigError(f"packed_doc_len={','.join(map(str, args.packed_doc_len))} must be positive (packed documents, "
                          f"one clip per stage) or 0 (consecutive tokens)")


# ------------------------------------------------------------------------------------------------
# The device plan: every device-dependent choice of a run, made once, handed to what it configures


@dataclass(frozen=True)
class DevicePlan:
    device: torch.device
    dtype: str  # parameters (the scalars float32), activations and Muon's orthogonalization: bfloat16 or float32
    attention: str  # "flex" (FlexAttention block masks) or "sdpa" (the same masks, dense)
    fp8: bool  # the lm_head's and the MLPs' training matmuls in FP8
    compile: bool  # torch.compile the model
    compile_optimizers: bool  # torch.compile Muon's orthogonalization and Adam's update
    pinned_memory: bool  # batches in pinned host memory, copied without blocking
    deterministic: bool  # torch's deterministic algorithms, so that a run repeats to the bit
    lines: tuple[str, ...]  # what the log says of each choice


NATIVE_BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")  # x86 instruction sets that multiply bf16 natively


def auto_dtype(device: torch.device, cpuinfo: Path = Path("/proc/cpuinfo")) -> tuple[str, str]:
    """dtype=auto, and why: bfloat16 on CUDA and on CPUs that multiply it natively; float32 on CPUs
    that emulate bf16 matmuls, many times slower. ./run.sh asks this function too."""
    if device.type == "cuda":
        return "bfloat16", "CUDA"
    try:
        flags = {flag for line in cpuinfo.read_text().splitlines() if line.startswith("flags")
                 for flag in line.split(":", 1)[1].split()}
    except OSError:
        flags = set()
    native = [flag for flag in NATIVE_BF16_CPU_FLAGS if flag in flags]
    if native:
        return "bfloat16", f"the CPU has {native[0]}"
    return "float32", f"the CPU has none of {', '.join(NATIVE_BF16_CPU_FLAGS)}: bf16 matmuls would be emulated"


def fp8_supported(device: torch.device) -> tuple[bool, str]:
    """FP8 matmuls need CUDA compute capability >= 8.9 (Ada, Hopper and newer)."""
    if device.type != "cuda":
        return False, f"needs CUDA compute capability >= 8.9; this device is {device.type}"
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        return False, f"needs CUDA compute capability >= 8.9; this GPU has {major}.{minor}"
    return True, f"compute capability {major}.{minor}"


def cpp_compiler_found() -> bool:
    """Whether torch.compile can build CPU kernels here (inductor searches $CXX, then g++ and clang++)."""
    from torch._inductor import cpp_builder, exc
    try:
        return bool(cpp_builder.get_cpp_compiler())
    except exc.InvalidCxxCompiler:
        return False


def plan_device(args: Hyperparameters, device: torch.device, allocator: str = "") -> DevicePlan:
    """CUDA runs the record's way (FlexAttention, FP8 where the GPU has it, compiled optimizers and FP8 scaling); a CPU
    uses the same masks densely and deterministic kernels."""
    cuda = device.type == "cuda"
    fp8_ok, fp8_why = fp8_supported(device)
    fp8 = args.fp8 and fp8_ok
    compile = args.compile and (cuda or cpp_compiler_found())
    dtype, dtype_why = auto_dtype(device) if args.dtype == "auto" else (args.dtype, "")
    plan = DevicePlan(device, dtype, "flex" if cuda else "sdpa", fp8, compile, compile_optimizers=cuda,
                      pinned_memory=cuda, deterministic=not cuda, lines=())
    if plan.attention == "sdpa":
        attention_why = f"SDPA with dense masks (FlexAttention has no backward on {device.type} in torch {torch.__version__})"
    elif compile:
        attention_why = "FlexAttention with block-sparse masks, compiled with the model"
    else:
        # Eager FlexAttention materializes every score (tens of GB at 48K tokens): attend() compiles it alone.
        attention_why = "FlexAttention with block-sparse masks, its kernel compiled alone (compile=false keeps the rest eager)"
    return dataclasses.replace(plan, lines=(
        f"fp8 lm_head and MLPs: {f'on ({fp8_why})' if fp8 else 'off (' + ('--fp8=false' if not args.fp8 else fp8_why) + ')'}",
        f"attention: {attention_why}",
        "compile: " + ("on" if compile else "off (compile=false)" if not args.compile
                       else "off (no C++ compiler for inductor's CPU kernels: install g++ or clang++, or set CXX)"),
        # Inductor's CPU kernels add embedding gradients with atomics, in whatever order threads reach
        # them; the deterministic fallback adds in token order. CUDA keeps the record's kernels.
        "deterministic algorithms: " + ("on (a CPU run repeats to the bit at the same thread count, compiled or not)"
                                        if plan.deterministic else "off (CUDA: the record's kernels)"),
        f"optimizers: Muon (Polar Express) and Adam, {'compiled' if plan.compile_optimizers else 'eager (compiled on CUDA only)'}",
        f"dtype: {dtype}" + (f" (auto: {dtype_why})" if dtype_why else ""),
        f"pinned memory, non-blocking copies: {'on' if plan.pinned_memory else 'off (CUDA only)'}",
        f"CUDA allocator: {allocator if cuda else 'n/a (no CUDA)'}",
    ))


def check_ranks_agree(plan: DevicePlan, world_size: int):
    """Each rank plans alone, and dtype=auto follows its machine's CPU: every rank must run one plan."""
    dtypes = [None] * world_size
    dist.all_gather_object(dtypes, plan.dtype)
    if len(set(dtypes)) > 1:
        raise ConfigError(f"the ranks' dtype=auto differ ({', '.join(dtypes)}): their CPUs differ; pass --dtype")


# ------------------------------------------------------------------------------------------------
# The training step and loop


def loss_scale(args: Hyperparameters, world_size: int) -> float:
    """What each micro-batch's summed loss is multiplied by before its backward: LOSS_SCALE / accumulation steps, the
    ranks' gradients then averaged, so the same gradient at any world size."""
    return LOSS_SCALE / (args.batch_slots // world_size)


def gpt_config(args: Hyperparameters, max_seq_len: int, plan: DevicePlan | None = None, world_size: int = 1) -> GPTConfig:
    """The GPT that args describe, built as plan says for world_size ranks; without a plan, for inference on CPU (dense
    masks, no FP8, float32 parameters)."""
    return GPTConfig(args.vocab_size, args.num_layers, args.num_heads, args.head_dim, args.model_dim, max_seq_len,
                     windows=(*args.window_stages, args.final_window), window_unit=args.window_unit,
                     attention_scale=args.attention_scale, attention_scale_growth=args.attention_scale_growth,
                     backout_layer=args.backout_layer, paired_layers=listed_layers(args, "paired_head_layers"),
                     xsa_layers=listed_layers(args, "xsa_layers"), logit_cap=args.logit_cap, logit_offset=args.logit_offset,
                     dtype=DTYPES[plan.dtype] if plan else torch.float32,
                     attention_backend=plan.attention if plan else "sdpa", fp8=plan is not None and plan.fp8,
                     loss_scale=loss_scale(args, world_size))


def training_seq_len(args: Hyperparameters) -> int:
    """The longest sequence a run feeds its model (training's or validation's): its rotary tables' length."""
    return max(*args.seq_len, args.val_seq_len)


def build_model(args: Hyperparameters, max_seq_len: int, plan: DevicePlan | None = None, world_size: int = 1) -> GPT:
    """The GPT of gpt_config(), on CPU."""
    return GPT(gpt_config(args, max_seq_len, plan, world_size))


# Adam's betas by parameter kind (the records' from 2026-01-04; the stream's lambdas' from 2026-02-12), and its cautious
# weight decay (from 2025-12-18), times lr^2 and each kind's multiplier (these from 2025-12-29; the other kinds' 0).
# value_embeds: the bigram table's too.
ADAM_BETAS = dict(head=(0.5, 0.95), value_embeds=(0.75, 0.95), gates=(0.9, 0.99), stream=(0.9, 0.95))
ADAM_CAUTIOUS_WD = 0.005
ADAM_WD_MULS = dict(lm_head=150.0, embed=150.0, value_embeds=5.0, gates=1.0)
ADAM_EVERY = 2  # Adam steps every 2nd step, on the two steps' summed gradients (records from 2025-09-30)
SCALAR_LR_MUL = 5  # the records' scalars and stream scales take 5x the Adam lr of the stream's other lambdas (2026-02-12)
MUDD_LR_MUL = 0.25  # the dense connections' Adam lr, a factor on gate_lr's after the schedule's (records from 2026-04-22)
GATE_NETS_LR_MUL = 0.1  # the gate networks' likewise (records from 2026-05-27)
MLP_DOWN_LR_MUL = 2.0  # Muon's lr factor of each MLP's down-projection, on top of its shape's (records from 2025-12-11)


def build_optimizers(model: GPT, args: Hyperparameters, rank: int = 0, world_size: int = 1,
                     plan: DevicePlan | None = None) -> tuple[Adam, Muon]:
    """Adam for the lm_head, the embeddings, the gates and the scalars (the records' from 2025-12-31); Muon for the
    hidden matrices. Each group keeps its initial_lr for the schedule."""
    gates = [block.attn.ve_gate.weight for block in model.blocks if block.attn is not None and block.attn.ve_gate]
    hidden = [p for p in model.blocks.parameters() if p.ndim >= 2 and all(p is not g for g in gates)]
    nets = lambda net, lr_mul: [  # a coefficient network's groups: its biases and learned scale without decay
        dict(params=[net.w1, net.w2], lr=args.gate_lr, lr_mul=lr_mul, wd_mul=ADAM_WD_MULS["gates"], betas=ADAM_BETAS["gates"]),
        dict(params=[net.b2, *[p for p in [net.scale] if isinstance(p, nn.Parameter)]], lr=args.gate_lr, lr_mul=lr_mul,
             wd_mul=0.0, betas=ADAM_BETAS["gates"])]
    compiled = plan is not None and plan.compile_optimizers
    groups = [
        dict(params=[model.lm_head.weight], lr=args.head_lr, wd_mul=ADAM_WD_MULS["lm_head"], betas=ADAM_BETAS["head"]),
        dict(params=[model.embed.weight], lr=args.embed_lr, wd_mul=ADAM_WD_MULS["embed"], betas=ADAM_BETAS["head"]),
        dict(params=[p for p in (model.value_embeds, model.bigram_embed.weight) if p is not None], lr=args.value_embed_lr,
             wd_mul=ADAM_WD_MULS["value_embeds"], betas=ADAM_BETAS["value_embeds"]),
        dict(params=gates, lr=args.gate_lr, wd_mul=ADAM_WD_MULS["gates"], betas=ADAM_BETAS["gates"]),
        dict(params=[model.smear_gate.weight], lr=args.smear_gate_lr, wd_mul=0.0, betas=ADAM_BETAS["gates"]),
        dict(params=[model.scalars], lr=args.scalar_lr, wd_mul=0.0, betas=ADAM_BETAS["gates"]),
        dict(params=[model.resid_lambdas], lr=args.scalar_lr, wd_mul=0.0, betas=ADAM_BETAS["stream"]),
        dict(params=[model.post_lambdas], lr=args.scalar_lr / SCALAR_LR_MUL, wd_mul=0.0, betas=ADAM_BETAS["stream"]),
        *nets(model.mudd, MUDD_LR_MUL), *nets(model.gates, GATE_NETS_LR_MUL),
    ]
    adam = Adam(groups, eps=args.adam_eps, weight_decay=ADAM_CAUTIOUS_WD, compiled=compiled)
    muon = Muon(hidden, lr=args.muon_lr, momentum=args.muon_momentum_start,
                dtype=DTYPES[plan.dtype if plan else args.dtype], rank=rank, world_size=world_size,
                neuron_beta2=args.muon_neuron_beta2, weight_decay=args.muon_cautious_wd,
                lr_mul={block.mlp.c_proj: MLP_DOWN_LR_MUL for block in model.blocks},
                add_apart=[p for block in model.blocks for p in block.mlp.parameters()], compiled=compiled)
    assigned = [p for optimizer in (adam, muon) for group in optimizer.param_groups for p in group["params"]]
    if sorted(map(id, assigned)) != sorted(map(id, model.parameters())):
        raise RuntimeError("every parameter must belong to exactly one optimizer group")
    for optimizer in (adam, muon):
        for group in optimizer.param_groups:
            group["initial_lr"] = group["lr"]
    return adam, muon


def stage_bounds(step: int, parts: int, args: Hyperparameters) -> tuple[int, int, int]:
    """(k, first, end): step lies in part k of `parts` parts of the scheduled steps (all but the extension), steps first
    to end - 1, part k starting at round(k N / parts) (the records' from 2026-01-30); the extension in the last part."""
    scheduled = args.num_iterations - args.extension_steps
    starts = [round(k * scheduled / parts) for k in range(parts + 1)]
    part = max(k for k in range(parts) if step >= starts[k])
    return part, starts[part], starts[part + 1]


def stage_at(step: int, stages: tuple, args: Hyperparameters):
    """The stage of step among stages, each in its part of the scheduled steps (stage_bounds); the last one for the
    extension."""
    return stages[stage_bounds(step, len(stages), args)[0]]


def seq_len_at(step: int, args: Hyperparameters) -> int:
    """Training tokens per sequence at step: the batch stage's (the batch is batch_slots such sequences)."""
    return stage_at(step, args.seq_len, args)


def doc_len_at(step: int, args: Hyperparameters) -> int:
    """The clip of each packed document at step: its stage's (0: consecutive tokens)."""
    return stage_at(step, args.packed_doc_len, args)


LR_STAGE_PEAKS = (1.0, 1.52, 1.73)  # the lr multiplier before the cooldown in each third of the scheduled steps
# (records from 2025-11-29)
LR_FLOOR = 0.15  # the multiplier the cooldown ends at, kept through the extension (records from 2026-02-10; 0.1 before)
MTP_WEIGHTS = (1.0, 0.5, 0.25)  # multi-token prediction's weights of the next 1, 2, 3 tokens (records from 2025-12-22)
PREFIX_WEIGHT = 0.25  # the prefix token's loss weight, fading to 0 over the second third (records from 2026-07-13)
UNTIE_EMBED_FRAC = 2 / 3  # the embedding is tied to the lm_head until Adam's first step from this fraction of the
# scheduled steps (records from 2025-12-22)


def lr_multiplier(step: int, args: Hyperparameters) -> float:
    """The stage's peak (LR_STAGE_PEAKS, each from its part's first step), then from step int(N (1 - cooldown_frac))
    linear from it toward LR_FLOOR at the end of the N scheduled steps; LR_FLOOR through the extension (the records'
    from 2026-01-30)."""
    scheduled = args.num_iterations - args.extension_steps
    if step >= scheduled:
        return LR_FLOOR
    peak = stage_at(step, LR_STAGE_PEAKS, args)
    cooldown_start = int(scheduled * (1 - args.cooldown_frac))
    if step < cooldown_start:
        return peak
    t = (step - cooldown_start) / (scheduled - cooldown_start)
    return peak * (1 - t) + LR_FLOOR * t


def window_at(step: int, args: Hyperparameters) -> int:
    """The long window in window units: window_stages in equal parts of the scheduled steps, then final_window for the
    extension steps and the last validation."""
    if step >= args.num_iterations - args.extension_steps:
        return args.final_window
    return stage_at(step, args.window_stages, args)


def long_window_at(step: int, args: Hyperparameters) -> int | None:
    """The long layers' own window at step, in window units: final_long_window at the last validation where set; else
    None (the long layers take window_at's)."""
    return (args.final_long_window or None) if step == args.num_iterations else None


def adam_steps_at(step: int) -> bool:
    """Whether Adam steps at step: the last of every ADAM_EVERY steps, on their summed gradients."""
    return (step + 1) % ADAM_EVERY == 0


def move_window(model: GPT, window: int, step: int, args: Hyperparameters) -> int:
    """The long window of step, the rotary frequencies rescaled (YaRN, unless args.yarn is off) when it differs from
    window, the model's until now. Rescales compound: a model restored at step s moves through steps 0..s."""
    new = window_at(step, args)
    if new != window and args.yarn:
        model.rotary.rescale(window, new)
    return new


def replay_windows(model: GPT, step: int, args: Hyperparameters) -> int:
    """The window of step, for a model whose rotary has its initial frequencies: moved through steps
    0..step, how a resumed run or a loaded checkpoint gets the rotary its training left."""
    window = window_at(0, args)
    for past in range(step + 1):
        window = move_window(model, window, past, args)
    return window


def muon_momentum(step: int, args: Hyperparameters) -> float:
    """From muon_momentum_start up to muon_momentum_end over the warm-up, and back over the cooldown's last steps."""
    if step < args.muon_momentum_warmup_steps:
        frac = step / args.muon_momentum_warmup_steps
        return args.muon_momentum_start + frac * (args.muon_momentum_end - args.muon_momentum_start)
    cooldown_start = args.num_iterations - args.muon_momentum_cooldown_steps
    if args.muon_momentum_cooldown_steps and step > cooldown_start:
        frac = (step - cooldown_start) / args.muon_momentum_cooldown_steps
        return args.muon_momentum_end - frac * (args.muon_momentum_end - args.muon_momentum_start)
    return args.muon_momentum_end


def mtp_weights_at(step: int, args: Hyperparameters) -> tuple[float, ...]:
    """Multi-token prediction's weights at step: in part k of len(MTP_WEIGHTS) parts of the scheduled steps
    (stage_bounds), the first len - k of them, the last of several moving linearly from its value toward 0 over the
    part, a + (0 - a) t (the records' from 2026-01-30); the next token's alone in the last part and the extension."""
    k, first, end = stage_bounds(step, len(MTP_WEIGHTS), args)
    weights = list(MTP_WEIGHTS[:len(MTP_WEIGHTS) - k])
    if len(weights) > 1:
        t = (step - first) / (end - first)
        weights[-1] = weights[-1] + (0.0 - weights[-1]) * t
    return tuple(weights)


def prefix_weight_at(step: int, args: Hyperparameters) -> float:
    """The prefix token's loss weight at step, in float32 (as the record's tensor of it): in the parts of
    mtp_weights_at, PREFIX_WEIGHT in the first, then moving linearly from it toward 0 over the second, a + (0 - a) t;
    0 from the third on and in the extension (the records' from 2026-07-13)."""
    k, first, end = stage_bounds(step, len(MTP_WEIGHTS), args)
    if k != 1:
        return PREFIX_WEIGHT if k == 0 else 0.0
    t = (step - first) / (end - first)
    return float32(PREFIX_WEIGHT + (0.0 - PREFIX_WEIGHT) * t)


def untie_step(args: Hyperparameters) -> int:
    """The step after whose update the input embedding stops being a copy of the lm_head: Adam's first step from
    round(UNTIE_EMBED_FRAC N) on (the records' third stage's first step | 1, from 2026-01-30); past the last step in
    runs too short."""
    step = round(UNTIE_EMBED_FRAC * (args.num_iterations - args.extension_steps))
    while not adam_steps_at(step):
        step += 1
    return step


def embed_tied_at(step: int, args: Hyperparameters) -> bool:
    """Whether step's input embedding is the lm_head's copy, its gradient added to the lm_head's (Trainer.tie_embedding)."""
    return step <= untie_step(args)


def training_shapes(args: Hyperparameters) -> dict[tuple, int]:
    """The first step of each (seq_len, window, multi-token predictions) of the training steps, in order: each compiles
    its own graphs."""
    shapes = {}
    for step in range(args.num_iterations):
        shape = (seq_len_at(step, args), window_at(step, args), len(mtp_weights_at(step, args)))
        shapes.setdefault(shape, step)
    return shapes


# Each training shape compiles its own graphs, as in the record (training, validation; uncompiled, flex_attention's
# per mask and grad mode); past dynamo's recompile limit it would run eagerly, and eager FlexAttention materializes
# every score.
GRAPHS_PER_SHAPE = 4


class Trainer:
    """This rank's model, optimizers and gradient synchronization, and what a run does with them:
    training steps and validation. Identical on every rank after construction."""

    def __init__(self, args: Hyperparameters, rank: int, world_size: int, plan: DevicePlan,
                 prefix_table: Tensor | None = None):
        """prefix_table: the model's (prefix_table()); None: none, so no prefix token's loss term."""
        self.args, self.rank, self.world_size, self.device = args, rank, world_size, plan.device
        torch.use_deterministic_algorithms(plan.deterministic)  # process-wide; read when torch.compile builds kernels
        if plan.deterministic:
            torch.utils.deterministic.fill_uninitialized_memory = False  # it would write NaN into every torch.empty
        torch.manual_seed(args.seed)
        self.model = build_model(args, training_seq_len(args), plan, world_size).to(plan.device)
        if prefix_table is not None:
            self.model.prefix_table.copy_(prefix_table)
        if world_size > 1:
            for p in self.model.parameters():
                dist.broadcast(p.detach(), 0)
        self.optimizers = build_optimizers(self.model, args, rank, world_size, plan)
        self.adam, self.muon = self.optimizers
        # The training step only calls wait_for_gradients(); the hooks do the rest during backward.
        self.buckets = None
        if world_size > 1 or args.exact_grad_sum:
            adam_params = [p for group in self.adam.param_groups for p in group["params"]]
            self.buckets = GradientBuckets(list(reversed(list(self.model.parameters()))), int(args.bucket_mb * 1e6),
                                           world_size, torch.float64 if args.exact_grad_sum else None,
                                           deferred=adam_params, alone=[self.model.embed.weight])
        self.grad_accum_steps = args.batch_slots // world_size
        self.loss_scale = loss_scale(args, world_size)
        # AOTAutograd's cache skips graphs with an autograd.Function unless allowed; SoftcappedLoss
        # keeps no state outside its saved tensors and ctx constants, so its cached graphs are safe to reuse.
        torch._functorch.config.autograd_cache_allow_custom_autograd_functions = True
        self.compiled = torch.compile(self.model, dynamic=False) if plan.compile else self.model
        torch._dynamo.config.recompile_limit = max(
            torch._dynamo.config.recompile_limit,
            GRAPHS_PER_SHAPE * (len(training_shapes(args)) + len(self.model.attention_scales)))
        self.window = window_at(0, args)
        self.untie_step = untie_step(args)
        self.tie_embedding(embed_tied_at(0, args))
        # Each step's multi-token weights ((1.0,): the next token's alone) and prefix token's weight, made once.
        self.mtp_weights = [torch.tensor(w, device=plan.device) for w in (mtp_weights_at(step, args)
                                                                          for step in range(args.num_iterations))]
        self.prefix_weights = [torch.tensor(prefix_weight_at(step, args), device=plan.device)
                               for step in range(args.num_iterations)]
        # The first step whose loss was not finite, kept on the device so that checking costs no sync.
        self.nonfinite_step = torch.full((), -1, device=plan.device, dtype=torch.int64)

    def move_window(self, step: int):
        """step's window (YaRN on a change) and embedding: before its validation and training step."""
        self.window = move_window(self.model, self.window, step, self.args)
        self.tie_embedding(embed_tied_at(step, self.args))

    def tie_embedding(self, tied: bool):
        """Tied, as the records from 2026-01-18 tie them: the input embedding is a copy of the lm_head whose gradient
        joins the lm_head's on Adam's steps (in the gradient buckets, before the lm_head's is reduced); Adam steps
        the lm_head alone, and the embedding takes a new copy."""
        self.tied = tied
        self.adam.idle = {self.model.embed.weight} if tied else set()
        if self.buckets is not None:
            self.buckets.idle = self.adam.idle
            self.buckets.fold = (self.model.embed.weight, self.model.lm_head.weight) if tied else None

    def train_step(self, step: int, micro_batches: list[tuple[Tensor, Tensor]]) -> Tensor:
        """One optimizer step (Adam's only every ADAM_EVERY steps, on their summed gradients); returns the mean training
        loss per token as a device tensor (no sync)."""
        adam_steps = adam_steps_at(step)
        self.tie_embedding(embed_tied_at(step, self.args))
        total = torch.zeros((), device=self.device)
        for i, (inputs, targets) in enumerate(micro_batches):
            if self.buckets is not None:
                self.buckets.last_micro_step = i == len(micro_batches) - 1
                self.buckets.reduce_deferred = adam_steps
            loss = self.compiled(inputs, targets, self.window, None, self.mtp_weights[step], self.prefix_weights[step])
            (loss * self.loss_scale).backward()
            total += loss.detach()
        if self.buckets is not None:
            self.buckets.wait_for_gradients()
        elif self.tied and adam_steps:
            self.model.lm_head.weight.grad.add_(self.model.embed.weight.grad)
        for optimizer in self.optimizers:
            for group in optimizer.param_groups:
                group["lr"] = group["initial_lr"] * lr_multiplier(step, self.args)
        for group in self.muon.param_groups:
            group["momentum"] = muon_momentum(step, self.args)
        stepping = self.optimizers if adam_steps else [self.muon]
        for optimizer in stepping:
            optimizer.step()
        self.model.update_down_scales(step < DOWN_BOOTSTRAP_STEPS)
        if step == self.untie_step:  # the input embedding goes its own way from the lm_head's values and Adam state
            self.adam.copy_state(self.model.lm_head.weight, self.model.embed.weight)
        elif self.tied and adam_steps:
            self.model.embed.weight.data.copy_(self.model.lm_head.weight.data)
        if self.buckets is not None:
            self.buckets.zero_grad()
        else:
            for optimizer in stepping:
                optimizer.zero_grad(set_to_none=True)
        loss = total / (self.grad_accum_steps * micro_batches[0][0].numel())
        self.nonfinite_step = torch.where((self.nonfinite_step < 0) & ~torch.isfinite(loss), step + 1, self.nonfinite_step)
        return loss

    def stop_if_nonfinite(self):
        """A host sync: called only where the loop logs or validates anyway."""
        bad = int(self.nonfinite_step)
        if bad >= 0:
            raise FloatingPointError(f"training loss became non-finite at step {bad}; lower the learning rates or check the data")

    @torch.no_grad()
    def validate(self, step: int, val_sequences: Tensor) -> float:
        """Mean loss per token over every validation sequence, split across ranks; the last validation's long layers
        at final_long_window where set."""
        long_window = long_window_at(step, self.args)
        self.model.eval()
        total = torch.zeros((), device=self.device, dtype=torch.float64)
        for seq in val_sequences[self.rank::self.world_size]:
            seq = seq.to(self.device, non_blocking=True)
            total += self.compiled(seq[:-1].int(), seq[1:], self.window, long_window).double()
        self.model.train()
        if self.world_size > 1:
            dist.all_reduce(total)
        if not math.isfinite(float(total)):
            raise FloatingPointError(f"validation loss is non-finite at step {step}")
        return float(total) / len(val_sequences)

    def warm_up(self, first_step: int):
        """Compile (and warm caches) on random tokens, each training shape in turn from its first step on (the rotary
        tables unchanged), then restore the exact state from before."""
        # This rank's optimizer states only (the base class's state_dict): Muon's gathers what other ranks own.
        optimizer_states = [torch.optim.Optimizer.state_dict(o) for o in self.optimizers]
        saved = copy.deepcopy(dict(model=self.model.state_dict(), optimizers=optimizer_states))
        args, window = self.args, self.window
        first_steps = list(training_shapes(args).values())
        for i in range(args.warmup_steps):  # successive steps of each shape: Adam's and Muon's alone
            step = min(first_steps[i % len(first_steps)] + i // len(first_steps), args.num_iterations - 1)
            seq_len, self.window = seq_len_at(step, args), window_at(step, args)
            random_batch = [(torch.randint(0, args.vocab_size, (seq_len,), device=self.device, dtype=torch.int32),
                             torch.randint(0, args.vocab_size, (seq_len,), device=self.device))
                            for _ in range(self.grad_accum_steps)]
            self.train_step(step, random_batch)
        self.model.load_state_dict(saved["model"])
        for optimizer, state in zip(self.optimizers, saved["optimizers"]):
            optimizer.load_state_dict(state)
        if self.buckets is not None:  # gradients Adam summed but did not step on, and the idle embedding's
            self.buckets.reset()
        else:
            self.model.zero_grad(set_to_none=True)
        self.nonfinite_step.fill_(-1)
        self.window = window

    def synchronize(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize()


def check_weights_fit(path, weights: dict, model: nn.Module):
    """A one-line ConfigError naming path unless its weights have model's names and shapes."""
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    found = {name: tuple(t.shape) for name, t in weights.items()}
    if found != expected:
        differences = [f"{name}: {found.get(name, 'missing')} in the file, {expected.get(name, 'none')} expected"
                       for name in sorted(expected.keys() | found.keys()) if found.get(name) != expected.get(name)]
        raise ConfigError(f"{path}: the weights do not fit the model its hyperparameters describe ({len(differences)} "
                          f"differ, first {differences[0]}); the file was altered or made by another version of "
                          f"train_gpt.py")


def restore_checkpoint(state: dict, trainer: Trainer) -> tuple[int, dict]:
    """Restores the model and optimizers in place (main restores the data stream before the log exists);
    returns the step and the training clock to continue from."""
    trainer.model.load_state_dict(state["model"])
    scales = state.get("activation_scales")  # every rank's, (ranks, layers); the model's are rank 0's
    if scales is not None and scales.size(0) == trainer.world_size:
        with torch.no_grad():
            for block, scale in zip(trainer.model.blocks, scales[trainer.rank]):
                block.mlp.act_scale.copy_(scale)
    for optimizer, optimizer_state in zip(trainer.optimizers, state["optimizers"]):
        optimizer.load_state_dict(optimizer_state)
    trainer.window = replay_windows(trainer.model, state["step"], trainer.args)
    return state["step"], state["clock"]


def training_loop(trainer: Trainer, stream: TokenStream, val_sequences: Tensor, log: support.RunLog,
                  folder: support.CheckpointFolder | None, run_id: str, start_step: int, clock: support.TrainingClock,
                  stop: support.StopSignals, argv: list[str], checkpoints: list[Path]) -> tuple[dict, dict, list[Path]]:
    """Steps start_step..num_iterations with validation, logs and checkpoints on schedule; returns (val_losses,
    train_losses, checkpoints). Raises Preempted after the step in which a signal came."""
    args, rank, world_size = trainer.args, trainer.rank, trainer.world_size
    val_losses, train_losses = {}, {}

    def pause_clock():  # off the clock: wait for the device, then add the time since the last resume
        trainer.synchronize()
        clock.add_time(1000 * (time.perf_counter() - t0))

    save = functools.partial(support.save_checkpoint, trainer, stream, clock, folder, run_id, log, checkpoints)

    trainer.synchronize()
    t0 = time.perf_counter()
    for step in range(start_step, args.num_iterations + 1):
        last = step == args.num_iterations
        trainer.move_window(step)
        if last or (args.val_loss_every and step % args.val_loss_every == 0):
            pause_clock()
            trainer.stop_if_nonfinite()
            val_losses[step] = clock.timed_validation(functools.partial(trainer.validate, step, val_sequences))
            log(f"step:{step}/{args.num_iterations} val_loss:{val_losses[step]:.4f} train_time:{clock.training_ms:.0f}ms "
                f"step_avg:{clock.training_ms / max(clock.timed_steps, 1):.2f}ms")
            trainer.synchronize()
            t0 = time.perf_counter()
        if last:
            break
        seq_len, doc_len = seq_len_at(step, args), doc_len_at(step, args)
        if clock.stage != f"{seq_len}x{trainer.window}":  # each stage's time its own: a sync at its start
            pause_clock()
            clock.stage = f"{seq_len}x{trainer.window}"
            log(f"stage {clock.stage}: from step {step}, {args.batch_slots} x {seq_len} tokens a step"
                + (f" (documents clipped to {doc_len})" if doc_len else "")
                + f", long window {trainer.window} x {args.window_unit} tokens")
            t0 = time.perf_counter()
        batch = stream.next_batch(rank, world_size, seq_len, doc_len)
        if stream.unchecked:  # a new shard's token ids: our check, not the record's, so off the clock
            pause_clock()
            stream.check_shard()
            t0 = time.perf_counter()
        loss = trainer.train_step(step, batch)
        clock.count_step(args.batch_slots * seq_len)
        if step == trainer.untie_step:
            log(f"embedding untied from the lm_head after step {step}: a copy of its weights and Adam state from here on")
        elapsed_ms = clock.training_ms + 1000 * (time.perf_counter() - t0)
        if clock.timed_steps == 1:
            clock.first_step_ms, clock.first_step_tokens = elapsed_ms, args.batch_slots * seq_len
        timing = f"train_time:{elapsed_ms:.0f}ms step_avg:{elapsed_ms / clock.timed_steps:.2f}ms"
        if args.train_loss_every and (step + 1) % args.train_loss_every == 0:
            trainer.stop_if_nonfinite()
            train_losses[step + 1] = loss.item()
            log(f"step:{step + 1}/{args.num_iterations} train_loss:{train_losses[step + 1]:.4f} {timing}")
        else:
            log(f"step:{step + 1}/{args.num_iterations} {timing}")
        if args.checkpoint_every and (step + 1) % args.checkpoint_every == 0 and step + 1 < args.num_iterations:
            pause_clock()
            save(step + 1, periodic=True)
            t0 = time.perf_counter()
        signum = stop.agreed()
        if signum and adam_steps_at(step):  # else Adam's summed gradients would be lost: the next step
            pause_clock()
            raise support.stopped_after(signum, step + 1, save, checkpoints, run_id, argv, world_size, log)
    if args.save_checkpoint:
        save(args.num_iterations)
    return val_losses, train_losses, checkpoints


# ------------------------------------------------------------------------------------------------
# Main


def main(argv: list[str] | None = None) -> dict:
    """Train; returns the losses (tests use it). Raises ConfigError / DataError on bad input, Preempted on a stop
    signal, and Diverged, once the run has written everything, when it ended worse than it started."""
    sources = support.logged_sources([Path(__file__), Path(support.__file__)])  # every run logs its exact code
    argv = sys.argv[1:] if argv is None else argv
    allocator = configure_cuda_allocator()  # before anything touches CUDA
    rank, world_size, device = setup_distributed()
    settle_vector_math()  # before any matmul on the CPU; the rotary tables are made there on every device
    args, preset = parse_args(argv, "record" if device.type == "cuda" else "cpu")
    check_hyperparameters(args, world_size)
    plan = plan_device(args, device, allocator)
    args = dataclasses.replace(args, dtype=plan.dtype)  # logs and checkpoints name the dtype that ran
    if world_size > 1:
        check_ranks_agree(plan, world_size)
    # Data problems surface before anything is written.
    stream = TokenStream(args.train_files, max(args.seq_len), args.batch_slots, device, args.vocab_size,
                         plan.pinned_memory, min(args.packed_doc_len))
    val_sequences = validation_sequences(args.val_files, args.val_tokens, args.val_seq_len, args.vocab_size)
    prefixes = prefix_table(support.gpt2_ranks(), next_multiple(args.vocab_size, 128))  # the GPT-2 ranks' file too
    if plan.pinned_memory:
        val_sequences = val_sequences.pin_memory()
    run_id = args.run_id or str(uuid.uuid4())
    # Every path the run will write or read is checked before the log exists and before training.
    resume_from = support.latest_checkpoint(args.checkpoint_dir, args.run_id) if args.resume == "latest" else Path(args.resume)
    checkpoint = support.read_checkpoint(resume_from) if args.resume else None
    if checkpoint is not None:
        support.check_resumable(checkpoint, resume_from, args, RESUMABLE_CHANGES)
        with torch.device("meta"):  # the shapes alone: a checkpoint of an earlier train_gpt.py is refused here
            check_weights_fit(resume_from, checkpoint["model"], build_model(args, training_seq_len(args), plan, world_size))
        stream.load_state_dict(checkpoint["data"])  # reads and checks the shard it resumes in
    log_path, continues = support.log_path_for(Path(args.log_dir), run_id, resuming=checkpoint is not None)
    log, folder = support.claim_run_files(rank, world_size, log_path, Path(args.checkpoint_dir) / run_id, run_id,
                                          resume_from if checkpoint is not None else None)
    stop = support.StopSignals(world_size)
    try:
        log.header(sources, args, preset, device, world_size, plan.lines)
        if folder is not None:
            log(f"checkpoints: {folder.path}, held by this launch ({folder.launch}) while it runs", console=False)
        peak = support.matmul_peak(device, DTYPES[plan.dtype])
        log(f"matmul peak for MFU: {peak[1]}", console=False)
        trainer = Trainer(args, rank, world_size, plan, prefixes)
        for line in support.describe_run(trainer):
            log(line, console=False)
        start_step, clock = 0, support.TrainingClock()
        if checkpoint is not None:
            start_step, saved_clock = restore_checkpoint(checkpoint, trainer)
            # This process compiles again, later; the log names the stage it resumes in.
            clock = support.TrainingClock(**{**saved_clock, "first_step_ms": 0.0, "stage": ""})
            del checkpoint
            log(f"resumed from {resume_from} at step {start_step}" + (f"; continues the log {continues}" if continues else ""))
        if args.warmup_steps:
            t0 = time.perf_counter()
            trainer.warm_up(start_step)
            log(f"warm-up: {args.warmup_steps} steps on random tokens in {time.perf_counter() - t0:.1f}s; state restored")
        val_losses, train_losses, checkpoints = training_loop(trainer, stream, val_sequences, log, folder, run_id,
                                                              start_step, clock, stop, argv,
                                                              [resume_from] if args.resume else [])
        val_entropy = support.unigram_entropy(val_sequences, args.vocab_size)
        diverged = support.divergence(val_losses, trainer.model.lm_head.out_features)
        support.final_report(log, trainer, clock, val_losses, val_entropy, checkpoints, peak, diverged)
        if diverged is not None:  # after everything is written: the log, the final checkpoint
            raise diverged
        return dict(val_losses=val_losses, train_losses=train_losses, unigram_entropy=val_entropy,
                    log_path=log.path, checkpoints=checkpoints, run_id=run_id)
    finally:
        stop.close()
        log.close()
        if folder is not None:
            folder.release()


if __name__ == "__main__":
    if any(arg in ("-h", "--help") for arg in sys.argv[1:]):
        print(support.usage(__doc__, Hyperparameters, PRESETS))
        sys.exit(0)
    try:
        main()
    except (ConfigError, DataError, support.WriteError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except FloatingPointError as e:  # a non-finite loss: the run diverged
        print(f"error: {e}", file=sys.stderr)
        sys.exit(support.Diverged.exit_code)
    except (support.Preempted, support.Diverged) as e:  # every rank exits so; rank 0 says why
        if int(os.environ.get("RANK", 0)) == 0:
            print(e, file=sys.stderr)
        sys.exit(e.exit_code)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
