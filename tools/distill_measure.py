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

**Speed** (``--every N``): every run also evaluates every ``N`` rollouts (``trainer.val_check_interval``), on the same
held-out problems, so each run has a curve of greedy accuracy against rollouts. A run's "rollouts to 80 %" is the
first evaluated rollout count at which its greedy accuracy reached the student's accuracy before training plus 80 % of
the teacher's gain over it (the teacher's accuracy after its GRPO run); ``-`` where no evaluation reached it. The
record gains a column per evaluation and that column, and ``--figure PATH`` draws the curves (matplotlib)::

    .venv/bin/python tools/distill_measure.py --seeds 0 1 --every 5 --out runs/distill-speed \
        --record docs/results/distill-speed.json --figure docs/results/distill-speed.png --shared no

Each finished run's results are kept in ``<out>/<run>-s<seed>/result.json``; a rerun with the same options skips
the runs that have one (delete it to run one again), so a measurement can be spread over several sittings.
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
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the tools beside it
from before_after import greedy_curve  # noqa: E402
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
    p.add_argument("--every", type=int, help="Also evaluate every N rollouts: the curve and the rollouts to 80 %% of "
                                             "the teacher's gain.")
    p.add_argument("--figure", help="With --every: draw the curves to this PNG (beside the record, which names it).")
    add_record_options(p, id="distill-quickstart", section="Methods on the quickstart task")
    args = p.parse_args(argv)
    check_record_options(p, args, argv, __file__)
    if args.every is not None and args.every < 1:
        p.error(f"--every {args.every}: give a number of rollouts >= 1")
    if args.figure and not args.every:
        p.error("--figure draws the curves that --every measures: give --every N")
    if args.figure and not args.figure.endswith(".png"):
        p.error(f"--figure {args.figure}: give a .png file")
    if args.figure and args.record and os.path.dirname(os.path.abspath(args.figure)) != os.path.abspath(
            args.record if os.path.isdir(args.record) else os.path.dirname(args.record) or "."):
        p.error(f"--figure {args.figure}: put it beside the record ({args.record}), which names it")
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
    kept = os.path.join(run_dir, "result.json")
    settings = {"every": args.every, "config": args.config, "teacher": args.teacher}
    if os.path.isfile(kept):  # finished in an earlier sitting
        with open(kept) as f:
            result = json.load(f)
        if result.get("settings") != settings:
            raise SystemExit(f"distill_measure: {kept} was measured with {result.get('settings')}, not {settings}: "
                             "give another --out, or delete it to run again")
        print(f"distill_measure: {name} seed {seed}: finished earlier ({kept})", flush=True)
        return result
    os.makedirs(run_dir, exist_ok=True)
    overlay = os.path.join(run_dir, "overlay.yaml")
    trainer = {"default_root_dir": run_dir, "enable_checkpointing": False}
    if args.every:
        trainer.update(val_check_interval=args.every, check_val_every_n_epoch=None)
    with open(overlay, "w") as f:
        yaml.safe_dump({"seed_everything": seed, "trainer": trainer,
                        "model": {"export_dir": os.path.join(run_dir, "model")}}, f, sort_keys=False)
    cmd = [sys.executable, "-m", "rllight", "fit", "--config", recipe, "--config", overlay,
           *[a for c in args.config for a in ("--config", c)]]
    print(f"distill_measure: {name} seed {seed}: {' '.join(cmd)}", flush=True)
    before = set(glob.glob(os.path.join(run_dir, "lightning_logs", "version_*")))
    t0 = time.perf_counter()
    with open(os.path.join(run_dir, "stdout.log"), "w") as log:
        proc = subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, check=False)
    result = {"run": name, "seed": seed, "returncode": proc.returncode, "wall_s": time.perf_counter() - t0,
              "model": os.path.join(run_dir, "model"), "settings": settings}
    new = sorted(set(glob.glob(os.path.join(run_dir, "lightning_logs", "version_*"))) - before)
    if proc.returncode != 0 or not new:
        print(f"distill_measure: {name} seed {seed} failed (exit {proc.returncode}); see {run_dir}/stdout.log",
              file=sys.stderr)
        return result
    with open(os.path.join(new[-1], "eval_summary.json")) as f:
        result.update(json.load(f))
    result["curve"] = greedy_curve(new[-1])
    with open(kept, "w") as f:
        json.dump(result, f, indent=1)
    return result


def rollouts_to(points: list[list[float]], target: float | None) -> int | None:
    """The first rollout count of ``points`` whose accuracy is at least ``target``; None where none is."""
    if target is None:
        return None
    return next((int(step) for step, accuracy in points if accuracy >= target - 1e-12), None)


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


def table(rows: list[dict], columns: list) -> str:
    lines = ["| " + " | ".join(c[1] for c in columns) + " |", "|" + "---|" * len(columns)]
    for r in rows:
        cells = ["-" if r.get(c[0]) is None else (format(r[c[0]], c[2]) if len(c) > 2 else str(r[c[0]]))
                 for c in columns]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def mean(results: list[dict], key: str) -> float | None:
    values = [r[key] for r in results if r.get(key) is not None]
    return statistics.fmean(values) if values else None


def target_of(run: dict, teacher_accuracy: float | None) -> float | None:
    """The accuracy at 80 % of the teacher's gain over ``run``'s own start; None without the teacher's accuracy."""
    before = run.get("accuracy_before")
    return None if teacher_accuracy is None or before is None else before + 0.8 * (teacher_accuracy - before)


def speed(rows: list[dict], results: list[dict], teacher_accuracy: float | None) -> list:
    """Add to each row its greedy accuracy at each evaluated rollout count (``at<N>``) and its rollouts to 80 % of
    the teacher's gain (``to_80``); the columns added."""
    steps = sorted({int(step) for r in results for step, _ in r.get("curve") or []})
    for row_, result in zip(rows, results):
        points = result.get("curve") or []
        row_.update({f"at{step}": printed(accuracy, ".3f") for step, accuracy in points})
        row_["to_80"] = rollouts_to(points, target_of(result, teacher_accuracy))
    return [*[[f"at{step}", f"greedy at {step} rollouts", ".3f"] for step in steps],
            ["to_80", "rollouts to 80 % of the teacher's gain"]]


def draw(path: str, rows: list[dict], columns: list, target: float | None) -> None:
    """Each run's greedy accuracy against rollouts (the ``at<N>`` columns of ``rows``), the 80 % line, to ``path``."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise SystemExit("distill_measure: --figure needs matplotlib (pip install -e '.[plot]')") from None
    fig = Figure(figsize=(6, 4), layout="constrained")
    ax = fig.subplots()
    steps = [int(c[0][2:]) for c in columns if c[0].startswith("at")]
    for r in rows:
        shown = [(step, r[f"at{step}"]) for step in steps if r.get(f"at{step}") is not None]
        ax.plot(*zip(*shown), "o-" if r["run"] == "distill" else "s--", label=f"{r['run']} seed {r['seed']}",
                color="C1" if r["run"] == "distill" else "C0", alpha=0.5 + 0.5 * (r["seed"] == rows[0]["seed"]))
    if target is not None:
        ax.axhline(target, color="0.5", linewidth=0.8, label="80 % of the teacher's gain")
    ax.set_xlabel("rollouts (RL steps)")
    ax.set_ylabel("greedy accuracy, held-out problems")
    ax.legend(fontsize=8)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=100)
    print(f"figure: {path}")


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
    teacher_accuracy = teacher_run.get("accuracy_after") if teacher_run else None
    columns = COLUMNS + (speed(rows, grpo + distill, teacher_accuracy) if args.every else [])
    text = table(rows, columns)
    print("\n" + text)
    with open(os.path.join(args.out, "distill_measure.md"), "w") as f:
        f.write(text + "\n")
    summary = {"teacher_accuracy": printed(teacher_accuracy, ".3f"),
               "grpo_accuracy_after": printed(mean(grpo, "accuracy_after"), ".3f"),
               "distill_accuracy_after": printed(mean(distill, "accuracy_after"), ".3f"),
               "student_accuracy_before": printed(mean(distill, "accuracy_before"), ".3f")}
    failed = [f"{r['run']} seed {r['seed']}" for r in grpo + distill if r.get("accuracy_after") is None]
    if args.record and failed:
        print(f"distill_measure: no record written: {', '.join(failed)} did not finish", file=sys.stderr)
    elif args.record:
        if args.figure:
            draw(args.figure, rows, columns, target_of(distill[0], teacher_accuracy))
        write_record(args, rows, columns, summary, label)
    print(machine_line())
    print(" ".join(f"{k}={'-' if v is None else format(v, '.3f')}" for k, v in summary.items()))
    return 1 if failed else 0


def write_record(args: argparse.Namespace, rows: list[dict], columns: list, summary: dict, label: str) -> None:
    speed_note = (f" Every run is also evaluated every {args.every} rollouts on the same problems (greedy at N "
                  "rollouts); 'rollouts to 80 %' is the first of those counts at which a run's greedy accuracy reached "
                  "its accuracy before training plus 80 % of the teacher's gain over it, '-' where none did. Each "
                  "evaluation is one greedy pass over the problems: a difference of one evaluation's step is within "
                  "its noise." if args.every else "")
    tool_record(
        args, id="distill-quickstart", section="Methods on the quickstart task",
        title=f"On-policy distillation against GRPO on the quickstart task, seeds {', '.join(map(str, args.seeds))}",
        note=f"{GRPO} and {DISTILL} as written (40 rollouts x 4 prompts x 8 responses each), changed only in "
             "seed, output folders, no checkpoints and the teacher's folder. The teacher is the model the "
             f"first seed's GRPO run trained ({label}). Greedy accuracy on the same 200 held-out problems before "
             "and after, ± the paired standard error of the difference; avg@4 and pass@4 from 4 samples at "
             f"temperature 0.7. Wall time includes loading and every evaluation.{speed_note}",
        columns=columns, rows=rows, summary=summary,
        figure=os.path.basename(args.figure) if args.figure else None,
        headline="distilled student {distill_accuracy_after:.3f} vs GRPO {grpo_accuracy_after:.3f} "
                 "(teacher {teacher_accuracy:.3f})")


if __name__ == "__main__":
    sys.exit(main())
