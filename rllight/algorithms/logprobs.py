"""Per-token log-probabilities and entropy, directly from logits or chunked from hidden states."""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["logprobs_and_entropy", "chunked_logprobs_and_entropy"]


def logprobs_and_entropy(logits: Tensor, targets: Tensor, temperature: float = 1.0) -> tuple[Tensor, Tensor]:
    """Log-probability of ``targets`` and the entropy of the sampling distribution at each position.

    The logits are divided by ``temperature`` first, so that the result is the log-probability under
    the distribution the rollout engine sampled from. Computed in float32 at least (float64 stays).

    Args:
        logits: Shape (B, T, V).
        targets: Shape (B, T), token ids.

    Returns:
        ``(logprobs, entropy)``, each shape (B, T).
    """
    logp = torch.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature, dim=-1)
    token_logp = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp.exp() * logp).sum(-1)
    return token_logp, entropy


# Output-layer rows per product when a chunk's logits are computed in a lower dtype (autocast): each product casts
# this many rows of the weight (4.7 MB at H = 576 in bfloat16), never the whole matrix (57 MB for SmolLM2).
LOW_PRECISION_SLICE = 4096


def _low_precision(device: torch.device) -> torch.dtype | None:
    """The dtype autocast computes products in on ``device``, None where autocast is off."""
    return torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else None


def _weight_slices(weight: Tensor, low: torch.dtype):
    """The output layer ``LOW_PRECISION_SLICE`` rows at a time: (the rows, their weight cast to ``low``)."""
    for v in range(0, weight.shape[0], LOW_PRECISION_SLICE):
        part = slice(v, v + LOW_PRECISION_SLICE)
        yield part, weight[part].to(low)


def _chunk_logp(h: Tensor, weight: Tensor, bias: Tensor | None, temperature: float,
                low: torch.dtype | None = None) -> Tensor:
    """log-softmax of one chunk's logits, in place in the logits buffer (one (rows, V) allocation).

    With ``low`` (the autocast dtype) the products run in ``low`` as autocast's would, a slice of the output
    layer at a time written into the float32 buffer: no full low-precision copy of the weight, nor of the logits,
    exists at once. Shapes: h (rows, H), weight (V, H) -> (rows, V)."""
    if low is None or h.dtype == low:
        logits = torch.nn.functional.linear(h, weight, bias)
        if logits.dtype not in (torch.float32, torch.float64):
            logits = logits.float()  # at least float32
    else:
        logits = h.new_empty(h.shape[0], weight.shape[0], dtype=torch.promote_types(h.dtype, torch.float32))
        h_low = h.to(low)
        with torch.autocast(h.device.type, enabled=False):
            for part, w_low in _weight_slices(weight, low):
                logits[:, part] = torch.nn.functional.linear(h_low, w_low, None if bias is None else bias[part].to(low))
    if temperature != 1.0:
        logits.div_(temperature)
    return logits.sub_(torch.logsumexp(logits, dim=-1, keepdim=True))


def _grad_hidden(g: Tensor, weight: Tensor, low: torch.dtype | None) -> Tensor:
    """``g @ weight`` (the gradient of a chunk's hidden states), its products in ``low`` a slice of the output
    layer at a time when given, summed in float32. Shapes: g (rows, V), weight (V, H) -> (rows, H)."""
    if low is None or g.dtype == low:
        return g @ weight.to(g.dtype)
    out = g.new_zeros(g.shape[0], weight.shape[1])
    with torch.autocast(g.device.type, enabled=False):
        for part, w_low in _weight_slices(weight, low):
            out += g[:, part].to(low) @ w_low
    return out


class _ChunkedLogprobs(torch.autograd.Function):
    """Forward and backward over row chunks; only one chunk's (rows, V) logits exist at a time and
    nothing of size V is saved for backward (the chunk is recomputed there). Element-wise work is done
    in place: at V = 49152 every extra (rows, V) pass costs about as much as the matmul saved. Under autocast
    the products run in its dtype, as they would outside this function, with the output layer cast a slice at a
    time (``_chunk_logp``): a bfloat16 update then holds no more memory here than a float32 one."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, chunk_size):
        rows = hidden.shape[0]
        dtype = torch.promote_types(hidden.dtype, torch.float32)
        token_logp = hidden.new_empty(rows, dtype=dtype)
        entropy = hidden.new_empty(rows, dtype=dtype)
        low = _low_precision(hidden.device)
        with torch.no_grad():
            for s in range(0, rows, chunk_size):
                logp = _chunk_logp(hidden[s : s + chunk_size], weight, bias, temperature, low)
                token_logp[s : s + chunk_size] = logp.gather(-1, targets[s : s + chunk_size, None]).squeeze(-1)
                entropy[s : s + chunk_size] = -(logp.exp().mul_(logp)).sum(-1)
        ctx.save_for_backward(hidden, weight, bias, targets, entropy)
        ctx.temperature = temperature
        ctx.chunk_size = chunk_size
        ctx.low = low  # the backward pass computes in the forward pass's dtype, as autocast's backward does
        return token_logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        hidden, weight, bias, targets, entropy = ctx.saved_tensors
        t, c = ctx.temperature, ctx.chunk_size
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        acc = torch.promote_types(weight.dtype, torch.float32)
        grad_weight = torch.zeros(weight.shape, dtype=acc, device=weight.device) if ctx.needs_input_grad[1] else None
        grad_bias = None
        if bias is not None and ctx.needs_input_grad[2]:
            grad_bias = torch.zeros(bias.shape, dtype=acc, device=bias.device)
        w = weight.to(acc)
        for s in range(0, hidden.shape[0], c):
            h = hidden[s : s + c]
            g_lp, g_ent = grad_logp[s : s + c, None], grad_entropy[s : s + c, None]
            with torch.no_grad():
                g = _chunk_logp(h, weight, bias, t, ctx.low)
                p = g.exp()
                # dL/dz = g_lp (onehot(y) - p) + g_ent (-p (log p + H)), z = logits / t, built in place:
                # g = p * (-(log p + H) g_ent - g_lp) + g_lp onehot(y).
                g.add_(entropy[s : s + c, None]).mul_(-g_ent).sub_(g_lp).mul_(p)
                del p
                g.scatter_add_(-1, targets[s : s + c, None], g_lp.to(g.dtype))
                if t != 1.0:
                    g.div_(t)
                if grad_hidden is not None:
                    grad_hidden[s : s + c] = _grad_hidden(g, w, ctx.low).to(hidden.dtype)
                if grad_weight is not None:
                    grad_weight.addmm_(g.t(), h.to(acc))
                if grad_bias is not None:
                    grad_bias += g.sum(0)
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        if grad_bias is not None:
            grad_bias = grad_bias.to(bias.dtype)
        return grad_hidden, grad_weight, grad_bias, None, None, None


def chunked_logprobs_and_entropy(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    temperature: float = 1.0,
    bias: Tensor | None = None,
    chunk_size: int = 1024,
) -> tuple[Tensor, Tensor]:
    """``logprobs_and_entropy(hidden @ weight.T + bias, targets, temperature)`` without ever holding the
    full (B, T, V) float32 logits: rows are processed ``chunk_size`` at a time in the forward pass, and
    recomputed chunk by chunk in the backward pass. Same values and gradients as the direct path (up to
    float rounding); peak extra memory is about ``3 * chunk_size * V`` floats.

    Args:
        hidden: Shape (B, T, H), the last hidden state at the positions predicting ``targets``.
        weight: Shape (V, H), the output layer (``lm_head.weight``).
        targets: Shape (B, T), token ids.
        bias: Shape (V,) or None.

    Returns:
        ``(logprobs, entropy)``, each shape (B, T), float32 (float64 for float64 inputs).
    """
    b, t, h = hidden.shape
    lp, ent = _ChunkedLogprobs.apply(hidden.reshape(b * t, h), weight, bias, targets.reshape(b * t), temperature,
                                     chunk_size)
    return lp.view(b, t), ent.view(b, t)
