"""Policy objectives (per token) and how they are aggregated (separate choices)."""

from __future__ import annotations

from torch import Tensor

from rllight.algorithms import aggregate, clip_fractions, clipped_surrogate, kl_penalty
from rllight.errors import RecipeError
from rllight.types import Rollout


def check_clip_range(clip_low: float, clip_high: float) -> None:
    """One-line errors for a clip range ``[1 - clip_low, 1 + clip_high]`` that cannot work."""
    if not 0 < clip_low < 1:
        raise RecipeError(f"model.policy_loss.clip_low must be in (0, 1), got {clip_low}")
    if clip_high <= 0:
        raise RecipeError(f"model.policy_loss.clip_high must be > 0, got {clip_high}")


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

    def __init__(self, clip_low: float = 0.2, clip_high: float = 0.2, dual_clip: float | None = None):
        check_clip_range(clip_low, clip_high)
        if dual_clip is not None and not dual_clip > 1:
            raise RecipeError(f"model.policy_loss.dual_clip must be > 1 (it bounds the loss at -c A) or null, "
                              f"got {dual_clip}")
        self.clip_low = clip_low
        self.clip_high = clip_high
        self.dual_clip = dual_clip

    def __call__(self, logprobs: Tensor, batch: Rollout) -> tuple[Tensor, dict[str, Tensor]]:
        loss = clipped_surrogate(logprobs, batch.old_logprobs, batch.advantages, self.clip_low, self.clip_high,
                                 self.dual_clip)
        low, high = clip_fractions(logprobs.detach(), batch.old_logprobs, batch.advantages, batch.response_mask,
                                   self.clip_low, self.clip_high)
        return loss, {"policy/clipfrac_low": low, "policy/clipfrac_high": high}


class Aggregation:
    """How per-token losses become one number; see ``rllight.algorithms.aggregate`` for the modes.

    ``num_tokens`` / ``num_seqs`` are the global counts of the optimizer step (all micro-batches, all ranks).
    """

    mode = "token-mean"

    def __init__(self, max_len: int | None = None):
        self.max_len = max_len

    def __call__(self, per_token: Tensor, response_mask: Tensor, num_tokens: Tensor | float | None = None,
                 num_seqs: Tensor | float | None = None) -> Tensor:
        return aggregate(per_token, response_mask, self.mode, num_tokens=num_tokens, max_len=self.max_len,
                         num_seqs=num_seqs)


class TokenMean(Aggregation):
    """Every valid token of the optimizer step weighs the same (DAPO's token-level loss)."""

    mode = "token-mean"

    def __init__(self):
        super().__init__()


class SeqMeanTokenMean(Aggregation):
    """Mean over each response, then over responses (GRPO as published)."""

    mode = "seq-mean-token-mean"

    def __init__(self):
        super().__init__()


class SeqMeanTokenSum(Aggregation):
    """Sum over each response, then mean over responses."""

    mode = "seq-mean-token-sum"

    def __init__(self):
        super().__init__()


class SeqMeanTokenSumNorm(Aggregation):
    """Sum over each response divided by a constant, then mean over responses (Dr. GRPO).

    Args:
        max_len: The constant; default the response width T of the batch. Set it to
            ``rollout.max_new_tokens`` for one constant across batches, as the paper does.
    """

    mode = "seq-mean-token-sum-norm"

    def __init__(self, max_len: int | None = None):
        super().__init__(max_len=max_len)


class KLPenalty:
    """KL to a frozen reference policy, in the loss or in the reward.

    Args:
        coef: Weight beta.
        kind: Estimator: k1, k2 or k3 (GRPO's low-variance estimator).
        in_reward: Subtract ``coef * KL`` from the token rewards (PPO-RLHF style) instead of adding
            ``coef * KL`` to the loss.
    """

    def __init__(self, coef: float = 0.001, kind: str = "k3", in_reward: bool = False):
        kl_penalty(Tensor([0.0]), Tensor([0.0]), kind)  # fail at construction on an unknown kind
        self.coef = coef
        self.kind = kind
        self.in_reward = in_reward

    def __call__(self, logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
        """Per-token KL estimate, shape (B, T)."""
        return kl_penalty(logprobs, ref_logprobs, self.kind)
