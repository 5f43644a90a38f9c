"""VAPO's value pretraining (Yue et al., arXiv:2504.05118, section 4.1; VC-PPO, arXiv:2503.01491) as a
rollout callback."""

from __future__ import annotations

import logging
import math
from typing import Any

import lightning as L
import torch
from torch import Tensor

from rllight.algorithms import explained_variance, gae, masked_mean, value_loss
from rllight.bounds import NonNegativeFloat, NonNegativeInt, OpenUnitInterval, PositiveInt, bounded
from rllight.callbacks.base import RolloutCallback, RolloutContext, saved_ranks, state_of_every_rank
from rllight.distributed import Ranks, share
from rllight.errors import RecipeError
from rllight.strategies import GroupSampler, Sampler
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
    rollouts. Then every later rollout passes through untouched. The counters, the finished flag, both best
    values and the window's held-out numbers are in ``state_dict`` so a resumed run neither repeats nor skips
    the phase.

    Two settings for rollouts of a few prompts, where one rollout's explained variance mostly measures which of
    its few responses happened to be right:

    - ``window``: the criterion reads the loss and the explained variance of the last ``window`` fresh rollouts
      pooled (each token's value as the critic gave it before training on its rollout), rather than of the
      latest alone. It starts once the window is full, after ``window`` rollouts: a best set on fewer is the noise
      the window is there to average away (a first rollout with few right answers has a low loss only because
      its returns hardly vary, and no later window would beat it), so ``patience`` counts from there (or from
      ``max_steps``, where it is the smaller).
    - ``replay``: each fit also takes the ``replay`` pretraining rollouts before this one (their values scored
      again by the critic as it is, the clip's reference). While it pretrains the policy does not move, so they
      are samples of the same distribution as the fresh one: more data, not staler data. They are kept in
      memory only; a resumed run starts with none.

    ``probe``: the first ``probe`` pretraining rollouts are set aside and never fitted. After each fit the critic scores
    them again, and the stopping criterion reads their pooled loss and explained variance in place of the window's:
    the same responses judged by one critic after another, so that a change in the number is a change in the critic,
    not in which responses came (on a few prompts a window of fresh rollouts can rise or fall by luck alone, and the
    critic can get worse on rollouts it does not fit while it fits the latest). The probe's rollouts are held in
    memory and not in a checkpoint: a run resumed before pretraining ended sets aside a new probe from its next
    rollouts, and its criterion, whose best values were the old probe's, starts again.

    ``min_explained_variance`` departs from the paper's criterion, which stops on a plateau whatever the plateau's
    height: where set, pretraining is not "settled" while the criterion's explained variance (the window's, or the
    probe's) is below it, so a critic that stalls near 0 keeps fitting until it explains that much of the returns or
    ``max_steps`` ends it. On a window it waits for a window that happens to be high rather than a better critic
    (docs/algorithms/vapo.md), which is why no recipe sets it.

    ``group_size`` changes what the pretraining rollouts hold: as many responses as the recipe's (the sampler's group
    size G per prompt of the step's batch) but ``group_size`` per prompt, over G / ``group_size`` times as many
    prompts, the step's batch and more drawn from the training prompts (``RolloutProducer.more_prompts``, as dynamic
    sampling draws). A rollout of a few prompts teaches the critic a few success rates, which it then fits better than
    new prompts (docs/algorithms/vapo.md); the paper's pretraining sees 512 prompts a step. RL's rollouts are the
    recipe's again once pretraining ends. It needs ``model.sampler`` a ``GroupSampler`` whose G it divides.

    Put it first in ``trainer.callbacks`` (before callbacks that train, such as ``SelfImitation``).

    Metrics: ``train/value_pretraining/{loss,explained_variance}`` (held-out, on the fresh rollout),
    ``train/value_pretraining/{window_loss,window_explained_variance}`` (held-out, pooled over the window: the
    stopping criterion without a probe), ``train/value_pretraining/{probe_loss,probe_explained_variance}`` (with a
    probe, after each fit: the stopping criterion), ``train/value_pretraining/fit_loss`` (mean loss of the updates on
    it) and ``train/value_pretraining/{steps_done,finished,replayed,probe_rollouts}``.

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
        window: Fresh rollouts whose held-out loss and explained variance the stopping criterion pools (1 = the
            latest alone).
        replay: Earlier pretraining rollouts fitted again beside each fresh one (0 = none).
        min_explained_variance: The criterion's explained variance (the window's, or the probe's) below which
            pretraining does not count as settled (None = the paper's criterion, a plateau of any height).
        probe: Pretraining rollouts set aside, never fitted, that the critic scores after each fit for the stopping
            criterion (0 = none: the criterion reads the window). They come before the ``max_steps`` fitted ones.
        group_size: Responses per prompt in the pretraining rollouts, their number of responses kept, spread over more
            prompts (None = the sampler's own group size).
    """

    rollout_order = 30  # before SelfImitation: no replay while it consumes the rollouts

    @bounded
    def __init__(self, max_steps: NonNegativeInt = 50, patience: PositiveInt | None = 5,
                 min_delta: NonNegativeFloat = 1e-4, min_delta_explained_variance: NonNegativeFloat = 1e-2,
                 epochs: PositiveInt = 1, minibatch_size: PositiveInt | None = None, train_backbone: bool = False,
                 window: PositiveInt = 1, replay: NonNegativeInt = 0,
                 min_explained_variance: OpenUnitInterval | None = None, probe: NonNegativeInt = 0,
                 group_size: PositiveInt | None = None):
        self.max_steps = max_steps
        self.patience = patience
        self.min_delta = min_delta
        self.min_delta_explained_variance = min_delta_explained_variance
        self.epochs = epochs
        self.minibatch_size = minibatch_size
        self.train_backbone = train_backbone
        self.window = window
        self.replay = replay
        self.min_explained_variance = min_explained_variance
        self.probe = probe
        self.group_size = group_size
        self._told_spread = False  # the log line that says how pretraining samples: once
        self._probe: list[Rollout] = []  # the rollouts set aside, on the CPU, with their returns
        self.held_out: list[tuple[Tensor, Tensor]] = []  # (values, returns) of the window's rollouts, response tokens
        self._replayed: list[Rollout] = []  # the latest pretraining rollouts, on the CPU
        self._ranks: Ranks | None = None
        self.steps_done = 0
        self.finished = max_steps == 0
        self.best_loss = math.inf
        self.best_explained_variance = -math.inf
        self.bad_steps = 0

    def observe(self, loss: float, explained_variance: float) -> str | None:
        """Count one pretraining rollout with its held-out value loss and explained variance (NaN when
        undefined); returns why pretraining ends now (``"max_steps"`` or ``"settled"``), else None."""
        self.steps_done += 1
        # a full window only (the class's docstring); a probe is whole from the first fit
        if self.steps_done >= (1 if self.probe else min(self.window, self.max_steps)):
            improved = False
            if loss < self.best_loss - self.min_delta:
                self.best_loss, improved = loss, True
            # NaN compares False: a rollout without an explained variance cannot improve it.
            if explained_variance > self.best_explained_variance + self.min_delta_explained_variance:
                self.best_explained_variance, improved = explained_variance, True
            self.bad_steps = 0 if improved else self.bad_steps + 1
        high_enough = self.min_explained_variance is None or explained_variance >= self.min_explained_variance
        reason = ("max_steps" if self.steps_done >= self.max_steps
                  else "settled" if self.patience is not None and self.bad_steps >= self.patience and high_enough
                  else None)
        self.finished = reason is not None
        return reason

    def rollouts_to_take(self) -> int:
        """The pretraining rollouts left at most (``max_steps`` less those done, and the probe's still to set aside;
        none once finished)."""
        return 0 if self.finished else max(self.max_steps - self.steps_done, 0) + max(self.probe - len(self._probe), 0)

    def check_before_fit(self, module: L.LightningModule) -> None:
        if self.group_size is not None:
            self._spread_of(getattr(module, "sampler", None))

    def _spread_of(self, sampler) -> int:
        """How many prompts the pretraining rollouts take per row of the step's batch (G / ``group_size``)."""
        if not isinstance(sampler, GroupSampler):
            raise RecipeError(f"trainer.callbacks: ValuePretraining.group_size needs model.sampler a GroupSampler, not "
                              f"{type(sampler).__name__}; remove group_size")
        if sampler.group_size % self.group_size:
            raise RecipeError(f"trainer.callbacks: ValuePretraining.group_size {self.group_size} does not divide "
                              f"model.sampler's group_size {sampler.group_size}; choose a divisor of it")
        return sampler.group_size // self.group_size

    def step_sampler(self, sampler):
        """While it pretrains with ``group_size``: ``SpreadGroups``, the same number of responses over more prompts."""
        if self.group_size is None or self.finished:
            return sampler
        spread = self._spread_of(sampler)
        if not self._told_spread and (self._ranks is None or self._ranks.rank == 0):
            log.info("value pretraining samples %d responses per prompt over %d times the step's prompts, until it "
                     "ends; RL then samples %d per prompt", self.group_size, spread, sampler.group_size)
        self._told_spread = True
        return SpreadGroups(self.group_size, spread)

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._ranks = Ranks(trainer)  # before a checkpoint's state is loaded: each rank takes its own window
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
        if len(self._probe) < self.probe:  # set aside, never fitted: every rank alike (its own share, maybe none)
            part = rollout.select([]) if empty else rollout
            if not empty:
                self._monte_carlo_targets(context, part)
            self._probe.append(part.to("cpu"))
            context.log({"train/value_pretraining/probe_rollouts": float(len(self._probe))})
            return None
        # loss, explained variance, window loss, window explained variance, weight; the probe's loss, explained
        # variance and weight
        local = torch.zeros(8)
        if empty:
            rollout = rollout.select([])
        else:
            self._monte_carlo_targets(context, rollout)
            # Held out: the critic has not trained on this rollout yet. The clipped loss equals the plain one
            # here (the values are the rollout's own), so the number is on the scale of the critic's loss.
            mask = rollout.response_mask.bool()
            fresh = (rollout.values[mask].detach().float().cpu(), rollout.returns[mask].detach().float().cpu())
            self.held_out = [*self.held_out, fresh][-self.window:]
            local[0:2] = torch.tensor(held_out_numbers([fresh]))
            local[2:4] = torch.tensor(held_out_numbers(self.held_out))
            local[4] = 1.0
        fit = self._with_replay(context, rollout, empty)
        stats = context.updater.critic_update(fit, epochs=self.epochs, minibatch_size=self.minibatch_size,
                                              train_backbone=self.train_backbone)
        local[5:8] = self._probe_numbers(context)
        total = context.ranks.sum(local)
        loss, ev, window_loss, window_ev = (float(x) for x in total[:4] / total[4])
        probe_loss, probe_ev = (float(x) for x in total[5:7] / total[7]) if self.probe else (math.nan, math.nan)
        reason = self.observe(*((probe_loss, probe_ev) if self.probe else (window_loss, window_ev)))
        if reason and context.ranks.rank == 0:  # every rank decides alike; one line says so
            ev_text = (f"explained variance {self.best_explained_variance:.3f}"
                       if math.isfinite(self.best_explained_variance)
                       else "explained variance undefined (the returns never varied "
                       + ("on the probe)" if self.probe else "within a window)"))
            log.info("value pretraining finished after %d rollouts (%s); best held-out value loss %.5f, %s%s; RL "
                     "starts", self.steps_done, reason, self.best_loss, ev_text,
                     f" (on the probe of {self.probe} rollouts)" if self.probe else "")
        metrics = {"train/value_pretraining/loss": loss, "train/value_pretraining/explained_variance": ev,
                   "train/value_pretraining/window_loss": window_loss,
                   "train/value_pretraining/window_explained_variance": window_ev,
                   "train/value_pretraining/replayed": float(len(fit) - len(rollout)),
                   "train/value_pretraining/steps_done": float(self.steps_done),
                   "train/value_pretraining/finished": float(self.finished)}
        if self.probe:
            metrics.update({"train/value_pretraining/probe_loss": probe_loss,
                            "train/value_pretraining/probe_explained_variance": probe_ev})
        if "critic_only/loss" in stats:
            metrics["train/value_pretraining/fit_loss"] = float(stats["critic_only/loss"])
        context.log(metrics)
        return None

    def _with_replay(self, context: RolloutContext, rollout: Rollout, empty: bool) -> Rollout:
        """``rollout`` and the ``replay`` pretraining rollouts before it, their values scored again by the critic as
        it is now (the value clip's reference); keeps ``rollout`` for the next ones."""
        if not self.replay:
            return rollout
        earlier = [r.to(context.device) for r in self._replayed]
        for r in earlier:
            context.scoring.score(r, need_old=False, need_values=True, need_ref=False)
        if not empty:
            self._replayed = [*self._replayed, rollout.to("cpu")][-self.replay:]
        parts = ([] if empty else [rollout]) + earlier
        return Rollout.cat(parts, context.tokenizer.pad_token_id) if parts else rollout

    def _probe_numbers(self, context: RolloutContext) -> Tensor:
        """The probe's value loss, explained variance (pooled over this rank's share) and weight (1, or 0 for a rank
        with no share), its values scored by the critic as it is now; zeros without a probe. Every rank scores as
        many parts (under FSDP an empty one runs padding passes)."""
        parts = []
        for part in self._probe:
            part = part.to(context.device)
            context.scoring.score(part, need_old=False, need_values=True, need_ref=False)
            if len(part):
                mask = part.response_mask.bool()
                parts.append((part.values[mask].detach().float().cpu(), part.returns[mask].detach().float().cpu()))
        parts = [p for p in parts if len(p[0])]
        return torch.tensor([*held_out_numbers(parts), 1.0]) if parts else torch.zeros(3)

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
        """The criterion's state; the window is each rank's own share of the rollouts (every rank's is saved)."""
        own = {"steps_done": self.steps_done, "finished": self.finished, "best_loss": self.best_loss,
               "best_explained_variance": self.best_explained_variance, "bad_steps": self.bad_steps,
               "held_out": [(v.tolist(), r.tolist()) for v, r in self.held_out]}
        return state_of_every_rank(self._ranks, own)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        saved = saved_ranks(state_dict)
        world, rank = (self._ranks.world_size, self._ranks.rank) if self._ranks is not None else (1, 0)
        if len(saved) == world:
            state_dict = saved[rank]
        else:  # another number of processes: the first rank holds the whole window, each rollout's shares pooled
            windows = [part.get("held_out", []) for part in saved]
            pooled = [([x for w in windows for x in w[k][0]], [x for w in windows for x in w[k][1]])
                      for k in range(min(map(len, windows)))]
            state_dict = {**saved[0], "held_out": pooled if rank == 0 else []}
        self.steps_done = int(state_dict["steps_done"])
        self.finished = bool(state_dict["finished"])
        self.best_loss = float(state_dict["best_loss"])
        # Checkpoints written before the explained variance joined the criterion lack it: no best yet.
        self.best_explained_variance = float(state_dict.get("best_explained_variance", -math.inf))
        self.bad_steps = int(state_dict["bad_steps"])
        held_out = state_dict.get("held_out", [])  # none in checkpoints made before the window
        self.held_out = [(torch.tensor(v), torch.tensor(r)) for v, r in held_out][-self.window:]
        if self.probe and not self.finished and self.steps_done:
            # The probe's rollouts are not in the checkpoint: a new probe is set aside from the next rollouts, and
            # the criterion, whose best values were measured on the old one, starts again.
            self.best_loss, self.best_explained_variance, self.bad_steps = math.inf, -math.inf, 0
            log.info("value pretraining resumed after %d rollouts: its probe is not in the checkpoint, so it sets "
                     "aside %d new rollouts and its stopping criterion starts again", self.steps_done, self.probe)


class SpreadGroups(Sampler):
    """A rollout of ``spread`` prompts per row of the step's batch, ``group_size`` responses each: the batch's rows
    and ``len(rows) x (spread - 1)`` more training rows (``RolloutProducer.more_prompts``), in that order. The extra
    rows come from the prompt stream, whose order is not the loader's, so one may repeat a row of the batch (each is
    a group of its own: a Monte-Carlo return needs none)."""

    fixed_size = True

    def __init__(self, group_size: int, spread: int):
        self.group_size, self.spread = group_size, spread

    def __call__(self, producer, rows: list[dict]) -> Rollout:
        more = len(rows) * (self.spread - 1)
        return producer.sample(list(rows) + (producer.more_prompts(more) if more else []), self.group_size)

    def prefetch(self, producer, rows: list[dict]) -> None:
        """Nothing is asked ahead: the extra rows are drawn only when the step samples, so a request for the batch's
        rows alone would never be collected."""


def held_out_numbers(parts: list[tuple[Tensor, Tensor]]) -> tuple[float, float]:
    """The value loss (``0.5 (V - R)^2`` averaged over the tokens) and the explained variance of ``parts``, pairs of
    values and returns of response tokens, pooled; the explained variance is NaN where the returns do not vary."""
    values, returns = torch.cat([v for v, _ in parts]), torch.cat([r for _, r in parts])
    ones = torch.ones_like(values)
    loss = masked_mean(value_loss(values, values, returns), ones)
    return float(loss), float(explained_variance(values, returns, ones))
