"""The stream of extra training prompts that samplers draw beyond a step's batch (e.g. dynamic sampling)."""

from __future__ import annotations

import torch


class PromptStream:
    """A seeded stream over the training rows, independent of the dataloader's order: a fresh permutation
    per pass, derived from the position alone, so a checkpoint only needs ``cursor``. Under DDP each rank
    takes every ``world``-th row from its own offset ``rank``, so ranks never draw the same extra prompts.
    """

    def __init__(self, rows: list[dict], seed: int = 1234, world: int = 1, rank: int = 0):
        if not rows:
            raise ValueError("PromptStream needs at least one row")
        self.rows = rows
        self.seed = seed
        self.world = world
        self.rank = rank
        self.cursor = 0  # rows drawn so far by this rank
        self._epoch = -1
        self._order: list[int] = []

    def draw(self, n: int) -> list[dict]:
        out = []
        for _ in range(n):
            epoch, position = divmod(self.cursor * self.world + self.rank, len(self.rows))
            if epoch != self._epoch:
                g = torch.Generator().manual_seed(self.seed + epoch)
                self._order = torch.randperm(len(self.rows), generator=g).tolist()
                self._epoch = epoch
            out.append(self.rows[self._order[position]])
            self.cursor += 1
        return out

    def state_dict(self) -> dict[str, int]:
        """The position: the order of every pass follows from it."""
        return {"cursor": self.cursor}

    def load_state_dict(self, state: dict) -> None:
        self.cursor = state.get("cursor", 0)
