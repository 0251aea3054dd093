"""run_support.py, the companion train_gpt.py imports and logs: what it may import, the sources a log
begins with, and the report lines about memory."""

import ast
import os
import subprocess
import sys
import types

import pytest
import torch
from conftest import ROOT

import run_support as support

COMPANION = ROOT / "run_support.py"


def test_the_companion_imports_neither_train_gpt_nor_torch_nn():
    """It holds no line that can change what a run computes: no model code, nothing from train_gpt."""
    imported = set()
    for node in ast.walk(ast.parse(COMPANION.read_text())):
        if isinstance(node, ast.Import):
            imported |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            imported.add(node.module)
    assert "torch" in imported
    assert not [name for name in imported if name == "train_gpt" or name.startswith(("torch.nn", "torch.optim"))]
    probe = "import sys, run_support; print('train_gpt' in sys.modules)"  # nor does importing it load train_gpt
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stderr


def test_logged_sources_begin_with_the_first_file_exactly_and_name_the_others(tmp_path):
    first, second = tmp_path / "a.py", tmp_path / "b.py"
    first.write_text("x = 1\n\n# ----\n")
    second.write_text("y = 2")  # no final newline: one is added
    text = support.logged_sources([first, second])
    assert text == f"x = 1\n\n# ----\n\n{'-' * 40}\n# b.py\n{'-' * 40}\n\ny = 2\n"
    assert support.logged_sources([first]) == first.read_text()


def test_huge_pages_line_names_the_setting_the_kernel_mode_and_a_dtype_that_gains_nothing(tmp_path):
    mode = tmp_path / "enabled"
    mode.write_text("always [madvise] never\n")
    on = {"THP_MEM_ALLOC_ENABLE": "1"}
    assert (support.huge_pages_line("bfloat16", on, mode)
            == "huge pages: on for tensors of 2 MB or more (THP_MEM_ALLOC_ENABLE=1; kernel mode madvise)")
    assert (support.huge_pages_line("float32", on, mode)
            == "huge pages: on for tensors of 2 MB or more (THP_MEM_ALLOC_ENABLE=1; kernel mode madvise), "
               "though float32 ran slower with them")
    assert (support.huge_pages_line("bfloat16", {}, mode) == "huge pages: off (THP_MEM_ALLOC_ENABLE=1 not set: "
            "./run.sh sets THP_MEM_ALLOC_ENABLE=1 for bfloat16 runs; kernel mode madvise)")
    assert support.huge_pages_line("float32", {}, mode).startswith("huge pages: off (float32: ./run.sh sets")
    mode.write_text("always madvise [never]\n")
    assert (support.huge_pages_line("bfloat16", on, mode)
            == "huge pages: off (the kernel's transparent huge pages are set to never)")
    mode.write_text("[always] madvise never\n")  # the kernel gives them unasked
    assert (support.huge_pages_line("float32", {}, mode)
            == "huge pages: on (the kernel's transparent huge pages are set to always)")
    assert support.huge_pages_line("bfloat16", on, tmp_path / "absent").endswith("; kernel mode unknown)")


HUGE_PAGE_PROBE = ("import sys, torch\nsys.path.insert(0, sys.argv[1])\nimport run_support\n"
                   "before = run_support.huge_page_kib()\nx = torch.ones(2**25)\nprint(run_support.huge_page_kib() - before)")


@pytest.mark.skipif(not support.THP_MODE_FILE.exists() or "[never]" in support.THP_MODE_FILE.read_text()
                    or support.huge_page_kib() is None,
                    reason="this kernel has no transparent huge pages to give, or does not count them")
def test_torch_takes_huge_pages_for_large_tensors_when_asked():
    """THP_MEM_ALLOC_ENABLE=1, the setting ./run.sh makes, is the name this torch's allocator reads: a
    128 MB tensor then lies mostly in 2 MB pages, as smaps reports them; without it (kernel mode
    madvise), in none."""
    def grown_kib(huge_pages: bool) -> int:
        env = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
        if huge_pages:
            env["THP_MEM_ALLOC_ENABLE"] = "1"
        out = subprocess.run([sys.executable, "-c", HUGE_PAGE_PROBE, str(ROOT)], env=env,
                             capture_output=True, text=True, check=True).stdout
        return int(out.split()[-1])

    assert grown_kib(True) >= 64 * 1024
    if "[madvise]" in support.THP_MODE_FILE.read_text():
        assert grown_kib(False) < 2 * 1024


@pytest.mark.parametrize("name, tflops", [
    ("NVIDIA H100 80GB HBM3", 989), ("NVIDIA H100 PCIe", 756), ("NVIDIA H100 NVL", 835), ("NVIDIA H200", 989),
    ("NVIDIA H200 NVL", 835), ("NVIDIA A100-SXM4-80GB", 312), ("NVIDIA A100 80GB PCIe", 312), ("NVIDIA L40S", 362),
    ("NVIDIA L4", 121), ("NVIDIA GeForce RTX 4090", 165)])
def test_mfu_peak_by_device_name(monkeypatch, name, tflops):
    """The datasheet's dense bf16 peak for each known card, the most specific name winning (an H100 PCIe
    is no SXM H100); the device query is faked, the only CUDA call on that path."""
    import torch
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: name)
    assert support.matmul_peak(torch.device("cuda"), torch.bfloat16) == (
        tflops * 1e12, f"{tflops} TFLOP/s bf16 ({name} datasheet)")


def test_unknown_names_slices_and_laptop_parts_have_no_datasheet_peak():
    """Those are timed instead, as on a CPU (the same code path as the CPU's, tested in test_train_loop)."""
    for name in ("NVIDIA RTX A6000", "NVIDIA H100 80GB HBM3 MIG 1g.10gb", "NVIDIA GeForce RTX 4090 Laptop GPU"):
        assert support.datasheet_peak(name) is None, name
    assert support.datasheet_peak("NVIDIA GeForce RTX 4090") == 165e12


def test_resumable_changes_name_hyperparameters_and_only_they_may_differ(tmp_path):
    """RESUMABLE_CHANGES names Hyperparameters fields, each of which alone may differ on resume; no other may."""
    import dataclasses

    import train_gpt
    fields = {f.name for f in dataclasses.fields(train_gpt.Hyperparameters)}
    assert train_gpt.RESUMABLE_CHANGES <= fields
    saved = dataclasses.asdict(train_gpt.Hyperparameters())
    for name in sorted(train_gpt.RESUMABLE_CHANGES):  # each may change alone
        value = saved[name]
        changed = (not value if isinstance(value, bool) else value + ("x" if isinstance(value, str) else
                                                                      (1,) if isinstance(value, tuple) else 1))
        support.check_resumable({"hyperparameters": saved}, tmp_path,
                                dataclasses.replace(train_gpt.Hyperparameters(), **{name: changed}),
                                train_gpt.RESUMABLE_CHANGES)
    with pytest.raises(support.ConfigError, match=r"muon_lr \(checkpoint 0.023, now 0.05\)"):
        support.check_resumable({"hyperparameters": saved}, tmp_path, train_gpt.Hyperparameters(muon_lr=0.05),
                                train_gpt.RESUMABLE_CHANGES)
    del saved["yarn"]  # a checkpoint made before the setting existed
    with pytest.raises(support.ConfigError, match=r"yarn \(now True; the checkpoint predates this setting\)"):
        support.check_resumable({"hyperparameters": saved}, tmp_path, train_gpt.Hyperparameters(), train_gpt.RESUMABLE_CHANGES)
    saved = dict(dataclasses.asdict(train_gpt.Hyperparameters()), bigram_rows=0)  # made while the table was a setting
    with pytest.raises(support.ConfigError, match=r": bigram_rows \(checkpoint 0; no longer a setting\)$"):
        support.check_resumable({"hyperparameters": saved}, tmp_path, train_gpt.Hyperparameters(), train_gpt.RESUMABLE_CHANGES)


@pytest.mark.parametrize("platform, max_rss", [("linux", 3 * 2**10), ("darwin", 3 * 2**20)])
def test_peak_rss_is_in_mib_whatever_unit_the_os_counts_in(monkeypatch, platform, max_rss):
    """getrusage's ru_maxrss is in KiB on Linux and in bytes on macOS."""
    monkeypatch.setattr(support.sys, "platform", platform)
    monkeypatch.setattr(support.resource, "getrusage", lambda who: types.SimpleNamespace(ru_maxrss=max_rss))
    assert support.peak_memory_line(torch.device("cpu")).startswith("peak memory (RSS): 3 MiB")


def test_the_torch_pin_is_requirements_txt_s_and_a_tested_release():
    """run_support names the pin in every log; requirements.txt installs it: one value, held equal here."""
    requirements = (ROOT / "requirements.txt").read_text()
    assert f"\ntorch=={support.TORCH_PIN}\n" in requirements and support.TORCH_PIN in support.TESTED_TORCH


@pytest.mark.parametrize("version, untested", [("2.13.0+cpu", False), ("2.13.0", False), ("2.11.0+cu130", False),
                                               ("2.12.0+cu130", True), ("2.11.1", True), ("2.13.0a0+git4b02cd4", True)])
def test_only_a_tested_release_runs_without_a_warning(version, untested):
    message = support.untested_torch_message(version)
    assert (message is not None) == untested
    if untested:
        release = version.split("+")[0]
        assert message == (f"torch {version} is not a release this project is tested on (2.11.0, 2.13.0); results may "
                           f"differ from a tested torch's: ./run.sh test --torch={release} runs the suite on it")


def test_run_sh_checks_the_torch_it_was_asked_for():
    """./run.sh test --torch=VERSION keeps its own venv with that torch and the other pins: deps_ok accepts the
    running release when asked for it, refuses another, and a version that is not a release stops with one line."""
    def deps_ok(torch_release):
        env = {k: v for k, v in os.environ.items() if k != "RUN_SH_TORCH"}
        if torch_release:
            env["RUN_SH_TORCH"] = torch_release
        return subprocess.run(["bash", "-c", 'source <(sed -n "/^deps_ok()/,/^}/p" run.sh) && deps_ok "$0"',
                               sys.executable], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert deps_ok(support.torch_release()).returncode == 0
    assert deps_ok("9.9.9").returncode != 0
    if support.torch_release() == support.TORCH_PIN:
        assert deps_ok(None).returncode == 0
    refused = subprocess.run(["bash", str(ROOT / "run.sh"), "test", "--torch=2.11"], cwd=ROOT, capture_output=True,
                             text=True, timeout=60)
    assert refused.returncode == 2 and refused.stdout == ""
    assert refused.stderr == "run.sh: --torch=2.11 is not a torch release; give one such as 2.11.0\n"


def test_the_gpt2_ranks_are_the_tokenizers_from_the_named_file_or_the_cache(gpt2_ranks_file, tmp_path, monkeypatch):
    """gpt2_ranks() reads the file GPT2_TIKTOKEN_FILE names, else data/cache's (where data/gpt2_tokenizer.py fetches
    it), under data/gpt2_tokenizer.py's sha256 pin: the same ranks as its parser's. A missing file, and one of other
    bytes, are a one-line ConfigError naming the file and what to do."""
    import gpt2_tokenizer  # data/, on sys.path through conftest

    data = gpt2_ranks_file.read_bytes()
    assert support.GPT2_RANKS_SHA256 == gpt2_tokenizer.RANKS_SHA256
    assert support.GPT2_RANKS_CACHE == gpt2_tokenizer.CACHE_DIR / gpt2_tokenizer.RANKS_FILENAME
    assert support.GPT2_RANKS_VARIABLE == gpt2_tokenizer.ENV_VAR
    ranks = support.gpt2_ranks({"GPT2_TIKTOKEN_FILE": str(gpt2_ranks_file)})
    assert ranks == gpt2_tokenizer._parse_ranks(data) and len(ranks) == 50256
    cached = tmp_path / "cache" / "gpt2.tiktoken"
    monkeypatch.setattr(support, "GPT2_RANKS_CACHE", cached)
    fetch = "fetch it with: python data/gpt2_tokenizer.py (or set GPT2_TIKTOKEN_FILE to a copy of gpt2.tiktoken)"
    with pytest.raises(support.ConfigError) as missing:
        support.gpt2_ranks({})
    assert str(missing.value) == f"GPT-2 ranks {cached}: No such file or directory; {fetch}"
    cached.parent.mkdir()
    cached.write_bytes(data)
    assert support.gpt2_ranks({"GPT2_TIKTOKEN_FILE": ""}) == ranks
    cached.write_bytes(data.replace(b" 0\n", b" 1\n", 1))
    with pytest.raises(support.ConfigError) as bad:
        support.gpt2_ranks({})
    assert str(bad.value) == (f"GPT-2 ranks {cached}: not the pinned file (sha256 {gpt2_tokenizer.RANKS_SHA256}); "
                              f"{fetch}")
    named = tmp_path / "nowhere.tiktoken"
    with pytest.raises(support.ConfigError) as unnamed:
        support.gpt2_ranks({"GPT2_TIKTOKEN_FILE": str(named)})
    assert str(unnamed.value) == (f"GPT-2 ranks GPT2_TIKTOKEN_FILE={named}: No such file or directory; point it at an "
                                  "unmodified gpt2.tiktoken")
    assert all("\n" not in str(e.value) for e in (missing, bad, unnamed))
