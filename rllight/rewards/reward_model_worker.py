"""The reward model's ``placement: worker``: the classifier loads and scores in a supervised child process
(``rllight.supervised``), so that a classifier that runs out of memory, crashes or hangs costs a batch, not the run.

The trainer's side is ``ClassifierWorker``: it starts the child at the first ``score`` (a fresh interpreter that
imports ``rllight.rewards.reward_model`` and, to load the classifier, torch and transformers; never a fork of the
trainer), sends it the settings once, then each batch's texts, already rendered by the trainer. What it costs:

- **A batch waits at most ``timeout_seconds``**; past it the child is killed and the batch fails (``TimeoutError``),
  the next batch starts a new child. A stop (Ctrl-C, SIGTERM) is seen within seconds while it waits.
- **A child that dies** during a batch (the OOM killer, a crash in a kernel) is restarted once and the batch sent
  again; a second death fails the batch (``RuntimeError``).
- A failed batch is a plain exception: the rollout producer gives each of its samples 0 and counts it
  (``score_samples``), and ``model.max_failed_reward_steps`` such batches in a row stop the run.
- ``close`` stops the child; a later ``score`` starts a new one.

Standard library only: the torch work is the child's.
"""

from __future__ import annotations

import logging
import weakref

from rllight.errors import one_line
from rllight.supervised import ChildDied, SupervisedProcess

log = logging.getLogger(__name__)

LOAD_TIMEOUT = 600.0
"""Seconds for the child to start and load the classifier (a large model from a slow disk)."""

NAME = "the reward model's worker process"


def _stop(box: list[SupervisedProcess]) -> None:
    while box:
        box.pop().stop(grace_seconds=2.0)


class ClassifierWorker:
    """The trainer's handle on the reward model's child process (see ``rllight.rewards.reward_model_worker``).

    Args:
        target: The child's function, ``"package.module:function"``; it calls ``become_child`` first, reads
            ``("load", settings)`` and answers ``("loaded", error or None)``, then answers each
            ``("score", texts)`` with ``("scores", scores, error or None)`` until ``("stop",)``.
        settings: What the child builds its classifier from (sent once per child).
        timeout_seconds: Longest wait for one batch's scores.
        name: What the messages call the child (``the reward model's worker process``).
        loads: What the child loads, in messages (``the classifier``).
    """

    def __init__(self, target: str, settings: dict, timeout_seconds: float, name: str = NAME,
                 loads: str = "the classifier"):
        self.target, self.settings, self.timeout_seconds = target, settings, float(timeout_seconds)
        self.name, self.loads = name, loads
        self._box: list[SupervisedProcess] = []  # the running child, if any
        self._finalizer = weakref.finalize(self, _stop, self._box)

    @property
    def child(self) -> SupervisedProcess | None:
        return self._box[0] if self._box else None

    def close(self) -> None:
        """Stop the child (a later ``score`` starts a new one)."""
        _stop(self._box)

    def _start(self) -> SupervisedProcess:
        name = self.name
        child = SupervisedProcess.interpreter(self.target, name=name, timed_out=lambda what, seconds: TimeoutError(
            f"{name} did not {what} within {seconds:g} s; it was killed"))
        self._box.append(child)
        child.send(("load", self.settings))
        _, error = child.receive(LOAD_TIMEOUT, f"load {self.loads}")
        if error is not None:
            raise RuntimeError(f"{name} could not load {self.loads}: {error}")
        return child

    def _drop(self) -> int | None:
        """Kill the child; its exit code."""
        return self._box.pop().kill() if self._box else None

    def score(self, texts: list[tuple[str, bool]]) -> list[float]:
        """The classifier's score of each ``(text, templated)``, from the child. Raises ``TimeoutError`` after
        ``timeout_seconds`` (the child killed) and ``RuntimeError`` when the child died twice on this batch or
        could not score it; either fails the batch."""
        try:
            return self._score_once(texts)
        except ChildDied:
            log.warning("%s died (exit code %s); restarting it once for this batch", self.name, self._drop())
        try:
            return self._score_once(texts)
        except ChildDied:
            raise RuntimeError(f"{self.name} died again on the same batch (exit code {self._drop()}); the batch fails, "
                               "the next one starts a new process") from None

    def _score_once(self, texts: list[tuple[str, bool]]) -> list[float]:
        try:
            child = self.child or self._start()
            child.send(("score", texts))
            _, scores, error = child.receive(self.timeout_seconds, f"score a batch of {len(texts)} texts")
        except ChildDied:
            raise
        except BaseException:  # a timeout, a stop, a failed load: a child still busy would answer the next batch
            self._drop()
            raise
        if error is not None:
            raise RuntimeError(f"{self.name} could not score the batch: {error}")
        return scores


def serve(connection, build) -> None:
    """A worker child's loop: ``build(settings)`` from the first message (``("load", settings)`` ->
    ``("loaded", error or None)``) gives the function that answers each ``("score", payload)`` with
    ``("scores", result, error or None)``, until ``("stop",)`` or the trainer's end closes the connection. An
    error in one batch fails that batch in the trainer (counted); the next is answered."""
    from rllight.supervised import become_child

    become_child()
    try:
        _, settings = connection.recv()
    except EOFError:  # the trainer left before sending the settings
        return
    try:
        answer = build(settings)
    except Exception as err:  # noqa: BLE001 - the trainer raises it, in one line
        connection.send(("loaded", one_line(err, 500)))
        return
    connection.send(("loaded", None))
    while True:
        try:
            message = connection.recv()
        except EOFError:
            return
        if message[0] != "score":
            return
        try:
            connection.send(("scores", answer(message[1]), None))
        except Exception as err:  # noqa: BLE001 - this batch fails in the trainer, counted; the next is answered
            connection.send(("scores", None, one_line(err, 500)))




__all__ = ["LOAD_TIMEOUT", "ClassifierWorker", "serve"]
