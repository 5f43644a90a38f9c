"""Fit critic options on the same frozen-policy rollouts: how well each predicts the return before RL starts.

While value pretraining runs the policy does not move, so its rollouts are samples of one distribution: they can be
generated once and every critic option fitted on the same ones, in the same order. The options then differ by
their settings alone, with no sampling noise between them (a paired comparison; the optimizer's own draws, the
minibatch order, are seeded alike).

1. **Rollouts.** ``rllight fit --config <recipe> [--config ...]`` with ``trainer.callbacks`` replaced by
   ``SaveRollouts``, which saves each scored rollout (``<out>/rollouts/r000.pt``, ...) and consumes it: no update,
   the policy frozen, as in value pretraining. Rollouts already saved are kept; only the missing ones are made.
2. **Fits.** For each ``--option NAME KEY=VALUE ...``, a ``rllight.critics.SeparateCritic`` (a copy of the recipe's
   policy with a zero head, as ``recipes/vapo.yaml``'s) fits the rollouts one by one as ``ValuePretraining`` does:
   on each rollout, first the held-out numbers (the critic's values before it trains on it, against the
   Monte-Carlo returns: the outcome reward on every response token, gamma 1), then ``epochs`` passes of
   AdamW updates over minibatches of ``minibatch`` responses with the value loss (``loss_coef`` times its token
   mean, clipped around the values at the rollout's start where ``clip`` is set) and the trainer's gradient-norm
   clip of 1.0, on the rollout and the ``replay`` rollouts before it (their values scored again). Keys: ``lr``,
   ``head_lr``, ``clip`` (0 = none), ``epochs``, ``minibatch``, ``replay``, ``loss_coef``, ``sampling`` (below).
   Options run ``--jobs`` at a time (two by default), each in a child with the cores shared out, under the recipe's
   precision. A finished option (its ``<out>/<NAME>.json``) is skipped.

Reported per option: the explained variance of the held-out values, pooled over the response tokens of rollouts 2 to
N (the first is scored by the untrained critic) and over each window of ``--window`` rollouts, and the held-out value
loss likewise. Beside them, per window, the share of the returns' variance that lies between prompts (the variance of
each prompt's mean return over the variance of the returns, in sample): what a critic that knew each prompt's success
rate but nothing of the response could explain.

``--sampling NAME KEY=VALUE ...`` names rollouts sampled with more recipe settings on top of ``--set`` (e.g. more
prompts per rollout and fewer responses each); an option with ``sampling=NAME`` fits those (``<out>/seed-<s>/NAME``,
as many as ``--rollouts``) instead, and is scored on the same probe as every other option.

``--probe M`` also samples M more rollouts that no option fits: after each rollout's fit the critic scores all of them,
so the probe's explained variance follows one critic after another on the same responses. A change in it is a change
in the critic, not in which responses came. Beside it the tool replays the recipe's ``ValuePretraining`` criterion
(its settings as the recipe resolves them) on the option's held-out numbers: the rollout it would stop after, the
criterion's pooled window there, and the probe's explained variance there; ``--min-ev`` adds the same with
``min_explained_variance`` set. With two or more probe rollouts the probe is also split in two: the criterion reads
the first half after each fit (as ``ValuePretraining(probe=...)`` reads its probe), and the second half, which that
stop never saw, judges the critic where it stops and where the criterion on the window stops. ``--seeds 0 1 2``: each
seed samples rollouts of its own (``<out>/seed-<s>``) and every option fits each seed's; a row per option and seed,
then (with a probe) each option's probe columns averaged over the seeds and each later option's paired difference
from the first, averaged, with its smallest and largest.

Run (SmolLM2-135M-Instruct, VAPO's recipe at the league's 4 prompts x 8 responses and temperature; the recipe's critic
and two variants over three seeds, a probe of 8 rollouts, the criterion also replayed with a minimum of 0.1 and 0.2):

    .venv/bin/python tools/critic_fit.py --recipe recipes/vapo.yaml --set data.batch_size=4 \\
        --set model.rollout.init_args.temperature=0.7 --rollouts 30 --probe 8 --min-ev 0.1 0.2 --seeds 0 1 2 \\
        --option recipe lr=1e-5 head_lr=1e-4 clip=0 epochs=1 replay=4 --jobs 1 --out runs/critic-probe \\
        --option slow-head lr=1e-5 head_lr=3e-5 clip=0 epochs=1 replay=4 \\
        --option replay-12 lr=1e-5 head_lr=1e-4 clip=0 epochs=1 replay=12
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.append(os.path.dirname(os.path.abspath(__file__)))  # the tools beside it

from critic_fit_table import (  # noqa: E402
    monte_carlo_returns, pooled, rollout_path, sampling_dir, seed_dir, summary, table)

from rllight.app.records import add_record_options, check_record_options, tool_record  # noqa: E402
from rllight.callbacks.base import RolloutCallback  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KEYS = {"lr": float, "head_lr": float, "clip": float, "epochs": int, "minibatch": int, "replay": int,
        "loss_coef": float, "sampling": str}
DEFAULTS = {"lr": 1e-4, "head_lr": None, "clip": 0.2, "epochs": 4, "minibatch": 16, "replay": 0, "loss_coef": 0.5}


class SaveRollouts(RolloutCallback):
    """Save each scored rollout to ``folder`` (``r<k>.pt``, from ``start``) and consume it; stop after ``count``."""

    rollout_order = 1

    def __init__(self, folder: str, start: int = 0, count: int = 1):
        self.folder, self.next, self.end = folder, start, start + count

    def on_rollout(self, trainer, context, rollout):
        path = os.path.join(self.folder, f"r{self.next:03d}.pt")
        torch.save(rollout.to("cpu"), path + ".part")
        os.replace(path + ".part", path)
        self.next += 1
        if self.next >= self.end and trainer is not None:
            trainer.should_stop = True
        return None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--recipe", default="recipes/vapo.yaml", help="The recipe whose policy samples the rollouts.")
    p.add_argument("--config", action="append", default=[], help="Another overlay on the recipe (repeatable).")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="One more recipe setting for the rollouts, e.g. data.batch_size=4 (repeatable).")
    p.add_argument("--rollouts", type=int, default=30, help="Rollouts to fit on.")
    p.add_argument("--probe", type=int, default=0,
                   help="Rollouts more that no option fits, scored by the critic after each fit (0 = none).")
    p.add_argument("--min-ev", type=float, nargs="*", default=[],
                   help="Also replay the recipe's stopping criterion with min_explained_variance at each value.")
    p.add_argument("--option", action="append", nargs="+", default=[], metavar="NAME [KEY=VALUE ...]",
                   help=f"A critic option: a name and settings among {', '.join(KEYS)} (repeatable).")
    p.add_argument("--sampling", action="append", nargs="+", default=[], metavar="NAME KEY=VALUE",
                   help="Rollouts sampled with more recipe settings, for options with sampling=NAME (repeatable).")
    p.add_argument("--window", type=int, default=10, help="Rollouts per window of the pooled numbers.")
    p.add_argument("--jobs", type=int, default=2, help="Options fitted at once, the cores shared out between them.")
    p.add_argument("--seeds", "--seed", type=int, nargs="+", default=[0],
                   help="Seeds: each samples rollouts of its own (the recipe's seed) and seeds the fits on them.")
    p.add_argument("--out", default="runs/critic-fit", help="Folder for the rollouts and each option's results.")
    p.add_argument("--fit-one", nargs=2, help=argparse.SUPPRESS)  # a child's option name and seed
    add_record_options(p, id="critic-fit", section="Methods on the quickstart task")
    args = p.parse_args(argv)
    if not args.option:
        p.error("name at least one --option")
    if args.probe < 0 or args.rollouts < 1:
        p.error("--rollouts must be at least 1 and --probe at least 0")
    args.options = {}
    for name, *pairs in args.option:
        settings = dict(DEFAULTS)
        for pair in pairs:
            key, sep, value = pair.partition("=")
            if not sep or key not in KEYS:
                p.error(f"--option {name}: {pair!r} is not KEY=VALUE with KEY one of {', '.join(KEYS)}")
            settings[key] = KEYS[key](value)
        args.options[name] = settings
    args.samplings = {}
    for name, *pairs in args.sampling:
        if (not pairs or not all("=" in pair for pair in pairs) or not name.replace("-", "").isalnum()
                or name in ("rollouts", "sampling")):
            p.error(f"--sampling {name}: give a name of letters, digits and dashes (not 'rollouts' or 'sampling'), "
                    f"then recipe settings KEY=VALUE")
        args.samplings[name] = pairs
    used = {settings.get("sampling") for settings in args.options.values()} - {None}
    if used - set(args.samplings) or set(args.samplings) - used:
        p.error(f"each --option's sampling= must be a --sampling name and each --sampling used by an option: options "
                f"use {sorted(used) or 'none'}, --sampling names {sorted(args.samplings) or 'none'}")
    check_record_options(p, args, argv, __file__)
    return args


# ------------------------------------------------------------------------------------------------- rollouts


def recipe_args(args: argparse.Namespace, *overlays: str, sampling: str | None = None) -> list[str]:
    """``rllight fit``'s arguments for the recipe: its ``--config`` files, ``overlays``, then each ``--set`` and
    ``sampling``'s settings."""
    configs, sets = [args.recipe, *args.config, *overlays], [*args.set, *args.samplings.get(sampling, [])]
    return [*sum((["--config", c] for c in configs), []), *sum((["--" + k, v] for k, _, v in
                                                                (s.partition("=") for s in sets)), [])]


def make_rollouts(args: argparse.Namespace, seed: int, sampling: str | None = None) -> None:
    """Sample the rollouts of ``seed`` not yet saved (the fitted ones, then the probe; ``sampling``'s only the fitted
    ones), each run of ``rllight fit`` from the first missing one on."""
    folder = sampling_dir(args.out, seed, sampling)
    total = args.rollouts + (args.probe if sampling is None else 0)
    os.makedirs(os.path.join(folder, "rollouts"), exist_ok=True)
    missing = [k for k in range(total) if not os.path.exists(rollout_path(folder, k))]
    if not missing:
        return
    start = missing[0]
    overlay = os.path.join(folder, "save-rollouts.yaml")
    with open(overlay, "w") as f:
        json.dump({"seed_everything": seed + start, "evaluate_before_after": False,
                   "trainer": {"callbacks": [{"class_path": "critic_fit.SaveRollouts", "init_args": {
                       "folder": os.path.join(os.path.abspath(folder), "rollouts"), "start": start,
                       "count": total - start}}],
                       "default_root_dir": os.path.join(folder, "sampling"), "enable_checkpointing": False,
                       "val_check_interval": 10**9, "check_val_every_n_epoch": None, "max_steps": 10**6,
                       "limit_val_batches": 0},
                   "model": {"guards": {"max_steps_without_update": None}}, "data": {"seed": seed}}, f)
    cmd = [sys.executable, "-m", "rllight", "fit", *recipe_args(args, overlay, sampling=sampling)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(os.path.abspath(__file__)),
                                                        os.environ.get("PYTHONPATH", "")])}
    print(f"critic_fit: seed {seed}: sampling rollouts {start}..{total - 1}"
          + (f" of {sampling}" if sampling else ""), flush=True)
    with open(os.path.join(folder, "sampling.log"), "w") as log:
        code = subprocess.call(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    made = sum(os.path.exists(rollout_path(folder, k)) for k in range(total))
    if made < total:
        raise SystemExit(f"critic_fit: sampling ended (exit {code}) with {made} of {total} rollouts; see "
                         f"{os.path.join(folder, 'sampling.log')}")


def resolved_setup(args: argparse.Namespace) -> dict:
    """The recipe's policy source (``model.model``), precision and ``ValuePretraining`` settings (None without it),
    as the rollouts' run resolved them."""
    import yaml

    from rllight.precision import resolve_precision

    cmd = [sys.executable, "-m", "rllight", "fit", *recipe_args(args), "--print_config"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"critic_fit: cannot resolve {args.recipe}: {(proc.stderr.strip().splitlines() or ['?'])[-1]}")
    config = yaml.safe_load(proc.stdout)
    precision = str(config["trainer"].get("precision") or "32-true")
    if precision == "auto":
        precision = resolve_precision(config["trainer"].get("accelerator"))[0]
    pretraining = [c.get("init_args") or {} for c in config["trainer"].get("callbacks") or []
                   if isinstance(c, dict) and str(c.get("class_path", "")).endswith("ValuePretraining")]
    return {"model": config["model"]["model"], "precision": precision,
            "value_pretraining": pretraining[0] if pretraining else None}


# ----------------------------------------------------------------------------------------------------- fits
def build(spec: dict):
    """An object from a recipe's ``{class_path, init_args}``."""
    import importlib

    module, _, name = spec["class_path"].rpartition(".")
    return getattr(importlib.import_module(module), name)(**(spec.get("init_args") or {}))


def with_returns(rollout):
    """``rollout`` with its Monte-Carlo returns (``critic_fit_table.monte_carlo_returns``)."""
    rollout.returns = monte_carlo_returns(rollout)
    return rollout


def tokens(rollout) -> tuple[torch.Tensor, torch.Tensor]:
    """The values and returns of ``rollout``'s response tokens."""
    mask = rollout.response_mask.bool()
    return rollout.values[mask], rollout.returns[mask]


def fit_one(args: argparse.Namespace, name: str, seed: int) -> dict:
    """Fit option ``name`` on the rollouts of ``seed``; its held-out values and returns per rollout, and with a
    probe the probe's explained variance and loss after each fit."""
    from rllight.critics import SeparateCritic

    folder = seed_dir(args.out, seed)
    setup = json.load(open(os.path.join(args.out, "setup.json")))
    settings = args.options[name]
    torch.manual_seed(seed)
    order = random.Random(seed)
    source = build(setup["model"])
    critic = SeparateCritic(loss_coef=settings["loss_coef"], clip=settings["clip"] or None, lr=settings["lr"],
                            head_lr=settings["head_lr"])
    policy, tokenizer = source.load()
    critic.setup(policy, tokenizer, source)
    del policy
    optimizer = torch.optim.AdamW(critic.param_groups(), lr=settings["lr"], weight_decay=0.0)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=setup["precision"].startswith("bf16"))

    def score(rollout) -> None:
        with torch.no_grad(), autocast:
            rollout.values = critic.values(rollout, None).float() * rollout.response_mask

    probe = [with_returns(torch.load(rollout_path(folder, args.rollouts + j), weights_only=False))
             for j in range(args.probe)]
    held_out, probed, halves, earlier, start = [], [], [], [], time.time()
    fitted = sampling_dir(args.out, seed, settings.get("sampling"))
    for k in range(args.rollouts):
        rollout = with_returns(torch.load(rollout_path(fitted, k), weights_only=False))
        score(rollout)
        held_out.append([x.tolist() for x in tokens(rollout)])
        for part in earlier:
            score(part)
        batches = [rollout, *earlier]
        earlier = ([rollout, *earlier])[: settings["replay"]]
        fit(critic, optimizer, batches, settings, order, autocast)
        for part in probe:
            score(part)
        if probe:
            scored = [tokens(part) for part in probe]
            probed.append(list(pooled(scored)))
            halves.append([list(pooled(half)) for half in probe_halves(scored)])
        print(f"critic_fit: {name}, seed {seed}: rollout {k + 1}/{args.rollouts} explained variance "
              f"{pooled([tuple(map(torch.tensor, held_out[-1]))])[0]:.3f}"
              + (f", probe {probed[-1][0]:.3f}" if probe else ""), flush=True)
    result = {"option": name, "seed": seed, "settings": settings, "held_out": held_out, "probe": probed,
              "probe_halves": halves, "seconds": round(time.time() - start)}
    path = os.path.join(folder, f"{name}.json")
    with open(path + ".part", "w") as f:
        json.dump(result, f)
    os.replace(path + ".part", path)
    return result


def probe_halves(probe: list) -> list[list]:
    """The first and second half of the probe's rollouts (here their scored tokens; the first half has the odd one):
    two probes of the same critic, so a stop chosen on one can be judged on the other."""
    middle = (len(probe) + 1) // 2
    return [half for half in (probe[:middle], probe[middle:]) if half]


def fit(critic, optimizer, batches: list, settings: dict, order: random.Random, autocast) -> None:
    """``epochs`` passes of AdamW updates over minibatches of each of ``batches``, with the value loss and the
    trainer's gradient-norm clip of 1.0."""
    from rllight.algorithms import masked_mean

    params = [p for p in critic.parameters() if p.requires_grad]
    for _ in range(settings["epochs"]):
        for part in batches:
            rows = list(range(len(part)))
            order.shuffle(rows)
            for first in range(0, len(rows), settings["minibatch"]):
                batch = part.select(rows[first : first + settings["minibatch"]])
                with autocast:
                    per_token, _ = critic.loss(critic.values(batch, None).float(), batch)
                loss = settings["loss_coef"] * masked_mean(per_token.float(), batch.response_mask.float())
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(params, 1.0)
                optimizer.step()


def fit_options(args: argparse.Namespace, argv: list[str]) -> None:
    """Fit every option and seed without results yet, ``--jobs`` at a time, each in a child with its share of the
    cores (``os.cpu_count() // jobs`` threads, at least one)."""
    todo = [(name, seed) for name in args.options for seed in args.seeds
            if not os.path.exists(os.path.join(seed_dir(args.out, seed), f"{name}.json"))]
    threads = str(max(1, (os.cpu_count() or 1) // max(args.jobs, 1)))
    env = {**os.environ, "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads}
    running: list[tuple[str, subprocess.Popen]] = []
    failed = []
    while todo or running:
        while todo and len(running) < max(args.jobs, 1):
            name, seed = todo.pop(0)
            log_path = os.path.join(seed_dir(args.out, seed), f"{name}.log")
            log = open(log_path, "w")
            running.append((log_path, subprocess.Popen([sys.executable, os.path.abspath(__file__), *argv,
                                                        "--fit-one", name, str(seed)],
                                                       cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)))
        time.sleep(1)
        for log_path, proc in list(running):
            if proc.poll() is not None:
                running.remove((log_path, proc))
                if proc.returncode != 0:
                    failed.append(f"exit {proc.returncode}; see {log_path}")
    if failed:
        raise SystemExit(f"critic_fit: failed: {', '.join(failed)}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    if args.fit_one:
        fit_one(args, args.fit_one[0], int(args.fit_one[1]))
        return 0
    os.makedirs(args.out, exist_ok=True)
    setup_path = os.path.join(args.out, "setup.json")
    if not os.path.exists(setup_path):
        with open(setup_path, "w") as f:
            json.dump(resolved_setup(args), f)
    for seed in args.seeds:
        for sampling in [None, *args.samplings]:
            make_rollouts(args, seed, sampling)
    fit_options(args, argv)
    setup = json.load(open(setup_path))
    rows, columns = summary(args, setup.get("value_pretraining"))
    text = table(rows, columns)
    print(text)
    with open(os.path.join(args.out, "critic-fit.md"), "w") as f:
        f.write(text + "\n")
    probe = (f" The probe: {args.probe} more rollouts of the same policy that no option fits, scored by the critic "
             f"after each rollout's fit (their pooled explained variance after rollout k, and at its best). Each stop: "
             f"the rollout after which the recipe's ValuePretraining criterion ends on the option's held-out numbers "
             f"({json.dumps(setup.get('value_pretraining'))}), with its pooled window's explained variance there and "
             f"the probe's." if args.probe else "")
    if args.probe >= 2:
        probe += (" The split: the probe's first half (its first ceil(M/2) rollouts) read by the same criterion after "
                  "each fit, as ValuePretraining with a probe reads its probe, and the second half judging the critic "
                  "where that stops and where the criterion on the window stops (options fitted before the tool "
                  "recorded the halves have none).")
    if args.samplings:
        probe += (" Options with sampling=NAME fit rollouts sampled with NAME's settings on top of the others ("
                  + "; ".join(f"{name}: {' '.join(sets)}" for name, sets in args.samplings.items())
                  + "), as many, and are scored on the same probe; their between-prompts row is named after them.")
    if any(row["seed"] == "mean" for row in rows):  # summary added seed_means' rows
        probe += (" The rows of seed 'mean': each option's probe columns averaged over the seeds, and each later "
                  "option's difference from the first on the same seed's probe (and fitted rollouts, unless it has a "
                  "sampling of its own), averaged (its smallest and largest "
                  "over the seeds in the settings column).")
    tool_record(args, id="critic-fit", title="Critic options fitted on the same frozen-policy rollouts",
                section="Methods on the quickstart task", columns=columns, rows=rows,
                note=(f"{args.rollouts} rollouts of {args.recipe} ({' '.join(args.set) or 'as written'}) with the "
                      f"policy frozen, saved once per seed ({', '.join(map(str, args.seeds))}); each option a "
                      f"SeparateCritic (a copy of the policy, zero head) fitted on them in the same order, "
                      f"{setup['precision']}. EV: the explained variance of the "
                      f"critic's values on each rollout before it trains on it, pooled over the response tokens of "
                      f"the rollouts named (rollout 1 is scored by the untrained critic and left out). The last row of "
                      f"each seed: the share of the returns' variance between prompts, in sample." + probe))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
