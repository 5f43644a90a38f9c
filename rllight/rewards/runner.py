"""Rewards scored in worker processes, so that a verifier that hangs or kills its process costs one sample,
not the run.

``RewardRunner.score`` sends each sample to one of a few worker processes and waits at most
``timeout_seconds`` for it. A sample whose reward raises, returns a value that is not finite in float32,
runs past the timeout or takes its worker process down gets reward 0 and counts as a failure (as in
``score_batch``); a hung or dead worker is replaced and the other samples go on. The workers run each reward
on their main thread, so ``math-verify``'s SIGALRM-based timeouts work there (they do not on a trainer's
helper thread).

The workers are fresh interpreters (``SupervisedProcess.interpreter`` of ``rllight.supervised``: a kill also ends
what a hung reward started, and a worker ends with the trainer), never forks of the trainer, which holds torch
threads. Unlike ``multiprocessing``'s spawn and forkserver starts they do not re-import the trainer's ``__main__``
(under ``rllight fit`` that is torch and Lightning: seconds and hundreds of MB per worker); they import
``rllight.rewards`` and ``math-verify`` only, with the trainer's ``sys.path``. They start at the first ``score``
and are reused; the reward is pickled once per ``score`` call and sent to a worker only when that
worker has not seen the same pickle.

``RewardRunner.preflight`` runs before training: the reward must give a few rows' reference answers their
full reward and a wrong answer less, through the same workers, or the recipe stops with one line.

A ``BatchReward`` (``rllight.rewards.batch``: a reward model, a judge) is none of this: it scores a whole batch in
the trainer's process (``RolloutProducer.score`` calls it), is never pickled to a worker, and has no pre-flight (a
reward model cannot be checked with reference answers).
"""

from __future__ import annotations

import collections
import hashlib
import logging
import math
import pickle
import time
import weakref
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Self

from rllight.errors import RecipeError, one_line
from rllight.rewards.base import Reward, _finite_in_float32, _quote
from rllight.rewards.batch import BatchReward
from rllight.rewards.combine import Weighted
from rllight.supervised import ChildDied, SupervisedProcess, become_child

log = logging.getLogger(__name__)

_START_TIMEOUT = 120.0  # seconds for a worker to import rllight.rewards and math-verify (a loaded machine)
_LOAD_TIMEOUT = 120.0  # seconds to unpickle a reward (it may import a heavy module of its own)
_CACHED_REWARDS = 4  # rewards a worker keeps unpickled (a recipe has one; the check of a run may add a few)

REFERENCE_RESPONSE = "The answer is \\boxed{{{answer}}}."
"""The response ``preflight`` scores for a reference answer (``{answer}``: the answer, stripped): the
final-answer form ``IntegerMatch`` and ``MathVerify`` read first."""

PREFLIGHT_SKIP = " (--model.reward_preflight 0 skips this check)"
"""How the pre-flight's errors end: the option that turns the check off."""


@dataclass
class RewardScores:
    """The rewards of one batch of responses, in the order given.

    ``failures`` counts every sample whose reward could not be computed (it raised, was not finite in
    float32, timed out, or its worker process died): each got reward 0 and ``correct`` False.
    ``failures == len(rewards)`` means the reward failed on the whole batch. ``timeouts`` and
    ``worker_deaths`` say how many of those failures were timeouts and dead workers.
    """

    rewards: list[float]
    correct: list[bool]
    failures: int = 0
    timeouts: int = 0
    worker_deaths: int = 0
    components: dict[str, list[float]] = field(default_factory=dict)
    """For a ``Weighted`` reward, each component's unweighted value per sample (0 on a failed sample), by
    name; empty for any other reward."""
    errors: dict[int, str] = field(default_factory=dict)
    """Why each failed sample failed, by its index."""


def score_one(reward, response: str, answer: str) -> tuple[float, bool, dict[str, float] | None]:
    """``(reward, correct, components)`` of one response; raises when the reward does or returns a value
    that is not finite in float32.

    Correct means the full reward (``value >= reward.correct``, as ``score_batch``); for ``Weighted``, the
    full reward of its ``correct_from`` component, and ``components`` holds each component's value (None for
    other rewards). A plain callable (not a ``Reward``) is correct when its value is positive.
    """
    if isinstance(reward, Weighted):
        parts = reward.components(response, answer)
        value = float(reward.combine(parts))
        for name, part in parts.items():
            if not _finite_in_float32(part):
                raise ValueError(f"component {name} gave {part!r}, not finite in float32")
        ok = reward.correct_given(parts)
    else:
        parts = None
        value = float(reward(response, answer))
        ok = value >= reward.correct if isinstance(reward, Reward) else value > 0
    if not _finite_in_float32(value):
        raise ValueError(f"reward {value!r} is not finite in float32")
    return value, bool(ok), parts




# --------------------------------------------------------------------------------------------- worker side
def _serve(connection: Connection) -> None:
    """A worker's main loop: load rewards, score one sample per message, until told to stop or the trainer's
    end of the pipe closes."""
    become_child()
    try:  # the built-in verifier's import (seconds) must not count against the first sample's timeout
        import math_verify  # noqa: F401
    except ImportError:
        pass
    connection.send(("ready",))
    rewards: collections.OrderedDict[str, object] = collections.OrderedDict()
    while True:
        try:
            message = connection.recv()
        except EOFError:
            return
        if message[0] == "reward":
            _, key, blob = message
            try:
                rewards[key] = pickle.loads(blob)
                error = None
            except Exception as err:  # noqa: BLE001 - whatever failed, the trainer raises it as one line
                error = one_line(err)
            while len(rewards) > _CACHED_REWARDS:
                rewards.popitem(last=False)
            connection.send(("loaded", key, error))
        elif message[0] == "score":
            _, key, index, response, answer = message
            try:
                value, ok, parts = score_one(rewards[key], response, answer)
                connection.send(("done", index, value, ok, parts, None))
            except Exception as err:  # noqa: BLE001 - counted by the trainer, like score_batch does in-process
                connection.send(("done", index, 0.0, False, None, one_line(err)))
        else:
            return


# --------------------------------------------------------------------------------------------- trainer side
class _Worker:
    """One worker process (``child``) and where it is in the pool: ``state`` is starting, idle, loading (a
    reward) or busy (a sample), until ``deadline``."""

    def __init__(self):
        self.child = SupervisedProcess.interpreter("rllight.rewards.runner:_serve", name="a reward worker process")
        self.state = "starting"
        self.deadline = time.monotonic() + _START_TIMEOUT
        self.loaded: collections.OrderedDict[str, None] = collections.OrderedDict()
        """The rewards this worker holds unpickled, oldest first: it keeps the last ``_CACHED_REWARDS`` it loaded,
        and so does this mirror, so that a reward it dropped is sent again rather than asked for by key."""
        self.index: int | None = None

    def send(self, message: tuple, state: str, seconds: float) -> None:
        """Send ``message`` and expect the answer within ``seconds`` (``ChildDied`` if the worker is gone)."""
        self.child.send(message)
        self.state, self.deadline = state, time.monotonic() + seconds


def _stop_all(workers: list[_Worker]) -> None:
    while workers:
        worker = workers.pop()
        worker.child.stop(grace_seconds=2.0) if worker.state == "idle" else worker.child.kill()


class RewardRunner:
    """Scores rewards in worker processes with a per-sample timeout (see ``rllight.rewards.runner``).

    Only a ``Reward`` (one response against its answer) goes to the workers; a ``BatchReward`` runs in the trainer's
    process, called once per batch by the rollout producer, and ``score`` refuses it.

    Args:
        workers: Worker processes (started at the first ``score``, then reused). 0 scores in the trainer's
            process, without timeouts or protection from a reward that hangs or exits: for debugging.
        timeout_seconds: Wall-clock limit of one sample's reward; past it the sample gets 0 and its worker
            is replaced.
    """

    def __init__(self, workers: int = 2, timeout_seconds: float = 10.0):
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 0:
            raise RecipeError(f"RewardRunner.workers must be an integer >= 0, got {workers!r}; "
                              "0 scores in-process (debugging)")
        if not (isinstance(timeout_seconds, (int, float)) and math.isfinite(timeout_seconds)
                and timeout_seconds > 0):
            raise RecipeError(f"RewardRunner.timeout_seconds must be a positive number of seconds, "
                              f"got {timeout_seconds!r}")
        self.workers = workers
        self.timeout_seconds = float(timeout_seconds)
        self._start()

    def _start(self) -> None:
        self._pool: list[_Worker] = []
        self._finalizer = weakref.finalize(self, _stop_all, self._pool)

    # Pickling or copying a runner (a checkpoint, a deep copy of the module) carries its settings only.
    def __getstate__(self) -> dict:
        return {"workers": self.workers, "timeout_seconds": self.timeout_seconds}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._start()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        finalizer = getattr(self, "_finalizer", None)
        if finalizer is not None:
            finalizer()

    def close(self) -> None:
        """Stop the worker processes; a later ``score`` starts new ones."""
        self._finalizer()
        self._start()

    # ----------------------------------------------------------------------------------------- scoring
    def score(self, reward: Reward, responses: list[str], answers: list[str]) -> RewardScores:
        """Score ``responses[i]`` against ``answers[i]`` for every i; see ``RewardScores``."""
        if isinstance(reward, BatchReward):
            raise TypeError(f"RewardRunner.score: {type(reward).__name__} is a BatchReward, which runs in the trainer's "
                            "process: call its score method with the batch's Samples")
        if len(responses) != len(answers):
            raise ValueError(f"{len(responses)} responses but {len(answers)} answers")
        result = RewardScores(rewards=[0.0] * len(responses), correct=[False] * len(responses))
        if isinstance(reward, Weighted):
            result.components = {name: [0.0] * len(responses) for name in reward.rewards}
        if self.workers == 0:
            for i, (response, answer) in enumerate(zip(responses, answers)):
                try:
                    self._record(result, i, *score_one(reward, response, answer), None, reward)
                except Exception as err:  # noqa: BLE001 - a user's verifier must not stop the run; it is counted
                    self._record(result, i, 0.0, False, None, one_line(err), reward)
            return result
        if responses:
            try:
                self._score_in_workers(reward, list(responses), list(answers), result)
            except BaseException:
                # Interrupted (an unloadable reward, Ctrl-C): workers still on this batch would answer the
                # next one with stale results.
                for worker in [w for w in self._pool if w.state != "idle"]:
                    self._pool.remove(worker)
                    worker.child.kill()
                raise
        return result

    def _score_in_workers(self, reward, responses: list[str], answers: list[str], result: RewardScores) -> None:
        try:
            blob = pickle.dumps(reward)
        except Exception as err:  # noqa: BLE001 - whatever failed, it is raised as one line
            raise RecipeError(f"model.reward: {type(reward).__name__} cannot be sent to reward worker processes "
                              f"({one_line(err)}); define it at the top level of an importable module, or "
                              "score in-process with workers: 0") from None
        if type(reward).__module__ == "__main__":  # workers import rllight, not the script being run
            raise RecipeError(f"model.reward: {type(reward).__name__} is defined in the script being run, which "
                              "reward worker processes do not import; move it to an importable module, or score "
                              "in-process with workers: 0")
        key = hashlib.sha256(blob).hexdigest()
        pending = collections.deque(range(len(responses)))
        while pending or any(w.state == "busy" for w in self._pool):
            while len(self._pool) < self.workers:
                self._pool.append(_Worker())
            for worker in [w for w in self._pool if w.state == "idle"]:
                try:
                    if key not in worker.loaded:
                        worker.send(("reward", key, blob), "loading", _LOAD_TIMEOUT)
                    elif pending:
                        i = pending.popleft()
                        worker.index = i
                        worker.send(("score", key, i, responses[i], answers[i]), "busy", self.timeout_seconds)
                except ChildDied:  # it died while idle (e.g. the OOM killer): not this sample's fault
                    if worker.state == "idle" and worker.index is not None and key in worker.loaded:
                        pending.appendleft(worker.index)
                    self._pool.remove(worker)
                    worker.child.kill()
            waiting = [w for w in self._pool if w.state != "idle"]
            if not waiting:
                continue
            ready = wait([w.child.connection for w in waiting],
                         max(0.0, min(w.deadline for w in waiting) - time.monotonic()))
            for worker in waiting:
                if worker.child.connection in ready:
                    self._receive(worker, reward, result)
                elif time.monotonic() >= worker.deadline:
                    self._expire(worker, reward, result)

    def _receive(self, worker: _Worker, reward, result: RewardScores) -> None:
        try:
            message = worker.child.receive(0.0, "answer")  # ready: it answered or its end closed
        except ChildDied:  # the process is gone: os._exit, a signal, the OOM killer
            self._pool.remove(worker)
            code = worker.child.kill()
            if worker.state != "busy":
                raise RuntimeError(f"a reward worker process exited with code {code} while "
                                   f"{'starting' if worker.state == 'starting' else 'loading the reward'}; "
                                   "its error is printed above") from None
            result.worker_deaths += 1
            self._record(result, worker.index, 0.0, False, None,
                         f"its reward worker process died (exit code {code})", reward)
            return
        if message[0] == "ready":
            worker.state = "idle"
        elif message[0] == "loaded":
            _, key, error = message
            if error is not None:
                raise RecipeError(f"model.reward: {type(reward).__name__} cannot be loaded in a reward worker "
                                  f"process ({error}); define it in a module on the trainer's Python path, or score "
                                  "in-process with workers: 0")
            worker.loaded[key] = None
            while len(worker.loaded) > _CACHED_REWARDS:  # the worker dropped its oldest alike
                worker.loaded.popitem(last=False)
            worker.state = "idle"
        elif message[0] == "done":
            _, index, value, ok, parts, error = message
            worker.state, worker.index = "idle", None
            self._record(result, index, value, ok, parts, error, reward)

    def _expire(self, worker: _Worker, reward, result: RewardScores) -> None:
        self._pool.remove(worker)
        worker.child.kill()
        if worker.state != "busy":
            raise RuntimeError(f"a reward worker process did not finish "
                               f"{'starting' if worker.state == 'starting' else 'loading the reward'} within "
                               f"{_START_TIMEOUT if worker.state == 'starting' else _LOAD_TIMEOUT:g} s")
        result.timeouts += 1
        self._record(result, worker.index, 0.0, False, None,
                     f"timed out after {self.timeout_seconds:g} s (its worker process was replaced)", reward)

    @staticmethod
    def _record(result: RewardScores, i: int, value: float, ok: bool, parts: dict | None, error: str | None,
                reward) -> None:
        if error is not None:
            log.warning("reward %s failed on sample %d (scored 0; fix the reward): %s", type(reward).__name__, i, error)
            result.failures += 1
            result.errors[i] = error
            value, ok = 0.0, False
        result.rewards[i] = float(value)
        result.correct[i] = bool(ok)
        for name, values in result.components.items():
            values[i] = float(parts[name]) if parts else 0.0

    # ----------------------------------------------------------------------------------------- pre-flight
    def preflight(self, reward: Reward | BatchReward, rows: list[dict], k: int = 4, field: str = "answer") -> None:
        """Before training, check that the reward tells right from wrong on ``k`` of the rows (spread evenly).

        For each, the response ``REFERENCE_RESPONSE`` ("The answer is \\boxed{<answer>}.", with the answer the
        row's field stands for: ``reward.reference_answer``) must be correct
        (the full reward, ``reward.correct``; for ``Weighted``, of its ``correct_from`` component) and the
        same response with a wrong answer must not: the answer's last digit changed (7 -> 8, 9 -> 0), or
        "<answer> + 1" when it has no digit. Otherwise raises ``RecipeError`` in one line naming the reward
        class and the row (its ``source``, e.g. "train.jsonl row 3"): a reward that scores every response 0,
        or 1, would otherwise train on nothing without a word.

        A ``BatchReward`` is not checked (one info line says so): a reward model or a judge scores a response by
        more than its stated answer.
        """
        if k < 1 or not rows:
            return
        if isinstance(reward, BatchReward):
            log.info("model.reward: %s scores whole batches (a BatchReward), which reference answers cannot check: "
                     "no reward pre-flight for it", type(reward).__name__)
            return
        picks = sorted({i * len(rows) // min(k, len(rows)) for i in range(min(k, len(rows)))})
        answers = [str(rows[i].get(field, "")).strip() for i in picks]
        # The answer a right response states (a reward whose rows hold a key to it says what the key stands for).
        stated = [getattr(reward, "reference_answer", lambda a: a)(a) for a in answers]
        right = [REFERENCE_RESPONSE.format(answer=a) for a in stated]
        wrong = [REFERENCE_RESPONSE.format(answer=_wrong_answer(a)) for a in stated]
        scores = self.score(reward, right + wrong, answers + answers)
        name = type(reward).__name__
        full = f"its full reward {reward.correct:g}" if isinstance(reward, Reward) else "a positive reward"
        if isinstance(reward, Weighted):
            full = f"the full reward of its component {reward.correct_from!r}"
        for j, i in enumerate(picks):
            where = rows[i].get("source", f"row {i + 1}")
            if not scores.correct[j]:
                why = f" ({scores.errors[j]})" if j in scores.errors else ""
                raise RecipeError(
                    f"model.reward: {name} does not give the reference answer of {where} {full}: the response "
                    f"{_quote(right[j])} against {field} {_quote(answers[j])} scored {scores.rewards[j]:g}{why}; "
                    f"make the reward read this answer format, or fix the data{PREFLIGHT_SKIP}")
            if scores.correct[len(picks) + j]:
                raise RecipeError(
                    f"model.reward: {name} gives a wrong response {full}: {_quote(wrong[j])} against {field} "
                    f"{_quote(answers[j])} ({where}) scored {scores.rewards[len(picks) + j]:g}; the reward must "
                    f"compare the response with the answer{PREFLIGHT_SKIP}")


def _wrong_answer(answer: str) -> str:
    """``answer`` with its last digit changed (d -> d + 1 mod 10), or ``answer + 1`` when it has no digit."""
    for pos in range(len(answer) - 1, -1, -1):
        if answer[pos] in "0123456789":
            return answer[:pos] + str((int(answer[pos]) + 1) % 10) + answer[pos + 1:]
    return f"{answer} + 1"
