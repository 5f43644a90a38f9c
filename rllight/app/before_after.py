"""``evaluate_before_after``: the evaluation before training, kept in the run's checkpoints, and the table that sets
it beside the evaluation after training.

A resume (``--ckpt_path``) compares with the evaluation its checkpoint keeps instead of evaluating the untrained
model again (minutes: about 3 for the quickstart's 200 problems), where the checkpoint's evaluation measured what
this recipe would (``measured``: the model, the engine, the reward, ``model.evaluation`` and the held-out prompts);
``--evaluate_before_again true`` evaluates again all the same.
"""

from __future__ import annotations

import hashlib
import json
import os

import lightning as L

from rllight.app.progress import StepLog
from rllight.evaluation import before_after, column_notes
from rllight.safety import read_checkpoint

MEASURED_KEYS = ("model", "lora", "rollout", "reward", "environment", "max_prompt_tokens", "prompt_truncation",
                 "evaluation")
"""The recipe's ``model.*`` settings an evaluation of the untrained model depends on (with ``data.system_prompt`` and
the held-out rows): where a resume's differ from its checkpoint's, the evaluation before training is done again."""


def measured(recipe: dict, rows: list[dict]) -> str:
    """A digest of what an evaluation before training measures: the ``MEASURED_KEYS`` of the recipe's ``model``, its
    ``data.system_prompt``, and the held-out ``rows`` (prompt, answer, data source)."""
    model, data = recipe.get("model") or {}, recipe.get("data") or {}
    what = {"model": {key: model.get(key) for key in MEASURED_KEYS}, "system_prompt": data.get("system_prompt"),
            "rows": rows}
    return hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()


class BeforeTraining(L.Callback):
    """The evaluation before training of ``evaluate_before_after``: its metrics, its values prompt by prompt (for the
    paired standard errors) and the digest of what it measured (``measured``). Its ``state_dict`` puts them in every
    checkpoint, so that a resume compares with them (``evaluate_before``) and checkpoints it saves keep them too."""

    def __init__(self):
        self.metrics: dict[str, float] | None = None
        self.per_prompt: dict[str, dict[str, float]] = {}
        self.measured: str | None = None

    def state_dict(self) -> dict:
        if self.metrics is None:
            return {}
        return {"metrics": self.metrics, "per_prompt": self.per_prompt, "measured": self.measured}

    def load_state_dict(self, state_dict: dict) -> None:
        # The evaluation this run made (evaluate_before_again, or settings that changed) stays when Lightning restores
        # the checkpoint's, which the resume did not take.
        if self.metrics is None and state_dict.get("metrics") is not None:
            self.metrics = dict(state_dict["metrics"])
            self.per_prompt = dict(state_dict.get("per_prompt") or {})
            self.measured = state_dict.get("measured")

    def stored(self, ckpt_path: str) -> dict:
        """What the checkpoint at ``ckpt_path`` keeps of this callback ({} if nothing)."""
        return (read_checkpoint(ckpt_path).get("callbacks") or {}).get(self.state_key) or {}


def evaluate(trainer: L.Trainer, module: L.LightningModule, datamodule) -> dict[str, float]:
    """One evaluation (Lightning's validation loop) and its metrics."""
    results = trainer.validate(module, datamodule=datamodule, verbose=False)
    # The evaluation's own numbers: Lightning returns the logged copies, rounded to float32.
    return {**results[0], **module.evaluator.last_metrics} if results else {}


def evaluate_before(trainer: L.Trainer, module: L.LightningModule, datamodule, recipe: dict,
                    ckpt_path: str | None, again: bool = False) -> None:
    """The evaluation before training, kept in the trainer's ``BeforeTraining``: on a resume from ``ckpt_path`` the one
    its checkpoint keeps, where it measured what ``recipe`` would and ``again`` is false; else evaluated now."""
    kept = next(cb for cb in trainer.callbacks if isinstance(cb, BeforeTraining))
    digest = measured(recipe, getattr(datamodule, "val_rows", None) or [])
    if ckpt_path and os.path.exists(ckpt_path):
        stored = {} if again else kept.stored(ckpt_path)
        if stored.get("metrics") is not None and stored.get("measured") == digest:
            kept.load_state_dict(stored)
            accuracy = stored["metrics"].get("val/accuracy")
            _say(trainer, "evaluation before training: the checkpoint's"
                 + (f" (accuracy {accuracy:.3f})" if accuracy is not None else "")
                 + "; --evaluate_before_again true evaluates the untrained model again")
            return
        why = ("asked with --evaluate_before_again" if again
               else "the checkpoint keeps none" if stored.get("metrics") is None
               else "the checkpoint's was of another model, engine, reward, model.evaluation or held-out prompts")
        _say(trainer, f"evaluation before training: evaluating the untrained model again ({why})")
    step_logs = [cb for cb in trainer.callbacks if isinstance(cb, StepLog)]
    for step_log in step_logs:
        step_log.before_fit = True
    try:
        metrics = evaluate(trainer, module, datamodule)
    finally:
        for step_log in step_logs:
            step_log.before_fit = False
    kept.metrics, kept.per_prompt, kept.measured = metrics, dict(module.evaluator.last_per_prompt), digest


def compare_before_after(trainer: L.Trainer, module: L.LightningModule, datamodule, no_validation: str | None) -> None:
    """Evaluate after training and print the table of both evaluations (and save it as ``eval_summary.json`` in the
    log folder); ``no_validation``: why there is nothing to evaluate, or None."""
    after = evaluate(trainer, module, datamodule) if no_validation is None else {}
    kept = next((cb for cb in trainer.callbacks if isinstance(cb, BeforeTraining)), None)
    before = (kept.metrics if kept is not None else None) or {}
    acc_before, acc_after = before.get("val/accuracy"), after.get("val/accuracy")
    if acc_before is None or acc_after is None:
        if trainer.is_global_zero:
            why = no_validation or "no val/accuracy was logged"
            print(f"rllight: evaluate_before_after: no validation ran ({why}), so there is nothing to compare; set "
                  "trainer.limit_val_batches above 0 and data.val_size above 0", flush=True)
        return
    n = len(datamodule.val_rows)
    summary = {"accuracy_before": acc_before, "accuracy_after": acc_after, "num_val": n}
    table, lines = before_after(before, after, kept.per_prompt, module.evaluator.last_per_prompt)
    if n:
        # val/accuracy is the greedy accuracy where there is one, else avg@n: its row's standard error of the
        # difference (paired where the per-prompt values are known); else the binomial one of two independent
        # accuracies on the same n problems (an upper bound).
        label = "greedy accuracy" if "val/greedy/avg@1" in after else f"avg@{module.evaluation.n}"
        se = table.get(label, {}).get("difference_se")
        if se is None:
            se = ((acc_before * (1 - acc_before) + acc_after * (1 - acc_after)) / n) ** 0.5
        summary["difference"] = acc_after - acc_before
        summary["stderr_of_difference"] = se
    log_dir = trainer.log_dir or "."  # on every rank: under DDP the log folder is a collective (rank 0's, broadcast)
    if not trainer.is_global_zero:
        return
    os.makedirs(log_dir, exist_ok=True)
    with open(os.path.join(log_dir, "eval_summary.json"), "w") as f:
        json.dump({**summary, "metrics": table}, f, indent=2)
    paired = all(row.get("paired", True) for row in table.values())
    kind = "paired over the same prompts" if paired else "as if the two evaluations were independent, an upper bound"
    print(f"rllight: before and after training, {n} held-out prompts (± standard error; the difference's {kind}):",
          flush=True)
    for line in lines + column_notes(list(table), module.evaluation):
        print("  " + line, flush=True)
    print("rllight: " + " ".join(f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}" for k, v in summary.items()),
          flush=True)


def _say(trainer: L.Trainer, text: str) -> None:
    if trainer.is_global_zero:
        print(f"rllight: {text}", flush=True)
