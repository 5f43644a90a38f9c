"""The reward interface (``Reward``: scores for a batch of ``Sample``s), the verifiers of one response against its
answer (``Verifier``, ``IntegerMatch``, ``MathVerify``), and the check of reference answers (the package
``rllight.rewards`` exports all of it)."""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence

from rllight.errors import RecipeError, one_line
from rllight.rewards.scores import Sample, Scores, finite_in_float32

log = logging.getLogger(__name__)

_INT = re.compile(r"-?\d[\d,]*")
_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")
_PLAIN_NUMBER = re.compile(r"\s*-?[0-9][0-9,]*(\.[0-9]+)?\s*")  # ASCII digits: what math-verify reads
NUMBER = re.compile(r"[-+]?\d[\d,]*(?:\.\d+)?|[-+]?\.\d+")
"""A number as written in a response: sign, digits with thousands separators, decimals."""


class Reward:
    """A reward: scores for a batch of responses (``score``). The one interface of every reward, whatever computes
    it and wherever it runs: a verifier of one response against its answer (``Verifier``: ``IntegerMatch``,
    ``MathVerify``...), a reward model, an LLM judge, a combination (``Weighted``, ``PerSource``).

    Subclass it and implement ``score`` for a reward that reads a whole batch (the prompt, the row, the other
    responses to the same prompt, a model of its own); subclass ``Verifier`` instead for one response against its
    reference answer. The trainer calls ``score`` once per batch with one ``Sample`` per response, in the batch's
    order; the samples of one prompt share a ``group``.
    """

    solved_at: float = 1.0
    """A sample whose value is at least this counts as solved, unless ``score`` says otherwise (``Scores.solved``)."""

    def score(self, samples: Sequence[Sample]) -> Scores | list[float]:
        """A reward per sample, in the order given (a list of floats, or ``Scores`` to say more)."""
        raise NotImplementedError(f"{type(self).__name__} implements no score(samples); a reward of one response "
                                  "against its answer subclasses rllight.rewards.Verifier")

    def solved_from(self, values: list[float]) -> list[bool]:
        """Which of ``values`` (what ``score`` gave, when it did not say) count as solved."""
        return [v >= self.solved_at for v in values]

    @property
    def name(self) -> str:
        """The reward in messages: its class's name (a wrapper gives the name of what it wraps)."""
        return type(self).__name__

    def parts(self) -> list[Reward]:
        """The rewards this one combines (none: a reward of its own)."""
        return []

    def guarded(self, runner) -> Reward:
        """This reward with its verifiers scored under ``runner`` (``rllight.rewards.RewardRunner``: worker
        processes with a per-sample timeout). A reward that is no verifier and combines none is itself."""
        return self

    def split(self, rows: Sequence[dict]) -> list[tuple[Reward, list[int]]]:
        """Which reward scores which of ``rows``: ``(reward, indices)`` pairs covering every row once (``PerSource``
        gives one per data source); itself for every row by default."""
        return [(self, list(range(len(rows))))]

    @property
    def answers_decide(self) -> bool:
        """Whether the stated final answer alone decides a response's score, so that the pre-flight can check the
        reward with the rows' reference answers (a verifier: yes; a reward model or a judge: no)."""
        return False

    def full_reward(self) -> str:
        """What a solved response earns, in the pre-flight's words (``its full reward 1``)."""
        return "a solved score"

    def check_answer(self, answer: str) -> str | None:
        """A one-line reason when no response can ever be scored against the reference ``answer``; None when one
        can. The default accepts every answer (a reward model or a judge reads any row)."""
        return None

    def reference_answer(self, answer: str) -> str:
        """What a correct response states as its final answer for the row whose ``answer`` field is ``answer``:
        the field itself, unless the field is a key to the answer (e.g. a reasoning-gym row's). The pre-flight
        check (``rllight.rewards.preflight``) builds its right and wrong responses from it."""
        return answer

    def check(self) -> None:
        """Raise ``RecipeError`` in one line for what can be found wrong before the policy loads (a model folder that
        is not the right kind, an API key's environment variable that is unset); the trainer calls it first. The
        default checks the rewards this one combines."""
        for part in self.parts():
            part.check()

    def close(self) -> None:
        """Free what the reward holds (a model, connections); the trainer calls it when the run ends."""
        for part in self.parts():
            part.close()


class Verifier(Reward):
    """A reward of one response against its reference answer: ``correct`` or ``wrong`` by ``is_correct``, or any
    value ``__call__`` gives (partial credit). Under ``model.reward_runner`` each response is scored in a worker
    process with a timeout (``guarded``); in a reward of its own ``score`` scores each sample here.

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

    def verdict(self, response: str, answer: str) -> tuple[float, bool]:
        """``(value, solved)`` of one response: solved means its full reward (``value >= correct``). Raises when the
        reward does, or gives a value that is not finite in float32."""
        value = float(self(response, answer))
        if not finite_in_float32(value):
            raise ValueError(f"reward {value!r} is not finite in float32")
        return value, value >= self.correct

    def score(self, samples: Sequence[Sample]) -> Scores:
        """Each sample's ``verdict``, in this process; a sample whose reward raises fails (0, counted)."""
        return verdicts(self, [(s.response, s.answer) for s in samples])

    def solved_from(self, values: list[float]) -> list[bool]:
        return [v >= self.correct for v in values]

    def guarded(self, runner) -> Reward:
        return self if runner is None else runner.guard(self)

    @property
    def answers_decide(self) -> bool:
        return True

    def full_reward(self) -> str:
        return f"its full reward {self.correct:g}"


def verdicts(verifier: Verifier, pairs: Sequence[tuple[str, str]]) -> Scores:
    """The ``verdict`` of each ``(response, answer)`` of ``pairs`` as ``Scores``; a pair whose verdict raises fails
    (0, not solved, why in ``failed``)."""
    scores = Scores(values=[0.0] * len(pairs), solved=[False] * len(pairs))
    for i, (response, answer) in enumerate(pairs):
        try:
            scores.values[i], scores.solved[i] = verifier.verdict(response, answer)
        except Exception as err:  # noqa: BLE001 - a user's verifier must not stop the run; the sample fails
            scores.failed[i] = one_line(err)
    return scores


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


class IntegerMatch(Verifier):
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


class MathVerify(Verifier):
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


def quote(text: str, limit: int = 60) -> str:
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
            raise RecipeError(f"{where}: {field} {quote(answer)} can never be matched by "
                              f"{type(reward).__name__}: {reason}")
