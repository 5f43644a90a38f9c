"""Policy objectives and loss aggregation as pure tensor functions.

Every loss here is per token, shape (B, T), and meant to be *minimised*; how tokens and sequences are
weighed is a separate choice made by ``aggregate``.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["clipped_surrogate", "clip_fractions", "aggregate", "value_loss", "explained_variance", "AGGREGATION_MODES"]

AGGREGATION_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")


def _per_token(advantages: Tensor, like: Tensor) -> Tensor:
    return advantages.unsqueeze(-1) if advantages.dim() == 1 else advantages


def clipped_surrogate(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
) -> Tensor:
    """PPO clipped surrogate (Schulman et al., arXiv:1707.06347), with DAPO's decoupled clip range
    (clip-higher, Yu et al., arXiv:2503.14476) and the optional dual clip (Ye et al., arXiv:1912.09729).

    ``loss_t = -min(r_t A_t, clip(r_t, 1 - clip_low, 1 + clip_high) A_t)`` with
    ``r_t = exp(logprobs - old_logprobs)``. With ``dual_clip = c > 1`` the loss of a token with
    ``A < 0`` is further bounded by ``-c A``.

    Args:
        logprobs: Shape (B, T), under the policy being trained (carries the gradient).
        old_logprobs: Shape (B, T), under the policy that sampled the tokens.
        advantages: Shape (B,) (one per sequence, broadcast) or (B, T).

    Returns:
        Shape (B, T): per-token loss, to be masked and aggregated by the caller.
    """
    adv = _per_token(advantages, logprobs)
    ratio = torch.exp(logprobs - old_logprobs)
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    loss = torch.maximum(unclipped, clipped)
    if dual_clip is not None:
        if dual_clip <= 1.0:
            raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
        loss = torch.where(adv < 0, torch.minimum(loss, -adv * dual_clip), loss)
    return loss


def clip_fractions(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
) -> tuple[Tensor, Tensor]:
    """Fractions of valid tokens whose gradient the clip removed, at the low and at the high bound.

    High: ``A > 0`` and ``r > 1 + clip_high``. Low: ``A < 0`` and ``r < 1 - clip_low``.
    Shapes as in ``clipped_surrogate``; returns two scalars.
    """
    adv = _per_token(advantages, logprobs)
    ratio = torch.exp(logprobs - old_logprobs)
    mask = response_mask.to(ratio.dtype)
    n = mask.sum().clamp(min=1)
    high = ((ratio > 1.0 + clip_high) & (adv > 0)).to(ratio.dtype)
    low = ((ratio < 1.0 - clip_low) & (adv < 0)).to(ratio.dtype)
    return (low * mask).sum() / n, (high * mask).sum() / n


def aggregate(
    per_token: Tensor,
    response_mask: Tensor,
    mode: str = "token-mean",
    num_tokens: Tensor | float | None = None,
    max_len: int | None = None,
    num_seqs: Tensor | float | None = None,
) -> Tensor:
    """Reduce a per-token loss (B, T) to a scalar.

    Modes:
        ``token-mean``: sum over valid tokens / number of valid tokens (DAPO's token-level loss,
            arXiv:2503.14476): responses of 100 and 1000 tokens weigh each token 1/1100.
        ``seq-mean-token-mean``: mean over each response, then mean over responses (GRPO as published):
            the same two responses weigh their tokens 1/200 and 1/2000.
        ``seq-mean-token-sum``: sum over each response, then mean over responses.
        ``seq-mean-token-sum-norm``: sum over each response divided by the constant ``max_len``, then
            mean over responses (Dr. GRPO, arXiv:2503.20783; as TRL's ``dr_grpo``).

    A sequence-level loss (shape (B,), e.g. SPPO's sequence-clipped objective) is averaged over sequences
    (``num_seqs``) whatever the mode: it has no tokens left to weigh.

    Args:
        per_token: Shape (B, T), or (B,) for a loss already per sequence.
        response_mask: Shape (B, T).
        num_tokens: Denominator for ``token-mean`` in place of this batch's valid-token count: pass the
            global count of the optimizer step so that gradient accumulation and several ranks weigh
            every token equally.
        num_seqs: Denominator over responses for the ``seq-mean-*`` modes, in place of B (same reason).
        max_len: The constant of ``seq-mean-token-sum-norm``; defaults to T.

    Returns:
        A scalar tensor.
    """
    if per_token.dim() == 1:
        return per_token.sum() / (per_token.shape[0] if num_seqs is None else num_seqs)
    mask = response_mask.to(per_token.dtype)
    # where, not a product: a non-finite value on a padding token must not turn the loss into NaN.
    masked = torch.where(response_mask.bool(), per_token, per_token.new_zeros(()))
    if mode == "token-mean":
        denom = mask.sum().clamp(min=1) if num_tokens is None else num_tokens
        return masked.sum() / denom
    seqs = per_token.shape[0] if num_seqs is None else num_seqs
    if mode == "seq-mean-token-mean":
        return (masked.sum(-1) / mask.sum(-1).clamp(min=1)).sum() / seqs
    if mode == "seq-mean-token-sum":
        return masked.sum() / seqs
    if mode == "seq-mean-token-sum-norm":
        return masked.sum() / (seqs * (per_token.shape[-1] if max_len is None else max_len))
    raise ValueError(f"unknown aggregation mode {mode!r}; choose one of {', '.join(AGGREGATION_MODES)}")


def value_loss(values: Tensor, old_values: Tensor, returns: Tensor, clip: float | None = None) -> Tensor:
    """Per-token squared error of the critic, optionally clipped around the rollout's values (PPO2).

    ``0.5 * max((V - R)^2, (V_old + clip(V - V_old, -c, c) - R)^2)``; without ``clip``, ``0.5 (V - R)^2``.

    Args:
        values: Shape (B, T), current predictions (carry the gradient).
        old_values: Shape (B, T), predictions at rollout time.
        returns: Shape (B, T), targets.

    Returns:
        Shape (B, T).
    """
    loss = (values - returns) ** 2
    if clip is not None:
        clipped = old_values + torch.clamp(values - old_values, -clip, clip)
        loss = torch.maximum(loss, (clipped - returns) ** 2)
    return 0.5 * loss


def explained_variance(values: Tensor, returns: Tensor, mask: Tensor) -> Tensor:
    """``1 - Var(R - V) / Var(R)`` over the masked entries: 1 is a perfect critic, 0 no better than a
    constant, negative worse. Shapes (B, T); returns a scalar, NaN when the returns do not vary (then
    it is undefined: any number would be an artefact of a tiny denominator). Compute it over a whole
    rollout, not per micro-batch, where constant returns are common.

    "Do not vary" allows for rounding: returns computed as advantages + values (``gae``) carry a
    floating-point error on the scale of the values, so a rollout whose rewards are all equal gets returns
    that differ slightly where they should be equal (in bfloat16 by up to a few parts in a thousand of the
    values). The returns vary when their standard deviation exceeds 1e-2 of the larger root-mean-square of the
    returns and the values (and 1e-4 absolutely): far below the spread of rewards that differ between
    responses (0/1 rewards with one right answer in 32 have a standard deviation near 0.17)."""
    m = mask.to(values.dtype)
    n = m.sum().clamp(min=1)

    def var(x: Tensor) -> Tensor:
        mean = (x * m).sum() / n
        return (((x - mean) ** 2) * m).sum() / n

    def mean_square(x: Tensor) -> Tensor:
        return (torch.where(m.bool(), x, 0.0) ** 2).sum() / n

    var_r = var(returns)
    defined = var_r > torch.clamp(1e-4 * torch.maximum(mean_square(returns), mean_square(values)), min=1e-8)
    return torch.where(defined, 1.0 - var(returns - values) / torch.where(defined, var_r, 1.0), torch.nan)
