"""DAPO's handling of over-long responses (Yu et al., arXiv:2503.14476, section 3.4) as rollout callbacks.

- ``OverlongFilter``: truncated responses keep their reward (it still enters group statistics) but
  their tokens leave the loss, so an unfinished derivation is not taught as a wrong one.
- ``SoftOverlongPunishment``: adds the length penalty R_len to the reward.

The punishment always runs before the filter, whatever their order in ``trainer.callbacks``
(``rollout_order``): the filter zeroes the truncated rows' ``response_mask``, and the punishment reads
lengths from that mask.
"""

from __future__ import annotations

import lightning as L

from rllight.algorithms.shaping import soft_overlong_punishment
from rllight.bounds import NonNegativeFloat, PositiveInt, bounded
from rllight.callbacks.base import RolloutCallback, RolloutContext
from rllight.errors import RecipeError
from rllight.types import Rollout


class OverlongFilter(RolloutCallback):
    """Mask the loss of truncated responses (DAPO's overlong filtering).

    Every token of a response that hit the generation limit without ending is removed from
    ``response_mask``; its reward is left alone, so group baselines still count it. If every response
    of the step is truncated the module skips the update (``train/guard/empty_rollouts``).

    Metrics: ``train/overlong/masked_ratio`` (share of responses masked), ``train/overlong/masked_tokens``.
    """

    rollout_order = 20

    def on_rollout(self, trainer: L.Trainer | None, context: RolloutContext | None, rollout: Rollout) -> Rollout:
        truncated = rollout.truncated.bool().to(rollout.response_mask.device)
        masked_tokens = (rollout.response_mask * truncated.unsqueeze(-1)).sum()
        rollout.response_mask = rollout.response_mask * (~truncated).unsqueeze(-1).to(rollout.response_mask.dtype)
        rollout.extras["overlong/masked_ratio"] = float(truncated.float().mean()) if len(rollout) else 0.0
        rollout.extras["overlong/masked_tokens"] = float(masked_tokens)
        return rollout


class SoftOverlongPunishment(RolloutCallback):
    """Add ``coef * R_len(L)`` to each response's reward (DAPO's soft overlong punishment):
    0 up to ``max_len - cache_len`` tokens, then a linear ramp to -1 at ``max_len``, -1 beyond
    (``rllight.algorithms.soft_overlong_punishment``). ``rollout.correct`` is unchanged, so accuracy
    metrics still measure the task.

    Metrics: ``train/overlong/penalty_mean``, ``train/overlong/penalized_ratio``.

    Args:
        cache_len: L_cache, the width of the punishment buffer (4096 in the paper).
        max_len: L_max (20480 in the paper); None = the rollout engine's ``max_new_tokens`` (``RolloutContext``).
        coef: Scale of the penalty (verl's ``overlong_penalty_factor``; 1.0 in the paper).
    """

    rollout_order = 10

    @bounded
    def __init__(self, cache_len: PositiveInt = 4096, max_len: int | None = None, coef: NonNegativeFloat = 1.0):
        if max_len is not None and max_len < cache_len:
            raise RecipeError(f"trainer.callbacks: SoftOverlongPunishment.max_len must be >= cache_len "
                              f"({cache_len}), got {max_len}")
        self.cache_len = cache_len
        self.max_len = max_len
        self.coef = coef

    def on_rollout(self, trainer: L.Trainer | None, context: RolloutContext, rollout: Rollout) -> Rollout:
        max_len = self.max_len if self.max_len is not None else context.max_new_tokens
        if max_len is None:
            raise RecipeError("trainer.callbacks: SoftOverlongPunishment.max_len is needed: the rollout engine has no "
                              "max_new_tokens")
        if max_len < self.cache_len:
            raise RecipeError(f"trainer.callbacks: SoftOverlongPunishment.cache_len ({self.cache_len}) exceeds "
                              f"the longest response ({max_len} = rollout.max_new_tokens); lower cache_len or set "
                              "max_len")
        penalty = self.coef * soft_overlong_punishment(rollout.response_lengths, max_len, self.cache_len)
        rollout.rewards = rollout.rewards + penalty.to(rollout.rewards)
        rollout.extras["overlong/penalty_mean"] = float(penalty.mean()) if len(rollout) else 0.0
        rollout.extras["overlong/penalized_ratio"] = float((penalty < 0).float().mean()) if len(rollout) else 0.0
        return rollout
