"""The baselines researchers compare against, as strategies: RLOO, ReMax, REINFORCE++ (advantages),
GSPO and CISPO (policy objectives), and truncated importance sampling (a wrapper around any per-token
policy objective). Dr. GRPO is ``GroupRelative(scale_by_std: false)`` + ``SeqMeanTokenSumNorm`` (a recipe)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from rllight.algorithms import (cispo, gspo, icepop_weight, masked_mean, reinforce_pp, remax, rloo,
                                sequence_is_mask, token_is_mask, truncated_is_weight)
from rllight.errors import RecipeError
from rllight.strategies.advantages import AdvantageEstimator
from rllight.strategies.losses import PolicyLoss, check_clip_range
from rllight.strategies.samplers import Sampler
from rllight.types import Rollout

if TYPE_CHECKING:
    from rllight.rollout.producer import RolloutProducer

__all__ = ["CISPO", "GSPO", "MaskedIS", "RLOO", "ReMax", "ReMaxSampler", "ReinforcePP", "TruncatedIS"]

GREEDY_REWARDS = "greedy_rewards"
"""Key in ``rollout.extras`` of the (B,) rewards of the greedy response to each row's prompt."""


def _broadcast(adv: Tensor, rollout: Rollout) -> Tensor:
    return adv.unsqueeze(-1) * rollout.response_mask.to(adv.dtype)


class RLOO(AdvantageEstimator):
    """REINFORCE leave-one-out (Ahmadian et al., arXiv:2402.14740): the baseline of a response is the
    mean reward of the other responses to its prompt, ``A_i = R_i - mean_{j != i} R_j``, broadcast to
    every token. Needs ``group_size >= 2``; a group of one gets A = 0. Reads the outcome reward only: a KL
    penalty belongs in the loss (``model.kl.in_reward: false``) with this estimator."""

    min_group_size = 2

    def __call__(self, rollout: Rollout) -> tuple[Tensor, None]:
        return _broadcast(rloo(rollout.rewards, rollout.group_ids), rollout), None


class ReMaxSampler(Sampler):
    """ReMax's rollout (Li et al., arXiv:2310.10505): ``group_size`` sampled responses per prompt, plus
    one greedy response per prompt that is scored but not trained on; its reward is stored per row in
    ``rollout.extras["greedy_rewards"]`` (B,) for ``ReMax``. Logs ``reward/greedy_mean``.

    Args:
        group_size: Sampled responses per prompt (ReMax uses 1).
    """

    def __init__(self, group_size: int = 1):
        if group_size < 1:
            raise RecipeError(f"model.sampler.init_args.group_size must be >= 1, got {group_size}")
        self.group_size = group_size

    def __call__(self, producer: RolloutProducer, rows: list[dict]) -> Rollout:
        rollout = producer.sample(rows, self.group_size)
        if len(rollout) == 0:
            return rollout
        greedy = producer.sample(rows, 1, greedy=True, training=False)  # dropped prompts counted above
        if len(greedy) * self.group_size != len(rollout):  # both calls drop the same over-long prompts
            raise RuntimeError(f"ReMaxSampler: {len(greedy)} greedy responses for {len(rollout)} samples")
        rollout.extras[GREEDY_REWARDS] = greedy.rewards.repeat_interleave(self.group_size)
        rollout.extras["reward/greedy_mean"] = greedy.rewards.mean()
        # The greedy pass is part of the rollout's cost.
        for key in ("time/rollout", "time/reward"):
            rollout.extras[key] = rollout.extras.get(key, 0.0) + greedy.extras.get(key, 0.0)
        return rollout


class ReMax(AdvantageEstimator):
    """ReMax (Li et al., arXiv:2310.10505): ``A_i = R_i - R(greedy response to the same prompt)``,
    broadcast to every token. Needs ``model.sampler: rllight.strategies.ReMaxSampler``, which generates
    and scores the greedy responses. Reads the outcome rewards only (put a KL penalty in the loss)."""

    def __call__(self, rollout: Rollout) -> tuple[Tensor, None]:
        if GREEDY_REWARDS not in rollout.extras:
            raise RecipeError("model.advantage: ReMax needs the greedy rewards; set model.sampler to "
                              "rllight.strategies.ReMaxSampler")
        return _broadcast(remax(rollout.rewards, rollout.extras[GREEDY_REWARDS]), rollout), None


class ReinforcePP(AdvantageEstimator):
    """REINFORCE++ (Hu et al., arXiv:2501.03262): discounted returns of the token rewards, whitened over
    the batch. The token rewards hold the outcome on the last token and, with
    ``model.kl: {in_reward: true}``, the KL penalty on every token: that is how REINFORCE++ uses KL.
    Returns no value targets (no critic).

    Args:
        gamma: Discount (1.0 in the paper).
    """

    uses_token_rewards = True

    def __init__(self, gamma: float = 1.0):
        if not 0 < gamma <= 1:
            raise RecipeError(f"model.advantage.gamma must be in (0, 1], got {gamma}")
        self.gamma = gamma

    def __call__(self, rollout: Rollout) -> tuple[Tensor, None]:
        advantages, _ = reinforce_pp(rollout.token_rewards, rollout.response_mask, self.gamma, total=self.total)
        return advantages, None


class GSPO(PolicyLoss):
    """GSPO (Zheng et al., arXiv:2507.18071): PPO's clip applied to the sequence ratio
    ``s_i = exp(mean_t(logp - old_logp))``; one loss per response (shape (B,)), averaged over responses
    whatever the recipe's aggregation. The clip only matters with several updates per rollout
    (``model.minibatch_size`` below the rollout size).

    Logged: ``policy/clipfrac_low`` / ``policy/clipfrac_high`` (fractions of responses clipped, A < 0 /
    A > 0) and ``policy/seq_ratio_mean``.

    Args:
        clip_low: epsilon below 1 (3e-4 in the paper).
        clip_high: epsilon above 1 (4e-4 in the paper).
    """

    def __init__(self, clip_low: float = 3e-4, clip_high: float = 4e-4):
        check_clip_range(clip_low, clip_high)
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


class CISPO(PolicyLoss):
    """CISPO (MiniMax-M1, arXiv:2506.13585): ``-sg(clip(r_t, 1 - clip_low, 1 + clip_high)) A_t logp_t``
    per token. Unlike PPO's clip, no token loses its gradient: the clip only bounds its weight.

    Logged: ``policy/clipfrac_high`` (tokens whose weight was capped above), ``policy/clipfrac_low``.

    Args:
        clip_low: epsilon below 1; None = no lower bound (as the paper).
        clip_high: epsilon above 1 (the paper tunes only this one).
    """

    def __init__(self, clip_low: float | None = None, clip_high: float = 0.28):
        if clip_low is not None and not 0 < clip_low <= 1:
            raise RecipeError(f"model.policy_loss.clip_low must be in (0, 1] or null, got {clip_low}")
        if clip_high <= 0:
            raise RecipeError(f"model.policy_loss.clip_high must be > 0, got {clip_high}")
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


class TruncatedIS(PolicyLoss):
    """Truncated importance sampling for the mismatch between the rollout engine and the trainer (Yao et
    al., 2025, "Your efficient RL framework secretly brings you off-policy RL training"): the per-token
    loss of ``loss`` is multiplied by ``min(exp(old_logprobs - sample_logprobs), cap)``, detached.

    ``old_logprobs`` are the trainer's log-probs before the step's updates and ``sample_logprobs`` the
    engine's (``rollout.sample_logprobs``); with an engine that samples from the trained model itself
    (HFEngine) the weight is ~1, with vLLM it corrects the kernels' and precision's differences.

    Logged: ``policy/tis_weight_mean`` and ``policy/tis_capped_frac`` (tokens at the cap).

    Args:
        loss: The per-token policy objective to correct (e.g. ``rllight.strategies.ClippedSurrogate``).
        cap: C, the truncation of the weight.
    """

    def __init__(self, loss: PolicyLoss, cap: float = 2.0):
        if cap <= 0:
            raise RecipeError(f"model.policy_loss.cap must be > 0, got {cap}")
        self.loss = loss
        self.cap = cap

    def begin_update(self, minibatch, aggregation, global_sum) -> None:
        self.loss.begin_update(minibatch, aggregation, global_sum)

    def __call__(self, logprobs: Tensor, batch: Rollout) -> tuple[Tensor, dict[str, Tensor]]:
        per_token, stats = _per_token_loss(self, logprobs, batch)
        weight = truncated_is_weight(batch.old_logprobs, batch.sample_logprobs, self.cap)
        mask = batch.response_mask
        stats = dict(stats)
        stats["policy/tis_weight_mean"] = masked_mean(weight, mask)
        capped = (batch.old_logprobs - batch.sample_logprobs) >= math.log(self.cap)
        stats["policy/tis_capped_frac"] = masked_mean(capped.float(), mask)
        return per_token * weight, stats


def _per_token_loss(wrapper, logprobs: Tensor, batch: Rollout) -> tuple[Tensor, dict[str, Tensor]]:
    """The wrapped loss's per-token loss and stats (a one-line error for a sequence-level loss)."""
    per_token, stats = wrapper.loss(logprobs, batch)
    if per_token.dim() != 2:
        raise RecipeError(f"model.policy_loss: {type(wrapper).__name__} needs a per-token loss; "
                          f"{type(wrapper.loss).__name__} returns one loss per sequence")
    return per_token, dict(stats)


MASKS = ("token", "sequence", "icepop")


class MaskedIS(PolicyLoss):
    """Masked importance sampling for the engine/trainer mismatch: the per-token loss of ``loss`` is kept where
    the ratio ``r_t = exp(old_logprobs_t - sample_logprobs_t)`` is within ``[low, high]`` and dropped elsewhere
    (``rllight.algorithms.masked_is``), instead of TIS's reweighting of every token.

    ``mask``:

    - ``token``: each token on its own ratio (``token_is_mask``);
    - ``sequence``: a whole response on the geometric mean of its ratios (``sequence_is_mask``);
    - ``icepop``: each token weighted by its ratio inside the band, dropped outside (``icepop_weight``;
      defaults there 0.5 and 5).

    Dropped tokens still count in the token-mean's denominator: masking removes their gradient, not the
    normalisation (as verl and TRL do). Logged: ``policy/is_masked_frac`` (the share of response tokens dropped)
    and ``policy/is_ratio_mean``.

    Args:
        loss: The per-token policy objective to correct (e.g. ``rllight.strategies.ClippedSurrogate``).
        mask: token, sequence or icepop.
        low: The lowest ratio kept (None: 0.5, or 1 / high for ``sequence`` when high is given).
        high: The highest ratio kept (None: 2.0; 5.0 for ``icepop``).
    """

    def __init__(self, loss: PolicyLoss, mask: str = "sequence", low: float | None = None,
                 high: float | None = None):
        if mask not in MASKS:
            raise RecipeError(f"model.policy_loss.mask must be one of {', '.join(MASKS)}, got {mask!r}")
        high = high if high is not None else (5.0 if mask == "icepop" else 2.0)
        low = low if low is not None else (0.5 if mask == "icepop" else 1.0 / high)
        if not 0 <= low < high:
            raise RecipeError(f"model.policy_loss: need 0 <= low < high, got low={low}, high={high}")
        self.loss, self.mask, self.low, self.high = loss, mask, low, high

    def begin_update(self, minibatch, aggregation, global_sum) -> None:
        self.loss.begin_update(minibatch, aggregation, global_sum)

    def __call__(self, logprobs: Tensor, batch: Rollout) -> tuple[Tensor, dict[str, Tensor]]:
        per_token, stats = _per_token_loss(self, logprobs, batch)
        old, sampled, mask = batch.old_logprobs, batch.sample_logprobs, batch.response_mask
        if self.mask == "token":
            weight = token_is_mask(old, sampled, self.low, self.high)
        elif self.mask == "sequence":
            weight = sequence_is_mask(old, sampled, mask, self.low, self.high)
        else:
            weight = icepop_weight(old, sampled, self.low, self.high)
        stats["policy/is_masked_frac"] = masked_mean((weight == 0).float(), mask)
        stats["policy/is_ratio_mean"] = masked_mean(torch.exp((old - sampled).detach().clamp(-50, 50)), mask)
        return per_token * weight, stats
