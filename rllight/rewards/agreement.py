"""How far a model-served reward (an LLM judge, a reward model) agrees with a verifier that trains beside it, over one
batch, and the trend test of the reward-hacking guard (``rllight.callbacks.RewardHackingGuard``).

A policy trained on a learned reward can find text that reward likes whatever the question: the model reward rises
while the verifier's falls (reward over-optimisation: Gao et al., "Scaling Laws for Reward Model Overoptimization",
arXiv:2210.10760). ``rllight.rewards.Weighted`` logs ``pair_metrics`` for each model reward and verifier among its
components every step; the guard fits ``fitted_change`` to their means over a window of steps.

Pure functions of lists of floats: no torch, no rewards, no run.
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def average_ranks(values: Sequence[float]) -> list[float]:
    """The 1-based rank of each of ``values`` in ascending order, tied values sharing the mean of the ranks they span
    (``[0.5, 0.2, 0.5]`` -> ``[2.5, 1.0, 2.5]``: the two 0.5s span ranks 2 and 3)."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    ranks = [0.0] * len(values)
    start = 0
    while start < len(order):
        end = start  # order[start..end] hold one value
        while end + 1 < len(order) and values[order[end + 1]] == values[order[start]]:
            end += 1
        for k in range(start, end + 1):
            ranks[order[k]] = (start + end) / 2 + 1
        start = end + 1
    return ranks


def rank_correlation(x: Sequence[float], y: Sequence[float]) -> float | None:
    """Spearman's rank correlation of the pairs ``(x[i], y[i])``: Pearson's correlation of their ``average_ranks``
    (so ties count as ``scipy.stats.spearmanr`` counts them), in [-1, 1]. 1: the two order the samples alike; 0: no
    relation; -1: opposite orders. None where it is undefined: fewer than two pairs, or ``x`` or ``y`` constant
    (every rank tied: nothing to order)."""
    if len(x) != len(y):
        raise ValueError(f"rank_correlation of {len(x)} values against {len(y)}")
    if len(x) < 2:
        return None
    rx, ry = average_ranks(x), average_ranks(y)
    mean = (len(x) + 1) / 2  # the mean of 1..n, whatever the ties
    dx, dy = [r - mean for r in rx], [r - mean for r in ry]
    sxx, syy = sum(d * d for d in dx), sum(d * d for d in dy)
    if sxx == 0 or syy == 0:
        return None
    return max(-1.0, min(1.0, sum(a * b for a, b in zip(dx, dy)) / math.sqrt(sxx * syy)))


def verifier_at_top(model: Sequence[float], verifier: Sequence[float], groups: Sequence[int]) -> float | None:
    """The verifier's reward of the responses the model reward prefers: within each group (the responses to one
    prompt, ``groups[i]`` sample i's), the verifier's mean over the responses whose model reward is the group's
    highest (every response tied at it), then the mean over the groups, each counting once. Compared with the
    verifier's mean over all responses, it says whether the model reward's favourite in a group is more often right
    (higher) or less (lower) than a response drawn at random. With one response per group it is the verifier's mean.
    None for no samples."""
    if not (len(model) == len(verifier) == len(groups)):
        raise ValueError(f"verifier_at_top of {len(model)}, {len(verifier)} and {len(groups)} values")
    members: dict[int, list[int]] = {}
    for i, group in enumerate(groups):
        members.setdefault(group, []).append(i)
    if not members:
        return None
    tops = []
    for index in members.values():
        best = max(model[i] for i in index)
        top = [verifier[i] for i in index if model[i] == best]
        tops.append(sum(top) / len(top))
    return sum(tops) / len(tops)


def pair_metrics(model_name: str, verifier_name: str, model: Sequence[float], verifier: Sequence[float],
                 groups: Sequence[int]) -> dict[str, float]:
    """The agreement of a model reward (``model``, one value per sample) with a verifier (``verifier``) over one
    batch, as ``Scores.metrics`` (logged as ``train/reward/<key>``): ``agreement/<model>_vs_<verifier>/rank_corr``
    (``rank_correlation``; left out where it is undefined: a batch where either reward is constant) and
    ``.../verifier_at_top`` (``verifier_at_top``). None of it for no samples."""
    prefix = f"agreement/{model_name}_vs_{verifier_name}/"
    out = {}
    corr = rank_correlation(model, verifier)
    if corr is not None:
        out[prefix + "rank_corr"] = corr
    top = verifier_at_top(model, verifier, groups)
    if top is not None:
        out[prefix + "verifier_at_top"] = top
    return out


def fitted_change(values: Sequence[float]) -> float:
    """How much the least-squares line through ``(t, values[t])``, t = 0..n-1, changes from the first point to the
    last: its slope times (n - 1), in the values' own units. Less sensitive to one noisy step than the last value
    minus the first. 0 for fewer than two values."""
    n = len(values)
    if n < 2:
        return 0.0
    t_mean, v_mean = (n - 1) / 2, sum(values) / n
    slope = (sum((t - t_mean) * (v - v_mean) for t, v in enumerate(values))
             / sum((t - t_mean) ** 2 for t in range(n)))
    return slope * (n - 1)


__all__ = ["average_ranks", "fitted_change", "pair_metrics", "rank_correlation", "verifier_at_top"]
