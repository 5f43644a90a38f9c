"""Compare GRPO, DAPO and VAPO on the quickstart model and task for the same budget.

Each method runs its recipe (recipes/grpo.yaml, recipes/dapo.yaml, recipes/vapo.yaml) as a subprocess,
``rllight fit --config <recipe> --config <shared overlay> --evaluate_before_after true``. The overlay gives
every method the same budget and sampling: the same number of rollouts with a policy update (``--steps``),
prompts per step (``--batch-size``), responses per prompt (``--group-size``), response length, temperature
and learning rate; mid-run validation is off. Greedy accuracy on the same held-out problems before and after training
comes from each run's ``eval_summary.json``.

The budget is counted in rollouts that reach a policy update (``--steps``), not in optimizer updates: a
recipe that splits each rollout into minibatches (VAPO: 2 updates per rollout of 32 responses at
``model.batching.minibatch_size: 16``) would otherwise see fewer prompts. Each method's ``trainer.max_steps`` (which
counts optimizer updates) is ``--steps`` times its updates per rollout, ``ppo_epochs * ceil(responses /
minibatch_size)``, read from the method's resolved configuration (``--print_config``).

Equal steps do not mean equal samples: DAPO's dynamic sampling draws extra groups, and VAPO's value
pretraining consumes rollouts before its first policy update. The table therefore reports, from each
run's TensorBoard log, the responses and response tokens actually generated (discarded ones included)
and the training time next to the wall time (which includes loading and both evaluations). It also reports
the truncation ratio of the greedy held-out responses after training and, for methods with a critic, how
much of the variance of the returns the critic explains: at the end of value pretraining (held out, on
the last pretraining rollout, and how many rollouts it took) and over the last half of the RL steps
(``train/value/explained_variance``: the critic as it enters each step, on the fresh rollout).
The runs' curves, overlaid, go to ``<out>/figures/`` (one PNG per metric group, see tools/plot.py). The last
two lines name the machine (``rllight.machine``) and give each method's accuracy after training:
``grpo_accuracy_after=<x> dapo_accuracy_after=<x> vapo_accuracy_after=<x>``.

``--record PATH`` also writes the table as a record for docs/results/ (``rllight.app.records``; id ``compare``): one row
per method, its values as printed, each method's accuracy after training (the last line) in the summary. A record
is written only when every method finished.

Full run (SmolLM2-135M-Instruct, arithmetic, CPU; the quickstart's budget of 40 steps x 4 prompts x 8
responses per method; GRPO takes about 15 minutes on 2 free cores, DAPO and
VAPO longer: extra sampling rounds, value pretraining, K_v = 4 critic passes; plan on about an hour in all):

    .venv/bin/python tools/compare.py

Smoke test (seconds of training, a handful of held-out problems; proves the pipeline, not the methods):

    .venv/bin/python tools/compare.py --steps 1 --batch-size 1 --group-size 2 --val-size 4 --max-new-tokens 8 \\
        --out runs/compare-smoke
"""

from __future__ import annotations

import argparse
import glob
import importlib.util
import json
import os
import math
import subprocess
import sys
import time

import yaml

from rllight.machine import machine_line
from rllight.app.records import add_record_options, check_record_options, printed, tool_record

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
METHODS = {"grpo": "recipes/grpo.yaml", "dapo": "recipes/dapo.yaml", "vapo": "recipes/vapo.yaml"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--methods", nargs="+", default=list(METHODS),
                   help="Methods to run: names of the built-in recipes (grpo, dapo, vapo) or NAME=RECIPE.yaml "
                        "(e.g. vapo-paper=recipes/vapo-paper-lambda.yaml).")
    p.add_argument("--steps", type=int, default=40,
                   help="Rollouts with a policy update per method (trainer.max_steps is this times the method's "
                        "updates per rollout).")
    p.add_argument("--batch-size", type=int, default=4, help="Prompts per step (data.batch_size).")
    p.add_argument("--group-size", type=int, default=8, help="Responses per prompt (model.sampler group_size).")
    p.add_argument("--max-new-tokens", type=int, default=24, help="Longest response in tokens.")
    p.add_argument("--temperature", type=float, default=0.7, help="Sampling temperature of the rollouts.")
    p.add_argument("--lr", type=float, default=2e-5,
                   help="Policy learning rate, the same for every method (the README's comparison ran at 2e-5).")
    p.add_argument("--val-size", type=int, default=200, help="Held-out problems for greedy accuracy.")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="runs/compare", help="Folder for the runs, compare.json and compare.md.")
    p.add_argument("--config", action="append", default=[],
                   help="Another overlay applied to every method after the shared one (repeatable).")
    add_record_options(p, id="compare", section="Methods on the quickstart task")
    args = p.parse_args(argv)
    for name in ("steps", "batch_size", "group_size", "max_new_tokens", "val_size"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    check_record_options(p, args, argv, __file__)
    return args


def method_recipes(specs: list[str]) -> dict[str, str]:
    out = {}
    for spec in specs:
        name, _, recipe = spec.partition("=")
        recipe = recipe or METHODS.get(name)
        if recipe is None:
            raise SystemExit(f"compare: unknown method {name!r}; use one of {', '.join(METHODS)} or NAME=RECIPE.yaml")
        out[name] = recipe
    return out


def shared_overlay(args: argparse.Namespace, run_dir: str, updates_per_rollout: int = 1) -> dict:
    """The settings every method shares: budget, sampling, learning rate, evaluation."""
    return {
        "seed_everything": args.seed,
        "trainer": {
            "max_steps": args.steps * updates_per_rollout,
            "default_root_dir": run_dir,
            "enable_checkpointing": False,  # a 135M model with AdamW states is 1.6 GB per run
            "check_val_every_n_epoch": None,
            "val_check_interval": 10**9,  # no mid-run validation: before and after only
            "limit_val_batches": None,
        },
        "model": {
            "rollout": {"init_args": {"max_new_tokens": args.max_new_tokens, "temperature": args.temperature}},
            "sampler": {"init_args": {"group_size": args.group_size}},
            "optimizer": {"init_args": {"lr": args.lr}},
        },
        "data": {"batch_size": args.batch_size, "val_size": args.val_size},
    }


def read_scalars(log_dir: str) -> dict[str, list[float]]:
    """Every scalar series of a TensorBoard log folder (empty when there is none)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    if not glob.glob(os.path.join(log_dir, "events.out.tfevents.*")):
        return {}
    acc = EventAccumulator(log_dir, size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [e.value for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def generated(scalars: dict[str, list[float]], batch_size: int, group_size: int) -> tuple[float, float]:
    """(responses, response tokens) generated over the run, discarded ones included. Each training batch
    logs one ``train/time/step`` (value-pretraining rollouts too); dynamic sampling logs its own counts."""
    if "train/sampling/responses_drawn" in scalars:
        return sum(scalars["train/sampling/responses_drawn"]), sum(scalars["train/sampling/generated_tokens"])
    steps = len(scalars.get("train/time/step", []))
    return steps * batch_size * group_size, sum(scalars.get("train/response/tokens", []))


def updates_per_rollout(config: dict) -> int:
    """Optimizer updates one rollout makes under a resolved configuration (``--print_config`` output):
    ``ppo_epochs * ceil(responses / minibatch_size)``, responses = prompts x responses per prompt."""
    model = config.get("model") or {}
    sampler_args = (model.get("sampler") or {}).get("init_args") or {}
    responses = int(config["data"]["batch_size"]) * int(sampler_args.get("group_size") or 1)
    batching = model.get("batching") or {}
    minibatch = batching.get("minibatch_size") or responses
    return int(batching.get("ppo_epochs") or 1) * math.ceil(responses / minibatch)


def resolved_config(cmd: list[str]) -> dict:
    """The complete configuration a ``rllight fit`` command would run with."""
    proc = subprocess.run([*cmd, "--print_config"], cwd=ROOT, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"compare: cannot resolve the configuration of {' '.join(cmd)}: "
                         f"{(proc.stderr.strip().splitlines() or ['?'])[-1]}")
    return yaml.safe_load(proc.stdout)


def run_method(name: str, recipe: str, args: argparse.Namespace) -> dict:
    run_dir = os.path.join(args.out, name)
    os.makedirs(run_dir, exist_ok=True)
    overlay = os.path.join(run_dir, "compare_overlay.yaml")
    with open(overlay, "w") as f:
        yaml.safe_dump(shared_overlay(args, run_dir), f, sort_keys=False)
    cmd = [sys.executable, "-m", "rllight", "fit", "--config", recipe, "--config", overlay,
           *[a for c in args.config for a in ("--config", c)]]
    per_rollout = updates_per_rollout(resolved_config(cmd))
    with open(overlay, "w") as f:
        yaml.safe_dump(shared_overlay(args, run_dir, per_rollout), f, sort_keys=False)
    cmd += ["--evaluate_before_after", "true"]
    print(f"compare: {name}: {per_rollout} policy updates per rollout; {' '.join(cmd)}", flush=True)
    before_versions = set(glob.glob(os.path.join(run_dir, "lightning_logs", "version_*")))
    t0 = time.perf_counter()
    with open(os.path.join(run_dir, "stdout.log"), "w") as log_file:
        proc = subprocess.run(cmd, cwd=ROOT, stdout=log_file, stderr=subprocess.STDOUT, check=False)
    wall = time.perf_counter() - t0
    result = {"method": name, "recipe": recipe, "returncode": proc.returncode, "wall_s": wall,
              "updates": args.steps * per_rollout}
    new = sorted(set(glob.glob(os.path.join(run_dir, "lightning_logs", "version_*"))) - before_versions,
                 key=lambda p: int(p.rsplit("_", 1)[-1]))
    if proc.returncode != 0 or not new:
        print(f"compare: {name} failed (exit {proc.returncode}); see {run_dir}/stdout.log", file=sys.stderr)
        return result
    log_dir = new[-1]
    with open(os.path.join(log_dir, "eval_summary.json")) as f:
        result.update(json.load(f))
    scalars = read_scalars(log_dir)
    result["responses"], result["tokens"] = generated(scalars, args.batch_size, args.group_size)
    result["train_s"] = sum(scalars.get("train/time/step", []))
    result.update(critic_summary(scalars))
    truncated = scalars.get("val/truncated_ratio")
    result["truncated_after"] = truncated[-1] if truncated else None  # the evaluation after training
    result["log_dir"] = log_dir
    return result


def _finite_mean(values: list[float]) -> float | None:
    values = [v for v in values if math.isfinite(v)]
    return sum(values) / len(values) if values else None


def critic_summary(scalars: dict[str, list[float]]) -> dict:
    """How well the critic explains the returns: after value pretraining (the held-out explained variance
    on the last pretraining rollout, pooled over the last window of them where value pretraining logs one, on its probe
    where it sets one aside, and how many rollouts it fitted) and over the last half of the RL steps
    (mean of the finite ``train/value/explained_variance``: NaN marks a rollout whose returns did not vary).
    Empty for methods without a critic."""
    out = {}
    pre = scalars.get("train/value_pretraining/explained_variance")
    if pre:
        out["pretraining_rollouts"] = len(pre)
        out["ev_pretraining_end"] = pre[-1] if math.isfinite(pre[-1]) else None
    window = scalars.get("train/value_pretraining/window_explained_variance")
    if window:  # pooled over the last window of fresh rollouts: what the criterion reads without a probe
        out["ev_pretraining_window_end"] = window[-1] if math.isfinite(window[-1]) else None
    probe = scalars.get("train/value_pretraining/probe_explained_variance")
    if probe:  # the probe's, after the last fit: what the criterion reads with one (so it chose the stop on it)
        out["ev_pretraining_probe_end"] = probe[-1] if math.isfinite(probe[-1]) else None
    rl = scalars.get("train/value/explained_variance")
    if rl:
        out["ev_rl_last_half"] = _finite_mean(rl[len(rl) // 2:])
    return out


def table(results: list[dict]) -> str:
    head = ("| method | recipe | updates | accuracy before | accuracy after | difference (± se) | truncated after "
            "| critic EV: pretraining end (rollouts) | critic EV: RL, last half | responses | tokens "
            "| train time (s) | wall time (s) |")
    rows = [head, "|" + "---|" * 13]

    def fmt(value, spec):
        return "-" if value is None else format(value, spec)

    for r in results:
        if r.get("accuracy_after") is None:
            rows.append(f"| {r['method']} | {r['recipe']} | {r.get('updates', '-')} | failed (exit "
                        f"{r['returncode']}) | | | | | | | | | {r['wall_s']:.0f} |")
            continue
        diff = f"{r['difference']:+.3f} ± {r['stderr_of_difference']:.3f}" if "difference" in r else "-"
        pre = (f"{fmt(r.get('ev_pretraining_end'), '.3f')} ({r['pretraining_rollouts']})"
               if "pretraining_rollouts" in r else "-")
        rows.append(f"| {r['method']} | {r['recipe']} | {r['updates']} | {fmt(r['accuracy_before'], '.3f')} | "
                    f"{fmt(r['accuracy_after'], '.3f')} | {diff} | {fmt(r.get('truncated_after'), '.2f')} | {pre} | "
                    f"{fmt(r.get('ev_rl_last_half'), '.3f')} | {r['responses']:.0f} | {r['tokens']:.0f} | "
                    f"{r['train_s']:.0f} | {r['wall_s']:.0f} |")
    return "\n".join(rows)


ACCURACY_COLUMNS = [["accuracy_before", "held-out accuracy before", ".3f"], ["accuracy_after", "after", ".3f"],
                    ["difference", "difference", "+.3f"], ["difference_se", "± se", ".3f"]]
"""The held-out accuracy before and after training of a run's ``eval_summary.json``: the record's columns of the
tables of this tool and of tools/async_staleness.py."""


def accuracy_values(r: dict) -> dict:
    """``ACCURACY_COLUMNS``' values of a finished run ``r``, as the tables print them."""
    return {"accuracy_before": printed(r.get("accuracy_before"), ".3f"),
            "accuracy_after": printed(r.get("accuracy_after"), ".3f"),
            "difference": printed(r.get("difference"), "+.3f"),
            "difference_se": printed(r.get("stderr_of_difference"), ".3f")}


RECORD_COLUMNS = [["method", "method"], ["recipe", "recipe"], ["updates", "updates"], *ACCURACY_COLUMNS,
                  ["truncated_after", "truncated after", ".2f"],
                  ["ev_pretraining_end", "critic EV, pretraining end", ".3f"],
                  ["pretraining_rollouts", "pretraining rollouts"],
                  ["ev_rl_last_half", "critic EV, RL last half", ".3f"],
                  ["responses", "responses"], ["tokens", "tokens"], ["train_s", "train time (s)"],
                  ["wall_s", "wall time (s)"]]


def record_row(r: dict) -> dict:
    """A finished method's row of the table, as printed, for the record."""
    return {"method": r["method"], "recipe": r["recipe"], "updates": r["updates"], **accuracy_values(r),
            "truncated_after": printed(r.get("truncated_after"), ".2f"),
            "ev_pretraining_end": printed(r.get("ev_pretraining_end"), ".3f"),
            "pretraining_rollouts": r.get("pretraining_rollouts"),
            "ev_rl_last_half": printed(r.get("ev_rl_last_half"), ".3f"), "responses": printed(r["responses"], ".0f"),
            "tokens": printed(r["tokens"], ".0f"), "train_s": printed(r["train_s"], ".0f"),
            "wall_s": printed(r["wall_s"], ".0f")}


def record_all_finished(args: argparse.Namespace, results: list[dict], **fields) -> str | None:
    """``tool_record`` with ``fields`` where every run in ``results`` finished; else one line (stderr) that no record
    was written: a record holds a measurement, not a failure."""
    failed = [r.get("method") or r.get("name") for r in results if r.get("accuracy_after") is None]
    if args.record and failed:
        print(f"{fields['id']}: no record written: {', '.join(failed)} did not finish", file=sys.stderr)
        return None
    return tool_record(args, **fields)


def write_figures(results: list[dict], out_dir: str) -> list[str]:
    """The runs' curves (tools/plot.py), one PNG per metric group; comes after the table, so a failure
    here (no matplotlib, an unreadable log) costs only the figures and is reported in one line."""
    runs = [r for r in results if r.get("log_dir")]
    if not runs:
        print("compare: no run to plot", file=sys.stderr)
        return []
    try:
        spec = importlib.util.spec_from_file_location("rllight_plot_tool", os.path.join(ROOT, "tools", "plot.py"))
        plot = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(plot)
        paths = plot.plot_runs([r["log_dir"] for r in runs], out_dir, [r["method"] for r in runs])
    except Exception as e:  # noqa: BLE001 - reported, and the table is already written
        print(f"compare: figures not written: {type(e).__name__}: {e}", file=sys.stderr)
        return []
    names = ", ".join(os.path.basename(p) for p in paths) or "none (no plotted metric)"
    print(f"compare: figures in {out_dir}: {names}")
    return paths


def write_report(out_dir: str, stem: str, text: str, payload: dict, runs: list[dict]) -> None:
    """Print ``text`` and save it as ``<out_dir>/<stem>.md``, ``payload`` as ``<stem>.json``, and the curves of
    ``runs`` (each with ``log_dir`` and ``method``, its label) in ``<out_dir>/figures``."""
    print("\n" + text)
    with open(os.path.join(out_dir, f"{stem}.md"), "w") as f:
        f.write(text)
    with open(os.path.join(out_dir, f"{stem}.json"), "w") as f:
        json.dump(payload, f, indent=2)
    write_figures(runs, os.path.join(out_dir, "figures"))


def final_line(results: list[dict]) -> str:
    """``<method>_accuracy_after=<greedy held-out accuracy after training>`` for each method (``failed`` for one
    that did not finish), space-separated: the line that tools/rerun_numbers.py and the tests read."""
    def value(r):
        return "failed" if r.get("accuracy_after") is None else f"{r['accuracy_after']:.3f}"

    return " ".join(f"{r['method']}_accuracy_after={value(r)}" for r in results)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    recipes = method_recipes(args.methods)
    args.out = os.path.abspath(args.out)
    os.makedirs(args.out, exist_ok=True)
    results = [run_method(name, recipe, args) for name, recipe in recipes.items()]
    budget = (f"{args.steps} rollouts with a policy update x {args.batch_size} prompts x {args.group_size} "
              f"responses, max_new_tokens {args.max_new_tokens}, temperature {args.temperature}, lr {args.lr}, "
              f"greedy accuracy on {args.val_size} held-out problems")
    write_report(args.out, "compare", f"Budget: {budget}\n\n{table(results)}\n",
                 {"budget": vars(args), "results": results}, results)
    last = final_line(results)
    record_all_finished(
        args, results, id="compare", section="Methods on the quickstart task",
        title=f"{', '.join(recipes)} for the same budget: {args.steps} rollouts x {args.batch_size} prompts x "
              f"{args.group_size} responses",
        note=f"Budget: {budget}. Each method runs its recipe with the shared overlay (tools/compare.py); greedy "
             "accuracy before and after on the same held-out problems, ± the paired standard error of the difference; "
             "responses and tokens generated (discarded ones included); train time is the sum of the RL steps, wall "
             "time includes loading and both evaluations.",
        columns=RECORD_COLUMNS, rows=[record_row(r) for r in results if r.get("accuracy_after") is not None],
        summary={f"{r['method']}_accuracy_after": printed(r.get("accuracy_after"), ".3f") for r in results},
        headline=", ".join(f"{r['method']} {{{r['method']}_accuracy_after:.3f}}" for r in results))
    print(machine_line())
    print(last)
    return 0 if all(r["returncode"] == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
