"""Policy losses (``model.policy_loss``): ``__call__(logprobs, batch) -> (loss, metrics)`` with the loss per token
(B, T), which the recipe's aggregation (``rllight.strategies.aggregations``) turns into one number, or per
response (B,), averaged over responses.

- Per token: ``ClippedSurrogate`` (PPO, DAPO's clip-higher), ``CISPO``, ``VESPO``.
- Per response: ``SequenceClippedSurrogate`` (SPPO), ``GSPO``.

The losses that wrap one of these (importance-sampling corrections, VAPO's positive-example NLL) are in
``rllight.strategies.loss_wrappers``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from rllight.algorithms import (
    cispo,
    clip_fractions,
    clipped_surrogate,
    effective_sample_size,
    gspo,
    masked_mean,
    sequence_clipped_surrogate,
    vespo_weight,
)
from rllight.bounds import AboveOne, NonNegativeFloat, OpenUnitInterval, PositiveFloat, UpToOne, bounded
from rllight.errors import RecipeError
from rllight.strategies.aggregations import Aggregation
from rllight.types import Rollout

__all__ = ["CISPO", "GSPO", "VESPO", "ClippedSurrogate", "PolicyLoss", "SequenceClippedSurrogate"]


class PolicyLoss:
    """Base class: ``__call__(logprobs, batch) -> (per_token_loss (B, T), metrics)``; the loss is
    minimised after aggregation. ``logprobs`` (B, T) carries the gradient."""

    def __call__(self, logprobs: Tensor, batch: Rollout) -> tuple[Tensor, dict[str, Tensor]]:
        raise NotImplementedError

    def begin_update(self, minibatch: Rollout, aggregation: Aggregation, global_sum) -> None:
        """Called by the module once per optimizer update, on every rank, before its micro-batches: a loss
        whose normaliser spans the whole update (e.g. the tokens of its correct responses) records it here.
        ``global_sum`` sums a tensor over ranks. Nothing by default."""


class ClippedSurrogate(PolicyLoss):
    """PPO's clipped surrogate with separate low and high clip (DAPO's clip-higher: 0.2 / 0.28,
    arXiv:2503.14476) and an optional dual clip.

    Args:
        clip_low: epsilon_low; the ratio is clipped below at 1 - clip_low.
        clip_high: epsilon_high; the ratio is clipped above at 1 + clip_high.
        dual_clip: c > 1 bounds the loss of negative-advantage tokens by -c A (None = off).
    """

    @bounded
    def __init__(self, clip_low: OpenUnitInterval = 0.2, clip_high: PositiveFloat = 0.2,
                 dual_clip: AboveOne | None = None):
        self.clip_low = clip_low
        self.clip_high = clip_high
        self.dual_clip = dual_clip

    def __call__(self, logprobs: Tensor, batch: Rollout) -> tuple[Tensor, dict[str, Tensor]]:
        loss = clipped_surrogate(logprobs, batch.old_logprobs, batch.advantages, self.clip_low, self.clip_high,
                                 self.dual_clip)
        low, high = clip_fractions(logprobs.detach(), batch.old_logprobs, batch.advantages, batch.response_mask,
                                   self.clip_low, self.clip_high)
        return loss, {"policy/clipfrac_low": low, "policy/clipfrac_high": high}


class CISPO(PolicyLoss):
    """CISPO (MiniMax-M1, arXiv:2506.13585): ``-sg(clip(r_t, 1 - clip_low, 1 + clip_high)) A_t logp_t``
    per token. Unlike PPO's clip, no token loses its gradient: the clip only bounds its weight.

    Logged: ``policy/clipfrac_high`` (tokens whose weight was capped above), ``policy/clipfrac_low``.

    Args:
        clip_low: epsilon below 1; None = no lower bound (as the paper).
        clip_high: epsilon above 1 (the paper tunes only this one).
    """

    @bounded
    def __init__(self, clip_low: UpToOne | None = None, clip_high: PositiveFloat = 0.28):
        self.clip_low = clip_low
        self.clip_high = clip_high

    def __call__(self, logprobs: Tensor, batch: Rollout) -> tuple[Tensor, dict[str, Tensor]]:
        loss = cispo(logprobs, batch.old_logprobs, batch.advantages, self.clip_low, self.clip_high)
        with torch.no_grad():
            ratio = torch.exp(logprobs - batch.old_logprobs)
            mask = batch.response_mask
            high = masked_mean((ratio > 1 + self.clip_high).float(), mask)
            low = masked_mean((ratio < 1 - self.clip_low).float(), mask) if self.clip_low is not None \
                else ratio.new_zeros(())
        return loss, {"policy/clipfrac_low": low, "policy/clipfrac_high": high}


WEIGHTS_AGAINST = ("trainer", "engine")


class VESPO(PolicyLoss):
    """VESPO's policy objective (Variational Sequence-Level Soft Policy Optimization, arXiv:2602.10693; note 002):
    a smooth kernel of the sequence importance weight replaces PPO's hard clip.

    Per response, the sequence log-weight with no length normalisation,
    ``log W = sum_t (logp_t - behaviour_logp_t)``; the kernel ``phi(W) = W^c1 exp(c2 (1 - W))``, computed in
    log space and detached, with ``(c1, c2)`` by the sign of the response's advantage; and the per-token loss
    ``-phi(W) A_t logp_t`` (shape (B, T), aggregated by the recipe: token-mean in the paper). The gradient is
    ``phi(W) A grad log pi``: an importance-weighted REINFORCE whose weight is smoothly damped on both sides of
    W = 1 instead of clipped.

    Which log-probs are the behaviour policy's (``weight_against``):

    - ``trainer`` (default, as the authors' code): the trainer's own old log-probs (``rollout.old_logprobs``:
      the policy before this rollout's first update, scored in the update's own micro-batches; with a single
      update per rollout the live log-probs, detached), so W measures how far the updates have moved the policy
      and is exactly 1 on the first minibatch. In ``FloyedShen/VESPO``, ``recipe/vespo/code/core_algos.py``
      ``compute_policy_loss_vespo`` takes ``log_ratio = log_prob - old_log_prob``, where ``old_log_prob`` is
      the actor's recomputed ``old_log_probs`` (``recipe/vespo/code/trainer.py``, ``compute_log_prob``) or, with
      one minibatch and one epoch, ``log_prob.detach()`` (``recipe/vespo/code/dp_actor.py``,
      ``update_policy``). The engine/trainer mismatch is then a separate, optional correction: wrap this loss in
      ``rllight.strategies.TruncatedIS`` or ``MaskedIS`` (per token, outside phi; the authors instead add the
      log of verl's ``rollout_is_weights`` to log W before phi, and their sync scripts enable none).
    - ``engine``: note 002's literal form, the rollout engine's sampling log-probs (``rollout.sample_logprobs``,
      not recomputed by the trainer): W then also measures the engine/trainer mismatch (kernels, precision,
      and with top-p / top-k sampling the truncation) and, for asynchronous rollouts, the policy's lag. The
      authors' fully asynchronous script does this (``recipe/vespo/run/fully_async/vespo_S_1.0_N_4.sh`` sets
      ``async_training.use_rollout_log_probs=True``: the rollout's log-probs become the old ones).

    Staleness ``N = global batch / mini batch`` is the number of sequential optimizer updates per rollout:
    with R = data.batch_size * sampler.group_size responses per rollout, ``N = model.batching.ppo_epochs * R /
    model.batching.minibatch_size``. The paper trains at N = 8 and stays stable up to N = 64.

    Logged: ``policy/vespo_phi_mean``, ``policy/vespo_ess`` (normalised effective sample size of the phi
    weights, in (0, 1]), ``policy/vespo_ess_raw`` (of the raw weights W), ``policy/vespo_log_weight_mean``
    and ``policy/vespo_log_weight_absmax``.

    Args:
        c1_pos: Power c1 for A >= 0.
        c2_pos: Exponential damping c2 for A >= 0 (above 0: it is what damps large weights; without it phi grows
            like W^c1).
        c1_neg: Power c1 for A < 0.
        c2_neg: Exponential damping c2 for A < 0.
        weight_against: The behaviour log-probs of W: ``trainer`` (the trainer's old log-probs, as the
            authors' code) or ``engine`` (the rollout engine's sampling log-probs, note 002's literal form).
    """

    @bounded
    def __init__(self, c1_pos: NonNegativeFloat = 2.0, c2_pos: PositiveFloat = 3.0, c1_neg: NonNegativeFloat = 3.0,
                 c2_neg: PositiveFloat = 2.0, weight_against: str = "trainer"):
        if weight_against not in WEIGHTS_AGAINST:
            raise RecipeError(f"model.policy_loss.weight_against must be one of {', '.join(WEIGHTS_AGAINST)}, "
                              f"got {weight_against!r}")
        self.c1_pos = c1_pos
        self.c2_pos = c2_pos
        self.c1_neg = c1_neg
        self.c2_neg = c2_neg
        self.weight_against = weight_against

    def __call__(self, logprobs: Tensor, batch: Rollout) -> tuple[Tensor, dict[str, Tensor]]:
        mask = batch.response_mask
        valid = mask.bool()
        behaviour = batch.old_logprobs if self.weight_against == "trainer" else batch.sample_logprobs
        log_w = torch.where(valid, logprobs.detach() - behaviour, logprobs.new_zeros(())).sum(-1)
        seq_adv = masked_mean(batch.advantages, mask, dim=-1)  # its sign picks (c1, c2)
        phi = vespo_weight(log_w, seq_adv, self.c1_pos, self.c2_pos, self.c1_neg, self.c2_neg)
        loss = -phi.to(logprobs.dtype).unsqueeze(-1) * batch.advantages * logprobs
        stats = {
            "policy/vespo_phi_mean": phi.mean(),
            "policy/vespo_ess": effective_sample_size(torch.log(phi)),
            "policy/vespo_ess_raw": effective_sample_size(log_w),
            "policy/vespo_log_weight_mean": log_w.mean(),
            "policy/vespo_log_weight_absmax": log_w.abs().max(),
        }
        return loss, stats


class SequenceClippedSurrogate(PolicyLoss):
    """SPPO's sequence-level clipped objective (Wang et al., arXiv:2604.08865), one loss per response (shape (B,)):
    ``-min(sum_t r_t A, sum_t clip(r_t, 1 - clip_low, 1 + clip_high) A)`` (see
    ``rllight.algorithms.sequence_clipped_surrogate``). Being per sequence, it is averaged over
    responses whatever the recipe's aggregation.

    Logged: ``policy/clipfrac_low`` / ``policy/clipfrac_high``, the fraction of responses whose clipped
    sum was the smaller one (so the clip acted) with A < 0 / A > 0.

    Args:
        clip_low: epsilon below 1.
        clip_high: epsilon above 1.
    """

    @bounded
    def __init__(self, clip_low: OpenUnitInterval = 0.2, clip_high: PositiveFloat = 0.2):
        self.clip_low = clip_low
        self.clip_high = clip_high

    def __call__(self, logprobs: Tensor, batch: Rollout) -> tuple[Tensor, dict[str, Tensor]]:
        loss = sequence_clipped_surrogate(logprobs, batch.old_logprobs, batch.advantages, batch.response_mask,
                                          self.clip_low, self.clip_high)
        with torch.no_grad():
            # The clip acted where the clipped objective differs from the unclipped one and was chosen.
            unclipped = sequence_clipped_surrogate(logprobs, batch.old_logprobs, batch.advantages,
                                                   batch.response_mask, 1e30, 1e30)
            acted = loss > unclipped + 1e-12
            seq_adv = (batch.advantages * batch.response_mask).sum(-1)
            low = (acted & (seq_adv < 0)).float().mean()
            high = (acted & (seq_adv > 0)).float().mean()
        return loss, {"policy/clipfrac_low": low, "policy/clipfrac_high": high}


class GSPO(PolicyLoss):
    """GSPO (Zheng et al., arXiv:2507.18071): PPO's clip applied to the sequence ratio
    ``s_i = exp(mean_t(logp - old_logp))``; one loss per response (shape (B,)), averaged over responses
    whatever the recipe's aggregation. The clip only matters with several updates per rollout
    (``model.batching.minibatch_size`` below the rollout size).

    Logged: ``policy/clipfrac_low`` / ``policy/clipfrac_high`` (fractions of responses clipped, A < 0 /
    A > 0) and ``policy/seq_ratio_mean``.

    Args:
        clip_low: epsilon below 1 (3e-4 in the paper).
        clip_high: epsilon above 1 (4e-4 in the paper).
    """

    @bounded
    def __init__(self, clip_low: OpenUnitInterval = 3e-4, clip_high: PositiveFloat = 4e-4):
        self.clip_low = clip_low
        self.clip_high = clip_high

    def __call__(self, logprobs: Tensor, batch: Rollout) -> tuple[Tensor, dict[str, Tensor]]:
        loss = gspo(logprobs, batch.old_logprobs, batch.advantages, batch.response_mask, self.clip_low,
                    self.clip_high)
        with torch.no_grad():
            mask = batch.response_mask
            seq_ratio = torch.exp(masked_mean(logprobs - batch.old_logprobs, mask, dim=-1))
            seq_adv = masked_mean(batch.advantages, mask, dim=-1)
            low = ((seq_ratio < 1 - self.clip_low) & (seq_adv < 0)).float().mean()
            high = ((seq_ratio > 1 + self.clip_high) & (seq_adv > 0)).float().mean()
        return loss, {"policy/clipfrac_low": low, "policy/clipfrac_high": high,
                      "policy/seq_ratio_mean": seq_ratio.mean()}
