"""One reward per dataset: rows are scored by the reward of their ``data_source``.

A mixture of datasets (GSM8K integers next to MATH expressions) needs a verifier per dataset. In a recipe::

    reward:
      class_path: rllight.rewards.PerSource
      init_args:
        rewards:
          openai/gsm8k: {class_path: rllight.rewards.IntegerMatch}
          lighteval/MATH: {class_path: rllight.rewards.MathVerify}
        default: {class_path: rllight.rewards.MathVerify}

``score_rows`` and ``check_rows`` score and check rows with whatever reward a recipe names: a reward with
``for_source`` is asked per row, any other is used for every row. A data source's reward may be a ``BatchReward``
(``rllight.rewards.batch``, e.g. a reward model): the trainer scores its rows' samples in one call.
"""

from __future__ import annotations

from collections.abc import Sequence

from rllight.errors import RecipeError
from rllight.rewards.base import Reward, check_answers, score_batch
from rllight.rewards.batch import BatchReward
from rllight.rewards.combine import WeightedBatch


class PerSource(Reward):
    """Score each row with the reward of its ``data_source`` (the datamodule's ``data_source_key`` field).

    Args:
        rewards: A reward per data source name, exactly as the rows spell it (a ``Reward`` or a ``BatchReward``).
        default: The reward of rows whose data source is not in ``rewards`` (None: such a row is an error
            that names its source).
    """

    def __init__(self, rewards: dict[str, Reward | BatchReward] | None = None,
                 default: Reward | BatchReward | None = None):
        rewards = dict(rewards or {})
        if not rewards and default is None:
            raise RecipeError("model.reward.init_args: PerSource needs 'rewards' (a reward per data source) or a "
                              "'default' reward")
        for name, reward in rewards.items():
            if not (callable(reward) or isinstance(reward, BatchReward)):
                raise RecipeError(f"model.reward.init_args.rewards.{name} is a {type(reward).__name__}, not a reward; "
                                  "give a class_path such as rllight.rewards.IntegerMatch")
        # The base class's scale is the default's, so that a caller that treats this as one reward reads
        # the scale of the reward it delegates to.
        super().__init__(correct=getattr(default, "correct", 1.0), wrong=getattr(default, "wrong", 0.0))
        self.rewards = rewards
        self.default = default

    def for_source(self, data_source: str) -> Reward | BatchReward:
        """The reward of rows whose ``data_source`` is ``data_source``."""
        reward = self.rewards.get(data_source, self.default)
        if reward is None:
            known = ", ".join(repr(s) for s in self.rewards)
            raise RecipeError(f"model.reward: no reward for data_source {data_source!r} (PerSource has {known}); "
                              "add it under model.reward.init_args.rewards or set model.reward.init_args.default")
        return reward

    def is_correct(self, response: str, answer: str) -> bool:
        return self._unsourced().is_correct(response, answer)

    def __call__(self, response: str, answer: str) -> float:
        return self._unsourced()(response, answer)

    def _unsourced(self) -> Reward:
        """The reward of a response scored without its data source: the default."""
        if self.default is None:
            raise RecipeError("model.reward: PerSource was asked to score a response without its data_source and "
                              "has no default; score rows with rllight.rewards.score_rows")
        if isinstance(self.default, BatchReward):
            raise TypeError(f"PerSource's default {type(self.default).__name__} is a BatchReward: it scores "
                            "Samples (BatchReward.score), not one (response, answer) pair")
        return self.default


def batch_rewards(reward) -> list[BatchReward]:
    """The ``BatchReward``s among what ``reward`` scores with, each once: itself, a ``PerSource``'s rewards and
    default, and the batch rewards inside a ``WeightedBatch`` (after it); empty when every one is a ``Reward``."""
    found: list[BatchReward] = []

    def visit(part) -> None:
        if isinstance(part, BatchReward) and not any(part is f for f in found):
            found.append(part)
            if isinstance(part, WeightedBatch):
                for inner in part.rewards.values():
                    visit(inner)

    for part in [*reward.rewards.values(), reward.default] if isinstance(reward, PerSource) else [reward]:
        visit(part)
    return found


def by_source(reward, data_sources: Sequence[str | None]) -> list[tuple[Reward, list[int]]]:
    """The responses each reward scores: ``(reward, indices)`` pairs covering ``0..len(data_sources) - 1``
    once, in order of first appearance. A reward with ``for_source`` gets one pair per data source (an
    unknown source raises ``RecipeError``); any other reward gets one pair with every index. For a scorer
    other than ``score_batch`` (e.g. ``RewardRunner.score``): score each pair and put the results back at
    their indices."""
    if getattr(reward, "for_source", None) is None:
        return [(reward, list(range(len(data_sources))))]
    groups: dict[str, list[int]] = {}
    for i, source in enumerate(data_sources):
        groups.setdefault(str(source), []).append(i)
    return [(reward.for_source(source), index) for source, index in groups.items()]


def score_rows(
    reward, responses: Sequence[str], answers: Sequence[str], data_sources: Sequence[str | None]
) -> tuple[list[float], list[bool], int]:
    """``score_batch`` with each response scored by its data source's reward (``reward.for_source``; a
    reward without it scores every response). Same return value and failure handling as ``score_batch``,
    in the order of ``responses``. An unknown data source raises ``RecipeError`` (a recipe error, not a
    failed sample)."""
    if not len(responses) == len(answers) == len(data_sources):
        raise ValueError(f"score_rows needs one answer and data source per response, got {len(responses)} "
                         f"responses, {len(answers)} answers, {len(data_sources)} data sources")
    rewards, correct, failures = [0.0] * len(responses), [False] * len(responses), 0
    for sub, index in by_source(reward, data_sources):
        if isinstance(sub, BatchReward):
            raise TypeError(f"score_rows: {type(sub).__name__} is a BatchReward; it scores Samples (its score "
                            "method), not (response, answer) pairs")
        values, ok, failed = score_batch(sub, [responses[i] for i in index], [answers[i] for i in index])
        failures += failed
        for j, i in enumerate(index):
            rewards[i], correct[i] = values[j], ok[j]
    return rewards, correct, failures


def check_rows(reward, rows: Sequence[dict], field: str = "answer") -> None:
    """``check_answers`` with each row checked by its data source's reward; raises ``RecipeError`` on the
    first row the reward can never match, or whose data source has no reward (naming the row)."""
    if getattr(reward, "for_source", None) is None:
        check_answers(reward, list(rows), field)
        return
    groups: dict[str, list[dict]] = {}
    for row in rows:
        groups.setdefault(str(row.get("data_source")), []).append(row)
    for source, members in groups.items():
        try:
            sub = reward.for_source(source)
        except RecipeError as err:
            where = members[0].get("source", "a row")
            raise RecipeError(f"{where}: {err}") from err
        check_answers(sub, members, field)
