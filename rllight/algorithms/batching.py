"""How a step's rows are spread over the training processes and cut into the updates' minibatches, as pure
functions of counts (no ``torch.distributed``: the callers gather the counts and move the rows).

A recipe's sizes are totals over all processes, as the papers and verl state them. DAPO's dynamic sampling
(Yu et al., arXiv:2503.14476, section 3.2) keeps a different number of groups on each process, so the kept
groups are dealt evenly to the ranks before the update (``deal_groups``; verl gathers the batch on its driver and
splits it evenly), and the minibatches are planned over all ranks' rows together (``minibatch_shares``): a rollout
then makes the updates its global sizes imply on any number of processes.
"""

from __future__ import annotations

from collections.abc import Sequence
from fractions import Fraction

__all__ = ["deal_groups", "first_in_rank_order", "minibatch_shares"]


def first_in_rank_order(counts: Sequence[int], target: int) -> list[int]:
    """How many of its ``counts[r]`` items each rank keeps when the first ``target`` items over the ranks, taken
    in rank order, are kept (DAPO's dynamic sampling keeps the first ``target`` mixed groups and drops a surplus
    of the last round, as verl does).

    Example: counts (3, 2, 4) and target 6 keep (3, 2, 1).
    """
    kept, left = [], max(target, 0)
    for count in counts:
        kept.append(min(count, left))
        left -= kept[-1]
    return kept


def deal_groups(sizes: Sequence[Sequence[int]]) -> list[list[tuple[int, int]]]:
    """Deal whole groups evenly to the ranks: ``sizes[r][g]`` is the number of rows of rank r's group g.

    The groups, in rank order and each rank's order, are cut into ``W`` contiguous runs: a group of ``n`` rows
    starting at row ``s`` of the ``N`` rows of all ranks goes to the rank in whose equal share of the rows its
    middle falls, ``floor((2s + n) W / (2N))``. So with groups of one size (G responses per prompt) the ranks
    differ by at most one group; a group is never split; and where every rank already holds its even share of
    groups of one size, every group stays where it is (nothing moves). Deterministic: every rank computes the
    same deal from the gathered sizes.

    Args:
        sizes: One list per rank, each group's row count (>= 1), in the rank's order.

    Returns:
        One list per destination rank of ``(source rank, group index)``, in rank order then group order.

    Example: ranks holding 3 and 1 groups of 2 rows (N = 8): the middles are rows 1, 3, 5 (rank 0's) and 7
    (rank 1's), so rank 0 keeps groups 0 and 1 and rank 1 gets rank 0's group 2 beside its own.
    """
    world = len(sizes)
    total = sum(sum(s) for s in sizes)
    dealt: list[list[tuple[int, int]]] = [[] for _ in range(world)]
    start = 0
    for rank, groups in enumerate(sizes):
        for g, n in enumerate(groups):
            dealt[(2 * start + n) * world // (2 * total)].append((rank, g))
            start += n
    return dealt


def minibatch_shares(counts: Sequence[int], minibatch_size: int | None) -> list[list[int]]:
    """The updates of one epoch over the rows of all ranks (``counts[r]`` rows on rank r): for each update, how
    many of its rows each rank holds.

    There are ``ceil(N / minibatch_size)`` updates over the ``N`` rows (one with ``minibatch_size`` None; none
    when ``N`` is 0), each of ``minibatch_size`` rows except the last, which takes the rest: the global
    minibatches of one process cutting ``N`` rows, on any number of ranks. When dynamic sampling's cap leaves
    fewer rows than the recipe's batch, the last update is the smaller one, as on one process (verl's DAPO
    trainer stops the run instead).

    Each rank's rows are spread evenly over the updates: rank r's i-th row sits at ``(2i + 1) / (2 counts[r])``
    of the way through the epoch, and the updates take the rows in that order (ties in rank order). With equal
    counts and a ``minibatch_size`` that is a multiple of the rank count, every update takes
    ``minibatch_size / W`` rows of each rank.

    Example: ranks holding 6 and 2 rows, ``minibatch_size`` 4: two updates of (3, 1) rows, where cutting each
    rank's rows into its own 2-row shares gives three updates of 4, 2 and 2 rows.
    """
    total = sum(counts)
    if total == 0:
        return []
    size = minibatch_size or total
    order = sorted((Fraction(2 * i + 1, 2 * count), rank) for rank, count in enumerate(counts) for i in range(count))
    shares = []
    for first in range(0, total, size):
        share = [0] * len(counts)
        for _, rank in order[first : first + size]:
            share[rank] += 1
        shares.append(share)
    return shares
