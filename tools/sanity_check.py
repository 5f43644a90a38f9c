"""Learning sanity check: trained on prompts its base model half-solves, does the policy learn to solve them?

A broken trainer (a flipped sign, a mask one token off, an engine that never gets the new weights) still runs, logs a
loss and changes every weight; what it cannot do is make the policy better at its task. This check asks exactly that,
on prompts the base model already solves sometimes, which a correct trainer must make it solve nearly always
(``tests/test_sanity_check.py`` runs it shortened on a tiny model, and shows that it fails under each of those
bugs). Three stages, each ``rllight`` command a subprocess from the repository root, with the recipe (``--recipe``,
default ``recipes/quickstart.yaml``), then any ``--config`` overlays, then the stage's own overlay:

1. **Profile**: the recipe's first ``--profile-prompts`` training prompts, each sampled ``--samples`` times by the
   base model as training samples it (the recipe's temperature, top-p, top-k and response length): ``rllight
   validate`` with the prompts as its held-out file and ``model.evaluation.n`` samples each. A prompt's pass rate
   is the share of its samples the recipe's reward counts correct. Kept: the prompts whose pass rate is within
   ``[--low, --high]``, in the recipe's order, at most ``--prompts`` of them, cut to a multiple of the recipe's
   ``data.batch_size`` (so that each pass over them is whole batches), written as ``<out>/fixed_set.jsonl``
   (``prompt``, ``answer``, ``data_source``); every profiled prompt's pass rate goes to ``<out>/profile.json``.
   ``--fixed-set FILE`` skips this stage and trains on FILE; ``--profile-only`` stops after it.
2. **Train**: ``rllight fit`` on exactly that set (``data.train_files``) for ``--steps`` RL steps
   (``trainer.max_steps`` is that times the recipe's optimizer updates per step), once per ``--seeds`` value; no
   evaluation, checkpoint or export, a TensorBoard log.
3. **Judge**: the run's training accuracy per RL step (``train/reward/accuracy``: the share of the step's sampled
   responses the reward counts correct), averaged over a moving window of ``--window`` steps. A run PASSES when that
   average reaches ``--bar`` within the budget; the step where it first does is reported. The check passes when
   every seed's run does.

The bar, the window and the budget, chosen for the quickstart recipe (SmolLM2-135M-Instruct, 4 prompts x 8 samples
a step at temperature 0.7, lr 1e-5, 2 optimizer updates a step) on a 2-core CPU:

- **Bar 0.8**, not the 95 % of prime-rl's Hendrycks sanity check (arXiv:2510.26788's test: MATH problems a 1.5B
  model solves 20-80 % of the time), whose example gives it up to 5000 steps of 512 responses on 8 GPUs. Here the
  budget is tens of steps of 32, the accuracy is that of samples at temperature 0.7 (the recipe keeps its entropy
  from collapsing: clip-higher, a token-level loss), and a sample is wrong unless the last integer of its 24 tokens
  at most is the answer. 0.8 is still a bar that only learning clears: it is the top of the selection band, so the
  set as a whole must end above where any of its prompts started (the record gives where it started: the profile's
  mean pass rate and the first window's accuracy), and the average of a window's 256 samples has a standard error
  under 0.03, so sampling noise cannot carry it there.
- **Window 8 steps**: one pass over the default 32 prompts at 4 a step (256 responses; the set is shuffled anew
  each pass), so the average is the whole set's, not a few easy prompts'.
- **Budget 64 RL steps** (128 optimizer updates): 8 passes over the set, each prompt trained on 8 times; one and
  a half times the quickstart's 40 steps, without its two evaluations, so it should take about as long as the
  quickstart on the same CPU. The profile samples 256 x 8 = 2048 responses, as many as the 64 steps generate.

The last lines name the machine and give ``sanity=PASS|FAIL first_pass_step=<step; - unless every seed passed>
best_moving_average=<the lowest seed's> ...``; the exit code is 0 on PASS, 1 otherwise. ``--record PATH`` writes one
row per seed (the accuracy by pass over the set, the best window average, the first step past the bar) with the bar
and its reason in the note.

Full measurement (profile and one training run; run it alone)::

    .venv/bin/python tools/sanity_check.py --out runs/sanity-check \\
        --record docs/results/sanity-check-quickstart.json --shared no
"""

from __future__ import annotations

import argparse
import glob
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time

import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from rllight.machine import machine_line
from rllight.app.records import add_record_options, check_record_options, printed, tool_record

RECIPE = "recipes/quickstart.yaml"
ACCURACY = "train/reward/accuracy"
BAR, WINDOW, STEPS, PROMPTS = 0.8, 8, 64, 32
BAR_REASON = ("0.8, not the 95 % of prime-rl's check, whose example may take 5000 steps of 512 responses on 8 GPUs: "
              "here tens of steps of 32 on a CPU, scored on sampled answers (temperature 0.7); 0.8 is the top of the "
              "selection band, so only learning clears it (tools/sanity_check.py says more).")


def _tool(name: str):
    spec = importlib.util.spec_from_file_location(f"rllight_tool_{name}", os.path.join(ROOT, "tools", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


compare = _tool("compare")  # updates per RL step from a resolved configuration
plot = _tool("plot")  # a run's TensorBoard scalars


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--recipe", default=RECIPE, help="The recipe to check (default %(default)s).")
    p.add_argument("--config", action="append", default=[], help="An overlay applied after the recipe (repeatable).")
    p.add_argument("--out", default="runs/sanity-check", help="Folder for the profile, the fixed set and the runs.")
    p.add_argument("--profile-prompts", type=int, default=256, help="Training prompts to profile, the first ones.")
    p.add_argument("--samples", type=int, default=8, help="Samples per profiled prompt.")
    p.add_argument("--low", type=float, default=0.2, help="Lowest pass rate kept (inclusive).")
    p.add_argument("--high", type=float, default=0.8, help="Highest pass rate kept (inclusive).")
    p.add_argument("--prompts", type=int, default=PROMPTS, help="Most prompts kept in the fixed set.")
    p.add_argument("--fixed-set", help="Train on this JSONL file instead of profiling (prompt, answer, data_source).")
    p.add_argument("--profile-only", action="store_true", help="Stop after writing the fixed set.")
    p.add_argument("--steps", type=int, default=STEPS, help="RL steps each training run may take to pass the bar.")
    p.add_argument("--bar", type=float, default=BAR, help="Training accuracy the moving average must reach.")
    p.add_argument("--window", type=int, default=WINDOW, help="RL steps in the moving average.")
    p.add_argument("--seeds", type=int, nargs="+", default=[0], help="One training run each (the profile: the first).")
    add_record_options(p, id="sanity-check", section="Quickstart")
    args = p.parse_args(argv)
    if not 0 <= args.low <= args.high <= 1:
        p.error(f"--low {args.low} and --high {args.high}: need 0 <= low <= high <= 1")
    for name in ("profile_prompts", "samples", "prompts", "steps", "window"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.window > args.steps:
        p.error(f"--window {args.window} is longer than --steps {args.steps}: no average would be complete")
    check_record_options(p, args, argv, __file__)
    # The runs start in the repository root; the recipe's default is a path from there.
    args.recipe = os.path.abspath(args.recipe if os.path.exists(args.recipe) else os.path.join(ROOT, args.recipe))
    args.config = [os.path.abspath(c) for c in args.config]
    return args


# ------------------------------------------------------------------------------------------- the recipe
def config_args(args: argparse.Namespace) -> list[str]:
    return ["--config", args.recipe, *[a for c in args.config for a in ("--config", c)]]


def recipe_settings(args: argparse.Namespace) -> dict:
    """What the stages take from the recipe (with its overlays): its training prompt rows, the engine's sampling
    settings, prompts per step and optimizer updates per step."""
    from rllight.app.cli import RLLightCLI

    cli = RLLightCLI(args=config_args(args), run=False)
    engine, data = cli.model.rollout, cli.datamodule
    data.setup("fit")
    rows = [{"prompt": r["prompt"], "answer": r["answer"], "data_source": r["data_source"]} for r in data.train_rows]
    return {"rows": rows, "batch_size": data.batch_size,
            "updates_per_step": compare.updates_per_rollout(cli.config.as_dict()),
            "sampling": {"temperature": engine.temperature, "top_p": engine.top_p, "top_k": engine.top_k}}


def write_jsonl(path: str, rows: list[dict]) -> None:
    with open(path, "w") as f:
        f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)


def run_rllight(command: str, args: argparse.Namespace, overlay: dict, folder: str) -> tuple[int, float]:
    """``rllight <command>`` of the recipe, its overlays and ``overlay`` (written to ``folder``), its output in
    ``folder/stdout.log``: the exit code and the wall time."""
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, "overlay.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(overlay, f, sort_keys=False)
    cmd = [sys.executable, "-m", "rllight", command, *config_args(args), "--config", path]
    print(f"sanity_check: {' '.join(cmd)}", flush=True)
    start = time.perf_counter()
    with open(os.path.join(folder, "stdout.log"), "w") as log:
        proc = subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, check=False)
    return proc.returncode, time.perf_counter() - start


# ---------------------------------------------------------------------------------------------- profile
def profile(args: argparse.Namespace, settings: dict) -> list[dict]:
    """The first ``--profile-prompts`` training rows, each with its ``pass_rate`` over ``--samples`` samples of the
    base model (``rllight validate``, sampling as training does), in the recipe's order."""
    folder = os.path.join(args.out, "profile")
    os.makedirs(folder, exist_ok=True)
    prompts = os.path.join(folder, "prompts.jsonl")
    write_jsonl(prompts, settings["rows"][: args.profile_prompts])
    overlay = {"seed_everything": args.seeds[0],
               "trainer": {"default_root_dir": folder, "limit_val_batches": None},
               "model": {"evaluation": {"n": args.samples, **settings["sampling"], "ks": sorted({1, args.samples}),
                                        "also_greedy": False, "max_new_tokens": None,
                                        "sampling_seed": args.seeds[0]}},
               "data": {"val_files": [prompts], "val_size": None}}
    code, _ = run_rllight("validate", args, overlay, folder)
    found = sorted(glob.glob(os.path.join(folder, "**", "evaluation", "val_step0_rows.jsonl"), recursive=True),
                   key=os.path.getmtime)
    if code != 0 or not found:
        raise SystemExit(f"sanity_check: the profile failed (exit {code}); see {folder}/stdout.log")
    with open(found[-1]) as f:
        records = [json.loads(line) for line in f if line.strip()]
    return [{"prompt": r["prompt"], "answer": r["answer"], "data_source": r["data_source"],
             "pass_rate": sum(r["correct"]) / len(r["correct"])} for r in records if r.get("correct")]


def select(profiled: list[dict], low: float, high: float, limit: int, batch_size: int) -> list[dict]:
    """The rows whose ``pass_rate`` is within ``[low, high]``, in order, at most ``limit``, cut to a multiple of
    ``batch_size`` (each pass over the set is then whole training batches; fewer than one batch are kept as they
    are, for the caller to refuse)."""
    kept = [r for r in profiled if low <= r["pass_rate"] <= high][:limit]
    whole = len(kept) - len(kept) % batch_size
    return kept[:whole] if whole else kept


# ------------------------------------------------------------------------------------------------ train
def train(args: argparse.Namespace, settings: dict, fixed_set: str, seed: int) -> dict:
    """One ``rllight fit`` on ``fixed_set`` for ``--steps`` RL steps with ``seed``: its exit code, wall time and
    training accuracy per RL step."""
    run_dir = os.path.join(args.out, f"train-s{seed}")
    overlay = {"seed_everything": seed, "evaluate_before_after": False,
               "trainer": {"max_steps": args.steps * settings["updates_per_step"], "default_root_dir": run_dir,
                           "logger": True, "enable_checkpointing": False, "limit_val_batches": 0,
                           "val_check_interval": None},
               "model": {"export_dir": None},
               "data": {"train_files": [fixed_set], "val_files": None}}
    code, wall = run_rllight("fit", args, overlay, run_dir)
    curve = accuracy_curve(run_dir, args.steps) if code == 0 else []
    if code != 0:
        print(f"sanity_check: seed {seed}: the run failed (exit {code}); see {run_dir}/stdout.log", file=sys.stderr)
    return {"seed": seed, "returncode": code, "wall_s": wall, "curve": curve}


def accuracy_curve(run_dir: str, steps: int) -> list[float]:
    """The run's training accuracy at RL steps 1, 2, ... up to ``steps``, from its TensorBoard log."""
    points = sorted(plot.read_scalars(run_dir).get(ACCURACY, []))
    return [value for step, value in points if step <= steps]


# ------------------------------------------------------------------------------------------------ judge
def moving_average(values: list[float], window: int) -> list[float]:
    """The mean of each ``window`` consecutive values: entry i averages values i .. i + window - 1 (so it belongs to
    step i + window, counting steps from 1); empty when there are fewer than ``window`` values."""
    return [statistics.fmean(values[i : i + window]) for i in range(len(values) - window + 1)]


def judge(curve: list[float], bar: float, window: int) -> dict:
    """A run's verdict: the moving average's first window (``start``), its best and last values, the first step
    (counted from 1) at which it reaches ``bar`` (None if it never does), ``passed``, and the mean accuracy of each
    block of ``window`` steps (``blocks``; the last may be shorter)."""
    average = moving_average(curve, window)
    first = next((i + window for i, value in enumerate(average) if value >= bar), None)
    blocks = [statistics.fmean(curve[i : i + window]) for i in range(0, len(curve), window)]
    return {"start": average[0] if average else None, "best": max(average) if average else None,
            "final": average[-1] if average else None, "first_pass_step": first, "passed": first is not None,
            "blocks": blocks}


def verdict_line(seed: int, result: dict, args: argparse.Namespace) -> str:
    """One seed's line: its accuracy by block of ``--window`` steps, its best window average, where it passed."""
    v = result["verdict"]
    blocks = " ".join(f"{b:.3f}" for b in v["blocks"])
    if result["returncode"] != 0:
        return f"seed {seed}: the run failed (exit {result['returncode']}): FAIL"
    best = "-" if v["best"] is None else f"{v['best']:.3f}"
    where = f"at step {v['first_pass_step']}" if v["passed"] else f"not within {args.steps} steps"
    return (f"seed {seed}: accuracy by {args.window} steps {blocks} | best {args.window}-step average {best} | "
            f"reaches {args.bar} {where}: {'PASS' if v['passed'] else 'FAIL'}")


# ----------------------------------------------------------------------------------------------- report
def fixed_set(args: argparse.Namespace, settings: dict) -> tuple[str, int, float | None]:
    """The file the runs train on (``--fixed-set``, or the profile's selection written to ``<out>``), its number
    of prompts, and their mean pass rate in the profile (None for a given file)."""
    if args.fixed_set:
        with open(args.fixed_set) as f:
            return os.path.abspath(args.fixed_set), sum(1 for line in f if line.strip()), None
    profiled = profile(args, settings)
    kept = select(profiled, args.low, args.high, args.prompts, settings["batch_size"])
    with open(os.path.join(args.out, "profile.json"), "w") as f:
        json.dump({"samples": args.samples, "sampling": settings["sampling"], "low": args.low, "high": args.high,
                   "prompts": profiled}, f, indent=1, ensure_ascii=False)
    band = f"[{args.low}, {args.high}]"
    if len(kept) < settings["batch_size"]:
        raise SystemExit(f"sanity_check: {len(kept)} of {len(profiled)} profiled prompts have a pass rate in {band}, "
                         f"fewer than one training batch ({settings['batch_size']}); profile more "
                         "(--profile-prompts) or widen the band (--low, --high)")
    path = os.path.join(args.out, "fixed_set.jsonl")
    write_jsonl(path, [{k: r[k] for k in ("prompt", "answer", "data_source")} for r in kept])
    mean = statistics.fmean(r["pass_rate"] for r in kept)
    print(f"sanity_check: kept {len(kept)} of {len(profiled)} profiled prompts (pass rate in {band}, mean {mean:.3f})")
    return path, len(kept), mean


def columns(args: argparse.Namespace, blocks: int) -> list[list]:
    spans = [(1 + i * args.window, min((i + 1) * args.window, args.steps)) for i in range(blocks)]
    return [["seed", "seed"], ["prompts", "prompts"], ["steps", "RL steps"],
            *[[f"accuracy_{a}_{b}", f"accuracy, steps {a}-{b}", ".3f"] for a, b in spans],
            ["start", "first window", ".3f"], ["best", "best window", ".3f"],
            ["first_pass_step", "first step past the bar"], ["verdict", "verdict"], ["train_s", "train (s)", ".0f"]]


def row(result: dict, prompts: int, args: argparse.Namespace, cols: list[list]) -> dict:
    v = result["verdict"]
    blocks = dict(zip([c[0] for c in cols if c[0].startswith("accuracy_")], v["blocks"]))
    return {"seed": result["seed"], "prompts": prompts, "steps": len(result["curve"]),
            **{k: printed(b, ".3f") for k, b in blocks.items()},
            "start": printed(v["start"], ".3f"), "best": printed(v["best"], ".3f"),
            "first_pass_step": v["first_pass_step"], "verdict": "PASS" if v["passed"] else "FAIL",
            "train_s": printed(result["wall_s"], ".0f")}


def summarize(results: list[dict], prompts: int, mean_pass: float | None, args: argparse.Namespace) -> dict:
    """The check's numbers: its settings, how many seeds passed, the lowest seed's best window average and the
    latest seed's first step past the bar (None unless every seed passed)."""
    verdicts = [r["verdict"] for r in results]
    bests = [v["best"] for v in verdicts if v["best"] is not None]
    passed = sum(v["passed"] and r["returncode"] == 0 for v, r in zip(verdicts, results))
    every = passed == len(results)
    return {"bar": args.bar, "window": args.window, "steps": args.steps, "prompts": prompts,
            "profile_mean_pass_rate": printed(mean_pass, ".3f"),
            "best_moving_average": printed(min(bests), ".3f") if len(bests) == len(results) else None,
            "first_pass_step": max(v["first_pass_step"] for v in verdicts) if every else None,
            "passed_seeds": passed, "seeds": len(results)}


def write_record(args: argparse.Namespace, results: list[dict], summary: dict, settings: dict) -> None:
    """The record (``--record``): a row per seed as printed, ``summary`` (the last line's numbers and the counts),
    and a note saying what was trained on, for how long, and what the bar is and why."""
    blocks = max(len(r["verdict"]["blocks"]) for r in results)
    cols = columns(args, blocks)
    rows = [row(r, summary["prompts"], args, cols) for r in results]
    source = (f"the {summary['prompts']} of its first {args.profile_prompts} training prompts whose pass rate over "
              f"{args.samples} samples of the base model was in [{args.low}, {args.high}] (mean "
              f"{summary['profile_mean_pass_rate']})" if summary["profile_mean_pass_rate"] is not None
              else f"the {summary['prompts']} prompts of {os.path.basename(args.fixed_set)}")
    reason = f" Bar {BAR_REASON}" if args.bar == BAR else ""
    recipe = os.path.relpath(args.recipe, ROOT)
    tool_record(
        args, id="sanity-check", section="Quickstart",
        title=f"Learning sanity check: {recipe} on " + (
            f"prompts its base model solves {args.low:.0%}-{args.high:.0%} of the time" if not args.fixed_set
            else f"the prompts of {os.path.basename(args.fixed_set)}"),
        note=f"{recipe} trained on {source} for {args.steps} RL steps ({args.steps * settings['updates_per_step']} "
             f"optimizer updates), no evaluation, one run per seed. Training accuracy: the share of a step's sampled "
             f"responses the reward counts correct; a run passes when its {args.window}-step moving average reaches "
             f"{args.bar} within the steps; the first step it does is shown.{reason}",
        columns=cols, rows=rows, summary=summary,
        headline="{passed_seeds} of {seeds} seeds past {bar} within {steps} steps, lowest best average "
                 "{best_moving_average:.3f}" if summary["best_moving_average"] is not None else None)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out = os.path.abspath(args.out)
    os.makedirs(args.out, exist_ok=True)
    settings = recipe_settings(args)
    path, prompts, mean_pass = fixed_set(args, settings)
    if args.profile_only:
        print(f"sanity_check: fixed set {path}")
        return 0
    results = []
    for seed in args.seeds:
        result = train(args, settings, path, seed)
        result["verdict"] = judge(result["curve"], args.bar, args.window)
        print(verdict_line(seed, result, args), flush=True)
        results.append(result)
    summary = summarize(results, prompts, mean_pass, args)
    passed = summary["passed_seeds"] == summary["seeds"]
    failed = [str(r["seed"]) for r in results if r["returncode"] != 0]
    if args.record and failed:
        print(f"sanity_check: no record written: the run of seed {', '.join(failed)} did not finish", file=sys.stderr)
    elif args.record:
        write_record(args, results, summary, settings)
    print(machine_line())
    values = {"sanity": "PASS" if passed else "FAIL", **{k: summary[k] for k in (
        "first_pass_step", "best_moving_average", "bar", "window", "steps", "prompts")}}
    print(" ".join(f"{k}={'-' if v is None else v}" for k, v in values.items()))
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
