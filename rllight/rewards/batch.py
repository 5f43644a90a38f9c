"""Rewards that score a whole batch at once, seeing each sample's prompt, response, row and group: reward models,
LLM judges (pointwise or the whole group at once), and any reward that needs more than ``(response, answer)``.

A ``BatchReward`` is selected in a recipe like any reward (``model.reward: {class_path: ...}``). The trainer calls
``score`` once per batch with one ``Sample`` per response, in the batch's order; the samples of one prompt share a
``group``. A ``Reward`` (one response against its answer: the verifiers) keeps its own interface and its worker
processes (``RewardRunner``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from rllight.errors import RecipeError


@dataclass(frozen=True)
class Sample:
    """One response to score, with what it answers."""

    prompt: str
    """The prompt as the policy saw it (its chat template applied), as text."""
    messages: list[dict] | None
    """The row's chat messages (``[{"role": ..., "content": ...}, ...]``) when the row is a conversation, else None."""
    response: str
    """The response, as text (special tokens removed)."""
    response_ids: list[int]
    """The response's token ids (its end token included when it has one)."""
    answer: str
    """The row's reference answer (``""`` when it has none)."""
    row: dict[str, Any]
    """Every field of the prompt's row (``data_source``, ``source``, the task's own fields...)."""
    group: int
    """The prompt's index in the batch: the responses to one prompt share it."""
    truncated: bool = False
    """The response reached ``max_new_tokens`` without an end token."""


@dataclass
class BatchScores:
    """What ``BatchReward.score`` returns when a plain list of floats does not say enough.

    ``scores[i]`` is sample i's reward. ``correct[i]`` whether it counts as solved (for ``reward/accuracy``; None:
    ``scores[i] >= reward.correct``). ``failed`` maps the index of a sample that could not be scored to why (it
    gets reward 0 and counts as a reward failure, like a verifier that raised). ``components`` (optional, e.g.
    ``WeightedBatch``'s) maps a name to one value per sample, each logged as ``train/reward/<name>`` (its mean).

    ``token_scores`` (optional) gives rewards per response token: for sample i None, or one number per token of
    its ``response_ids`` (the policy's own tokens, so a reward with another tokenizer maps its scores onto them). They
    are rewards on those tokens in addition to ``scores[i]``, which sits on the last token: the return from token t
    is the outcome plus the token scores from t on (a process reward, or a shaping whose sum is zero). Only an
    advantage estimator that reads token rewards uses them (GAE, VAPO, REINFORCE++); another refuses them in one
    line at the first batch. A failed sample's token scores are dropped.
    """

    scores: list[float]
    correct: list[bool] | None = None
    failed: dict[int, str] = field(default_factory=dict)
    components: dict[str, list[float]] = field(default_factory=dict)
    token_scores: list[list[float] | None] | None = None


class BatchReward:
    """Base class of rewards that score a batch of ``Sample``s at once (see ``rllight.rewards.batch``).

    Subclass it, implement ``score``, and name the class in a recipe with ``class_path``.

    Args:
        correct: A sample whose score is at least this counts as solved in ``reward/accuracy`` (unless ``score``
            says otherwise through ``BatchScores.correct``).
    """

    def __init__(self, correct: float = 1.0):
        self.correct = correct

    def score(self, samples: Sequence[Sample]) -> list[float] | BatchScores:
        """A reward per sample, in the order given (or a ``BatchScores``)."""
        raise NotImplementedError

    def check_answer(self, answer: str) -> str | None:
        """A one-line reason when no response can ever be scored against the reference ``answer``; None when one
        can (the default: a reward model or a judge reads any row)."""
        return None

    def check(self) -> None:
        """Raise ``RecipeError`` in one line for what can be found wrong before the policy loads (a model folder that
        is not the right kind, an API key's environment variable that is unset); the trainer calls it first. The
        default checks nothing."""

    def close(self) -> None:
        """Free what the reward holds (a model, connections); the trainer calls it when the run ends."""


def as_batch_scores(reward: BatchReward, samples: Sequence[Sample], out: list[float] | BatchScores) -> BatchScores:
    """``out`` (what ``reward.score`` returned for ``samples``) as a checked ``BatchScores``: one finite score per
    sample (a sample whose score is not finite fails, with the reason), ``correct`` filled in from
    ``reward.correct``. Raises ``RecipeError`` in one line when the count is wrong (a bug in the reward, not a
    failed sample)."""
    scores = out if isinstance(out, BatchScores) else BatchScores(scores=list(out))
    name = type(reward).__name__
    if len(scores.scores) != len(samples):
        raise RecipeError(f"model.reward: {name}.score returned {len(scores.scores)} scores for {len(samples)} "
                          "samples; it must return one per sample, in the order given")
    if scores.correct is not None and len(scores.correct) != len(samples):
        raise RecipeError(f"model.reward: {name}.score returned {len(scores.correct)} correct flags for "
                          f"{len(samples)} samples")
    for part, vals in scores.components.items():
        if len(vals) != len(samples):
            raise RecipeError(f"model.reward: {name}.score returned {len(vals)} values of component {part!r} for "
                              f"{len(samples)} samples")
    failed = dict(scores.failed)
    tokens = _checked_tokens(name, samples, scores.token_scores, failed)  # marks a sample with a token score not finite
    values = []
    for i, value in enumerate(scores.scores):
        try:
            value = float(value)
        except (TypeError, ValueError):
            failed.setdefault(i, f"score {value!r} is not a number")
            value = 0.0
        if not math.isfinite(value):
            failed.setdefault(i, f"score {value!r} is not finite")
        values.append(0.0 if i in failed else value)
    correct = ([bool(c) for c in scores.correct] if scores.correct is not None
               else [v >= getattr(reward, "correct", 1.0) for v in values])
    correct = [ok and i not in failed for i, ok in enumerate(correct)]
    components = {part: [0.0 if i in failed else float(v) for i, v in enumerate(vals)]
                  for part, vals in scores.components.items()}
    if tokens is not None:  # a failed sample's token scores do not train either
        tokens = [None if i in failed else t for i, t in enumerate(tokens)]
    return BatchScores(scores=values, correct=correct, failed=failed, components=components, token_scores=tokens)


def _checked_tokens(name: str, samples: Sequence[Sample], tokens, failed: dict[int, str]):
    """``tokens`` (``BatchScores.token_scores``) as floats; ``RecipeError`` in one line for a wrong count of samples
    or of a sample's tokens; a sample with a token score that is not finite is marked in ``failed``."""
    if tokens is None:
        return None
    if len(tokens) != len(samples):
        raise RecipeError(f"model.reward: {name}.score returned token scores for {len(tokens)} samples of "
                          f"{len(samples)}; give one entry per sample (None for a sample without)")
    out: list[list[float] | None] = []
    for i, (values, sample) in enumerate(zip(tokens, samples)):
        if values is not None and len(values) != len(sample.response_ids):
            raise RecipeError(f"model.reward: {name}.score returned {len(values)} token scores for sample {i}, whose "
                              f"response has {len(sample.response_ids)} tokens (Sample.response_ids); give one per "
                              "token")
        values = None if values is None else [float(v) for v in values]
        if values is not None and not all(math.isfinite(v) for v in values):
            failed.setdefault(i, "a token score is not finite")
            values = None
        out.append(values)
    return out


__all__ = ["BatchReward", "BatchScores", "Sample", "as_batch_scores"]
