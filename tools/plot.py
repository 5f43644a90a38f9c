"""Plot the curves of one or more runs from their TensorBoard logs, one PNG per group of metrics.

    .venv/bin/python tools/plot.py runs/grpo/lightning_logs/version_0 runs/dapo/lightning_logs/version_0 \\
        --labels grpo dapo --out runs/figures

A run folder is one holding event files (``events.out.tfevents.*``), such as ``lightning_logs/version_N``;
a ``default_root_dir`` works too and stands for its newest ``lightning_logs/version_N``. Runs are overlaid,
one colour each across every figure, labelled with ``--labels`` or the folder's name; the x axis is the
logged step (Lightning's ``global_step``: optimizer updates). Each metric of a group gets its own panel,
so metrics of different scales never share an axis. A metric that no run logged is left out, and a group
with none is not drawn. Needs matplotlib (``pip install -e '.[plot]'``).
"""

from __future__ import annotations

import argparse
import glob
import math
import os
import re
import sys

EVENTS = "events.out.tfevents.*"

# (file name, title, the metrics in panel order). None: every ``val/*`` metric the runs logged.
GROUPS: list[tuple[str, str, list[str] | None]] = [
    ("reward", "Reward and accuracy", ["train/reward/mean", "train/reward/accuracy"]),
    ("validation", "Validation", None),
    ("response", "Response length and truncation",
     ["train/response/length_mean", "train/response/length_max", "train/response/truncated_ratio"]),
    ("entropy", "Policy entropy", ["train/policy/entropy"]),
    ("clipfrac", "Clip fractions", ["train/policy/clipfrac_low", "train/policy/clipfrac_high"]),
    ("kl", "KL", ["train/policy/approx_kl", "train/policy/kl_ref"]),
    ("step_time", "Step time (s)", ["train/time/step"]),
]


class NoEventsError(ValueError):
    """A run folder without TensorBoard event files."""


def event_dir(run_dir: str) -> str:
    """The folder whose event files make up the run: ``run_dir`` itself, or else the newest
    ``run_dir/lightning_logs/version_N`` that has event files. Raises NoEventsError when there is none."""
    if glob.glob(os.path.join(run_dir, EVENTS)):
        return run_dir
    versions = [d for d in glob.glob(os.path.join(run_dir, "lightning_logs", "version_*"))
                if re.fullmatch(r"version_\d+", os.path.basename(d)) and glob.glob(os.path.join(d, EVENTS))]
    if versions:
        return max(versions, key=lambda d: int(d.rsplit("_", 1)[-1]))
    what = "no such folder" if not os.path.isdir(run_dir) else f"no TensorBoard event file ({EVENTS})"
    raise NoEventsError(f"plot: {run_dir}: {what}")


def read_scalars(run_dir: str) -> dict[str, list[tuple[int, float]]]:
    """Every scalar series of a run as ``{tag: [(step, value), ...]}`` in the order it was written
    (NaN kept). Raises NoEventsError when the folder has no event file."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    # size_guidance 0 keeps every point (the default samples 10,000 per tag); no purge, so a step that
    # goes backwards is shown as written rather than silently dropping what came after it.
    acc = EventAccumulator(event_dir(run_dir), size_guidance={"scalars": 0}, purge_orphaned_data=False)
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def default_label(run_dir: str) -> str:
    """The run folder's name; ``<root>/version_N`` for a Lightning version folder, whose bare name
    would be the same for every run."""
    path = os.path.normpath(os.path.abspath(run_dir))
    name, parent = os.path.basename(path), os.path.dirname(path)
    if re.fullmatch(r"version_\d+", name) and os.path.basename(parent) == "lightning_logs":
        return f"{os.path.basename(os.path.dirname(parent))}/{name}"
    return name


def group_metrics(metrics: list[str] | None, logged: set[str]) -> list[str]:
    """The metrics of a group that at least one run logged, in panel order."""
    if metrics is None:  # validation: overall metrics first, then per data source
        return sorted((t for t in logged if t.startswith("val/")), key=lambda t: (t.count("/"), t))
    return [m for m in metrics if m in logged]


def plot_runs(run_dirs: list[str], out_dir: str, labels: list[str] | None = None) -> list[str]:
    """Write ``<out_dir>/<group>.png`` for each group of GROUPS that any run logged; return the paths.

    Every run folder is checked before anything is written (NoEventsError names the first without
    event files)."""
    if not run_dirs:
        raise ValueError("plot: no run folder given")
    if labels is not None and len(labels) != len(run_dirs):
        raise ValueError(f"plot: {len(labels)} labels for {len(run_dirs)} runs")
    labels = labels or [default_label(d) for d in run_dirs]
    runs = [read_scalars(d) for d in run_dirs]
    logged = set().union(*runs)

    from matplotlib.figure import Figure  # a bare Figure: no pyplot state, no GUI backend

    os.makedirs(out_dir, exist_ok=True)
    written = []
    for name, title, metrics in GROUPS:
        panels = group_metrics(metrics, logged)
        if not panels:
            continue
        ncols = min(3, len(panels))
        nrows = math.ceil(len(panels) / ncols)
        fig = Figure(figsize=(4.5 * ncols, 3.2 * nrows + 0.6), layout="constrained")
        axes = fig.subplots(nrows, ncols, squeeze=False).ravel()
        for ax, tag in zip(axes, panels):
            for i, (label, scalars) in enumerate(zip(labels, runs)):
                points = scalars.get(tag)
                if not points:
                    continue
                steps, values = zip(*points)
                # Markers where a curve has few points (validation before/after): a lone point draws no line.
                ax.plot(steps, values, color=f"C{i % 10}", label=label, linewidth=1.2,
                        marker="o" if len(points) <= 50 else None, markersize=3)
            ax.set_title(tag, fontsize=9)
            ax.set_xlabel("step")
            ax.grid(alpha=0.3)
        for ax in axes[len(panels):]:
            ax.set_visible(False)
        handles = {}  # one legend entry per run that appears in the figure, in run order
        for ax in axes[:len(panels)]:
            for h, lab in zip(*ax.get_legend_handles_labels()):
                handles.setdefault(lab, h)
        order = [lab for lab in labels if lab in handles]
        fig.legend([handles[lab] for lab in order], order, loc="outside lower center",
                   ncols=min(len(order), 4), fontsize=8)
        fig.suptitle(title)
        path = os.path.join(out_dir, f"{name}.png")
        fig.savefig(path, dpi=100)
        written.append(path)
    return written


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR",
                   help="Folders with TensorBoard event files (lightning_logs/version_N, or a default_root_dir).")
    p.add_argument("--labels", nargs="+", help="One legend label per run (default: the folder's name).")
    p.add_argument("--out", required=True, help="Folder for the PNGs.")
    args = p.parse_args(argv)
    if args.labels is not None and len(args.labels) != len(args.run_dirs):
        p.error(f"{len(args.labels)} labels for {len(args.run_dirs)} runs")
    try:
        paths = plot_runs(args.run_dirs, args.out, args.labels)
    except NoEventsError as e:
        print(e, file=sys.stderr)
        return 2
    if not paths:
        print("plot: none of the plotted metrics is in these runs; nothing written", file=sys.stderr)
    for path in paths:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
