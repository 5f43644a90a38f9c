"""VAPO's value pretraining (Yue et al., arXiv:2504.05118, section 4.1; VC-PPO, arXiv:2503.01491) as a
rollout callback."""

from __future__ import annotations

import logging
import math
from typing import Any

import lightning as L
import torch

from rllight.algorithms import explained_variance, gae, masked_mean, value_loss
from rllight.bounds import NonNegativeFloat, NonNegativeInt, PositiveInt, bounded
from rllight.callbacks.base import RolloutCallback, RolloutContext
from rllight.distributed import share
from rllight.errors import RecipeError
from rllight.types import Rollout

log = logging.getLogger(__name__)


class ValuePretraining(RolloutCallback):
    """Fit the value model on Monte-Carlo returns of the frozen policy's samples before RL starts.

    While pretraining, every rollout is consumed here (``on_rollout`` returns None, so the step makes no
    policy update and ``trainer.global_step`` does not advance): the critic scores it, the targets are
    the Monte-Carlo returns (GAE with lambda = 1, ``gamma`` of the recipe's advantage estimator, outcome
    reward on the last token; a KL penalty is not part of them), and ``RolloutContext.updater.critic_update`` fits
    the critic for ``epochs`` passes. With a value head on the shared backbone and ``train_backbone``
    False only the head trains, as note 000 describes; a separate critic trains whole.

    Pretraining ends as the paper's criterion asks, when the value loss and the explained variance have
    both settled: neither has improved on its best so far by more than its tolerance (``min_delta``,
    ``min_delta_explained_variance``) for ``patience`` rollouts in a row. Both are measured on each
    fresh rollout before the critic trains on it, so they are held-out numbers, not the fit of the data
    just trained on. A rollout whose returns do not vary (every response wrong, or every one right) has
    no explained variance and improves only through its loss. At the latest it ends after ``max_steps``
    rollouts. Then every later rollout passes through untouched. The counters, the finished flag and
    both best values are in ``state_dict`` so a resumed run neither repeats nor skips the phase.

    Put it first in ``trainer.callbacks`` (before callbacks that train, such as ``SelfImitation``).

    Metrics: ``train/value_pretraining/{loss,explained_variance}`` (held-out, on the fresh rollout; the
    stopping criterion), ``train/value_pretraining/fit_loss`` (mean loss of the updates on it) and
    ``train/value_pretraining/{steps_done,finished}``.

    Args:
        max_steps: Rollouts to pretrain on at most (0 = no pretraining).
        patience: Stop after this many rollouts in a row improved neither the value loss nor the explained
            variance (None = run all ``max_steps``).
        min_delta: Decrease of the value loss below its best that counts as an improvement.
        min_delta_explained_variance: Increase of the explained variance above its best that counts as an
            improvement.
        epochs: Passes of critic updates over each rollout.
        minibatch_size: Responses per critic update over all processes, each taking an equal share (None =
            ``model.batching.minibatch_size``, or the whole rollout).
        train_backbone: Also train the shared backbone of a ``ValueHead`` (False = head only, as note 000 says of
            its figure 5: "in value pretraining the backbone is frozen, only the value head trains"; True moves the
            policy before RL starts). A ``SeparateCritic`` trains whole either way. Figure 5's backbone training
            comes in RL: ``ValueHead.critic_first_trains_backbone``.
    """

    rollout_order = 30  # before SelfImitation: no replay while it consumes the rollouts

    @bounded
    def __init__(self, max_steps: NonNegativeInt = 50, patience: PositiveInt | None = 5,
                 min_delta: NonNegativeFloat = 1e-4, min_delta_explained_variance: NonNegativeFloat = 1e-2,
                 epochs: PositiveInt = 1, minibatch_size: PositiveInt | None = None, train_backbone: bool = False):
        self.max_steps = max_steps
        self.patience = patience
        self.min_delta = min_delta
        self.min_delta_explained_variance = min_delta_explained_variance
        self.epochs = epochs
        self.minibatch_size = minibatch_size
        self.train_backbone = train_backbone
        self.steps_done = 0
        self.finished = max_steps == 0
        self.best_loss = math.inf
        self.best_explained_variance = -math.inf
        self.bad_steps = 0

    def observe(self, loss: float, explained_variance: float) -> str | None:
        """Count one pretraining rollout with its held-out value loss and explained variance (NaN when
        undefined); returns why pretraining ends now (``"max_steps"`` or ``"settled"``), else None."""
        improved = False
        if loss < self.best_loss - self.min_delta:
            self.best_loss, improved = loss, True
        # NaN compares False: a rollout without an explained variance cannot improve it.
        if explained_variance > self.best_explained_variance + self.min_delta_explained_variance:
            self.best_explained_variance, improved = explained_variance, True
        self.bad_steps = 0 if improved else self.bad_steps + 1
        self.steps_done += 1
        reason = ("max_steps" if self.steps_done >= self.max_steps
                  else "settled" if self.patience is not None and self.bad_steps >= self.patience else None)
        self.finished = reason is not None
        return reason

    def rollouts_to_take(self) -> int:
        """The pretraining rollouts left at most (``max_steps`` less those done; none once finished)."""
        return 0 if self.finished else max(self.max_steps - self.steps_done, 0)

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if self.minibatch_size is not None:  # a total that must divide among the processes: refused at the start
            share(self.minibatch_size, trainer.world_size, "trainer.callbacks: ValuePretraining.minibatch_size")

    def on_rollout(self, trainer: L.Trainer | None, context: RolloutContext, rollout: Rollout) -> Rollout | None:
        if self.finished:
            return rollout
        if context.critic is None:
            raise RecipeError("trainer.callbacks: ValuePretraining needs a value model; set model.critic "
                              "(e.g. class_path: rllight.critics.ValueHead)")
        # Under DDP every rank takes each decision alike (the critic updates are collectives): a rank with
        # nothing to fit joins the others' updates with no rows, and the stopping criterion reads the
        # ranks' mean loss and explained variance.
        empty = len(rollout) == 0 or rollout.response_mask.sum() == 0
        if not context.ranks.any(not empty):
            return None  # nothing to fit anywhere; the step is still not a policy step
        local = torch.zeros(3)  # loss, explained variance, weight
        if empty:
            rollout = rollout.select([])
        else:
            self._monte_carlo_targets(context, rollout)
            # Held out: the critic has not trained on this rollout yet. The clipped loss equals the plain one
            # here (the values are the rollout's own), so the number is on the scale of the critic's loss.
            mask = rollout.response_mask
            local[0] = masked_mean(value_loss(rollout.values, rollout.values, rollout.returns), mask).detach().cpu()
            local[1] = explained_variance(rollout.values, rollout.returns, mask).detach().cpu()
            local[2] = 1.0
        stats = context.updater.critic_update(rollout, epochs=self.epochs, minibatch_size=self.minibatch_size,
                                              train_backbone=self.train_backbone)
        total = context.ranks.sum(local)
        loss, ev = float(total[0] / total[2]), float(total[1] / total[2])
        reason = self.observe(loss, ev)
        if reason:
            log.info("value pretraining finished after %d rollouts (%s); best held-out value loss %.5f, "
                     "explained variance %.3f; RL starts", self.steps_done, reason, self.best_loss,
                     self.best_explained_variance)
        metrics = {"train/value_pretraining/loss": loss, "train/value_pretraining/explained_variance": ev,
                   "train/value_pretraining/steps_done": float(self.steps_done),
                   "train/value_pretraining/finished": float(self.finished)}
        if "critic_only/loss" in stats:
            metrics["train/value_pretraining/fit_loss"] = float(stats["critic_only/loss"])
        context.log(metrics)
        return None

    def _monte_carlo_targets(self, context: RolloutContext, rollout: Rollout) -> None:
        """Fill ``values`` (the critic's, without gradients), ``token_rewards`` and ``returns`` (B, T)."""
        context.scoring.score(rollout, need_old=False, need_values=True, need_ref=False)
        if rollout.values.dim() != 2:
            raise RecipeError("trainer.callbacks: ValuePretraining fits token-level critics (values (B, T)); "
                              f"{type(context.critic).__name__} gives one value per prompt")
        gamma = float(context.gamma)  # the estimator's discount (AdvantageEstimator.gamma: 1.0 if none)
        rollout.token_rewards = rollout.outcome_token_rewards()
        # lam = 1: returns are the (discounted) Monte-Carlo returns G_t, independent of the critic.
        _, rollout.returns = gae(rollout.token_rewards, rollout.values, rollout.response_mask, gamma, 1.0)

    def state_dict(self) -> dict[str, Any]:
        return {"steps_done": self.steps_done, "finished": self.finished, "best_loss": self.best_loss,
                "best_explained_variance": self.best_explained_variance, "bad_steps": self.bad_steps}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.steps_done = int(state_dict["steps_done"])
        self.finished = bool(state_dict["finished"])
        self.best_loss = float(state_dict["best_loss"])
        # Checkpoints written before the explained variance joined the criterion lack it: no best yet.
        self.best_explained_variance = float(state_dict.get("best_explained_variance", -math.inf))
        self.bad_steps = int(state_dict["bad_steps"])
