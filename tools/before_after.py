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

``--record PATH --command "<the fit command that made the runs>"`` also writes the tables as one record for
docs/results/ (``rllight.app.records``; the quickstart's and reasoning-gym's results): one row per run (its seed from the
config it saved; the headline metric before, after, the difference and its paired standard error, the other metrics
before and after, the truncation, and the headline per data source where there are several), values as printed, and
in the summary the mean over the runs of the headline before, after and the difference (``gain_mean``). rllight
saves no command line in a run's folder (its config.yaml is the resolved recipe), so ``--command`` is needed::

    .venv/bin/python tools/before_after.py runs/qs-s0/lightning_logs/version_0 runs/qs-s1/lightning_logs/version_0 \
        --record docs/results/quickstart.json --command "rllight fit --config recipes/quickstart.yaml ..."
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import statistics
import sys

import yaml

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from rllight.evaluation import before_after, read_evaluation  # noqa: E402
from rllight.app.records import add_record_options, check_record_options, printed, tool_record  # noqa: E402


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


def greedy_curve(folder: str) -> list[list[float]]:
    """``[RL steps, greedy accuracy]`` of each evaluation a run saved (``evaluation/val_step<N>_greedy.json``, its
    ``val/greedy/avg@1`` as logged), in order of RL steps: before training at 0, any during it, the one after."""
    points = []
    for path in glob.glob(os.path.join(folder, "evaluation", "val_step*_greedy.json")):
        with open(path) as f:
            saved = json.load(f)
        points.append([int(saved["rl_step"]), float(saved["metrics"]["val/greedy/avg@1"])])
    return sorted({p[0]: p for p in points}.values())


def headline_of(summary: dict) -> str | None:
    """The run's headline metric: the one shown per data source (greedy accuracy, else avg@k), else the table's
    first paired one."""
    paired = [name for name, row in summary.items() if "difference_se" in row]
    per_source = [name for name in paired if " / " in name]
    return per_source[0].split(" / ")[0] if per_source else paired[0] if paired else None


def key_of(label: str) -> str:
    """A record's column key for a table's metric: ``greedy accuracy`` -> ``greedy``, ``avg@4`` -> ``avg4``,
    ``greedy accuracy / chain_sum`` -> ``chain_sum``, ``truncated_ratio`` -> ``truncated``."""
    label = label.split(" / ")[-1] if " / " in label else label
    return {"greedy accuracy": "greedy", "truncated_ratio": "truncated"}.get(label, label.replace("@", ""))


def record_row(folder: str, summary: dict, headline: str | None, prompts: int) -> tuple[dict, list]:
    """One run's row of the record (values as the table prints them) and its columns."""
    seed = None
    config = os.path.join(folder, "config.yaml")
    if os.path.isfile(config):
        with open(config) as f:
            seed = (yaml.safe_load(f) or {}).get("seed_everything")
    row, columns = {"run": folder, "seed": seed, "prompts": prompts}, [["run", "run"], ["seed", "seed"],
                                                                        ["prompts", "prompts"]]
    for name, values in summary.items():
        shown = name.split(" / ")[-1] + (" " + name.split(" / ")[0] if " / " in name else "")
        key = key_of(name)
        parts = [("before", "before", "before", ".3f"), ("after", "after", "after", ".3f")]
        if name == headline or name.startswith(f"{headline} / "):
            parts += [("gain", "difference", "difference", "+.3f"), ("gain_se", "± se", "difference_se", ".3f")]
        elif "difference_se" not in values and name != "truncated_ratio":
            continue  # response length, turns: not in the record
        for suffix, label, field, spec in parts:
            row[f"{key}_{suffix}"] = printed(values.get(field), spec)
            columns.append([f"{key}_{suffix}", f"{shown} {label}", spec])
    return row, columns


def write(args: argparse.Namespace, runs: list[tuple[str, dict, str | None, int]]) -> None:
    """The record of the runs' tables (``--record``): a row each, the mean of the headline over them."""
    rows, columns = [], []
    for folder, summary, headline, prompts in runs:
        row, row_columns = record_row(folder, summary, headline, prompts)
        rows.append(row)
        columns += [c for c in row_columns if c[0] not in {k for k, *_ in columns}]
    headlines = {headline for _, _, headline, _ in runs}
    if len(headlines) != 1 or None in headlines:
        raise SystemExit(f"before_after: --record: the runs' headline metrics differ ({sorted(map(str, headlines))}); "
                         "record runs of the same evaluation together")
    (headline,) = headlines
    per_run = [summary[headline] for _, summary, _, _ in runs]
    gains = [r["difference"] for r in per_run]
    mean = {"before": statistics.fmean(r["before"] for r in per_run),
            "after": statistics.fmean(r["after"] for r in per_run), "gain_mean": statistics.fmean(gains)}
    summary = {k: printed(v, ".4f") for k, v in mean.items()}
    summary["runs"] = len(runs)
    if len(gains) > 1:
        summary["gain_se"] = printed(statistics.stdev(gains) / len(gains) ** 0.5, ".4f")
    prompts = sorted({p for *_, p in runs})
    tool_record(
        args, id="before-after", section="Quickstart", command=args.command, columns=columns, rows=rows,
        title=f"{headline} before and after training, {len(runs)} run{'s' if len(runs) > 1 else ''}",
        note=f"Each run evaluated before and after training on the same {'/'.join(map(str, prompts))} held-out "
             "problems; ± the standard error of the difference, paired over the problems; read back from each run's "
             "saved evaluations by tools/before_after.py.",
        summary=summary,
        headline=f"{headline} {{before:.3f}} → {{after:.3f}} ({{gain_mean:+.3f}}, "
                 + ("mean of {runs} runs)" if len(runs) > 1 else "one run)"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folders", nargs="+", help="Run log folders (holding evaluation/val_step<N>.json).")
    parser.add_argument("--command", help="With --record: the fit command that made the runs, the record's command.")
    add_record_options(parser, id="before-after", section="Quickstart")
    args = parser.parse_args(argv)
    if args.record and not args.command:
        parser.error("--record needs --command: the fit command that made the runs (rllight saves no command line in "
                     "a run's folder)")
    check_record_options(parser, args, argv, __file__)
    runs, printout = [], []
    for folder in args.folders:
        steps = evaluations(folder)
        if len(steps) < 2:
            parser.error(f"{folder}: needs two evaluations under {folder}/evaluation (found steps {steps}); run the "
                         "fit with evaluate_before_after: true")
        (before, before_pp), (after, after_pp) = read_step(folder, steps[0]), read_step(folder, steps[-1])
        summary, lines = before_after(before, after, before_pp, after_pp)
        printout.append(f"{folder}: step {steps[0]} -> step {steps[-1]}, {int(after.get('val/prompts', 0))} prompts")
        printout += ["  " + line for line in lines]
        headline = headline_of(summary)
        for name, row in summary.items():
            if "difference_se" in row and (name == headline or name.startswith(f"{headline} / ")):
                printout.append(f"{folder} {name.replace(' ', '_')} {row['before']:.3f} {row['after']:.3f} "
                                f"{row['difference']:+.3f} {row['difference_se']:.3f}")
        runs.append((folder, summary, headline, int(after.get("val/prompts", 0))))
    if args.record:
        write(args, runs)
    for line in printout:
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
