"""VAPO's advantage estimator and positive-example loss (Yue et al., arXiv:2504.05118; VAPO note 000).

- ``DecoupledGAE``: GAE whose value targets use their own lambda (1.0: Monte-Carlo returns, from
  VC-PPO, arXiv:2503.01491) while the policy's advantages use a fixed or length-adaptive lambda.
- Lambda schedules, one per sequence: ``FixedLambda``, ``AdaptiveLambda`` (note 000, eq. 7),
  ``VAPOLambda`` (the paper's ``1 - 1 / (alpha L)``). Swapping one for another is a one-line ablation.
- ``PositiveExampleNLL``: wraps a policy loss and adds the paper's NLL of this batch's correct responses.
"""

from __future__ import annotations

import torch
from jsonargparse import lazy_instance
from torch import Tensor

from rllight.algorithms import gae, masked_mean, masked_whiten
from rllight.algorithms.lambdas import adaptive_lambda, vapo_lambda
from rllight.errors import RecipeError
from rllight.strategies.advantages import AdvantageEstimator
from rllight.strategies.losses import ClippedSurrogate, PolicyLoss
from rllight.types import Rollout


class LambdaSchedule:
    """Base class: ``__call__(lengths (B,)) -> lambda``, a float or one lambda per sequence (B,)."""

    def __call__(self, lengths: Tensor) -> float | Tensor:
        raise NotImplementedError


class FixedLambda(LambdaSchedule):
    """The same lambda for every sequence (PPO; VAPO's "fixed lambda" ablation).

    Args:
        lam: GAE lambda in [0, 1].
    """

    def __init__(self, lam: float = 0.95):
        if not 0.0 <= lam <= 1.0:
            raise RecipeError(f"model.advantage.policy_lambda.lam must be in [0, 1], got {lam}")
        self.lam = lam

    def __call__(self, lengths: Tensor) -> float:
        return self.lam


class AdaptiveLambda(LambdaSchedule):
    """``lam_min + (lam_max - lam_min) * sigmoid((L - mean_L) / max(std_L, 1))`` over the batch's
    response lengths (VAPO note 000, eq. 7; ``rllight.algorithms.adaptive_lambda``).

    Args:
        lam_min: Lambda of the shortest responses (0.3 in the note).
        lam_max: Lambda of the longest responses (0.95 in the note).
    """

    def __init__(self, lam_min: float = 0.3, lam_max: float = 0.95):
        if not 0.0 <= lam_min <= lam_max <= 1.0:
            raise RecipeError(f"model.advantage.policy_lambda: need 0 <= lam_min <= lam_max <= 1, got "
                              f"lam_min={lam_min}, lam_max={lam_max}")
        self.lam_min = lam_min
        self.lam_max = lam_max

    def __call__(self, lengths: Tensor) -> Tensor:
        return adaptive_lambda(lengths, self.lam_min, self.lam_max)


class VAPOLambda(LambdaSchedule):
    """``1 - 1 / (alpha L)``, clamped at 0 below ``L = 1 / alpha`` (VAPO paper, arXiv:2504.05118, as
    NeMo-RL ships it; ``rllight.algorithms.vapo_lambda``).

    Args:
        alpha: 0.05 in the paper (lambda 0.8 at 100 tokens, 0.98 at 1000).
    """

    def __init__(self, alpha: float = 0.05):
        if alpha <= 0:
            raise RecipeError(f"model.advantage.policy_lambda.alpha must be > 0, got {alpha}")
        self.alpha = alpha

    def __call__(self, lengths: Tensor) -> Tensor:
        return vapo_lambda(lengths, self.alpha)


class DecoupledGAE(AdvantageEstimator):
    """GAE with separate lambdas for the policy and the value targets (decoupled GAE of VC-PPO,
    arXiv:2503.01491, used by VAPO, arXiv:2504.05118).

    Policy advantages: ``gae(token_rewards, values, lam = policy_lambda(L))``, optionally whitened.
    Value targets (``returns``): ``gae(..., lam = value_lam) + values``; with ``gamma = value_lam = 1``
    they are the Monte-Carlo returns ``G_t``, so the critic is fitted without bootstrapping on itself.
    ``value_lam: null`` couples them again (targets use the policy's lambda, as plain PPO).

    The update order of note 000 (K_v critic updates on the fresh rollout, then values and advantages
    recomputed with the updated critic, then the policy update) is ``model.critic_updates_first``.

    Lambda statistics go to ``rollout.extras`` as ``advantage/lambda_{mean,min,max}``.

    Args:
        policy_lambda: The policy's lambda, one per sequence (``AdaptiveLambda``, ``VAPOLambda``) or
            ``FixedLambda``.
        value_lam: Lambda of the value targets (1.0 = Monte-Carlo; null = the policy's lambda).
        gamma: Discount (1.0 for outcome rewards).
        whiten: Normalise advantages over the batch's valid tokens.
    """

    needs_values = True
    uses_token_rewards = True

    def __init__(self, policy_lambda: LambdaSchedule = lazy_instance(AdaptiveLambda), value_lam: float | None = 1.0,
                 gamma: float = 1.0, whiten: bool = True):
        if value_lam is not None and not 0.0 <= value_lam <= 1.0:
            raise RecipeError(f"model.advantage.value_lam must be in [0, 1] or null, got {value_lam}")
        if not 0.0 <= gamma <= 1.0:
            raise RecipeError(f"model.advantage.gamma must be in [0, 1], got {gamma}")
        self.policy_lambda = policy_lambda
        self.value_lam = value_lam
        self.gamma = gamma
        self.whiten = whiten

    def __call__(self, rollout: Rollout) -> tuple[Tensor, Tensor]:
        if rollout.values is None or rollout.values.dim() != 2:
            raise ValueError("DecoupledGAE needs token-level values: set model.critic (e.g. rllight.critics.ValueHead)")
        lengths = rollout.response_lengths
        lam = self.policy_lambda(lengths)
        advantages, returns = gae(rollout.token_rewards, rollout.values, rollout.response_mask, self.gamma, lam)
        if self.value_lam is not None:
            _, returns = gae(rollout.token_rewards, rollout.values, rollout.response_mask, self.gamma, self.value_lam)
        if self.whiten:
            advantages = masked_whiten(advantages, rollout.response_mask)
        lam_t = lam if isinstance(lam, Tensor) else torch.full_like(lengths, lam, dtype=torch.float32)
        if lam_t.numel():
            rollout.extras.update({"advantage/lambda_mean": float(lam_t.float().mean()),
                                   "advantage/lambda_min": float(lam_t.min()),
                                   "advantage/lambda_max": float(lam_t.max())})
        return advantages, returns


class PositiveExampleNLL(PolicyLoss):
    """A policy loss plus ``coef`` times the negative log-likelihood of this batch's correct responses
    (VAPO paper's positive-example LM loss, arXiv:2504.05118, mu = 0.1).

    Per token: ``loss(...) + coef * 1[correct_i] * (-log pi(y_t))``.

    Normalisation: the NLL rides on the policy loss's aggregation. With ``token-mean`` the added term is
    ``coef / N * sum over correct responses' tokens of -log pi``, where N counts every valid token of
    the optimizer step (correct or not), over all micro-batches, so gradient accumulation does not
    change it. The paper divides by the correct responses' tokens only; this term equals the paper's
    times ``N_correct / N``, the share of the step's tokens that belong to correct responses (a second
    global count would be needed for the paper's denominator under accumulation).

    Args:
        loss: The policy objective to wrap (per-token, e.g. ClippedSurrogate with clip-higher).
        coef: mu, the weight of the NLL (0.1 in the paper).
    """

    def __init__(self, loss: PolicyLoss = lazy_instance(ClippedSurrogate, clip_low=0.2, clip_high=0.28),
                 coef: float = 0.1):
        if coef < 0:
            raise RecipeError(f"model.policy_loss.coef must be >= 0, got {coef}")
        self.loss = loss
        self.coef = coef

    def __call__(self, logprobs: Tensor, batch: Rollout) -> tuple[Tensor, dict[str, Tensor]]:
        per_token, stats = self.loss(logprobs, batch)
        if per_token.dim() != 2:
            raise ValueError("PositiveExampleNLL wraps per-token policy losses (B, T), not sequence-level ones")
        if batch.correct is None:
            raise ValueError("PositiveExampleNLL needs rollout.correct (set by the reward)")
        positive = (batch.correct > 0).to(logprobs.dtype).unsqueeze(-1)  # (B, 1)
        stats = dict(stats)
        stats["policy/positive_nll"] = masked_mean(-logprobs.detach(), batch.response_mask * positive)
        stats["policy/positive_fraction"] = positive.mean()
        return per_token + self.coef * positive * (-logprobs), stats
