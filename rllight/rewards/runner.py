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

Only a ``Verifier`` (one response against its answer) goes to the workers: ``Reward.guarded(runner)`` wraps each
verifier of a reward (also inside ``Weighted`` and ``PerSource``) in a ``Guarded`` reward that scores through the
runner. Any other reward (a reward model, a judge) scores its batch in the trainer's process.
"""

from __future__ import annotations

import collections
import hashlib
import logging
import pickle
import time
import weakref
from multiprocessing.connection import Connection, wait
from collections.abc import Sequence
from typing import Self

from rllight.bounds import NonNegativeInt, PositiveFiniteFloat, bounded
from rllight.errors import RecipeError, one_line
from rllight.rewards.base import Reward, Verifier, verdicts
from rllight.rewards.scores import Sample, Scores
from rllight.supervised import ChildDied, SupervisedProcess, become_child

log = logging.getLogger(__name__)

_START_TIMEOUT = 120.0  # seconds for a worker to import rllight.rewards and math-verify (a loaded machine)
_LOAD_TIMEOUT = 120.0  # seconds to unpickle a reward (it may import a heavy module of its own)
_CACHED_REWARDS = 4  # rewards a worker keeps unpickled (a recipe has one; the check of a run may add a few)

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
                value, ok = rewards[key].verdict(response, answer)
                connection.send(("done", index, value, ok, None))
            except Exception as err:  # noqa: BLE001 - counted by the trainer, as a verifier's own score does
                connection.send(("done", index, 0.0, False, one_line(err)))
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

    Only a ``Verifier`` (one response against its answer) goes to the workers (``guard``); any other reward scores
    its batch in the trainer's process.

    Args:
        workers: Worker processes (started at the first ``score``, then reused). 0 scores in the trainer's
            process, without timeouts or protection from a reward that hangs or exits: for debugging.
        timeout_seconds: Wall-clock limit of one sample's reward; past it the sample gets 0 and its worker
            is replaced.
    """

    @bounded
    def __init__(self, workers: NonNegativeInt = 2, timeout_seconds: PositiveFiniteFloat = 10.0):
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
    def guard(self, verifier: Verifier) -> Guarded:
        """``verifier`` scored in this runner's workers (what ``Verifier.guarded`` returns)."""
        return Guarded(verifier, self)

    def score(self, verifier: Verifier, responses: list[str], answers: list[str]) -> Scores:
        """Score ``responses[i]`` against ``answers[i]`` for every i. A sample whose verifier raises, gives a value
        that is not finite, times out or takes its worker down fails (0, why in ``failed``); ``metrics`` count the
        ``timeouts`` and ``worker_deaths``."""
        if len(responses) != len(answers):
            raise ValueError(f"{len(responses)} responses but {len(answers)} answers")
        if self.workers == 0:
            scores = verdicts(verifier, list(zip(responses, answers)))
            scores.metrics = {"timeouts": 0.0, "worker_deaths": 0.0}
            return scores
        result = Scores(values=[0.0] * len(responses), solved=[False] * len(responses),
                        metrics={"timeouts": 0.0, "worker_deaths": 0.0})
        if responses:
            try:
                self._score_in_workers(verifier, list(responses), list(answers), result)
            except BaseException:
                # Interrupted (an unloadable reward, Ctrl-C): workers still on this batch would answer the
                # next one with stale results.
                for worker in [w for w in self._pool if w.state != "idle"]:
                    self._pool.remove(worker)
                    worker.child.kill()
                raise
        return result

    def _score_in_workers(self, reward, responses: list[str], answers: list[str], result: Scores) -> None:
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

    def _receive(self, worker: _Worker, reward, result: Scores) -> None:
        try:
            message = worker.child.receive(0.0, "answer")  # ready: it answered or its end closed
        except ChildDied:  # the process is gone: os._exit, a signal, the OOM killer
            self._pool.remove(worker)
            code = worker.child.kill()
            if worker.state != "busy":
                raise RuntimeError(f"a reward worker process exited with code {code} while "
                                   f"{'starting' if worker.state == 'starting' else 'loading the reward'}; "
                                   "its error is printed above") from None
            result.metrics["worker_deaths"] += 1
            self._record(result, worker.index, 0.0, False, f"its reward worker process died (exit code {code})")
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
            _, index, value, ok, error = message
            worker.state, worker.index = "idle", None
            self._record(result, index, value, ok, error)

    def _expire(self, worker: _Worker, reward, result: Scores) -> None:
        self._pool.remove(worker)
        worker.child.kill()
        if worker.state != "busy":
            raise RuntimeError(f"a reward worker process did not finish "
                               f"{'starting' if worker.state == 'starting' else 'loading the reward'} within "
                               f"{_START_TIMEOUT if worker.state == 'starting' else _LOAD_TIMEOUT:g} s")
        result.metrics["timeouts"] += 1
        self._record(result, worker.index, 0.0, False,
                     f"timed out after {self.timeout_seconds:g} s (its worker process was replaced)")

    @staticmethod
    def _record(result: Scores, i: int, value: float, ok: bool, error: str | None) -> None:
        if error is not None:
            result.failed[i] = error
            value, ok = 0.0, False
        result.values[i] = float(value)
        result.solved[i] = bool(ok)


class Guarded(Reward):
    """A verifier scored in a ``RewardRunner``'s worker processes, a timeout per sample (``Verifier.guarded``)."""

    def __init__(self, verifier: Verifier, runner: RewardRunner):
        self.verifier, self.runner = verifier, runner

    def score(self, samples: Sequence[Sample]) -> Scores:
        return self.runner.score(self.verifier, [s.response for s in samples], [s.answer for s in samples])

    def solved_from(self, values: list[float]) -> list[bool]:
        return self.verifier.solved_from(values)

    @property
    def name(self) -> str:
        return self.verifier.name

    @property
    def answers_decide(self) -> bool:
        return self.verifier.answers_decide

    def full_reward(self) -> str:
        return self.verifier.full_reward()

    def check_answer(self, answer: str) -> str | None:
        return self.verifier.check_answer(answer)

    def reference_answer(self, answer: str) -> str:
        return self.verifier.reference_answer(answer)

    def check(self) -> None:
        self.verifier.check()

    def close(self) -> None:
        self.verifier.close()

    def __repr__(self) -> str:
        return f"Guarded({self.verifier!r})"
