"""The typed extension point for rollout callbacks."""

from __future__ import annotations

import lightning as L

from rllight.types import Rollout


class RolloutCallback(L.Callback):
    """Base class of callbacks that see (and may change) each scored rollout before the update.

    The module calls them in order of ``rollout_order`` (then in the recipe's order), not in the order the
    recipe lists them, so that listing them differently cannot change a method: reward shaping first
    (``SoftOverlongPunishment``: 10), then loss masks (``OverlongFilter``: 20; it zeroes the masks the
    punishment reads lengths from), then callbacks that train on the rollout (``ValuePretraining``: 30,
    which consumes it while it pretrains), then those that store it (``SelfImitation``: 40). A callback of
    your own runs after these unless it sets a smaller ``rollout_order``.
    """

    rollout_order: int = 100

    def on_rollout(self, trainer: L.Trainer, module: L.LightningModule, rollout: Rollout) -> Rollout | None:
        """Return the rollout to train on (the same object, changed, or a new one), or None when the
        callback has used it itself and this step makes no policy update (e.g. value pretraining).

        Scalars put in ``rollout.extras`` are logged as ``train/<key>``. Rows can be dropped with
        ``rollout.select(index)``, and tokens kept out of the loss by zeroing ``response_mask``.
        """
        return rollout


def in_rollout_order(callbacks: list) -> list[RolloutCallback]:
    """The rollout callbacks among ``callbacks`` (those with ``on_rollout``) in ``rollout_order``; equal orders
    keep the recipe's order."""
    rollout_callbacks = [cb for cb in callbacks if hasattr(cb, "on_rollout")]
    return sorted(rollout_callbacks, key=lambda cb: getattr(cb, "rollout_order", 100))
