"""Advantage estimators: each maps a scored Rollout to ``(advantages, returns)``, both (B, T)."""

from __future__ import annotations

from torch import Tensor

from rllight.algorithms import gae, group_relative, masked_whiten
from rllight.errors import RecipeError
from rllight.types import Rollout


class AdvantageEstimator:
    """Base class. Subclass it in your own module and select it with ``class_path`` in a recipe.

    ``needs_values`` tells the module to run the critic before calling the estimator;
    ``uses_token_rewards`` says that it reads ``rollout.token_rewards`` (where a KL penalty in the
    reward lands) rather than only the outcome ``rollout.rewards``; ``min_group_size`` is the smallest
    number of responses per prompt it can learn from (group baselines: 2, since a group of one has
    advantage 0), checked against the sampler's ``group_size`` when the recipe is built; ``gamma`` is the discount
    of the token rewards (1.0 for estimators without one), which value pretraining's Monte-Carlo returns use.
    """

    needs_values: bool = False
    uses_token_rewards: bool = False
    min_group_size: int = 1
    gamma: float = 1.0
    total = None
    """Sums a tensor over the training processes, set by the module (None = one process): batch statistics such
    as whitening's use it so that they are the global batch's, and every rank calls the estimator (an empty
    rollout too)."""

    def __call__(self, rollout: Rollout) -> tuple[Tensor, Tensor | None]:
        """``(advantages (B, T), returns (B, T) or None)``, zero outside ``rollout.response_mask``."""
        raise NotImplementedError


class GAE(AdvantageEstimator):
    """PPO's generalised advantage estimation (arXiv:1506.02438) on token rewards and critic values;
    returns (value targets) are ``advantages + values``.

    Args:
        gamma: Discount.
        lam: GAE lambda.
        whiten: Normalise advantages over the batch's valid tokens (as PPO implementations do).
    """

    needs_values = True
    uses_token_rewards = True

    def __init__(self, gamma: float = 1.0, lam: float = 0.95, whiten: bool = True):
        for name, value in (("gamma", gamma), ("lam", lam)):
            if not 0 <= value <= 1:
                raise RecipeError(f"model.advantage.init_args.{name} must be in [0, 1], got {value}")
        self.gamma = gamma
        self.lam = lam
        self.whiten = whiten

    def __call__(self, rollout: Rollout) -> tuple[Tensor, Tensor]:
        if rollout.values is None:
            raise RecipeError("model.advantage: GAE needs a critic; set model.critic (e.g. rllight.critics.ValueHead)")
        advantages, returns = gae(rollout.token_rewards, rollout.values, rollout.response_mask, self.gamma, self.lam)
        if self.whiten:
            advantages = masked_whiten(advantages, rollout.response_mask, total=self.total)
        return advantages, returns


class GroupRelative(AdvantageEstimator):
    """GRPO's group-relative advantage (arXiv:2402.03300), or Dr. GRPO's (arXiv:2503.20783) with
    ``scale_by_std: false``, broadcast to every token of the response.

    Args:
        scale_by_std: Divide by the group's (unbiased) reward std.
        eps: Added to the std.
    """

    min_group_size = 2

    def __init__(self, scale_by_std: bool = True, eps: float = 1e-6):
        self.scale_by_std = scale_by_std
        self.eps = eps

    def __call__(self, rollout: Rollout) -> tuple[Tensor, None]:
        adv = group_relative(rollout.rewards, rollout.group_ids, self.scale_by_std, self.eps)
        return adv.unsqueeze(-1) * rollout.response_mask.to(adv.dtype), None
