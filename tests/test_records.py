"""tools/records.py, on logs of short real runs of train_gpt.py made here (plus edited copies of them)."""

import importlib.util
import json
import math
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import shards  # data/shards.py, on sys.path through conftest
from conftest import TINY_FORMS, TINY_VOCAB

import train_gpt

ROOT = Path(__file__).resolve().parents[1]
TOOL = ROOT / "tools" / "records.py"
SEP = "=" * 100


def _load_tool():
    spec = importlib.util.spec_from_file_location("records_tool", TOOL)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


records = _load_tool()

# A model small enough that a run is mostly interpreter start-up; val_loss_every=1 gives a curve.
TINY_ANY_SOURCE = ["--preset", "cpu", "--num_layers=4", "--model_dim=64", "--num_heads=2", "--head_dim=32",
                   "--seq_len=128", "--val_seq_len=128", "--val_tokens=1024", "--batch_slots=2", "--val_loss_every=1",
                   f"--vocab_size={TINY_VOCAB}", "--compile=false"]  # compiling would cost most of each tiny run
TINY = [*TINY_ANY_SOURCE, *TINY_FORMS]  # what the current source needs at this size (conftest.py)
EDIT_SUFFIX = "  (edited by tests/test_records.py)"


def _known_edit(source: str) -> tuple[str, str]:
    """A comment line that occurs once in the source, and the same line with a note appended."""
    lines = source.splitlines()
    old = next(line for line in lines if line.startswith("# ") and len(line) > 3 and lines.count(line) == 1)
    return old, old + EDIT_SUFFIX


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Four real runs: base (seed 0), seed1 (seed 1, 4 steps), seed2 (seed 2) run the current
    train_gpt.py; edited (seed 0) runs a copy whose one comment line differs."""
    tmp = tmp_path_factory.mktemp("records_runs")
    rng = np.random.default_rng(0)
    for name, n in (("train", 50_000), ("val", 5_000)):
        tokens = (rng.zipf(1.2, n) - 1) % TINY_VOCAB  # learnable: on uniform tokens a run may end above its start
        shards.write_shard(tmp / f"tiny_{name}_000000.bin", tokens)

    source = (ROOT / "train_gpt.py").read_text()
    old, new = _known_edit(source)
    edited_dir = tmp / "edited"
    edited_dir.mkdir()
    (edited_dir / "train_gpt.py").write_text(source.replace(old + "\n", new + "\n", 1))
    (edited_dir / "run_support.py").write_text((ROOT / "run_support.py").read_text())  # imported beside it

    logs = tmp / "logs"
    data = [f"--train_files={tmp}/tiny_train_*.bin", f"--val_files={tmp}/tiny_val_*.bin", f"--log_dir={logs}"]
    plan = {"base": ["--seed=0", "--num_iterations=3"], "seed1": ["--seed=1", "--num_iterations=4"],
            "seed2": ["--seed=2", "--num_iterations=3"]}
    # Importing train_gpt (torch, inductor) costs most of a tiny run, so the three runs of the current
    # source share one process, calling train_gpt.main(argv) as its command line does; the edited copy
    # runs beside it, one thread each.
    driver = ("import json, sys\nsys.path.insert(0, sys.argv[1])\nimport train_gpt\n"
              "for argv in json.loads(sys.argv[2]):\n    train_gpt.main(argv)\n")
    argvs = [[*TINY, *extra, *data, f"--run_id={run_id}"] for run_id, extra in plan.items()]
    env = dict(os.environ, OMP_NUM_THREADS="1", MALLOC_MMAP_MAX_="0", MALLOC_TRIM_THRESHOLD_="68719476736",
               THP_MEM_ALLOC_ENABLE="1")
    commands = {"current": [sys.executable, "-c", driver, str(ROOT), json.dumps(argvs)],
                "edited": [sys.executable, str(edited_dir / "train_gpt.py"), *TINY, "--seed=0", "--num_iterations=3",
                           *data, "--run_id=edited"]}
    procs = {name: subprocess.Popen(cmd, cwd=tmp, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for name, cmd in commands.items()}
    for name, proc in procs.items():
        out, _ = proc.communicate(timeout=600)
        assert proc.returncode == 0, f"{name} runs failed:\n{out[-3000:]}"
    paths = {run_id: logs / f"{run_id}.txt" for run_id in [*plan, "edited"]}

    # Edited copies for the error cases.
    base_text = paths["base"].read_text()
    paths["no_source"] = tmp / "no_source.txt"
    paths["no_source"].write_text(base_text.split(SEP + "\n", 1)[1])
    paths["truncated"] = tmp / "truncated.txt"  # stopped after step 1's validation
    cut = base_text.index("\n", base_text.index("step:1/3 val_loss:")) + 1
    paths["truncated"].write_text(base_text[:cut])
    paths["fork"] = tmp / "fork.txt"  # another speedrun fork: no hyperparameters, extra fields, 2nd separator
    body = base_text.split(SEP + "\n", 1)[1]
    steps = [re.sub(r" train_time:", " mem:123MiB train_time:", line)
             for line in body.splitlines() if line.startswith("step:")]
    paths["fork"].write_text(base_text.split(SEP + "\n", 1)[0] + SEP + "\nRunning Python 3.12\nRunning PyTorch 2.9\n"
                             "| NVIDIA H100 80GB HBM3 |\n" + SEP + "\n" + "\n".join(steps) + "\n")
    return dict(paths=paths, tmp=tmp, old=old, new=new, data=data)


def _changed(lines: list[str]) -> list[str]:
    return [line for line in lines if line.startswith(("+", "-")) and not line.startswith(("+++", "---"))]


def _sections(out: str) -> tuple[list[str], list[str]]:
    """(source part, hyperparameters part) of diff's output."""
    lines = out.splitlines()
    split = next(i for i, line in enumerate(lines)
                 if line.endswith("(hyperparameters)") or line.startswith(("hyperparameters are", "note: no hyper")))
    return lines[:split], lines[split:]


def _final(path: Path) -> tuple[float, int]:
    """(val loss, train_time ms) of the last validation line, parsed without the tool."""
    last = re.findall(r"^step:\d+/\d+ val_loss:(\S+) train_time:(\d+)ms", path.read_text(), re.M)[-1]
    return float(last[0]), int(last[1])


SHAKESPEARE_VAL = "'data/shakespeare/shakespeare_val_*.bin'"
FINEWEB_VAL = "'data/fineweb10B/fineweb_val_*.bin'"


def _tiny_log(path: Path, loss: str = "5.0000", val_files: str = SHAKESPEARE_VAL, seed: int = 0,
              val: bool = True) -> Path:
    """A made-up log: a one-line source, a hyperparameters block, and one final step line (a
    validation line unless val is false)."""
    step = f"val_loss:{loss}" if val else "train_loss:5.1234"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"x = 1\n{SEP}\nhyperparameters (preset cpu):\n  val_files: {val_files}\n  seed: {seed}\n"
                    f"step:2/2 {step} train_time:1000ms step_avg:500.00ms\n")
    return path


def _error(capsys) -> str:
    """The one line a refusal prints on stderr, when it printed nothing on stdout."""
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert len(lines) == 1, captured.err
    return lines[0]


# ------------------------------------------------------------------------------------------------
# diff


def test_diff_shows_exactly_the_known_edit(runs, capsys):
    p = runs["paths"]
    assert records.main(["diff", str(p["base"]), str(p["edited"])]) == 0
    source, hparams = _sections(capsys.readouterr().out)
    assert _changed(source) == ["-" + runs["old"], "+" + runs["new"]]
    assert _changed(hparams) == ["-  run_id: 'base'", "+  run_id: 'edited'"]


def test_diff_shows_changed_hyperparameters(runs, capsys):
    p = runs["paths"]
    assert records.main(["diff", str(p["base"]), str(p["seed1"])]) == 0
    source, hparams = _sections(capsys.readouterr().out)
    assert source[0].startswith("sources are identical")
    assert sorted(_changed(hparams)) == sorted(["-  num_iterations: 3", "+  num_iterations: 4", "-  seed: 0",
                                                "+  seed: 1", "-  run_id: 'base'", "+  run_id: 'seed1'"])


def test_diff_colour_only_when_asked_or_on_a_terminal(runs, capsys):
    p = runs["paths"]
    records.main(["diff", str(p["base"]), str(p["edited"])])
    assert "\033[" not in capsys.readouterr().out  # captured stdout is no terminal
    records.main(["diff", str(p["base"]), str(p["edited"]), "--color", "always"])
    out = capsys.readouterr().out
    assert f"\033[31m-{runs['old']}\033[0m" in out and f"\033[32m+{runs['new']}\033[0m" in out
    assert "\033[36m@@" in out


def test_diff_of_a_log_without_source_is_a_clear_error(runs, capsys):
    p = runs["paths"]
    assert records.main(["diff", str(p["base"]), str(p["no_source"])]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    err = captured.err.strip()
    assert len(err.splitlines()) == 1 and str(p["no_source"]) in err and "no embedded source" in err


def test_diff_of_a_log_from_another_fork(runs, capsys):
    p = runs["paths"]
    assert records.main(["diff", str(p["base"]), str(p["fork"])]) == 0
    out = capsys.readouterr().out
    assert out.startswith("sources are identical")
    assert f"note: no hyperparameters block in {p['fork']}" in out


def test_diff_of_identical_hyperparameters_says_so(tmp_path, capsys):
    a = _tiny_log(tmp_path / "a" / "run.txt")
    b = tmp_path / "b" / "run.txt"
    b.parent.mkdir()
    b.write_bytes(a.read_bytes())
    assert records.main(["diff", str(a), str(b)]) == 0
    assert capsys.readouterr().out == "sources are identical (1 lines in train_gpt.py)\n\nhyperparameters are identical\n"


def test_diff_color_never_prints_plain_lines(tmp_path, capsys):
    a, b = _tiny_log(tmp_path / "a.txt", seed=0), _tiny_log(tmp_path / "b.txt", seed=1)
    assert records.main(["diff", str(a), str(b), "--color", "never"]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "sources are identical (1 lines in train_gpt.py)", "",
        f"--- {a} (hyperparameters)", f"+++ {b} (hyperparameters)", "@@ -1,3 +1,3 @@",
        " hyperparameters (preset cpu):", f"   val_files: {SHAKESPEARE_VAL}", "-  seed: 0", "+  seed: 1"]


# ------------------------------------------------------------------------------------------------
# paths that are no log: one error line, exit status 2, nothing written

PATH_REFUSALS = [
    (["stats", "{empty}"], "error: {empty}: a folder with no *.txt logs"),
    (["plot", "{empty}", "-o", "{out}/p.png"], "error: {empty}: a folder with no *.txt logs"),
    (["diff", "{empty}", "{log}"], "error: {empty}: a folder with no *.txt logs"),
    (["diff", "{log}", "{missing}"], "error: {missing}: no such log file or record folder"),
    (["check", "{missing}"], "error: {missing}: cannot read (No such file or directory)"),
    (["source", "{missing}", "{out}"], "error: {missing}: cannot read (No such file or directory)"),
    (["source", "{empty}", "{out}"], "error: {empty}: cannot read (Is a directory)"),
]


@pytest.mark.parametrize("argv, message", PATH_REFUSALS, ids=[" ".join(argv) for argv, _ in PATH_REFUSALS])
def test_a_path_that_is_no_log_is_one_error_line(argv, message, tmp_path, capsys):
    where = {"empty": tmp_path / "empty", "missing": tmp_path / "missing.txt", "out": tmp_path / "out",
             "log": _tiny_log(tmp_path / "run.txt")}
    where["empty"].mkdir()
    assert records.main([arg.format(**where) for arg in argv]) == 2
    assert _error(capsys) == message.format(**where)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "run.txt"]  # no out/, no file
    assert list(where["empty"].iterdir()) == []


# ------------------------------------------------------------------------------------------------
# stats


def test_stats_matches_scipy(runs, capsys):
    from scipy import stats

    logs = [runs["paths"][k] for k in ("base", "seed1", "seed2")]
    finals = [_final(path) for path in logs]
    losses = [loss for loss, _ in finals]
    target = 7.0
    assert records.main(["stats", *map(str, logs), "--target", str(target)]) == 0
    out = capsys.readouterr().out
    for path, (loss, ms) in zip(logs, finals):
        assert re.search(rf"^{path.stem}\s+{loss:.4f}\s+{ms}ms$", out, re.M), out

    def printed(label):
        return float(re.search(rf"^{label}: ([0-9.e+-]+)", out, re.M).group(1))

    assert printed("n") == 3
    assert printed("mean final val loss") == pytest.approx(np.mean(losses), abs=1e-6)
    assert printed("std final val loss") == pytest.approx(np.std(losses, ddof=1), abs=1e-6)
    p = stats.ttest_1samp(losses, target, alternative="less").pvalue
    assert printed(r"p-value \(one-sided t-test that the mean is below the target\)") == pytest.approx(p, rel=1e-3)
    assert printed("mean training time") == pytest.approx(np.mean([ms for _, ms in finals]), abs=0.05)


def test_stats_with_one_run_has_no_p_value(runs, capsys):
    assert records.main(["stats", str(runs["paths"]["base"]), "--target", "11"]) == 0
    out = capsys.readouterr().out
    assert "p-value (one-sided t-test that the mean is below the target): n/a (n=1" in out


def test_stats_reads_other_forks_logs(runs, capsys):
    p = runs["paths"]
    assert records.main(["stats", str(p["fork"]), str(p["base"])]) == 0
    out = capsys.readouterr().out
    loss, ms = _final(p["base"])
    assert re.search(rf"^fork\s+{loss:.4f}\s+{ms}ms$", out, re.M)
    assert "n/a (no target" in out  # tiny shards in tmp: no track to take a target from


@pytest.mark.parametrize("val_files, track, target", [(FINEWEB_VAL, "track_1_short", 3.28),
                                                      (SHAKESPEARE_VAL, "track_cpu", records.CPU_TARGET)])
def test_stats_takes_the_target_from_the_logged_val_files(val_files, track, target, tmp_path, capsys):
    from scipy import stats

    logs = [_tiny_log(tmp_path / f"s{seed}.txt", loss=loss, val_files=val_files, seed=seed)
            for seed, loss in enumerate(("3.1000", "3.2000", "3.1500"))]
    assert records.main(["stats", *map(str, logs)]) == 0
    out = capsys.readouterr().out
    p = stats.ttest_1samp([3.1, 3.2, 3.15], target, alternative="less").pvalue
    assert f"\ntarget: {target:g} ({track}, from val_files)\n" in out
    assert out.endswith(f"\np-value (one-sided t-test that the mean is below the target): {p:.4g}\n")


def test_stats_of_logs_of_different_tracks_has_no_target(tmp_path, capsys):
    fineweb = _tiny_log(tmp_path / "fineweb.txt", loss="3.1000", val_files=FINEWEB_VAL)
    cpu = _tiny_log(tmp_path / "cpu.txt", loss="5.0000", val_files=SHAKESPEARE_VAL)
    assert records.main(["stats", str(fineweb), str(cpu)]) == 0
    out = capsys.readouterr().out
    assert "\ntarget:" not in out
    assert out.endswith("\np-value (one-sided t-test that the mean is below the target): n/a (no target: the logs "
                        "belong to different tracks (track_1_short, track_cpu); pass --target X)\n")


def test_stats_of_equal_final_losses_has_no_p_value(tmp_path, capsys):
    logs = [_tiny_log(tmp_path / f"s{seed}.txt", loss="5.0000", seed=seed) for seed in range(3)]
    assert records.main(["stats", *map(str, logs), "--target", "6"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert "std final val loss: 0.000000 (sample, ddof=1)" in lines and "target: 6 (--target)" in lines
    assert out.endswith("\np-value (one-sided t-test that the mean is below the target): n/a (every run has the "
                        "same final val loss, so the t-test is undefined; vary --seed)\n")


@pytest.mark.parametrize("loss", ["nan", "inf", "1.2.3"])
def test_stats_with_a_non_finite_final_loss_says_so(tmp_path, capsys, loss):
    """A diverged run (or a malformed loss, read as nan) among others: no t-test, and no traceback."""
    logs = [_tiny_log(tmp_path / "s0.txt", loss="5.0000"), _tiny_log(tmp_path / "s1.txt", loss=loss, seed=1)]
    assert records.main(["stats", *map(str, logs), "--target", "6"]) == 0
    out = capsys.readouterr().out
    assert "std final val loss: nan (sample, ddof=1)" in out.splitlines()
    assert out.endswith("\np-value (one-sided t-test that the mean is below the target): n/a (a final val loss "
                        "is not finite)\n")


def test_stats_notes_a_run_that_diverged(runs, tmp_path, capsys):
    """Above step 0's loss, or without a step-0 line above ln(padded vocab_size); a log that holds neither is
    not judged."""
    base = runs["paths"]["base"]
    diverged = _edit(base, tmp_path, lambda t: _with_final_val_loss(t, "7.5000"))
    no_step_0 = tmp_path / "no_step_0.txt"
    no_step_0.write_text(_with_final_val_loss(_without_step_0(base.read_text()), "6.9400"))
    unjudged = _tiny_log(tmp_path / "unjudged.txt", loss="9.0000")
    assert records.main(["stats", str(base), str(diverged), str(no_step_0), str(unjudged), "--target", "6"]) == 0
    header, *rows = capsys.readouterr().out.splitlines()
    notes = [row[header.index("note"):] for row in rows[:4]]
    step_0 = re.search(r"^step:0/\d+ val_loss:(\S+) ", base.read_text(), re.MULTILINE)[1]
    assert notes == ["", f"diverged: final val loss 7.5000 is above step 0's {step_0}",
                     "diverged: final val loss 6.9400 is above ln(1024) = 6.9315, the loss of uniform predictions", ""]


# ------------------------------------------------------------------------------------------------
# plot


def test_plot_writes_a_png_of_the_requested_size(runs, tmp_path, capsys):
    import matplotlib.image

    p = runs["paths"]
    out = tmp_path / "curves.png"
    args = ["plot", str(p["base"]), str(p["seed1"]), str(p["edited"]), "-o", str(out), "--dpi", "40"]
    assert records.main(args) == 0
    fig = records.plot_figure([records.parse_log(p[k]) for k in ("base", "seed1", "edited")], None, dpi=40)
    width, height = fig.get_size_inches() * 40
    assert width == records.PLOT_WIDTH * 40
    assert matplotlib.image.imread(out).shape[:2] == pytest.approx((height, width), abs=1)  # whole pixels
    before = out.read_bytes()
    assert records.main(args) == 2  # refuses to overwrite
    assert "--force" in capsys.readouterr().err
    assert out.read_bytes() == before
    assert records.main([*args, "--force"]) == 0
    assert sorted(x.name for x in tmp_path.iterdir()) == ["curves.png"]  # no temporary files left


def test_plot_leaves_out_a_log_without_validation_lines(tmp_path, capsys):
    import matplotlib.image

    silent = _tiny_log(tmp_path / "silent.txt", val=False)
    good = _tiny_log(tmp_path / "good.txt")
    out = tmp_path / "plots" / "p.png"
    assert records.main(["plot", str(silent), str(good), "-o", str(out), "--dpi", "20"]) == 0
    captured = capsys.readouterr()
    assert captured.err == f"warning: {silent}: no validation lines; not plotted\n"
    assert captured.out == f"wrote {out} (1 runs)\n"
    width, height = records.plot_figure([records.parse_log(good)], records.CPU_TARGET, dpi=20).get_size_inches() * 20
    assert matplotlib.image.imread(out).shape[:2] == pytest.approx((height, width), abs=1)


def test_plot_with_no_validation_line_at_all_writes_nothing(tmp_path, capsys):
    logs = [_tiny_log(tmp_path / f"silent{i}.txt", val=False) for i in range(2)]
    out = tmp_path / "plots" / "p.png"
    assert records.main(["plot", *map(str, logs), "-o", str(out)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.splitlines() == [*(f"warning: {log}: no validation lines; not plotted" for log in logs),
                                         "error: no validation lines in any log; nothing to plot"]
    assert not out.parent.exists()


def _curve_log(path: Path, points: list[tuple], total: int, run_id: str | None = None) -> Path:
    """A made-up log whose validation lines are points: (step, val loss, train_time in ms or None),
    of a run of total steps; run_id, if given, in a hyperparameters block."""
    hparams = f"hyperparameters (preset cpu):\n  run_id: {run_id!r}\n" if run_id else ""
    lines = [f"step:{step}/{total} val_loss:{loss:.4f}" + (f" train_time:{ms}ms" if ms is not None else "")
             for step, loss, ms in points]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"x = 1\n{SEP}\n{hparams}" + "\n".join(lines) + "\n")
    return path


def _figure(paths: list[Path], target: float | None):
    """plot's figure of these logs, and its panels: zoomed by time, zoomed by step, whole by time,
    whole by step, each checked by its title and axis labels."""
    fig = records.plot_figure([records.parse_log(path) for path in paths], target, dpi=50)
    panels = fig.axes
    assert [ax.get_title() for ax in panels] == ["val loss against training time (zoomed)",
                                                 "val loss against step (zoomed)", "whole runs", "whole runs"]
    assert [ax.get_xlabel() for ax in panels] == ["training time (s)", "step"] * 2
    assert {ax.get_ylabel() for ax in panels} == {"val loss"}
    return fig, panels


def _padded(low: float, high: float) -> tuple[float, float]:
    pad = records.ZOOM_MARGIN * (high - low)
    return pytest.approx((low - pad, high + pad), abs=1e-9)


def _crossing(a: tuple[float, float], b: tuple[float, float], level: float) -> float:
    """Where the segment from point a down to point b crosses level."""
    (x0, y0), (x1, y1) = a, b
    return x0 + (x1 - x0) * (y0 - level) / (y0 - y1)


# Three complete runs of 120 steps ending just below and above a target of 3.28, with times.
CURVES = {"a": [(0, 10.0, 0), (50, 4.0, 5000), (100, 3.30, 10000), (120, 3.270, 12000)],
          "b": [(0, 10.0, 0), (50, 4.1, 5100), (100, 3.31, 10100), (120, 3.275, 12300)],
          "c": [(0, 10.0, 0), (50, 4.2, 5200), (100, 3.32, 10200), (120, 3.283, 12100)]}


def test_plot_zooms_from_the_lowest_loss_to_just_above_the_target(tmp_path):
    paths = [_curve_log(tmp_path / f"{name}.txt", points, 120) for name, points in CURVES.items()]
    fig, (zoom_time, zoom_step, full_time, full_step) = _figure(paths, 3.28)
    bottom, top = 3.270, 3.283  # the lowest loss; the highest final loss, above the target
    for zoom in (zoom_time, zoom_step):
        assert zoom.get_ylim() == _padded(bottom, top)
    zoom_top = zoom_step.get_ylim()[1]
    # from where the first line enters the zoom from above to the last step (widened to whole steps), or time
    for zoom, x, per_unit in ((zoom_step, 0, 1), (zoom_time, 2, 1000)):
        ends = [points[-1][x] / per_unit for points in CURVES.values()]
        entries = [_crossing((p[-2][x], p[-2][1]), (p[-1][x], p[-1][1]), zoom_top) / per_unit for p in CURVES.values()]
        left, right = _padded(min(entries), max(ends)).expected
        assert zoom.get_xlim() == ((math.floor(left), math.ceil(right)) if zoom is zoom_step else (left, right))
    for ax in (zoom_time, zoom_step, full_time, full_step):
        target_lines = [line for line in ax.get_lines() if line.get_label() == "target 3.28"]
        assert len(target_lines) == 1 and list(target_lines[0].get_ydata()) == [3.28, 3.28]
    for full in (full_time, full_step):  # whole curves: from the first loss of 10
        low, high = full.get_ylim()
        assert low < 3.270 and high > 10.0
    assert full_step.get_xlim()[0] < 0 < 120 < full_step.get_xlim()[1]


def test_plot_zoom_of_runs_far_above_the_target_shows_their_ends_and_the_target(tmp_path):
    paths = [_curve_log(tmp_path / "a.txt", [(0, 10.0, 0), (100, 3.6, 9000), (200, 3.5, 18000)], 200),
             _curve_log(tmp_path / "b.txt", [(0, 10.0, 0), (100, 3.7, 9000), (200, 3.6, 18500)], 200)]
    fig, (zoom_time, zoom_step, _, _) = _figure(paths, 3.28)
    for zoom, ends in ((zoom_time, [(18.0, 3.5), (18.5, 3.6)]), (zoom_step, [(200, 3.5), (200, 3.6)])):
        assert zoom.get_ylim() == _padded(3.28, 3.6)
        (left, right), (low, high) = zoom.get_xlim(), zoom.get_ylim()
        assert all(left < x < right and low < loss < high for x, loss in ends)


def test_plot_without_a_target_zooms_on_the_final_losses_of_complete_runs(tmp_path):
    dips = [(0, 10.0, 0), (100, 3.30, 10000), (110, 3.265, 11000), (120, 3.279, 12000)]  # lowest before its end
    paths = [_curve_log(tmp_path / "a.txt", CURVES["a"], 120), _curve_log(tmp_path / "dips.txt", dips, 120),
             _curve_log(tmp_path / "stopped.txt", CURVES["b"][:2], 120)]  # stopped at step 50, loss 4.1
    fig, (zoom_time, zoom_step, full_time, full_step) = _figure(paths, None)
    for zoom in (zoom_time, zoom_step):
        assert zoom.get_ylim() == _padded(3.265, 3.279)
    for ax in (zoom_time, zoom_step, full_time, full_step):
        assert not [line for line in ax.get_lines() if line.get_label().startswith("target")]
    assert [text.get_text() for text in fig.legends[0].get_texts()] == [
        f"{tmp_path.name}/a", f"{tmp_path.name}/dips", f"{tmp_path.name}/stopped"]


@pytest.mark.parametrize("target", [None, records.CPU_TARGET])
def test_plot_of_one_run_with_one_validation(target, tmp_path):
    """track_cpu's records validate once, at the end: one point per run."""
    fig, (zoom_time, zoom_step, _, _) = _figure([_tiny_log(tmp_path / "run.txt", loss="5.0000")], target)
    for zoom, x in ((zoom_time, 1.0), (zoom_step, 2)):
        (left, right), (low, high) = zoom.get_xlim(), zoom.get_ylim()
        assert left < x < right and low < 5.0 < high
        if target is not None:
            assert (low, high) == _padded(5.0, target)
        else:  # no span: widened by the margin of the loss itself
            assert (low, high) == pytest.approx((5.0 * (1 - records.ZOOM_MARGIN), 5.0 * (1 + records.ZOOM_MARGIN)))


def test_plot_leaves_points_without_a_time_out_of_the_time_panels_only(tmp_path):
    some = [(0, 10.0, None), (100, 3.30, 10000), (120, 3.270, None)]
    paths = [_curve_log(tmp_path / "timed.txt", CURVES["a"], 120), _curve_log(tmp_path / "some.txt", some, 120),
             _curve_log(tmp_path / "untimed.txt", [(s, loss, None) for s, loss, _ in CURVES["b"]], 120)]
    fig, (zoom_time, zoom_step, full_time, full_step) = _figure(paths, 3.28)
    for ax in (full_time, zoom_time):
        timed, partly, untimed, _target = ax.get_lines()
        assert list(timed.get_xdata()) == [0, 5, 10, 12] and list(partly.get_xdata()) == [10]
        assert list(partly.get_ydata()) == [3.30] and len(untimed.get_xdata()) == 0
    for ax in (full_step, zoom_step):
        assert [list(line.get_xdata()) for line in ax.get_lines()[:3]] == [[0, 50, 100, 120], [0, 100, 120],
                                                                          [0, 50, 100, 120]]
    assert zoom_time.get_ylim() == zoom_step.get_ylim() == _padded(3.270, 3.28)
    assert len(fig.legends[0].get_texts()) == 4


def test_plot_names_runs_by_record_folder_and_run_name(tmp_path):
    uuid = "0ecdb695-510b-4c3b-b030-09861a162ce8"
    paths = [_curve_log(tmp_path / "track_cpu" / "2026-11-24_LossExp2" / "cpu_seed0.txt", CURVES["a"], 120,
                        run_id="B-s0"),
             _curve_log(tmp_path / "track_cpu" / "2026-11-25_AdamLrHalf" / "cpu_seed1.txt", CURVES["b"], 120),
             _curve_log(tmp_path / "track_1_short" / "2025-09-10_Yarn" / f"{uuid}.txt", CURVES["c"], 120)]
    fig, _ = _figure(paths, 3.28)
    assert [text.get_text() for text in fig.legends[0].get_texts()] == [
        "2026-11-24_LossExp2/B-s0", "2026-11-25_AdamLrHalf/cpu_seed1", "2025-09-10_Yarn/0ecdb695", "target 3.28"]


def test_plot_zoom_leaves_out_a_diverged_runs_end_and_names_a_resumed_runs_logs_apart(tmp_path):
    paths = [_curve_log(tmp_path / "logs" / "run.txt", [(0, 10.0, 0), (50, 3.4, 500)], 100, run_id="run"),
             _curve_log(tmp_path / "logs" / "run.resume1.txt", [(100, 3.27, 1000)], 100, run_id="run"),
             _curve_log(tmp_path / "logs" / "wild.txt", [(0, 10.0, 0), (100, 11.0, 1000)], 100)]
    assert records.divergence(records.parse_log(paths[2])) == "final val loss 11.0000 is above step 0's 10.0000"
    fig, (zoom_time, zoom_step, _, _) = _figure(paths, 3.28)
    assert zoom_time.get_ylim() == zoom_step.get_ylim() == _padded(3.27, 3.28)
    assert [text.get_text() for text in fig.legends[0].get_texts()] == [
        "logs/run", "logs/run.resume1", "logs/wild", "target 3.28"]


def test_a_track_folder_means_every_records_logs_oldest_first(tmp_path):
    track = tmp_path / "track_cpu"
    paths = [_curve_log(track / folder / name, CURVES["a"], 120) for folder, name in
             (("2026-11-25_AdamLrHalf", "s0.txt"), ("2026-11-24_LossExp2", "s1.txt"), ("2026-11-24_LossExp2", "s0.txt"))]
    (track / "notes").mkdir()  # not a record folder
    assert records.expand_paths([str(track)]) == [paths[2], paths[1], paths[0]]
    fig, _ = _figure(records.expand_paths([str(track)]), 3.28)
    assert [text.get_text() for text in fig.legends[0].get_texts()] == [
        "2026-11-24_LossExp2/s0", "2026-11-24_LossExp2/s1", "2026-11-25_AdamLrHalf/s0", "target 3.28"]


@pytest.mark.parametrize("folders", [1, 4])
def test_plot_legend_of_20_runs_names_each_distinctly_and_fits_under_the_panels(folders, tmp_path):
    paths = [_curve_log(tmp_path / f"2026-11-24_NorMuon_CautiousWD_85steps_{i % folders}" / f"cpu_seed{i}.txt",
                        [(0, 10.0, 0), (100, 3.27 + i / 1000, 10000 + i)], 100) for i in range(20)]
    fig, panels = _figure(paths, 3.28)
    legend, = fig.legends
    texts = [text.get_text() for text in legend.get_texts()]
    assert len(set(texts)) == len(texts) == 21 and texts[-1] == "target 3.28"
    assert texts[:20] == [f"{path.parent.name}/{path.stem}" for path in paths]
    runs = panels[1].get_lines()[:20]
    assert len({(line.get_color(), line.get_linestyle(), line.get_marker()) for line in runs}) == 20
    fig.canvas.draw()
    box = legend.get_window_extent()
    assert fig.bbox.x0 <= box.x0 and box.x1 <= fig.bbox.x1 and fig.bbox.y0 <= box.y0 and box.y1 <= fig.bbox.y1
    assert all(not box.overlaps(ax.get_window_extent()) for ax in panels)  # it covers no curve


# ------------------------------------------------------------------------------------------------
# check


def test_check_against_the_current_train_gpt(runs, capsys):
    p = runs["paths"]
    assert records.main(["check", str(p["base"])]) == 0
    assert "source is exactly" in capsys.readouterr().out
    assert records.main(["check", str(p["edited"])]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert _changed(lines) == ["-" + runs["old"], "+" + runs["new"]]
    assert records.main(["check", str(p["no_source"])]) == 2


# ------------------------------------------------------------------------------------------------
# logged sources: train_gpt.py and its companion, or train_gpt.py alone in older logs

RECORD_LOG = ROOT / "records" / "track_cpu" / "2026-11-25_AdamLrHalf" / "cpu_seed0.txt"  # train_gpt.py alone
LOSSES = ("import json, sys\nsys.path.insert(0, sys.argv[1])\nimport train_gpt\n"
          "r = train_gpt.main(json.loads(sys.argv[2]))\n"
          "print(json.dumps({k: {s: float(v).hex() for s, v in r[k].items()} for k in ('train_losses', 'val_losses')}))")


def test_a_log_holds_train_gpt_then_its_companion(runs):
    log = records.parse_log(runs["paths"]["base"])
    assert list(log.sources) == ["train_gpt.py", "run_support.py"]
    for name, text in log.sources.items():
        assert text == (ROOT / name).read_text()


def test_older_logs_hold_train_gpt_alone_and_every_command_reads_them(runs, tmp_path, capsys):
    log = records.parse_log(RECORD_LOG)
    assert list(log.sources) == ["train_gpt.py"] and log.sources["train_gpt.py"] == log.source
    assert "class Hyperparameters" in log.source and log.final.step == log.final.total
    assert records.main(["diff", str(RECORD_LOG), str(runs["paths"]["base"])]) == 0
    out = capsys.readouterr().out
    assert f"+++ {runs['paths']['base']} (run_support.py)" in out  # the companion is new on the right
    assert "--- /dev/null" not in out and f"--- {RECORD_LOG} (train_gpt.py)" in out
    assert records.main(["check", str(RECORD_LOG)]) == 1  # an older train_gpt.py, compared alone
    assert f"{RECORD_LOG} (train_gpt.py)" in capsys.readouterr().out
    assert records.main(["stats", str(RECORD_LOG.parent)]) == 0
    assert "n: 5" in capsys.readouterr().out
    assert records.main(["plot", str(RECORD_LOG), "-o", str(tmp_path / "p.png")]) == 0
    assert records.main(["list", "track_cpu", "--records-dir", str(ROOT / "records")]) == 0


def test_source_writes_a_log_back_out_and_it_runs_to_the_same_bits(runs, tmp_path, capsys):
    """The files written from the base run's log, run with its hyperparameters, give the losses the
    log holds, and bit for bit those of the current train_gpt.py (same threads, one process each)."""
    out = tmp_path / "from_log"
    assert records.main(["source", str(runs["paths"]["base"]), str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["run_support.py", "train_gpt.py"]
    for name in ("train_gpt.py", "run_support.py"):
        assert (out / name).read_text() == (ROOT / name).read_text()
    assert records.main(["source", str(runs["paths"]["base"]), str(out)]) == 2  # never over existing files
    assert "exists; pick an empty folder" in capsys.readouterr().err
    argv = [*TINY, "--seed=0", "--num_iterations=3", *runs["data"]]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    losses = {}
    for where, folder in (("logged", out), ("current", ROOT)):
        run_argv = [*argv, f"--log_dir={tmp_path / where}", "--run_id=again"]
        proc = subprocess.run([sys.executable, "-c", LOSSES, str(folder), json.dumps(run_argv)], cwd=runs["tmp"],
                              env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        losses[where] = json.loads(proc.stdout.splitlines()[-1])
    assert losses["logged"] == losses["current"]
    logged = re.findall(r"^step:(\d+)/3 val_loss:(\S+)", runs["paths"]["base"].read_text(), re.M)
    assert [(int(s), float(v)) for s, v in logged] == [
        (int(s), round(float.fromhex(v), 4)) for s, v in losses["logged"]["val_losses"].items()]


def test_source_files_get_the_usual_mode_and_bad_names_write_nothing(runs, tmp_path, capsys):
    umask = os.umask(0o022)
    try:
        assert records.main(["source", str(runs["paths"]["base"]), str(tmp_path / "out")]) == 0
    finally:
        os.umask(umask)
    assert {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / "out").iterdir()} == {
        "train_gpt.py": 0o644, "run_support.py": 0o644}
    text = runs["paths"]["base"].read_text()
    for bad in ("../evil.py", "train_gpt.py", ""):  # a path, a second train_gpt.py, no name
        log = tmp_path / "bad.txt"
        log.write_text(text.replace("\n# run_support.py\n", f"\n# {bad}\n", 1))
        assert records.main(["source", str(log), str(tmp_path / "bad_out")]) == 2
        assert "is no file name, or comes twice" in capsys.readouterr().err
        assert not (tmp_path / "bad_out").exists()


def test_logs_of_the_upstream_repository_split_into_their_files(tmp_path, capsys):
    """Upstream appends each kernel file after two newlines and a dashed header, and print() adds a
    final newline: check compares such a log with the files it ran, blank lines at the end aside."""
    code, kernels = "import torch\nx = 1\n", "def kernel():\n    pass\n"
    logged = code + f"\n\n{'-' * 40}\n# triton_kernels.py\n{'-' * 40}\n\n" + kernels
    log = tmp_path / "upstream.txt"
    log.write_text(logged + "\n" + SEP + "\nstep:10/10 val_loss:3.2800 train_time:1000ms step_avg:100.00ms\n")
    assert list(records.parse_log(log).sources) == ["train_gpt.py", "triton_kernels.py"]
    (tmp_path / "train_gpt.py").write_text(code)
    assert records.main(["check", str(log), "--script", str(tmp_path / "train_gpt.py")]) == 1
    assert "triton_kernels.py: not in this checkout" in capsys.readouterr().out
    (tmp_path / "triton_kernels.py").write_text(kernels)
    assert records.main(["check", str(log), "--script", str(tmp_path / "train_gpt.py")]) == 0
    (tmp_path / "triton_kernels.py").write_text(kernels.replace("pass", "return"))
    assert records.main(["check", str(log), "--script", str(tmp_path / "train_gpt.py")]) == 1
    assert "+    pass" in capsys.readouterr().out


def test_an_older_record_log_writes_out_a_source_that_runs(runs, tmp_path):
    out = tmp_path / "record"
    assert records.main(["source", str(RECORD_LOG), str(out)]) == 0
    assert [p.name for p in out.iterdir()] == ["train_gpt.py"]
    proc = subprocess.run([sys.executable, str(out / "train_gpt.py"), *TINY_ANY_SOURCE, "--num_iterations=2", "--compile=false",
                           *runs["data"], f"--log_dir={tmp_path / 'logs'}", "--run_id=record"], cwd=runs["tmp"],
                          capture_output=True, text=True, timeout=600, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert re.search(r"^step:2/2 val_loss:\d+\.\d+ ", proc.stdout, re.M)
    assert records.parse_log(tmp_path / "logs" / "record.txt").sources == records.parse_log(RECORD_LOG).sources


# ------------------------------------------------------------------------------------------------
# submit and list


def test_submit_refusals_create_nothing(runs, tmp_path, capsys):
    p = runs["paths"]
    recs = tmp_path / "records"
    common = ["--track", "track_cpu", "--records-dir", str(recs), "--date", "2024-05-20"]
    cases = {
        "sources differ": [str(p["base"]), str(p["edited"]), "--name", "Mixed"],
        "may hold only": [str(p["base"]), "--name", "bad name"],
        "no embedded source": [str(p["no_source"]), "--name", "NoSource"],
        "no final val loss": [str(p["truncated"]), "--name", "Truncated"],
    }
    for bad in ("../up", "a/b", "dot.name", "", "naïve"):
        assert records.main(["submit", str(p["base"]), "--name", bad, *common]) == 2
        assert "may hold only" in capsys.readouterr().err
    for message, args in cases.items():
        assert records.main(["submit", *args, *common]) == 2
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1
    assert records.main(["submit", str(p["base"]), "--name", "X", "--track", "track_9", "--records-dir", str(recs)]) == 2
    assert "unknown track" in capsys.readouterr().err
    assert not recs.exists()


def _with_final_val_loss(text: str, value: str) -> str:
    last = re.findall(r"^step:\d+/\d+ val_loss:\S+", text, re.M)[-1]
    head, _, tail = text.rpartition(last)
    return head + re.sub(r"val_loss:\S+", f"val_loss:{value}", last) + tail


def _without_validation_lines(text: str) -> str:
    source, body = text.split(SEP + "\n", 1)
    return source + SEP + "\n" + "".join(line for line in body.splitlines(keepends=True)
                                         if not (line.startswith("step:") and " val_loss:" in line))


def _with_step_0_val_loss(text: str, value: str) -> str:
    source, body = text.split(SEP + "\n", 1)
    return source + SEP + "\n" + re.sub(r"^(step:0/\d+ val_loss:)\S+", rf"\g<1>{value}", body, count=1, flags=re.M)


def _without_step_0(text: str) -> str:
    source, body = text.split(SEP + "\n", 1)
    return source + SEP + "\n" + re.sub(r"^step:0/\d+ val_loss:.*\n", "", body, count=1, flags=re.M)


def _resumed(text: str) -> str:
    source, body = text.split(SEP + "\n", 1)
    first_step = body.index("\nstep:") + 1
    return source + SEP + "\n" + body[:first_step] + "resumed from checkpoints/base_step2.pt at step 2\n" + body[first_step:]


# (logs to submit, given the base log and a folder for edited copies; the error line, {0} the first log)
SUBMIT_LOG_REFUSALS = {
    "missing": (lambda base, d: [d / "missing.txt"], "error: {0}: no such log file"),
    "same file name": (lambda base, d: [base, _copy_into(base, d / "again")],
                       "error: two logs share a file name (base.txt); each run needs its own run_id"),
    "no validation line": (lambda base, d: [_edit(base, d, _without_validation_lines)],
                           "error: {0}: no final val loss (no validation line)"),
    "nan": (lambda base, d: [_edit(base, d, lambda t: _with_final_val_loss(t, "nan"))],
            "error: {0}: the final val loss is nan"),
    "inf": (lambda base, d: [_edit(base, d, lambda t: _with_final_val_loss(t, "inf"))],
            "error: {0}: the final val loss is inf"),
    "malformed number": (lambda base, d: [_edit(base, d, lambda t: _with_final_val_loss(t, "1.2.3"))],
                         "error: {0}: the final val loss is nan"),
    "resumed": (lambda base, d: [base, _edit(base, d, _resumed)],
                "error: {1}: a resumed run; its train_time does not cover the whole run"),
    # the base run validates step 0; without that line its logged vocab_size counts: ln(1024), uniform predictions'
    "diverged": (lambda base, d: [_edit(base, d, lambda t: _with_final_val_loss(_with_step_0_val_loss(t, "6.9000"),
                                                                                "6.9001"))],
                 "error: {0}: the run diverged: final val loss 6.9001 is above step 0's 6.9000"),
    "diverged, no step-0 line": (
        lambda base, d: [_edit(base, d, lambda t: _with_final_val_loss(_without_step_0(t), "6.9316"))],
        "error: {0}: the run diverged: final val loss 6.9316 is above ln(1024) = 6.9315, the loss of uniform predictions"),
}


def _copy_into(log: Path, folder: Path) -> Path:
    folder.mkdir()
    return Path(shutil.copy(log, folder / log.name))


def _edit(base: Path, folder: Path, change) -> Path:
    path = folder / "edited.txt"
    text = base.read_text()
    path.write_text(change(text))
    assert path.read_text() != text
    return path


@pytest.mark.parametrize("case", SUBMIT_LOG_REFUSALS)
def test_submit_refuses_logs_that_make_no_record(case, runs, tmp_path, capsys):
    build, message = SUBMIT_LOG_REFUSALS[case]
    logs = build(runs["paths"]["base"], tmp_path)
    recs = tmp_path / "records"
    assert records.main(["submit", *map(str, logs), "--track", "track_cpu", "--name", "Refused",
                         "--date", "2024-05-20", "--records-dir", str(recs)]) == 2
    assert _error(capsys) == message.format(*logs)
    assert not recs.exists()


@pytest.mark.parametrize("date", ["2024-5-20", "20240520", "2024-02-30", "2024-13-01", "24-05-20", "2024-05-20 ", ""])
def test_submit_refuses_a_date_that_is_not_yyyy_mm_dd(date, runs, tmp_path, capsys):
    recs = tmp_path / "records"
    assert records.main(["submit", str(runs["paths"]["base"]), "--track", "track_cpu", "--name", "Dated",
                         "--date", date, "--records-dir", str(recs)]) == 2
    assert _error(capsys) == f"error: --date {date!r} is not a date of the form YYYY-MM-DD"
    assert not recs.exists()


def _submitted_readme(log: Path, recs: Path, name: str, date: str = "2024-05-20") -> str:
    assert records.main(["submit", str(log), "--track", "track_cpu", "--name", name, "--date", date,
                         "--records-dir", str(recs)]) == 0
    return (recs / "track_cpu" / f"{date}_{name}" / "README.md").read_text()


def test_submit_readme_of_logs_without_a_preset_or_hyperparameters(runs, tmp_path, capsys):
    text = runs["paths"]["base"].read_text()
    no_preset = tmp_path / "no_preset.txt"
    no_preset.write_text(text.replace("\nhyperparameters (preset cpu):\n", "\nhyperparameters:\n", 1))
    hparams = records.parse_log(runs["paths"]["base"]).hparam_lines[1:]
    assert len(hparams) > 10
    readme = _submitted_readme(no_preset, tmp_path / "records", "NoPreset")
    assert readme.endswith("\n## Command\n\n" + "\n".join(["The logs name no preset; their hyperparameters:", "",
                                                            "```", *hparams, "```", ""]))
    readme = _submitted_readme(runs["paths"]["fork"], tmp_path / "fork_records", "Fork")
    assert readme.endswith("\n## Command\n\nThe logs record no hyperparameters; see the source and the logs.\n")


PREVIOUS_RECORD_NOTES = {
    "no logs": (None, "The previous record, `records/track_cpu/2024-05-01_Prev`, holds no logs to compare with."),
    "no source": ("no_source", "The previous record, `records/track_cpu/2024-05-01_Prev`, could not be compared: "
                               "{prev}: no embedded source (no line of 100 '=' ends one); is this a train_gpt.py log?"),
    "same source": ("seed1", "The source is identical to that of the previous record, "
                             "`records/track_cpu/2024-05-01_Prev`."),
}


@pytest.mark.parametrize("case", PREVIOUS_RECORD_NOTES)
def test_submit_readme_notes_what_it_could_compare_with_the_previous_record(case, runs, tmp_path, capsys):
    previous, note = PREVIOUS_RECORD_NOTES[case]
    recs = tmp_path / "records"
    prev = recs / "track_cpu" / "2024-05-01_Prev"
    prev.mkdir(parents=True)
    prev_log = prev / "run.txt"
    if previous is not None:
        shutil.copy(runs["paths"][previous], prev_log)
    (recs / "track_cpu" / "2024-06-01_Later").mkdir()  # a later date: not the previous record
    readme = _submitted_readme(runs["paths"]["base"], recs, "Next")
    assert readme.split("\n")[8] == note.format(prev=prev_log)


def test_submit_then_list(runs, tmp_path, capsys):
    from scipy import stats

    p = runs["paths"]
    recs = tmp_path / "records"
    logs = [p["base"], p["seed1"], p["seed2"]]
    args = ["submit", *map(str, logs), "--track", "track_cpu", "--name", "Tiny_run-1", "--date", "2024-05-20",
            "--records-dir", str(recs)]
    assert records.main(args) == 0
    folder = recs / "track_cpu" / "2024-05-20_Tiny_run-1"
    assert sorted(x.name for x in folder.iterdir()) == ["README.md", "base.txt", "seed1.txt", "seed2.txt"]
    for log in logs:
        assert (folder / log.name).read_bytes() == log.read_bytes()
    readme = (folder / "README.md").read_text()
    losses = [_final(log)[0] for log in logs]
    pvalue = stats.ttest_1samp(losses, records.CPU_TARGET, alternative="less").pvalue
    assert "## What changed\n\nTODO: describe the change" in readme
    assert "This is the first record of this track." in readme
    assert f"mean final val loss: {np.mean(losses):.4f}" in readme
    assert f"{pvalue:.4g}" in readme
    assert "--preset cpu" in readme and "--model_dim=64" in readme and "--run_id" not in readme
    # the command carries the memory settings the logs say the runs had (./run.sh's)
    huge_pages = "  huge pages: on" in p["base"].read_text()
    settings = "MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=68719476736" + (" THP_MEM_ALLOC_ENABLE=1" if huge_pages else "")
    assert f"\n{settings} python train_gpt.py --preset cpu " in readme
    assert "`--seed`: 0, 1, 2" in readme and "`--num_iterations`: 3, 4, 3" in readme
    assert "hardware: 1x CPU" in readme  # the hardware line
    assert sorted(x.name for x in (recs / "track_cpu").iterdir()) == [folder.name]  # no temporary folder left
    capsys.readouterr()

    assert records.main(args) == 2  # the folder exists
    assert "exists" in capsys.readouterr().err

    # A later record whose source differs by the known edit: its README counts the change.
    assert records.main(["submit", str(p["edited"]), "--track", "track_cpu", "--name", "Edited",
                         "--date", "2024-06-01", "--records-dir", str(recs)]) == 0
    later = (recs / "track_cpu" / "2024-06-01_Edited" / "README.md").read_text()
    assert "records/track_cpu/2024-05-20_Tiny_run-1`: train_gpt.py, 1 insertion(s)(+), 1 deletion(s)(-)" in later
    capsys.readouterr()

    # A record of the same date submitted later is the newer one, whatever the names' order.
    assert records.main(["submit", str(p["base"]), "--track", "track_cpu", "--name", "Aardvark",
                         "--date", "2024-06-01", "--records-dir", str(recs)]) == 0
    same_day = (recs / "track_cpu" / "2024-06-01_Aardvark" / "README.md").read_text()
    assert "Source diff against the previous record, `records/track_cpu/2024-06-01_Edited`" in same_day
    assert re.search(r"^- submitted: \d{4}-\d{2}-\d{2}T", same_day, re.MULTILINE)
    capsys.readouterr()

    assert records.main(["list", "--records-dir", str(recs)]) == 0
    out = capsys.readouterr().out
    assert "track_1_short" in out and "(no records yet)" in out
    rows = [line.split() for line in out.splitlines() if re.match(r"\s+\d{4}-\d{2}-\d{2}\s", line)]
    assert [row[:2] for row in rows] == [["2024-06-01", "Aardvark"], ["2024-06-01", "Edited"],
                                         ["2024-05-20", "Tiny_run-1"]]  # newest first
    assert rows[2][4] == f"{np.mean(losses):.4f}" and rows[2][5] == "3" and rows[2][6] == f"{pvalue:.4g}"

    # stats takes the target from the records/<track>/ path; diff takes a folder's first log.
    assert records.main(["stats", str(folder)]) == 0
    assert f"target: {records.CPU_TARGET:g} (track_cpu, from the path)" in capsys.readouterr().out
    assert records.main(["diff", str(folder), str(recs / "track_cpu" / "2024-06-01_Edited")]) == 0
    source, _ = _sections(capsys.readouterr().out)
    assert _changed(source) == ["-" + runs["old"], "+" + runs["new"]]


def test_command_carries_the_memory_settings_a_log_reports(runs, tmp_path):
    """Each fast-path line a CPU log reports as on puts its setting in front of the command, for
    torchrun too; a line reporting off adds nothing."""
    text = runs["paths"]["base"].read_text()
    kept = [line for line in text.splitlines(keepends=True)
            if not line.startswith(("  glibc malloc tuning:", "  huge pages:"))]
    fast = kept.index("fast paths:\n") + 1
    cases = {("on", "on for tensors of 2 MB or more (...)", 1): "MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=68719476736 "
                                                             "THP_MEM_ALLOC_ENABLE=1 python train_gpt.py",
             ("on", "off (float32: ...)", 1): "MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=68719476736 python train_gpt.py",
             ("off (...)", "off (...)", 1): "python train_gpt.py",
             ("off (...)", "on (the kernel's ...)", 2): "THP_MEM_ALLOC_ENABLE=1 torchrun --standalone "
                                                       "--nproc_per_node=2 train_gpt.py"}
    for (malloc, huge, world_size), launcher in cases.items():
        lines = kept[:fast] + [f"  glibc malloc tuning: {malloc}\n", f"  huge pages: {huge}\n"] + kept[fast:]
        if world_size > 1:
            lines.append(f"distributed: world size {world_size}, backend gloo, 1 gradient buckets of [0.1] MB\n")
        path = tmp_path / "log.txt"
        path.write_text("".join(lines))
        command = records.command_lines([records.parse_log(path)])[1]
        assert command.startswith(launcher + " --preset cpu "), (malloc, huge, command)


def test_command_gives_tuples_as_train_gpt_parses_them(runs, tmp_path):
    """A log whose window stages differ from the preset's: the command passes them comma-separated,
    and train_gpt.py reads back the logged value."""
    text = runs["paths"]["base"].read_text()
    assert text.count("\n  window_stages: (2, 4, 8, 16, 32)\n") == 1
    path = tmp_path / "log.txt"
    path.write_text(text.replace("\n  window_stages: (2, 4, 8, 16, 32)\n", "\n  window_stages: (1, 2)\n"))
    command = shlex.split(records.command_lines([records.parse_log(path)])[1])
    assert "--window_stages=1,2" in command
    args, _ = train_gpt.parse_args(command[command.index("--preset"):], "record")
    assert args.window_stages == (1, 2)


def test_list_of_empty_records(tmp_path, capsys):
    assert records.main(["list", "track_cpu", "--records-dir", str(tmp_path)]) == 0
    assert capsys.readouterr().out.splitlines()[1] == "  (no records yet)"
    assert records.main(["list", "track_nope", "--records-dir", str(tmp_path)]) == 2


def test_list_orders_records_of_one_date_whose_readme_gives_no_time_by_name(tmp_path, capsys):
    """Newest first: a README with a submission time ranks above those without one (a missing README, no
    '- submitted:' line, an unreadable time), which follow by name, last first. A folder with no logs
    is a row of dashes and an error line under the table."""
    track = tmp_path / "track_cpu"
    readmes = {"Aaa": "- submitted: 2024-01-01T10:00:00+00:00\n", "Bee": "- submitted: not a time\n",
               "Mid": None, "Zed": "# Zed\n\nno submission line\n"}
    for name, readme in readmes.items():
        _tiny_log(track / f"2024-01-01_{name}" / "run.txt")
        if readme is not None:
            (track / f"2024-01-01_{name}" / "README.md").write_text(readme)
    (track / "2024-01-01_NoLogs").mkdir()
    assert records.main(["list", "track_cpu", "--records-dir", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1:] == [
        "  date        name    mean time  mean val loss  runs  p-value",
        "  2024-01-01  Aaa         1.0 s         5.0000     1      n/a",
        "  2024-01-01  Zed         1.0 s         5.0000     1      n/a",
        "  2024-01-01  NoLogs          -              -     0        -",
        "  2024-01-01  Mid         1.0 s         5.0000     1      n/a",
        "  2024-01-01  Bee         1.0 s         5.0000     1      n/a",
        f"  2024-01-01_NoLogs: {track / '2024-01-01_NoLogs'}: a folder with no *.txt logs"]


# ------------------------------------------------------------------------------------------------
# the script itself


def test_script_runs_and_light_commands_import_neither_scipy_nor_matplotlib(runs, tmp_path):
    p = runs["paths"]
    done = subprocess.run([sys.executable, str(TOOL), "list", "--records-dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "(no records yet)" in done.stdout
    probe = ("import importlib.util, sys\n"
             "spec = importlib.util.spec_from_file_location('r', sys.argv[1])\n"
             "m = importlib.util.module_from_spec(spec); sys.modules['r'] = m; spec.loader.exec_module(m)\n"
             "for argv in (['diff', sys.argv[2], sys.argv[3]], ['check', sys.argv[2]], ['list', '--records-dir', sys.argv[4]]):\n"
             "    assert m.main(argv) in (0, 1)\n"
             "print('heavy:', [k for k in ('scipy', 'matplotlib', 'numpy', 'torch') if k in sys.modules])\n")
    done = subprocess.run([sys.executable, "-c", probe, str(TOOL), str(p["base"]), str(p["edited"]), str(tmp_path)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "heavy: []"


def test_help_and_usage_errors(capsys):
    assert records.main(["--help"]) == 0
    assert "submit" in capsys.readouterr().out
    assert records.main(["frobnicate"]) == 2
    assert records.main(["plot", "x.txt"]) == 2  # -o is required
    assert records.main(["stats", "/nonexistent/log.txt"]) == 2
    assert "no such log file" in capsys.readouterr().err
    assert not math.isnan(records.TRACKS["track_1_short"].target)
