"""The device plan: every device-dependent choice made once, by plan_device(), and the model built from
it with nothing set afterwards. CUDA is faked where the API allows: only the capability query."""

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import ROOT
from test_train_loop import run

import train_gpt

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def test_cpu_plan_runs_the_same_masks_densely_and_repeats_to_the_bit():
    args = train_gpt.Hyperparameters(**train_gpt.PRESETS["cpu"])
    plan = train_gpt.plan_device(args, CPU)
    assert (plan.attention, plan.fp8, plan.compile_optimizers, plan.pinned_memory) == ("sdpa", False, False, False)
    assert plan.deterministic and plan.compile == train_gpt.cpp_compiler_found()
    assert plan.dtype == train_gpt.auto_dtype(CPU)[0]
    assert "fp8 lm_head and MLPs: off (needs CUDA compute capability >= 8.9; this device is cpu)" in plan.lines
    model = train_gpt.build_model(args, 1024, plan)  # args.dtype is still auto: the plan's dtype is the one used
    assert model.attention_backend == "sdpa" and model.fp8_scales is None
    run_dtype = train_gpt.DTYPES[plan.dtype]
    assert model.embed.weight.dtype == model.value_embeds.dtype == model.rotary.cos.dtype == run_dtype


def test_cuda_plan_is_the_record_and_the_model_is_built_from_it(monkeypatch):
    """With FP8 available, the record preset gets FlexAttention, the FP8 lm_head, compiled optimizers, pinned memory
    and the record's kernels; the model built from the plan holds each choice."""
    monkeypatch.setattr(train_gpt, "fp8_supported", lambda device: (True, "compute capability 9.0"))
    args = train_gpt.Hyperparameters()
    plan = train_gpt.plan_device(args, CUDA, "PYTORCH_ALLOC_CONF=expandable_segments:True")
    assert (plan.attention, plan.fp8, plan.compile, plan.compile_optimizers) == ("flex", True, True, True)
    assert plan.dtype == "bfloat16" and plan.pinned_memory and not plan.deterministic
    for line in ("attention: FlexAttention with block-sparse masks, compiled with the model",
                 "fp8 lm_head and MLPs: on (compute capability 9.0)",
                 "deterministic algorithms: off (CUDA: the record's kernels)",
                 "optimizers: Muon (Polar Express) and Adam, compiled",
                 "dtype: bfloat16", "CUDA allocator: PYTORCH_ALLOC_CONF=expandable_segments:True"):
        assert line in plan.lines, line
    eager = train_gpt.plan_device(dataclasses.replace(args, compile=False), CUDA, "x")
    assert eager.attention == "flex" and not eager.compile
    assert ("attention: FlexAttention with block-sparse masks, its kernel compiled alone (compile=false keeps "
            "the rest eager)") in eager.lines
    small = dataclasses.replace(args, model_dim=64, num_heads=2, head_dim=32, vocab_size=1000)
    model = train_gpt.build_model(small, 256, plan)  # built on the CPU, as the Trainer builds it before moving it
    # the record's grad_s = grad_scale x 0.75 / 448, grad_scale 1 / (8 micro-steps) on one process
    assert model.attention_backend == "flex" and model.fp8_scales == (100 / 448, 1.6 / 448, 1 / 8 * 0.75 / 448)
    assert model.embed.weight.dtype == model.lm_head.weight.dtype == torch.bfloat16  # the record's bf16 head
    assert {p.dtype for block in model.blocks for p in block.mlp.parameters()} == {torch.bfloat16}  # and matrices
    adam, muon = train_gpt.build_optimizers(model, small, plan=plan)
    assert muon.orthogonalize is train_gpt.compiled_on_first_use(train_gpt.orthogonalize)
    assert adam.update is train_gpt.compiled_on_first_use(train_gpt.adam_update)
    assert muon.dtype == torch.bfloat16
    without_fp8 = train_gpt.plan_device(dataclasses.replace(args, fp8=False), CUDA, "x")
    assert not without_fp8.fp8 and "fp8 lm_head and MLPs: off (--fp8=false)" in without_fp8.lines


def test_compile_without_a_cpp_compiler_runs_eager_and_says_why():
    from torch._inductor import config as inductor_config
    args = train_gpt.Hyperparameters(compile=True)
    with inductor_config.patch({"cpp.cxx": (None, "/nonexistent/c++")}):  # what $CXX sets at import
        assert not train_gpt.cpp_compiler_found()
        plan = train_gpt.plan_device(args, CPU)
    assert not plan.compile
    assert "compile: off (no C++ compiler for inductor's CPU kernels: install g++ or clang++, or set CXX)" in plan.lines
    assert train_gpt.plan_device(args, CPU).compile  # this machine has one


@pytest.mark.parametrize("flags, expected", [
    ("fpu avx2 avx512f avx512_bf16 avx512_vnni", ("bfloat16", "the CPU has avx512_bf16")),
    ("fpu avx2 amx_tile amx_bf16 amx_int8", ("bfloat16", "the CPU has amx_bf16")),
    ("fpu avx2 avx512f avx512bw", ("float32", "the CPU has none of avx512_bf16, amx_bf16: bf16 matmuls would "
                                              "be emulated")),
])
def test_dtype_auto_follows_the_cpu_flags(tmp_path, flags, expected):
    """bfloat16 where the CPU multiplies it natively (AVX512-BF16, AMX), float32 where it would be emulated;
    every core's flags line is read, as /proc/cpuinfo lists them."""
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("".join(f"processor\t: {i}\nmodel name\t: Some CPU\nflags\t\t: {flags}\n\n" for i in range(2)))
    assert train_gpt.auto_dtype(CPU, cpuinfo) == expected
    assert train_gpt.auto_dtype(CPU, tmp_path / "absent")[0] == "float32"
    assert train_gpt.auto_dtype(CUDA, cpuinfo) == ("bfloat16", "CUDA")


def test_explicit_dtypes_stay_and_auto_resolves():
    for dtype in train_gpt.DTYPES:
        assert train_gpt.plan_device(train_gpt.Hyperparameters(dtype=dtype), CPU).dtype == dtype
    plan = train_gpt.plan_device(train_gpt.Hyperparameters(dtype="auto"), CPU)
    dtype, why = train_gpt.auto_dtype(CPU)
    assert plan.dtype == dtype and f"dtype: {dtype} (auto: {why})" in plan.lines


def test_run_sh_decides_dtype_auto_by_the_same_rule():
    """./run.sh turns huge pages on for bfloat16 runs before torch starts, so it asks auto_dtype() too:
    the one place the rule is written."""
    script = (ROOT / "run.sh").read_text()
    assert "auto_dtype(" in script and "avx512_bf16" not in script
    out = subprocess.run(["bash", "-c", 'source <(sed -n "/^deps_ok()/,/^}/p" run.sh) && deps_ok "$0"', sys.executable],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    gpus, dtype = out.stdout.split()
    assert int(gpus) == torch.cuda.device_count() and dtype == train_gpt.auto_dtype(CPU)[0], out.stderr


def test_the_run_logs_the_dtype_it_resolved(tiny_shards, tmp_path):
    """With dtype=auto, the hyperparameters logged (and saved in checkpoints) name the dtype that ran."""
    result = run(tiny_shards, tmp_path, "--num_iterations=1", "--dtype=auto")
    text = Path(result["log_path"]).read_text()
    dtype, why = train_gpt.auto_dtype(CPU)
    assert f"\n  dtype: '{dtype}'\n" in text and f"\n  dtype: {dtype} (auto: {why})\n" in text


@pytest.mark.parametrize("name, value", [("dtype", "fp16")])
def test_each_choice_is_checked_in_one_place_naming_the_valid_values(name, value):
    args, _ = train_gpt.parse_args([f"--{name}={value}"], "cpu")
    valid = train_gpt.CHOICES[name]
    with pytest.raises(train_gpt.ConfigError) as error:
        train_gpt.check_hyperparameters(args, 1)
    assert str(error.value) == f"{name}={value!r}; choose one of {', '.join(valid)}"
    for good in valid:  # and every listed value passes
        train_gpt.check_hyperparameters(dataclasses.replace(args, **{name: good}), 1)


def test_cuda_setup_runs_the_records_start_up_backward(monkeypatch):
    """On CUDA, setup_distributed() selects the rank's GPU and runs the record's one-element backward
    ("prevents a bug on some systems") before anything else touches autograd: CUDA's calls are faked."""
    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: calls.append(("set_device", str(device))))
    empty = torch.empty

    def recorded_empty(*args, device=None, **kwargs):
        calls.append(("empty", device, kwargs.get("requires_grad")))
        return empty(*args, **kwargs)

    monkeypatch.setattr(torch, "empty", recorded_empty)
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert train_gpt.setup_distributed() == (0, 1, torch.device("cuda", 3))
    assert calls == [("set_device", "cuda:3"), ("empty", "cuda", True)]
