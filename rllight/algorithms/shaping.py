"""Reward shaping and group filtering of DAPO (Yu et al., arXiv:2503.14476) as pure tensor functions."""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["group_retention_probability", "mixed_groups", "soft_overlong_punishment"]


def soft_overlong_punishment(lengths: Tensor, max_len: int, cache_len: int) -> Tensor:
    """DAPO's soft overlong punishment R_len (arXiv:2503.14476, section 3.4), added to the task reward.

    With the expected length ``E = max_len - cache_len``::

        R_len(L) = 0                        if L <= E
                 = -(L - E) / cache_len     if E < L <= max_len   (linear inside the buffer)
                 = -1                       if L > max_len

    The paper uses ``max_len`` 20480 and ``cache_len`` 4096 (expected length 16384).

    Args:
        lengths: Shape (B,), response lengths in tokens.
        max_len: L_max, the longest response (the generation limit).
        cache_len: L_cache, the width of the punishment buffer below ``max_len``; 0 < cache_len <= max_len.

    Returns:
        Shape (B,), float32, in ``[-1, 0]``.
    """
    if not 0 < cache_len <= max_len:
        raise ValueError(f"need 0 < cache_len <= max_len, got cache_len={cache_len}, max_len={max_len}")
    length = lengths.to(torch.float32)
    expected = max_len - cache_len
    # Above max_len the linear ramp would pass -1; the clamp is the third case of the definition.
    return (-(length - expected) / cache_len).clamp(min=-1.0, max=0.0)


def mixed_groups(values: Tensor, group_ids: Tensor) -> Tensor:
    """Which rows belong to a group whose ``values`` are not all equal (DAPO's dynamic sampling keeps
    those groups: an all-correct or all-wrong group has zero group-relative advantage).

    Args:
        values: Shape (B,), e.g. rewards or 0/1 correctness.
        group_ids: Shape (B,), integer labels; equal labels form a group.

    Returns:
        Shape (B,), bool. A group of one response is never mixed.
    """
    if values.numel() == 0:
        return torch.zeros(0, dtype=torch.bool, device=values.device)
    _, inverse = torch.unique(group_ids, return_inverse=True)
    n = int(inverse.max()) + 1
    v = values.to(torch.float64)
    high = torch.full((n,), float("-inf"), dtype=v.dtype, device=v.device).scatter_reduce(0, inverse, v, "amax")
    low = torch.full((n,), float("inf"), dtype=v.dtype, device=v.device).scatter_reduce(0, inverse, v, "amin")
    return (high > low)[inverse]


def group_retention_probability(p: float | Tensor, group_size: int) -> float | Tensor:
    """Probability that a group of ``group_size`` independent responses with success rate ``p`` is
    kept by dynamic sampling, i.e. is neither all wrong nor all right:
    ``a_G(p) = 1 - (1 - p)^G - p^G`` (DAPO note 003). ``1 / a_G(p)`` groups are drawn per kept group
    on average: G = 16, p = 0.01 gives a = 0.14854, so about 6.73 groups.

    Args:
        p: Success probability, a float or a tensor of any shape with values in [0, 1].
        group_size: G, responses per prompt.
    """
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    return 1 - (1 - p) ** group_size - p**group_size
