"""Rollout callbacks (``rllight.callbacks``): Lightning callbacks with one extra hook,
``on_rollout(trainer, context, rollout) -> rollout``, called after rewards and before values and
advantages; ``context`` (``RolloutContext``) is what a callback may use of the run. A callback keeps its own
state in ``state_dict()`` so that resume restores it."""

from rllight.callbacks.base import RolloutCallback, RolloutContext

__all__ = ["RolloutCallback", "RolloutContext"]

from rllight.callbacks.distillation import Teacher, TeacherLogprobs  # noqa: E402
from rllight.callbacks.overlong import OverlongFilter, SoftOverlongPunishment  # noqa: E402
from rllight.callbacks.replay import SelfImitation  # noqa: E402
from rllight.callbacks.reward_guard import RewardHackingGuard  # noqa: E402
from rllight.callbacks.value_pretraining import ValuePretraining  # noqa: E402

__all__ += ["OverlongFilter", "RewardHackingGuard", "SelfImitation", "SoftOverlongPunishment", "Teacher",
            "TeacherLogprobs", "ValuePretraining"]
