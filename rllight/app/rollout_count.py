"""The rollouts (RL steps) and optimizer updates of a run, done and in all, as the progress lines and bars show them
(``rllight.app.progress``): ``trainer.max_steps`` counts optimizer updates, and a rollout makes ``ppo_epochs x
ceil(responses / minibatch_size)`` of them."""

from __future__ import annotations

import math

from rllight._compat import rl_steps_done, step_metrics


def planned_updates_per_rollout(module, datamodule) -> int:
    """Optimizer updates one rollout makes as the recipe plans them: ``ppo_epochs x ceil(data.batch_size x
    group_size / minibatch_size)`` (one per epoch without a minibatch size), as ``RLModule.rl_step`` counts them."""
    batching = getattr(module, "batching", None)
    epochs = max(int(getattr(batching, "ppo_epochs", 1) or 1), 1)
    minibatch = getattr(batching, "minibatch_size", None)
    batch = getattr(datamodule, "batch_size", None)
    if not minibatch or not batch:
        return epochs
    group = getattr(getattr(module, "sampler", None), "group_size", 1) or 1
    return epochs * max(math.ceil(batch * group / minibatch), 1)


class RolloutCount:
    """Rollouts (RL steps: one training batch each) and optimizer updates of a run that may be a resume: done, in
    all, and left (for the ETA).

    The totals are fixed when training starts (``start``: from the recipe's plan and what a resume restored) and do
    not move during the run: a line that says ``step 3/40 | updates 6/80`` is followed by ``step 4/40 | updates
    8/80``.

    - Updates in all: ``trainer.max_steps`` rounded up to whole rollouts of the planned updates
      (``planned_updates_per_rollout``), as a rollout's updates all run (``max_steps`` 1 at 4 a rollout: 4).
    - RL steps in all: the rollouts those updates take, and no more than ``max_epochs`` epochs of batches, where the
      sampler fixes each rollout's size (``Sampler.fixed_size``); plus the rollouts a callback takes for itself
      before RL (``RolloutCallback.rollouts_to_take``: value pretraining's ``max_steps``), which it may end sooner, so
      that the total is then a bound (``bound``; ``step 3/≤12``). Where the sampler may train on fewer responses than
      planned (dynamic sampling keeps only the groups with mixed rewards), the rollouts the updates take are known
      only as the run goes: no total of RL steps is shown (``step 4 | updates 3/8``) rather than one that moves.
    - A total the run goes past (a rollout empty after filtering, a prompt too long to ask) is not shown after.

    The rollouts left, for the ETA, are measured instead: the updates left over the updates per rollout, planned
    until this run has made some, then measured over the rollouts that trained and those that were empty after
    filtering (a run whose rollouts are often empty takes that many more of them), plus those a callback may still
    take; one that has made no update yet has no estimate. A rollout that a callback used instead (value
    pretraining) is not counted in the rate: it is not part of what the updates left will cost.
    """

    def __init__(self):
        self.updates = 0  # optimizer updates made by this run's counted rollouts
        self.rollouts = 0  # ... and how many rollouts those were (empty ones included)
        self._step_at_start = 0
        self._totals: tuple[int | None, int | None] | None = None  # (RL steps, updates) in all, fixed by start
        self.bound = False
        """Whether the RL steps in all are a bound (a callback may take fewer rollouts than it said)."""

    def start(self, trainer) -> None:
        """Training starts: fix the totals, from the recipe's plan and what a resume restored."""
        self.updates = self.rollouts = 0
        self._fix(trainer)

    def _fix(self, trainer) -> None:
        """The totals of ``RolloutCount``'s docstring, from where the run stands now."""
        done, step, taken = self.done(trainer), trainer.global_step, self._to_take(trainer)
        planned = planned_updates_per_rollout(trainer.lightning_module, trainer.datamodule)
        fixed = getattr(getattr(trainer.lightning_module, "sampler", None), "fixed_size", False)
        rollouts = None
        if trainer.max_steps is not None and trainer.max_steps > 0:
            rollouts = math.ceil(max(trainer.max_steps - step, 0) / planned)
        per_epoch = trainer.num_training_batches
        by_epochs = (int(trainer.max_epochs * per_epoch) if trainer.max_epochs is not None and trainer.max_epochs > 0
                     and math.isfinite(per_epoch) else None)
        if rollouts is None:  # max_epochs alone bounds the run: one rollout per batch
            steps = by_epochs
            updates = step + max(by_epochs - done - taken, 0) * planned if by_epochs is not None and fixed else None
        else:
            updates = step + rollouts * planned
            # Where a rollout may make fewer updates than planned (dynamic sampling), how many rollouts the updates
            # take depends on how many groups each keeps: no total of RL steps, rather than one that moves.
            steps = None
            if fixed:
                steps = done + taken + rollouts if by_epochs is None else min(done + taken + rollouts, by_epochs)
        self._totals = steps, updates
        self.bound = taken > 0 and steps is not None

    def batch_start(self, trainer) -> None:
        self._step_at_start = trainer.global_step

    def batch_end(self, trainer) -> None:
        made = trainer.global_step - self._step_at_start
        if made > 0 or step_metrics(trainer).get("train/guard/empty_rollouts", 0) > 0:
            self.updates += made
            self.rollouts += 1

    def done(self, trainer) -> int:
        return rl_steps_done(trainer)

    def per_rollout(self, trainer) -> float:
        """Optimizer updates per rollout: measured (0 while every counted rollout was empty), else planned."""
        if self.rollouts:
            return self.updates / self.rollouts
        return planned_updates_per_rollout(trainer.lightning_module, trainer.datamodule)

    def total(self, trainer) -> int | None:
        """The run's RL steps in all as fixed at the start (a bound where ``bound``), or None: unknown or passed."""
        if self._totals is None:  # a trainer that did not call start
            self._fix(trainer)
        steps = self._totals[0]
        return steps if steps is not None and self.done(trainer) <= steps else None

    def total_updates(self, trainer) -> int | None:
        """The optimizer updates the run will have made at its end, as fixed at the start, or None: unknown or
        passed."""
        if self._totals is None:  # a trainer that did not call start
            self._fix(trainer)
        updates = self._totals[1]
        return updates if updates is not None and trainer.global_step <= updates else None

    def left(self, trainer) -> int | None:
        """The rollouts left as measured so far (the ETA's), or None when nothing bounds them or no rollout has made
        an update yet."""
        estimates = []
        per_rollout = self.per_rollout(trainer)
        if trainer.max_steps is not None and trainer.max_steps > 0 and per_rollout > 0:
            left = max(trainer.max_steps - trainer.global_step, 0)
            estimates.append(self._to_take(trainer) + math.ceil(round(left / per_rollout, 6)))
        per_epoch = trainer.num_training_batches
        if trainer.max_epochs is not None and trainer.max_epochs > 0 and math.isfinite(per_epoch):
            estimates.append(max(int(trainer.max_epochs * per_epoch) - self.done(trainer), 0))
        return min(estimates) if estimates else None

    @staticmethod
    def _to_take(trainer) -> int:
        """The coming rollouts the run's callbacks will use themselves at most (value pretraining's)."""
        return sum(int(cb.rollouts_to_take()) for cb in getattr(trainer, "callbacks", None) or []
                   if callable(getattr(cb, "rollouts_to_take", None)))
