"""tools/profile_step.py on a tiny model: real training steps under torch.profiler, top operations printed."""

import sys

import pytest
from conftest import ROOT, TINY_RUN

sys.path.insert(0, str(ROOT / "tools"))
import profile_step  # noqa: E402

import train_gpt  # noqa: E402


def test_it_profiles_real_training_steps():
    report = profile_step.main([*TINY_RUN, "--top=6", "--steps=1"])
    lines = report.splitlines()
    assert lines[0].startswith("preset cpu: 4 layers x 64, 2 x 128 tokens a step (the first stage's), dtype float32, "
                               "compile False; cpu")
    assert "1 profiled steps" in lines[1] and "top 6 operations by self time" in lines[1]
    # the table: a header between rules, then six rows (aten operations or profiler ranges such as
    # Optimizer.step) up to the closing rule; the matmuls of a forward and backward must be among them
    rules = [i for i, line in enumerate(lines) if line.startswith("---")]
    assert len(rules) == 3
    rows = [line.strip() for line in lines[rules[1] + 1 : rules[2]]]
    assert len(rows) == 6 and any(row.startswith(("aten::mm", "aten::addmm", "aten::bmm")) for row in rows)


@pytest.mark.parametrize("arg", ["--top=0", "--steps=x"])
def test_its_own_options_are_checked(arg):
    with pytest.raises(train_gpt.ConfigError, match="expected a positive integer"):
        train_gpt.support.split_tool_options([arg], dict(top=25, steps=2))
