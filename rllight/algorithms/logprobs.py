"""Per-token log-probabilities and entropy from logits."""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["logprobs_and_entropy"]


def logprobs_and_entropy(logits: Tensor, targets: Tensor, temperature: float = 1.0) -> tuple[Tensor, Tensor]:
    """Log-probability of ``targets`` and the entropy of the sampling distribution at each position.

    The logits are divided by ``temperature`` first, so that the result is the log-probability under
    the distribution the rollout engine sampled from. Computed in float32.

    Args:
        logits: Shape (B, T, V).
        targets: Shape (B, T), token ids.

    Returns:
        ``(logprobs, entropy)``, each shape (B, T).
    """
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    token_logp = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp.exp() * logp).sum(-1)
    return token_logp, entropy
