"""Measure on-policy distillation on the quickstart task: the student before and after, against its teacher and
against the quickstart's own GRPO for the same number of steps.

The runs, one after another, each a ``rllight fit`` subprocess from the repository root with the recipe as written
and only these changed: ``seed_everything``, ``trainer.default_root_dir``, ``model.export_dir`` (all under
``--out``), ``trainer.enable_checkpointing: false`` (a 135M model with AdamW states is 1.6 GB per run) and, for
distillation, the teacher's folder:

1. ``recipes/quickstart.yaml`` (GRPO) once per seed. The first seed's trained model is the teacher, as the
   distillation recipe's header says to make it; its accuracy after training is the teacher's accuracy.
2. ``recipes/distill-quickstart.yaml`` once per seed, its teacher the model of step 1 (or ``--teacher``).

Both recipes make the same 40 rollouts of 4 prompts x 8 responses (80 optimizer updates) and evaluate the same 200
held-out problems before and after (``evaluate_before_after``): greedy accuracy, avg@4, pass@4, each run's
``eval_summary.json``. The table gives one row per run; the last lines name the machine and give the means:
``teacher_accuracy=<x> grpo_accuracy_after=<mean> distill_accuracy_after=<mean> student_accuracy_before=<x>``.

Full measurement (four quickstart-sized runs, about an hour on 2 free cores; run it alone)::

    .venv/bin/python tools/distill_measure.py --seeds 0 1 --out runs/distill-measure \\
        --record docs/results/distill-quickstart.json --shared no

``--config OVERLAY`` (repeatable) is applied to every run after its recipe (the tests run a tiny model this way);
``--teacher PATH`` skips training one (the teacher's accuracy is then not measured and prints ``-``).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import subprocess
import sys
import time

import yaml

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from rllight.machine import machine_line  # noqa: E402
from rllight.app.records import add_record_options, check_record_options, printed, tool_record  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GRPO = "recipes/quickstart.yaml"
DISTILL = "recipes/distill-quickstart.yaml"
TEACHER_CALLBACK = "rllight.callbacks.TeacherLogprobs"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1], help="One GRPO and one distillation run each.")
    p.add_argument("--out", default="runs/distill-measure", help="Folder for the runs and distill_measure.md.")
    p.add_argument("--teacher", help="A trained model folder to distil from (default: the first seed's GRPO model).")
    p.add_argument("--config", action="append", default=[], help="An overlay applied to every run (repeatable).")
    add_record_options(p, id="distill-quickstart", section="Methods on the quickstart task")
    args = p.parse_args(argv)
    check_record_options(p, args, argv, __file__)
    return args


def with_teacher(recipe: dict, teacher: str) -> dict:
    """``recipe`` with its ``TeacherLogprobs`` callback's model folder set to ``teacher``; SystemExit where the
    recipe has no such callback (the measurement would not be distillation)."""
    for callback in (recipe.get("trainer") or {}).get("callbacks") or []:
        if callback.get("class_path") == TEACHER_CALLBACK:
            callback["init_args"]["model"]["init_args"]["path"] = teacher
            return recipe
    raise SystemExit(f"distill_measure: {DISTILL} has no {TEACHER_CALLBACK} callback under trainer.callbacks")


def run(name: str, recipe: str, seed: int, args: argparse.Namespace) -> dict:
    """One ``rllight fit`` of ``recipe`` (a path) with ``seed``; its ``eval_summary.json`` and wall time."""
    run_dir = os.path.join(args.out, f"{name}-s{seed}")
    os.makedirs(run_dir, exist_ok=True)
    overlay = os.path.join(run_dir, "overlay.yaml")
    with open(overlay, "w") as f:
        yaml.safe_dump({"seed_everything": seed,
                        "trainer": {"default_root_dir": run_dir, "enable_checkpointing": False},
                        "model": {"export_dir": os.path.join(run_dir, "model")}}, f, sort_keys=False)
    cmd = [sys.executable, "-m", "rllight", "fit", "--config", recipe, "--config", overlay,
           *[a for c in args.config for a in ("--config", c)]]
    print(f"distill_measure: {name} seed {seed}: {' '.join(cmd)}", flush=True)
    before = set(glob.glob(os.path.join(run_dir, "lightning_logs", "version_*")))
    t0 = time.perf_counter()
    with open(os.path.join(run_dir, "stdout.log"), "w") as log:
        proc = subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, check=False)
    result = {"run": name, "seed": seed, "returncode": proc.returncode, "wall_s": time.perf_counter() - t0,
              "model": os.path.join(run_dir, "model")}
    new = sorted(set(glob.glob(os.path.join(run_dir, "lightning_logs", "version_*"))) - before)
    if proc.returncode != 0 or not new:
        print(f"distill_measure: {name} seed {seed} failed (exit {proc.returncode}); see {run_dir}/stdout.log",
              file=sys.stderr)
        return result
    with open(os.path.join(new[-1], "eval_summary.json")) as f:
        result.update(json.load(f))
    return result


def metric(r: dict, name: str, when: str):
    return ((r.get("metrics") or {}).get(name) or {}).get(when)


COLUMNS = [["run", "run"], ["seed", "seed"], ["teacher", "teacher"],
           ["accuracy_before", "greedy before", ".3f"], ["accuracy_after", "greedy after", ".3f"],
           ["difference", "difference", "+.3f"], ["difference_se", "± se", ".3f"],
           ["avg4_after", "avg@4 after", ".3f"], ["pass4_after", "pass@4 after", ".3f"],
           ["wall_s", "wall time (s)", ".0f"]]


def row(r: dict, teacher: str) -> dict:
    return {"run": r["run"], "seed": r["seed"], "teacher": teacher,
            "accuracy_before": printed(r.get("accuracy_before"), ".3f"),
            "accuracy_after": printed(r.get("accuracy_after"), ".3f"),
            "difference": printed(r.get("difference"), "+.3f"),
            "difference_se": printed(r.get("stderr_of_difference"), ".3f"),
            "avg4_after": printed(metric(r, "avg@4", "after"), ".3f"),
            "pass4_after": printed(metric(r, "pass@4", "after"), ".3f"),
            "wall_s": printed(r["wall_s"], ".0f")}


def table(rows: list[dict]) -> str:
    lines = ["| " + " | ".join(c[1] for c in COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for r in rows:
        cells = ["-" if r[c[0]] is None else (format(r[c[0]], c[2]) if len(c) > 2 else str(r[c[0]]))
                 for c in COLUMNS]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def mean(results: list[dict], key: str) -> float | None:
    values = [r[key] for r in results if r.get(key) is not None]
    return statistics.fmean(values) if values else None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out = os.path.abspath(args.out)
    os.makedirs(args.out, exist_ok=True)
    grpo = [run("grpo", GRPO, seed, args) for seed in args.seeds]
    teacher_run = None if args.teacher else grpo[0]
    teacher = os.path.abspath(args.teacher) if args.teacher else teacher_run["model"]
    if teacher_run is not None and teacher_run.get("accuracy_after") is None:
        raise SystemExit(f"distill_measure: the teacher's run (grpo seed {teacher_run['seed']}) failed; "
                         f"see {os.path.dirname(teacher_run['model'])}/stdout.log")
    with open(os.path.join(ROOT, DISTILL)) as f:
        recipe = with_teacher(yaml.safe_load(f), teacher)
    distill_recipe = os.path.join(args.out, "distill-quickstart.yaml")
    with open(distill_recipe, "w") as f:
        yaml.safe_dump(recipe, f, sort_keys=False)
    distill = [run("distill", distill_recipe, seed, args) for seed in args.seeds]
    label = f"grpo seed {teacher_run['seed']}" if teacher_run else "given"
    rows = [row(r, "-" if r is not teacher_run else "is the teacher") for r in grpo]
    rows += [row(r, label) for r in distill]
    text = table(rows)
    print("\n" + text)
    with open(os.path.join(args.out, "distill_measure.md"), "w") as f:
        f.write(text + "\n")
    summary = {"teacher_accuracy": printed(teacher_run.get("accuracy_after") if teacher_run else None, ".3f"),
               "grpo_accuracy_after": printed(mean(grpo, "accuracy_after"), ".3f"),
               "distill_accuracy_after": printed(mean(distill, "accuracy_after"), ".3f"),
               "student_accuracy_before": printed(mean(distill, "accuracy_before"), ".3f")}
    failed = [f"{r['run']} seed {r['seed']}" for r in grpo + distill if r.get("accuracy_after") is None]
    if args.record and failed:
        print(f"distill_measure: no record written: {', '.join(failed)} did not finish", file=sys.stderr)
    elif args.record:
        tool_record(
            args, id="distill-quickstart", section="Methods on the quickstart task",
            title=f"On-policy distillation against GRPO on the quickstart task, seeds {', '.join(map(str, args.seeds))}",
            note=f"{GRPO} and {DISTILL} as written (40 rollouts x 4 prompts x 8 responses each), changed only in "
                 "seed, output folders, no checkpoints and the teacher's folder. The teacher is the model the "
                 f"first seed's GRPO run trained ({label}). Greedy accuracy on the same 200 held-out problems before "
                 "and after, ± the paired standard error of the difference; avg@4 and pass@4 from 4 samples at "
                 "temperature 0.7. Wall time includes loading and both evaluations.",
            columns=COLUMNS, rows=rows, summary=summary,
            headline="distilled student {distill_accuracy_after:.3f} vs GRPO {grpo_accuracy_after:.3f} "
                     "(teacher {teacher_accuracy:.3f})")
    print(machine_line())
    print(" ".join(f"{k}={'-' if v is None else format(v, '.3f')}" for k, v in summary.items()))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
