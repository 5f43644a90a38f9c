"""The interface of a multi-turn environment: what it says to the model, and how it scores it."""

from __future__ import annotations

import copy
from dataclasses import dataclass

from rllight.bounds import AtLeastTwo, PositiveFiniteFloat, PositiveInt, bounded


@dataclass
class StepResult:
    """What an environment answers to one model turn."""

    observation: str | list[dict] | None
    """What the model is shown next: text (one turn in the environment's ``observation_role``) or chat messages
    (dicts with ``role`` and ``content``, plus what the template reads, e.g. a tool result's ``name`` or
    ``tool_call_id``); None when the episode is done."""
    reward: float
    """Reward of this turn; a trajectory's reward is ``Environment.trajectory_reward`` of its turns' rewards."""
    done: bool
    """The episode is over (answered, or out of attempts)."""
    correct: bool | None = None
    """Whether the task is solved so far (for the accuracy metrics); None = not judged at this turn."""


class Environment:
    """A multi-turn task: the model answers, the environment replies, until it is done or a limit is hit.

    Select one with ``model.environment`` (``class_path`` + ``init_args``). The object in the recipe holds the
    settings and is a factory: ``spawn()`` returns a fresh copy for one episode, so the G episodes of a prompt
    run independently. On that copy the episode runner calls ``reset(row)`` once (its text, if any, is added to
    the prompt), then ``step(response_text)`` after every model turn. Keep per-episode state on ``self`` and
    set it in ``reset``.

    The runner stops an episode when ``step`` says ``done``, after ``max_turns`` model turns, or when the
    context (prompt, model turns and observations) would exceed ``max_total_tokens``; the last two count as
    truncated. A trajectory's reward is ``trajectory_reward`` of its turns' rewards (their sum by default),
    and its correctness the last ``correct`` a turn reported (False when none did).

    Every call into an episode runs under a guard (``rllight.envs.guard``): one that raises, runs past
    ``timeout_seconds``, returns something other than a ``StepResult`` or a reward that is not finite in
    float32 ends that episode with reward 0, counted (``train/episode/failures``, ``train/episode/timeouts``)
    and logged; the run goes on. Every episode of ``model.guards.max_failed_reward_steps`` batches in a row failing
    stops it with one line naming the environment class. A call past its limit cannot be killed and keeps its
    thread until it returns; once ``max(3, max_concurrency)`` calls of one method are in that state, that method is
    not called (its episodes fail at once) until one returns, so hung calls leave a bounded number of threads.

    Args:
        max_turns: Most model turns per episode.
        max_total_tokens: Most tokens in an episode's context, prompt included (at least a prompt and one token).
        timeout_seconds: Wall-clock limit of one call (``reset``, ``step``, ``trajectory_reward``); past it the
            episode gets reward 0. None = calls in the trainer's thread without a limit (for an environment
            that needs the main thread, e.g. signal-based timeouts of its own).
        max_concurrency: Episodes whose ``reset``, or whose ``step`` within a turn, runs at once (a bounded pool of
            threads, each call under its own ``timeout_seconds``), so that one slow environment (a tool, an HTTP
            round-trip) does not hold up the others; 1 calls them one after another. ``timeout_seconds: null`` steps them one after
            another in the trainer's thread.
    """

    DEFAULT_TIMEOUT = 30.0
    """Seconds one call into an environment may take by default."""

    observation_role = "user"
    """Chat role of the observation turns (``tool`` for a template that has one the model knows)."""

    max_concurrency = 8
    """Episodes stepped at once within a turn (see the constructor)."""

    tokenizer = None
    """The policy's tokenizer, set by the rollout producer before the first episode (environments that read tool
    calls in the model's own format use it, ``rllight.envs.tool_calls``)."""

    verifier = None
    """The verifier of the rows' reference answers (a ``rllight.rewards.Verifier``) when the environment judges answers
    with one: without a ``model.reward``, it checks every reference answer before the model loads and runs the reward
    pre-flight, as a reward would. None: the rows have no answers to check (a game's)."""

    @bounded
    def __init__(self, max_turns: PositiveInt = 3, max_total_tokens: AtLeastTwo = 1024,
                 timeout_seconds: PositiveFiniteFloat | None = DEFAULT_TIMEOUT, max_concurrency: PositiveInt = 8):
        self.max_concurrency = max_concurrency
        self.max_turns = max_turns
        self.max_total_tokens = max_total_tokens
        self.timeout_seconds = None if timeout_seconds is None else float(timeout_seconds)

    def spawn(self) -> Environment:
        """A fresh episode object with this environment's settings (a shallow copy; ``reset`` sets its state)."""
        return copy.copy(self)

    def reset(self, row: dict) -> str | None:
        """Start an episode on the prompt row ``row`` (fields ``messages``, ``answer``, ...). Returns text added
        to the prompt's last message (e.g. tool instructions), or None."""
        return None

    def tools(self) -> list[dict] | None:
        """The tools the model may call, as JSON schemas (``{"type": "function", "function": {...}}``): the chat
        template renders them into the prompt in the model's own format (``apply_chat_template(tools=...)``).
        None = no tools. Called after ``reset``, so an episode may offer its own."""
        return None

    def step(self, response_text: str) -> StepResult:
        """Judge one model turn (its decoded text, special tokens removed) and say what comes next."""
        raise NotImplementedError

    def trajectory_reward(self, rewards: list[float]) -> float:
        """The reward of a whole trajectory from its turns' rewards (in order): their sum."""
        return float(sum(rewards))

    def close(self) -> None:
        """Free what the factory object holds (a server it started, open sessions) when a fit or a validation
        ends; the next episode may take them again. Nothing by default."""
