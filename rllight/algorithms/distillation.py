"""Logit-level distillation: divergences between a teacher's and a student's next-token distributions.

The sampled-token estimator of on-policy distillation (``rllight.strategies.OnPolicyDistillation``: Thinking
Machines' per-token reverse KL, log pi_T(y_t) - log pi_S(y_t) as an advantage) reads one log-prob per token. These
functions compare whole distributions at each position, as GKD does (Agarwal et al., arXiv:2306.13649, eq. 1; TRL's
``GKDTrainer.generalized_jsd_loss`` over the vocabulary) or over the teacher's top-k tokens, as NeMo-RL's
distillation loss does (``teacher_topk_logits``).

Over the teacher's top-k tokens both distributions are made proper over k + 1 outcomes: the k tokens, and a "rest"
bucket holding the mass of every other token (``with_rest``). The student's log-probs of the k tokens are its
log-softmax over the full vocabulary gathered at the teacher's ids (not renormalised over the k), so the student's
mass outside the k tokens is penalised through the rest bucket instead of being dropped; NeMo-RL's default
(``zero_outside_topk: false``) renormalises both over the k tokens instead, which cannot see that mass.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

__all__ = ["MIN_REST_PROB", "chunked_teacher_divergence", "forward_kl", "generalized_jsd", "log1mexp", "reverse_kl",
           "teacher_divergence", "with_rest"]

MIN_REST_PROB = 1e-8
"""The rest bucket's smallest probability. Where the k tokens hold all of a distribution's mass in float32 its rest
would be 0, and a divergence that divides by it (the reverse KL's log q / p with p = 0) infinite; floored, it stays
finite (log 1e-8 = -18.4) and its gradient too."""


def log1mexp(x: Tensor) -> Tensor:
    """log(1 - exp(x)) for x <= 0, accurate at both ends (Maechler, "Accurately computing log(1 - exp(-|a|))",
    2012): log(-expm1(x)) near 0, log1p(-exp(x)) below -log 2. Shape: any, elementwise."""
    return torch.where(x > -math.log(2.0), torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


def with_rest(logprobs: Tensor, min_rest: float = MIN_REST_PROB) -> Tensor:
    """The log-probs of k outcomes of a distribution over more, with a last "rest" outcome appended that holds the
    mass of all the others: log(1 - sum_k p), at least ``log(min_rest)``. The floor is applied to the input (the
    k outcomes' total clamped at ``1 - min_rest``), so the gradient is finite where it binds (zero there).

    Shape: (..., k) -> (..., k + 1).
    """
    total = torch.logsumexp(logprobs, dim=-1, keepdim=True).clamp(max=math.log1p(-min_rest))
    return torch.cat([logprobs, log1mexp(total)], dim=-1)


def _kl(p_log: Tensor, q_log: Tensor) -> Tensor:
    """KL(P || Q) = sum_i p_i (log p_i - log q_i) over the last dimension, an outcome of p_i = 0 counting 0."""
    p = p_log.exp()
    return torch.where(p > 0, p * (p_log - q_log), torch.zeros_like(p)).sum(-1)


def forward_kl(student: Tensor, teacher: Tensor) -> Tensor:
    """KL(teacher || student) = sum_i p_T(i) (log p_T(i) - log p_S(i)): the forward, mass-covering KL of supervised
    distillation (GKD's beta = 0 in TRL's convention).

    Args:
        student: Shape (..., n), the student's log-probs over n outcomes (a proper distribution).
        teacher: Shape (..., n), the teacher's, over the same outcomes.

    Returns:
        Shape (...).
    """
    return _kl(teacher, student)


def reverse_kl(student: Tensor, teacher: Tensor) -> Tensor:
    """KL(student || teacher) = sum_i p_S(i) (log p_S(i) - log p_T(i)): the reverse, mode-seeking KL whose single-
    sample estimate on the sampled token is on-policy distillation's advantage (TRL's beta = 1). Shapes as
    ``forward_kl``."""
    return _kl(student, teacher)


def generalized_jsd(student: Tensor, teacher: Tensor, beta: float) -> Tensor:
    """GKD's generalised Jensen-Shannon divergence (Agarwal et al., arXiv:2306.13649, eq. 1) in TRL's convention
    (``GKDConfig.beta``, ``GKDTrainer.generalized_jsd_loss``), P the teacher and Q the student:

        JSD_beta(P || Q) = beta KL(P || M) + (1 - beta) KL(Q || M),   M = beta P + (1 - beta) Q

    and at the ends, where this tends to 0, TRL's limits: beta = 0 is the forward KL(P || Q) (``forward_kl``),
    beta = 1 the reverse KL(Q || P) (``reverse_kl``). Shapes as ``forward_kl``.
    """
    if beta == 0.0:
        return forward_kl(student, teacher)
    if beta == 1.0:
        return reverse_kl(student, teacher)
    mixture = torch.logaddexp(teacher + math.log(beta), student + math.log1p(-beta))
    return beta * _kl(teacher, mixture) + (1.0 - beta) * _kl(student, mixture)


def teacher_divergence(student_logits: Tensor, teacher_logprobs: Tensor, teacher_ids: Tensor | None, beta: float,
                       temperature: float = 1.0) -> Tensor:
    """The divergence ``generalized_jsd`` (beta 0: forward KL, 1: reverse KL) between the teacher's and the
    student's next-token distributions at each position, both at ``temperature`` (the student's logits are divided
    by it here; the teacher's log-probs come at it).

    With ``teacher_ids`` (the teacher's top-k tokens) both are distributions over k + 1 outcomes (``with_rest``):
    the student's log-softmax over the full vocabulary gathered at the k ids, and the rest; the teacher's k
    log-probs (of its full distribution) and its rest. Without (None), ``teacher_logprobs`` covers the vocabulary in
    id order and the divergence is the full one. Computed in float32 at least.

    Args:
        student_logits: Shape (..., V), the student's raw logits.
        teacher_logprobs: Shape (..., k), or (..., V) with ``teacher_ids`` None.
        teacher_ids: Shape (..., k), int, or None.

    Returns:
        Shape (...).
    """
    dtype = torch.promote_types(student_logits.dtype, torch.float32)
    student = torch.log_softmax(student_logits.to(dtype) / temperature, dim=-1)
    teacher = teacher_logprobs.to(dtype)
    if teacher_ids is not None:
        student = with_rest(student.gather(-1, teacher_ids.long()))
        teacher = with_rest(teacher)
    return generalized_jsd(student, teacher, beta)


def chunked_teacher_divergence(hidden: Tensor, head: Callable[[Tensor], Tensor], teacher_logprobs: Tensor,
                               teacher_ids: Tensor | None, beta: float, temperature: float = 1.0,
                               chunk_size: int = 1024) -> Tensor:
    """``teacher_divergence(head(hidden), ...)`` a chunk of ``chunk_size`` positions at a time, each chunk's logits
    recomputed in the backward pass (activation checkpointing) rather than kept: about ``3 * chunk_size * V`` floats
    of logits exist at once, never the (N, V) of every position.

    Args:
        hidden: Shape (N, H), the student's last hidden state at N positions.
        head: The output layer, (n, H) -> (n, V) logits.
        teacher_logprobs: Shape (N, k), or (N, V) with ``teacher_ids`` None.
        teacher_ids: Shape (N, k), int, or None.

    Returns:
        Shape (N,).
    """

    def part(h: Tensor, values: Tensor, ids: Tensor | None) -> Tensor:
        return teacher_divergence(head(h), values, ids, beta, temperature)

    out = []
    for s in range(0, hidden.shape[0], chunk_size):
        ids = None if teacher_ids is None else teacher_ids[s:s + chunk_size]
        args = (hidden[s:s + chunk_size], teacher_logprobs[s:s + chunk_size], ids)
        out.append(checkpoint(part, *args, use_reentrant=False) if torch.is_grad_enabled() else part(*args))
    return torch.cat(out) if out else hidden.new_zeros(0, dtype=torch.float32)
