"""Stale-data stress test: GRPO's clipped surrogate against VESPO's kernel with N sequential minibatch
updates per rollout.

VESPO (arXiv:2602.10693) claims stable training as the staleness N = global batch / mini batch grows
(N = 4 .. 64 in the paper). Each run here trains a tiny in-process model (or ``--model``, a Hugging Face
folder) on the embedded arithmetic prompts with a reward it can improve from scratch: the fraction of
digit characters in the response. Every run starts from the same weights and sees the same first prompts;
only the policy loss and N differ. With R responses per rollout, N = R / model.batching.minibatch_size (one epoch).

For each (algorithm, N) it prints whether the run stayed finite (no non-finite metric or parameter, no
skipped update), the reward curve (mean reward per rollout), and the last rollout's approximate KL to the
sampling policy (mean over its N updates) and, for VESPO, the mean kernel weight phi and the largest
|log W| against the trainer's old log-probs (VESPO's default weight: 0 on each rollout's first update).

``--record PATH`` also writes the table as a record for docs/results/ (``rllight.app.records``; id ``staleness``): one
row per run, its values as printed, and the number of runs that stayed finite in the summary.

Usage: python tools/staleness.py [--steps 15] [--ns 1,8,32] [--algos grpo,vespo] [--lr 0.003]
       [--model PATH] [--seed 0] [--record PATH] [--shared yes|no]
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import tempfile
import time
import warnings

import lightning as L
import torch

from rllight.data import RLDataModule
from rllight.machine import machine_line
from rllight.data.arithmetic import ArithmeticTask
from rllight.models import HFModel
from rllight.module import RLModule
from rllight.app.records import add_record_options, check_record_options, printed, tool_record
from rllight.rewards import Verifier
from rllight.rollout import HFEngine
from rllight.settings import Batching
from rllight.strategies import VESPO, ClippedSurrogate, GroupRelative, GroupSampler, TokenMean
from rllight.testing import build_tiny_model

PROMPTS_PER_STEP = 8
GROUP_SIZE = 4  # R = 32 responses per rollout, so N = 32 is one response per update


class DigitFraction(Verifier):
    """Fraction of the response's characters that are digits: a random model scores near 0 and can
    climb to 1, with no need to solve the arithmetic."""

    def __call__(self, response: str, answer: str) -> float:
        return sum(c.isdigit() for c in response) / max(len(response), 1)

    def is_correct(self, response: str, answer: str) -> bool:
        return self(response, answer) >= 0.5


class _Curve(L.Callback):
    """Collects the metrics of every RL step (one training batch)."""

    def __init__(self):
        self.steps: list[dict[str, float]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.steps.append({k: float(v) for k, v in trainer.callback_metrics.items()})


def policy_loss(algo: str):
    if algo == "grpo":
        return ClippedSurrogate(clip_low=0.2, clip_high=0.2)
    if algo == "vespo":
        return VESPO()
    raise SystemExit(f"staleness: unknown algorithm '{algo}'; choose grpo or vespo")


def run(model_dir: str, algo: str, n: int, steps: int, lr: float, seed: int) -> dict:
    responses = PROMPTS_PER_STEP * GROUP_SIZE
    if responses % n:
        raise SystemExit(f"staleness: N = {n} must divide the {responses} responses of a rollout")
    L.seed_everything(seed, verbose=False)
    module = RLModule(
        model=HFModel(model_dir),
        rollout=HFEngine(max_new_tokens=8, temperature=1.0),
        sampler=GroupSampler(group_size=GROUP_SIZE),
        reward=DigitFraction(),
        reward_runner=None,  # the reward is defined in this script: scored in-process
        reward_preflight=0,  # it scores digits, not answers
        advantage=GroupRelative(),
        policy_loss=policy_loss(algo),
        aggregation=TokenMean(),
        batching=Batching(ppo_epochs=1, minibatch_size=responses // n, micro_batch_size=responses),
        optimizer=lambda params: torch.optim.AdamW(params, lr=lr, weight_decay=0.0),
    )
    data = RLDataModule(task=ArithmeticTask(num_train=PROMPTS_PER_STEP * steps, num_val=4, seed=seed),
                        batch_size=PROMPTS_PER_STEP, seed=seed)
    curve = _Curve()
    trainer = L.Trainer(max_steps=steps * n, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                        num_sanity_val_steps=0, callbacks=[curve], default_root_dir=tempfile.gettempdir())
    start = time.perf_counter()
    error = None
    try:
        trainer.fit(module, datamodule=data)
    except FloatingPointError as err:  # the module's guard: several non-finite updates in a row
        error = str(err)
    seconds = time.perf_counter() - start
    finite_metrics = all(math.isfinite(v) for s in curve.steps for k, v in s.items() if k.startswith("train/"))
    finite_params = all(torch.isfinite(p).all() for p in module.policy.parameters())
    skipped = sum(s.get("train/guard/skipped_updates", 0.0) > 0 for s in curve.steps)
    return {
        "algo": algo, "n": n, "seconds": seconds, "error": error,
        "finite": error is None and finite_metrics and finite_params and skipped == 0,
        "skipped_steps": skipped,
        "rewards": [s.get("train/reward/mean", float("nan")) for s in curve.steps],
        "last": curve.steps[-1] if curve.steps else {},
    }


COLUMNS = [["algo", "loss"], ["n", "N (updates per rollout)"], ["finite", "finite"], ["skipped_steps", "skipped steps"],
           ["reward_first3", "reward, first 3 rollouts", ".3f"], ["reward_last3", "reward, last 3", ".3f"],
           ["approx_kl", "approx KL, last rollout", ".4f"], ["phi_mean", "VESPO phi mean", ".3f"],
           ["log_weight_absmax", "VESPO max abs log W", ".2f"], ["time_s", "time (s)", ".0f"]]


def row(r: dict) -> dict:
    """One run's line of the table as printed (and as its record's row holds it): the values and their texts."""
    rewards, last = r["rewards"], r["last"]
    head, tail = rewards[:3], rewards[-3:]
    nan = float("nan")
    out = {"algo": r["algo"], "n": r["n"], "finite": "yes" if r["finite"] else "NO",
           "skipped_steps": r["skipped_steps"],
           "reward_first3": printed(sum(head) / max(len(head), 1), ".3f"),
           "reward_last3": printed(sum(tail) / max(len(tail), 1), ".3f"),
           "approx_kl": printed(last.get("train/policy/approx_kl", nan), ".4f"),
           "phi_mean": None, "log_weight_absmax": None, "time_s": printed(r["seconds"], ".0f")}
    if r["algo"] == "vespo":  # means over the last rollout's N updates
        out["phi_mean"] = printed(last.get("train/policy/vespo_phi_mean", nan), ".3f")
        out["log_weight_absmax"] = printed(last.get("train/policy/vespo_log_weight_absmax", nan), ".2f")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=15, help="Rollouts per run.")
    parser.add_argument("--ns", default="1,8,32", help="Staleness values N (updates per rollout).")
    parser.add_argument("--algos", default="grpo,vespo")
    parser.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate (tiny models need a high one).")
    parser.add_argument("--model", default=None, help="A Hugging Face model folder (default: a tiny in-process model).")
    parser.add_argument("--seed", type=int, default=0)
    add_record_options(parser, id="staleness", section="Asynchronous and stale rollouts")
    args = parser.parse_args()
    check_record_options(parser, args, None, __file__)

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    logging.getLogger("lightning").setLevel(logging.ERROR)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    model_dir = args.model or build_tiny_model(os.path.join(tempfile.mkdtemp(prefix="rllight-staleness-"), "model"),
                                               hidden_size=64, num_layers=2, seed=args.seed)
    ns = [int(x) for x in args.ns.split(",")]
    algos = args.algos.split(",")
    print(f"model={'tiny (hidden 64, 2 layers)' if args.model is None else args.model} rollouts={args.steps} "
          f"responses/rollout={PROMPTS_PER_STEP * GROUP_SIZE} lr={args.lr} reward=digit fraction", flush=True)
    results = []
    for algo in algos:
        for n in ns:
            r = run(model_dir, algo, n, args.steps, args.lr, args.seed)
            results.append(r)
            rewards = r["rewards"]
            head, tail = rewards[:3], rewards[-3:]
            last = r["last"]
            extra = f" approx_kl={last.get('train/policy/approx_kl', float('nan')):.4f}"
            if algo == "vespo":  # means over the last rollout's N updates
                extra += (f" phi_mean={last.get('train/policy/vespo_phi_mean', float('nan')):.3f}"
                          f" max|logW|={last.get('train/policy/vespo_log_weight_absmax', float('nan')):.2f}")
            print(f"{algo:5s} N={n:<3d} finite={'yes' if r['finite'] else 'NO '} skipped_steps={r['skipped_steps']}"
                  f" reward first3={sum(head) / max(len(head), 1):.3f} last3={sum(tail) / max(len(tail), 1):.3f}"
                  f"{extra} time={r['seconds']:.0f}s", flush=True)
            print("      curve: " + " ".join(f"{x:.2f}" for x in rewards), flush=True)
            if r["error"]:
                print(f"      stopped: {r['error']}", flush=True)
    finite = sum(r["finite"] for r in results)
    tool_record(
        args, id="staleness", section="Asynchronous and stale rollouts",
        title=f"Stale-data stress test: {', '.join(algos)} with N = {', '.join(map(str, ns))} minibatch updates per "
              f"rollout, {args.steps} rollouts, {'a tiny model' if args.model is None else args.model}",
        note=f"Each run trains from the same weights on the embedded arithmetic prompts with the digit-fraction "
             f"reward, {PROMPTS_PER_STEP * GROUP_SIZE} responses per rollout at lr {args.lr}, seed {args.seed}; "
             "finite: no non-finite metric or parameter and no skipped update. The reward columns are the mean over "
             "the first and the last three rollouts; KL, phi and log W are the last rollout's means over its N "
             "updates.",
        columns=COLUMNS, rows=[row(r) for r in results], summary={"finite_runs": finite, "runs": len(results)},
        headline="{finite_runs}/{runs} runs finite")
    print("all finite" if all(r["finite"] for r in results) else
          "NOT finite: " + ", ".join(f"{r['algo']} N={r['n']}" for r in results if not r["finite"]))
    print(machine_line())
    print(f"finite_runs={sum(r['finite'] for r in results)}/{len(results)}")


if __name__ == "__main__":
    main()
