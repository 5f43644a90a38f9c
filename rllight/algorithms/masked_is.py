"""Masked importance sampling for the mismatch between the rollout engine and the trainer, as pure functions.

The engine samples from pi_engine, the trainer computes pi_trainer of the same tokens (kernels, precision,
MoE routing and stale weights make them differ). Truncated IS (``truncated_is_weight``) reweights every token
by ``min(r, C)``; the masks below instead drop the tokens or responses whose ratio says the sample is too far
off-policy to learn from, and keep the rest with weight 1 (IcePop keeps its ratio as the weight).

``r_t = pi_trainer(y_t) / pi_engine(y_t) = exp(old_logprobs_t - sample_logprobs_t)``, all detached.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["icepop_weight", "sequence_is_mask", "token_is_mask"]


def _ratio(old_logprobs: Tensor, sample_logprobs: Tensor) -> Tensor:
    return torch.exp((old_logprobs - sample_logprobs).detach().clamp(-50.0, 50.0))


def token_is_mask(old_logprobs: Tensor, sample_logprobs: Tensor, low: float, high: float) -> Tensor:
    """Token-level mask: 1 where ``low <= r_t <= high``, else 0 (verl's token rejection, TRL's ``token_mask``).

    Args:
        old_logprobs, sample_logprobs: Shape (B, T), the trainer's and the engine's log-probs.

    Returns:
        Shape (B, T), float.
    """
    r = _ratio(old_logprobs, sample_logprobs)
    return ((r >= low) & (r <= high)).to(old_logprobs.dtype)


def sequence_is_mask(old_logprobs: Tensor, sample_logprobs: Tensor, response_mask: Tensor, low: float,
                     high: float) -> Tensor:
    """Sequence-level mask on the geometric mean of a response's token ratios,
    ``g = exp(mean_t log r_t)`` over its response tokens: every token of a response is kept (1) when
    ``low <= g <= high`` and dropped (0) otherwise (verl's geometric rejection; TRL's ``sequence_mask`` on the
    per-token mean). The geometric mean does not grow with the length, so one threshold serves short and long
    responses. A response without tokens is kept (it has nothing to mask).

    Returns:
        Shape (B, T), float, constant along each row.
    """
    m = response_mask.to(old_logprobs.dtype)
    log_r = ((old_logprobs - sample_logprobs).detach() * m).sum(-1) / m.sum(-1).clamp(min=1.0)
    g = torch.exp(log_r.clamp(-50.0, 50.0))
    keep = (g >= low) & (g <= high)
    return keep.to(old_logprobs.dtype).unsqueeze(-1).expand_as(old_logprobs)


def icepop_weight(old_logprobs: Tensor, sample_logprobs: Tensor, low: float = 0.5, high: float = 5.0) -> Tensor:
    """IcePop's two-sided masked weight (the Ling team's Ring-1T report, "Every Step Evolves", 2025):
    ``M(r_t) = r_t`` where ``low <= r_t <= high``, else 0; detached. The defaults are the report's
    (alpha 0.5, beta 5).

    Returns:
        Shape (B, T).
    """
    r = _ratio(old_logprobs, sample_logprobs)
    return torch.where((r >= low) & (r <= high), r, torch.zeros_like(r))
