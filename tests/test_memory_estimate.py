import dataclasses
import sys

import pytest
import torch
from conftest import ROOT, TINY_RUN

sys.path.insert(0, str(ROOT / "tools"))
import memory_estimate  # noqa: E402

import train_gpt  # noqa: E402


@pytest.mark.parametrize("fp8", [False, True])
def test_fake_tensors_save_the_bytes_a_real_forward_saves(fp8):
    """saved_bytes on a fake copy of a tiny bf16 model in training mode (FP8 lm_head and MLPs: the record's on an H100;
    on CPU their products are computed too) counts, at two lengths, exactly the bytes the real forward saves for
    backward, trunk and loss apart: the tool's figures come from shapes and dtypes alone."""
    torch.manual_seed(0)
    args = dataclasses.replace(train_gpt.parse_args(TINY_RUN, "cpu")[0], dtype="bfloat16")
    plan = dataclasses.replace(train_gpt.plan_device(args, torch.device("cpu")), fp8=fp8)
    model = train_gpt.build_model(args, 384, plan)
    assert all(block.mlp.fp8 == fp8 for block in model.blocks) and (model.fp8_scales is not None) == fp8
    fake, mode = memory_estimate.fake_copy(model)
    for T in (128, 384):
        real = memory_estimate.saved_bytes(model, args.final_window, T)
        with mode:
            assert memory_estimate.saved_bytes(fake, args.final_window, T) == real
        assert min(real) > 0


def test_the_tool_prints_each_stage(capsys):
    assert memory_estimate.main(["--preset=cpu"]) == 0
    lines = capsys.readouterr().out.splitlines()
    hp = train_gpt.Hyperparameters(**train_gpt.PRESETS["cpu"])
    assert lines[0].startswith("cpu model, ") and "saved for backward per token" in lines[0]
    assert [int(line.split()[1].rstrip(":")) for line in lines[2:]] == sorted(hp.seq_len, reverse=True)
