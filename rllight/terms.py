"""Loss terms: what one optimizer update minimises, one small object per term.

An update (``rllight.update.Updater.update``) adds the terms it is given on each micro-batch, so the policy's
update, a critic-only fit and a self-imitation NLL update are the same routine with other terms. A term says
what the forward pass must compute for it (``needs_logprobs``, ``needs_values``), which parameters its
gradient reaches (``trains``) and what it logs (the metrics it returns).

A term of your own goes in a recipe under ``model.loss_terms`` (added to every policy update)::

    model:
      loss_terms:
        - class_path: my_lab.LengthPenalty
          init_args: {coef: 0.01}
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from rllight.algorithms import masked_mean
from rllight.algorithms.distillation import chunked_teacher_divergence
from rllight.bounds import ClosedUnitInterval, NonNegativeFloat, PositiveInt, bounded
from rllight.errors import RecipeError
from rllight.models import response_hidden_states
from rllight.rollout.metrics import logprob_mismatch
from rllight.scoring import Outputs
from rllight.strategies import Aggregation, KLPenalty, PolicyLoss
from rllight.strategies.advantages import TEACHER_TOP_IDS, TEACHER_TOP_LOGPROBS
from rllight.types import Rollout

Aggregate = Callable[..., Tensor]
"""``aggregate(loss, response_mask)``: a per-token (B, T) or per-sequence (B,) loss averaged as the recipe's
``model.aggregation`` says, with the update's global token and sequence counts (all micro-batches, all ranks);
``aggregate(loss, response_mask, how)`` averages as the aggregation ``how`` says instead."""


class LossTerm:
    """Base class of a loss term; subclass it and name the subclass in ``model.loss_terms``."""

    needs_logprobs: bool = True
    """The forward pass must compute the policy's log-probs and entropy (with gradients) for this term."""
    needs_values: bool = False
    """The forward pass must compute the critic's values (with gradients) for this term."""
    trains: tuple[str, ...] = ("policy",)
    """The parameters this term's gradient reaches: ``"policy"`` (the policy's weights: the rollout engine is
    synced after the update) and/or ``"critic"``."""

    def begin(self, minibatch: Rollout, aggregation: Aggregation, global_sum: Callable[[Tensor], Tensor]) -> None:
        """Called once per optimizer update, on every rank, before its micro-batches (``global_sum`` sums a
        tensor over ranks). Nothing by default."""

    def __call__(self, batch: Rollout, out: Outputs, aggregate: Aggregate) -> tuple[Tensor, dict[str, Tensor]]:
        """The term's scalar loss on the micro-batch ``batch`` (its share of the update's loss: ``aggregate``
        divides by the update's global counts) and its metrics, e.g. ``{"mine/penalty": ...}`` (logged as
        ``train/mine/penalty``, averaged over the step's micro-batches)."""
        raise NotImplementedError


class PolicyObjective(LossTerm):
    """The policy's objective ``policy_loss``, with a KL penalty to the reference (when it is in the loss) and
    an entropy bonus.

    On a rollout without old log-probs (one update per rollout: the policy has not moved since sampling) the
    live log-probs, detached, are the ratio's base.
    """

    def __init__(self, policy_loss: PolicyLoss, kl: KLPenalty | None = None, entropy_coef: float = 0.0):
        self.policy_loss = policy_loss
        self.kl = kl if kl is not None and not kl.in_reward else None
        self.entropy_coef = entropy_coef

    def begin(self, minibatch: Rollout, aggregation: Aggregation, global_sum: Callable[[Tensor], Tensor]) -> None:
        self.policy_loss.begin_update(minibatch, aggregation, global_sum)

    def __call__(self, batch: Rollout, out: Outputs, aggregate: Aggregate) -> tuple[Tensor, dict[str, Tensor]]:
        mask = batch.response_mask.float()
        stats = {}
        if batch.old_logprobs is None:
            batch.old_logprobs = out.logprobs.detach() * mask
            stats.update(logprob_mismatch(batch.old_logprobs, batch.sample_logprobs, mask))
        per_token, loss_stats = self.policy_loss(out.logprobs, batch)
        loss = aggregate(per_token, mask)
        if self.kl is not None:
            kl = self.kl(out.logprobs, batch.ref_logprobs)
            loss = loss + self.kl.coef * aggregate(kl, mask)
            stats["policy/kl_ref"] = masked_mean(kl, mask)
        if self.entropy_coef:
            loss = loss - self.entropy_coef * aggregate(out.entropy, mask)
        log_ratio = (out.logprobs.detach() - batch.old_logprobs) * mask
        stats["policy/approx_kl"] = masked_mean(0.5 * log_ratio**2, mask)
        stats["policy/entropy"] = masked_mean(out.entropy, mask)
        return loss, {**stats, **loss_stats}


class CriticLoss(LossTerm):
    """The critic's own loss (``critic.loss``) weighted by ``critic.loss_coef``. A critic on the policy's
    backbone trains the backbone too (``trains`` includes ``"policy"``)."""

    needs_logprobs = False
    needs_values = True

    def __init__(self, critic, train_backbone: bool = True):
        self.critic = critic
        self.trains = ("critic", "policy") if critic.shared and train_backbone else ("critic",)

    def __call__(self, batch: Rollout, out: Outputs, aggregate: Aggregate) -> tuple[Tensor, dict[str, Tensor]]:
        per_token, stats = self.critic.loss(out.values, batch)
        return self.critic.loss_coef * aggregate(per_token, batch.response_mask.float()), stats


class HeadOnlyCriticFit(CriticLoss):
    """The critic loss of a value head on the policy's backbone, training the head alone: the backbone runs
    without gradients and gives fixed features (VAPO's value pretraining; critic updates between sampling and
    the policy's update). The backbone does not move, so the hidden states of each micro-batch are computed
    once and reused by every later update of the same minibatch with this term.

    Args:
        critic: The shared critic.
        policy: The causal LM whose backbone the head reads.
    """

    needs_values = False

    def __init__(self, critic, policy: torch.nn.Module, run: Callable | None = None):
        super().__init__(critic, train_backbone=False)
        self.policy = policy
        self.run = run or (lambda fn: fn())  # ``Scoring.run``: the passes under FSDP run inside its root unit
        self.hidden: list[Tensor] = []
        self._next = 0

    def begin(self, minibatch: Rollout, aggregation: Aggregation, global_sum: Callable[[Tensor], Tensor]) -> None:
        self._next = 0

    def __call__(self, batch: Rollout, out: Outputs, aggregate: Aggregate) -> tuple[Tensor, dict[str, Tensor]]:
        def values() -> Tensor:
            if self._next == len(self.hidden):
                with torch.no_grad():
                    self.hidden.append(response_hidden_states(self.policy.get_decoder(), batch))
            return self.critic.values(batch, self.hidden[self._next])

        values = self.run(values)
        self._next += 1
        return super().__call__(batch, out._replace(values=values), aggregate)


class ResponseNLL(LossTerm):
    """``coef * -log pi(response)``: supervised learning on given responses (VAPO's self-imitation on replayed
    successes, note 000 eq. 11), aggregated as ``aggregation`` says (an ``rllight.strategies`` aggregation, e.g.
    ``SeqMeanTokenSum`` for eq. 11's sum over each response's tokens; None = like the policy loss). Logs the NLL
    itself as ``nll/loss``."""

    def __init__(self, coef: float = 1.0, aggregation=None):
        self.coef = coef
        self.aggregation = aggregation

    def __call__(self, batch: Rollout, out: Outputs, aggregate: Aggregate) -> tuple[Tensor, dict[str, Tensor]]:
        mask = batch.response_mask.float()
        nll = aggregate(-out.logprobs, mask) if self.aggregation is None else aggregate(-out.logprobs, mask,
                                                                                         self.aggregation)
        return self.coef * nll, {"nll/loss": nll}


class TeacherDivergence(LossTerm):
    """Logit-level distillation: ``coef`` times the divergence between the teacher's and the student's next-token
    distributions at each response token, aggregated like the policy loss (``model.aggregation``) over the
    response mask. GKD's loss (Agarwal et al., arXiv:2306.13649, eq. 1) on the student's own samples, in TRL's
    ``beta`` convention (``rllight.algorithms.generalized_jsd``): beta 0 is the forward KL(teacher || student),
    1 the reverse KL(student || teacher), and between them the generalised JSD with the mixture
    M = beta teacher + (1 - beta) student.

    The teacher's distribution is what ``rllight.callbacks.TeacherLogprobs(top_k=k)`` stores: its k most likely
    tokens and their log-probs at each response position, or (``top_k: 0``) every token's. Over the top k, both
    distributions are proper over k + 1 outcomes: the k tokens (the student's log-softmax over the full
    vocabulary, gathered at the teacher's ids) and a "rest" bucket with the mass of every other token
    (``rllight.algorithms.with_rest``; NeMo-RL's distillation loss renormalises over the k tokens instead). Both
    are at the rollout engine's temperature, as the log-probs of the sampled tokens are.

    The student's distribution comes from a forward pass of its own, with gradients, through the policy (the
    update's forward pass computes the sampled tokens' log-probs only): the update's forward and backward cost
    about twice as much. Its output layer runs ``chunk_size`` positions at a time, each chunk's logits recomputed in
    the backward pass (``rllight.algorithms.chunked_teacher_divergence``). ``TeacherLogprobs`` hands this term the
    policy's scoring when fit starts (``bind``). Logs ``distill/divergence``, the mean divergence per response token.

    Args:
        coef: Weight of the term.
        beta: The divergence (TRL's GKD ``beta``): 0 forward KL, 1 reverse KL, between: generalised JSD.
        chunk_size: Response positions per chunk of the output layer.
    """

    @bounded
    def __init__(self, coef: NonNegativeFloat = 1.0, beta: ClosedUnitInterval = 0.5, chunk_size: PositiveInt = 1024):
        self.coef = coef
        self.beta = beta
        self.chunk_size = chunk_size
        self.scoring = None  # the policy's forward passes (``rllight.scoring.Scoring``), given by ``bind``

    def bind(self, scoring) -> None:
        """Compute the student's distribution with ``scoring``'s policy, at its engine's temperature, inside its
        ``run`` (FSDP's root unit)."""
        self.scoring = scoring

    def __call__(self, batch: Rollout, out: Outputs, aggregate: Aggregate) -> tuple[Tensor, dict[str, Tensor]]:
        values = batch.extras.get(TEACHER_TOP_LOGPROBS)
        if values is None:
            raise RecipeError("model.loss_terms: TeacherDivergence needs the teacher's distribution at each response "
                              "token; add rllight.callbacks.TeacherLogprobs with top_k (e.g. top_k: 64) to "
                              "trainer.callbacks")
        if self.scoring is None:
            raise RecipeError("model.loss_terms: TeacherDivergence has no policy to compare with the teacher; "
                              "rllight.callbacks.TeacherLogprobs gives it the policy when fit starts")
        ids = batch.extras.get(TEACHER_TOP_IDS)
        mask = batch.response_mask.bool()
        t = mask.shape[1]  # a padding row (FSDP) has one response column, its extras the rollout's
        values, ids = values[:, :t], None if ids is None else ids[:, :t]
        scoring = self.scoring

        def divergence() -> Tensor:  # at the response tokens only: shape (N,)
            policy = scoring.policy
            head = policy.get_output_embeddings()
            vocab = getattr(getattr(head, "weight", None), "shape", (None,))[0]
            if ids is None and vocab is not None and values.shape[-1] != vocab:
                raise RecipeError(f"model.loss_terms: TeacherDivergence: the teacher's full distribution has "
                                  f"{values.shape[-1]} tokens and the policy's {vocab}; set TeacherLogprobs.top_k "
                                  "(its top k tokens) instead of 0")
            hidden = response_hidden_states(policy.get_decoder(), batch)
            return chunked_teacher_divergence(hidden[mask], head, values[mask],
                                              None if ids is None else ids[mask], self.beta,
                                              scoring.engine.temperature, self.chunk_size)

        per_position = scoring.run(divergence)
        per_token = torch.zeros(mask.shape, dtype=per_position.dtype, device=mask.device).masked_scatter(
            mask, per_position)
        weights = mask.float()
        return self.coef * aggregate(per_token, weights), {"distill/divergence": masked_mean(per_token.detach(),
                                                                                             weights)}
