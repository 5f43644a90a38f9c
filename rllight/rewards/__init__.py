"""Outcome rewards: verifiers that score one response against its reference answer.

A reward is any subclass of ``Reward`` (select it in a recipe by ``class_path``, including from your own
module). ``score_batch`` is what the trainer calls: a reward that raises or returns a non-finite value for
one sample gives that sample 0 and counts it, so one bad sample never stops a run.
"""

from __future__ import annotations

import logging
import math
import re

log = logging.getLogger(__name__)

_INT = re.compile(r"-?\d[\d,]*")
_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")


class Reward:
    """Score one response. ``correct`` and ``wrong`` set the reward scale (DAPO uses +1 / -1).

    Args:
        correct: Reward of a correct response.
        wrong: Reward of a wrong one.
    """

    def __init__(self, correct: float = 1.0, wrong: float = 0.0):
        self.correct = correct
        self.wrong = wrong

    def is_correct(self, response: str, answer: str) -> bool:
        """Whether ``response`` solves the task whose reference answer is ``answer``."""
        raise NotImplementedError

    def __call__(self, response: str, answer: str) -> float:
        return self.correct if self.is_correct(response, answer) else self.wrong


def last_integer(text: str) -> int | None:
    """The answer a response commits to: the content of the last ``\\boxed{}`` if any, else the last
    integer in the text (thousands separators allowed)."""
    boxed = _BOXED.findall(text)
    candidates = _INT.findall(boxed[-1] if boxed else text)
    if not candidates:
        return None
    try:
        return int(candidates[-1].replace(",", ""))
    except ValueError:
        return None


class IntegerMatch(Reward):
    """Exact integer match: the last integer of the response (or of its last ``\\boxed{}``) equals the
    reference answer."""

    def is_correct(self, response: str, answer: str) -> bool:
        got = last_integer(response)
        return got is not None and got == int(str(answer).strip().replace(",", ""))


class MathVerify(Reward):
    """Symbolic equivalence of the final answer with ``math-verify`` (fractions, radicals, LaTeX...).

    Args:
        correct: Reward of a correct response.
        wrong: Reward of a wrong one.
        timeout_seconds: Per-sample limit of the parser and verifier.
    """

    def __init__(self, correct: float = 1.0, wrong: float = 0.0, timeout_seconds: int = 5):
        super().__init__(correct=correct, wrong=wrong)
        self.timeout_seconds = timeout_seconds

    def is_correct(self, response: str, answer: str) -> bool:
        from math_verify import parse, verify

        gold = parse(f"${answer}$" if "$" not in str(answer) and "\\boxed" not in str(answer) else str(answer),
                     parsing_timeout=self.timeout_seconds)
        pred = parse(response, parsing_timeout=self.timeout_seconds)
        return bool(verify(gold, pred, timeout_seconds=self.timeout_seconds))


def score_batch(reward: Reward, responses: list[str], answers: list[str]) -> tuple[list[float], list[bool], int]:
    """Score every response; returns ``(rewards, correct, failures)``.

    A sample whose reward raises or is not finite gets reward 0 and counts as a failure.
    """
    rewards, correct, failures = [], [], 0
    for i, (response, answer) in enumerate(zip(responses, answers)):
        try:
            value = float(reward(response, answer))
            if not math.isfinite(value):
                raise ValueError(f"non-finite reward {value}")
            ok = value >= reward.correct if isinstance(reward, Reward) else value > 0
        except Exception as err:  # a user's verifier must not stop the run; the failure is counted
            log.warning("reward %s failed on sample %d: %s", type(reward).__name__, i, err)
            failures += 1
            value, ok = 0.0, False
        rewards.append(value)
        correct.append(ok)
    return rewards, correct, failures
