"""The before/after table of a finished run, read back from the evaluations it saved.

A fit with ``evaluate_before_after`` saves each evaluation under ``<log dir>/evaluation/`` (``val_step<N>.json`` and
``val_step<N>_rows.jsonl``, and ``val_step<N>_greedy...`` for the greedy pass). This prints, for each run folder given,
the table the run printed at its end (``rllight.evaluation.before_after``: each metric before and after with the
difference's standard error, paired over the same prompts, and the headline metric per data source), recomputed from
the saved rows, so runs made before a row was added to that table can be read with it too::

    .venv/bin/python tools/before_after.py runs/reasoning-gym-s0/lightning_logs/version_0 [more run folders]

The first evaluation (the lowest step) is "before", the last "after". Each run's last line is
``<folder> <metric> <before> <after> <difference> <se>`` for the headline metric overall and per data source (the
metric the table shows per data source: the greedy accuracy, else avg@k, e.g. an environment recipe's greedy avg@1).
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from rllight.evaluation import before_after, read_evaluation  # noqa: E402


def evaluations(folder: str) -> list[int]:
    """The steps of the evaluations saved under ``folder/evaluation``, in order."""
    names = glob.glob(os.path.join(folder, "evaluation", "val_step*.json"))
    return sorted({int(m.group(1)) for m in (re.fullmatch(r"val_step(\d+)\.json", os.path.basename(n)) for n in names)
                   if m})


def read_step(folder: str, step: int) -> tuple[dict, dict]:
    """One evaluation's metrics and per-prompt values, its greedy pass merged in where there is one."""
    directory = os.path.join(folder, "evaluation")
    metrics, per_prompt = read_evaluation(directory, f"val_step{step}")
    if os.path.exists(os.path.join(directory, f"val_step{step}_greedy.json")):
        greedy, greedy_per_prompt = read_evaluation(directory, f"val_step{step}_greedy")
        metrics, per_prompt = {**metrics, **greedy}, {**per_prompt, **greedy_per_prompt}
    return metrics, per_prompt


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folders", nargs="+", help="Run log folders (holding evaluation/val_step<N>.json).")
    args = parser.parse_args(argv)
    for folder in args.folders:
        steps = evaluations(folder)
        if len(steps) < 2:
            parser.error(f"{folder}: needs two evaluations under {folder}/evaluation (found steps {steps}); run the fit "
                         "with evaluate_before_after: true")
        (before, before_pp), (after, after_pp) = read_step(folder, steps[0]), read_step(folder, steps[-1])
        summary, lines = before_after(before, after, before_pp, after_pp)
        print(f"{folder}: step {steps[0]} -> step {steps[-1]}, {int(after.get('val/prompts', 0))} prompts")
        for line in lines:
            print("  " + line)
        # The headline: the metric shown per data source (greedy accuracy, else avg@k), else the first one of the table.
        paired = [name for name, row in summary.items() if "difference_se" in row]
        per_source = [name for name in paired if " / " in name]
        headline = per_source[0].split(" / ")[0] if per_source else paired[0] if paired else None
        for name, row in summary.items():
            if name in paired and (name == headline or name.startswith(f"{headline} / ")):
                print(f"{folder} {name.replace(' ', '_')} {row['before']:.3f} {row['after']:.3f} "
                      f"{row['difference']:+.3f} {row['difference_se']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
