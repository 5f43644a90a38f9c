"""Advantages of the critic-free baselines researchers compare against: RLOO, ReMax, REINFORCE++.

Shapes: B responses, T response columns; ``response_mask`` (B, T) marks the valid response tokens and
``group_ids`` (B,) ties the responses sampled for one prompt.
"""

from __future__ import annotations

import torch
from torch import Tensor

from rllight.algorithms.advantages import discounted_cumsum, group_index, group_sum
from rllight.algorithms.kl import masked_whiten

__all__ = ["rloo", "remax", "reinforce_pp"]


def rloo(rewards: Tensor, group_ids: Tensor) -> Tensor:
    """REINFORCE leave-one-out (Ahmadian et al., "Back to Basics", arXiv:2402.14740; Kool et al., 2019).

    ``A_i = R_i - mean of the other G - 1 rewards of its group``, which equals
    ``G / (G - 1) * (R_i - mean_g)``: the baseline of a sample does not depend on the sample itself, so
    the gradient estimate stays unbiased. A group of one sample has no baseline and gets 0.

    Args:
        rewards: Shape (B,).
        group_ids: Shape (B,), any integer labels; equal labels form a group.

    Returns:
        Shape (B,).
    """
    r, inverse, sizes = group_index(rewards, group_ids)
    sums = group_sum(r, inverse, sizes.shape[0])
    n = sizes[inverse]
    others = (sums[inverse] - r) / (n - 1).clamp(min=1)
    return torch.where(n > 1, r - others, torch.zeros_like(r))


def remax(rewards: Tensor, greedy_rewards: Tensor) -> Tensor:
    """ReMax (Li et al., arXiv:2310.10505): the baseline is the reward of the greedy response to the
    same prompt, ``A_i = R_i - R(greedy_i)``.

    Args:
        rewards: Shape (B,), of the sampled responses.
        greedy_rewards: Shape (B,), of the greedy response of each row's prompt.

    Returns:
        Shape (B,).
    """
    return rewards - greedy_rewards.to(rewards.dtype)


def reinforce_pp(token_rewards: Tensor, response_mask: Tensor, gamma: float = 1.0,
                 total=None) -> tuple[Tensor, Tensor]:
    """REINFORCE++ (Hu et al., arXiv:2501.03262): discounted returns of the token rewards (the outcome
    reward on the last token, minus the KL penalty on every token when it is in the reward),
    ``G_t = sum_l gamma^l r_{t+l}``, whitened over all valid tokens of the batch. No critic and no group:
    the batch statistics are the baseline.

    Args:
        token_rewards: Shape (B, T).
        response_mask: Shape (B, T).
        gamma: Discount.
        total: Sums over the training processes, for whitening over the global batch (``masked_whiten``).

    Returns:
        ``(advantages, returns)``, each shape (B, T), zero outside ``response_mask``.
    """
    valid = response_mask.bool()
    r = torch.where(valid, token_rewards, token_rewards.new_zeros(()))
    decay = torch.full((r.shape[0],), float(gamma), dtype=r.dtype, device=r.device)
    returns = discounted_cumsum(r, decay) * valid.to(r.dtype)
    return masked_whiten(returns, response_mask, total=total), returns
