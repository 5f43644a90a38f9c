"""Difficulty pools against uniform sampling: one recipe, the same steps and seeds, held-out accuracy per task.

Each arm runs ``rllight fit --config <recipe> [--config <arm's overlay>] [--config <extra>...] --seed_everything S``
as a subprocess in ``<out>/<arm>-s<S>`` (its output in ``stdout.log`` there), one after another: ``uniform`` is the
recipe as it is, ``pools`` adds ``recipes/overlays/difficulty-pools.yaml`` (``data.curriculum``). With the same seed
both arms' loaders give every step the same number of prompts of each task; the pools choose which. Neither arm
profiles or draws extra prompts, so each step samples the recipe's responses; the table gives each run's generated
response tokens (its TensorBoard log) to show how close the budgets came.

The held-out accuracy before and after training is read back from each run's saved evaluations
(``tools/before_after.py``): the recipe's headline metric (greedy accuracy for ``recipes/reasoning-gym.yaml``),
overall and per data source (task). The summary gives each arm's mean over the seeds, and pools minus uniform per
task, paired by seed. Measured once, alone on the cores (``--shared no``)::

    .venv/bin/python tools/curriculum_measure.py --seeds 0 1 --out runs/curriculum \\
        --record docs/results/curriculum-reasoning-gym.json --shared no

The last line is ``uniform_after=... pools_after=... difference=... tokens_ratio=...`` (the headline after training,
each arm's mean; pools minus uniform; pools' generated tokens over uniform's).
"""

from __future__ import annotations

import argparse
import glob
import importlib.util
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from rllight.machine import machine_line  # noqa: E402
from rllight.app.records import add_record_options, check_record_options, printed, tool_record  # noqa: E402

ARMS = {"uniform": [], "pools": ["recipes/overlays/difficulty-pools.yaml"]}


def _tool(name: str):
    spec = importlib.util.spec_from_file_location(f"rllight_tool_{name}", os.path.join(ROOT, "tools", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--recipe", default="recipes/reasoning-gym.yaml", help="The recipe both arms run.")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1], help="seed_everything of each pair of runs.")
    p.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS), help="The arms to run.")
    p.add_argument("--config", action="append", default=[],
                   help="Another overlay applied to every run after the arm's (repeatable), e.g. fewer steps.")
    p.add_argument("--out", default="runs/curriculum", help="Folder for the runs (<arm>-s<seed> each).")
    add_record_options(p, id="curriculum-reasoning-gym", section="reasoning-gym")
    args = p.parse_args(argv)
    for arm in args.arms:
        for seed in args.seeds:
            folder = os.path.join(args.out, f"{arm}-s{seed}")
            if os.path.exists(folder) and os.listdir(folder):
                p.error(f"--out: {folder} exists and is not empty; name another --out (runs are never overwritten)")
    check_record_options(p, args, argv, __file__)
    return args


def run_arm(arm: str, seed: int, args: argparse.Namespace) -> dict:
    """One fit of ``arm`` at ``seed``; its held-out summary, generated tokens and curriculum draws."""
    run_dir = os.path.join(args.out, f"{arm}-s{seed}")
    os.makedirs(run_dir, exist_ok=True)
    configs = [args.recipe, *ARMS[arm], *args.config]
    cmd = [sys.executable, "-m", "rllight", "fit", *[a for c in configs for a in ("--config", c)],
           "--seed_everything", str(seed), "--trainer.default_root_dir", run_dir, "--model.export_dir", "null",
           "--evaluate_before_after", "true"]
    print(f"curriculum_measure: {arm} seed {seed}: {' '.join(cmd[1:])}", flush=True)
    t0 = time.perf_counter()
    with open(os.path.join(run_dir, "stdout.log"), "w") as log_file:
        proc = subprocess.run(cmd, cwd=ROOT, stdout=log_file, stderr=subprocess.STDOUT, check=False)
    wall = time.perf_counter() - t0
    logs = sorted(glob.glob(os.path.join(run_dir, "**", "evaluation"), recursive=True))
    if proc.returncode != 0 or not logs:
        raise SystemExit(f"curriculum_measure: {arm} seed {seed} failed (exit {proc.returncode}); see "
                         f"{run_dir}/stdout.log")
    log_dir = os.path.dirname(logs[-1])
    saved, scalars = _tool("before_after"), _tool("compare").read_scalars(log_dir)
    steps = saved.evaluations(log_dir)
    (before, before_pp), (after, after_pp) = saved.read_step(log_dir, steps[0]), saved.read_step(log_dir, steps[-1])
    summary, _ = saved.before_after(before, after, before_pp, after_pp)
    draws = {pool: sum(scalars.get(f"train/curriculum/pool/{pool}/draws", [])) for pool in ("hard", "normal", "easy")}
    return {"arm": arm, "seed": seed, "wall_s": wall, "summary": summary,
            "headline": saved.headline_of(summary), "tokens": sum(scalars.get("train/response/tokens", [])),
            "steps": len(scalars.get("train/time/step", [])), "draws": draws}


def rows_of(runs: list[dict]) -> tuple[list[dict], list[list], list[str]]:
    """The record's rows (one per run, values as printed), columns and the data sources."""
    headline = runs[0]["headline"]
    sources = sorted({name.split(" / ")[1] for r in runs for name in r["summary"] if name.startswith(f"{headline} / ")})
    columns = [["arm", "arm"], ["seed", "seed"], ["steps", "steps"], ["before", f"{headline} before", ".3f"],
               ["after", f"{headline} after", ".3f"]]
    columns += [[f"{s}_after", f"{s} after", ".3f"] for s in sources]
    columns += [["tokens", "generated tokens", ".0f"], ["hard_draws", "hard draws", ".0f"],
                ["normal_draws", "normal draws", ".0f"], ["easy_draws", "easy draws", ".0f"],
                ["wall_s", "wall s", ".0f"]]
    rows = []
    for r in runs:
        overall = r["summary"][headline]
        row = {"arm": r["arm"], "seed": r["seed"], "steps": r["steps"], "before": printed(overall["before"], ".3f"),
               "after": printed(overall["after"], ".3f"), "tokens": printed(r["tokens"], ".0f"),
               "wall_s": printed(r["wall_s"], ".0f")}
        for s in sources:
            row[f"{s}_after"] = printed(r["summary"].get(f"{headline} / {s}", {}).get("after"), ".3f")
        for pool, count in r["draws"].items():
            row[f"{pool}_draws"] = printed(count, ".0f") if r["arm"] == "pools" else None
        rows.append(row)
    return rows, columns, sources


def summary_of(rows: list[dict], sources: list[str]) -> dict:
    """Each arm's mean after training (overall and per source), pools minus uniform paired by seed, tokens ratio."""
    by_arm = {arm: [r for r in rows if r["arm"] == arm] for arm in ARMS}
    out: dict = {}
    for key in ["after", *[f"{s}_after" for s in sources]]:
        for arm, arm_rows in by_arm.items():
            values = [r[key] for r in arm_rows if r[key] is not None]
            if values:
                out[f"{arm}_{key}"] = printed(statistics.fmean(values), ".4f")
        uniform = {r["seed"]: r[key] for r in by_arm["uniform"]}
        paired = [r[key] - uniform[r["seed"]] for r in by_arm["pools"] if uniform.get(r["seed"]) is not None
                  and r[key] is not None]
        if paired:
            out["difference" if key == "after" else f"{key.removesuffix('_after')}_difference"] = printed(
                statistics.fmean(paired), "+.4f")
    tokens = {arm: sum(r["tokens"] for r in arm_rows) for arm, arm_rows in by_arm.items()}
    if tokens["uniform"] and tokens["pools"]:
        out["tokens_ratio"] = printed(tokens["pools"] / tokens["uniform"], ".4f")
    out["seeds"] = len({r["seed"] for r in rows})
    return out


def table(rows: list[dict], columns: list[list]) -> str:
    head = " | ".join(c[1] for c in columns)
    lines = [head, "-" * len(head)]
    for row in rows:
        lines.append(" | ".join("-" if row.get(c[0]) is None else
                                (format(row[c[0]], c[2]) if len(c) > 2 else str(row[c[0]])) for c in columns))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    runs = [run_arm(arm, seed, args) for seed in args.seeds for arm in args.arms]
    if len({r["headline"] for r in runs}) != 1:
        raise SystemExit("curriculum_measure: the runs' headline metrics differ; run one recipe")
    rows, columns, sources = rows_of(runs)
    summary = summary_of(rows, sources)
    headline = runs[0]["headline"]
    tool_record(
        args, id="curriculum-reasoning-gym", section="reasoning-gym", columns=columns, rows=rows, summary=summary,
        title=f"Difficulty pools against uniform sampling, {args.recipe}, {len(args.seeds)} seeds: {headline} per task",
        note=f"Both arms run {args.recipe} at the same seeds and steps; pools adds "
             "recipes/overlays/difficulty-pools.yaml (data.curriculum: a prompt's latest group all wrong = hard, all "
             "right = easy, else normal or unseen; weights 0.1 / 0.8 / 0.1; no profiling, no extra draws). "
             f"{headline} on the same held-out rows before and after training, overall and per task, read from each "
             "run's saved evaluations; the summary's differences are pools minus uniform, paired by seed; draws by "
             "pool are the training steps' (train/curriculum/pool/<pool>/draws).",
        headline=f"{headline} after: uniform {{uniform_after:.3f}}, pools {{pools_after:.3f}} "
                 "(mean of {seeds} seeds)")
    print(table(rows, columns))
    print(machine_line())
    print(" ".join(f"{k}={summary.get(k)}" for k in ("uniform_after", "pools_after", "difference", "tokens_ratio")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
