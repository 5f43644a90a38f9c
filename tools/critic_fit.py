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
   ``head_lr``, ``clip`` (0 = none), ``epochs``, ``minibatch``, ``replay``, ``loss_coef``. Options run two at a time
   (``--jobs``), each in a child with one thread, under the recipe's precision. A finished option (its
   ``<out>/<NAME>.json``) is skipped.

Reported per option: the explained variance of the held-out values, pooled over the response tokens of rollouts 2 to
N (the first is scored by the untrained critic) and over each window of ``--window`` rollouts, and the held-out value
loss likewise. Beside them, per window, the share of the returns' variance that lies between prompts (the variance of
each prompt's mean return over the variance of the returns, in sample): what a critic that knew each prompt's success
rate but nothing of the response could explain.

Run (SmolLM2-135M-Instruct, VAPO's recipe at the quickstart's 4 prompts x 8 responses; about an hour on 2 cores):

    .venv/bin/python tools/critic_fit.py --recipe recipes/vapo.yaml --set data.batch_size=4 --rollouts 30 \\
        --option recipe lr=1e-4 clip=0.2 epochs=4 --option slow-backbone lr=1e-5 head_lr=1e-4 clip=0 epochs=4 \\
        --option slow-backbone-replay lr=1e-5 head_lr=1e-4 clip=0 epochs=1 replay=4
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

from rllight.app.records import add_record_options, check_record_options, printed, tool_record  # noqa: E402
from rllight.callbacks.base import RolloutCallback  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KEYS = {"lr": float, "head_lr": float, "clip": float, "epochs": int, "minibatch": int, "replay": int,
        "loss_coef": float}
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
    p.add_argument("--option", action="append", nargs="+", default=[], metavar="NAME [KEY=VALUE ...]",
                   help=f"A critic option: a name and settings among {', '.join(KEYS)} (repeatable).")
    p.add_argument("--window", type=int, default=10, help="Rollouts per window of the pooled numbers.")
    p.add_argument("--jobs", type=int, default=2, help="Options fitted at once, one thread each.")
    p.add_argument("--seed", type=int, default=0, help="The recipe's seed for the rollouts; the fits' seed.")
    p.add_argument("--out", default="runs/critic-fit", help="Folder for the rollouts and each option's results.")
    p.add_argument("--fit-one", help=argparse.SUPPRESS)  # a child's option name
    add_record_options(p, id="critic-fit", section="Methods on the quickstart task")
    args = p.parse_args(argv)
    if not args.option:
        p.error("name at least one --option")
    args.options = {}
    for name, *pairs in args.option:
        settings = dict(DEFAULTS)
        for pair in pairs:
            key, sep, value = pair.partition("=")
            if not sep or key not in KEYS:
                p.error(f"--option {name}: {pair!r} is not KEY=VALUE with KEY one of {', '.join(KEYS)}")
            settings[key] = KEYS[key](value)
        args.options[name] = settings
    check_record_options(p, args, argv, __file__)
    return args


# ------------------------------------------------------------------------------------------------- rollouts
def rollout_path(out: str, k: int) -> str:
    return os.path.join(out, "rollouts", f"r{k:03d}.pt")


def make_rollouts(args: argparse.Namespace) -> None:
    """Sample the rollouts not yet saved, each run of ``rllight fit`` from the first missing one on."""
    os.makedirs(os.path.join(args.out, "rollouts"), exist_ok=True)
    missing = [k for k in range(args.rollouts) if not os.path.exists(rollout_path(args.out, k))]
    if not missing:
        return
    start = missing[0]
    overlay = os.path.join(args.out, "save-rollouts.yaml")
    with open(overlay, "w") as f:
        json.dump({"seed_everything": args.seed + start, "evaluate_before_after": False,
                   "trainer": {"callbacks": [{"class_path": "critic_fit.SaveRollouts", "init_args": {
                       "folder": os.path.join(os.path.abspath(args.out), "rollouts"), "start": start,
                       "count": args.rollouts - start}}],
                       "default_root_dir": os.path.join(args.out, "sampling"), "enable_checkpointing": False,
                       "val_check_interval": 10**9, "check_val_every_n_epoch": None, "max_steps": 10**6,
                       "limit_val_batches": 0},
                   "model": {"guards": {"max_steps_without_update": None}}}, f)
    cmd = [sys.executable, "-m", "rllight", "fit", "--config", args.recipe, *sum((["--config", c] for c in
                                                                                  args.config), []),
           "--config", overlay, *sum((["--" + s.split("=", 1)[0], s.split("=", 1)[1]] for s in args.set), [])]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(os.path.abspath(__file__)),
                                                        os.environ.get("PYTHONPATH", "")])}
    print(f"critic_fit: sampling rollouts {start}..{args.rollouts - 1}", flush=True)
    with open(os.path.join(args.out, "sampling.log"), "w") as log:
        code = subprocess.call(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    made = sum(os.path.exists(rollout_path(args.out, k)) for k in range(args.rollouts))
    if made < args.rollouts:
        raise SystemExit(f"critic_fit: sampling ended (exit {code}) with {made} of {args.rollouts} rollouts; see "
                         f"{os.path.join(args.out, 'sampling.log')}")


def resolved_setup(args: argparse.Namespace) -> dict:
    """The recipe's policy source (``model.model``) and precision, as the rollouts' run resolved them."""
    import yaml

    from rllight.precision import resolve_precision

    cmd = [sys.executable, "-m", "rllight", "fit", "--config", args.recipe,
           *sum((["--config", c] for c in args.config), []),
           *sum((["--" + s.split("=", 1)[0], s.split("=", 1)[1]] for s in args.set), []), "--print_config"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"critic_fit: cannot resolve {args.recipe}: {(proc.stderr.strip().splitlines() or ['?'])[-1]}")
    config = yaml.safe_load(proc.stdout)
    precision = str(config["trainer"].get("precision") or "32-true")
    if precision == "auto":
        precision = resolve_precision(config["trainer"].get("accelerator"))[0]
    return {"model": config["model"]["model"], "precision": precision}


# ----------------------------------------------------------------------------------------------------- fits
def build(spec: dict):
    """An object from a recipe's ``{class_path, init_args}``."""
    import importlib

    module, _, name = spec["class_path"].rpartition(".")
    return getattr(importlib.import_module(module), name)(**(spec.get("init_args") or {}))


def pooled(parts: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[float, float]:
    """Explained variance and value loss of ``(values, returns)`` pairs pooled, in float64, as value pretraining's
    criterion reads them (``held_out_numbers``); NaN for none or returns that do not vary."""
    from callbacks.value_pretraining import held_out_numbers

    if not parts:
        return float("nan"), float("nan")
    loss, ev = held_out_numbers([(v.double(), r.double()) for v, r in parts])
    return ev, loss


def between_prompts(rollout) -> tuple[torch.Tensor, torch.Tensor]:
    """Each response token's return and its prompt's mean return, in sample (what the prompt alone predicts)."""
    from rllight.algorithms import gae

    returns = gae(rollout.outcome_token_rewards(), torch.zeros(rollout.response_mask.shape),
                  rollout.response_mask, 1.0, 1.0)[1]
    means = torch.zeros_like(rollout.rewards)
    for group in rollout.group_ids.unique():
        rows = rollout.group_ids == group
        means[rows] = rollout.rewards[rows].float().mean()
    mask = rollout.response_mask.bool()
    return (means[:, None].expand_as(returns))[mask].float(), returns[mask].float()


def fit_one(args: argparse.Namespace, name: str) -> dict:
    """Fit option ``name`` on the saved rollouts; its held-out values and returns per rollout."""
    from rllight.algorithms import gae, masked_mean
    from rllight.critics import SeparateCritic

    setup = json.load(open(os.path.join(args.out, "setup.json")))
    settings = args.options[name]
    torch.manual_seed(args.seed)
    order = random.Random(args.seed)
    source = build(setup["model"])
    critic = SeparateCritic(loss_coef=settings["loss_coef"], clip=settings["clip"] or None, lr=settings["lr"],
                            head_lr=settings["head_lr"])
    policy, tokenizer = source.load()
    critic.setup(policy, tokenizer, source)
    del policy
    optimizer = torch.optim.AdamW(critic.param_groups(), lr=settings["lr"], weight_decay=0.0)
    params = [p for p in critic.parameters() if p.requires_grad]
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=setup["precision"].startswith("bf16"))

    def score(rollout) -> None:
        with torch.no_grad(), autocast:
            rollout.values = critic.values(rollout, None).float() * rollout.response_mask

    held_out, earlier, start = [], [], time.time()
    for k in range(args.rollouts):
        rollout = torch.load(rollout_path(args.out, k), weights_only=False)
        score(rollout)
        # lambda 1, gamma 1: the Monte-Carlo returns, whatever the values (zeros here, so no rounding of R - V + V)
        rollout.returns = gae(rollout.outcome_token_rewards(), torch.zeros(rollout.response_mask.shape),
                              rollout.response_mask, 1.0, 1.0)[1]
        mask = rollout.response_mask.bool()
        held_out.append((rollout.values[mask].tolist(), rollout.returns[mask].tolist()))
        for part in earlier:
            score(part)
        batches = [rollout, *earlier]
        earlier = ([rollout, *earlier])[: settings["replay"]]
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
        print(f"critic_fit: {name}: rollout {k + 1}/{args.rollouts} "
              f"explained variance {pooled([tuple(map(torch.tensor, held_out[-1]))])[0]:.3f}", flush=True)
    result = {"option": name, "settings": settings, "held_out": held_out, "seconds": round(time.time() - start)}
    path = os.path.join(args.out, f"{name}.json")
    with open(path + ".part", "w") as f:
        json.dump(result, f)
    os.replace(path + ".part", path)
    return result


def fit_options(args: argparse.Namespace, argv: list[str]) -> None:
    """Fit every option without results yet, ``--jobs`` at a time, each in a child with one thread."""
    todo = [name for name in args.options if not os.path.exists(os.path.join(args.out, f"{name}.json"))]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    running: list[tuple[str, subprocess.Popen]] = []
    failed = []
    while todo or running:
        while todo and len(running) < max(args.jobs, 1):
            name = todo.pop(0)
            log = open(os.path.join(args.out, f"{name}.log"), "w")
            running.append((name, subprocess.Popen([sys.executable, os.path.abspath(__file__), *argv, "--fit-one",
                                                    name], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)))
        time.sleep(1)
        for name, proc in list(running):
            if proc.poll() is not None:
                running.remove((name, proc))
                if proc.returncode != 0:
                    failed.append(f"{name} (exit {proc.returncode}; see {os.path.join(args.out, name + '.log')})")
    if failed:
        raise SystemExit(f"critic_fit: failed: {', '.join(failed)}")


def summary(args: argparse.Namespace) -> tuple[list[dict], list[list]]:
    """One row per option (pooled explained variance and loss, overall and per window) and the columns."""
    windows = [(lo, min(lo + args.window, args.rollouts)) for lo in range(0, args.rollouts, args.window)]
    bound = [pooled([between_prompts(torch.load(rollout_path(args.out, k), weights_only=False))
                     for k in range(lo, hi)])[0] for lo, hi in windows]
    columns = [["option", "option"], ["settings", "settings"], ["ev", "EV, rollouts 2+", ".3f"],
               ["loss", "loss, rollouts 2+", ".4f"]]
    columns += [[f"ev_{lo + 1}_{hi}", f"EV {lo + 1}-{hi}", ".3f"] for lo, hi in windows]
    rows = []
    for name in args.options:
        result = json.load(open(os.path.join(args.out, f"{name}.json")))
        parts = [(torch.tensor(v), torch.tensor(r)) for v, r in result["held_out"]]
        ev, loss = pooled(parts[1:])
        row = {"option": name, "settings": " ".join(f"{k}={v}" for k, v in result["settings"].items()),
               "ev": printed(ev, ".3f"), "loss": printed(loss, ".4f")}
        for lo, hi in windows:
            row[f"ev_{lo + 1}_{hi}"] = printed(pooled(parts[max(lo, 1):hi])[0], ".3f")
        rows.append(row)
    rows.append({"option": "(between prompts, in sample)", "settings": "each prompt's mean return",
                 "ev": None, "loss": None,
                 **{f"ev_{lo + 1}_{hi}": printed(b, ".3f") for (lo, hi), b in zip(windows, bound)}})
    return rows, columns


def table(rows: list[dict], columns: list[list]) -> str:
    def cell(row, column):
        value = row.get(column[0])
        return "-" if value is None else format(value, column[2]) if len(column) > 2 else str(value)

    lines = ["| " + " | ".join(c[1] for c in columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(r, c) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    if args.fit_one:
        fit_one(args, args.fit_one)
        return 0
    os.makedirs(args.out, exist_ok=True)
    setup_path = os.path.join(args.out, "setup.json")
    if not os.path.exists(setup_path):
        with open(setup_path, "w") as f:
            json.dump(resolved_setup(args), f)
    make_rollouts(args)
    fit_options(args, argv)
    rows, columns = summary(args)
    text = table(rows, columns)
    print(text)
    with open(os.path.join(args.out, "critic-fit.md"), "w") as f:
        f.write(text + "\n")
    setup = json.load(open(setup_path))
    tool_record(args, id="critic-fit", title="Critic options fitted on the same frozen-policy rollouts",
                section="Methods on the quickstart task", columns=columns, rows=rows,
                note=(f"{args.rollouts} rollouts of {args.recipe} ({' '.join(args.set) or 'as written'}) with the "
                      f"policy frozen, saved once; each option a SeparateCritic (a copy of the policy, zero head) "
                      f"fitted on them in the same order, {setup['precision']}. EV: the explained variance of the "
                      f"critic's values on each rollout before it trains on it, pooled over the response tokens of "
                      f"the rollouts named (rollout 1 is scored by the untrained critic and left out). The last row: "
                      f"the share of the returns' variance between prompts, in sample."))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
