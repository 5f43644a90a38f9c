"""The few places where rllight reaches into Lightning's or PyTorch's internals, each with why."""

from __future__ import annotations

import contextlib
import logging
import os
import warnings

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.nn.parallel import DistributedDataParallel

log = logging.getLogger(__name__)


def forget_step_metrics(trainer: L.Trainer) -> None:
    """Drop the step-level values Lightning keeps for the epoch (``trainer._results``). Lightning sends the
    last value of each step metric to the logger again at every later step, so a metric logged on some
    steps only (replay, value pretraining, critic-only updates) would show stale repeats;
    ``trainer.callback_metrics`` keeps them."""
    results = getattr(trainer, "_results", None)
    if results is not None:
        results.reset(metrics=False)


def no_gradient_sync(trainer: L.Trainer | None):
    """A context in which backward passes leave DDP's reducer out (``DistributedDataParallel.no_sync``).

    rllight sums gradients over ranks itself, once per optimizer update (``rllight.distributed.Ranks.sum_gradients``):
    updates that train only part of the model (the critic alone, a replay NLL) or ranks with no rows in a
    minibatch would otherwise leave DDP waiting for gradients that never come. Elsewhere: no effect."""
    model = getattr(getattr(trainer, "strategy", None), "model", None) if trainer is not None else None
    if isinstance(model, DistributedDataParallel):
        return model.no_sync()
    return contextlib.nullcontext()


def plain_instance(obj):
    """A default made with ``jsonargparse.lazy_instance`` as a plain instance of its class (others unchanged).

    A lazy instance is one object shared by every call that takes the default, of a generated class that
    cannot be pickled: a reward must be sent to worker processes, and a reward runner holds processes of
    its own, so each module gets its own plain instance."""
    lazy_type = getattr(obj, "_lazy_class_type", None)
    if lazy_type is None or not hasattr(obj, "lazy_get_init_args"):
        return obj
    return lazy_type(**dict(obj._lazy_kwargs))


class RunCheckpoint(ModelCheckpoint):
    """Lightning's ``ModelCheckpoint``, which also saves ``last.ckpt`` at the run's last step when that is not a
    multiple of ``every_n_train_steps`` (Lightning's own ``on_train_end`` saves it only when no checkpoint was
    saved at all: a 12-step run checkpointed every 10 ended with step 10 in ``last.ckpt``). A failure of that
    final save (a full disk) is one logged line, not the end of the run: the export that follows still runs, and
    the previous ``last.ckpt`` stays whole (``rllight.checkpoint.AtomicCheckpointIO``). Reads the callback's
    ``_last_global_step_saved`` and calls its ``_save_last_checkpoint`` (Lightning 2.5 and 2.6)."""

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not self.save_last or self._last_global_step_saved == trainer.global_step:
            return super().on_train_end(trainer, pl_module)
        try:
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))
        except OSError as err:
            where = os.path.join(self.dirpath or "", "last.ckpt")
            log.error("could not save the final checkpoint %s (%s); the run goes on to its export, and the last "
                      "checkpoint saved before (step %d) is intact", where, err, self._last_global_step_saved)


def resolve_last_checkpoint(trainer: L.Trainer) -> str | None:
    """The checkpoint ``--ckpt_path last`` resumes from, found as Lightning finds it (None: there is none, where
    Lightning would warn and train from scratch). Calls ``_CheckpointConnector._parse_ckpt_path`` (Lightning 2.5 and
    2.6) with its warning silenced: the caller makes it an error."""
    from lightning.pytorch.trainer.states import TrainerFn

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return trainer._checkpoint_connector._parse_ckpt_path(TrainerFn.FITTING, "last", model_provided=True,
                                                              model_connected=False)
