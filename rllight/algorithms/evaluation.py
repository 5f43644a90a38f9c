"""Evaluation estimators over ``n`` sampled responses per prompt: pass@k, avg@k, maj@k, their standard
errors across prompts and a seeded bootstrap interval.

Every estimator that takes a correctness matrix returns an ``Estimate``: the mean over prompts, its
standard error (the sample standard deviation of the per-prompt values over sqrt(P); NaN with fewer
than two prompts, where it is undefined) and the per-prompt values, so that two runs can be compared
prompt by prompt (a paired difference has a far smaller error than two independent means).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor


class Estimate(NamedTuple):
    """A mean over prompts with its standard error."""

    mean: float
    se: float
    """Standard error of ``mean``: std of ``per_prompt`` (Bessel-corrected) / sqrt(P); NaN when P < 2."""
    per_prompt: Tensor
    """Shape (P,), float64: the estimator's value for each prompt."""


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one prompt from ``n`` samples of which ``c`` are correct: the probability that at
    least one of ``k`` samples drawn without replacement from the ``n`` is correct,
    ``1 - C(n - c, k) / C(n, k)`` (Chen et al. 2021, "Evaluating Large Language Models Trained on Code",
    arXiv:2107.03374, eq. 1 and its numerically stable form in Fig. 3).

    Computed as ``1 - prod_{i=n-c+1}^{n} (1 - k / i)``: a product of ``c`` factors in [0, 1], no binomial
    coefficient, so no overflow for large ``n``. It is 1 when ``n - c < k`` (every k-subset holds a
    correct sample).
    """
    if not (isinstance(n, int) and isinstance(c, int) and isinstance(k, int)):
        raise TypeError(f"pass_at_k takes integers, got n={n!r}, c={c!r}, k={k!r}")
    if n < 1 or not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k needs n >= 1, 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def mean_and_se(values: Tensor) -> tuple[float, float]:
    """Mean of ``values`` (shape (P,)) and its standard error ``std(values, ddof=1) / sqrt(P)``.

    The standard error is NaN when ``P < 2``: one prompt says nothing about the spread across prompts.
    """
    values = values.detach().to(torch.float64).flatten()
    p = values.numel()
    if p == 0:
        return math.nan, math.nan
    mean = values.mean().item()
    se = (values.std(unbiased=True) / math.sqrt(p)).item() if p >= 2 else math.nan
    return mean, se


def bootstrap_interval(
    values: Tensor, resamples: int = 1000, confidence: float = 0.95, seed: int = 0
) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean of ``values`` (shape (P,)), resampling prompts with
    replacement (Efron & Tibshirani 1993, ch. 13). ``seed`` seeds a private generator: the interval is
    the same on every call and leaves the global random stream alone."""
    if resamples < 1:
        raise ValueError(f"bootstrap_interval needs resamples >= 1, got {resamples}")
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"bootstrap_interval needs 0 < confidence < 1, got {confidence}")
    values = values.detach().to(torch.float64).flatten()
    p = values.numel()
    if p == 0:
        return math.nan, math.nan
    g = torch.Generator().manual_seed(seed)
    means = values[torch.randint(p, (resamples, p), generator=g)].mean(dim=1)
    tail = (1.0 - confidence) / 2
    low, high = torch.quantile(means, torch.tensor([tail, 1.0 - tail], dtype=torch.float64)).tolist()
    return low, high


def _estimate(per_prompt: Tensor) -> Estimate:
    mean, se = mean_and_se(per_prompt)
    return Estimate(mean, se, per_prompt)


def _check_k(correct: Tensor, k: int) -> tuple[int, int]:
    if correct.dim() != 2:
        raise ValueError(f"correct must have shape (P, n), got {tuple(correct.shape)}")
    p, n = correct.shape
    if not 1 <= k <= n:
        raise ValueError(f"k must be in 1..n = 1..{n}, got {k}")
    return p, n


def pass_at_k_over_prompts(correct: Tensor, k: int) -> Estimate:
    """Mean unbiased pass@k over prompts (``pass_at_k`` of each row, arXiv:2107.03374).

    Args:
        correct: Shape (P, n), bool or 0/1: whether each of the ``n`` samples of each prompt is correct.
        k: Samples per attempt, ``1 <= k <= n``. pass@1 equals the mean correctness of all ``n`` samples.
    """
    _, n = _check_k(correct, k)
    counts = correct.to(torch.int64).sum(dim=1).tolist()
    return _estimate(torch.tensor([pass_at_k(n, c, k) for c in counts], dtype=torch.float64))


def avg_at_k(correct: Tensor, k: int) -> Estimate:
    """avg@k: the mean correctness of the first ``k`` samples of each prompt, averaged over prompts
    (the "pass@1 averaged over k samples" of DeepSeek-R1, arXiv:2501.12948).

    The first ``k`` samples, not all ``n``: avg@k is then exactly what a run sampling ``k`` responses would
    report. Its expectation is the per-sample accuracy for every ``k``; ``k = n`` has the smallest error.

    Args:
        correct: Shape (P, n), bool or 0/1.
        k: ``1 <= k <= n``.
    """
    _check_k(correct, k)
    return _estimate(correct[:, :k].to(torch.float64).mean(dim=1))


def majority_vote(answers: Sequence[str | None]) -> int | None:
    """Index of the sample whose answer wins the vote among ``answers``; None when no sample has one.

    Samples whose answer is None (nothing could be extracted) do not vote. Ties go to the answer that
    appears first, and the index returned is that answer's first occurrence: the vote depends on the
    samples' order only through ties, and is the same on every run.
    """
    counts: dict[str, int] = {}
    first: dict[str, int] = {}
    for i, answer in enumerate(answers):
        if answer is None:
            continue
        counts[answer] = counts.get(answer, 0) + 1
        first.setdefault(answer, i)
    if not counts:
        return None
    # max() keeps the first maximum it meets, and dicts iterate in first-occurrence order.
    winner = max(counts, key=counts.__getitem__)
    return first[winner]


def maj_at_k(answers: Sequence[Sequence[str | None]], correct: Tensor, k: int) -> Estimate:
    """maj@k (self-consistency, Wang et al. 2022, arXiv:2203.11171): a prompt counts as solved when the
    majority answer among its first ``k`` samples is correct.

    The vote is ``majority_vote`` over the extracted answers (None does not vote; ties go to the answer
    seen first). The majority answer's correctness is that of its first sample: the reward judged that
    response, and samples with the same extracted answer normally get the same verdict. A prompt where no
    sample has an answer counts as wrong.

    Args:
        answers: P lists of ``n`` extracted answers (None where nothing was extracted).
        correct: Shape (P, n), bool or 0/1.
        k: ``1 <= k <= n``.
    """
    p, n = _check_k(correct, k)
    if len(answers) != p or any(len(a) != n for a in answers):
        raise ValueError(f"answers must be {p} lists of {n} answers, like correct {tuple(correct.shape)}")
    per_prompt = []
    for i in range(p):
        j = majority_vote(answers[i][:k])
        per_prompt.append(0.0 if j is None else float(bool(correct[i, j])))
    return _estimate(torch.tensor(per_prompt, dtype=torch.float64))
