"""The typed extension point for rollout callbacks."""

from __future__ import annotations

from typing import TYPE_CHECKING

import lightning as L

from rllight.types import Rollout

if TYPE_CHECKING:
    from rllight.module import RLModule


class RolloutCallback(L.Callback):
    """Base class of callbacks that see (and may change) each scored rollout before the update."""

    def on_rollout(self, trainer: L.Trainer, module: RLModule, rollout: Rollout) -> Rollout | None:
        """Return the rollout to train on (the same object, changed, or a new one), or None when the
        callback has used it itself and this step makes no policy update (e.g. value pretraining).

        Scalars put in ``rollout.extras`` are logged as ``train/<key>``. Rows can be dropped with
        ``rollout.select(index)``, and tokens kept out of the loss by zeroing ``response_mask``.
        """
        return rollout
