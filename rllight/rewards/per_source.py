"""One reward per dataset: rows are scored by the reward of their ``data_source``.

A mixture of datasets (GSM8K integers next to MATH expressions) needs a verifier per dataset. In a recipe::

    reward:
      class_path: rllight.rewards.PerSource
      init_args:
        rewards:
          openai/gsm8k: {class_path: rllight.rewards.IntegerMatch}
          lighteval/MATH: {class_path: rllight.rewards.MathVerify}
        default: {class_path: rllight.rewards.MathVerify}

A data source's reward may be any reward (a verifier, a reward model, a judge, a ``Weighted`` mix): each scores its
own rows' samples in one call. ``check_rows`` checks rows' reference answers with the reward that scores each.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

from rllight.errors import RecipeError
from rllight.rewards.base import Reward, check_answers
from rllight.rewards.combine import scored
from rllight.rewards.scores import Sample, Scores


class PerSource(Reward):
    """Score each row with the reward of its ``data_source`` (the datamodule's ``data_source_key`` field).

    Args:
        rewards: A reward per data source name, exactly as the rows spell it.
        default: The reward of rows whose data source is not in ``rewards`` (None: such a row is an error
            that names its source).
    """

    def __init__(self, rewards: dict[str, Reward] | None = None, default: Reward | None = None):
        rewards = dict(rewards or {})
        if not rewards and default is None:
            raise RecipeError("model.reward.init_args: PerSource needs 'rewards' (a reward per data source) or a "
                              "'default' reward")
        for name, reward in [*rewards.items(), *([("default", default)] if default is not None else [])]:
            if not isinstance(reward, Reward):
                where = f"rewards.{name}" if name in rewards else "default"
                raise RecipeError(f"model.reward.init_args.{where} is a {type(reward).__name__}, not a reward; "
                                  "give a class_path such as rllight.rewards.IntegerMatch")
        self.rewards = rewards
        self.default = default

    def for_source(self, data_source: str) -> Reward:
        """The reward of rows whose ``data_source`` is ``data_source``."""
        reward = self.rewards.get(data_source, self.default)
        if reward is None:
            known = ", ".join(repr(s) for s in self.rewards)
            raise RecipeError(f"model.reward: no reward for data_source {data_source!r} (PerSource has {known}); "
                              "add it under model.reward.init_args.rewards or set model.reward.init_args.default")
        return reward

    def parts(self) -> list[Reward]:
        found: list[Reward] = []
        for reward in [*self.rewards.values(), self.default]:
            if reward is not None and not any(reward is f for f in found):  # one reward may serve several sources
                found.append(reward)
        return found

    def guarded(self, runner) -> Reward:
        guarded = copy.copy(self)
        done = {id(r): r.guarded(runner) for r in self.parts()}
        guarded.rewards = {source: done[id(r)] for source, r in self.rewards.items()}
        guarded.default = None if self.default is None else done[id(self.default)]
        return guarded

    def split(self, rows: Sequence[dict]) -> list[tuple[Reward, list[int]]]:
        groups: dict[str, list[int]] = {}
        for i, row in enumerate(rows):
            groups.setdefault(str(row.get("data_source")), []).append(i)
        out = []
        for source, index in groups.items():
            try:
                out.append((self.for_source(source), index))
            except RecipeError as err:
                raise RecipeError(f"{rows[index[0]].get('source', f'row {index[0] + 1}')}: {err}") from None
        return out

    def score(self, samples: Sequence[Sample]) -> Scores:
        parts = [(reward, index) for reward, index in self.split([s.row for s in samples])]
        return Scores.join(len(samples), [(scored(reward, [samples[i] for i in index]), index)
                                          for reward, index in parts])


def check_rows(reward: Reward, rows: Sequence[dict], field: str = "answer") -> None:
    """``check_answers`` with each row checked by the reward that scores it (``Reward.split``: by data source
    under ``PerSource``); raises ``RecipeError`` on the first row the reward can never match, or whose data source
    has no reward (naming the row)."""
    for part, index in reward.split(rows):
        check_answers(part, [rows[i] for i in index], field)
