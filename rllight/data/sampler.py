"""The training rows' order: a seeded permutation per epoch, dealt out to the training processes, resumable."""

from __future__ import annotations

import torch


class ResumableSampler(torch.utils.data.DistributedSampler):
    """A fresh seeded permutation of the training rows each epoch, dealt out to the training processes, able to
    start mid-epoch.

    Each epoch takes the first ``epoch_rows`` indices of a permutation of ``num_rows`` that depends only on
    ``(seed, epoch)``; process ``rank`` of ``world`` gets every ``world``-th of them, from its ``rank``-th on (so
    consecutive batches of ``b`` rows on each process together make consecutive global batches of ``b x world``
    rows, with no row twice). ``start_at(n)`` skips the first ``n`` rows of this process's stream. A run resumed
    after ``k`` trained batches therefore sees exactly the rows an uninterrupted run would: the trained-batch
    count decides where it resumes, not the dataloader's prefetching.

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
        self.skip = 0  # rows of this process's stream already consumed by training

    def start_at(self, rows_consumed: int) -> None:
        self.skip = rows_consumed

    def set_epoch(self, epoch: int) -> None:
        """Lightning's per-epoch call: nothing to do, the stream counts its own epochs."""

    def order(self, epoch: int) -> list[int]:
        """The row indices this process gets in epoch ``epoch``."""
        g = torch.Generator().manual_seed(self.seed + epoch)
        return torch.randperm(self.num_rows, generator=g)[: self.epoch_rows][self.rank :: self.world].tolist()

    def __iter__(self):
        epoch, offset = divmod(self.skip, len(self))
        order = self.order(epoch)
        self.skip = (epoch + 1) * len(self)  # the next iterator starts the next epoch
        yield from order[offset:]

    def __len__(self) -> int:
        # A full epoch, also when resuming mid-epoch: Lightning's restored batch counter then reaches the
        # epoch's end exactly when this iterator runs out.
        return self.epoch_rows // self.world
