"""VAPO's value pretraining (Yue et al., arXiv:2504.05118, section 4.1; VC-PPO, arXiv:2503.01491) as a
rollout callback."""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING, Any

import lightning as L

from rllight.algorithms import gae
from rllight.callbacks.base import RolloutCallback
from rllight.errors import RecipeError
from rllight.types import Rollout

if TYPE_CHECKING:
    from rllight.module import RLModule

log = logging.getLogger(__name__)


class ValuePretraining(RolloutCallback):
    """Fit the value model on Monte-Carlo returns of the frozen policy's samples before RL starts.

    While pretraining, every rollout is consumed here (``on_rollout`` returns None, so the step makes no
    policy update and ``trainer.global_step`` does not advance): the critic scores it, the targets are
    the Monte-Carlo returns (GAE with lambda = 1, ``gamma`` of the module's advantage estimator, outcome
    reward on the last token; a KL penalty is not part of them), and ``module.critic_update`` fits the
    critic for ``epochs`` passes. With a value head on the shared backbone and ``train_backbone``
    False only the head trains, as note 000 describes; a separate critic trains whole.

    Pretraining ends after ``max_steps`` rollouts, or earlier when the value loss measured on each
    fresh rollout (before it is trained on) has not improved by ``min_delta`` for ``patience`` rollouts
    in a row. Then every later rollout passes through untouched. Steps done, the finished flag and the
    best loss are in ``state_dict`` so a resumed run neither repeats nor skips the phase.

    Put it first in ``trainer.callbacks`` (before callbacks that train, such as ``SelfImitation``).

    Metrics: ``train/value_pretraining/{loss,explained_variance,steps_done,finished}``.

    Args:
        max_steps: Rollouts to pretrain on at most (0 = no pretraining).
        patience: Stop after this many rollouts without improvement (None = run all ``max_steps``).
        min_delta: Improvement of the loss that resets the patience counter.
        epochs: Passes of critic updates over each rollout.
        minibatch_size: Responses per critic update (None = ``model.minibatch_size``, or the whole rollout).
        train_backbone: Also train the shared backbone (False = head only, as note 000).
    """

    def __init__(self, max_steps: int = 50, patience: int | None = 5, min_delta: float = 1e-4, epochs: int = 1,
                 minibatch_size: int | None = None, train_backbone: bool = False):
        if max_steps < 0:
            raise RecipeError(f"trainer.callbacks: ValuePretraining.max_steps must be >= 0, got {max_steps}")
        if patience is not None and patience < 1:
            raise RecipeError(f"trainer.callbacks: ValuePretraining.patience must be >= 1 or null, got {patience}")
        if min_delta < 0:
            raise RecipeError(f"trainer.callbacks: ValuePretraining.min_delta must be >= 0, got {min_delta}")
        if epochs < 1:
            raise RecipeError(f"trainer.callbacks: ValuePretraining.epochs must be >= 1, got {epochs}")
        if minibatch_size is not None and minibatch_size < 1:
            raise RecipeError(f"trainer.callbacks: ValuePretraining.minibatch_size must be >= 1 or null, "
                              f"got {minibatch_size}")
        self.max_steps = max_steps
        self.patience = patience
        self.min_delta = min_delta
        self.epochs = epochs
        self.minibatch_size = minibatch_size
        self.train_backbone = train_backbone
        self.steps_done = 0
        self.finished = max_steps == 0
        self.best_loss = math.inf
        self.bad_steps = 0

    def on_rollout(self, trainer: L.Trainer | None, module: RLModule, rollout: Rollout) -> Rollout | None:
        if self.finished:
            return rollout
        if module.critic is None:
            raise RecipeError("trainer.callbacks: ValuePretraining needs a value model; set model.critic "
                              "(e.g. class_path: rllight.critics.ValueHead)")
        if len(rollout) == 0 or rollout.response_mask.sum() == 0:
            return None  # nothing to fit; the step is still not a policy step
        self._monte_carlo_targets(module, rollout)
        stats = module.critic_update(rollout, epochs=self.epochs, minibatch_size=self.minibatch_size,
                                     train_backbone=self.train_backbone)
        loss = float(stats["critic_only/loss"])
        self.steps_done += 1
        if loss < self.best_loss - self.min_delta:
            self.best_loss, self.bad_steps = loss, 0
        else:
            self.bad_steps += 1
        reason = ("max_steps" if self.steps_done >= self.max_steps
                  else "plateau" if self.patience is not None and self.bad_steps >= self.patience else None)
        if reason:
            self.finished = True
            log.info("value pretraining finished after %d steps (%s); best value loss %.5f; RL starts",
                     self.steps_done, reason, self.best_loss)
        metrics = {"train/value_pretraining/loss": loss, "train/value_pretraining/steps_done": float(self.steps_done),
                   "train/value_pretraining/finished": float(self.finished)}
        if "critic_only/explained_variance" in stats:
            metrics["train/value_pretraining/explained_variance"] = float(stats["critic_only/explained_variance"])
        module.log_dict(metrics, on_step=True, on_epoch=False, batch_size=1)
        return None

    def _monte_carlo_targets(self, module: RLModule, rollout: Rollout) -> None:
        """Fill ``values`` (the critic's, without gradients), ``token_rewards`` and ``returns`` (B, T)."""
        module.score_with_models(rollout, need_old=False, need_values=True, need_ref=False)
        if rollout.values.dim() != 2:
            raise RecipeError("trainer.callbacks: ValuePretraining fits token-level critics (values (B, T)); "
                              f"{type(module.critic).__name__} gives one value per prompt")
        gamma = float(getattr(module.advantage, "gamma", 1.0))
        rollout.token_rewards = module.outcome_token_rewards(rollout)
        # lam = 1: returns are the (discounted) Monte-Carlo returns G_t, independent of the critic.
        _, rollout.returns = gae(rollout.token_rewards, rollout.values, rollout.response_mask, gamma, 1.0)

    def state_dict(self) -> dict[str, Any]:
        return {"steps_done": self.steps_done, "finished": self.finished, "best_loss": self.best_loss,
                "bad_steps": self.bad_steps}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.steps_done = int(state_dict["steps_done"])
        self.finished = bool(state_dict["finished"])
        self.best_loss = float(state_dict["best_loss"])
        self.bad_steps = int(state_dict["bad_steps"])
