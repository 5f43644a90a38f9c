"""Arithmetic with feedback: a wrong answer is told so and may be corrected."""

from __future__ import annotations

from rllight.bounds import AtLeastTwo, PositiveFiniteFloat, PositiveInt, UpToOne
from rllight.envs.base import Environment
from rllight.envs.feedback import Feedback
from rllight.rewards import IntegerMatch


class ArithmeticFeedback(Feedback):
    """The embedded arithmetic task (or any task with integer answers) over several attempts: ``Feedback``
    with ``IntegerMatch`` as the verifier (each answer read as the last integer, or that of the last
    ``\\boxed{}``).

    Args:
        max_turns: Attempts per episode.
        max_total_tokens: Most tokens in an episode's context, prompt included.
        timeout_seconds: Wall-clock limit of one call into an episode (see ``Environment``).
        max_concurrency: Episodes stepped at once within a turn (see ``Environment``).
        turn_discount: Reward factor per extra attempt, in (0, 1] (1 = a late correct answer counts in full).
        feedback: What the environment says after a wrong answer.
    """

    def __init__(self, max_turns: PositiveInt = 3, max_total_tokens: AtLeastTwo = 512, turn_discount: UpToOne = 1.0,
                 feedback: str = "That is not correct. Try again.",
                 timeout_seconds: PositiveFiniteFloat | None = Environment.DEFAULT_TIMEOUT,
                 max_concurrency: PositiveInt = 8):
        super().__init__(IntegerMatch(), max_turns=max_turns, max_total_tokens=max_total_tokens,
                         turn_discount=turn_discount, feedback=feedback, timeout_seconds=timeout_seconds,
                         max_concurrency=max_concurrency)
