"""VAPO's advantage estimator and positive-example loss (Yue et al., arXiv:2504.05118; VAPO note 000).

- ``DecoupledGAE``: GAE whose value targets use their own lambda (1.0: Monte-Carlo returns, from
  VC-PPO, arXiv:2503.01491) while the policy's advantages use a fixed or length-adaptive lambda.
- Lambda schedules, one per sequence: ``FixedLambda``, ``AdaptiveLambda`` (note 000, eq. 7),
  ``VAPOLambda`` (the paper's ``1 - 1 / (alpha L)``). Swapping one for another is a one-line ablation.
- ``PositiveExampleNLL``: wraps a policy loss and adds the paper's NLL of this batch's correct responses.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import Tensor

from rllight._compat import lazy_default
from rllight.algorithms import gae, masked_mean, masked_whiten
from rllight.algorithms.lambdas import adaptive_lambda, vapo_lambda
from rllight.errors import RecipeError
from rllight.strategies.advantages import AdvantageEstimator
from rllight.strategies.losses import Aggregation, ClippedSurrogate, PolicyLoss
from rllight.types import Rollout

log = logging.getLogger(__name__)

_NLL_NORMALIZE = ("correct_tokens", "all_tokens")


class LambdaSchedule:
    """Base class: ``__call__(lengths (B,)) -> lambda``, a float or one lambda per sequence (B,)."""

    total = None
    """Sums over the training processes, set by the estimator (None = one process): a schedule that normalises
    lengths over the batch uses it, so that the batch is the global one."""

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
        return adaptive_lambda(lengths, self.lam_min, self.lam_max, total=self.total)


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

    The update order of note 000 (K_v critic optimizer steps on the fresh rollout, then values and advantages
    recomputed with the updated critic, then the policy update) is ``model.critic_steps_first``.

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

    def __init__(self, policy_lambda: LambdaSchedule = lazy_default(AdaptiveLambda), value_lam: float | None = 1.0,
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
            raise RecipeError("model.advantage: DecoupledGAE needs token-level values; set model.critic (e.g. "
                              "rllight.critics.ValueHead)")
        lengths = rollout.response_lengths
        self.policy_lambda.total = self.total  # a schedule's batch statistics are the global batch's
        lam = self.policy_lambda(lengths)
        advantages, returns = gae(rollout.token_rewards, rollout.values, rollout.response_mask, self.gamma, lam)
        if self.value_lam is not None:
            _, returns = gae(rollout.token_rewards, rollout.values, rollout.response_mask, self.gamma, self.value_lam)
        if self.whiten:
            advantages = masked_whiten(advantages, rollout.response_mask, total=self.total)
        lam_t = lam if isinstance(lam, Tensor) else torch.full_like(lengths, lam, dtype=torch.float32)
        if lam_t.numel():
            rollout.extras.update({"advantage/lambda_mean": float(lam_t.float().mean()),
                                   "advantage/lambda_min": float(lam_t.min()),
                                   "advantage/lambda_max": float(lam_t.max())})
        return advantages, returns


class PositiveExampleNLL(PolicyLoss):
    """A policy loss plus ``coef`` times the negative log-likelihood of this batch's correct responses
    (VAPO paper's positive-example LM loss, arXiv:2504.05118, mu = 0.1).

    Per token: ``loss(...) + coef * scale * 1[correct_i] * (-log pi(y_t))``, aggregated like the policy loss.

    ``normalize`` chooses what the NLL is divided by:

    - ``correct_tokens`` (the paper's form): the tokens of the correct responses of the optimizer step,
      ``L_NLL = sum over correct tokens of -log pi / N_correct``. With token-mean aggregation (whose
      denominator is N, every valid token of the step) this is ``scale = N / N_correct``. Both counts are
      global over the step's micro-batches and ranks when the module calls ``begin_update`` before each
      optimizer update; without that call they are the micro-batch's own, which is exact when a minibatch
      is one micro-batch on one process (a warning says so once).
    - ``all_tokens``: ``scale = 1``: the NLL rides on the aggregation's denominator. With token-mean that is
      ``coef / N * sum over correct tokens of -log pi``, the paper's term times ``N_correct / N``, the share of
      the step's tokens that belong to correct responses (the effective weight shrinks with accuracy).

    Args:
        loss: The policy objective to wrap (per-token, e.g. ClippedSurrogate with clip-higher).
        coef: mu, the weight of the NLL (0.1 in the paper).
        normalize: correct_tokens (the paper's) or all_tokens (see above). correct_tokens needs
            token-mean aggregation.
    """

    def __init__(self, loss: PolicyLoss = lazy_default(ClippedSurrogate, clip_low=0.2, clip_high=0.28),
                 coef: float = 0.1, normalize: str = "correct_tokens"):
        if coef < 0:
            raise RecipeError(f"model.policy_loss.coef must be >= 0, got {coef}")
        if normalize not in _NLL_NORMALIZE:
            raise RecipeError(f"model.policy_loss.normalize: '{normalize}' is not one of {', '.join(_NLL_NORMALIZE)}")
        self.loss = loss
        self.coef = coef
        self.normalize = normalize
        self._step_counts: tuple[Tensor, Tensor] | None = None
        self._warned = False

    def begin_update(self, minibatch: Rollout, aggregation: Aggregation, global_sum: Callable[[Tensor], Tensor]) -> None:
        """Called by the module once per optimizer update, before its micro-batches: records the global
        counts of the update's valid tokens and of its correct responses' tokens.

        Args:
            minibatch: The update's rows (all micro-batches of this rank).
            aggregation: The recipe's aggregation (``correct_tokens`` needs token-mean).
            global_sum: Sums a scalar tensor over ranks (identity on one process).
        """
        if self.normalize != "correct_tokens":
            return
        if getattr(aggregation, "mode", None) != "token-mean":
            raise RecipeError(f"model.policy_loss.normalize: correct_tokens needs model.aggregation TokenMean, got "
                              f"{type(aggregation).__name__}; use normalize: all_tokens with it")
        mask = minibatch.response_mask.float()
        positive = (minibatch.correct > 0).to(mask.dtype).unsqueeze(-1)
        self._step_counts = (global_sum(mask.sum()), global_sum((mask * positive).sum()))

    def __call__(self, logprobs: Tensor, batch: Rollout) -> tuple[Tensor, dict[str, Tensor]]:
        per_token, stats = self.loss(logprobs, batch)
        if per_token.dim() != 2:
            raise ValueError("PositiveExampleNLL wraps per-token policy losses (B, T), not sequence-level ones")
        if batch.correct is None:
            raise ValueError("PositiveExampleNLL needs rollout.correct (set by the reward)")
        positive = (batch.correct > 0).to(logprobs.dtype).unsqueeze(-1)  # (B, 1)
        mask = batch.response_mask.to(logprobs.dtype)
        scale = logprobs.new_ones(())
        if self.normalize == "correct_tokens":
            if self._step_counts is not None:
                num_tokens, num_correct = self._step_counts
            else:
                if not self._warned:
                    log.warning("PositiveExampleNLL: the optimizer step's token counts were not given "
                                "(begin_update); normalising by each micro-batch's own counts (call begin_update "
                                "before an update's micro-batches, as rllight.update.Updater does)")
                    self._warned = True
                num_tokens, num_correct = mask.sum(), (mask * positive).sum()
            scale = num_tokens.to(logprobs.dtype) / num_correct.to(logprobs.dtype).clamp(min=1)
        stats = dict(stats)
        stats["policy/positive_nll"] = masked_mean(-logprobs.detach(), mask * positive)
        stats["policy/positive_fraction"] = positive.mean()
        return per_token + self.coef * scale * positive * (-logprobs), stats
