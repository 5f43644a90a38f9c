"""Several data sources mixed by weight in every training batch, with optional weight schedules over steps.

The sources are the training rows' ``data_source`` values (a file's name, the field ``data.data_source_key``
names, an embedded task's source, each reasoning-gym task). ``SourceMix`` says how many of each batch's
``data.batch_size`` prompts come from each: ``round(batch_size x weight share)``, exactly, batch by batch (the
fractions left over are carried to the next batches, so that a weight that does not divide the batch gets its
share over consecutive batches, never more than one prompt off in any batch). Each source is drawn from its own
seeded stream (a fresh permutation per pass over it), so a small source repeats before a large one does.

Everything follows from the batch's index: a run resumed after ``k`` trained batches draws exactly the prompts an
uninterrupted run draws from batch ``k`` on (the checkpoint's batch count is the whole state), and under several
processes each takes its share of the same global batch.
"""

from __future__ import annotations

import math
import zlib
from itertools import pairwise

import torch

from rllight.bounds import NonNegativeFiniteFloat, NonNegativeInt, checked
from rllight.data.sampler import ResumableSampler
from rllight.errors import RecipeError

KEY = "data.mix"


def _check_weights(weights, key: str) -> dict[str, float]:
    if not isinstance(weights, dict) or not weights:
        raise RecipeError(f"{key} must map each data source to a weight, e.g. {{gsm8k: 3, arithmetic: 1}}")
    out = {}
    for source, weight in weights.items():
        out[str(source)] = checked(f"{key}.{source}", weight, NonNegativeFiniteFloat)
    if not sum(out.values()) > 0:
        raise RecipeError(f"{key}: every weight is 0; give at least one source a positive weight")
    return out


def largest_remainder(weights: dict[str, float], total: int) -> dict[str, int]:
    """``total`` shared in proportion to ``weights`` (counts or weights; largest remainders, ties to the earlier
    name)."""
    weights = scaled(weights)
    whole = sum(weights.values())
    if not whole:
        return {}
    exact = {k: total * v / whole for k, v in weights.items()}
    out = {k: math.floor(x) for k, x in exact.items()}
    for k in sorted(exact, key=lambda k: out[k] - exact[k])[: total - sum(out.values())]:
        out[k] += 1
    return out


def scaled(weights: dict[str, float]) -> dict[str, float]:
    """``weights`` over their largest, so that their sum is finite however large each is (any scale means the same
    shares: ``{a: 1e308, b: 1e308}`` sums to infinity, which would make every share 0)."""
    top = max(weights.values(), default=0.0)
    return {k: v / top for k, v in weights.items()} if top > 0 else dict(weights)


def rows_by_source(rows: list[dict]) -> dict[str, list[int]]:
    """The indices of ``rows`` by their ``data_source`` (as a string), in the rows' order."""
    out: dict[str, list[int]] = {}
    for i, row in enumerate(rows):
        out.setdefault(str(row.get("data_source")), []).append(i)
    return out


class SourceStreams:
    """Each data source's rows as a seeded stream: a fresh permutation of them per pass, derived from the source,
    the pass and ``seed`` alone, so a position in the stream is all its state. ``item(source, position)`` is the
    row index at that position (each source's latest pass is kept)."""

    def __init__(self, rows: list[dict], seed: int):
        self.by_source = rows_by_source(rows)
        self.seed = seed
        self._passes: dict[str, tuple[int, list[int]]] = {}  # source -> (pass, its permutation)

    def item(self, source: str, position: int) -> int:
        rows = self.by_source[source]
        epoch, offset = divmod(position, len(rows))
        cached = self._passes.get(source)
        if cached is None or cached[0] != epoch:
            g = torch.Generator().manual_seed(self.seed + zlib.crc32(source.encode()) * 7919 + epoch)
            cached = self._passes[source] = (epoch, torch.randperm(len(rows), generator=g).tolist())
        return rows[cached[1][offset]]


class SourceMix:
    """How much of every training batch each data source gives (see ``rllight.data.mix``).

    Args:
        weights: Each source's weight (any scale; a batch's shares are the weights over their sum). A weight of 0
            leaves the source out until a schedule gives it one.
        schedule: Weights over training steps (RL steps, i.e. batches, counted from 0): a list of ``{step: S,
            weights: {...}}`` in increasing ``step``. The weights go linearly from ``weights`` at step 0 (or the
            first point's, at a point at step 0) to each point's in turn, and stay at the last point's after it.
            Every point names the same sources as ``weights``.
    """

    def __init__(self, weights: dict[str, float], schedule: list[dict] | None = None):
        self.weights = _check_weights(weights, f"{KEY}.weights")
        self.schedule: list[tuple[int, dict[str, float]]] = []
        for i, point in enumerate(schedule or []):
            key = f"{KEY}.schedule[{i}]"
            if not isinstance(point, dict) or set(point) != {"step", "weights"}:
                raise RecipeError(f"{key} must be {{step: S, weights: {{source: weight, ...}}}}, got {point!r}")
            step = checked(f"{key}.step", point["step"], NonNegativeInt)
            if self.schedule and step <= self.schedule[-1][0]:
                raise RecipeError(f"{key}.step must be larger than the point before it ({self.schedule[-1][0]})")
            point_weights = _check_weights(point["weights"], f"{key}.weights")
            if set(point_weights) != set(self.weights):
                raise RecipeError(f"{key}.weights names {sorted(point_weights)}; name the sources of "
                                  f"{KEY}.weights: {sorted(self.weights)}")
            self.schedule.append((step, point_weights))

    @property
    def sources(self) -> list[str]:
        return list(self.weights)

    def weights_at(self, step: int) -> dict[str, float]:
        """The weights of batch ``step`` (counted from 0), normalised to sum to 1: ``weights`` at step 0, then
        linear between the schedule's points, the last point's after it."""
        points = list(self.schedule)
        if not points or points[0][0] > 0:
            points.insert(0, (0, self.weights))
        raw = points[-1][1]
        for (s0, w0), (s1, w1) in pairwise(points):
            if step < s1:
                t = max(0.0, (step - s0) / (s1 - s0))
                raw = {k: w0[k] + t * (w1[k] - w0[k]) for k in w0}
                break
        raw = scaled(raw)
        total = sum(raw.values())
        if not total > 0:
            raise RecipeError(f"{KEY}: every weight is 0 at step {step}; give a source a positive weight there")
        return {k: v / total for k, v in raw.items()}

    def counts(self, first: int, last: int, batch_size: int) -> list[dict[str, int]]:
        """Prompts per source of batches ``first .. last - 1``: each batch's ``batch_size`` split by its weights,
        the leftover fractions carried from batch 0 on (largest remainder, ties to the earlier source)."""
        credit = dict.fromkeys(self.weights, 0.0)
        out = []
        for step in range(last):
            shares = self.weights_at(step)
            for k in credit:
                credit[k] += batch_size * shares[k]
            count = {k: math.floor(credit[k] + 1e-9) for k in credit}
            left = batch_size - sum(count.values())
            for k in sorted(credit, key=lambda k: -(credit[k] - count[k]))[:max(left, 0)]:
                count[k] += 1
            for k in credit:
                credit[k] -= count[k]
            if step >= first:
                out.append(count)
        return out


class MixedSampler(ResumableSampler):
    """``ResumableSampler`` whose batches follow a ``SourceMix``: batch ``k`` holds ``mix.counts`` prompts of each
    source, the next ones of that source's own seeded stream, shuffled together; process ``rank`` takes every
    ``world``-th of them. An epoch is as many batches as the plain sampler's (the rows over the batch size)."""

    def __init__(self, rows: list[dict], mix: SourceMix, batch_size: int, batches_per_epoch: int, seed: int,
                 rank: int = 0, world: int = 1):
        super().__init__(len(rows), batches_per_epoch * batch_size, seed, rank, world)
        self.mix, self.batch_size, self.batches_per_epoch = mix, batch_size, batches_per_epoch
        self.streams = SourceStreams(rows, seed * 1_000_003)
        for i, row in enumerate(rows):
            source = str(row.get("data_source"))
            if source not in mix.weights:
                raise RecipeError(f"{KEY}.weights has no weight for data source {source!r} (training row "
                                  f"{row.get('source', i + 1)}); give every source a weight: {sorted(self._all(rows))}")
        empty = [s for s in mix.sources if s not in self.streams.by_source]
        if empty:
            raise RecipeError(f"{KEY}.weights names {empty}, which no training row has; the sources are "
                              f"{sorted(self._all(rows))}")

    @staticmethod
    def _all(rows: list[dict]) -> set[str]:
        return {str(r.get("data_source")) for r in rows}

    def global_batch(self, step: int, cursor: dict[str, int], count: dict[str, int]) -> list[int]:
        """The row indices of batch ``step`` over all processes, from each source's ``cursor``."""
        picked = [self.streams.item(s, p) for s in self.mix.sources for p in range(cursor[s], cursor[s] + count[s])]
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        return [picked[j] for j in torch.randperm(len(picked), generator=g).tolist()]

    def order(self, epoch: int) -> list[int]:
        first = epoch * self.batches_per_epoch
        counts = self.mix.counts(0, first + self.batches_per_epoch, self.batch_size)
        cursor = {s: sum(c[s] for c in counts[:first]) for s in self.mix.sources}
        out = []
        for step in range(first, first + self.batches_per_epoch):
            count = counts[step]
            out.extend(self.global_batch(step, cursor, count)[self.rank :: self.world])
            for s in cursor:
                cursor[s] += count[s]
        return out

