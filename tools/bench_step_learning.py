"""tools/bench_step.py's learning per step (``--heldout``, ``--summarize``): the held-out greedy accuracy of the
starting model and of each side's final model, all evaluated by the same ``rllight validate`` (``evaluate``,
``learning``), and the learning table of one run or several, printed and recorded (``print_learning``,
``record_learning``)."""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import sys

import yaml
from bench_step_sides import (CURVE, CURVE_BLOCKS, ENGINES, LEARNING, MAX_NEW_TOKENS, RLLIGHT_CHILD, ROOT, TEMPERATURE,
                              TRL_CURVE, data_config, run_logged, versions)

from rllight.app.records import printed, tool_record

def evaluate(args: argparse.Namespace, name: str, model_dir: str) -> tuple[dict[str, float], dict[str, str]]:
    """Greedy correctness (0/1) of the model folder on each of the ``--heldout`` problems, by ``rllight
    validate`` (the recipe with the HF engine at ``MAX_NEW_TOKENS``, one greedy response per problem, scored by
    the recipe's reward), keyed by the problem's source row, and each problem's task (its ``data_source``).
    Every side's final model and the starting model go through this same code."""
    config = {
        "seed_everything": args.seed,
        # float32 whatever --precision: every model folder evaluated by the same computation
        "trainer": {"precision": "32-true", "limit_val_batches": 1.0, "enable_progress_bar": False,
                    "enable_model_summary": False,
                    "default_root_dir": os.path.join(args.out, name),
                    "logger": {"class_path": "lightning.pytorch.loggers.CSVLogger",
                               "init_args": {"save_dir": args.out, "name": name}}},
        "model": {"model": {"class_path": "rllight.models.HFModel", "init_args": {"path": model_dir}},
                  "rollout": {"class_path": ENGINES["hf"],
                              "init_args": {"max_new_tokens": MAX_NEW_TOKENS, "temperature": TEMPERATURE}},
                  "evaluation": {"n": 1, "temperature": 0.0, "ks": [1], "also_greedy": False},
                  "export_dir": None},
        "data": data_config(args, val_size=args.heldout),
    }
    path = os.path.join(args.out, f"{name}.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(config, f, sort_keys=False)
    _, logs = run_logged(args, name, [sys.executable, "-c", RLLIGHT_CHILD, "validate", "--config", args.recipe,
                                      "--config", path])
    rows = glob.glob(os.path.join(logs, "**", "val_step0_rows.jsonl"), recursive=True) if logs else []
    if not rows:
        raise SystemExit(f"bench_step: {name} wrote no val_step0_rows.jsonl under {os.path.join(args.out, name)}")
    with open(rows[0]) as f:
        records = [json.loads(line) for line in f]
    if len(records) != args.heldout:
        raise SystemExit(f"bench_step: {name} evaluated {len(records)} of the {args.heldout} held-out problems; "
                         f"see {rows[0]}")
    return {r["source"]: float(r["correct"][0]) for r in records}, {r["source"]: r["data_source"] for r in records}


def by_task(correct: dict[str, float], tasks: dict[str, str]) -> dict[str, float]:
    """Accuracy on each task's problems (``correct`` and ``tasks`` keyed by problem), tasks by name."""
    grouped: dict[str, list[float]] = {}
    for source, value in correct.items():
        grouped.setdefault(tasks[source], []).append(value)
    return {task: statistics.fmean(grouped[task]) for task in sorted(grouped)}


def learning(args: argparse.Namespace, rllight: dict, trl: dict | None) -> dict:
    """Held-out greedy accuracy of the starting model and of each side's final model (the gain's standard error
    paired over the problems), and each side's per-step reward, entropy and length; written to
    ``<out>/learning.json``."""
    from rllight.evaluation import paired_se
    from rllight.models import SmolLM2Package

    base, tasks = evaluate(args, "eval-start", args.model_dir or SmolLM2Package().resolve())
    out = {"seed": args.seed, "steps": args.steps, "train_prompts": args.train_prompts, "heldout": args.heldout,
           "recipe": os.path.relpath(args.recipe, ROOT), "overrides": args.overrides,
           "trl_loss_type": args.trl_loss_type if trl is not None else None,
           "start": statistics.fmean(base.values()), "start_by_task": by_task(base, tasks),
           "task_sizes": {task: sum(t == task for t in tasks.values()) for task in sorted(set(tasks.values()))},
           "sides": {}}
    sides = [("rllight", os.path.join(args.out, "rllight", "final"), rllight["curve"])]
    if trl is not None:
        sides.append(("trl", os.path.join(args.out, "trl", "final"),
                      {name: trl["logs"][key] for name, key in TRL_CURVE.items()}))
    for name, folder, curve in sides:
        after, _ = evaluate(args, f"eval-{name}", folder)
        out["sides"][name] = {"accuracy": statistics.fmean(after.values()), "accuracy_by_task": by_task(after, tasks),
                              "gain_se": paired_se(base, after), **curve}
    with open(os.path.join(args.out, LEARNING), "w") as f:
        json.dump(out, f, indent=2)
    return out


def thirds(values: list[float | None]) -> tuple[float, float]:
    """Mean of the first and of the last third of the steps (missing values left out)."""
    k = max(1, len(values) // 3)
    first, last = [v for v in values[:k] if v is not None], [v for v in values[-k:] if v is not None]
    return (statistics.fmean(first) if first else float("nan"), statistics.fmean(last) if last else float("nan"))


def blocks(values: list[float | None], n: int = CURVE_BLOCKS) -> list[float]:
    """The mean of each of ``n`` consecutive blocks of the steps (missing values left out; NaN for a block
    without any), the last block taking the remainder: a reward curve short enough to print."""
    n = max(1, min(n, len(values)))
    size = len(values) // n
    edges = [i * size for i in range(n)] + [len(values)]
    means = []
    for lo, hi in zip(edges, edges[1:]):
        present = [v for v in values[lo:hi] if v is not None]
        means.append(statistics.fmean(present) if present else float("nan"))
    return means


def rllight_loss(out: str) -> str:
    """``rllight/<aggregation>`` of the rllight run in ``out`` (from the config it saved), e.g.
    ``rllight/SeqMeanTokenMean``: the loss aggregation is what the learning comparison varies."""
    configs = [c for c in (os.path.join(v, "config.yaml") for v in versions(os.path.join(out, "rllight")))
               if os.path.isfile(c)]
    if not configs:
        return "rllight"
    with open(configs[-1]) as f:
        aggregation = (yaml.safe_load(f)["model"].get("aggregation") or {}).get("class_path", "")
    return f"rllight/{aggregation.rsplit('.', 1)[-1]}" if aggregation else "rllight"


def mean_se(values: list[float]) -> tuple[float, float]:
    """The mean of ``values`` and its standard error over them (NaN for one value)."""
    se = statistics.stdev(values) / len(values) ** 0.5 if len(values) > 1 else float("nan")
    return statistics.fmean(values), se


def print_learning(runs: list[dict], folders: list[str], record: list[dict] | None = None) -> None:
    """One row per run (its ``--out`` folder) and side: held-out greedy accuracy before -> after (± paired
    standard error of the gain), and the first -> last third of the steps' reward, entropy and response length,
    then, with several tasks (reasoning-gym's), the accuracy on each task's held-out problems; with several
    runs, the mean over the runs of each side and loss (± standard error over the runs), also per task, and its
    reward curve (the mean reward of ``CURVE_BLOCKS`` consecutive blocks of the steps, averaged over the runs).
    ``record``, a list, gets each printed row as a record's row (``LEARNING_COLUMNS``), its values as printed."""
    record = [] if record is None else record
    first = runs[0]
    print(f"\nlearning: {first['steps']} steps on {first['train_prompts']} training problems, greedy accuracy on "
          f"{first['heldout']} held-out ones; reward, entropy and length: first -> last third of the steps")
    print(f"  {'side/loss':<26}{'seed':>5}  {'held-out accuracy':<26}{'reward':<15}{'entropy':<15}{'length':<13}")
    by_side: dict[str, list[dict]] = {}
    for run, folder in zip(runs, folders):
        for side, r in run["sides"].items():
            row = {"start": run["start"], "accuracy": r["accuracy"], "start_by_task": run.get("start_by_task", {}),
                   "by_task": r.get("accuracy_by_task", {}), "reward_blocks": blocks(r["reward"])}
            for key in CURVE:
                row[key] = thirds(r[key])
            label = rllight_loss(folder) if side == "rllight" else f"trl/{run['trl_loss_type']}"
            by_side.setdefault(label, []).append(row)
            se = f" ± {r['gain_se']:.3f}" if r.get("gain_se") is not None else ""
            print(f"  {label:<26}{run['seed']:>5}  {run['start']:.3f} -> {r['accuracy']:.3f}{se:<10}"
                  + "".join(f"{row[key][0]:.2f} -> {row[key][1]:<7.2f}" for key in ("reward", "entropy"))
                  + f"{row['length'][0]:.0f} -> {row['length'][1]:.0f}")
            record.append({"side": label, "seed": run["seed"], "start": printed(run["start"], ".3f"),
                           "accuracy": printed(r["accuracy"], ".3f"), "gain_se": printed(r.get("gain_se"), ".3f"),
                           **{f"{key}_{part}": printed(row[key][i], ".0f" if key == "length" else ".2f")
                              for key in CURVE for i, part in enumerate(("first", "last"))}})
            if len(row["by_task"]) > 1:
                sizes = run.get("task_sizes", {})
                for task, accuracy in row["by_task"].items():
                    print(f"    {task:<31}{row['start_by_task'][task]:.3f} -> {accuracy:.3f}  "
                          f"({sizes.get(task, '?')} problems)")
                    record.append({"side": label, "seed": run["seed"], "task": task, "problems": sizes.get(task),
                                   "start": printed(row["start_by_task"][task], ".3f"),
                                   "accuracy": printed(accuracy, ".3f")})
    if len(runs) < 2:
        return
    print("  mean over the runs of each (± standard error over the runs):")
    for side, rows in by_side.items():
        def mean(values: list[float]) -> str:
            return "{:.3f} ± {:.3f}".format(*mean_se(values))

        gains = [r["accuracy"] - r["start"] for r in rows]
        print(f"  {side:<26}{len(rows)} runs: held-out gain {mean(gains)}; last-third reward "
              f"{mean([r['reward'][1] for r in rows])}; last-third entropy {mean([r['entropy'][1] for r in rows])}")
        runs_row = {"side": side, "seed": f"mean of {len(rows)} runs"}
        for key, values in (("gain", gains), ("reward_last_mean", [r["reward"][1] for r in rows]),
                            ("entropy_last_mean", [r["entropy"][1] for r in rows])):
            runs_row[key], runs_row[f"{key}_se"] = (printed(v, ".3f") for v in mean_se(values))
        tasks = set(rows[0]["by_task"]) if all(r["by_task"].keys() == rows[0]["by_task"].keys() for r in rows) else ()
        curve = [statistics.fmean(column) for column in zip(*(r["reward_blocks"] for r in rows))]
        record.append({**runs_row, "reward_curve": " ".join(f"{v:.3f}" for v in curve)})
        for task in sorted(tasks) if len(tasks) > 1 else ():
            accuracies = [r["by_task"][task] for r in rows]
            task_gains = [r["by_task"][task] - r["start_by_task"][task] for r in rows]
            print(f"    {task:<31}accuracy {mean(accuracies)}, gain {mean(task_gains)}")
            (accuracy, accuracy_se), (gain, gain_se) = mean_se(accuracies), mean_se(task_gains)
            record.append({"side": side, "seed": f"mean of {len(rows)} runs", "task": task,
                           "accuracy": printed(accuracy, ".3f"), "accuracy_se": printed(accuracy_se, ".3f"),
                           "gain": printed(gain, ".3f"), "gain_se": printed(gain_se, ".3f")})
        print(f"    {'reward curve':<31}" + " ".join(f"{v:.3f}" for v in curve)
              + f"  (mean reward of {len(curve)} consecutive blocks of the steps)")


LEARNING_COLUMNS = [
    ["side", "side/loss"], ["seed", "seed"], ["task", "task"], ["problems", "problems"],
    ["start", "held-out accuracy before", ".3f"], ["accuracy", "after", ".3f"], ["accuracy_se", "± se", ".3f"],
    ["gain", "gain", "+.3f"], ["gain_se", "± se", ".3f"], ["reward_first", "reward, first third", ".2f"],
    ["reward_last", "reward, last third", ".2f"], ["entropy_first", "entropy, first third", ".2f"],
    ["entropy_last", "entropy, last third", ".2f"], ["length_first", "length, first third", ".0f"],
    ["length_last", "length, last third", ".0f"], ["reward_last_mean", "mean last-third reward", ".3f"],
    ["reward_last_mean_se", "± se", ".3f"], ["entropy_last_mean", "mean last-third entropy", ".3f"],
    ["entropy_last_mean_se", "± se", ".3f"], ["reward_curve", "reward curve (block means)"]]
"""The columns of the record of the learning table (``--summarize``, or one run's ``--heldout``)."""


def record_learning(args: argparse.Namespace, runs: list[dict], rows: list[dict]) -> None:
    """The record of ``--summarize`` (``--record``): the learning table's rows; the summary each side's gain, the
    mean over the runs as printed (of one run: after - before, as printed)."""
    if not args.record:
        return
    gains: dict[str, float] = {}
    for row in rows:
        if "task" in row:
            continue
        if isinstance(row["seed"], int):  # one run's row; a mean row, later, replaces it
            gains.setdefault(row["side"], printed(row["accuracy"] - row["start"], ".3f"))
        else:
            gains[row["side"]] = row["gain"]
    summary = {f"{side}_gain": gain for side, gain in gains.items()}
    used = {k for row in rows for k, v in row.items() if v is not None}
    first = runs[0]
    tool_record(args, id="bench-step-learning", section="Against TRL", rows=rows, summary=summary,
                columns=[c for c in LEARNING_COLUMNS if c[0] in used],
                title=f"Learning per step: {' against '.join(gains)}, {len(runs)} run{'s' if len(runs) > 1 else ''} "
                      f"of {first['steps']} steps on {first['train_prompts']} training problems",
                note=f"Greedy accuracy on {first['heldout']} held-out problems before and after training (the gain's "
                     "standard error paired over the problems for a run, over the runs for their mean), and the mean "
                     "reward, entropy and response length over the first and the last third of the steps.",
                headline=", ".join(f"{side} {{{side}_gain:+.3f}}" for side in gains))
