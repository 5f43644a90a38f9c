"""What a reward reads and what it returns: a ``Sample`` per response in, one ``Scores`` per batch out.

Every reward (``rllight.rewards.Reward``) scores a batch of ``Sample``s; ``Scores`` is the one form a score takes
from the reward to the rollout (``Rollout.rewards``, ``Rollout.correct``, ``Rollout.dense_rewards``) and the
step's metrics. ``checked`` is how the trainer reads what a reward returned: one finite value per sample, or the
sample fails (0, counted, never the run).
"""

from __future__ import annotations

import logging
import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from rllight.errors import RecipeError

log = logging.getLogger(__name__)


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

    @property
    def data_source(self) -> str:
        """The row's data source (``data_source``; ``"None"`` when it has none), as ``PerSource`` keys it."""
        return str(self.row.get("data_source"))


MEAN_METRICS = ("rank_corr", "verifier_at_top")
"""The last parts of ``Scores.metrics`` keys that are means over a batch rather than counts."""


def combine_metrics(parts: Sequence[tuple[dict[str, float], int]]) -> dict[str, float]:
    """The metrics of a batch from its parts' ``(metrics, samples)``: counts add up; a mean (its key's last part in
    ``MEAN_METRICS``) is the parts' means weighted by their samples, over the parts that have it."""
    out: dict[str, float] = {}
    weights: dict[str, float] = {}
    for metrics, samples in parts:
        for name, value in metrics.items():
            if name.rsplit("/", 1)[-1] in MEAN_METRICS:
                out[name] = out.get(name, 0.0) + value * samples
                weights[name] = weights.get(name, 0.0) + samples
            else:
                out[name] = out.get(name, 0.0) + value
    for name, weight in weights.items():
        out[name] = out[name] / weight if weight else 0.0
    return out


@dataclass
class Scores:
    """A batch's scores, one entry per sample in the order given.

    ``values[i]`` is sample i's reward. ``solved[i]`` whether it counts as solved (for ``reward/accuracy`` and
    ``Rollout.correct``; None: the reward's ``solved_from(values)`` says). ``failed`` maps the index of a sample that
    could not be scored to why: it gets reward 0, is not solved, and counts in ``reward/failures``. ``components``
    (e.g. ``Weighted``'s) maps a name to one value per sample (None for a sample the component did not score), each
    logged as ``reward/<name>``, the mean over the samples it scored. ``metrics`` are counts over the batch (e.g. the
    reward workers' ``timeouts``), logged as ``reward/<name>`` and summed when scores are combined; a metric whose
    last part is one of ``MEAN_METRICS`` (e.g. ``agreement/judge_vs_exact/rank_corr``) is a mean over the batch, and
    scores combined from parts of a batch average it, each part weighted by its samples (``combine_metrics``).

    ``token_scores`` (optional) gives rewards per response token: for sample i None, or one number per token of
    its ``response_ids`` (the policy's own tokens, so a reward with another tokenizer maps its scores onto them). They
    are rewards on those tokens in addition to ``values[i]``, which sits on the last token: the return from token t
    is the outcome plus the token scores from t on (a process reward, or a shaping whose sum is zero). Only an
    advantage estimator that reads token rewards uses them (GAE, VAPO, REINFORCE++); another refuses them in one
    line at the first batch. A failed sample's token scores are dropped.
    """

    values: list[float]
    solved: list[bool] | None = None
    failed: dict[int, str] = field(default_factory=dict)
    components: dict[str, list[float | None]] = field(default_factory=dict)
    token_scores: list[list[float] | None] | None = None
    metrics: dict[str, float] = field(default_factory=dict)

    @classmethod
    def failing(cls, count: int, why: str) -> Scores:
        """Scores of ``count`` samples that all failed for the same reason."""
        return cls(values=[0.0] * count, solved=[False] * count, failed=dict.fromkeys(range(count), why))

    @classmethod
    def join(cls, count: int, parts: Sequence[tuple[Scores, Sequence[int]]]) -> Scores:
        """The scores of ``count`` samples from ``parts``: ``(scores, index)`` pairs, ``scores`` of the samples at
        ``index`` (every sample in exactly one part). Components and token scores are placed at their samples (None
        where a part has none); metrics are summed."""
        out = cls(values=[0.0] * count, solved=[False] * count)
        tokens: list[list[float] | None] = [None] * count
        for scores, index in parts:
            for j, i in enumerate(index):
                out.values[i], out.solved[i] = scores.values[j], scores.solved[j]
                if j in scores.failed:
                    out.failed[i] = scores.failed[j]
                if scores.token_scores is not None:
                    tokens[i] = scores.token_scores[j]
            for name, values in scores.components.items():
                placed = out.components.setdefault(name, [None] * count)
                for j, i in enumerate(index):
                    placed[i] = values[j]
        out.metrics = combine_metrics([(scores.metrics, len(index)) for scores, index in parts])
        out.token_scores = tokens if any(t is not None for t in tokens) else None
        return out

    def component_means(self) -> dict[str, float]:
        """Each component's mean over the samples it scored, by name."""
        means = {}
        for name, values in self.components.items():
            scored = [v for v in values if v is not None]
            means[name] = sum(scored) / max(len(scored), 1)
        return means


def finite_in_float32(value: float) -> bool:
    """Whether ``value`` survives a round trip through float32 (the rollout stores rewards as float32, where 1e39
    becomes inf)."""
    try:
        return math.isfinite(struct.unpack("f", struct.pack("f", value))[0])
    except OverflowError:
        return False


def checked(reward, samples: Sequence[Sample], out: list[float] | Scores) -> Scores:
    """``out`` (what ``reward.score`` returned for ``samples``) as checked ``Scores``: one value per sample, finite in
    float32 (a sample whose value is not fails, with the reason); ``solved`` filled in from ``reward.solved_from``;
    a failed sample's value, components and token scores zeroed or dropped. Raises ``RecipeError`` in one line when
    a count is wrong (a bug in the reward, not a failed sample)."""
    scores = out if isinstance(out, Scores) else Scores(values=list(out))
    name = reward.name
    _check_counts(name, samples, scores)
    failed = dict(scores.failed)
    tokens = _checked_tokens(name, samples, scores.token_scores, failed)  # marks a sample with a token score not finite
    values = []
    for i, value in enumerate(scores.values):
        try:
            value = float(value)
        except (TypeError, ValueError):
            failed.setdefault(i, f"score {value!r} is not a number")
            value = 0.0
        if not finite_in_float32(value):
            failed.setdefault(i, f"score {value!r} is not finite")
        values.append(0.0 if i in failed else value)
    solved = [bool(s) for s in scores.solved] if scores.solved is not None else reward.solved_from(values)
    solved = [ok and i not in failed for i, ok in enumerate(solved)]
    components = {part: [None if v is None else 0.0 if i in failed else float(v) for i, v in enumerate(vals)]
                  for part, vals in scores.components.items()}
    if tokens is not None:  # a failed sample's token scores do not train either
        tokens = [None if i in failed else t for i, t in enumerate(tokens)]
    return Scores(values=values, solved=solved, failed=failed, components=components, token_scores=tokens,
                  metrics={k: float(v) for k, v in scores.metrics.items()})


def _check_counts(name: str, samples: Sequence[Sample], scores: Scores) -> None:
    if len(scores.values) != len(samples):
        raise RecipeError(f"model.reward: {name}.score returned {len(scores.values)} scores for {len(samples)} "
                          "samples; it must return one per sample, in the order given")
    if scores.solved is not None and len(scores.solved) != len(samples):
        raise RecipeError(f"model.reward: {name}.score returned {len(scores.solved)} solved flags for "
                          f"{len(samples)} samples")
    for part, vals in scores.components.items():
        if len(vals) != len(samples):
            raise RecipeError(f"model.reward: {name}.score returned {len(vals)} values of component {part!r} for "
                              f"{len(samples)} samples")


def _checked_tokens(name: str, samples: Sequence[Sample], tokens, failed: dict[int, str]):
    """``tokens`` (``Scores.token_scores``) as floats; ``RecipeError`` in one line for a wrong count of samples or of
    a sample's tokens; a sample with a token score that is not finite is marked in ``failed``."""
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


__all__ = ["MEAN_METRICS", "Sample", "Scores", "checked", "combine_metrics", "finite_in_float32"]
