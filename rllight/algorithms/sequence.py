"""Sequence-level and importance-weighted policy objectives as pure tensor functions.

Shapes: B responses, T response columns; ``response_mask`` (B, T) marks the valid response tokens.
Every loss is meant to be *minimised*. Some are per token (B, T) and go through ``aggregate`` like the
PPO surrogate; the sequence-level ones return one loss per response (B,), which ``aggregate`` averages
over responses whatever its mode.

Advantages may be given per sequence (B,) or per token (B, T); rllight's estimators broadcast one
advantage over the response, so both describe the same thing.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = [
    "vespo_weight", "sequence_clipped_surrogate", "gspo", "cispo", "truncated_is_weight", "effective_sample_size",
]

# exp(50) ~ 5e21: phi(e^50) = exp(c1 * 50 + c2 * (1 - 5e21)) is exactly 0 in every float type for any
# c2 > 0, so capping log W there changes no value, and it keeps exp() finite (+inf would give inf - inf).
_MAX_LOG_W = 50.0
# The lower cap only turns -inf into a finite number: phi(e^-1e6) = exp(-1e6 c1 + c2) is 0 for c1 > 1e-3.
_MIN_LOG_W = -1.0e6


def _per_token(advantages: Tensor) -> Tensor:
    """(B,) -> (B, 1) so that a sequence advantage broadcasts over tokens; (B, T) unchanged."""
    return advantages.unsqueeze(-1) if advantages.dim() == 1 else advantages


def _per_sequence(advantages: Tensor, response_mask: Tensor) -> Tensor:
    """(B,) unchanged; (B, T) -> the mean over each response's valid tokens, (B,)."""
    if advantages.dim() == 1:
        return advantages
    m = response_mask.to(advantages.dtype)
    return (advantages * m).sum(-1) / m.sum(-1).clamp(min=1)


def vespo_weight(
    seq_log_ratio: Tensor,
    advantages: Tensor,
    c1_pos: float = 2.0,
    c2_pos: float = 3.0,
    c1_neg: float = 3.0,
    c2_neg: float = 2.0,
) -> Tensor:
    """VESPO's importance-weight kernel phi(W) = W^c1 exp(c2 (1 - W)) (VESPO, arXiv:2602.10693).

    ``W = pi(y|x) / mu(y|x)`` is the sequence importance weight, given by its log
    ``log W = sum_t (logp_t - behaviour_logp_t)`` with no length normalisation. The kernel is computed in
    log space, ``log phi = c1 log W + c2 (1 - W)``, and exponentiated last, so it stays finite for any
    ``|log W|`` (phi -> 0 at both ends: W^c1 damps W < 1, exp(-c2 W) damps W > 1). ``(c1, c2)`` are
    chosen by the sign of the advantage: ``(c1_pos, c2_pos)`` for ``A >= 0``, ``(c1_neg, c2_neg)`` for
    ``A < 0``. phi(1) = 1 for every (c1, c2). For ``c1 >= 1``,
    ``K = sup_w phi(w) / w = ((c1 - 1) / c2)^(c1 - 1) exp(c2 - c1 + 1)`` bounds the variance.

    Args:
        seq_log_ratio: log W, shape (B,) (or any shape that broadcasts with ``advantages``).
        advantages: Shape (B,): only the sign is used.

    Returns:
        phi(W), detached, with the broadcast shape of the inputs (B,), in float32 or wider.
    """
    log_w = seq_log_ratio.detach()
    if log_w.dtype not in (torch.float32, torch.float64):
        log_w = log_w.float()
    log_w = log_w.clamp(min=_MIN_LOG_W, max=_MAX_LOG_W)
    positive = advantages.detach() >= 0
    c1 = torch.where(positive, torch.tensor(c1_pos, dtype=log_w.dtype, device=log_w.device),
                     torch.tensor(c1_neg, dtype=log_w.dtype, device=log_w.device))
    c2 = torch.where(positive, torch.tensor(c2_pos, dtype=log_w.dtype, device=log_w.device),
                     torch.tensor(c2_neg, dtype=log_w.dtype, device=log_w.device))
    log_phi = c1 * log_w + c2 * (1.0 - torch.exp(log_w))
    return torch.exp(log_phi)


def effective_sample_size(log_weights: Tensor) -> Tensor:
    """Normalised effective sample size ``(sum w)^2 / (n sum w^2)`` of importance weights given by their
    logs, in (0, 1] (1 = all weights equal). Computed with log-sum-exp, so huge or tiny weights do not
    overflow; weights that are all zero (log = -inf) give 0.

    Args:
        log_weights: Shape (n,).

    Returns:
        A scalar tensor.
    """
    lw = log_weights.detach().double()
    n = lw.numel()
    if n == 0 or not torch.isfinite(lw).any():
        return torch.zeros((), dtype=torch.float32)
    ess = torch.exp(2.0 * torch.logsumexp(lw, 0) - torch.logsumexp(2.0 * lw, 0)) / n
    return ess.float()


def sequence_clipped_surrogate(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
) -> Tensor:
    """SPPO's sequence-level clipped objective (Wang et al., arXiv:2604.08865; note 004):

    ``loss_i = -min(sum_t r_t A, sum_t clip(r_t, 1 - clip_low, 1 + clip_high) A)``, with
    ``r_t = exp(logprobs - old_logprobs)`` summed over the response's valid tokens. The min is taken once
    per sequence, after the sums (the token-level PPO surrogate takes it per token), and there is no
    length normalisation: every token of a response receives the same advantage.

    Args:
        logprobs: Shape (B, T), under the policy being trained (carries the gradient).
        old_logprobs: Shape (B, T), under the policy that sampled.
        advantages: Shape (B,) or (B, T).
        response_mask: Shape (B, T).

    Returns:
        Shape (B,): one loss per response.
    """
    adv = _per_token(advantages)
    valid = response_mask.bool()
    zero = logprobs.new_zeros(())
    ratio = torch.exp(logprobs - old_logprobs)
    # where, not a product: a non-finite value in the padding must not reach the sums.
    unclipped = torch.where(valid, ratio * adv, zero).sum(-1)
    clipped = torch.where(valid, torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high) * adv, zero).sum(-1)
    return -torch.minimum(unclipped, clipped)


def gspo(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    clip_low: float = 3e-4,
    clip_high: float = 4e-4,
) -> Tensor:
    """GSPO's sequence-level clipped surrogate (Zheng et al., arXiv:2507.18071).

    ``s_i = exp(mean_t (logprobs - old_logprobs))`` (the geometric mean of the token ratios over the
    response), and ``loss_i = -min(s_i A_i, clip(s_i, 1 - clip_low, 1 + clip_high) A_i)``. The defaults
    are the paper's clip range (3e-4 / 4e-4): a sequence ratio moves far less than a token ratio.

    Args:
        logprobs: Shape (B, T), carries the gradient.
        old_logprobs: Shape (B, T).
        advantages: Shape (B,), or (B, T) (its mean over the response is used).
        response_mask: Shape (B, T).

    Returns:
        Shape (B,): one loss per response.
    """
    adv = _per_sequence(advantages, response_mask)
    valid = response_mask.bool()
    n = valid.sum(-1).clamp(min=1).to(logprobs.dtype)
    seq_ratio = torch.exp(torch.where(valid, logprobs - old_logprobs, logprobs.new_zeros(())).sum(-1) / n)
    unclipped = -adv * seq_ratio
    clipped = -adv * torch.clamp(seq_ratio, 1.0 - clip_low, 1.0 + clip_high)
    return torch.maximum(unclipped, clipped)


def cispo(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    clip_low: float | None = None,
    clip_high: float = 0.28,
) -> Tensor:
    """CISPO (MiniMax-M1, arXiv:2506.13585): the importance weight is clipped and detached, and every
    token keeps its gradient (PPO instead drops the gradient of clipped tokens).

    ``loss_t = -sg(clip(r_t, 1 - clip_low, 1 + clip_high)) A_t logp_t``, ``r_t = exp(logp - old_logp)``.
    The paper sets no lower bound (``clip_low`` None) and tunes only the upper one.

    Args:
        logprobs: Shape (B, T), carries the gradient.
        old_logprobs: Shape (B, T).
        advantages: Shape (B,) or (B, T).

    Returns:
        Shape (B, T).
    """
    ratio = torch.exp((logprobs - old_logprobs).detach())
    weight = torch.clamp(ratio, min=None if clip_low is None else 1.0 - clip_low, max=1.0 + clip_high)
    return -weight * _per_token(advantages) * logprobs


def truncated_is_weight(old_logprobs: Tensor, sample_logprobs: Tensor, cap: float = 2.0) -> Tensor:
    """Truncated importance weight ``min(exp(old_logprobs - sample_logprobs), cap)``, detached, that
    corrects for the mismatch between the rollout engine's sampling distribution and the trainer's
    (Yao et al., 2025, "Your efficient RL framework secretly brings you off-policy RL training").

    The exponent is capped at ``log(cap)`` before ``exp``, which gives the same value and never
    overflows.

    Args:
        old_logprobs: Shape (B, T), the trainer's log-probs of the sampled tokens.
        sample_logprobs: Shape (B, T), the engine's.

    Returns:
        Shape (B, T).
    """
    if cap <= 0:
        raise ValueError(f"cap must be > 0, got {cap}")
    return torch.exp(torch.clamp((old_logprobs - sample_logprobs).detach(), max=math.log(cap)))
