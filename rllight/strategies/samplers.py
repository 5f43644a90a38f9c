"""Samplers decide which responses make up a rollout."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rllight.errors import RecipeError
from rllight.types import Rollout

if TYPE_CHECKING:
    from rllight.rollout.producer import RolloutProducer


class Sampler:
    """Base class: ``__call__(producer, rows) -> Rollout`` for a batch of prompt rows.

    ``producer.sample(rows, n)`` samples ``n`` responses per row and scores them; ``producer.more_prompts(n)``
    draws further training rows (the datamodule's stream) when a step needs more than its batch.
    """

    def __call__(self, producer: RolloutProducer, rows: list[dict]) -> Rollout:
        raise NotImplementedError

    def prefetch(self, producer: RolloutProducer, rows: list[dict]) -> None:
        """Ask the engine to start on a later step's ``rows`` now (asynchronous rollouts, see
        ``rllight.rollout.worker``): the first ``producer.sample`` that step makes then finds its responses
        ready. The default asks for ``group_size`` responses per row, which is the first call of every sampler
        here; a sampler whose first call differs overrides it (a request nobody collects is dropped)."""
        n = getattr(self, "group_size", None)
        if n:
            producer.prefetch(rows, n)


class GroupSampler(Sampler):
    """``group_size`` responses per prompt (GRPO's G), tied by ``group_ids``.

    Args:
        group_size: Responses per prompt (1 for PPO / SPPO-style single samples).
    """

    def __init__(self, group_size: int = 4):
        if group_size < 1:
            raise RecipeError(f"model.sampler.init_args.group_size must be >= 1, got {group_size}")
        self.group_size = group_size

    def __call__(self, producer: RolloutProducer, rows: list[dict]) -> Rollout:
        return producer.sample(rows, self.group_size)
