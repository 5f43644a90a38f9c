"""Stopping on request: Ctrl-C and SIGTERM seen within seconds while the trainer waits for something outside it
(an environment's call, a vLLM server, a rollout worker), and a process that ends within seconds of its stop whatever
a thread of it still waits for. Standard library only, so that rollout worker processes import it without Lightning;
``rllight.safety.Interrupts`` installs the signal handlers."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time


class Interrupted(SystemExit):
    """Raised to end a run after Ctrl-C or SIGTERM, once what can be saved is saved; the process exits with ``code``
    (130 for Ctrl-C, 143 for SIGTERM, as a shell reports them). ``waiting_for`` names what the step was waiting for
    when the stop cut that wait short (``check_stop``), else None."""

    def __init__(self, code: int, waiting_for: str | None = None):
        super().__init__(code)
        self.waiting_for = waiting_for


STOP_GRACE_SECONDS = 5.0
"""After Ctrl-C or SIGTERM, how long a wait for an outside component (an environment's call, a request to a
vLLM server) may go on before the run gives up the step and stops (``wait_stoppable``)."""

EXIT_GRACE_SECONDS = 2.0
"""After a stop, how long the interpreter's exit may wait for the process's other threads (a request to a server that
never answers, left to its thread with a timeout minutes away) before the process ends without them."""

_stop: dict[str, float] = {}  # {"what": "SIGTERM" or "Ctrl-C", "at": time.monotonic()} once a stop is asked
_ending: list[str] = []  # why a guard asked the run to end after the current RL step (the first reason)
_said: list[tuple[str, float]] = []  # the stops whose giving up a wait was said (check_stop)
_lock = threading.Lock()
_exit_watch: list[threading.Thread] = []  # the thread that ends a stopped process whose exit waits (leave_promptly)


def exit_code(what: str) -> int:
    """The exit code of a process stopped by ``what``: 130 after Ctrl-C, 143 after SIGTERM (128 + the signal)."""
    return 130 if what == "Ctrl-C" else 128 + signal.SIGTERM


def request_stop(what: str) -> None:
    """Record that the user or a scheduler asked the run to stop (``Interrupts`` calls it from its handlers)."""
    _stop.setdefault(what, time.monotonic())


def leave_promptly(code: int) -> None:
    """Called as a command ends by an exception (``rllight.app.launch.rank_failures``): where a stop (Ctrl-C,
    SIGTERM) was asked for, see that the process ends within seconds. The interpreter's exit waits for every thread
    that is not a daemon, such as a ``ThreadPoolExecutor``'s still inside a request to a server that never answers,
    until its timeout; where one is still running ``EXIT_GRACE_SECONDS`` into the exit, a daemon thread flushes the
    output and ends the process with ``code``. An exit slowed by its own work alone (``atexit``), and a caller that
    goes on (a Python session), are left alone."""
    if stop_requested() is None or _exit_watch:
        return
    _exit_watch.append(threading.Thread(target=_end_a_stuck_exit, args=(code,), name="rllight-exit-watch",
                                        daemon=True))
    _exit_watch[0].start()


def _end_a_stuck_exit(code: int) -> None:
    main = threading.main_thread()
    while not _exiting(main):
        time.sleep(0.1)
    time.sleep(EXIT_GRACE_SECONDS)
    if not any(t.is_alive() and not t.daemon and t is not main for t in threading.enumerate()):
        return  # nothing to wait for: the exit is doing its own work
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (AttributeError, OSError, ValueError, RuntimeError):
            pass
    os._exit(code)


def _exiting(main: threading.Thread) -> bool:
    """Whether ``main`` is in the interpreter's exit: inside ``threading._shutdown``, which joins the other threads
    (CPython 3.9 to 3.13; where it were named otherwise, the exit would wait for them as it does without a stop), or
    past its Python code."""
    frame = sys._current_frames().get(main.ident)
    if frame is None:
        return True
    while frame is not None:
        if frame.f_code.co_name == "_shutdown" and frame.f_globals.get("__name__") == "threading":
            return True
        frame = frame.f_back
    return False


def stop_requested() -> tuple[str, float] | None:
    """``(what, when)`` of the first stop asked for in this process (``time.monotonic`` seconds), or None."""
    return min(((w, t) for w, t in _stop.items()), key=lambda item: item[1], default=None)


def clear_stop() -> None:
    _stop.clear()
    _ending.clear()
    _said.clear()


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
    line naming ``what`` (``check_stop``). Returns whether ``done`` was set."""
    deadline = time.monotonic() + seconds
    while True:
        left = deadline - time.monotonic()
        if done.wait(max(0.0, min(left, 0.2))):
            return True
        if left <= 0:
            return False
        check_stop(what)


def check_stop(what: str) -> None:
    """Raise ``Interrupted`` (exit 130 after Ctrl-C, 143 after SIGTERM; its ``waiting_for`` is ``what``) once a stop
    was asked for ``STOP_GRACE_SECONDS`` ago or more, with a line naming ``what`` (once a stop, where several threads
    wait); the caller was waiting for ``what``. ``rllight.safety.Interrupts`` then saves what it can and says so."""
    stop = stop_requested()
    if stop is not None and time.monotonic() - stop[1] >= STOP_GRACE_SECONDS:
        with _lock:  # said once a stop, by the first of the threads that wait (an environment's episodes, ...)
            first = stop not in _said
            if first:
                _said.append(stop)
        if first:
            say(f"rllight: {stop[0]}: stopped while waiting for {what}, {STOP_GRACE_SECONDS:g} s after the signal")
        raise Interrupted(exit_code(stop[0]), waiting_for=what)


def say(line: str, file=None) -> None:
    """Print ``line`` to ``file`` (stdout by default) in one write, which the lines of other threads do not split; a
    write error is ignored: a reader that went away (``| tee``, ended by the same Ctrl-C) never ends a stop before
    it has saved."""
    stream = file or sys.stdout
    try:
        stream.write(f"{line}\n")
        stream.flush()
    except (AttributeError, OSError, ValueError, RuntimeError):  # no stream, EPIPE, closed, a write inside its own
        pass


def say_in_handler(line: str) -> None:
    """Print ``line`` to stdout from a signal handler: one system call on its file descriptor, not through its
    buffer, which the interrupted code may be writing into (a print there raises ``RuntimeError: reentrant call``);
    a write error is ignored."""
    stream = sys.stdout
    if stream is None or getattr(stream, "broken", False):  # a _TolerantStream after a write error
        return
    try:
        fd = stream.fileno()
    except (AttributeError, OSError, ValueError):  # a stream of Python's own (a test's capture): no buffer lock
        say(line)
        return
    data = f"{line}\n".encode(getattr(stream, "encoding", None) or "utf-8", "replace")
    try:
        while data:
            data = data[os.write(fd, data):]
    except OSError:
        pass


class _TolerantStream:
    """A text stream whose write errors (a reader that went away: ``| tee log`` ended by the same Ctrl-C) are
    swallowed: after the first, output is dropped and the file descriptor is pointed at ``os.devnull``, so that what
    writes to it directly (a handler that holds the stream from before, the interpreter's final flush, a process
    started later) succeeds too, and the run goes on to save its checkpoint. A write that a signal handler makes
    inside this stream's own (``RuntimeError: reentrant call``) is dropped alone."""

    def __init__(self, stream):
        self._stream, self.broken = stream, False

    def write(self, text: str) -> int:
        if not self.broken:
            try:
                return self._stream.write(text)
            except RuntimeError:  # reentrant: the interrupted write goes on
                pass
            except (OSError, ValueError) as err:  # EPIPE, EIO, ENOSPC, or a stream closed under us
                self._give_up(err)
        return len(text)

    def flush(self) -> None:
        if not self.broken:
            try:
                self._stream.flush()
            except RuntimeError:
                pass
            except (OSError, ValueError) as err:
                self._give_up(err)

    def _give_up(self, err: Exception) -> None:
        if isinstance(err, BlockingIOError):  # a non-blocking pipe that is full for now: that text only is lost
            return
        self.broken = True
        try:
            fd = self._stream.fileno()
            devnull = os.open(os.devnull, os.O_WRONLY)
        except (AttributeError, OSError, ValueError):  # no descriptor of its own, or closed
            return
        try:
            os.dup2(devnull, fd)
        except OSError:
            pass
        finally:
            os.close(devnull)

    def __getattr__(self, name):  # isatty, fileno, encoding, ...: the stream's own
        return getattr(self._stream, name)


def tolerate_closed_output() -> None:
    """Make ``sys.stdout`` and ``sys.stderr`` never end a run with a write error (``_TolerantStream``): Ctrl-C on
    ``rllight fit ... | tee log`` also ends ``tee``, and the run's next print would raise ``BrokenPipeError`` before
    it could save the step and print how to resume. Idempotent."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is not None and not isinstance(stream, _TolerantStream):
            setattr(sys, name, _TolerantStream(stream))


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


__all__ = ["EXIT_GRACE_SECONDS", "STOP_GRACE_SECONDS", "Interrupted", "call_stoppable", "check_stop", "clear_stop",
           "end_after_step", "ending", "exit_code", "leave_promptly", "request_stop", "say", "say_in_handler",
           "stop_requested", "tolerate_closed_output", "wait_stoppable"]
