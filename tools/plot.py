"""Plot the curves of one or more runs from their TensorBoard logs, one PNG per group of metrics.

    .venv/bin/python tools/plot.py runs/grpo runs/dapo --labels grpo dapo --out runs/figures

A run is a ``default_root_dir``, whose ``lightning_logs/version_N`` folders are joined into one curve (a resumed
run writes a new version; see ``read_scalars``), or one folder holding event files (``events.out.tfevents.*``),
such as a single ``version_N``. Runs are overlaid, one colour each across every figure, labelled with
``--labels`` or the folder's name. Each group is one figure of a few panels; metrics of one kind and scale share
a panel, told apart by line style and marker, and a metric logged with its standard error (``<metric>_se``: the
evaluation's avg@k, pass@k and maj@k) is drawn with a band of one standard error either side. The x axis is the
logged step: RL steps (rollouts), counted from 1 as the progress lines count them, an evaluation at the RL steps
done before it (0 before training). A metric that no run logged is left out, and a
panel or group with none is not drawn. Prints the paths written, then ``figures=<how many>``. Needs matplotlib
(the extra ``plot``: ``pip install -e '.[plot]'``).
"""

from __future__ import annotations

import argparse
import glob
import math
import os
import re
import sys
from collections.abc import Callable

EVENTS = "events.out.tfevents.*"
SE_SUFFIX = "_se"
MISSING_MATPLOTLIB = ("plot: needs matplotlib, in rllight's extra 'plot': pip install -e '.[plot]' "
                      "(or bash tools/install.sh plot)")

Series = list[tuple[str, str]]
"""The curves of a panel: ``(tag, legend label)`` in drawing order."""


def _fixed(*tags: str) -> Callable[[set[str]], Series]:
    """A panel of these tags, labelled by their last part."""
    return lambda logged: [(t, t.rsplit("/", 1)[-1]) for t in tags if t in logged]


_AT_K = re.compile(r"val/(avg|pass|maj)@(\d+)")
_SOURCE_AT_K = re.compile(r"val/(?!greedy/)(.+)/(avg|pass|maj)@\d+")  # a source may hold a slash: openai/gsm8k


def _largest_k(logged: set[str]) -> int | None:
    """The largest k of the overall ``val/avg@k`` / ``pass@k`` / ``maj@k`` the runs logged (None: none)."""
    ks = [int(m.group(2)) for t in logged if (m := _AT_K.fullmatch(t))]
    return max(ks) if ks else None


def _val_label(tag: str) -> str:
    return tag.removeprefix("val/")


def _validation_accuracy(logged: set[str]) -> Series:
    """Greedy accuracy and, at the largest k, avg@k, pass@k and maj@k (a smaller k estimates the same avg@k with
    a larger error, and pass@1 = maj@1 = avg@1); ``val/accuracy`` only when it is the one there is."""
    k = _largest_k(logged)
    tags = ["val/greedy/avg@1"] + ([f"val/{name}@{k}" for name in ("avg", "pass", "maj")] if k else [])
    series = [(t, _val_label(t)) for t in tags if t in logged]
    return series or _fixed("val/accuracy")(logged)


def _sources(logged: set[str]) -> list[str]:
    """The data sources of a per-source evaluation (``val/<source>/avg@k``), sorted."""
    return sorted({m.group(1) for t in logged if (m := _SOURCE_AT_K.fullmatch(t))})


def _validation_by_source(logged: set[str]) -> Series:
    """Per data source, the headline accuracy (greedy where logged, else avg@k at the largest k); drawn only with
    two sources or more (with one, it repeats the overall panel)."""
    sources, k = _sources(logged), _largest_k(logged)
    if len(sources) < 2:
        return []
    series = []
    for source in sources:
        greedy, sampled = f"val/greedy/{source}/avg@1", f"val/{source}/avg@{k}"
        tag = greedy if greedy in logged else sampled
        if tag in logged:
            series.append((tag, _val_label(tag)))
    return series


def _validation_pair(name: str) -> Callable[[set[str]], Series]:
    """``val/<name>`` and its greedy pass's ``val/greedy/<name>``."""
    return lambda logged: [(t, _val_label(t)) for t in (f"val/{name}", f"val/greedy/{name}") if t in logged]


# (file name, title, [(panel title, the panel's curves from the tags the runs logged), ...])
GROUPS: list[tuple[str, str, list[tuple[str, Callable[[set[str]], Series]]]]] = [
    ("reward", "Reward and accuracy", [("reward", _fixed("train/reward/mean")),
                                       ("accuracy", _fixed("train/reward/accuracy"))]),
    ("validation", "Validation", [("accuracy (band: ± 1 standard error)", _validation_accuracy),
                                  ("accuracy by data source", _validation_by_source),
                                  ("response length (tokens)", _validation_pair("response_length")),
                                  ("truncated ratio", _validation_pair("truncated_ratio"))]),
    ("response", "Response length and truncation",
     [("length (tokens)", _fixed("train/response/length_mean", "train/response/length_max")),
      ("truncated ratio", _fixed("train/response/truncated_ratio"))]),
    ("entropy", "Policy entropy", [("entropy", _fixed("train/policy/entropy"))]),
    ("clipfrac", "Clip fractions", [("clip fraction", _fixed("train/policy/clipfrac_low",
                                                              "train/policy/clipfrac_high"))]),
    ("kl", "KL", [("approx_kl (to the behaviour policy)", _fixed("train/policy/approx_kl")),
                  ("kl_ref (to the reference)", _fixed("train/policy/kl_ref"))]),
    ("step_time", "Step time (s)", [("seconds per step", _fixed("train/time/step"))]),
]

LINE_STYLES = [("-", "o"), ("--", "s"), (":", "^"), ("-.", "D"), ((0, (5, 1, 1, 1)), "v"), ((0, (1, 3)), "P")]
"""Line style and marker of a panel's first, second, ... curve (colour tells the runs apart)."""


class NoEventsError(ValueError):
    """A run folder without TensorBoard event files."""


class MissingExtraError(RuntimeError):
    """An optional dependency of this tool is not installed; the message names the extra and the command."""


def _versions(run_dir: str) -> list[str]:
    """``run_dir/lightning_logs/version_N`` folders that hold event files, by N (numerically)."""
    versions = [d for d in glob.glob(os.path.join(run_dir, "lightning_logs", "version_*"))
                if re.fullmatch(r"version_\d+", os.path.basename(d)) and glob.glob(os.path.join(d, EVENTS))]
    return sorted(versions, key=lambda d: int(d.rsplit("_", 1)[-1]))


def _no_events(run_dir: str) -> NoEventsError:
    what = "no such folder" if not os.path.isdir(run_dir) else f"no TensorBoard event file ({EVENTS})"
    return NoEventsError(f"plot: {run_dir}: {what}")


def event_dirs(run_dir: str) -> list[str]:
    """The folders whose event files make up the run, oldest first: ``run_dir`` itself if it holds event files,
    else every ``run_dir/lightning_logs/version_N`` that does. Raises NoEventsError when there is none."""
    if glob.glob(os.path.join(run_dir, EVENTS)):
        return [run_dir]
    versions = _versions(run_dir)
    if not versions:
        raise _no_events(run_dir)
    return versions


def event_dir(run_dir: str) -> str:
    """The run's newest event folder (``run_dir`` itself, or its newest ``lightning_logs/version_N``), where
    its last ``eval_summary.json`` is. Raises NoEventsError when there is none."""
    return event_dirs(run_dir)[-1]


def _read_event_dir(folder: str) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    # size_guidance 0 keeps every point (the default samples 10,000 per tag); no purge, so a step that
    # goes backwards is shown as written rather than silently dropping what came after it.
    acc = EventAccumulator(folder, size_guidance={"scalars": 0}, purge_orphaned_data=False)
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def read_scalars(run_dir: str) -> dict[str, list[tuple[int, float]]]:
    """Every scalar series of a run as ``{tag: [(step, value), ...]}`` (NaN kept). Raises NoEventsError when
    the folder has no event file.

    A ``default_root_dir`` with several versions is one run resumed: each version continues the curves from its
    first logged step, and what the earlier versions logged at that step or later is dropped (a resume from a
    checkpoint redoes the steps after it; a fresh run in the same folder starts at 0 and so replaces them all).
    Within a version, points are kept in the order written."""
    joined: dict[str, list[tuple[int, float]]] = {}
    for folder in event_dirs(run_dir):
        scalars = _read_event_dir(folder)
        steps = [step for points in scalars.values() for step, _ in points]
        if not steps:
            continue
        start = min(steps)
        joined = {tag: [p for p in points if p[0] < start] for tag, points in joined.items()}
        for tag, points in scalars.items():
            joined.setdefault(tag, []).extend(points)
    return {tag: points for tag, points in joined.items() if points}


def default_label(run_dir: str) -> str:
    """The run folder's name; ``<root>/version_N`` for a Lightning version folder, whose bare name
    would be the same for every run."""
    path = os.path.normpath(os.path.abspath(run_dir))
    name, parent = os.path.basename(path), os.path.dirname(path)
    if re.fullmatch(r"version_\d+", name) and os.path.basename(parent) == "lightning_logs":
        return f"{os.path.basename(os.path.dirname(parent))}/{name}"
    return name


def _matplotlib():
    """matplotlib's ``(Figure, Line2D)``, or MissingExtraError naming the extra that installs it."""
    try:
        from matplotlib.figure import Figure  # a bare Figure: no pyplot state, no GUI backend
        from matplotlib.lines import Line2D
    except ImportError:
        raise MissingExtraError(MISSING_MATPLOTLIB) from None
    return Figure, Line2D


def _band(points: list[tuple[int, float]], se_points: list[tuple[int, float]] | None):
    """``(steps, low, high)`` of ± one standard error at the steps that have both a value and a finite error."""
    if not se_points:
        return None
    se = dict(se_points)
    kept = [(s, v, se[s]) for s, v in points if s in se and math.isfinite(se[s]) and math.isfinite(v)]
    if not kept:
        return None
    steps, values, errors = zip(*kept)
    return steps, [v - e for v, e in zip(values, errors)], [v + e for v, e in zip(values, errors)]


def _draw_panel(ax, title: str, series: Series, runs: list[dict], Line2D) -> set[int]:
    """Draw each of ``series`` for every run that logged it (colour: the run; line style and marker: the curve;
    a band of ± one standard error where ``<tag>_se`` was logged); return the indices of the runs drawn."""
    drawn = set()
    for j, (tag, _) in enumerate(series):
        style, marker = LINE_STYLES[j % len(LINE_STYLES)]
        for i, scalars in enumerate(runs):
            points = scalars.get(tag)
            if not points:
                continue
            colour = f"C{i % 10}"
            steps, values = zip(*points)
            # Markers where a curve has few points (validation before/after): a lone point draws no line.
            ax.plot(steps, values, color=colour, linestyle=style, linewidth=1.3,
                    marker=marker if len(points) <= 50 else None, markersize=4)
            band = _band(points, scalars.get(tag + SE_SUFFIX))
            if band is not None:
                ax.fill_between(*band, color=colour, alpha=0.15, linewidth=0)
            drawn.add(i)
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("RL step")
    ax.grid(alpha=0.3)
    if len(series) > 1:  # the curves' key, by line style (in black: colour is the run's)
        keys = [Line2D([], [], color="black", linestyle=style, marker=marker, markersize=4)
                for style, marker in (LINE_STYLES[j % len(LINE_STYLES)] for j in range(len(series)))]
        ax.legend(keys, [label for _, label in series], fontsize=8, loc="best")
    return drawn


def figure_panels(logged: set[str]) -> list[tuple[str, str, list[tuple[str, Series]]]]:
    """What to draw for runs that logged the tags ``logged``: ``(file name, title, [(panel title, curves), ...])``
    for each group of GROUPS, less the panels without a curve and the groups without a panel."""
    figures = []
    for name, title, panel_specs in GROUPS:
        panels = [(panel_title, series) for panel_title, curves in panel_specs if (series := curves(logged))]
        if panels:
            figures.append((name, title, panels))
    return figures


def plot_runs(run_dirs: list[str], out_dir: str, labels: list[str] | None = None) -> list[str]:
    """Write ``<out_dir>/<group>.png`` for each group of GROUPS that any run logged; return the paths.

    matplotlib and every run folder are checked before anything is written (MissingExtraError names the extra;
    NoEventsError the first folder without event files)."""
    if not run_dirs:
        raise ValueError("plot: no run folder given")
    if labels is not None and len(labels) != len(run_dirs):
        raise ValueError(f"plot: {len(labels)} labels for {len(run_dirs)} runs")
    Figure, Line2D = _matplotlib()
    labels = labels or [default_label(d) for d in run_dirs]
    runs = [read_scalars(d) for d in run_dirs]
    logged = set().union(*runs)

    os.makedirs(out_dir, exist_ok=True)
    written = []
    for name, title, panels in figure_panels(logged):
        ncols = min(2, len(panels))
        nrows = math.ceil(len(panels) / ncols)
        fig = Figure(figsize=(6 * ncols, 3.8 * nrows + 0.8), layout="constrained")
        axes = fig.subplots(nrows, ncols, squeeze=False).ravel()
        drawn = set()  # the runs drawn in this figure (their index)
        for ax, (panel_title, series) in zip(axes, panels):
            drawn |= _draw_panel(ax, panel_title, series, runs, Line2D)
        for ax in axes[len(panels):]:
            ax.set_visible(False)
        handles = [Line2D([], [], color=f"C{i % 10}", linewidth=2) for i in sorted(drawn)]
        fig.legend(handles, [labels[i] for i in sorted(drawn)], loc="outside lower center",
                   ncols=min(len(drawn), 4), fontsize=9)
        fig.suptitle(title)
        path = os.path.join(out_dir, f"{name}.png")
        fig.savefig(path, dpi=100)
        written.append(path)
    return written


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR",
                   help="A run's default_root_dir (its lightning_logs/version_N joined) or a folder with "
                        "TensorBoard event files.")
    p.add_argument("--labels", nargs="+", help="One legend label per run (default: the folder's name).")
    p.add_argument("--out", required=True, help="Folder for the PNGs.")
    args = p.parse_args(argv)
    if args.labels is not None and len(args.labels) != len(args.run_dirs):
        p.error(f"{len(args.labels)} labels for {len(args.run_dirs)} runs")
    try:
        paths = plot_runs(args.run_dirs, args.out, args.labels)
    except (NoEventsError, MissingExtraError) as e:
        print(e, file=sys.stderr)
        return 2
    if not paths:
        print("plot: none of the plotted metrics is in these runs; nothing written", file=sys.stderr)
    for path in paths:
        print(path)
    print(f"figures={len(paths)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
