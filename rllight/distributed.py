"""Collectives over the training processes, in the few shapes an RL step needs them."""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import Tensor

from rllight.algorithms.batching import deal_groups
from rllight.errors import RecipeError
from rllight.types import Rollout


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

    def gather_objects(self, obj) -> list:
        """Every rank's ``obj`` (picklable), in rank order."""
        if self.world_size <= 1:
            return [obj]
        out = [None] * self.world_size
        torch.distributed.all_gather_object(out, obj)
        return out

    def send(self, obj, dst: int) -> None:
        """Send ``obj`` (picklable, its tensors on the CPU) to rank ``dst``, which ``recv``s it."""
        torch.distributed.send_object_list([obj], dst)

    def recv(self, src: int):
        """What rank ``src`` ``send``s to this rank."""
        box = [None]
        torch.distributed.recv_object_list(box, src)
        return box[0]

    def exchange(self, moves: list[tuple[int, int]], outgoing: dict[int, object]) -> dict[int, object]:
        """For each ``(src, dst)`` of ``moves`` (the same list on every rank), ``src`` sends ``outgoing[dst]`` to
        ``dst``; returns what this rank received, by source. The transfers block and run in the list's order, so
        the first one not yet done always has both its ranks at it: no rank waits forever."""
        received = {}
        for src, dst in moves:
            if src == self.rank:
                self.send(outgoing[dst], dst)
            elif dst == self.rank:
                received[src] = self.recv(src)
        return received

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


def deal_rollout(rollout: Rollout, ranks: Ranks, pad_id: int) -> Rollout:
    """This rank's share of the step's groups, dealt evenly to the ranks (``rllight.algorithms.deal_groups``): whole
    groups (rows with one ``group_ids`` value), so that the ranks differ by at most one group of G and each makes
    the same share of the updates whichever rank drew the groups (DAPO's dynamic sampling keeps them in rank
    order). One process, or ranks that already hold even shares, keep ``rollout`` itself.

    A collective: every rank calls it, a rank with an empty rollout too. The moved rows travel point to point
    (``Ranks.exchange``, on the CPU) with their per-row extras; each rank keeps its own scalar extras (its
    sampling counts, timings: its own ledger). Group ids are renumbered per source so that groups of two ranks
    never share one. A group's rows move together before any advantage is computed, so group statistics are
    those of the rows as sampled; batch statistics over all ranks (``AdvantageEstimator.total``) do not change.
    """
    if ranks.world_size <= 1:
        return rollout
    ids = rollout.group_ids.tolist()
    groups: dict[int, list[int]] = {}  # group id -> its rows, in order of first appearance
    for row, gid in enumerate(ids):
        groups.setdefault(gid, []).append(row)
    rows = list(groups.values())
    sizes = ranks.gather_objects([len(r) for r in rows])
    dealt = deal_groups(sizes)
    if all(picks == [(r, g) for g in range(len(sizes[r]))] for r, picks in enumerate(dealt)):
        return rollout  # already even: nothing moves
    me = ranks.rank

    def part(src: int, picks: list[tuple[int, int]]) -> Rollout:
        return rollout.select([i for s, g in picks if s == src for i in rows[g]])

    outgoing = {dst: _moved(part(me, picks), "cpu") for dst, picks in enumerate(dealt)
                if dst != me and any(s == me for s, _ in picks)}
    moves = [(src, dst) for dst, picks in enumerate(dealt) for src in sorted({s for s, _ in picks}) if src != dst]
    received = ranks.exchange(moves, outgoing)
    if dealt[me] == [(me, g) for g in range(len(rows))]:
        return rollout  # this rank neither sends nor receives
    device = rollout.response_mask.device
    parts, offset = [], 0
    for src in sorted({s for s, _ in dealt[me]}):
        p = part(me, dealt[me]) if src == me else _moved(received[src], device)
        _, local_ids = torch.unique(p.group_ids, return_inverse=True)
        parts.append(replace(p, group_ids=local_ids + offset))
        offset += int(local_ids.max()) + 1
    if not parts:
        return rollout.select([])  # fewer groups than ranks
    own = {k: v for k, v in rollout.extras.items() if not _per_row(v, len(rollout))}
    common = set.intersection(*({k for k, v in p.extras.items() if _per_row(v, len(p))} for p in parts))
    parts = [replace(p, extras={k: p.extras[k] for k in sorted(common)}) for p in parts]
    dealt_rollout = Rollout.cat(parts, pad_id=pad_id)
    return replace(dealt_rollout, extras={**own, **dealt_rollout.extras})


def _per_row(value, rows: int) -> bool:
    """Whether an extra has one entry per row (``Rollout.select`` slices it)."""
    return (isinstance(value, Tensor) and value.dim() > 0 and value.shape[0] == rows) or (
        isinstance(value, list) and len(value) == rows)


def _moved(rollout: Rollout, device: torch.device | str) -> Rollout:
    """``rollout`` with its tensors, those of its extras too, on ``device``."""
    extras = {k: v.to(device) if isinstance(v, Tensor) else v for k, v in rollout.extras.items()}
    return replace(rollout.to(device), extras=extras)
