"""VESPO (Variational Sequence-Level Soft Policy Optimization, arXiv:2602.10693): a smooth kernel of the
sequence importance weight replaces PPO's hard clip, for training that stays stable on stale data."""

from __future__ import annotations

import torch
from torch import Tensor

from rllight.algorithms import effective_sample_size, masked_mean, vespo_weight
from rllight.errors import RecipeError
from rllight.strategies.losses import PolicyLoss
from rllight.types import Rollout

__all__ = ["VESPO"]

WEIGHTS_AGAINST = ("trainer", "engine")


class VESPO(PolicyLoss):
    """VESPO's policy objective (arXiv:2602.10693; note 002).

    Per response, the sequence log-weight with no length normalisation,
    ``log W = sum_t (logp_t - behaviour_logp_t)``; the kernel ``phi(W) = W^c1 exp(c2 (1 - W))``, computed in
    log space and detached, with ``(c1, c2)`` by the sign of the response's advantage; and the per-token loss
    ``-phi(W) A_t logp_t`` (shape (B, T), aggregated by the recipe: token-mean in the paper). The gradient is
    ``phi(W) A grad log pi``: an importance-weighted REINFORCE whose weight is smoothly damped on both sides of
    W = 1 instead of clipped.

    Which log-probs are the behaviour policy's (``weight_against``):

    - ``trainer`` (default, as the authors' code): the trainer's own old log-probs (``rollout.old_logprobs``:
      the policy before this rollout's first update, scored in the update's own micro-batches; with a single
      update per rollout the live log-probs, detached), so W measures how far the updates have moved the policy
      and is exactly 1 on the first minibatch. In ``FloyedShen/VESPO``, ``recipe/vespo/code/core_algos.py``
      ``compute_policy_loss_vespo`` takes ``log_ratio = log_prob - old_log_prob``, where ``old_log_prob`` is
      the actor's recomputed ``old_log_probs`` (``recipe/vespo/code/trainer.py``, ``compute_log_prob``) or, with
      one minibatch and one epoch, ``log_prob.detach()`` (``recipe/vespo/code/dp_actor.py``,
      ``update_policy``). The engine/trainer mismatch is then a separate, optional correction: wrap this loss in
      ``rllight.strategies.TruncatedIS`` or ``MaskedIS`` (per token, outside phi; the authors instead add the
      log of verl's ``rollout_is_weights`` to log W before phi, and their sync scripts enable none).
    - ``engine``: note 002's literal form, the rollout engine's sampling log-probs (``rollout.sample_logprobs``,
      not recomputed by the trainer): W then also measures the engine/trainer mismatch (kernels, precision,
      and with top-p / top-k sampling the truncation) and, for asynchronous rollouts, the policy's lag. The
      authors' fully asynchronous script does this (``recipe/vespo/run/fully_async/vespo_S_1.0_N_4.sh`` sets
      ``async_training.use_rollout_log_probs=True``: the rollout's log-probs become the old ones).

    Staleness ``N = global batch / mini batch`` is the number of sequential optimizer updates per rollout:
    with R = data.batch_size * sampler.group_size responses per rollout, ``N = model.ppo_epochs * R /
    model.minibatch_size``. The paper trains at N = 8 and stays stable up to N = 64.

    Logged: ``policy/vespo_phi_mean``, ``policy/vespo_ess`` (normalised effective sample size of the phi
    weights, in (0, 1]), ``policy/vespo_ess_raw`` (of the raw weights W), ``policy/vespo_log_weight_mean``
    and ``policy/vespo_log_weight_absmax``.

    Args:
        c1_pos: Power c1 for A >= 0.
        c2_pos: Exponential damping c2 for A >= 0.
        c1_neg: Power c1 for A < 0.
        c2_neg: Exponential damping c2 for A < 0.
        weight_against: The behaviour log-probs of W: ``trainer`` (the trainer's old log-probs, as the
            authors' code) or ``engine`` (the rollout engine's sampling log-probs, note 002's literal form).
    """

    def __init__(self, c1_pos: float = 2.0, c2_pos: float = 3.0, c1_neg: float = 3.0, c2_neg: float = 2.0,
                 weight_against: str = "trainer"):
        for name, value in (("c1_pos", c1_pos), ("c1_neg", c1_neg)):
            if value < 0:
                raise RecipeError(f"model.policy_loss.{name} must be >= 0, got {value}")
        for name, value in (("c2_pos", c2_pos), ("c2_neg", c2_neg)):
            if value <= 0:  # c2 > 0 is what damps large weights; without it phi grows like W^c1
                raise RecipeError(f"model.policy_loss.{name} must be > 0, got {value}")
        if weight_against not in WEIGHTS_AGAINST:
            raise RecipeError(f"model.policy_loss.weight_against must be one of {', '.join(WEIGHTS_AGAINST)}, "
                              f"got {weight_against!r}")
        self.c1_pos = c1_pos
        self.c2_pos = c2_pos
        self.c1_neg = c1_neg
        self.c2_neg = c2_neg
        self.weight_against = weight_against

    def __call__(self, logprobs: Tensor, batch: Rollout) -> tuple[Tensor, dict[str, Tensor]]:
        mask = batch.response_mask
        valid = mask.bool()
        behaviour = batch.old_logprobs if self.weight_against == "trainer" else batch.sample_logprobs
        log_w = torch.where(valid, logprobs.detach() - behaviour, logprobs.new_zeros(())).sum(-1)
        seq_adv = masked_mean(batch.advantages, mask, dim=-1)  # its sign picks (c1, c2)
        phi = vespo_weight(log_w, seq_adv, self.c1_pos, self.c2_pos, self.c1_neg, self.c2_neg)
        loss = -phi.to(logprobs.dtype).unsqueeze(-1) * batch.advantages * logprobs
        stats = {
            "policy/vespo_phi_mean": phi.mean(),
            "policy/vespo_ess": effective_sample_size(torch.log(phi)),
            "policy/vespo_ess_raw": effective_sample_size(log_w),
            "policy/vespo_log_weight_mean": log_w.mean(),
            "policy/vespo_log_weight_absmax": log_w.abs().max(),
        }
        return loss, stats
