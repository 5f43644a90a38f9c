"""The league: every method's recipe on the quickstart task at one budget, over seeds, resumable.

Each method runs its recipe (``recipes/<method>.yaml``) as a subprocess, ``rllight fit --config <recipe> --config
<overlay> [--config <--config>...]``, once per seed; the runs go two at a time (``--jobs``), each with
``OMP_NUM_THREADS=1`` and ``MKL_NUM_THREADS=1``. Default seeds: 0, 1 and 2 for grpo, dapo, vapo, sppo, vespo and
ppo; 0 for the baselines rloo, dr_grpo, reinforce_pp, remax, gspo and cispo (``--seeds``, ``--baseline-seeds``).
A method may also be ``NAME=RECIPE``: a recipe, or an ablation overlay of recipes/ablations/, which runs on the base
its first line names (``vespo_grpo_minibatch=recipes/ablations/vespo-grpo-minibatch.yaml``: VESPO at GRPO's updates
per rollout), over ``--seeds``.

The overlay gives every run the quickstart's budget, read from ``recipes/quickstart.yaml`` (``--quickstart``; a flat,
complete recipe, read as written): its rollouts with a policy update (``trainer.max_steps`` over its updates per
rollout), prompts per rollout (``data.batch_size``), responses per prompt (the sampler's ``group_size``),
``max_new_tokens``, the rollouts' sampling temperature, held-out problems (``data.val_size``, ``val_batch_size``) and
precision. ``--steps``, ``--batch-size``, ``--group-size``, ``--max-new-tokens``, ``--temperature``, ``--val-size``
and ``--precision`` replace them (smoke runs). What stays each recipe's own, and is stated in each row: the learning
rates (the policy's, and a critic's where it has its own), the minibatching and every mechanism.

The temperature is the quickstart's for every method, though several recipes sample at 1.0 as their papers do: at
1.0 SmolLM2-135M's answers to the arithmetic task are mostly noise, every method (a critic above all) would learn
from a far sparser signal, and a method's own temperature would be a second difference between two rows.

- **Budget.** Every run makes the same rollouts of the same number of responses: prompts x responses per prompt.
  A recipe that samples one response per prompt (sampler ``group_size: 1``: ppo, sppo, reinforce_pp, remax; its
  baseline is a critic or the batch, not a group) keeps its one response and draws prompts x responses prompts
  instead. ``trainer.max_steps`` counts optimizer updates, so each run's is the rollouts times its updates per
  rollout, ``ppo_epochs * ceil(responses / minibatch_size)`` of its resolved configuration (``--print_config``),
  as tools/compare.py counts them. DAPO's dynamic sampling draws extra groups, and VAPO's value pretraining
  consumes rollouts before its first policy update: the table reports the RL steps, optimizer updates, responses
  and tokens each run actually made.
- **Precision.** One for every run: the quickstart's ``trainer.precision``, its ``auto`` resolved once here
  (``rllight.precision.resolve_precision``) and passed to each run as written.
- **Seeds.** A run's seed is its ``seed_everything`` and its ``data.seed`` (the order of the training prompts);
  the held-out problems are the task's own, the same for every run.
- **Evaluation.** The trainer's own ``evaluate_before_after`` with the quickstart's ``model.evaluation`` (k = its
  ``n`` samples per problem at its temperature, plus one greedy answer) and ``sampling_seed`` the run's seed, so the
  evaluations before training of one seed are the same for every method. From each run's saved evaluations
  (``<log dir>/evaluation/val_step<N>*.json``, tools/before_after.py): greedy accuracy, avg@k and pass@k before and
  after, overall and per problem.

**Resumable.** Each run has its folder, ``<out>/<method>/seed<seed>/``; when it ends, its results, per-problem
values included, go at once into ``run.json`` there (written whole: a temporary file, renamed). A run whose
``run.json`` is complete is skipped. A run that did not finish (killed, failed: its folder lacks a complete
``run.json``) is rerun from scratch: its folder is emptied first. It is not resumed from a checkpoint: checkpointing
is off (a full model with its optimizer's states, each run), and a resumed run would mix two processes' timings. A
complete run made with other settings (budget, precision, evaluation, overlays) is refused before anything starts:
name another ``--out``; so is one whose recipe's settings (its YAML, comments aside) changed since the commit it ran
at, as git tells. With ``--keep DIR`` each finished run's ``run.json`` is also written whole as
``DIR/<method>-seed<seed>.json`` (results and per-problem values; no logs, no weights): commit that folder, and a
league spread over sittings on fresh machines resumes from it, a run kept there counting as finished (its signals
are those its ``run.json`` holds where its log is not there). SIGTERM (or SIGINT) stops a league: the runs under way
are ended and count as not finished, no other starts, and the table is written. After every run, and at the end,
``<out>/league.md`` and ``league.json`` hold the table of what has finished and list every run still missing (not
run yet, or failed and why).

**Statistics** (tools/league_report.py), per method over its finished seeds s = 1..S and the held-out problems
p = 1..P they share, for each metric (greedy accuracy, avg@k, pass@k): d_sp = after_sp - before_sp, the per-problem
gain of seed s. The gain is the mean over seeds and problems of d_sp. Its standard error has two parts, one for each
draw that could move it: over the problems, paired, sd_p(d_p) / sqrt(P) with d_p = mean_s d_sp
(``rllight.evaluation.paired_se`` of the seed-averaged values before and after), and over the seeds,
sd_s(g_s) / sqrt(S) with g_s = mean_p d_sp the seed-level gain; the table's se is the root of the sum of their
squares (conservative: the part of the problems' noise that the seed-level gains carry counts twice). With one seed
the seeds' part is unknown and the se is the problems' only. The seeds' spread is shown beside it as the min..max of
the g_s. Against GRPO (greedy accuracy): e_p = d_p(method) - d_p(grpo) on the problems both share; the difference is
mean_p e_p, its standard error the root of sd_p(e_p)^2 / P plus both methods' seed parts (their seeds taken as
independent), and a method is flagged where the difference is below -2 standard errors.

**Mechanism signals**, read from each run's TensorBoard scalars (again each time the table is written, where the
run's log is there) and averaged over seeds: critic explained variance at the end of value pretraining, on the
fresh rollouts of its last window pooled (what its stopping criterion reads without a probe) and on the last one
alone, on its probe where it sets one aside (the criterion's reading then, so the stop was chosen on it), and its
rollouts, and over the last half of RL (VAPO, PPO: tools/compare.py's
``critic_summary``); DAPO's kept-group share (sum of ``train/sampling/groups_kept`` over sum of ``groups_drawn``)
and extra draws (sampling rounds beyond each step's first, summed); the critic's loss over the last half of RL
(``train/value/loss``, else ``train/critic_only/loss``: SPPO's is the BCE of its P(success) critic) and SPPO's
``train/value/calibration_corr``; VESPO's ``train/policy/vespo_ess`` (mean) and ``vespo_log_weight_absmax``
(largest); the clip fractions ``train/policy/clipfrac_low`` / ``clipfrac_high`` (means).

**Curves** (``--curve-every N``): the runs of ``--curve-methods`` (default grpo and sppo) are also evaluated every N
rollouts on the same held-out problems; each keeps its ``curve``: RL steps, greedy accuracy and the response tokens
generated until then (``curve``). The table gives, per method, the tokens generated until its greedy accuracy first
reached GRPO's after training (the mean over GRPO's seeds), over the seeds that reached it, and how many did: SPPO's
claim is that it reaches group sampling's accuracy at a lower cost. The resolution is N rollouts.

Outputs in ``--out``: the runs, ``league.md`` (the page: tables, missing runs, the figure ``league.png`` of each
method's gain with its standard error and seed range; matplotlib, else a line says why there is none) and
``league.json``. ``--record PATH`` (``rllight.app.records``, id ``league``) writes the record, one row per method
(its missing seeds named, values only where measured); ``--page-of RECORD`` writes the page of a record (``--page``,
default ``<out>/league.md``) and runs nothing.

Full league (SmolLM2-135M-Instruct, arithmetic, CPU; 24 runs; hours):

    .venv/bin/python tools/league.py --curve-every 10 --keep docs/results/league-runs --record docs/results/league.json

A league stopped partway (Ctrl-C, or ``kill`` its process: the runs under way are lost, those finished are kept)
gets its partial record with the same command and ``--no-run``, which starts nothing.

Smoke run (seconds a run; proves the pipeline, not the methods):

    .venv/bin/python tools/league.py --methods grpo rloo --seeds 0 1 --baseline-seeds 0 --steps 1 --batch-size 1 \\
        --group-size 2 --val-size 4 --max-new-tokens 8 --out runs/league-smoke
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed

import yaml

sys.path.append(os.path.dirname(os.path.abspath(__file__)))  # the tools beside it

from before_after import evaluations, greedy_curve, read_step  # noqa: E402
from compare import critic_summary, generated, read_scalars, resolved_config, updates_per_rollout  # noqa: E402
from league_recipes import changed_since, recipe_configs  # noqa: E402
from league_report import finite_mean, write_league, write_page  # noqa: E402

from rllight.app.records import add_record_options, check_record_options, git_commit  # noqa: E402
from rllight.evaluation.files import load_evaluation, write_json  # noqa: E402
from rllight.machine import machine_line  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAIN = ["grpo", "dapo", "vapo", "sppo", "vespo", "ppo"]
"""Methods run over ``--seeds``."""
BASELINES = ["rloo", "dr_grpo", "reinforce_pp", "remax", "gspo", "cispo"]
"""Methods run over ``--baseline-seeds``."""
SUMMARY = "run.json"
"""A run's results, in its folder; complete once the run finished."""
STOP = threading.Event()
"""Set by SIGTERM or SIGINT: no run starts after it."""
RUNNING: set[subprocess.Popen] = set()
"""The runs under way (their processes), ended when the league is stopped."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--methods", nargs="+", default=MAIN + BASELINES,
                   help="Methods: names of recipes/<name>.yaml, or NAME=RECIPE.yaml (run over --seeds; an ablation "
                        "overlay of recipes/ablations/ runs on the base its first line names).")
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2], help=f"Seeds of {', '.join(MAIN)}.")
    p.add_argument("--baseline-seeds", nargs="+", type=int, default=[0], help=f"Seeds of {', '.join(BASELINES)}.")
    p.add_argument("--out", default="runs/league", help="Folder of the runs, league.md and league.json.")
    p.add_argument("--keep", metavar="DIR", help="Also write each finished run's run.json as DIR/<method>-seed<seed>"
                                                 ".json (commit it); a run kept there counts as finished.")
    p.add_argument("--jobs", type=int, default=2, help="Runs side by side (each with one thread).")
    p.add_argument("--quickstart", default="recipes/quickstart.yaml", help="The recipe the budget is read from.")
    p.add_argument("--steps", type=int, help="Rollouts with a policy update (default: the quickstart's).")
    p.add_argument("--batch-size", type=int, help="Prompts per rollout (default: the quickstart's).")
    p.add_argument("--group-size", type=int, help="Responses per prompt (default: the quickstart's).")
    p.add_argument("--max-new-tokens", type=int, help="Longest response (default: the quickstart's).")
    p.add_argument("--temperature", type=float, help="The rollouts' sampling temperature (default: the quickstart's).")
    p.add_argument("--val-size", type=int, help="Held-out problems (default: the quickstart's).")
    p.add_argument("--precision", help="trainer.precision of every run (default: the quickstart's, auto resolved).")
    p.add_argument("--config", action="append", default=[],
                   help="Another overlay applied to every run after the league's (repeatable).")
    p.add_argument("--curve-every", type=int, help="Also evaluate the runs of --curve-methods every N rollouts: "
                                                   "the tokens each method generates to reach GRPO's accuracy.")
    p.add_argument("--curve-methods", nargs="+", default=["grpo", "sppo"],
                   help="The methods whose runs --curve-every evaluates (default: grpo sppo).")
    p.add_argument("--no-run", action="store_true",
                   help="Start no run: write the table, the page and the record (--record) of the runs finished so "
                        "far, naming the rest missing. The record's command is the league's, without this flag.")
    p.add_argument("--page-of", metavar="RECORD", help="Write the page of this record (--page) and run nothing.")
    p.add_argument("--page", help="Where the page goes (default: <out>/league.md); its figure beside it (.png).")
    add_record_options(p, id="league", section="Methods on the quickstart task")
    args = p.parse_args(argv)
    for name in ("steps", "batch_size", "group_size", "max_new_tokens", "val_size", "jobs", "curve_every"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    given = sys.argv[1:] if argv is None else argv
    check_record_options(p, args, [a for a in given if a != "--no-run"], __file__)
    return args


def budget(args: argparse.Namespace) -> dict:
    """The league's budget and evaluation: the quickstart recipe's, each replaced where an option gives one."""
    with open(os.path.join(ROOT, args.quickstart)) as f:
        quickstart = yaml.safe_load(f)
    model, data, trainer = quickstart["model"], quickstart["data"], quickstart["trainer"]
    precision = args.precision or trainer.get("precision", "auto")
    if precision == "auto":
        from rllight.precision import resolve_precision

        precision = resolve_precision(trainer.get("accelerator"))[0]
    evaluation = dict(model["evaluation"])
    return {
        "rollouts": args.steps or int(trainer["max_steps"]) // updates_per_rollout(quickstart),
        "prompts": args.batch_size or int(data["batch_size"]),
        "responses": args.group_size or int(model["sampler"]["init_args"]["group_size"]),
        "max_new_tokens": args.max_new_tokens or int(model["rollout"]["init_args"]["max_new_tokens"]),
        "temperature": (args.temperature if args.temperature is not None
                        else float(model["rollout"]["init_args"]["temperature"])),
        "val_size": args.val_size or int(data["val_size"]),
        "val_batch_size": data.get("val_batch_size"),
        "precision": str(precision),
        "evaluation": evaluation,
        "k": int(evaluation.get("n", 1)),
    }


def metric_keys(k: int) -> dict[str, tuple[str, str]]:
    """The league's metrics: record key -> (logged key, label)."""
    return {"greedy": ("val/greedy/avg@1", "greedy accuracy"), f"avg{k}": (f"val/avg@{k}", f"avg@{k}"),
            f"pass{k}": (f"val/pass@{k}", f"pass@{k}")}


def plan(args: argparse.Namespace) -> list[dict]:
    """Every run of the league, seed by seed (so that a league stopped early holds whole seeds first)."""
    methods = {}
    for spec in args.methods:
        name, _, recipe = spec.partition("=")
        recipe = recipe or f"recipes/{name}.yaml"
        if not os.path.isfile(os.path.join(ROOT, recipe)):
            raise SystemExit(f"league: no recipe {recipe} for method {name!r}")
        methods[name] = (recipe, args.baseline_seeds if name in BASELINES else args.seeds)
    seeds = sorted({s for _, ss in methods.values() for s in ss})
    every = getattr(args, "curve_every", None)
    return [{"method": m, "recipe": r, "seed": s, "dir": os.path.join(args.out, m, f"seed{s}"),
             "curve_every": every if m in getattr(args, "curve_methods", ()) else None}
            for s in seeds for m, (r, ss) in methods.items() if s in ss]


def settings(run: dict, spent: dict, configs: list[str]) -> dict:
    """What a run measures under: a complete run made under other settings is not this league's."""
    return {"recipe": run["recipe"], "seed": run["seed"], **spent, "configs": configs,
            **({"curve_every": run["curve_every"]} if run.get("curve_every") else {})}


def overlay(run: dict, spent: dict, prompts: int | None = None, group: int | None = None, updates: int = 1) -> dict:
    """The league's overlay of one run; without ``prompts`` and ``group`` the recipe's own sampling stays (to read
    its group size)."""
    out = {
        "seed_everything": run["seed"],
        "evaluate_before_after": True,
        "trainer": {"max_steps": spent["rollouts"] * updates, "default_root_dir": run["dir"],
                    "enable_checkpointing": False, "check_val_every_n_epoch": None,
                    # no mid-run validation (before and after only) but for a method whose curve is measured
                    "val_check_interval": run.get("curve_every") or 10**9,
                    "limit_val_batches": None, "precision": spent["precision"]},
        "model": {"rollout": {"init_args": {"max_new_tokens": spent["max_new_tokens"],
                                            "temperature": spent["temperature"]}},
                  "evaluation": {**spent["evaluation"], "sampling_seed": run["seed"]}, "export_dir": None},
        "data": {"val_size": spent["val_size"], "seed": run["seed"]},
    }
    if spent.get("val_batch_size"):
        out["data"]["val_batch_size"] = spent["val_batch_size"]
    if group is not None:
        out["model"]["sampler"] = {"init_args": {"group_size": group}}
        out["data"]["batch_size"] = prompts
    return out


def launch(cmd: list[str], log_path: str) -> int:
    """Run ``cmd`` from the repository root with one thread, its output in ``log_path``; its exit status (ended,
    and counted as failed, when the league is stopped)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    with open(log_path, "w") as log:
        process = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        RUNNING.add(process)
        try:
            if STOP.is_set():  # stopped while this one was starting
                process.terminate()
            return process.wait()
        finally:
            RUNNING.discard(process)


def stop(signum: int, _frame) -> None:
    """The league's SIGTERM and SIGINT handler: no run starts after it, and the runs under way are ended."""
    STOP.set()
    print(f"league: stopping ({signal.Signals(signum).name}): ending {len(RUNNING)} run(s) under way; "
          "they count as not finished", file=sys.stderr, flush=True)
    for process in list(RUNNING):
        process.terminate()


def run_one(run: dict, spent: dict, configs: list[str]) -> dict | None:
    """One run from scratch in its folder; its ``run.json`` written whole when it ends (complete or not). None where
    the league was stopped before it started."""
    if STOP.is_set():
        return None
    folder = run["dir"]
    shutil.rmtree(folder, ignore_errors=True)  # a run that did not finish starts again from nothing
    os.makedirs(folder)
    path = os.path.join(folder, "overlay.yaml")
    extra = [a for c in configs for a in ("--config", c)]
    recipe = [a for c in recipe_configs(run["recipe"]) for a in ("--config", c)]
    cmd = [sys.executable, "-m", "rllight", "fit", *recipe, "--config", path, *extra]
    result = {"method": run["method"], "seed": run["seed"], "recipe": run["recipe"], "complete": False, "settings":
              settings(run, spent, configs), "commit": git_commit(), "machine": machine_line()[9:].split(", load")[0]}
    with open(path, "w") as f:
        yaml.safe_dump(overlay(run, spent), f, sort_keys=False)
    try:
        config = resolved_config(cmd)
    except SystemExit as e:  # the recipe does not resolve: this run fails, the league goes on
        return finish(folder, {**result, "error": str(e)})
    own_group = int(((config["model"].get("sampler") or {}).get("init_args") or {}).get("group_size") or 1)
    group = 1 if own_group == 1 else spent["responses"]
    prompts = spent["prompts"] * spent["responses"] // group
    sized = {**config, "data": {**config["data"], "batch_size": prompts},
             "model": {**config["model"], "sampler": {"init_args": {"group_size": group}}}}
    per_rollout = updates_per_rollout(sized)
    with open(path, "w") as f:
        yaml.safe_dump(overlay(run, spent, prompts, group, per_rollout), f, sort_keys=False)
    lr = config["model"]["optimizer"]["init_args"].get("lr")
    critic = config["model"].get("critic")
    critic_lr = ((critic.get("init_args") or {}).get("lr") or lr) if critic else None  # None: the policy's
    result.update(prompts=prompts, group_size=group, lr=lr, critic_lr=critic_lr, updates_per_rollout=per_rollout,
                  temperature=config["model"]["rollout"]["init_args"].get("temperature"))
    print(f"league: {run['method']} seed {run['seed']}: {prompts} prompts x {group}, {per_rollout} updates per "
          f"rollout; {' '.join(cmd)}", flush=True)
    t0 = time.perf_counter()
    result["returncode"] = launch(cmd, os.path.join(folder, "stdout.log"))
    result["wall_s"] = time.perf_counter() - t0
    logs = sorted(glob.glob(os.path.join(folder, "lightning_logs", "version_*")),
                  key=lambda p: int(p.rsplit("_", 1)[-1]))
    if result["returncode"] == 0 and logs and os.path.isfile(os.path.join(logs[-1], "eval_summary.json")):
        result.update(measured(logs[-1], spent, prompts, group, bool(run.get("curve_every"))),
                      log_dir=os.path.relpath(logs[-1], folder),
                      complete=True)
    return finish(folder, result)


def finish(folder: str, result: dict) -> dict:
    """Write ``result`` as the run's ``run.json``, whole, and return it."""
    write_json(os.path.join(folder, SUMMARY), result)
    return result


def measured(log_dir: str, spent: dict, prompts: int, group: int, with_curve: bool = False) -> dict:
    """What a finished run measured: each metric before and after, overall and per problem, the RL steps and
    optimizer updates (of the evaluation after training), what it generated, its mechanism's signals and, with
    ``with_curve``, its ``curve``."""
    steps = evaluations(log_dir)
    (before, before_pp), (after, after_pp) = read_step(log_dir, steps[0]), read_step(log_dir, steps[-1])
    saved, _ = load_evaluation(os.path.join(log_dir, "evaluation"), f"val_step{steps[-1]}")
    metrics, per_problem = {}, {}
    for key, (logged, _) in metric_keys(spent["k"]).items():
        metrics[key] = {"before": before.get(logged), "after": after.get(logged)}
        per_problem[key] = {"before": before_pp.get(logged), "after": after_pp.get(logged)}
    scalars = read_scalars(log_dir)
    responses, tokens = generated(scalars, prompts, group)
    return {"metrics": metrics, "per_problem": per_problem, "rl_steps": saved.get("rl_step"),
            "updates": saved.get("global_step"), "responses": responses, "tokens": tokens,
            "train_s": sum(scalars.get("train/time/step", [])), "signals": signals(scalars),
            "curve": curve(log_dir) if with_curve else None}


def curve(log_dir: str) -> list[list[float]]:
    """``[RL steps, greedy accuracy, response tokens generated up to then]`` at each evaluation a run saved (before
    training, every ``--curve-every`` rollouts, after): the tokens are those of its training steps up to that RL step
    (``train/sampling/generated_tokens`` where dynamic sampling logs what it discarded too, else
    ``train/response/tokens``), as the TensorBoard log holds them by RL step."""
    from plot import read_scalars as scalars_by_step

    series = scalars_by_step(log_dir)
    per_step = series.get("train/sampling/generated_tokens") or series.get("train/response/tokens") or []
    return [[step, greedy, sum(v for s, v in per_step if s <= step)] for step, greedy in greedy_curve(log_dir)]


def _last_half(values: list[float] | None) -> float | None:
    return finite_mean(values[len(values) // 2:]) if values else None


def signals(scalars: dict[str, list[float]]) -> dict:
    """The mechanism's own signals of one run (see the module's docstring); a key only where the run logged it."""
    out = critic_summary(scalars)
    drawn, kept = scalars.get("train/sampling/groups_drawn"), scalars.get("train/sampling/groups_kept")
    if drawn and kept and sum(drawn):
        out["kept_share"] = sum(kept) / sum(drawn)
        out["extra_draws"] = sum(r - 1 for r in scalars.get("train/sampling/rounds", []))
    loss = scalars.get("train/value/loss") or scalars.get("train/critic_only/loss")
    absmax = scalars.get("train/policy/vespo_log_weight_absmax")
    found = {"value_loss": _last_half(loss),
             "calibration_corr": _last_half(scalars.get("train/value/calibration_corr")),
             "vespo_ess": finite_mean(scalars.get("train/policy/vespo_ess", [])),
             "vespo_log_weight_absmax": max(absmax) if absmax else None,
             "clipfrac_low": finite_mean(scalars.get("train/policy/clipfrac_low", [])),
             "clipfrac_high": finite_mean(scalars.get("train/policy/clipfrac_high", []))}
    return {**out, **{k: v for k, v in found.items() if v is not None}}


def kept_path(keep: str, method: str, seed: int) -> str:  # where --keep holds a finished run's run.json
    return os.path.join(keep, f"{method}-seed{seed}.json")


def _complete(path: str) -> dict | None:
    try:
        with open(path) as f:
            result = json.load(f)
    except (OSError, ValueError):
        return None
    return result if result.get("complete") else None


def read_done(runs: list[dict], keep: str | None = None) -> dict[tuple[str, int], dict]:
    """The complete ``run.json`` of each planned run that has one, in its folder or else kept in ``keep``; its
    ``signals`` read again from its log where the log is there (so that the table's signals are those this code
    defines, also for runs finished before). A finished run not kept yet is written to ``keep``."""
    done = {}
    for run in runs:
        result = _complete(os.path.join(run["dir"], SUMMARY))
        kept = kept_path(keep, run["method"], run["seed"]) if keep else None
        if result is None and kept:
            result = _complete(kept)
        elif result is not None and kept and not os.path.isfile(kept):
            write_json(kept, result)
        if result is None:
            continue
        log_dir = os.path.join(run["dir"], result.get("log_dir") or "-")
        if os.path.isdir(log_dir):
            result["signals"] = signals(read_scalars(log_dir))
        done[run["method"], run["seed"]] = result
    return done


def collect(result: dict | None, done: dict, failed: dict, out: str, keep: str | None = None) -> None:
    """File a run's ``result`` under ``done`` (and ``keep``) or ``failed`` (and say where its log is); a run that
    never started (None) under neither."""
    if result is None:
        return
    key = (result["method"], result["seed"])
    if result["complete"]:
        done[key] = result
        if keep:
            write_json(kept_path(keep, *key), result)
        return
    failed[key] = result
    print(f"league: {key[0]} seed {key[1]} failed (exit {result.get('returncode')}"
          + (f": {result['error']}" if result.get("error") else "")
          + f"); see {os.path.join(out, key[0], f'seed{key[1]}', 'stdout.log')}", file=sys.stderr)


def page_only(args: argparse.Namespace) -> int:
    with open(args.page_of) as f:
        record = json.load(f)
    page = args.page or os.path.join(os.path.abspath(args.out), "league.md")
    write_page(record, page, plot=True)
    print(f"league: page {page}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.page_of:
        return page_only(args)
    args.out = os.path.abspath(args.out)
    os.makedirs(args.out, exist_ok=True)
    spent, runs = budget(args), plan(args)
    done = read_done(runs, args.keep)
    other = [f"{r['dir']}" for r in runs if (r["method"], r["seed"]) in done
             and done[r["method"], r["seed"]]["settings"] != settings(r, spent, args.config)]
    if other:
        raise SystemExit(f"league: finished runs of other settings: {', '.join(other)}; name another --out, --keep")
    stale = [f"{m} seed {s} ({', '.join(paths)} since {done[m, s]['commit']})" for (m, s) in sorted(done)
             if (paths := changed_since(done[m, s]))]
    if stale:
        raise SystemExit(f"league: finished runs whose recipe changed since they ran: {'; '.join(stale)}; rerun them "
                         "(move their run.json and kept file aside) or name another --out, --keep")
    failed: dict[tuple[str, int], dict] = {}
    todo = [] if args.no_run else [r for r in runs if (r["method"], r["seed"]) not in done]
    print(f"league: {len(runs)} runs, {len(done)} finished already, {len(todo)} to run", flush=True)
    metrics = metric_keys(spent["k"])
    write_league(args, spent, metrics, runs, done, failed)
    STOP.clear()
    handlers = {s: signal.signal(s, stop) for s in (signal.SIGTERM, signal.SIGINT)} if todo else {}
    try:
        with ThreadPoolExecutor(max_workers=args.jobs) as pool:
            for future in as_completed([pool.submit(run_one, r, spent, args.config) for r in todo]):
                collect(future.result(), done, failed, args.out, args.keep)
                write_league(args, spent, metrics, runs, done, failed)
    finally:
        for s, handler in handlers.items():
            signal.signal(s, handler)
    if STOP.is_set():
        print("league: stopped; the same command resumes it", file=sys.stderr)
    write_league(args, spent, metrics, runs, done, failed, final=True)
    print(machine_line())
    print(f"finished={len(done)} missing={len(runs) - len(done)}")
    return 0 if len(done) == len(runs) else 1


if __name__ == "__main__":
    sys.exit(main())
