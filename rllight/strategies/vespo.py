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


class VESPO(PolicyLoss):
    """VESPO's policy objective (arXiv:2602.10693; note 002).

    Per response, the sequence log-weight against the *behaviour* policy (the rollout engine's sampling
    log-probs, ``rollout.sample_logprobs``, not recomputed by the trainer) with no length normalisation,
    ``log W = sum_t (logp_t - behaviour_logp_t)``; the kernel ``phi(W) = W^c1 exp(c2 (1 - W))``,
    computed in log space and detached, with ``(c1, c2)`` by the sign of the response's advantage; and the
    per-token loss ``-phi(W) A_t logp_t`` (shape (B, T), aggregated by the recipe: token-mean in the
    paper). The gradient is ``phi(W) A grad log pi``: an importance-weighted REINFORCE whose weight is
    smoothly damped on both sides of W = 1 instead of clipped. With top-p / top-k sampling the engine's
    log-probs are those of the truncated distribution, so W then also measures that truncation.

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
    """

    def __init__(self, c1_pos: float = 2.0, c2_pos: float = 3.0, c1_neg: float = 3.0, c2_neg: float = 2.0):
        for name, value in (("c1_pos", c1_pos), ("c1_neg", c1_neg)):
            if value < 0:
                raise RecipeError(f"model.policy_loss.{name} must be >= 0, got {value}")
        for name, value in (("c2_pos", c2_pos), ("c2_neg", c2_neg)):
            if value <= 0:  # c2 > 0 is what damps large weights; without it phi grows like W^c1
                raise RecipeError(f"model.policy_loss.{name} must be > 0, got {value}")
        self.c1_pos = c1_pos
        self.c2_pos = c2_pos
        self.c1_neg = c1_neg
        self.c2_neg = c2_neg

    def __call__(self, logprobs: Tensor, batch: Rollout) -> tuple[Tensor, dict[str, Tensor]]:
        mask = batch.response_mask
        valid = mask.bool()
        log_w = torch.where(valid, logprobs.detach() - batch.sample_logprobs, logprobs.new_zeros(())).sum(-1)
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
