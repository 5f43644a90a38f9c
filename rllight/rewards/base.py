"""The reward base class, the built-in verifiers, and how a batch of responses is scored and checked (the
package ``rllight.rewards`` exports all of it)."""

from __future__ import annotations

import logging
import math
import re
import struct

from rllight.errors import RecipeError

log = logging.getLogger(__name__)

_INT = re.compile(r"-?\d[\d,]*")
_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")
_PLAIN_NUMBER = re.compile(r"\s*-?[0-9][0-9,]*(\.[0-9]+)?\s*")  # ASCII digits: what math-verify reads
NUMBER = re.compile(r"[-+]?\d[\d,]*(?:\.\d+)?|[-+]?\.\d+")
"""A number as written in a response: sign, digits with thousands separators, decimals."""


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

    def check_answer(self, answer: str) -> str | None:
        """A one-line reason when no response can ever match the reference ``answer``; None when one can.

        Override it in a verifier whose answers have a required form; the base class accepts every answer.
        """
        return None

    def reference_answer(self, answer: str) -> str:
        """What a correct response states as its final answer for the row whose ``answer`` field is ``answer``:
        the field itself, unless the field is a key to the answer (e.g. a reasoning-gym row's). The pre-flight
        check (``RewardRunner.preflight``) builds its right and wrong responses from it."""
        return answer

    def __call__(self, response: str, answer: str) -> float:
        return self.correct if self.is_correct(response, answer) else self.wrong


def last_number(text: str) -> str | None:
    """The last number written in ``text`` (``NUMBER``), as written but for a trailing comma ("30, I think" -> "30");
    None when there is none."""
    numbers = NUMBER.findall(text)
    return numbers[-1].rstrip(",") if numbers else None


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

    def check_answer(self, answer: str) -> str | None:
        # Exactly the answers is_correct can read: anything else raises on every response.
        try:
            int(str(answer).strip().replace(",", ""))
        except ValueError:
            return ("it is not an integer; write the answer as an integer, or use rllight.rewards.MathVerify "
                    "for fractions, decimals and expressions")
        return None


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

    def _parse_answer(self, answer: str) -> list:
        from math_verify import parse

        text = str(answer)
        return parse(f"${text}$" if "$" not in text and "\\boxed" not in text else text,
                     parsing_timeout=self.timeout_seconds)

    def is_correct(self, response: str, answer: str) -> bool:
        from math_verify import parse, verify

        gold = self._parse_answer(answer)
        pred = parse(response, parsing_timeout=self.timeout_seconds)
        return bool(verify(gold, pred, timeout_seconds=self.timeout_seconds))

    def check_answer(self, answer: str) -> str | None:
        # verify() is False against an empty parse, whatever the response says. A plain number always
        # parses; skipping the parser for it keeps the check of a large dataset to seconds (~7 ms a parse).
        if _PLAIN_NUMBER.fullmatch(str(answer)) is None and not self._parse_answer(answer):
            return "math-verify cannot parse it; write it as a number or a LaTeX expression"
        return None


def score_batch(reward: Reward, responses: list[str], answers: list[str]) -> tuple[list[float], list[bool], int]:
    """Score every response; returns ``(rewards, correct, failures)``.

    A sample whose reward raises or is not finite in float32 (the rollout stores rewards as float32, where
    1e39 becomes inf) gets reward 0 and counts as a failure.
    """
    rewards, correct, failures = [], [], 0
    for i, (response, answer) in enumerate(zip(responses, answers)):
        try:
            value = float(reward(response, answer))
            if not _finite_in_float32(value):
                raise ValueError(f"reward {value!r} is not finite in float32")
            ok = value >= reward.correct if isinstance(reward, Reward) else value > 0
        except Exception as err:  # a user's verifier must not stop the run; the failure is counted
            log.warning("reward %s failed on sample %d (scored 0; fix the reward): %s", type(reward).__name__, i, err)
            failures += 1
            value, ok = 0.0, False
        rewards.append(value)
        correct.append(ok)
    return rewards, correct, failures


def _finite_in_float32(value: float) -> bool:
    try:  # a round trip through float32: 1e39 comes back inf (or struct raises OverflowError)
        return math.isfinite(struct.unpack("f", struct.pack("f", value))[0])
    except OverflowError:
        return False


def _quote(text: str, limit: int = 60) -> str:
    """``text`` as a short one-line quoted literal for an error message."""
    return repr(text if len(text) <= limit else text[:limit] + "...")


def check_answers(reward: Reward, rows: list[dict], field: str = "answer") -> None:
    """Raise ``RecipeError`` on the first row whose ``field`` the reward can never match.

    Such a row trains on nothing but "wrong" (e.g. ``IntegerMatch`` with the answer "2.0"). The message
    names the row's ``source`` (file and 1-based row, set by the datamodule), the field, the answer and
    the reward class. A reward without ``check_answer`` (a plain callable) is not checked.
    """
    check = getattr(reward, "check_answer", None)
    if check is None:
        return
    seen: dict[str, str | None] = {}  # each distinct answer is checked once (math-verify parses are slow)
    for i, row in enumerate(rows):
        answer = str(row.get(field, ""))
        if answer not in seen:
            seen[answer] = check(answer)
        reason = seen[answer]
        if reason:
            where = row.get("source", f"row {i + 1}")
            reason = " ".join(str(reason).split())
            raise RecipeError(f"{where}: {field} {_quote(answer)} can never be matched by "
                              f"{type(reward).__name__}: {reason}")
