"""Feedback over several attempts: a wrong answer is told so and may be corrected."""

from __future__ import annotations

from rllight.bounds import AtLeastTwo, PositiveFiniteFloat, PositiveInt, UpToOne, bounded
from rllight.envs.base import Environment, StepResult
from rllight.errors import RecipeError
from rllight.rewards.base import Verifier


class Feedback(Environment):
    """Any verifiable task over several attempts, judged by a verifier (a ``rllight.rewards`` reward).

    Each model turn is an answer, checked with ``verifier.is_correct(turn_text, row["answer"])``. A correct answer
    ends the episode with reward ``turn_discount ** (turn - 1)`` (1 at the first attempt); a wrong one is
    answered with ``feedback`` and the model tries again, until ``max_turns`` attempts were wrong (reward 0, a
    finished episode, not a truncated one). Only the verdict counts, not a partial score.

    Args:
        verifier: Judges one answer against the row's reference answer, e.g. ``rllight.rewards.IntegerMatch``
            or ``rllight.rewards.ReasoningGymScore`` (reasoning-gym's own ``score_answer``; correct = score 1).
        max_turns: Attempts per episode.
        max_total_tokens: Most tokens in an episode's context, prompt included.
        timeout_seconds: Wall-clock limit of one call into an episode (see ``Environment``).
        max_concurrency: Episodes stepped at once within a turn (see ``Environment``).
        turn_discount: Reward factor per extra attempt, in (0, 1] (1 = a late correct answer counts in full).
        feedback: What the environment says after a wrong answer.
    """

    @bounded
    def __init__(self, verifier: Verifier, max_turns: PositiveInt = 3, max_total_tokens: AtLeastTwo = 512,
                 turn_discount: UpToOne = 1.0, feedback: str = "That is not correct. Try again.",
                 timeout_seconds: PositiveFiniteFloat | None = Environment.DEFAULT_TIMEOUT,
                 max_concurrency: PositiveInt = 8):
        super().__init__(max_turns=max_turns, max_total_tokens=max_total_tokens, timeout_seconds=timeout_seconds,
                         max_concurrency=max_concurrency)
        if not feedback.strip():
            raise RecipeError("model.environment.init_args.feedback must not be empty")
        if not callable(getattr(verifier, "is_correct", None)):
            raise RecipeError(f"model.environment.init_args.verifier: {type(verifier).__name__} has no is_correct; "
                              "use a reward from rllight.rewards (e.g. IntegerMatch, ReasoningGymScore)")
        self.verifier = verifier
        self.turn_discount = turn_discount
        self.feedback = feedback
        self.answer = ""
        self.turn = 0

    def reset(self, row: dict) -> str | None:
        self.answer = str(row["answer"])
        self.turn = 0
        return None

    def step(self, response_text: str) -> StepResult:
        self.turn += 1
        if self.verifier.is_correct(response_text, self.answer):
            return StepResult(None, self.turn_discount ** (self.turn - 1), done=True, correct=True)
        if self.turn >= self.max_turns:
            return StepResult(None, 0.0, done=True, correct=False)
        return StepResult(self.feedback, 0.0, done=False, correct=False)
