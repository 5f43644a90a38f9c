"""A model in a supervised child process (``rllight.supervised``): ``WorkerProcess`` is the trainer's handle,
``serve`` the child's loop. A model that runs out of memory, crashes or hangs there costs a batch, not the run.

The trainer's side starts the child at the first batch (a fresh interpreter that imports the child function's
module only; never a fork of the trainer), sends it the settings once, then each batch's inputs. What it costs:

- **A batch waits at most ``timeout_seconds``**; past it the child is killed and the batch fails (``TimeoutError``),
  the next batch starts a new child. A stop (Ctrl-C, SIGTERM) is seen within seconds while it waits.
- **A child that dies** during a batch (the OOM killer, a crash in a kernel) is restarted once and the batch sent
  again; a second death fails the batch (``RuntimeError``).
- A failed batch is a plain exception: its owner counts it (a reward's batch: every sample 0, counted).
- ``close`` stops the child; a later batch starts a new one.

Standard library only: the torch work is the child's.
"""

from __future__ import annotations

import logging
import weakref

from rllight.errors import one_line
from rllight.supervised import ChildDied, SupervisedProcess

log = logging.getLogger(__name__)


def _stop(box: list[SupervisedProcess]) -> None:
    while box:
        box.pop().stop(grace_seconds=2.0)


class WorkerProcess:
    """The trainer's handle on one model's child process (see ``rllight.serving.worker``).

    Args:
        target: The child's function, ``"package.module:function"``; it calls ``serve(connection, build)``.
        settings: What the child builds its model from (sent once per child).
        timeout_seconds: Longest wait for one batch's answers.
        load_timeout_seconds: Longest wait for the child to start and load its model.
        name: What the messages call the child (``the reward model's worker process``).
    """

    def __init__(self, target: str, settings: dict, timeout_seconds: float, load_timeout_seconds: float = 600.0,
                 name: str = "the worker process"):
        self.target, self.settings, self.timeout_seconds = target, settings, float(timeout_seconds)
        self.load_timeout_seconds, self.name = float(load_timeout_seconds), name
        self._box: list[SupervisedProcess] = []  # the running child, if any
        self._finalizer = weakref.finalize(self, _stop, self._box)

    @property
    def child(self) -> SupervisedProcess | None:
        return self._box[0] if self._box else None

    def close(self) -> None:
        """Stop the child (a later ``answer`` starts a new one)."""
        _stop(self._box)

    def _start(self) -> SupervisedProcess:
        name = self.name
        child = SupervisedProcess.interpreter(self.target, name=name, timed_out=lambda what, seconds: TimeoutError(
            f"{name} did not {what} within {seconds:g} s; it was killed"))
        self._box.append(child)
        child.send(("load", self.settings))
        _, error = child.receive(self.load_timeout_seconds, "load its model")
        if error is not None:
            raise RuntimeError(f"{name} could not load its model: {error}")
        return child

    def _drop(self) -> int | None:
        """Kill the child; its exit code."""
        return self._box.pop().kill() if self._box else None

    def answer(self, inputs: list) -> list:
        """The child's answer to each input. Raises ``TimeoutError`` after ``timeout_seconds`` (the child killed)
        and ``RuntimeError`` when the child died twice on this batch or could not answer it; either fails the
        batch."""
        try:
            return self._answer_once(inputs)
        except ChildDied:
            log.warning("%s died (exit code %s); restarting it once for this batch", self.name, self._drop())
        try:
            return self._answer_once(inputs)
        except ChildDied:
            raise RuntimeError(f"{self.name} died again on the same batch (exit code {self._drop()}); the batch fails, "
                               "the next one starts a new process") from None

    def _answer_once(self, inputs: list) -> list:
        try:
            child = self.child or self._start()
            child.send(("answer", inputs))
            _, values, error = child.receive(self.timeout_seconds, f"answer a batch of {len(inputs)}")
        except ChildDied:
            raise
        except BaseException:  # a timeout, a stop, a failed load: a child still busy would answer the next batch
            self._drop()
            raise
        if error is not None:
            raise RuntimeError(f"{self.name} could not answer the batch: {error}")
        return values


def serve(connection, build) -> None:
    """A worker child's loop: ``build(settings)`` from the first message (``("load", settings)`` ->
    ``("loaded", error or None)``) gives the function that answers each ``("answer", inputs)`` with
    ``("answers", values, error or None)``, until ``("stop",)`` or the trainer's end closes the connection. An
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
        if message[0] != "answer":
            return
        try:
            connection.send(("answers", answer(message[1]), None))
        except Exception as err:  # noqa: BLE001 - this batch fails in the trainer, counted; the next is answered
            connection.send(("answers", None, one_line(err, 500)))


__all__ = ["WorkerProcess", "serve"]
