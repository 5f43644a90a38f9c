"""KL estimators between the policy and a reference policy, and masked statistics."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

__all__ = ["kl_penalty", "masked_mean", "masked_whiten", "KL_KINDS"]

KL_KINDS = ("k1", "k2", "k3")


def kl_penalty(logprobs: Tensor, ref_logprobs: Tensor, kind: str = "k3") -> Tensor:
    """Per-token estimate of KL(pi || pi_ref) from samples of pi (Schulman, "Approximating KL
    divergence", 2020; k3 is GRPO's estimator, arXiv:2402.03300).

    With ``d = logprobs - ref_logprobs``: ``k1 = d``; ``k2 = d^2 / 2``;
    ``k3 = exp(-d) - (-d) - 1`` (non-negative, low variance).

    Args:
        logprobs, ref_logprobs: Shape (B, T).

    Returns:
        Shape (B, T).
    """
    d = logprobs - ref_logprobs
    if kind == "k1":
        return d
    if kind == "k2":
        return 0.5 * d * d
    if kind == "k3":
        return torch.exp(-d) + d - 1.0
    raise ValueError(f"unknown KL kind {kind!r}; choose one of {', '.join(KL_KINDS)}")


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of ``x`` over the entries where ``mask`` is set (over all of them, or along ``dim``)."""
    m = mask.to(x.dtype)
    if dim is None:
        return (x * m).sum() / m.sum().clamp(min=1)
    return (x * m).sum(dim) / m.sum(dim).clamp(min=1)


def masked_whiten(x: Tensor, mask: Tensor, shift_mean: bool = True, eps: float = 1e-8,
                  total: Callable[[Tensor], Tensor] | None = None) -> Tensor:
    """Normalise ``x`` to zero mean and unit variance over the masked entries.

    The variance is the unbiased masked variance (divides by ``n - 1``). With ``shift_mean`` False the
    mean is added back (only the scale changes). Entries outside ``mask`` come back as 0.

    Args:
        x, mask: Same shape, e.g. (B, T).
        total: Sums a tensor over the training processes (the batch is every process's rows: the moments are
            those of the global batch, as on one process); None = this process's rows alone.
    """
    total = total or (lambda t: t)
    m = mask.to(x.dtype)
    sums = total(torch.stack([(x * m).sum(), m.sum()]))
    n = sums[1]
    mean = sums[0] / n.clamp(min=1)
    var = total((((x - mean) ** 2) * m).sum()) / (n - 1).clamp(min=1)
    out = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return out * m
