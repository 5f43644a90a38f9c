"""tools/plot.py: scalars read back from event files as written, a resumed run's versions joined into one curve,
one PNG per metric group that has data (a few panels each, standard errors as bands), runs overlaid in their own
colours, one error line for a folder without events or a missing matplotlib; tools/compare.py's figures next to
its table."""

import importlib.util
import math
import os
import struct
import sys
import tomllib

import pytest
from helpers import TESTS, load_tool

ROOT = os.path.dirname(TESTS)
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
C0, C1 = (0x1F, 0x77, 0xB4), (0xFF, 0x7F, 0x0E)  # matplotlib's first two cycle colours: run 0 and run 1
needs_matplotlib = pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None,
                                      reason="matplotlib is not installed (the extra 'plot')")

# Two runs with known scalars (values exact in float32, which is what the event files store).
RUN_A = {
    "train/reward/mean": [(0, 0.25), (1, 0.5), (2, 0.75)],
    "train/reward/accuracy": [(0, 0.0), (1, 0.5), (2, 1.0)],
    "train/policy/entropy": [(0, 1.5), (1, 1.25), (2, math.nan)],  # NaN kept, not dropped
    "val/accuracy": [(0, 0.125), (2, 0.375)],  # before and after only
    "val/greedy/avg@1": [(0, 0.125), (2, 0.375)],
    "val/greedy/avg@1_se": [(0, 0.0625), (2, 0.125)],
    "epoch": [(0, 0.0), (2, 0.0)],  # logged by Lightning, in no group
}
RUN_B = {
    "train/reward/mean": [(0, 0.5), (1, 0.25), (2, 0.0), (3, 0.5)],
    "train/policy/clipfrac_high": [(1, 0.0625), (3, 0.125)],
}


def _write_run(log_dir: str, scalars: dict) -> str:
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(log_dir=log_dir)
    for tag, points in scalars.items():
        for step, value in points:
            writer.add_scalar(tag, value, step)
    writer.close()
    return log_dir


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> list[str]:
    root = tmp_path_factory.mktemp("runs")
    return [_write_run(str(root / name / "lightning_logs" / "version_0"), scalars)
            for name, scalars in (("a", RUN_A), ("b", RUN_B))]


def _evaluation(accuracy: float) -> dict[str, float]:
    """What one evaluation logs, from the evaluator's own accumulator: 8 problems from two data sources, 4
    samples and a greedy answer each, avg@k / pass@k / maj@k at k = 1 and 4 with standard errors (81 metrics)."""
    from rllight.evaluation import EvalAccumulator

    rows = [{"source": f"p{i}", "data_source": ("arith", "gsm8k")[i % 2], "prompt": "?", "answer": "1"}
            for i in range(8)]
    correct = [(3 * i + j) % 10 < 10 * accuracy for i in range(8) for j in range(4)]
    sampled, greedy = EvalAccumulator("val"), EvalAccumulator("val/greedy")
    sampled.update(rows, 4, correct, rewards=[float(c) for c in correct], lengths=[12] * 32, truncated=[False] * 32,
                   texts=["1" if c else "2" for c in correct])
    first = correct[::4]
    greedy.update(rows, 1, first, rewards=[float(c) for c in first], lengths=[9] * 8, truncated=[True] + [False] * 7,
                  texts=["1" if c else "2" for c in first])
    metrics = {**sampled.compute([1, 4]), **greedy.compute([1])}
    metrics["val/accuracy"] = metrics["val/greedy/avg@1"]
    return metrics


def _png_size(path: str) -> tuple[int, int]:
    with open(path, "rb") as f:
        head = f.read(24)
    assert head[:8] == PNG_SIGNATURE and head[12:16] == b"IHDR", path
    return struct.unpack(">II", head[16:24])


def _has_colour(path: str, rgb: tuple[int, int, int]) -> bool:
    from matplotlib.image import imread

    pixels = imread(path)[..., :3]  # float in [0, 1]
    target = [c / 255 for c in rgb]
    close = abs(pixels - target).max(axis=-1) < 8 / 255  # antialiasing leaves exact colours at line and marker cores
    return int(close.sum()) >= 10


def test_read_scalars_returns_what_was_written(runs):
    plot = load_tool("plot")
    a = plot.read_scalars(runs[0])
    assert set(a) == set(RUN_A)
    for tag, points in RUN_A.items():
        if tag == "train/policy/entropy":
            continue
        assert a[tag] == points, tag
    entropy = a["train/policy/entropy"]
    assert entropy[:2] == [(0, 1.5), (1, 1.25)] and entropy[2][0] == 2 and math.isnan(entropy[2][1])
    assert plot.read_scalars(runs[1]) == RUN_B


def test_a_resumed_runs_versions_are_joined_into_one_curve(tmp_path):
    """version_0 trained steps 0-5 and stopped; version_1 resumed from the checkpoint at step 4 and redid steps
    4-5: the curve is version_0's steps 0-3 then version_1's 4-7, and version_0's evaluation before training
    (step 0) stays."""
    plot = load_tool("plot")
    root = tmp_path / "run"
    logs = root / "lightning_logs"
    _write_run(str(logs / "version_0"), {"train/reward/mean": [(s, 0.125) for s in range(6)],
                                         "val/accuracy": [(0, 0.25)]})
    _write_run(str(logs / "version_1"), {"train/reward/mean": [(s, 0.5) for s in range(4, 8)],
                                         "val/accuracy": [(7, 0.75)]})
    (logs / "version_2").mkdir()  # started, no events yet: not a part
    assert plot.event_dirs(str(root)) == [str(logs / "version_0"), str(logs / "version_1")]
    assert plot.event_dir(str(root)) == str(logs / "version_1")  # the newest (its eval_summary.json is the last)
    assert plot.read_scalars(str(root)) == {
        "train/reward/mean": [(0, 0.125), (1, 0.125), (2, 0.125), (3, 0.125), (4, 0.5), (5, 0.5), (6, 0.5), (7, 0.5)],
        "val/accuracy": [(0, 0.25), (7, 0.75)],
    }
    assert plot.read_scalars(str(logs / "version_0"))["train/reward/mean"][-1] == (5, 0.125)  # one version: as is


def test_a_fresh_run_in_the_same_folder_replaces_the_earlier_versions(tmp_path):
    plot = load_tool("plot")
    root = tmp_path / "run"
    _write_run(str(root / "lightning_logs" / "version_9"), {"train/reward/mean": [(0, 0.25), (1, 0.5)]})
    _write_run(str(root / "lightning_logs" / "version_10"), {"train/reward/mean": [(0, 0.75)]})
    assert plot.event_dir(str(root)) == str(root / "lightning_logs" / "version_10")  # 10 > 9 as numbers
    assert plot.read_scalars(str(root)) == {"train/reward/mean": [(0, 0.75)]}  # it started at 0: nothing kept


def test_validation_is_one_figure_of_four_panels_whatever_the_number_of_metrics():
    plot = load_tool("plot")
    logged = set(_evaluation(0.5))
    assert len([t for t in logged if t.startswith("val/")]) >= 60
    figures = {name: panels for name, _, panels in plot.figure_panels(logged)}
    assert list(figures) == ["validation"]
    assert [[tag for tag, _ in series] for _, series in figures["validation"]] == [
        ["val/greedy/avg@1", "val/avg@4", "val/pass@4", "val/maj@4"],  # the largest k: the smallest error
        ["val/greedy/arith/avg@1", "val/greedy/gsm8k/avg@1"],
        ["val/response_length", "val/greedy/response_length"],
        ["val/truncated_ratio", "val/greedy/truncated_ratio"],
    ]
    # One data source: its panel would repeat the overall one. No greedy pass: the sampled accuracy.
    one_source = {t for t in logged if "gsm8k" not in t and "greedy" not in t}
    panels = dict(next(p for name, _, p in plot.figure_panels(one_source) if name == "validation"))
    assert "accuracy by data source" not in panels
    assert [tag for tag, _ in next(iter(panels.values()))] == ["val/avg@4", "val/pass@4", "val/maj@4"]


@needs_matplotlib
def test_a_metric_with_a_standard_error_is_drawn_with_a_band_of_one_se_either_side():
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D

    plot = load_tool("plot")
    run = {"val/avg@4": [(0, 0.25), (80, 0.5)], "val/avg@4_se": [(0, 0.0625), (80, 0.125)],
           "val/response_length": [(0, 12.0), (80, 9.0)]}  # no _se: no band
    ax = Figure().subplots()
    drawn = plot._draw_panel(ax, "accuracy", [("val/avg@4", "avg@4"), ("val/response_length", "length")], [run],
                             Line2D)
    assert drawn == {0} and len(ax.lines) == 2
    (band,) = ax.collections
    ys = band.get_paths()[0].vertices[:, 1]
    assert math.isclose(ys.min(), 0.25 - 0.0625) and math.isclose(ys.max(), 0.5 + 0.125)
    assert plot._band(run["val/avg@4"], [(0, 0.0625), (80, math.nan)]) == ((0,), [0.1875], [0.3125])  # NaN: no band


@needs_matplotlib
def test_a_full_evaluation_plots_to_a_readable_figure(tmp_path):
    plot = load_tool("plot")
    metrics = [_evaluation(0.25), _evaluation(0.625)]
    run = _write_run(str(tmp_path / "run" / "lightning_logs" / "version_0"),
                     {tag: [(0, metrics[0][tag]), (80, metrics[1][tag])] for tag in metrics[0]})
    (path,) = plot.plot_runs([run], str(tmp_path / "figures"))
    assert os.path.basename(path) == "validation.png"
    width, height = _png_size(path)
    assert width <= 1300 and height <= 900, (width, height)  # 2 x 2 panels (a panel per metric made 27 rows of 3)
    assert _has_colour(path, C0)


@needs_matplotlib
def test_plot_runs_writes_one_png_per_group_with_data(runs, tmp_path):
    plot = load_tool("plot")
    out = tmp_path / "figures"
    paths = plot.plot_runs(runs, str(out))
    # response, kl and step_time: logged by neither run, so no file.
    expected = [str(out / f"{name}.png") for name in ("reward", "validation", "entropy", "clipfrac")]
    assert paths == expected
    assert sorted(os.listdir(out)) == sorted(os.path.basename(p) for p in expected)
    for path in paths:
        width, height = _png_size(path)
        assert width >= 300 and height >= 200, (path, width, height)
        assert os.path.getsize(path) > 5_000, path
    # Runs overlaid in their own colours; a run with nothing in a group is not drawn there (nor in its legend).
    assert _has_colour(out / "reward.png", C0) and _has_colour(out / "reward.png", C1)
    assert _has_colour(out / "entropy.png", C0) and not _has_colour(out / "entropy.png", C1)
    assert _has_colour(out / "clipfrac.png", C1) and not _has_colour(out / "clipfrac.png", C0)


def test_labels_default_to_the_run_folder(runs, tmp_path):
    plot = load_tool("plot")
    assert [plot.default_label(d) for d in runs] == ["a/version_0", "b/version_0"]
    assert plot.default_label(str(tmp_path / "my-run")) == "my-run"
    with pytest.raises(ValueError, match="1 labels for 2 runs"):
        plot.plot_runs(runs, str(tmp_path / "out"), labels=["only-one"])


@needs_matplotlib
def test_a_folder_without_events_is_one_error_line(runs, tmp_path, capsys):
    plot = load_tool("plot")
    empty = tmp_path / "empty-run"
    empty.mkdir()
    out = tmp_path / "figures"
    with pytest.raises(plot.NoEventsError, match="empty-run: no TensorBoard event file"):
        plot.plot_runs([runs[0], str(empty)], str(out))
    assert not out.exists()  # every folder is checked before anything is written

    assert plot.main([runs[0], str(empty), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(empty) in err and not out.exists()
    assert plot.main([str(tmp_path / "missing"), "--out", str(out)]) == 2
    assert "missing: no such folder" in capsys.readouterr().err


def test_without_matplotlib_one_line_names_the_extra_and_the_command(runs, tmp_path, capsys, monkeypatch):
    # As if matplotlib were not installed: a None entry in sys.modules makes its import fail.
    for name in [n for n in sys.modules if n.split(".")[0] == "matplotlib"] + ["matplotlib"]:
        monkeypatch.setitem(sys.modules, name, None)
    plot = load_tool("plot")
    out = tmp_path / "figures"
    assert plot.main([runs[0], "--out", str(out)]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1, captured
    assert "matplotlib" in captured.err and "pip install -e '.[plot]'" in captured.err
    assert "Traceback" not in captured.err and not out.exists()
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        assert "matplotlib" in " ".join(tomllib.load(f)["project"]["optional-dependencies"]["plot"])


@needs_matplotlib
def test_cli_prints_the_paths_written(runs, tmp_path, capsys):
    plot = load_tool("plot")
    out = tmp_path / "figures"
    assert plot.main([runs[1], "--labels", "dapo", "--out", str(out)]) == 0
    *printed, last = capsys.readouterr().out.split()
    assert printed == [str(out / "reward.png"), str(out / "clipfrac.png")]
    assert all(os.path.isfile(p) for p in printed)
    assert last == "figures=2"


@needs_matplotlib
def test_compare_writes_figures_next_to_its_table(runs, tmp_path, capsys):
    compare = load_tool("compare")
    results = [{"method": "grpo", "log_dir": runs[0]}, {"method": "dapo", "log_dir": runs[1]},
               {"method": "vapo", "returncode": 1}]  # a failed run has no log folder: left out
    out = tmp_path / "figures"
    paths = compare.write_figures(results, str(out))
    assert [os.path.basename(p) for p in paths] == ["reward.png", "validation.png", "entropy.png", "clipfrac.png"]
    assert all(os.path.isfile(p) for p in paths)
    assert "figures in" in capsys.readouterr().out

    # A plotting failure costs only the figures, reported in one line.
    broken = [{"method": "grpo", "log_dir": str(tmp_path / "gone")}]
    assert compare.write_figures(broken, str(tmp_path / "figures2")) == []
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "figures not written" in err and "gone" in err
