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
from rllight.rewards.scores import MEAN_METRICS

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


def mean_metric_keys(metrics: dict[str, float], scores: Scores) -> tuple[str, ...]:
    """The keys of ``metrics`` (``reward_metrics(scores)``, with ``source_metrics``') that are means over the batch's
    responses, not counts: each component's mean, an agreement's mean (``MEAN_METRICS``), the token scores' mean sum,
    and the per data source shares and means. A sampler that joins several batches weights these by responses and
    adds up the rest (``rllight.strategies.DynamicSampling``)."""
    means = {f"reward/{name}" for name in scores.component_means()}
    means |= {f"reward/{name}" for name in scores.metrics if name.rsplit("/", 1)[-1] in MEAN_METRICS}
    means.add("reward/token_scores_sum")
    sources = {k for k in metrics if k.startswith("data/") and k.endswith("/share")}
    sources |= {k for k in metrics if k.startswith("reward/") and k.endswith(("/mean", "/accuracy"))}
    return tuple(sorted(k for k in metrics if k in means | sources))


def token_tensor(token_scores: list[list[float] | None], response_mask: torch.Tensor) -> torch.Tensor:
    """Shape (B, T), float32, on ``response_mask``'s device: row i holds response i's token scores from its first
    token (zeros for a response without, and past its end), zero outside ``response_mask``."""
    out = torch.zeros(response_mask.shape, dtype=torch.float32)
    for i, values in enumerate(token_scores):
        if values:
            out[i, : len(values)] = torch.tensor(values[: response_mask.shape[1]], dtype=torch.float32)
    return out.to(response_mask.device) * response_mask.float()


__all__ = ["mean_metric_keys", "reward_metrics", "score_samples", "token_tensor"]
