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

import copy
import math
import re
from collections.abc import Sequence

from rllight.errors import RecipeError, one_line
from rllight.rewards.agreement import pair_metrics
from rllight.rewards.base import Reward, Verifier
from rllight.rewards.scores import Sample, Scores, checked, combine_metrics


class FormatReward(Verifier):
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
    """Weighted sum of named rewards: ``sum(weights[name] * value of rewards[name])`` per sample. Any reward may be a
    component: verifiers, a reward model, a judge, another combination.

    A response counts as solved when the component ``correct_from`` says it is solved (a verifier: its full
    reward), whatever the others say: a format bonus never makes a wrong answer correct. A component that fails on
    a sample (it raised, gave a value that is not finite, or said it could not score it) fails that sample: 0,
    counted in ``train/reward/failures``; a component whose ``score`` raises fails every sample of the batch. Its
    token scores, weighted, add up like the values.

    Where a model-served component (one the stated answer does not decide: ``LLMJudge``, ``RewardModel``) trains
    beside a verifier (one it does: ``IntegerMatch``, ``MathVerify``), each step logs how far they agree
    (``agreement_pairs``, ``rllight.rewards.agreement.pair_metrics``), over the samples both scored:
    ``train/reward/agreement/<model>_vs_<verifier>/rank_corr`` and ``.../verifier_at_top``, whatever the weights (a
    verifier of weight 0 is scored too). ``rllight.callbacks.RewardHackingGuard`` acts on the two means.

    Args:
        rewards: The components by name, e.g. ``{correctness: MathVerify, format: FormatReward}``. Each name
            is logged as ``train/reward/<name>`` (its unweighted mean, 0 on a failed sample).
        weights: Weight of each component, one per name in ``rewards``; None weighs each by 1.
        correct_from: Name of the component that decides whether a response is solved (and whose
            ``check_answer`` checks the reference answers); None: the first name in ``rewards``.
    """

    def __init__(self, rewards: dict[str, Reward], weights: dict[str, float] | None = None,
                 correct_from: str | None = None):
        self.weights, self.correct_from = _checked("Weighted", rewards, weights, correct_from)
        self.rewards = dict(rewards)

    def parts(self) -> list[Reward]:
        return list(self.rewards.values())

    def agreement_pairs(self) -> list[tuple[str, str]]:
        """``(model reward, verifier)`` name pairs whose agreement ``score`` logs: each component whose score the stated
        answer alone does not decide (``answers_decide`` False: a judge, a reward model) with each that it decides (a
        verifier), in the order of ``rewards``."""
        models = [name for name, reward in self.rewards.items() if not reward.answers_decide]
        verifiers = [name for name, reward in self.rewards.items() if reward.answers_decide]
        return [(model, verifier) for model in models for verifier in verifiers]

    def guarded(self, runner) -> Reward:
        guarded = copy.copy(self)
        guarded.rewards = {name: reward.guarded(runner) for name, reward in self.rewards.items()}
        return guarded

    def score(self, samples: Sequence[Sample]) -> Scores:
        count = len(samples)
        total, solved, failed, part_metrics = [0.0] * count, [False] * count, {}, []
        components: dict[str, list[float | None]] = {}
        failed_by: dict[str, set[int]] = {}
        tokens: list[list[float] | None] = [None] * count
        for name, reward in self.rewards.items():
            part = scored(reward, samples)
            components[name], failed_by[name] = list(part.values), set(part.failed)
            weight = self.weights[name]
            for i, dense in enumerate(part.token_scores or ()):  # the weighted sum of the components' token scores
                if dense is not None:
                    base = tokens[i] or [0.0] * len(dense)
                    tokens[i] = [b + weight * v for b, v in zip(base, dense)]
            for i, why in part.failed.items():
                failed.setdefault(i, f"{name}: {why}")
            total = [t + weight * v for t, v in zip(total, part.values)]
            part_metrics.append((part.metrics, count))
            if name == self.correct_from:
                solved = list(part.solved)
        metrics = combine_metrics(part_metrics)
        for model, verifier in self.agreement_pairs():
            both = [i for i in range(count) if i not in failed_by[model] and i not in failed_by[verifier]]
            metrics.update(pair_metrics(model, verifier, [components[model][i] for i in both],
                                        [components[verifier][i] for i in both], [samples[i].group for i in both]))
        return Scores(values=total, solved=solved, failed=failed, components=components,
                      token_scores=tokens if any(t is not None for t in tokens) else None, metrics=metrics)

    @property
    def answers_decide(self) -> bool:
        return all(reward.answers_decide for reward in self.rewards.values())

    def full_reward(self) -> str:
        return f"the full reward of its component {self.correct_from!r}"

    def check_answer(self, answer: str) -> str | None:
        return self.rewards[self.correct_from].check_answer(answer)

    def reference_answer(self, answer: str) -> str:
        return self.rewards[self.correct_from].reference_answer(answer)


def scored(reward: Reward, samples: Sequence[Sample]) -> Scores:
    """``reward.score(samples)``, checked (``rllight.rewards.scores.checked``). A call that raises fails every
    sample of the batch with its one-line reason; a ``RecipeError`` (the reward's own set-up, a wrong count of
    scores) is raised: the recipe's fault, not the batch's."""
    if not samples:
        return Scores(values=[], solved=[])
    try:
        out = reward.score(samples)
    except RecipeError:
        raise
    except Exception as err:  # noqa: BLE001 - a reward model out of memory, a judge down: the batch, not the run
        return Scores.failing(len(samples), one_line(err))
    return checked(reward, samples, out)


def _checked(kind: str, rewards: dict, weights: dict[str, float] | None,
             correct_from: str | None) -> tuple[dict[str, float], str]:
    """``(weights, correct_from)`` of a weighted sum of ``rewards`` (``kind``: the class, for the messages),
    with None filled in; a one-line ``RecipeError`` for an empty ``rewards``, a component that is no reward, a
    missing, unknown or non-finite weight, or an unknown ``correct_from``."""
    if not rewards:
        raise RecipeError(f"{kind}.rewards is empty; name at least one reward, e.g. "
                          "{correctness: {class_path: rllight.rewards.MathVerify}}")
    names = list(rewards)
    for name, reward in rewards.items():
        if not isinstance(reward, Reward):
            raise RecipeError(f"{kind}.rewards.{name} is a {type(reward).__name__}, not a reward; give it as "
                              "{class_path: ..., init_args: ...} of a rllight.rewards.Reward")
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
