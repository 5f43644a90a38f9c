"""Scoring a batch of responses: each by its data source's reward (``PerSource``) or the one reward; a ``Reward`` per
response (in the reward runner's worker processes, if any), a ``BatchReward`` once per batch of ``Sample``s.

A ``BatchReward`` may also give scores per response token (``BatchScores.token_scores``): they come back as
``Scored.token_scores`` and become the rollout's ``dense_rewards`` (``token_tensor``), added to the outcome reward's
token rewards before the advantage (``RLModule.estimate_advantages``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from rllight.errors import RecipeError, one_line
from rllight.rewards import by_source, score_batch
from rllight.rewards.batch import BatchReward, Sample, as_batch_scores

log = logging.getLogger(__name__)


@dataclass
class Scored:
    """A batch's scores: per response its reward and whether it is correct, the failures, the metrics (per reward
    component, the runner's timeouts) and, where a reward gave them, per response its token scores (None for a
    response without; the whole list None when no response has any)."""

    rewards: list[float]
    correct: list[bool]
    failures: int
    metrics: dict[str, float]
    token_scores: list[list[float] | None] | None = None


def score_responses(reward, runner, texts: list[str], answers: list[str], sources: list[str | None],
                    samples: list[Sample] | None = None) -> Scored:
    """The responses ``texts`` scored: each by its data source's reward (``PerSource``) or the one reward, in the
    worker processes of ``runner`` if any; a ``BatchReward`` scores its responses' ``samples`` in one call, in this
    process."""
    rewards, correct = [0.0] * len(texts), [False] * len(texts)
    failures, metrics = 0, {}
    parts: dict[str, list[float]] = {}
    tokens: list[list[float] | None] = [None] * len(texts)
    for part, index in by_source(reward, sources):
        sub_texts, sub_answers = [texts[i] for i in index], [answers[i] for i in index]
        if isinstance(part, BatchReward):
            if samples is None:
                raise ValueError(f"RolloutProducer.score: {type(part).__name__} is a BatchReward and needs "
                                 "the responses' samples")
            dense: list[list[float] | None] = []
            values, oks, fails = score_samples(part, [samples[i] for i in index], parts, dense)
            for j, i in enumerate(index):
                tokens[i] = dense[j]
        elif runner is not None:
            scores = runner.score(part, sub_texts, sub_answers)
            values, oks, fails = scores.rewards, scores.correct, scores.failures
            for key in ("timeouts", "worker_deaths"):
                metrics[f"reward/{key}"] = metrics.get(f"reward/{key}", 0.0) + float(getattr(scores, key))
            for name, vals in scores.components.items():  # each part of a weighted reward, on its own
                parts.setdefault(name, []).extend(vals)
        else:
            values, oks, fails = score_batch(part, sub_texts, sub_answers)
        for j, i in enumerate(index):
            rewards[i], correct[i] = values[j], oks[j]
        failures += fails
    metrics.update({f"reward/{name}": sum(v) / max(len(v), 1) for name, v in parts.items()})
    given = [t for t in tokens if t is not None]
    if given:
        metrics["reward/token_scores_sum"] = sum(sum(t) for t in given) / len(given)
    return Scored(rewards, correct, failures, metrics, tokens if given else None)


def score_samples(reward: BatchReward, samples: list[Sample], parts: dict[str, list[float]] | None = None,
                  token_scores: list[list[float] | None] | None = None) -> tuple[list[float], list[bool], int]:
    """``(rewards, correct, failures)`` of ``samples`` from one call of ``reward.score`` (``as_batch_scores``
    checks it). A call that raises fails the whole batch: every sample 0, not correct and a failure, with one
    warning naming the reward and the error. A ``RecipeError`` (the reward's own set-up, or a wrong number of
    scores) is raised: it is the recipe's fault, not the batch's. A sample the reward says it could not score
    (``BatchScores.failed``) gets 0 and counts, one warning for them all. ``BatchScores.components`` (e.g.
    ``WeightedBatch``'s) are appended to ``parts`` by name, and each sample's token scores (None where it has
    none) to ``token_scores``, when given."""
    name = type(reward).__name__
    if not samples:
        return [], [], 0
    try:
        out = reward.score(samples)
    except RecipeError:
        raise
    except Exception as err:  # noqa: BLE001 - a reward model out of memory, a judge down: the batch, not the run
        why = one_line(err)
        log.warning("reward %s failed on its whole batch of %d samples (each scored 0; fix the reward): %s", name,
                    len(samples), why)
        if token_scores is not None:
            token_scores.extend([None] * len(samples))
        return [0.0] * len(samples), [False] * len(samples), len(samples)
    scores = as_batch_scores(reward, samples, out)
    if scores.failed:
        first = min(scores.failed)
        log.warning("reward %s could not score %d of %d samples (each scored 0); sample %d: %s", name,
                    len(scores.failed), len(samples), first, scores.failed[first])
    for part, values in scores.components.items() if parts is not None else ():
        parts.setdefault(part, []).extend(values)
    if token_scores is not None:
        token_scores.extend(scores.token_scores or [None] * len(samples))
    return scores.scores, scores.correct, len(scores.failed)


def token_tensor(token_scores: list[list[float] | None], response_mask: torch.Tensor) -> torch.Tensor:
    """Shape (B, T), float32, on ``response_mask``'s device: row i holds response i's token scores from its first
    token (zeros for a response without, and past its end), zero outside ``response_mask``."""
    out = torch.zeros(response_mask.shape, dtype=torch.float32)
    for i, values in enumerate(token_scores):
        if values:
            out[i, : len(values)] = torch.tensor(values[: response_mask.shape[1]], dtype=torch.float32)
    return out.to(response_mask.device) * response_mask.float()


__all__ = ["Scored", "score_responses", "score_samples", "token_tensor"]
