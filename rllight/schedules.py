"""Learning-rate schedules: linear warm-up, then constant, linear or cosine decay, per optimizer group.

The module's optimizer has one group for the policy (``name: policy``) and, with a critic, one for the
critic (``name: critic``), each with its own learning rate (``model.optimizer`` and ``critic.lr``). A
schedule gives each group its own warm-up and decay, as VAPO warms up its critic separately. Select it in a
recipe like any LightningCLI scheduler callable::

    model:
      lr_scheduler:
        class_path: rllight.schedules.WarmupSchedule
        init_args: {warmup_steps: 20, decay: cosine, critic_warmup_steps: 0}

The schedule advances once per policy update (``trainer.global_step``); critic-only updates, value
pretraining and self-imitation updates run at the rate of the current step. Its state is saved in
checkpoints, so an exact resume continues it.
"""

from __future__ import annotations

import math

import torch
from torch.optim.lr_scheduler import LRScheduler

from rllight.bounds import ClosedUnitInterval, NonNegativeInt, bounded
from rllight.errors import RecipeError

_DECAYS = ("constant", "linear", "cosine")


def warmup_factor(step: int, warmup_steps: int, decay: str, total_steps: int | None, min_lr_ratio: float) -> float:
    """The multiplier of the base learning rate before update ``step`` (0-based).

    Warm-up: ``(step + 1) / warmup_steps`` for the first ``warmup_steps`` updates (the first update already
    moves; update ``warmup_steps - 1`` runs at the full rate). Then ``constant`` stays at 1; ``linear`` and
    ``cosine`` go from 1 to ``min_lr_ratio`` over the updates up to ``total_steps``, and stay there.
    E.g. warmup 4, cosine, total 8, min 0: steps 0..3 -> 0.25, 0.5, 0.75, 1; step 6 -> progress (6-4)/4 = 0.5
    -> 0.5 * (1 + cos(pi/2)) = 0.5.
    """
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if decay == "constant":
        return 1.0
    span = max(total_steps - warmup_steps, 1)
    progress = min((step - warmup_steps) / span, 1.0)
    shape = 1.0 - progress if decay == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
    return min_lr_ratio + (1.0 - min_lr_ratio) * shape


def _check_decay(name: str, decay: str) -> None:
    if decay not in _DECAYS:
        raise RecipeError(f"model.lr_scheduler.{name}decay: '{decay}' is not one of {', '.join(_DECAYS)}")


class WarmupSchedule(LRScheduler):
    """Linear warm-up, then constant, linear or cosine decay, with the critic's group on its own schedule.

    Args:
        optimizer: The module's optimizer (passed by the module; not a recipe key).
        warmup_steps: Policy updates of linear warm-up for the policy's learning rate (0 = none).
        decay: After warm-up: ``constant``, ``linear`` or ``cosine`` (to ``min_lr_ratio`` at ``total_steps``).
        total_steps: Where the decay ends; None = ``trainer.max_steps`` (set by the module).
        min_lr_ratio: The decayed learning rate as a fraction of the base rate.
        critic_warmup_steps: Warm-up of the critic's group; None = the policy's ``warmup_steps``.
        critic_decay: Decay of the critic's group; None = the policy's ``decay``.
    """

    @bounded
    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        warmup_steps: NonNegativeInt = 0,
        decay: str = "constant",
        total_steps: int | None = None,
        min_lr_ratio: ClosedUnitInterval = 0.0,
        critic_warmup_steps: NonNegativeInt | None = None,
        critic_decay: str | None = None,
    ):
        self.warmup_steps = warmup_steps
        self.decay = decay
        self.total_steps = total_steps
        self.min_lr_ratio = min_lr_ratio
        self.critic_warmup_steps = warmup_steps if critic_warmup_steps is None else critic_warmup_steps
        self.critic_decay = decay if critic_decay is None else critic_decay
        _check_decay("", decay)
        _check_decay("critic_", self.critic_decay)
        super().__init__(optimizer)

    @property
    def needs_total_steps(self) -> bool:
        return self.decay != "constant" or self.critic_decay != "constant"

    def factors(self, step: int) -> list[float]:
        """The multiplier of each optimizer group's base rate before update ``step``."""
        if self.needs_total_steps and self.total_steps is None and step > 0:
            raise RecipeError("model.lr_scheduler.total_steps: a decaying schedule needs it, or trainer.max_steps")
        out = []
        for group in self.optimizer.param_groups:
            critic = str(group.get("name", "")).startswith("critic")
            warmup = self.critic_warmup_steps if critic else self.warmup_steps
            decay = self.critic_decay if critic else self.decay
            out.append(warmup_factor(step, warmup, decay, self.total_steps, self.min_lr_ratio))
        return out

    def get_lr(self) -> list[float]:
        step = max(self.last_epoch, 0)
        return [base * f for base, f in zip(self.base_lrs, self.factors(step))]


_SCHEDULE_SETTINGS = ("warmup_steps", "decay", "total_steps", "min_lr_ratio", "critic_warmup_steps", "critic_decay")


def recipe_rates(optimizer: torch.optim.Optimizer, scheduler=None) -> dict:
    """The learning rates and schedule settings the recipe gives, taken before a checkpoint is restored (a
    restore brings the checkpoint's own back with the optimizer's and the schedule's state)."""
    groups = [(str(g.get("name", i)), g.get("initial_lr", g["lr"])) for i, g in enumerate(optimizer.param_groups)]
    settings = {k: getattr(scheduler, k) for k in _SCHEDULE_SETTINGS if hasattr(scheduler, k)}
    return {"lrs": groups, "schedule": settings}


def apply_recipe_rates(optimizer: torch.optim.Optimizer, scheduler, recipe: dict) -> list[str]:
    """After a resume, put the recipe's learning rates and schedule settings (``recipe_rates``) in place of the
    checkpoint's, at the restored step; returns what changed, as ``name old -> new``, for the log."""
    changes = []
    old_lrs = list(scheduler.base_lrs) if scheduler is not None else [g["lr"] for g in optimizer.param_groups]
    new_lrs = [lr for _, lr in recipe["lrs"]]
    if len(new_lrs) != len(old_lrs):
        return changes  # another set of groups: the resume check refuses a changed model or critic before this
    changes += [f"lr/{name} {old:g} -> {new:g}" for (name, new), old in zip(recipe["lrs"], old_lrs) if old != new]
    for key, new in recipe["schedule"].items():
        if getattr(scheduler, key) != new:
            changes.append(f"lr_scheduler.{key} {getattr(scheduler, key)} -> {new}")
            setattr(scheduler, key, new)
    if scheduler is None:
        for group, lr in zip(optimizer.param_groups, new_lrs):
            group["lr"] = lr
    elif changes:
        scheduler.base_lrs = new_lrs
        for group, base, lr in zip(optimizer.param_groups, new_lrs, scheduler.get_lr()):
            group["initial_lr"], group["lr"] = base, lr
        scheduler._last_lr = [g["lr"] for g in optimizer.param_groups]
    return changes
