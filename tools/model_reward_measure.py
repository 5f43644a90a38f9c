"""Measure a recipe whose reward a model serves (an LLM judge, a reward model) beside a verifier, over seeds: the
held-out accuracy before and after each run, and how each run ended: it finished, or a guard stopped it
(``RewardHackingGuard``, or one of ``model.guards``: a reward that fails whole batches), at which RL step and with
which line.

Each seed is one ``rllight fit`` subprocess from the repository root with the recipe as written and only these
changed: ``seed_everything``, ``trainer.default_root_dir`` and ``model.export_dir`` (under ``--out``), and the
overlays given with ``--config``. A run a guard stops ends with exit code 2, saved as ``stopped-step=N.ckpt``, its
one line naming why; the tool then evaluates that checkpoint by training it further to the updates it already made
(``--ckpt_path <it> --trainer.max_steps <its updates>``: no update is made, and the evaluation after training runs
as after a finished fit, against the evaluation before training that the checkpoint keeps). So "after" is the
held-out accuracy where the run ended, finished or stopped, on the same problems as "before".

Each seed's results go to ``<out>/seed<N>/result.json`` as soon as it is done; a rerun skips the seeds that have one
(delete the file to run a seed again). The runs keep their checkpoints (a 135M model with AdamW's state is 1.6 GB
each)::

    .venv/bin/python tools/model_reward_measure.py --recipe recipes/judge-quickstart.yaml --seeds 0 1 \\
        --out runs/judge-measure --record docs/results/judge-quickstart-guard.json --shared no

The last lines name the machine and give ``before=<mean> after=<mean> gain_mean=<mean> stopped=<runs stopped>``.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import statistics
import subprocess
import sys
import time

import yaml

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from rllight.machine import machine_line  # noqa: E402
from rllight.app.records import add_record_options, check_record_options, printed, tool_record  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STOPPED = re.compile(r"^rllight: error: (?P<reason>.*); RL step (?P<step>\d+) \((?P<updates>\d+) optimizer updates\) is "
                     r"saved: resume with: .* --ckpt_path (?P<path>\S+)$")
METRICS = (("greedy accuracy", "greedy"), ("avg@4", "avg4"), ("pass@4", "pass4"), ("truncated_ratio", "truncated"))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--recipe", required=True, help="The recipe, e.g. recipes/judge-quickstart.yaml.")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1], help="One run each, one after another.")
    p.add_argument("--out", required=True, help="Folder for the runs and their result.json files.")
    p.add_argument("--config", action="append", default=[], help="An overlay applied to every run (repeatable).")
    add_record_options(p, id="model-reward", section="Methods on the quickstart task")
    args = p.parse_args(argv)
    check_record_options(p, args, argv, __file__)
    if not os.path.isfile(args.recipe):
        p.error(f"--recipe {args.recipe}: no such file")
    return args


def fit(cmd: list[str], log_path: str) -> tuple[int, str]:
    """Run one ``rllight fit`` command, its output to ``log_path``; its exit code and output."""
    with open(log_path, "w") as log:
        code = subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, check=False).returncode
    with open(log_path) as f:
        return code, f.read()


def stop_of(output: str) -> dict | None:
    """The guard's stop in a run's output: its reason, RL step, updates and checkpoint; None where no line says the
    run stopped saved."""
    for line in reversed(output.splitlines()):
        match = STOPPED.match(line.strip())
        if match:
            return {"reason": match["reason"], "step": int(match["step"]), "updates": int(match["updates"]),
                    "path": match["path"]}
    return None


def newest_summary(run_dir: str) -> dict | None:
    """The ``eval_summary.json`` of the newest log version under ``run_dir``, or None."""
    versions = sorted(glob.glob(os.path.join(run_dir, "lightning_logs", "version_*")),
                      key=lambda v: int(v.rsplit("_", 1)[1]))
    path = os.path.join(versions[-1], "eval_summary.json") if versions else ""
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)


def run_seed(seed: int, args: argparse.Namespace) -> dict:
    """One seed's fit (and, where the guard stopped it, the evaluation of its stopped checkpoint): its result."""
    run_dir = os.path.join(args.out, f"seed{seed}")
    os.makedirs(run_dir, exist_ok=True)
    overlay = os.path.join(run_dir, "overlay.yaml")
    with open(overlay, "w") as f:
        yaml.safe_dump({"seed_everything": seed, "trainer": {"default_root_dir": run_dir},
                        "model": {"export_dir": os.path.join(run_dir, "model")}}, f, sort_keys=False)
    cmd = [sys.executable, "-m", "rllight", "fit", "--config", args.recipe, "--config", overlay,
           *[a for c in args.config for a in ("--config", c)]]
    print(f"model_reward_measure: seed {seed}: {' '.join(cmd)}", flush=True)
    t0 = time.perf_counter()
    code, output = fit(cmd, os.path.join(run_dir, "fit.log"))
    result = {"seed": seed, "returncode": code, "wall_s": time.perf_counter() - t0, "stop": stop_of(output)}
    stop = result["stop"]
    if code == 2 and stop is not None:  # stopped saved: evaluate where it stopped
        again = [*cmd, "--ckpt_path", stop["path"], "--trainer.max_steps", str(stop["updates"])]
        result["evaluate_returncode"], _ = fit(again, os.path.join(run_dir, "evaluate.log"))
    elif code != 0:
        print(f"model_reward_measure: seed {seed} failed (exit {code}); see {run_dir}/fit.log", file=sys.stderr)
        return result
    result["summary"] = newest_summary(run_dir)
    if result["summary"] is None:
        print(f"model_reward_measure: seed {seed}: no evaluation after training; see {run_dir}/*.log", file=sys.stderr)
        return result
    with open(os.path.join(run_dir, "result.json"), "w") as f:
        json.dump(result, f, indent=1)
    return result


def row(result: dict) -> dict:
    """A result's row of the record: how it ended, and each metric before and after (the greedy accuracy's
    difference with its paired standard error)."""
    stop, metrics = result["stop"], (result.get("summary") or {}).get("metrics") or {}
    out = {"seed": result["seed"],
           "ended": f"stopped at RL step {stop['step']}" if stop else "finished",
           "guard_line": stop["reason"] if stop else None}
    for name, key in METRICS:
        values = metrics.get(name) or {}
        out[f"{key}_before"], out[f"{key}_after"] = printed(values.get("before"), ".3f"), \
            printed(values.get("after"), ".3f")
        if key == "greedy":
            out["greedy_gain"] = printed(values.get("difference"), "+.3f")
            out["greedy_gain_se"] = printed(values.get("difference_se"), ".3f")
    out["wall_s"] = printed(result["wall_s"], ".0f")
    return out


COLUMNS = [["seed", "seed"], ["ended", "ended"], ["greedy_before", "greedy accuracy before", ".3f"],
           ["greedy_after", "greedy accuracy after", ".3f"], ["greedy_gain", "difference", "+.3f"],
           ["greedy_gain_se", "± se", ".3f"], ["avg4_before", "avg@4 before", ".3f"],
           ["avg4_after", "avg@4 after", ".3f"], ["pass4_before", "pass@4 before", ".3f"],
           ["pass4_after", "pass@4 after", ".3f"], ["truncated_before", "truncated before", ".3f"],
           ["truncated_after", "truncated after", ".3f"], ["wall_s", "wall time (s)", ".0f"],
           ["guard_line", "why it stopped"]]


def done(args: argparse.Namespace, seed: int) -> dict | None:
    path = os.path.join(args.out, f"seed{seed}", "result.json")
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out = os.path.abspath(args.out)
    results = [done(args, seed) or run_seed(seed, args) for seed in args.seeds]
    finished = [r for r in results if r.get("summary")]
    rows = [row(r) for r in finished]
    for r in rows:
        print(" ".join(f"{k}={v}" for k, v in r.items() if k != "guard_line"), flush=True)
        if r["guard_line"]:
            print(f"  guard: {r['guard_line']}")
    gains = [r["greedy_gain"] for r in rows if r["greedy_gain"] is not None]
    summary = {"before": printed(statistics.fmean(r["greedy_before"] for r in rows), ".4f") if rows else None,
               "after": printed(statistics.fmean(r["greedy_after"] for r in rows), ".4f") if rows else None,
               "gain_mean": printed(statistics.fmean(gains), ".4f") if gains else None,
               "stopped": sum(r["ended"] != "finished" for r in rows), "runs": len(rows)}
    missing = [r["seed"] for r in results if not r.get("summary")]
    if args.record and missing:
        print(f"model_reward_measure: no record written: seeds {missing} did not finish", file=sys.stderr)
    elif args.record:
        tool_record(
            args, id="model-reward", section="Methods on the quickstart task",
            title=f"{args.recipe} as written, seeds {', '.join(map(str, args.seeds))}",
            note=f"{args.recipe} as written, changed only in seed and output folders. A run that the recipe's "
                 "RewardHackingGuard stopped is evaluated where it stopped (its stopped-step checkpoint), so 'after' "
                 "is the held-out accuracy where the run ended; the guard's line is the run's last. Greedy accuracy "
                 "on the same held-out problems before and after, ± the paired standard error of the difference; "
                 "avg@4 and pass@4 from 4 samples at the recipe's temperature. Wall time is the fit's, with loading "
                 "and its evaluations; a stopped run's evaluation where it stopped is a second process, not counted.",
            columns=COLUMNS, rows=rows, summary=summary,
            headline="greedy accuracy {before:.3f} → {after:.3f} ({gain_mean:+.3f}, mean of {runs} runs, "
                     "{stopped} stopped by the guard)")
    print(machine_line())
    print(" ".join(f"{k}={'-' if v is None else v}" for k, v in summary.items()))
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
