"""Lambda schedules: the GAE lambda of each sequence, ``DecoupledGAE``'s ``policy_lambda`` (VAPO,
arXiv:2504.05118): ``FixedLambda``, ``AdaptiveLambda`` (VAPO note 000, eq. 7) and ``VAPOLambda`` (the paper's
``1 - 1 / (alpha L)``). Swapping one for another is a one-line ablation."""

from __future__ import annotations

from torch import Tensor

from rllight.algorithms.lambdas import adaptive_lambda, vapo_lambda
from rllight.bounds import ClosedUnitInterval, PositiveFloat, bounded
from rllight.errors import RecipeError

__all__ = ["AdaptiveLambda", "FixedLambda", "LambdaSchedule", "VAPOLambda"]


class LambdaSchedule:
    """Base class: ``__call__(lengths (B,)) -> lambda``, a float or one lambda per sequence (B,)."""

    total = None
    """Sums over the training processes, set by the estimator (None = one process): a schedule that normalises
    lengths over the batch uses it, so that the batch is the global one."""

    def __call__(self, lengths: Tensor) -> float | Tensor:
        raise NotImplementedError


class FixedLambda(LambdaSchedule):
    """The same lambda for every sequence (PPO; VAPO's "fixed lambda" ablation).

    Args:
        lam: GAE lambda in [0, 1].
    """

    @bounded
    def __init__(self, lam: ClosedUnitInterval = 0.95):
        self.lam = lam

    def __call__(self, lengths: Tensor) -> float:
        return self.lam


class AdaptiveLambda(LambdaSchedule):
    """``lam_min + (lam_max - lam_min) * sigmoid((L - mean_L) / max(std_L, 1))`` over the batch's
    response lengths (VAPO note 000, eq. 7; ``rllight.algorithms.adaptive_lambda``).

    Args:
        lam_min: Lambda of the shortest responses (0.3 in the note).
        lam_max: Lambda of the longest responses (0.95 in the note).
    """

    @bounded
    def __init__(self, lam_min: ClosedUnitInterval = 0.3, lam_max: ClosedUnitInterval = 0.95):
        if not lam_min <= lam_max:
            raise RecipeError(f"model.advantage.policy_lambda: need lam_min <= lam_max, got lam_min={lam_min}, "
                              f"lam_max={lam_max}")
        self.lam_min = lam_min
        self.lam_max = lam_max

    def __call__(self, lengths: Tensor) -> Tensor:
        return adaptive_lambda(lengths, self.lam_min, self.lam_max, total=self.total)


class VAPOLambda(LambdaSchedule):
    """``1 - 1 / (alpha L)``, clamped at 0 below ``L = 1 / alpha`` (VAPO paper, arXiv:2504.05118, as
    NeMo-RL ships it; ``rllight.algorithms.vapo_lambda``).

    Args:
        alpha: 0.05 in the paper (lambda 0.8 at 100 tokens, 0.98 at 1000).
    """

    @bounded
    def __init__(self, alpha: PositiveFloat = 0.05):
        self.alpha = alpha

    def __call__(self, lengths: Tensor) -> Tensor:
        return vapo_lambda(lengths, self.alpha)
