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

from rllight.errors import RecipeError
from rllight.rewards.base import Reward


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
        if not rewards:
            raise RecipeError("Weighted.rewards is empty; name at least one reward, e.g. "
                              "{correctness: {class_path: rllight.rewards.MathVerify}}")
        names = list(rewards)
        for name, reward in rewards.items():
            if not isinstance(reward, Reward):
                raise RecipeError(f"Weighted.rewards.{name} is a {type(reward).__name__}, not a Reward; "
                                  "give it as {class_path: ..., init_args: ...} of a rllight.rewards.Reward")
        weights = {name: 1.0 for name in names} if weights is None else dict(weights)
        for name in weights:
            if name not in rewards:
                raise RecipeError(f"Weighted.weights.{name}: no reward of that name in rewards "
                                  f"({', '.join(names)}); weigh only the rewards you name")
        for name in names:
            if name not in weights:
                raise RecipeError(f"Weighted.weights has no weight for {name!r}; give every reward in rewards a "
                                  "weight (or leave weights out to weigh each by 1)")
            if not math.isfinite(float(weights[name])):
                raise RecipeError(f"Weighted.weights.{name} is {weights[name]}; give a finite number")
        correct_from = names[0] if correct_from is None else correct_from
        if correct_from not in rewards:
            raise RecipeError(f"Weighted.correct_from {correct_from!r} is not a reward in rewards "
                              f"({', '.join(names)}); name the component that judges correctness")
        self.rewards = dict(rewards)
        self.weights = {name: float(weights[name]) for name in names}
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
