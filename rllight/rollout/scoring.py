"""Scoring a batch of responses: the reward's ``Scores`` (``rllight.rewards.scored``), one warning for the samples
it could not score, the step's reward metrics, and token scores as a tensor.

A reward may give scores per response token (``Scores.token_scores``): they become the rollout's ``dense_rewards``
(``token_tensor``), added to the outcome reward's token rewards before the advantage
(``RLModule.estimate_advantages``).
"""

from __future__ import annotations

import logging

import torch

from rllight.rewards import Reward, Sample, Scores, scored

log = logging.getLogger(__name__)


def score_samples(reward: Reward, samples: list[Sample]) -> Scores:
    """``reward``'s checked ``Scores`` of ``samples``; one warning naming the reward, how many samples failed and
    why the first did (each failed sample scored 0)."""
    scores = scored(reward, samples)
    if scores.failed:
        first = min(scores.failed)
        log.warning("reward %s could not score %d of %d samples (each scored 0; fix the reward); sample %d: %s",
                    reward.name, len(scores.failed), len(samples), first, scores.failed[first])
    return scores


def reward_metrics(scores: Scores) -> dict[str, float]:
    """The step's ``reward/...`` metrics of ``scores``: failures, the reward's own counts (e.g. ``timeouts``), each
    component's mean, and the mean sum of token scores over the responses that have them."""
    metrics = {"reward/failures": float(len(scores.failed))}
    metrics.update({f"reward/{name}": value for name, value in scores.metrics.items()})
    metrics.update({f"reward/{name}": mean for name, mean in scores.component_means().items()})
    given = [t for t in scores.token_scores or () if t is not None]
    if given:
        metrics["reward/token_scores_sum"] = sum(sum(t) for t in given) / len(given)
    return metrics


def token_tensor(token_scores: list[list[float] | None], response_mask: torch.Tensor) -> torch.Tensor:
    """Shape (B, T), float32, on ``response_mask``'s device: row i holds response i's token scores from its first
    token (zeros for a response without, and past its end), zero outside ``response_mask``."""
    out = torch.zeros(response_mask.shape, dtype=torch.float32)
    for i, values in enumerate(token_scores):
        if values:
            out[i, : len(values)] = torch.tensor(values[: response_mask.shape[1]], dtype=torch.float32)
    return out.to(response_mask.device) * response_mask.float()


__all__ = ["reward_metrics", "score_samples", "token_tensor"]
