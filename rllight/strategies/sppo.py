"""SPPO (Wang et al., "SPPO: Sequence-Level PPO for Long-Horizon Reasoning Tasks", arXiv:2604.08865):
a scalar prompt critic gives the baseline, one advantage per response, and the PPO clip acts on the
sum of the token ratios of a response. The critic is ``rllight.critics.PromptCritic``."""

from __future__ import annotations

import torch
from torch import Tensor

from rllight.algorithms import sequence_clipped_surrogate
from rllight.errors import RecipeError
from rllight.strategies.advantages import AdvantageEstimator
from rllight.strategies.losses import PolicyLoss, check_clip_range
from rllight.types import Rollout

__all__ = ["PromptBaseline", "SequenceClippedSurrogate"]

_NORMALIZE = ("none", "batch_std", "bernoulli")


class PromptBaseline(AdvantageEstimator):
    """SPPO's sequence-level advantage ``A = (R - V(prompt)) / sigma``, broadcast over every response
    token. ``V`` comes from a prompt-level critic (``rllight.critics.PromptCritic``, values (B,)).

    ``sigma`` by ``normalize``:
        ``none``: 1 (the note's simplified form, ``A = R - V``);
        ``batch_std``: the std of ``R - V`` over the rollout (unbiased), plus ``eps``;
        ``bernoulli``: ``sqrt(V (1 - V))``, the std of a Bernoulli outcome of success probability V;
        it is floored at ``min_sigma`` so that a confident critic cannot blow the advantage up (the
        floor is ours, not the paper's).

    Returns no value targets: the critic is fitted to the rewards themselves. Reads the outcome reward
    only, so a KL penalty belongs in the loss (``model.kl.in_reward: false``).

    Args:
        normalize: none, batch_std or bernoulli.
        min_sigma: Floor of the Bernoulli sigma.
        eps: Added to the batch std.
    """

    needs_values = True

    def __init__(self, normalize: str = "none", min_sigma: float = 0.05, eps: float = 1e-6):
        if normalize not in _NORMALIZE:
            raise RecipeError(f"model.advantage.normalize: '{normalize}' is not one of {', '.join(_NORMALIZE)}")
        if min_sigma <= 0:
            raise RecipeError(f"model.advantage.min_sigma must be > 0, got {min_sigma}")
        self.normalize = normalize
        self.min_sigma = min_sigma
        self.eps = eps

    def __call__(self, rollout: Rollout) -> tuple[Tensor, None]:
        values = rollout.values
        if values is None or values.dim() != 1:
            raise RecipeError("model.critic: PromptBaseline needs a prompt-level critic with one value per response "
                              "(class_path: rllight.critics.PromptCritic)")
        adv = rollout.rewards.to(values.dtype) - values
        if self.normalize == "batch_std":
            total = self.total or (lambda t: t)  # the global batch's standard deviation
            n, s1, s2 = total(torch.stack([adv.new_tensor(float(adv.numel())), adv.sum(), (adv * adv).sum()]))
            std = ((s2 - s1 * s1 / n.clamp(min=1)) / (n - 1).clamp(min=1)).clamp(min=0).sqrt() if n > 1 else n * 0
            adv = adv / (std + self.eps)
        elif self.normalize == "bernoulli":
            adv = adv / torch.sqrt(values * (1.0 - values)).clamp(min=self.min_sigma)
        return adv.unsqueeze(-1) * rollout.response_mask.to(adv.dtype), None


class SequenceClippedSurrogate(PolicyLoss):
    """SPPO's sequence-level clipped objective, one loss per response (shape (B,)):
    ``-min(sum_t r_t A, sum_t clip(r_t, 1 - clip_low, 1 + clip_high) A)`` (see
    ``rllight.algorithms.sequence_clipped_surrogate``). Being per sequence, it is averaged over
    responses whatever the recipe's aggregation.

    Logged: ``policy/clipfrac_low`` / ``policy/clipfrac_high``, the fraction of responses whose clipped
    sum was the smaller one (so the clip acted) with A < 0 / A > 0.

    Args:
        clip_low: epsilon below 1.
        clip_high: epsilon above 1.
    """

    def __init__(self, clip_low: float = 0.2, clip_high: float = 0.2):
        check_clip_range(clip_low, clip_high)
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
