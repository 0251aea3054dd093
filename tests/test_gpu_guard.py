"""A machine with NVIDIA GPUs that the installed torch cannot use (a driver older than its CUDA, or a
CPU build) never trains on the CPU without a word: run.sh, train_gpt.py (alone and under torchrun)
and tools/gpu_check.py stop with one line, unless TRAIN_GPT_ALLOW_CPU=1 asks for the CPU. The GPUs
are faked by an nvidia-smi on PATH, which is all these entry points look at besides torch."""

import os
import subprocess
import sys

import pytest
import torch
from conftest import ROOT, TINY_RUN

import run_support as support

FAKE_NVIDIA_SMI = """#!/bin/sh
case "$1" in
  -L) for i in 0 1 2 3 4 5 6 7; do echo "GPU $i: NVIDIA H100 80GB HBM3 (UUID: GPU-1234567$i)"; done ;;
  --query-gpu=name,driver_version) for i in 0 1 2 3 4 5 6 7; do echo "NVIDIA H100 80GB HBM3, DRIVER"; done ;;
  *) echo "NVIDIA-SMI DRIVER" ;;
esac
"""
BROKEN_NVIDIA_SMI = """#!/bin/sh
echo "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. Make sure that the latest NVIDIA driver is installed and running."
exit 9
"""
EXPECTED = (f"8 NVIDIA GPU(s) (NVIDIA H100 80GB HBM3) with driver 570.124.06, but torch {torch.__version__} "
            f"({'built for CUDA ' + torch.version.cuda if torch.version.cuda else 'a CPU-only build'}) cannot use them")

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="torch can use this machine's GPUs")


def fake_nvidia_smi(folder, script: str) -> dict:
    """The environment of a machine whose nvidia-smi is script, without the opt-out."""
    folder.mkdir(exist_ok=True)
    (folder / "nvidia-smi").write_text(script)
    (folder / "nvidia-smi").chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in (support.CPU_ON_GPU_MACHINE, "CUDA_VISIBLE_DEVICES")}
    return dict(env, PATH=f"{folder}:{env['PATH']}", OMP_NUM_THREADS="1")


@pytest.fixture
def gpu_machine(tmp_path):
    """The environment of a machine whose nvidia-smi lists eight H100s on driver 570.124.06."""
    return fake_nvidia_smi(tmp_path / "bin", FAKE_NVIDIA_SMI.replace("DRIVER", "570.124.06"))


def one_line(proc, prefix: str) -> str:
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert lines[0].startswith(prefix + EXPECTED), lines[0]
    assert f"-m pip install torch=={torch.__version__.split('+')[0]} --index-url {support.CUDA_WHEEL_INDEX}" in lines[0]
    return lines[0]


def test_the_message_names_the_gpus_the_driver_and_what_to_do(gpu_machine, monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", gpu_machine["PATH"])
    assert support.unusable_gpus_message({}).startswith(EXPECTED)
    assert support.unusable_gpus_message({support.CPU_ON_GPU_MACHINE: "1"}) is None
    assert support.unusable_gpus_message({"CUDA_VISIBLE_DEVICES": ""}) is None  # the GPUs hidden on purpose
    # a driver too old for any CUDA 12 build: update it, no torch would do
    monkeypatch.setenv("PATH", fake_nvidia_smi(tmp_path / "old", FAKE_NVIDIA_SMI.replace("DRIVER", "470.256.02"))["PATH"])
    old = support.unusable_gpus_message({})
    assert "with driver 470.256.02, but torch" in old and "update the NVIDIA driver to the R525 series or newer" in old
    assert "pip install" not in old
    # a driver that does not work: nvidia-smi's own complaint, and no advice to reinstall torch
    monkeypatch.setenv("PATH", fake_nvidia_smi(tmp_path / "broken", BROKEN_NVIDIA_SMI)["PATH"])
    proc = tmp_path / "proc_broken"
    (proc / "gpus" / "0000:18:00.0").mkdir(parents=True)
    assert support.unusable_gpus_message({}, proc) == (
        "1 NVIDIA GPU(s) (PCI 0000:18:00.0) with driver unknown, but nvidia-smi fails (NVIDIA-SMI has failed because it "
        "couldn't communicate with the NVIDIA driver. Make sure that the latest NVIDIA driver is installed and running.): "
        "the driver does not work; repair it, or set TRAIN_GPT_ALLOW_CPU=1 to train on the CPU")
    # without nvidia-smi, the driver's /proc entries say the same
    monkeypatch.setenv("PATH", "/nonexistent")
    proc = tmp_path / "nvidia"
    (proc / "gpus" / "0000:18:00.0").mkdir(parents=True)
    (proc / "gpus" / "0000:2a:00.0").mkdir()
    (proc / "version").write_text("NVRM version: NVIDIA UNIX x86_64 Kernel Module  570.124.06  Wed Feb 26 2025\n")
    assert support.unusable_gpus_message({}, proc).startswith(
        "2 NVIDIA GPU(s) (PCI 0000:18:00.0) with driver 570.124.06, but torch")
    assert support.unusable_gpus_message({}, tmp_path / "absent") is None  # no GPUs: nothing to say


def test_train_gpt_refuses_before_anything_and_runs_when_asked(gpu_machine, tiny_shards, tmp_path):
    command = [sys.executable, str(ROOT / "train_gpt.py"), *TINY_RUN, *tiny_shards, "--num_iterations=1",
               f"--log_dir={tmp_path / 'logs'}"]
    refused = subprocess.run(command, cwd=tmp_path, env=gpu_machine, capture_output=True, text=True, timeout=300)
    assert refused.returncode == 2 and refused.stdout == ""
    one_line(refused, "error: ")
    assert not (tmp_path / "logs").exists()
    allowed = subprocess.run(command, cwd=tmp_path, env=dict(gpu_machine, **{support.CPU_ON_GPU_MACHINE: "1"}),
                             capture_output=True, text=True, timeout=300)
    assert allowed.returncode == 0, allowed.stderr[-3000:]
    assert "step:1/1 val_loss:" in allowed.stdout


def test_every_rank_under_torchrun_refuses(gpu_machine, tiny_shards, tmp_path):
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               str(ROOT / "train_gpt.py"), *TINY_RUN, *tiny_shards, f"--log_dir={tmp_path / 'logs'}"]
    proc = subprocess.run(command, cwd=tmp_path, env=gpu_machine, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert (proc.stdout + proc.stderr).count("error: " + EXPECTED) == 2  # one line from each rank
    assert "step:" not in proc.stdout and not (tmp_path / "logs").exists()


def test_gpu_check_fails_the_environment_check(gpu_machine):
    command = [sys.executable, str(ROOT / "tools" / "gpu_check.py")]
    proc = subprocess.run(command, cwd=ROOT, env=gpu_machine, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 1
    environment = next(line for line in proc.stdout.splitlines() if line.startswith("environment"))
    assert environment.split()[1] == "FAIL" and EXPECTED in environment
    lines = proc.stdout.splitlines()
    rows = lines[next(i for i, line in enumerate(lines) if line.startswith("check")) + 1:-1]
    assert [row[17:22].strip() for row in rows].count("SKIP") == len(rows) - 1 >= 6  # the rest would test the CPU
    assert lines[-1] == f"0 passed, 1 failed, {len(rows) - 1} skipped"


def test_run_sh_refuses_and_goes_on_when_asked(gpu_machine):
    refused = subprocess.run(["bash", str(ROOT / "run.sh"), "--help"], cwd=ROOT, env=gpu_machine,
                             capture_output=True, text=True, timeout=300)
    assert refused.returncode == 1 and "usage" not in refused.stdout.lower()
    one_line(refused, "run.sh: ")
    allowed = subprocess.run(["bash", str(ROOT / "run.sh"), "--help"], cwd=ROOT, timeout=600,
                             env=dict(gpu_machine, **{support.CPU_ON_GPU_MACHINE: "1"}), capture_output=True, text=True)
    assert allowed.returncode == 0, allowed.stderr[-3000:]
    assert "hyperparameters (record defaults):" in allowed.stdout  # train_gpt.py --help ran
