"""Collectives over the training processes, in the few shapes an RL step needs them."""

from __future__ import annotations

import torch
from torch import Tensor

from rllight.errors import RecipeError


def share(total: int, world: int, name: str) -> int:
    """Each process's share of a size given for all ``world`` processes together (``name`` is the recipe key,
    for the error when it does not divide)."""
    if total % world:
        raise RecipeError(f"{name}={total} is a total over all {world} training processes (trainer.devices x "
                          f"trainer.num_nodes) and must divide among them; use a multiple of {world}")
    return total // world


def process_rank_and_world() -> tuple[int, int]:
    """This process's rank and the number of processes of the run's process group (0 and 1 outside one); for
    code that has no trainer at hand (an engine, an evaluation)."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class Ranks:
    """Sums and maxima over the ranks of a run (the identity on one process). Every method is a collective
    where there are several ranks: every rank must call it, in the same order.

    Args:
        trainer: The Lightning trainer whose strategy reduces (None = one process, e.g. a module used outside
            a run).
    """

    def __init__(self, trainer=None):
        self.world_size = trainer.world_size if trainer is not None else 1
        self.rank = trainer.global_rank if trainer is not None else 0
        self._strategy = trainer.strategy if trainer is not None else None

    def reduce(self, value: Tensor, op: str = "sum") -> Tensor:
        """``value`` summed (or ``op``: max, mean) over ranks."""
        if self.world_size > 1:
            return self._strategy.reduce(value, reduce_op=op)
        return value

    def any(self, flag: bool) -> bool:
        """Whether ``flag`` holds on any rank."""
        return bool(self.reduce(torch.tensor(float(flag)), op="max").item() > 0)

    def sum(self, value: Tensor | float) -> Tensor:
        """The sum of a tensor or number over ranks, as a float32 CPU tensor (e.g. for a decision that all ranks
        must take alike)."""
        return self.reduce(torch.as_tensor(value, dtype=torch.float32).detach().cpu())

    def gather(self, value: float) -> list[float]:
        """Every rank's ``value``, in rank order."""
        slots = torch.zeros(self.world_size, dtype=torch.float64)
        slots[self.rank] = value
        return self.reduce(slots).tolist()

    def sum_gradients(self, params: list[torch.nn.Parameter]) -> None:
        """Sum the gradients of ``params`` over ranks (a rank without one adds zeros); a parameter that no rank
        has a gradient for keeps none, as on one process. Backward passes run outside DDP's reducer
        (``rllight._compat.no_gradient_sync``), so this is the one place gradients meet."""
        from rllight.fsdp import is_dtensor

        params = [p for p in params if not is_dtensor(p)]  # FSDP's shards: its backward summed them already
        if self.world_size <= 1 or not params:
            return
        has = self.reduce(torch.tensor([float(p.grad is not None) for p in params]))
        live = [p for p, h in zip(params, has.tolist()) if h > 0]
        if not live:
            return
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in live]
        flat = self.reduce(torch._utils._flatten_dense_tensors(grads))
        for p, g in zip(live, torch._utils._unflatten_dense_tensors(flat, grads)):
            p.grad = g.view_as(p).clone()
