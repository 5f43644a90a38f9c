"""A calculator tool: the model may ask for a computation before it answers.

The tool call format is ``<calc>EXPRESSION</calc>`` anywhere in a model turn (the first one counts); the
environment replies ``<result>VALUE</result>`` (or ``<result>error: REASON</result>``) in the next user turn.
A turn without a tool call is the final answer. Expressions are read by a small recursive-descent parser of
numbers, ``+ - * /``, parentheses and unary signs, with exact rational arithmetic and limits on length,
nesting and magnitude; model text is never handed to ``eval``, ``exec`` or ``ast``.
"""

from __future__ import annotations

import re
from fractions import Fraction

from rllight.bounds import AtLeastTwo, PositiveFiniteFloat, PositiveInt, bounded
from rllight.envs.base import Environment, StepResult
from rllight.rewards import IntegerMatch

TOOL_CALL = re.compile(r"<calc>(.*?)</calc>", re.DOTALL)
"""A tool call in a model turn; group 1 is the expression."""

_NUMBER = re.compile(r"\d+(?:\.\d+)?|\.\d+")
_MAX_DIGITS = 30  # per literal: a longer one is refused before it is converted


class CalcError(ValueError):
    """An expression the calculator refuses or cannot evaluate (the message is shown to the model)."""


class _Parser:
    """expr := term (('+' | '-') term)* ; term := unary (('*' | '/') unary)* ;
    unary := ('+' | '-') unary | primary ; primary := NUMBER | '(' expr ')'."""

    def __init__(self, text: str, max_depth: int, max_magnitude: int):
        self.tokens = self._tokenise(text)
        self.pos = 0
        self.depth = 0
        self.max_depth = max_depth
        self.max_magnitude = max_magnitude

    @staticmethod
    def _tokenise(text: str) -> list[str]:
        tokens, i = [], 0
        while i < len(text):
            c = text[i]
            if c.isspace():
                i += 1
            elif c in "+-*/()":
                tokens.append(c)
                i += 1
            else:
                m = _NUMBER.match(text, i)
                if m is None:
                    raise CalcError(f"unexpected character {c!r}")
                if len(m.group()) > _MAX_DIGITS:
                    raise CalcError("number too long")
                tokens.append(m.group())
                i = m.end()
        return tokens

    def parse(self) -> Fraction:
        if not self.tokens:
            raise CalcError("empty expression")
        value = self._expr()
        if self.pos != len(self.tokens):
            raise CalcError(f"unexpected {self.tokens[self.pos]!r}")
        return value

    def _peek(self) -> str | None:
        return self.tokens[self.pos] if self.pos < len(self.tokens) else None

    def _take(self) -> str:
        token = self._peek()
        if token is None:
            raise CalcError("unexpected end of expression")
        self.pos += 1
        return token

    def _checked(self, value: Fraction) -> Fraction:
        # Bounds every intermediate: without powers, products are the only way to grow, one step at a time.
        if abs(value.numerator) > self.max_magnitude * value.denominator:
            raise CalcError("number too large")
        if value.denominator > self.max_magnitude:
            raise CalcError("number too small")
        return value

    def _nest(self) -> None:
        self.depth += 1
        if self.depth > self.max_depth:
            raise CalcError("expression nested too deeply")

    def _expr(self) -> Fraction:
        value = self._term()
        while self._peek() in ("+", "-"):
            op, rhs = self._take(), self._term()
            value = self._checked(value + rhs if op == "+" else value - rhs)
        return value

    def _term(self) -> Fraction:
        value = self._unary()
        while self._peek() in ("*", "/"):
            op, rhs = self._take(), self._unary()
            if op == "/" and rhs == 0:
                raise CalcError("division by zero")
            value = self._checked(value * rhs if op == "*" else value / rhs)
        return value

    def _unary(self) -> Fraction:
        if self._peek() in ("+", "-"):
            op = self._take()
            self._nest()
            value = self._unary()
            self.depth -= 1
            return -value if op == "-" else value
        return self._primary()

    def _primary(self) -> Fraction:
        token = self._take()
        if token == "(":
            self._nest()
            value = self._expr()
            if self._take() != ")":
                raise CalcError("missing ')'")
            self.depth -= 1
            return value
        if token in "+-*/)":
            raise CalcError(f"unexpected {token!r}")
        return self._checked(Fraction(token))


def evaluate(expression: str, max_chars: int = 200, max_depth: int = 20, max_magnitude: int = 10**12) -> Fraction:
    """The exact value of an arithmetic expression: numbers (``12``, ``3.5``), ``+ - * /``, parentheses and
    unary signs. Raises ``CalcError`` for anything else (names, calls, ``**``, ...), for input longer than
    ``max_chars``, parentheses or signs nested deeper than ``max_depth``, any intermediate value beyond
    ``max_magnitude`` in absolute value (or with a denominator beyond it), and division by zero."""
    if len(expression) > max_chars:
        raise CalcError(f"expression longer than {max_chars} characters")
    return _Parser(expression, max_depth, max_magnitude).parse()


def format_number(value: Fraction, decimals: int = 6) -> str:
    """``value`` as the model should read it: an integer as is, anything else rounded to ``decimals`` places
    (trailing zeros dropped), e.g. ``Fraction(7, 2)`` -> ``3.5``, ``Fraction(1, 3)`` -> ``0.333333``."""
    if value.denominator == 1:
        return str(value.numerator)
    scaled = round(abs(value) * 10**decimals)
    whole, frac = divmod(scaled, 10**decimals)
    text = f"{whole}.{frac:0{decimals}d}".rstrip("0").rstrip(".")
    return f"-{text}" if value < 0 and text != "0" else text


DEFAULT_INSTRUCTIONS = (
    "You may use a calculator: write <calc>expression</calc> (numbers, + - * / and parentheses) and you will "
    "get <result>value</result>. Then give the final answer as just the number."
)


class Calculator(Environment):
    """An arithmetic task with a calculator tool.

    A model turn holding ``<calc>EXPRESSION</calc>`` is a tool call: the environment evaluates the expression
    with ``evaluate`` and answers ``<result>VALUE</result>`` (``<result>error: REASON</result>`` when it is
    refused), reward 0. A turn without a tool call is the final answer, scored like ``IntegerMatch`` (reward 1
    when its last integer is the reference answer, else 0), and ends the episode. An episode still calling the
    tool after ``max_turns`` turns is truncated (reward 0).

    Args:
        max_turns: Most model turns per episode (tool calls and the answer).
        max_total_tokens: Most tokens in an episode's context, prompt included.
        timeout_seconds: Wall-clock limit of one call into an episode (see ``Environment``).
        max_concurrency: Episodes stepped at once within a turn (see ``Environment``).
        instructions: Text added to the prompt's last message to describe the tool (None = nothing added).
        max_expression_chars: Longest expression the calculator reads.
        max_depth: Deepest nesting of parentheses and signs.
        max_magnitude: Largest absolute value (and denominator) of any intermediate result.
    """

    @bounded
    def __init__(self, max_turns: PositiveInt = 3, max_total_tokens: AtLeastTwo = 512,
                 instructions: str | None = DEFAULT_INSTRUCTIONS, max_expression_chars: PositiveInt = 200,
                 max_depth: PositiveInt = 20, max_magnitude: PositiveInt = 10**12,
                 timeout_seconds: PositiveFiniteFloat | None = Environment.DEFAULT_TIMEOUT,
                 max_concurrency: PositiveInt = 8):
        super().__init__(max_turns=max_turns, max_total_tokens=max_total_tokens, timeout_seconds=timeout_seconds,
                         max_concurrency=max_concurrency)
        self.instructions = instructions
        self.max_expression_chars = max_expression_chars
        self.max_depth = max_depth
        self.max_magnitude = max_magnitude
        self.verifier = IntegerMatch()
        self.answer = ""

    def reset(self, row: dict) -> str | None:
        self.answer = str(row["answer"])
        return self.instructions

    def calculate(self, expression: str) -> str:
        """The observation for one tool call: ``<result>VALUE</result>`` or ``<result>error: REASON</result>``."""
        try:
            value = evaluate(expression, self.max_expression_chars, self.max_depth, self.max_magnitude)
        except CalcError as err:
            return f"<result>error: {err}</result>"
        return f"<result>{format_number(value)}</result>"

    def step(self, response_text: str) -> StepResult:
        call = TOOL_CALL.search(response_text)
        if call is not None:
            return StepResult(self.calculate(call.group(1)), 0.0, done=False)
        ok = self.verifier.is_correct(response_text, self.answer)
        return StepResult(None, 1.0 if ok else 0.0, done=True, correct=ok)
