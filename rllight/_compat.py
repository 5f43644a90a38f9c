"""The few places where rllight reaches into Lightning's or PyTorch's internals, each with why."""

from __future__ import annotations

import contextlib

import lightning as L
from torch.nn.parallel import DistributedDataParallel


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
