"""Advantage estimators as pure tensor functions.

Shapes: B responses, T response columns. ``response_mask`` marks the valid response tokens of each row
(a contiguous prefix in rollouts made by rllight, but nothing here relies on that).
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["gae", "group_relative", "discounted_cumsum"]

# Tokens per block of the two-level scan in ``discounted_cumsum``. 64 keeps the (B, C, C) decay matrix
# small (1 MiB at B=256) while cutting the sequential depth of the recurrence to zero.
_CHUNK = 64


def _as_row_tensor(x: float | Tensor, batch: int, like: Tensor) -> Tensor:
    """A float or a (B,) tensor as a (B,) tensor with the dtype and device of ``like``."""
    if isinstance(x, Tensor) and x.dim() == 0:
        x = float(x)
    if isinstance(x, Tensor):
        if x.dim() != 1 or x.shape[0] != batch:
            raise ValueError(f"expected a float or a ({batch},) tensor, got shape {tuple(x.shape)}")
        return x.to(dtype=like.dtype, device=like.device)
    return torch.full((batch,), float(x), dtype=like.dtype, device=like.device)


def discounted_cumsum(x: Tensor, decay: Tensor) -> Tensor:
    """Reverse discounted cumulative sum ``y_t = x_t + decay * y_{t+1}`` with one decay per row.

    Computed without a loop over T: tokens are split into blocks of ``_CHUNK``; inside a block the sum
    is a batched matmul with the upper-triangular matrix ``decay^(k-t)``, and the carries between blocks
    are the same construction one level up (decay ``decay^C`` between block starts). Powers are only
    taken with non-negative exponents, so nothing overflows for long sequences (terms underflow to 0,
    which is their value in float arithmetic anyway).

    Args:
        x: Shape (B, T).
        decay: Shape (B,), typically ``gamma * lam``.

    Returns:
        Shape (B, T).
    """
    batch, length = x.shape
    chunk = min(_CHUNK, max(length, 1))
    n_chunks = -(-length // chunk)
    pad = n_chunks * chunk - length
    xc = (torch.nn.functional.pad(x, (0, pad)) if pad else x).reshape(batch, n_chunks, chunk)

    def decay_matrix(base: Tensor, size: int) -> Tensor:
        # M[b, i, j] = base_b^(j - i) for j >= i, else 0: row i sums the entries at and after i.
        # The 2*size-1 distinct entries per row are computed once and laid out by one gather, which is
        # several times cheaper than an elementwise pow over the (B, size, size) matrix.
        k = torch.arange(-(size - 1), size, device=x.device, dtype=x.dtype)
        diagonals = torch.pow(base.view(batch, 1), k.clamp(min=0)) * (k >= 0)  # (B, 2 size - 1)
        idx = torch.arange(size, device=x.device)
        lookup = idx.view(1, size) - idx.view(size, 1) + (size - 1)  # (size, size)
        return diagonals[:, lookup]

    inner = decay_matrix(decay, chunk)  # (B, C, C)
    local = torch.bmm(xc, inner.transpose(1, 2))  # sums within each block, (B, N, C)
    # Value at each block start, including everything after the block: a discounted sum over blocks
    # of the block-local sums at their first position, with decay^C between consecutive blocks.
    outer = decay_matrix(torch.pow(decay, chunk), n_chunks)  # (B, N, N)
    starts = torch.bmm(outer, local[:, :, :1]).squeeze(-1)  # (B, N)
    # Carry into block m is the start value of block m+1, discounted by decay^(C - i) at offset i.
    carry = torch.nn.functional.pad(starts[:, 1:], (0, 1))  # (B, N)
    offsets = torch.arange(chunk, device=x.device, dtype=x.dtype)
    tail = torch.pow(decay.view(batch, 1), (chunk - offsets).view(1, chunk))  # (B, C)
    out = local.addcmul_(carry.unsqueeze(-1), tail.unsqueeze(1))
    return out.reshape(batch, n_chunks * chunk)[:, :length]


def packing_order(valid: Tensor) -> Tensor:
    """Shape (B, T), long: per row, the positions of ``valid`` tokens first (in order), then the others, so
    that ``x.gather(1, order)`` packs a row's valid tokens to the left without gaps."""
    t = valid.shape[1]
    key = (~valid).long() * t + torch.arange(t, device=valid.device)  # valid first, each group in order
    return key.argsort(dim=1)


def unpack(packed: Tensor, order: Tensor) -> Tensor:
    """The inverse of ``packed = x.gather(1, order)``: values back at their original positions."""
    return torch.empty_like(packed).scatter_(1, order, packed)


def gae(
    token_rewards: Tensor,
    values: Tensor,
    response_mask: Tensor,
    gamma: float | Tensor = 1.0,
    lam: float | Tensor = 0.95,
) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation (Schulman et al., arXiv:1506.02438).

    ``delta_t = r_t + gamma V_{t+1} - V_t`` and ``A_t = sum_l (gamma lam)^l delta_{t+l}``, with values
    after the last valid token counted as 0. ``gamma = lam = 1`` gives the Monte-Carlo advantage
    ``G_t - V_t``. No whitening here: that is a separate, optional step (``masked_whiten``).

    Args:
        token_rewards: Shape (B, T). Outcome rewards sit on the last response token.
        values: Shape (B, T). V(s_t) for each response token.
        response_mask: Shape (B, T), bool or 0/1.
        gamma: Discount, a float or shape (B,).
        lam: GAE lambda, a float or shape (B,) (one lambda per sequence, e.g. VAPO's length-adaptive
            lambda).

    Returns:
        ``(advantages, returns)``, each shape (B, T), zero outside ``response_mask``;
        ``returns = advantages + values`` on valid tokens.
    """
    valid = response_mask.bool()
    if bool((valid[:, 1:] & ~valid[:, :-1]).any()):
        # Gaps inside a row (a multi-turn episode: observation tokens are not actions): GAE runs over the
        # model's tokens only, the observation folded into the transition to the next model token.
        order = packing_order(valid)
        adv, ret = gae(token_rewards.gather(1, order), values.gather(1, order), valid.gather(1, order), gamma, lam)
        return unpack(adv, order), unpack(ret, order)
    mask = valid.to(values.dtype)
    batch = values.shape[0]
    gamma_t = _as_row_tensor(gamma, batch, values)
    lam_t = _as_row_tensor(lam, batch, values)
    # where, not a product: a NaN or inf left in the padding must not leak into valid tokens.
    zero = values.new_zeros(())
    v = torch.where(valid, values, zero)
    next_v = torch.nn.functional.pad(v[:, 1:], (0, 1))
    # In place from here: at (256, 4096) every fresh (B, T) buffer costs as much as the scan itself.
    deltas = torch.where(valid, token_rewards, zero).addcmul_(next_v, gamma_t.unsqueeze(1)).sub_(v)
    advantages = discounted_cumsum(deltas, gamma_t * lam_t).mul_(mask)
    returns = next_v.copy_(advantages).add_(v)
    return advantages, returns


def group_relative(rewards: Tensor, group_ids: Tensor, scale_by_std: bool = True, eps: float = 1e-6) -> Tensor:
    """Group-relative advantage: GRPO (Shao et al., arXiv:2402.03300) or Dr. GRPO (arXiv:2503.20783).

    ``A_i = (R_i - mean_g) / (std_g + eps)`` with the unbiased group std (as ``torch.std``, like verl and
    TRL), or ``A_i = R_i - mean_g`` when ``scale_by_std`` is False (Dr. GRPO). A group of one sample, or
    a group whose rewards are all equal, gets advantage 0.

    Args:
        rewards: Shape (B,).
        group_ids: Shape (B,), any integer labels; equal labels form a group.

    Returns:
        Shape (B,).
    """
    r, inverse, n = group_index(rewards, group_ids)
    mean = group_sum(r, inverse, n.shape[0]) / n
    centred = r - mean[inverse]
    alone = n[inverse] <= 1
    if not scale_by_std:
        return torch.where(alone, torch.zeros_like(centred), centred)
    std = torch.sqrt(group_sum(centred * centred, inverse, n.shape[0]) / (n - 1).clamp(min=1))
    adv = centred / (std[inverse] + eps)
    return torch.where(alone, torch.zeros_like(adv), adv)


def group_index(values: Tensor, group_ids: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``(values as floats, group index of each row (B,), size of each group (G,))`` for any integer
    group labels; the shared first step of the group-baseline estimators."""
    _, inverse, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
    v = values if values.is_floating_point() else values.to(torch.float32)
    return v, inverse, counts.to(v.dtype)


def group_sum(values: Tensor, inverse: Tensor, num_groups: int) -> Tensor:
    """Per-group sums (G,) of ``values`` (B,) under the row-to-group index ``inverse``."""
    return values.new_zeros(num_groups).index_add_(0, inverse, values)
