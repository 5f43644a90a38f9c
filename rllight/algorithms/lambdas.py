"""Per-sequence GAE lambdas that depend on response length (VAPO, Yue et al., arXiv:2504.05118).

Both functions map response lengths (B,) to one lambda per sequence (B,), which ``gae`` accepts as
``lam``. Long responses get a lambda near 1 (the advantage leans on the verifier's reward, not on a
value model asked to predict thousands of tokens ahead); short ones a lower lambda (less variance).
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["adaptive_lambda", "vapo_lambda"]


def adaptive_lambda(lengths: Tensor, lam_min: float = 0.3, lam_max: float = 0.95, total=None) -> Tensor:
    """Length-adaptive lambda of the VAPO note (000, eq. 7): a sigmoid of the batch-normalised length.

    ``lam(L) = lam_min + (lam_max - lam_min) * sigmoid((L - mean_L) / max(std_L, 1))`` with the batch's
    mean and unbiased std of the lengths. The std is clamped to at least 1 token so that a batch of
    equal lengths (std 0, or a single response) gives every sequence the midpoint
    ``(lam_min + lam_max) / 2`` instead of 0/0.

    Args:
        lengths: Shape (B,), response lengths in tokens (any numeric dtype).
        lam_min: Lambda of very short responses (the sigmoid's lower asymptote).
        lam_max: Lambda of very long responses (the upper asymptote).
        total: Sums over the training processes: the mean and std are then the global batch's (every rank
            calls it, an empty one too). None = this process's lengths.

    Returns:
        Shape (B,), float32 (float64 if ``lengths`` is float64), in ``(lam_min, lam_max)``.
    """
    if not 0.0 <= lam_min <= lam_max <= 1.0:
        raise ValueError(f"need 0 <= lam_min <= lam_max <= 1, got lam_min={lam_min}, lam_max={lam_max}")
    length = lengths.to(torch.float64 if lengths.dtype == torch.float64 else torch.float32)
    if total is not None:
        sums = total(torch.stack([length.sum(), length.new_tensor(float(length.numel()))]))
        mean, n = sums[0] / sums[1].clamp(min=1), sums[1]
        var = total(((length - mean) ** 2).sum()) / (n - 1).clamp(min=1)
        std = var.sqrt() if n > 1 else var * 0
        return lam_min + (lam_max - lam_min) * torch.sigmoid((length - mean) / std.clamp(min=1.0))
    if length.numel() == 0:
        return length
    # One response has no spread: its std is taken as 0 (then clamped to 1), not torch's NaN.
    std = length.std() if length.numel() > 1 else length.new_zeros(())
    z = (length - length.mean()) / std.clamp(min=1.0)
    return lam_min + (lam_max - lam_min) * torch.sigmoid(z)


def vapo_lambda(lengths: Tensor, alpha: float = 0.05) -> Tensor:
    """Length-adaptive lambda of the VAPO paper (arXiv:2504.05118, section 4.2; as NeMo-RL ships it):
    ``lam(L) = 1 - 1 / (alpha * L)``, so that the sum of GAE's weights ``1 / (1 - lam) = alpha * L``
    grows in proportion to the length.

    The formula is negative for ``L < 1 / alpha`` (20 tokens at alpha = 0.05) and undefined at L = 0;
    those sequences get lambda 0 (one-step TD), the closest valid value. The paper's responses are
    thousands of tokens long, where the clamp never engages.

    Args:
        lengths: Shape (B,), response lengths in tokens.
        alpha: Proportionality constant (0.05 in the paper).

    Returns:
        Shape (B,), in ``[0, 1)``.
    """
    if alpha <= 0:
        raise ValueError(f"alpha must be > 0, got {alpha}")
    length = lengths.to(torch.float64 if lengths.dtype == torch.float64 else torch.float32)
    return (1.0 - 1.0 / (alpha * length.clamp(min=1e-12))).clamp(min=0.0)
