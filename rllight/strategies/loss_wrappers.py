"""Policy losses that wrap another policy loss (their ``loss`` argument): ``TruncatedIS`` and ``MaskedIS`` correct
the mismatch between the rollout engine and the trainer, by reweighting or by masking tokens; ``PositiveExampleNLL``
(VAPO) adds the negative log-likelihood of the batch's correct responses."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable

import torch
from torch import Tensor

from rllight._compat import lazy_default
from rllight.algorithms import icepop_weight, masked_mean, sequence_is_mask, token_is_mask, truncated_is_weight
from rllight.bounds import NonNegativeFloat, PositiveFloat, bounded
from rllight.errors import RecipeError
from rllight.strategies.aggregations import Aggregation
from rllight.strategies.policy_losses import ClippedSurrogate, PolicyLoss
from rllight.types import Rollout

__all__ = ["MaskedIS", "PositiveExampleNLL", "TruncatedIS"]

log = logging.getLogger(__name__)

_NLL_NORMALIZE = ("correct_tokens", "all_tokens")


class TruncatedIS(PolicyLoss):
    """Truncated importance sampling for the mismatch between the rollout engine and the trainer (Yao et
    al., 2025, "Your efficient RL framework secretly brings you off-policy RL training"): the per-token
    loss of ``loss`` is multiplied by ``min(exp(old_logprobs - sample_logprobs), cap)``, detached.

    ``old_logprobs`` are the trainer's log-probs before the step's updates and ``sample_logprobs`` the
    engine's (``rollout.sample_logprobs``); with an engine that samples from the trained model itself
    (HFEngine) the weight is ~1, with vLLM it corrects the kernels' and precision's differences.

    Logged: ``policy/tis_weight_mean`` and ``policy/tis_capped_frac`` (tokens at the cap).

    Args:
        loss: The per-token policy objective to correct (e.g. ``rllight.strategies.ClippedSurrogate``).
        cap: C, the truncation of the weight.
    """

    @bounded
    def __init__(self, loss: PolicyLoss, cap: PositiveFloat = 2.0):
        self.loss = loss
        self.cap = cap

    def begin_update(self, minibatch, aggregation, global_sum) -> None:
        self.loss.begin_update(minibatch, aggregation, global_sum)

    def __call__(self, logprobs: Tensor, batch: Rollout) -> tuple[Tensor, dict[str, Tensor]]:
        per_token, stats = _per_token_loss(self, logprobs, batch)
        weight = truncated_is_weight(batch.old_logprobs, batch.sample_logprobs, self.cap)
        mask = batch.response_mask
        stats = dict(stats)
        stats["policy/tis_weight_mean"] = masked_mean(weight, mask)
        capped = (batch.old_logprobs - batch.sample_logprobs) >= math.log(self.cap)
        stats["policy/tis_capped_frac"] = masked_mean(capped.float(), mask)
        return per_token * weight, stats


def _per_token_loss(wrapper, logprobs: Tensor, batch: Rollout) -> tuple[Tensor, dict[str, Tensor]]:
    """The wrapped loss's per-token loss and stats (a one-line error for a sequence-level loss)."""
    per_token, stats = wrapper.loss(logprobs, batch)
    if per_token.dim() != 2:
        raise RecipeError(f"model.policy_loss: {type(wrapper).__name__} needs a per-token loss; "
                          f"{type(wrapper.loss).__name__} returns one loss per sequence")
    return per_token, dict(stats)


MASKS = ("token", "sequence", "icepop")


class MaskedIS(PolicyLoss):
    """Masked importance sampling for the engine/trainer mismatch: the per-token loss of ``loss`` is kept where
    the ratio ``r_t = exp(old_logprobs_t - sample_logprobs_t)`` is within ``[low, high]`` and dropped elsewhere
    (``rllight.algorithms.masked_is``), instead of TIS's reweighting of every token.

    ``mask``:

    - ``token``: each token on its own ratio (``token_is_mask``);
    - ``sequence``: a whole response on the geometric mean of its ratios (``sequence_is_mask``);
    - ``icepop``: each token weighted by its ratio inside the band, dropped outside (``icepop_weight``;
      defaults there 0.5 and 5).

    Dropped tokens still count in the token-mean's denominator: masking removes their gradient, not the
    normalisation (as verl and TRL do). Logged: ``policy/is_masked_frac`` (the share of response tokens dropped)
    and ``policy/is_ratio_mean``.

    Args:
        loss: The per-token policy objective to correct (e.g. ``rllight.strategies.ClippedSurrogate``).
        mask: token, sequence or icepop.
        low: The lowest ratio kept (None: 0.5, or 1 / high for ``sequence`` when high is given).
        high: The highest ratio kept (None: 2.0; 5.0 for ``icepop``).
    """

    @bounded
    def __init__(self, loss: PolicyLoss, mask: str = "sequence", low: NonNegativeFloat | None = None,
                 high: PositiveFloat | None = None):
        if mask not in MASKS:
            raise RecipeError(f"model.policy_loss.mask must be one of {', '.join(MASKS)}, got {mask!r}")
        high = high if high is not None else (5.0 if mask == "icepop" else 2.0)
        low = low if low is not None else (0.5 if mask == "icepop" else 1.0 / high)
        if not 0 <= low < high:
            raise RecipeError(f"model.policy_loss: need 0 <= low < high, got low={low}, high={high}")
        self.loss, self.mask, self.low, self.high = loss, mask, low, high

    def begin_update(self, minibatch, aggregation, global_sum) -> None:
        self.loss.begin_update(minibatch, aggregation, global_sum)

    def __call__(self, logprobs: Tensor, batch: Rollout) -> tuple[Tensor, dict[str, Tensor]]:
        per_token, stats = _per_token_loss(self, logprobs, batch)
        old, sampled, mask = batch.old_logprobs, batch.sample_logprobs, batch.response_mask
        if self.mask == "token":
            weight = token_is_mask(old, sampled, self.low, self.high)
        elif self.mask == "sequence":
            weight = sequence_is_mask(old, sampled, mask, self.low, self.high)
        else:
            weight = icepop_weight(old, sampled, self.low, self.high)
        stats["policy/is_masked_frac"] = masked_mean((weight == 0).float(), mask)
        stats["policy/is_ratio_mean"] = masked_mean(torch.exp((old - sampled).detach().clamp(-50, 50)), mask)
        return per_token * weight, stats


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

    @bounded
    def __init__(self, loss: PolicyLoss = lazy_default(ClippedSurrogate, clip_low=0.2, clip_high=0.28),
                 coef: NonNegativeFloat = 0.1, normalize: str = "correct_tokens"):
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
