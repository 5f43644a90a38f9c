"""Environments under the same guard as rewards: a fault costs its episode, never the run.

``EpisodeGuard`` makes every call into an environment (``reset``, ``step``, ``trajectory_reward``) on a helper
thread and waits at most the environment's ``timeout_seconds`` for it. A call that raises, runs past the limit
or answers something unusable (``step`` returning None, a reward that is not finite in float32, ``done=False``
without an observation) ends that episode with reward 0; the guard counts it (``episode/failures``,
``episode/timeouts``) and the rollout producer logs one warning per batch naming the environment class. While
it waits, Ctrl-C and SIGTERM are honoured within seconds (``rllight.stopping.wait_stoppable``).

A call past its limit cannot be killed (it runs in the trainer's process): it is asked to stop with an exception
(which a pure-Python loop obeys) and left to its thread otherwise. After ``HUNG_IN_A_ROW`` timeouts of one
method without a call of it that came back, the batch's remaining calls of that method are not made (their
episodes fail at once): an environment that always hangs costs a few timeouts per batch, not one per episode.

Threads are bounded over the whole run (``HungCalls``, kept by the rollout producer across batches): a call given
up on keeps its thread until it returns, and once ``max(HUNG_IN_A_ROW, max_concurrency)`` calls of one method of an
environment are in that state (what one batch may leave), no call of that method is made (its episode fails at
once, named as such) until one of them returns. So an environment whose calls hang leaves at most that many threads
per method behind however long the run, instead of a few more every step (besides the ``max_concurrency`` threads
of a turn's calls, which end with the turn); while a method is at its limit every episode that needs it fails, which
``model.guards.max_failed_reward_steps`` turns into one line that ends the run.
"""

from __future__ import annotations

import math
import threading
from concurrent.futures import ThreadPoolExecutor

from rllight.envs.base import Environment, StepResult
from rllight.errors import one_line
from rllight.rewards.base import finite_in_float32
from rllight.stopping import call_stoppable, wait_stoppable

HUNG_IN_A_ROW = 3
"""Timeouts of one method in a row, without a call of it that returned between them, after which a batch's
remaining calls of that method fail without being made."""


class HungCalls:
    """The calls into one environment that a guard gave up on and that are still running, by method, across batches
    (see the module's docstring): each holds a thread until it returns. Once ``limit`` calls of a method are,
    ``full(method)`` says so and no call of it is made until one returns."""

    def __init__(self, limit: int):
        self.limit = limit
        self._running: set[int] = set()
        self._abandoned: dict[int, str] = {}  # token -> its method
        self._next = 0
        self._lock = threading.Lock()

    @classmethod
    def of(cls, environment: Environment) -> HungCalls:
        """For ``environment``: a limit of ``max(HUNG_IN_A_ROW, max_concurrency)`` per method, what one batch may
        leave of one method (``HUNG_IN_A_ROW`` in a row, or a turn's calls hanging at once)."""
        return cls(max(HUNG_IN_A_ROW, int(getattr(environment, "max_concurrency", 1) or 1)))

    def count(self, method: str | None = None) -> int:
        """Calls (of ``method``; None: of any) given up on that are still running."""
        with self._lock:
            return sum(method is None or m == method for m in self._abandoned.values())

    def full(self, method: str) -> bool:
        return self.count(method) >= self.limit

    def start(self) -> int:
        """A call starts: its token."""
        with self._lock:
            self._next += 1
            self._running.add(self._next)
            return self._next

    def end(self, token: int) -> None:
        """The call of ``token`` returned (or raised), given up on or not."""
        with self._lock:
            self._running.discard(token)
            self._abandoned.pop(token, None)

    def abandon(self, token: int, method: str) -> None:
        """The guard gave up waiting for the call of ``token`` (of ``method``): it counts until it returns."""
        with self._lock:
            if token in self._running:
                self._abandoned[token] = method


class EpisodeFailed(Exception):
    """An environment call failed; the message says how (one line) and the episode ends with reward 0."""


def _observation_problem(observation) -> str | None:
    """What is wrong with an observation of an episode that goes on (None: it is text, or chat messages with a
    text ``role`` and ``content``)."""
    if isinstance(observation, str):
        return None
    if not isinstance(observation, list) or not observation:
        return "no observation (text or a list of chat messages)"
    for message in observation:
        if not isinstance(message, dict) or not isinstance(message.get("role"), str) \
                or not isinstance(message.get("content"), str):
            return f"an observation message without text role and content: {str(message)[:100]!r}"
    return None


class EpisodeGuard:
    """Calls into one batch's episodes of ``environment`` with a wall-clock limit and checks what they return.

    ``timeout_seconds`` is the environment's (``Environment.timeout_seconds``); None makes the calls in the
    trainer's thread without a limit (an environment that needs the main thread, e.g. for signal-based
    timeouts of its own). ``failures`` and ``timeouts`` count the episodes that failed and how many of those
    by timeout; ``first_error`` is the first failure's description. ``hung`` counts the environment's calls given
    up on and still running, kept across batches by the caller (``HungCalls``; None: this guard's own).
    """

    def __init__(self, environment: Environment, hung: HungCalls | None = None):
        self.name = type(environment).__name__
        self.hung = hung if hung is not None else HungCalls.of(environment)
        self.timeout_seconds = getattr(environment, "timeout_seconds", Environment.DEFAULT_TIMEOUT)
        self.failures = 0
        self.timeouts = 0
        self.first_error: str | None = None
        self.max_concurrency = getattr(environment, "max_concurrency", 1)
        self._hung: dict[str, int] = {}  # timeouts in a row, per method
        self._lock = threading.Lock()  # the counts, when episodes step at once

    # ---------------------------------------------------------------------------------------- calls
    def _call(self, env: Environment, method: str, *args):
        where = f"{self.name}.{method}"
        if self._hung.get(method, 0) >= HUNG_IN_A_ROW:
            raise EpisodeFailed(f"{where} not called: it timed out {self._hung[method]} times in a row")
        fn = getattr(env, method)
        if self.timeout_seconds is None:
            try:
                return fn(*args)
            except Exception as err:
                raise EpisodeFailed(f"{where} raised {one_line(err, 300)}") from None
        if self.hung.full(method):
            raise EpisodeFailed(f"{where} not called: {self.hung.count(method)} earlier calls of it are still "
                                f"running past timeout_seconds={self.timeout_seconds:g} (at most {self.hung.limit} "
                                "are left running)")
        token = self.hung.start()

        def run():
            try:
                return fn(*args)
            finally:  # also once given up on: it no longer counts when it ends
                self.hung.end(token)

        finished, value, error = call_stoppable(run, self.timeout_seconds, f"the environment {where}")
        with self._lock:
            self._hung[method] = 0 if finished else self._hung.get(method, 0) + 1
            self.timeouts += not finished
        if not finished:
            self.hung.abandon(token, method)
            raise EpisodeFailed(f"{where} did not return within timeout_seconds={self.timeout_seconds:g}")
        if error is not None:
            if not isinstance(error, Exception):  # SystemExit, KeyboardInterrupt raised by the environment
                raise error
            raise EpisodeFailed(f"{where} raised {one_line(error, 300)}")
        return value

    def reset(self, env: Environment, row: dict) -> str | None:
        """``env.reset(row)``: the text added to the prompt, or None."""
        text = self._call(env, "reset", row)
        if text is not None and not isinstance(text, str):
            raise EpisodeFailed(f"{self.name}.reset returned a {type(text).__name__}, not text or None")
        return text

    def tools(self, env: Environment) -> list[dict] | None:
        """``env.tools()``: a list of tool schemas (dicts), or None (an empty list is None)."""
        schemas = self._call(env, "tools")
        if schemas is None or schemas == []:
            return None
        if not isinstance(schemas, list) or not all(isinstance(t, dict) for t in schemas):
            raise EpisodeFailed(f"{self.name}.tools returned {type(schemas).__name__}, not a list of JSON schemas")
        return schemas

    def step(self, env: Environment, response_text: str) -> StepResult:
        """``env.step(response_text)``, checked: a ``StepResult`` whose reward is finite in float32 and which
        has an observation unless done."""
        result = self._call(env, "step", response_text)
        if not isinstance(result, StepResult):
            raise EpisodeFailed(f"{self.name}.step returned {type(result).__name__}, not a StepResult")
        reward = self._finite(result.reward, "step")
        if not result.done:
            problem = _observation_problem(result.observation)
            if problem:
                raise EpisodeFailed(f"{self.name}.step returned done=False with {problem}")
        result.reward = reward
        return result

    def step_all(self, calls: list[tuple[Environment, str]]) -> list[StepResult | EpisodeFailed]:
        """``step`` of each ``(env, response_text)``, in order: its result, or the ``EpisodeFailed`` that ends its
        episode. Up to ``max_concurrency`` calls run at once, each under its own limit, so a turn takes about its
        slowest call rather than the sum; with a limit of 1, ``timeout_seconds: null`` or one call, one after
        another. Ctrl-C and SIGTERM are honoured while the turn waits."""
        return self._all(self.step, calls, "step")

    def reset_all(self, calls: list[tuple[Environment, dict]]) -> list[tuple[str | None, list[dict] | None] |
                                                                        EpisodeFailed]:
        """``(reset(env, row), tools(env))`` of each ``(env, row)``, in order, or the ``EpisodeFailed`` of either:
        at once as in ``step_all`` (a reset that opens a session on a server is a round trip)."""
        return self._all(lambda env, row: (self.reset(env, row), self.tools(env)), calls, "reset")

    def _all(self, call, calls: list[tuple], method: str) -> list:
        """``call(*args)`` for each of ``calls``, in order, up to ``max_concurrency`` at once (see ``step_all``)."""

        def one(*args):
            try:
                return call(*args)
            except EpisodeFailed as failure:
                return failure

        if self.max_concurrency <= 1 or self.timeout_seconds is None or len(calls) <= 1:
            return [one(*args) for args in calls]
        workers = min(self.max_concurrency, len(calls))
        done, left, lock = threading.Event(), [len(calls)], threading.Lock()

        def finished(_) -> None:
            with lock:
                left[0] -= 1
                if not left[0]:
                    done.set()

        pool = ThreadPoolExecutor(workers, thread_name_prefix=f"rllight-env-{self.name}"[:40])
        try:
            futures = [pool.submit(one, *args) for args in calls]
            for future in futures:
                future.add_done_callback(finished)
            # each call gives up after its limit (a reset's two calls, after two): the bound of its waves of calls
            per_call = (self.timeout_seconds + 1.0) * (2 if method == "reset" else 1)
            bound = math.ceil(len(calls) / workers) * per_call + 5.0
            wait_stoppable(done, bound, f"the environment {self.name}.{method}")
        finally:
            pool.shutdown(wait=False, cancel_futures=True)
        return [future.result() if future.done() and not future.cancelled() else
                EpisodeFailed(f"{self.name}.{method} did not return within the turn's bound") for future in futures]

    def trajectory_reward(self, env: Environment, rewards: list[float]) -> float:
        """``env.trajectory_reward(rewards)``, finite in float32."""
        return self._finite(self._call(env, "trajectory_reward", list(rewards)), "trajectory_reward")

    def _finite(self, value, method: str) -> float:
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise EpisodeFailed(f"{self.name}.{method} gave reward {value!r}, not a number") from None
        if not finite_in_float32(number):
            raise EpisodeFailed(f"{self.name}.{method} gave reward {number!r}, which is not finite in float32")
        return number

    # ------------------------------------------------------------------------------------ failures
    def failed(self, error: EpisodeFailed) -> None:
        """Count one failed episode."""
        self.failures += 1
        if self.first_error is None:
            self.first_error = str(error)

    def summary(self, episodes: int) -> str:
        """One line for the log: how many of ``episodes`` failed, how many timed out, the first error."""
        timed = f", {self.timeouts} by timeout" if self.timeouts else ""
        return (f"the environment {self.name} failed on {self.failures} of {episodes} episode(s){timed}, each "
                f"ended with reward 0; first: {self.first_error}")
