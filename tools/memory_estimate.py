"""Estimate the training memory of a preset's model per GPU from what it saves for backward.

    python tools/memory_estimate.py                          # the record model at each batch stage's seq_len
    python tools/memory_estimate.py --seq_lens 32768 8192

Runs the training forward on fake tensors (torch's FakeTensorMode: shapes and dtypes, no arithmetic), with
bf16 activations and the FP8 lm_head and MLPs as on an H100, at two sequence lengths, and counts the bytes
autograd saves (parameters excluded); the difference gives the bytes per token, the rest the weight copies
cast to bf16. Add parameters, gradients and optimizer states, and the gradient of the logits that backward
makes: float32, then its e5m2 copy. An estimate: on GPU, torch.compile recomputes cheap operations instead
of saving them, FlexAttention saves no mask (here the CPU's dense ones), and the allocator's caching and
fragmentation come on top.
"""

import argparse
import copy
import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from torch._subclasses.fake_tensor import FakeCopyMode, FakeTensorMode

import train_gpt

GIB = 2**30


def storage_id(t: torch.Tensor) -> int:
    """The address of t's storage object, which its views share: a fake tensor's storage has no data pointer."""
    return t.untyped_storage()._cdata


def saved_bytes(model: train_gpt.GPT, window: int, T: int) -> tuple[int, int]:
    """Bytes saved for backward by (the trunk, the logits and loss) for one sequence of T tokens, with a long window
    of window units (one of the model's; the dense masks' size does not depend on it). Under a FakeTensorMode for a
    fake model (fake_copy), nothing is computed."""
    parameters = {storage_id(p) for p in model.parameters()}
    storages = {}

    def pack(t):
        if storage_id(t) not in parameters:
            storages[storage_id(t)] = t.untyped_storage().nbytes()
        return t

    tokens = torch.randint(0, min(train_gpt.EOT_TOKEN, model.lm_head.weight.size(0)), (T + 1,))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        x = model.trunk(tokens[:-1], window)
        trunk = sum(storages.values())
        # training's loss: its sigmoids in bf16, log-sum-exps and, with the FP8 lm_head, the matmul's e4m3 operands saved
        train_gpt.SoftcappedLoss.apply(train_gpt.norm(x).view(T, -1), model.lm_head.weight, tokens[1:], torch.ones(1),
                                       model.logit_cap, model.logit_offset, model.fp8_scales).sum()
    return trunk, sum(storages.values()) - trunk


def fake_copy(model: train_gpt.GPT) -> tuple[train_gpt.GPT, FakeTensorMode]:
    """model with fake parameters and buffers, and the mode to run it under: a CPU would take hours over the record
    model's FP8 products (oneDNN's reference kernel)."""
    mode = FakeTensorMode()
    with FakeCopyMode(mode):
        return copy.deepcopy(model), mode


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="record", choices=list(train_gpt.PRESETS))
    parser.add_argument("--seq_lens", type=int, nargs="+", help="tokens per GPU (default: the preset's stages)")
    args = parser.parse_args(argv)
    hp = train_gpt.Hyperparameters(**train_gpt.PRESETS[args.preset])
    torch.manual_seed(0)
    plan = train_gpt.plan_device(dataclasses.replace(hp, dtype="bfloat16"), torch.device("cpu"))  # bf16 embeddings
    model = train_gpt.build_model(hp, 384, dataclasses.replace(plan, fp8=True))  # in training mode, as on an H100
    fake, mode = fake_copy(model)
    with mode:
        short, long = (saved_bytes(fake, hp.final_window, T) for T in (128, 384))
    per_token = [(b - a) / (384 - 128) for a, b in zip(short, long)]
    casts = sum(short) - 128 * sum(per_token)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    adam, muon = train_gpt.build_optimizers(model, hp, plan=plan)
    # float32 momentum; a bf16 matrix's low half (uint16)
    muon_bytes = sum((4 + 2 * (p.dtype == torch.bfloat16)) * p.numel() for group in muon.param_groups for p in group["params"])
    adam_state_bytes = sum(8 * p.numel() for group in adam.param_groups for p in group["params"])  # 2 float32 moments
    fixed = 2 * weights + adam_state_bytes + muon_bytes + casts
    logit_grad = 5 * model.lm_head.weight.size(0)  # one position's logits' gradient: float32, then e5m2
    print(f"{args.preset} model, {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters: saved for backward "
          f"per token {per_token[0] / 1024:.0f} KiB in the blocks + {per_token[1] / 1024:.0f} KiB for the logits "
          f"({per_token[1] / model.lm_head.weight.size(0):.1f} bytes each); {fixed / GIB:.1f} GiB of weights, gradients, "
          f"optimizer states and bf16 weight copies")
    table = model.bigram_embed.weight  # the largest parameter: its bf16 weight and gradient, Adam's float32 moments
    print(f"  of which the bigram table ({table.size(0)} x {table.size(1)}, {table.numel() / 1e6:.0f}M parameters): "
          f"{(2 * table.numel() * table.element_size() + 8 * table.numel()) / GIB:.2f} GiB")
    for seq_len in args.seq_lens or sorted(hp.seq_len, reverse=True):
        total = fixed + seq_len * (sum(per_token) + logit_grad)
        print(f"  seq_len {seq_len:6d}: about {total / GIB:5.1f} GiB per GPU in eager mode")
    return 0


if __name__ == "__main__":
    sys.exit(main())
