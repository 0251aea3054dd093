"""tools/gpu_check.py: its CPU path for real (the GPU checks say SKIP here), and that its checks can fail."""

import dataclasses
import subprocess
import sys

import pytest
import torch
from conftest import ROOT, needs_flex_on_cpu
from torch._inductor.kernel.flex.flex_cpu import check_cpu_supported

sys.path.insert(0, str(ROOT / "tools"))
import gpu_check  # noqa: E402

import train_gpt  # noqa: E402


def test_on_cpu_it_runs_the_cpu_checks_and_skips_the_gpu_ones():
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "gpu_check.py")], capture_output=True, text=True,
                          timeout=300, cwd=ROOT)
    rows = {line.split()[0] + (" " + line.split()[1] if line.split()[1] not in ("PASS", "FAIL", "SKIP") else ""):
            line for line in proc.stdout.splitlines()[2:-1]}
    status = {name: line.split()[len(name.split())] for name, line in rows.items()}
    flex = "PASS" if check_cpu_supported() else "SKIP"  # its compiled CPU kernel needs AVX2 and a vectorized ATen
    assert status == {"environment": "PASS", "fp8 matmul": "PASS", "flex forward": flex, "flex backward": "SKIP",
                      "training steps": "SKIP", "all-reduce": "PASS"}, proc.stdout + proc.stderr
    assert "no backward on cpu" in rows["flex backward"] and "needs CUDA" in rows["training steps"]
    assert "gloo, 2 processes" in rows["all-reduce"] and "max difference 0.0e+00" in rows["all-reduce"]
    assert proc.stdout.splitlines()[0] == ("The record preset computes what the 2025-09-10 record (Yarn) "
                                          "computes: val 3.2785 at step 1670 after 159.3 s of training on 8xH100 in its "
                                          "published log, unmeasured by us.")
    if flex == "PASS":
        assert "windows of 128, 129, 334, 384 tokens at scales 0.1000" in rows["flex forward"]
    else:
        assert "needs AVX2 and ATEN_CPU_CAPABILITY other than default" in rows["flex forward"]
    assert proc.stdout.splitlines()[-1] == ("4 passed, 0 failed, 2 skipped" if flex == "PASS" else
                                           "3 passed, 0 failed, 3 skipped")
    assert proc.returncode == 0


def test_training_check_runs_the_real_trainer_on_cpu():
    """The training check's code path, uncompiled and tiny: the loss falls on a repeated batch."""
    args = dataclasses.replace(train_gpt.Hyperparameters(**train_gpt.PRESETS["cpu"]), num_layers=2, model_dim=64,
                               num_heads=1, head_dim=64, seq_len=128, batch_slots=2, num_iterations=20, compile=False)
    summary = gpu_check.check_training(torch.device("cpu"), args, steps=4, warmup=2)
    assert summary.startswith("2 layers x 64, 2 x 128 tokens: loss 10.83 -> ")
    assert "tokens/s" in summary and "TFLOP/s" in summary


def test_a_wrong_fp8_result_fails(monkeypatch):
    real = train_gpt.fp8_mm
    monkeypatch.setattr(train_gpt, "fp8_mm", lambda x, w, *scales: (real(x, w, *scales)[0] * 1.2,))
    with pytest.raises(AssertionError, match=r"relative error out 0\.2"):
        gpu_check.check_fp8(torch.device("cpu"), 64, 64, 256)


@needs_flex_on_cpu
def test_a_wrong_flex_result_fails(monkeypatch):
    """FlexAttention against a dense mask whose window holds one key more per query."""
    real = train_gpt.attention_mask
    monkeypatch.setattr(train_gpt, "attention_mask", lambda tokens, window, backend, *rest:
                        real(tokens, window + 1 if backend == "sdpa" else window, backend, *rest))
    with pytest.raises(AssertionError, match="relative error"):
        gpu_check.check_flex(torch.device("cpu"), 256, backward=False, heads=1, head_dim=32, stages=1)


def test_the_environment_row_passes_on_every_tested_torch_and_fails_on_another(monkeypatch):
    """A rented GPU machine brings its own torch: a release the suite has passed on is named with the pin beside
    it, any other release fails the row with the warning a run would log."""
    for release in train_gpt.support.TESTED_TORCH:
        monkeypatch.setattr(torch, "__version__", f"{release}+cu130")
        assert gpu_check.check_environment(torch.device("cpu")) == (
            f"torch {release}+cu130 (requirements.txt pins 2.13.0; tested on 2.11.0, 2.13.0); no CUDA")
    monkeypatch.setattr(torch, "__version__", "2.12.0+cu130")
    with pytest.raises(AssertionError, match=r"^torch 2\.12\.0\+cu130 is not a release this project is tested on "
                                             r"\(2\.11\.0, 2\.13\.0\); .* ./run.sh test --torch=2\.12\.0 runs the suite on it$"):
        gpu_check.check_environment(torch.device("cpu"))
