"""The typed extension point for rollout callbacks."""

from __future__ import annotations

from typing import TYPE_CHECKING

import lightning as L

from rllight.types import Rollout

if TYPE_CHECKING:
    from rllight.module import RLModule


class RolloutCallback(L.Callback):
    """Base class of callbacks that see (and may change) each scored rollout before the update."""

    def on_rollout(self, trainer: L.Trainer, module: RLModule, rollout: Rollout) -> Rollout:
        """Return the rollout to train on (the same object, changed, or a new one)."""
        return rollout
