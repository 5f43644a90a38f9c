"""Stopping on request: Ctrl-C and SIGTERM seen within seconds while the trainer waits for something outside it
(an environment's call, a vLLM server, a rollout worker). Standard library only, so that rollout worker
processes import it without Lightning; ``rllight.safety.Interrupts`` installs the signal handlers."""

from __future__ import annotations

import signal
import threading
import time


class Interrupted(SystemExit):
    """Raised after the checkpoint of an interrupted run is saved; the process exits with ``code``
    (130 for Ctrl-C, 143 for SIGTERM, as a shell reports them)."""


STOP_GRACE_SECONDS = 5.0
"""After Ctrl-C or SIGTERM, how long a wait for an outside component (an environment's call, a request to a
vLLM server) may go on before the run gives up the step and stops (``wait_stoppable``)."""

_stop: dict[str, float] = {}  # {"what": "SIGTERM" or "Ctrl-C", "at": time.monotonic()} once a stop is asked
_ending: list[str] = []  # why a guard asked the run to end after the current RL step (the first reason)


def request_stop(what: str) -> None:
    """Record that the user or a scheduler asked the run to stop (``Interrupts`` calls it from its handlers)."""
    _stop.setdefault(what, time.monotonic())


def stop_requested() -> tuple[str, float] | None:
    """``(what, when)`` of the first stop asked for in this process (``time.monotonic`` seconds), or None."""
    return min(((w, t) for w, t in _stop.items()), key=lambda item: item[1], default=None)


def clear_stop() -> None:
    _stop.clear()
    _ending.clear()


def end_after_step(reason: str) -> None:
    """Ask the run to end after the current RL step, as Ctrl-C does (the step completes and is saved), with
    ``reason`` as its one-line error: for a guard that finds the run cannot usefully go on (RL steps without an
    update, updates without a gradient). Raising in the middle of the step instead would leave a state that no
    checkpoint can hold (some of the step's updates made, not all). ``rllight.safety.Interrupts`` acts on it."""
    if not _ending:
        _ending.append(reason)


def ending() -> str | None:
    """The reason a guard gave ``end_after_step`` in this process, or None."""
    return _ending[0] if _ending else None


def wait_stoppable(done: threading.Event, seconds: float, what: str) -> bool:
    """Wait up to ``seconds`` for ``done``, in short slices so that a stop is seen: once Ctrl-C or SIGTERM
    has been asked for ``STOP_GRACE_SECONDS`` ago, raise ``Interrupted`` (exit 130 or 143) with one printed
    line saying that the step waiting for ``what`` is not saved. Returns whether ``done`` was set."""
    deadline = time.monotonic() + seconds
    while True:
        left = deadline - time.monotonic()
        if done.wait(max(0.0, min(left, 0.2))):
            return True
        if left <= 0:
            return False
        check_stop(what)


def check_stop(what: str) -> None:
    """Raise ``Interrupted`` (exit 130 after Ctrl-C, 143 after SIGTERM) with one printed line once a stop was
    asked for ``STOP_GRACE_SECONDS`` ago or more; the caller was waiting for ``what``."""
    stop = stop_requested()
    if stop is not None and time.monotonic() - stop[1] >= STOP_GRACE_SECONDS:
        print(f"rllight: {stop[0]}: stopped while waiting for {what}; the step in progress is not saved, "
              "resume from the last checkpoint", flush=True)
        raise Interrupted(130 if stop[0] == "Ctrl-C" else 128 + signal.SIGTERM)


def call_stoppable(fn, seconds: float, what: str):
    """``(finished, value, error)`` of ``fn()`` run on a daemon thread and waited for as ``wait_stoppable``
    does: a call that hangs costs at most ``seconds`` of the trainer's time and never delays a stop past
    ``STOP_GRACE_SECONDS``. A call still running when given up is left to its thread (asked to stop with an
    exception, which a pure-Python loop obeys; one blocked in C ends when that call returns)."""
    done, box = threading.Event(), {}

    def run():
        try:
            box["value"] = fn()
        except BaseException as err:  # handed to the caller, which decides what a failure costs
            box["error"] = err
        finally:
            done.set()

    thread = threading.Thread(target=run, name=f"rllight-call: {what}"[:60], daemon=True)
    thread.start()
    try:
        finished = wait_stoppable(done, seconds, what)
    except BaseException:
        _raise_in(thread)
        raise
    if not finished:
        _raise_in(thread)
        return False, None, None
    return True, box.get("value"), box.get("error")


class _GivenUp(Exception):
    """Raised inside a thread whose call the trainer stopped waiting for."""


def _raise_in(thread: threading.Thread) -> None:
    import ctypes

    if thread.ident is not None and thread.is_alive():
        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread.ident), ctypes.py_object(_GivenUp))


__all__ = ["STOP_GRACE_SECONDS", "Interrupted", "call_stoppable", "check_stop", "clear_stop", "end_after_step",
           "ending", "request_stop", "stop_requested", "wait_stoppable"]
