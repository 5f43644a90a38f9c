"""Rollout callbacks (``rllight.callbacks``): Lightning callbacks with one extra hook,
``on_rollout(trainer, module, rollout) -> rollout``, called after rewards and before values and
advantages. A callback keeps its own state in ``state_dict()`` so that resume restores it."""

from rllight.callbacks.base import RolloutCallback

__all__ = ["RolloutCallback"]

from rllight.callbacks.overlong import OverlongFilter, SoftOverlongPunishment  # noqa: E402
from rllight.callbacks.replay import SelfImitation  # noqa: E402
from rllight.callbacks.value_pretraining import ValuePretraining  # noqa: E402

__all__ += ["OverlongFilter", "SelfImitation", "SoftOverlongPunishment", "ValuePretraining"]
