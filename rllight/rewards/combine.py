"""Reward shaping: a weighted sum of named rewards (e.g. correctness plus a small format bonus), and a
format reward to put in it.

A recipe combines them by ``class_path``::

    reward:
      class_path: rllight.rewards.Weighted
      init_args:
        rewards:
          correctness: {class_path: rllight.rewards.MathVerify}
          format: {class_path: rllight.rewards.FormatReward}
        weights: {correctness: 1.0, format: 0.2}
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

from rllight.errors import RecipeError, one_line
from rllight.rewards.base import Reward, _finite_in_float32
from rllight.rewards.batch import BatchReward, BatchScores, Sample, as_batch_scores


class FormatReward(Reward):
    """Rewards the form of a response, not its answer: ``correct`` when ``pattern`` occurs in the response,
    else ``wrong``.

    Args:
        pattern: Python regular expression searched anywhere in the response (``re.search``, with ``.``
            matching newlines too). The default asks for a non-empty ``\\boxed{...}``.
        correct: Reward of a response that matches.
        wrong: Reward of one that does not.
    """

    def __init__(self, pattern: str = r"\\boxed\{.+\}", correct: float = 1.0, wrong: float = 0.0):
        super().__init__(correct=correct, wrong=wrong)
        try:
            self.regex = re.compile(pattern, re.DOTALL)
        except re.error as err:
            raise RecipeError(f"FormatReward.pattern {pattern!r} is not a regular expression ({err}); "
                              "write it in Python's re syntax") from None
        self.pattern = pattern

    def is_correct(self, response: str, answer: str) -> bool:
        return self.regex.search(response) is not None


class Weighted(Reward):
    """Weighted sum of named rewards: ``sum(weights[name] * rewards[name](response, answer))``.

    A response counts as correct when the component ``correct_from`` gives it its full reward (``value >=
    that component's correct``), whatever the others say: a format bonus never makes a wrong answer
    correct. ``correct`` and ``wrong`` are the largest and smallest totals the components can give (every
    component at its ``correct`` or ``wrong``, whichever its weight favours).

    Args:
        rewards: The components by name, e.g. ``{correctness: MathVerify, format: FormatReward}``. Each name
            is logged as ``train/reward/<name>`` (its unweighted value).
        weights: Weight of each component, one per name in ``rewards``; None weighs each by 1.
        correct_from: Name of the component that decides whether a response is correct (and whose
            ``check_answer`` checks the reference answers); None: the first name in ``rewards``.
    """

    def __init__(self, rewards: dict[str, Reward], weights: dict[str, float] | None = None,
                 correct_from: str | None = None):
        weights, correct_from = _checked("Weighted", rewards, weights, correct_from, (Reward,))
        self.rewards = dict(rewards)
        self.weights = weights
        self.correct_from = correct_from
        ends = [(w * self.rewards[n].correct, w * self.rewards[n].wrong) for n, w in self.weights.items()]
        super().__init__(correct=sum(max(e) for e in ends), wrong=sum(min(e) for e in ends))

    def components(self, response: str, answer: str) -> dict[str, float]:
        """Each component's own (unweighted) value for this response, by name."""
        return {name: float(reward(response, answer)) for name, reward in self.rewards.items()}

    def combine(self, components: dict[str, float]) -> float:
        """The weighted sum of the values ``components`` returned."""
        return sum(self.weights[name] * value for name, value in components.items())

    def correct_given(self, components: dict[str, float]) -> bool:
        """Whether the values ``components`` returned make the response correct (``correct_from`` at its full
        reward)."""
        return components[self.correct_from] >= self.rewards[self.correct_from].correct

    def __call__(self, response: str, answer: str) -> float:
        return self.combine(self.components(response, answer))

    def is_correct(self, response: str, answer: str) -> bool:
        judge = self.rewards[self.correct_from]
        return float(judge(response, answer)) >= judge.correct

    def check_answer(self, answer: str) -> str | None:
        return self.rewards[self.correct_from].check_answer(answer)

    def reference_answer(self, answer: str) -> str:
        return self.rewards[self.correct_from].reference_answer(answer)


class WeightedBatch(BatchReward):
    """``Weighted`` for a mix that holds a ``BatchReward`` (a reward model, a judge): the weighted sum of named
    rewards, scored a batch of ``Sample``s at a time.

    Each ``Reward`` component scores each sample's ``(response, answer)`` (``rllight.rewards.runner.score_one``'s
    rules, in the trainer's process); each ``BatchReward`` component scores the whole batch in one call of its ``score``.
    A sample is correct when ``correct_from`` says so (its full reward, or its ``BatchScores.correct``). A component
    that fails on a sample (it raised, gave a value that is not finite, or said it could not score it) fails that
    sample: 0, counted in ``train/reward/failures``; a ``BatchReward`` component that raises fails every sample. The
    trainer closes the batch components through ``batch_rewards``.

    Args:
        rewards: The components by name, each a ``Reward`` or a ``BatchReward``. Each name is logged as
            ``train/reward/<name>`` (its unweighted mean, 0 on a failed sample).
        weights: Weight of each component, one per name in ``rewards``; None weighs each by 1.
        correct_from: Name of the component that decides whether a response is correct (and whose
            ``check_answer`` checks the reference answers); None: the first name in ``rewards``.
    """

    def __init__(self, rewards: dict[str, Reward | BatchReward], weights: dict[str, float] | None = None,
                 correct_from: str | None = None):
        self.weights, self.correct_from = _checked("WeightedBatch", rewards, weights, correct_from,
                                                   (Reward, BatchReward))
        self.rewards = dict(rewards)
        # the total when every component gives its full reward (a BatchReward has no ``wrong``: 0)
        super().__init__(correct=sum(max(w * r.correct, w * getattr(r, "wrong", 0.0))
                                     for r, w in zip(self.rewards.values(), self.weights.values())))

    def score(self, samples: Sequence[Sample]) -> BatchScores:
        total, correct, failed = [0.0] * len(samples), [False] * len(samples), {}
        components: dict[str, list[float]] = {}
        tokens: list[list[float] | None] = [None] * len(samples)
        for name, reward in self.rewards.items():
            values, oks, fails, dense = _component_scores(reward, samples)
            components[name] = values
            for i, part in enumerate(dense or ()):  # the weighted sum of the components' token scores
                if part is not None:
                    base = tokens[i] or [0.0] * len(part)
                    tokens[i] = [b + self.weights[name] * v for b, v in zip(base, part)]
            for i, why in fails.items():
                failed.setdefault(i, f"{name}: {why}")
            total = [t + self.weights[name] * v for t, v in zip(total, values)]
            if name == self.correct_from:
                correct = oks
        components = {name: [0.0 if i in failed else v for i, v in enumerate(vals)]
                      for name, vals in components.items()}
        return BatchScores(scores=[0.0 if i in failed else t for i, t in enumerate(total)],
                           correct=[ok and i not in failed for i, ok in enumerate(correct)], failed=failed,
                           components=components, token_scores=tokens if any(t is not None for t in tokens) else None)

    def check_answer(self, answer: str) -> str | None:
        return self.rewards[self.correct_from].check_answer(answer)


def _component_scores(reward: Reward | BatchReward, samples: Sequence[Sample]
                      ) -> tuple[list[float], list[bool], dict[int, str], list | None]:
    """``(values, correct, failed, token scores)`` of one ``WeightedBatch`` component on ``samples``; ``failed`` maps
    a sample the component could not score to why (its value is 0). A ``RecipeError`` is raised: the recipe's
    fault."""
    if isinstance(reward, BatchReward):
        try:
            out = reward.score(samples)
        except RecipeError:
            raise
        except Exception as err:  # noqa: BLE001 - a judge down fails this batch's samples, not the run
            why = one_line(err)
            return [0.0] * len(samples), [False] * len(samples), dict.fromkeys(range(len(samples)), why), None
        checked = as_batch_scores(reward, samples, out)
        return checked.scores, checked.correct, checked.failed, checked.token_scores
    values, oks, failed = [], [], {}
    for i, s in enumerate(samples):
        try:  # ``rllight.rewards.runner.score_one``'s rules (the runner imports this module)
            if isinstance(reward, Weighted):
                parts = reward.components(s.response, s.answer)
                value, ok = float(reward.combine(parts)), reward.correct_given(parts)
            else:
                value = float(reward(s.response, s.answer))
                ok = value >= reward.correct
            if not _finite_in_float32(value):
                raise ValueError(f"reward {value!r} is not finite in float32")
        except Exception as err:  # noqa: BLE001 - a user's verifier must not stop the run; the sample fails
            failed[i], value, ok = one_line(err), 0.0, False
        values.append(value)
        oks.append(ok)
    return values, oks, failed, None


def _checked(kind: str, rewards: dict, weights: dict[str, float] | None, correct_from: str | None,
             types: tuple[type, ...]) -> tuple[dict[str, float], str]:
    """``(weights, correct_from)`` of a weighted sum of ``rewards`` (``kind``: the class, for the messages),
    with None filled in; a one-line ``RecipeError`` for an empty ``rewards``, a component not of ``types``, a
    missing, unknown or non-finite weight, or an unknown ``correct_from``."""
    if not rewards:
        raise RecipeError(f"{kind}.rewards is empty; name at least one reward, e.g. "
                          "{correctness: {class_path: rllight.rewards.MathVerify}}")
    names = list(rewards)
    what = " or ".join(f"a rllight.rewards.{t.__name__}" for t in types)
    for name, reward in rewards.items():
        if not isinstance(reward, types):
            raise RecipeError(f"{kind}.rewards.{name} is a {type(reward).__name__}, not a "
                              f"{'Reward' if types == (Reward,) else 'reward'}; "
                              f"give it as {{class_path: ..., init_args: ...}} of {what}")
    weights = {name: 1.0 for name in names} if weights is None else dict(weights)
    for name in weights:
        if name not in rewards:
            raise RecipeError(f"{kind}.weights.{name}: no reward of that name in rewards "
                              f"({', '.join(names)}); weigh only the rewards you name")
    for name in names:
        if name not in weights:
            raise RecipeError(f"{kind}.weights has no weight for {name!r}; give every reward in rewards a "
                              "weight (or leave weights out to weigh each by 1)")
        if not math.isfinite(float(weights[name])):
            raise RecipeError(f"{kind}.weights.{name} is {weights[name]}; give a finite number")
    correct_from = names[0] if correct_from is None else correct_from
    if correct_from not in rewards:
        raise RecipeError(f"{kind}.correct_from {correct_from!r} is not a reward in rewards "
                          f"({', '.join(names)}); name the component that judges correctness")
    return {name: float(weights[name]) for name in names}, correct_from
