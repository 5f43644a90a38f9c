"""tools/plot.py: scalars read back from event files as written, one PNG per metric group that has data,
runs overlaid in their own colours, and a clear error for a folder without events; tools/compare.py's
figures next to its table."""

import importlib.util
import math
import os
import struct

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
C0, C1 = (0x1F, 0x77, 0xB4), (0xFF, 0x7F, 0x0E)  # matplotlib's first two cycle colours: run 0 and run 1

# Two runs with known scalars (values exact in float32, which is what the event files store).
RUN_A = {
    "train/reward/mean": [(0, 0.25), (1, 0.5), (2, 0.75)],
    "train/reward/accuracy": [(0, 0.0), (1, 0.5), (2, 1.0)],
    "train/policy/entropy": [(0, 1.5), (1, 1.25), (2, math.nan)],  # NaN kept, not dropped
    "val/accuracy": [(0, 0.125), (2, 0.375)],  # before and after only
    "val/arith/accuracy": [(0, 0.25), (2, 0.5)],
    "epoch": [(0, 0.0), (2, 0.0)],  # logged by Lightning, in no group
}
RUN_B = {
    "train/reward/mean": [(0, 0.5), (1, 0.25), (2, 0.0), (3, 0.5)],
    "train/policy/clipfrac_high": [(1, 0.0625), (3, 0.125)],
}


def _tool(name: str):
    spec = importlib.util.spec_from_file_location(f"rllight_{name}_tool", os.path.join(ROOT, "tools", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


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
    plot = _tool("plot")
    a = plot.read_scalars(runs[0])
    assert set(a) == set(RUN_A)
    for tag, points in RUN_A.items():
        if tag == "train/policy/entropy":
            continue
        assert a[tag] == points, tag
    entropy = a["train/policy/entropy"]
    assert entropy[:2] == [(0, 1.5), (1, 1.25)] and entropy[2][0] == 2 and math.isnan(entropy[2][1])
    assert plot.read_scalars(runs[1]) == RUN_B


def test_a_root_dir_stands_for_its_newest_version(tmp_path):
    plot = _tool("plot")
    root = tmp_path / "run"
    _write_run(str(root / "lightning_logs" / "version_9"), {"train/reward/mean": [(0, 0.25)]})
    _write_run(str(root / "lightning_logs" / "version_10"), {"train/reward/mean": [(0, 0.75)]})
    (root / "lightning_logs" / "version_11").mkdir()  # started, no events yet: not a candidate
    assert plot.event_dir(str(root)) == str(root / "lightning_logs" / "version_10")  # 10 > 9 as numbers
    assert plot.read_scalars(str(root)) == {"train/reward/mean": [(0, 0.75)]}


def test_plot_runs_writes_one_png_per_group_with_data(runs, tmp_path):
    plot = _tool("plot")
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
    plot = _tool("plot")
    assert [plot.default_label(d) for d in runs] == ["a/version_0", "b/version_0"]
    assert plot.default_label(str(tmp_path / "my-run")) == "my-run"
    assert plot.group_metrics(None, set(RUN_A)) == ["val/accuracy", "val/arith/accuracy"]  # overall first
    with pytest.raises(ValueError, match="1 labels for 2 runs"):
        plot.plot_runs(runs, str(tmp_path / "out"), labels=["only-one"])


def test_a_folder_without_events_is_one_error_line(runs, tmp_path, capsys):
    plot = _tool("plot")
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


def test_cli_prints_the_paths_written(runs, tmp_path, capsys):
    plot = _tool("plot")
    out = tmp_path / "figures"
    assert plot.main([runs[1], "--labels", "dapo", "--out", str(out)]) == 0
    printed = capsys.readouterr().out.split()
    assert printed == [str(out / "reward.png"), str(out / "clipfrac.png")]
    assert all(os.path.isfile(p) for p in printed)


def test_compare_writes_figures_next_to_its_table(runs, tmp_path, capsys):
    compare = _tool("compare")
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
