"""The KL penalty to a frozen reference policy (``model.kl``), in the loss or in the token rewards."""

from __future__ import annotations

from torch import Tensor

from rllight.algorithms import kl_penalty

__all__ = ["KLPenalty"]


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
