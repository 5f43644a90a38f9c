"""Sharded tensors (FSDP2's ``DTensor``) read as plain ones: what rollout engines need of ``rllight.fsdp``,
without importing Lightning (a rollout worker process would pay seconds for it)."""

from __future__ import annotations

from typing import Any

from torch import Tensor


def full_tensor(value: Tensor) -> Tensor:
    """A parameter or gradient as one full tensor (gathered from the ranks when it is sharded: a collective)."""
    from torch.distributed.tensor import DTensor

    return value.full_tensor() if isinstance(value, DTensor) else value


def is_dtensor(value: Any) -> bool:
    """Whether ``value`` is a sharded ``DTensor``."""
    from torch.distributed.tensor import DTensor

    return isinstance(value, DTensor)


__all__ = ["full_tensor", "is_dtensor"]
