"""The training rows' order: a seeded permutation per epoch, dealt out to the training processes, resumable."""

from __future__ import annotations

from collections.abc import Callable

import torch


class ResumableSampler(torch.utils.data.DistributedSampler):
    """A fresh seeded permutation of the training rows each epoch, dealt out to the training processes, able to
    start mid-epoch.

    Each epoch takes the first ``epoch_rows`` indices of a permutation of ``num_rows`` that depends only on
    ``(seed, epoch)``; process ``rank`` of ``world`` gets every ``world``-th of them, from its ``rank``-th on (so
    consecutive batches of ``b`` rows on each process together make consecutive global batches of ``b x world``
    rows, with no row twice). ``start_at(n)`` skips the first ``n`` rows of this process's stream; given a function,
    each iterator starts where it says when the iterator starts (the datamodule's trained batches). A run resumed
    after ``k`` trained batches therefore sees exactly the rows an uninterrupted run would: the trained-batch
    count decides where it resumes, not the dataloader's prefetching, nor where Lightning's loop counts an epoch's
    end (resumed from a checkpoint saved at an epoch's end, with validation off, Lightning trains one batch in the
    epoch it restores and then asks for a new iterator: it goes on with the next batch, not the next epoch).

    It is a ``DistributedSampler`` so that Lightning uses it as it is under several processes (it would wrap
    any other sampler in one that splits its stream again); the split is its own.
    """

    def __init__(self, num_rows: int, epoch_rows: int, seed: int, rank: int = 0, world: int = 1):
        self.num_rows = num_rows
        self.epoch_rows = epoch_rows  # over all processes; a multiple of world
        self.seed = seed
        self.rank = rank
        self.world = self.num_replicas = world  # num_replicas: the name DistributedSampler's readers know
        self.shuffle = False  # the order is this class's own; nothing is to shuffle it again
        self.skip: int | Callable[[], int] = 0  # rows of this process's stream already consumed by training

    def start_at(self, rows_consumed: int | Callable[[], int]) -> None:
        """Where the next iterator starts: after ``rows_consumed`` rows of this process's stream (the iterator after
        it starts the next epoch), or, given a function, after as many as it returns as each iterator starts."""
        self.skip = rows_consumed

    def set_epoch(self, epoch: int) -> None:
        """Lightning's per-epoch call: nothing to do, the stream counts its own epochs."""

    def order(self, epoch: int) -> list[int]:
        """The row indices this process gets in epoch ``epoch``."""
        g = torch.Generator().manual_seed(self.seed + epoch)
        return torch.randperm(self.num_rows, generator=g)[: self.epoch_rows][self.rank :: self.world].tolist()

    def __iter__(self):
        epoch, offset = divmod(self.skip() if callable(self.skip) else self.skip, len(self))
        order = self.order(epoch)
        if not callable(self.skip):
            self.skip = (epoch + 1) * len(self)  # the next iterator starts the next epoch
        yield from order[offset:]

    def __len__(self) -> int:
        # A full epoch, also when resuming mid-epoch: Lightning's restored batch counter then reaches the
        # epoch's end exactly when this iterator runs out.
        return self.epoch_rows // self.world
