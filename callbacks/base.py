"""The typed extension point for rollout callbacks, and the context they are given."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import lightning as L
import torch

from rllight.distributed import Ranks
from rllight.types import Rollout

if TYPE_CHECKING:
    from rllight.critics import Critic
    from rllight.scoring import Scoring
    from rllight.update import Updater


@dataclass
class RolloutContext:
    """What a rollout callback may use of the run: the module builds one per RL step and passes it to
    ``on_rollout`` in the module's place. A callback that acts later in the step (``SelfImitation`` replays in
    ``on_train_batch_end``) keeps the context its ``on_rollout`` was given. A test gives a callback one of these
    with only the fields it uses."""

    updater: Updater | None = None
    """Optimizer updates outside the step's own (``rllight.update.Updater``): ``critic_update`` fits the critic,
    ``nll_update`` imitates responses. A policy they move reaches the rollout engine by itself."""
    scoring: Scoring | None = None
    """Forward passes without gradients (``rllight.scoring.Scoring``): ``score(rollout, need_old=..., need_values=...,
    need_ref=...)`` fills the rollout's log-probs and values."""
    ranks: Ranks = field(default_factory=Ranks)
    """Collectives over the run's processes (``rllight.distributed.Ranks``: ``world_size``, ``any``, ``sum``,
    ``reduce``; default: one process); every rank must call them alike."""
    tokenizer: Any = None
    """The policy's tokenizer (``pad_token_id``, ``decode``)."""
    device: torch.device | str = "cpu"
    """Where the policy's tensors are."""
    critic: Critic | None = None
    """The value model (``model.critic``), or None when the recipe has none."""
    log: Callable[[dict[str, float]], None] = lambda metrics: None
    """Log scalars at this RL step under the keys given (e.g. ``train/sil/nll``)."""
    max_new_tokens: int | None = None
    """The rollout engine's limit on response tokens (None when the engine has none)."""
    gamma: float = 1.0
    """The advantage estimator's discount (``AdvantageEstimator.gamma``: 1.0 when it declares none)."""


class RolloutCallback(L.Callback):
    """Base class of callbacks that see (and may change) each scored rollout before the update.

    The module calls them in order of ``rollout_order`` (then in the recipe's order), not in the order the
    recipe lists them, so that listing them differently cannot change a method: reward shaping first
    (``SoftOverlongPunishment``: 10), then loss masks (``OverlongFilter``: 20; it zeroes the masks the
    punishment reads lengths from), then callbacks that train on the rollout (``ValuePretraining``: 30,
    which consumes it while it pretrains), then those that store it (``SelfImitation``: 40). A callback of
    your own runs after these unless it sets a smaller ``rollout_order``.
    """

    rollout_order: int = 100

    def check_before_fit(self, module: L.LightningModule) -> None:
        """Checks that need no model: ``rllight fit`` calls this before any model loads (before the evaluation that
        opens a run), so that a wrong setting costs a line, not minutes. Raise ``RecipeError`` with one line."""

    def rollouts_to_take(self) -> int:
        """The coming rollouts this callback will use itself at most (``on_rollout`` returning None: no policy update),
        counted in the total of RL steps the progress lines show (``rllight.app.rollout_count.RolloutCount``), which is
        then a bound: ``ValuePretraining``'s ``max_steps`` left, which it may end sooner. 0 by default."""
        return 0

    def step_sampler(self, sampler):
        """The sampler that makes the coming step's rollout: ``sampler`` (the recipe's ``model.sampler``, or what a
        callback before this one made of it) by default. ``ValuePretraining`` with ``group_size`` spreads its rollouts
        over more prompts while it pretrains."""
        return sampler

    def on_rollout(self, trainer: L.Trainer, context: RolloutContext, rollout: Rollout) -> Rollout | None:
        """Return the rollout to train on (the same object, changed, or a new one), or None when the
        callback has used it itself and this step makes no policy update (e.g. value pretraining).

        ``context`` is what a callback may use of the run (``RolloutContext``). Scalars put in ``rollout.extras``
        are logged as ``train/<key>``. Rows can be dropped with ``rollout.select(index)``, and tokens kept out of
        the loss by zeroing ``response_mask``.
        """
        return rollout


def in_rollout_order(callbacks: list) -> list[RolloutCallback]:
    """The rollout callbacks among ``callbacks`` (those with ``on_rollout``) in ``rollout_order``; equal orders
    keep the recipe's order."""
    rollout_callbacks = [cb for cb in callbacks if hasattr(cb, "on_rollout")]
    return sorted(rollout_callbacks, key=lambda cb: getattr(cb, "rollout_order", 100))


def sampler_of_step(trainer: L.Trainer | None, sampler):
    """The sampler of the coming step's rollout: ``sampler`` (``model.sampler``) as the trainer's rollout callbacks
    hand it on, in ``rollout_order`` (``RolloutCallback.step_sampler``)."""
    for cb in in_rollout_order(trainer.callbacks if trainer is not None else []):
        sampler = cb.step_sampler(sampler) if hasattr(cb, "step_sampler") else sampler
    return sampler


def state_of_every_rank(ranks: Ranks | None, state: dict) -> dict:
    """A callback's ``state_dict`` under several processes: every rank's ``state``, in rank order (a collective;
    Lightning builds a checkpoint's callback states on every rank and writes rank 0's, so a rank-local state would
    otherwise be rank 0's on every rank after a resume). On one process (or with no ``ranks``) ``state`` itself."""
    if ranks is None or ranks.world_size <= 1:
        return state
    return {"ranks": ranks.gather_objects(state)}


def saved_ranks(state: dict) -> list[dict]:
    """The states of each rank that ``state_of_every_rank`` saved, in rank order (one for a one-process state)."""
    return list(state["ranks"]) if "ranks" in state else [state]
