"""A child process the trainer supervises: it is sent requests and answers them, may hang or die at any time, and
ends with the trainer. The reward runner's workers and the rollout worker are such children.

The trainer's side is ``SupervisedProcess``: a send, a receive with a timeout that sees a stop (Ctrl-C,
SIGTERM) within seconds and a death as ``ChildDied``, a kill of the child and of everything it started, and a
stop that asks first. The child's side is ``become_child``, which a child's function calls first thing.

Two ways to start, for two kinds of payload:

- ``SupervisedProcess.interpreter("package.module:function")``: a fresh ``sys.executable`` with the trainer's
  ``sys.path`` that imports that module only. Unlike ``multiprocessing``'s spawn it does not re-import the
  trainer's ``__main__`` (under ``rllight fit``: torch and Lightning, seconds and hundreds of MB per child).
- ``SupervisedProcess.spawn(target, *args)``: ``torch.multiprocessing``'s spawn start, whose pipe carries shared
  CPU tensors as handles to the same memory (the rollout worker's weights).

Either way ``function(connection, *args)`` runs in the child with its end of one duplex
``multiprocessing.connection.Connection``. Standard library only (torch is imported by ``spawn``), so that the
children import it without the trainer's stack.
"""

from __future__ import annotations

import importlib
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection, wait

from rllight.stopping import check_stop

_SLICE = 0.2  # seconds between checks for a stop while waiting for a child: Ctrl-C is seen within seconds
_REAP_SECONDS = 10.0  # how long a kill waits for the child to be reaped (a process in uninterruptible sleep)

_supervisor_pid: int | None = None
"""In a child: the trainer's pid, set before the child's function runs, so that ``become_child`` sees a trainer
that died while the child was still importing (its parent is then already someone else)."""


class ChildDied(Exception):
    """The child process is gone (its end of the pipe closed). The message describes its exit: "exit code 3"
    (negative: the signal that killed it, "exit code -9"), or "still running" if it closed the pipe alive."""


class ChildTimedOut(TimeoutError):
    """The child did not answer in time (the default timeout error of ``SupervisedProcess.receive``)."""


def _default_timed_out(name: str) -> Callable[[str, float], BaseException]:
    return lambda what, timeout: ChildTimedOut(f"{name} did not {what} within {timeout:g} s")


class SupervisedProcess:
    """The trainer's handle on one child process: see ``rllight.supervised``. Start one with ``interpreter`` or
    ``spawn``; the child's function calls ``become_child`` first thing.

    Args:
        process: The started child (a ``subprocess.Popen`` or a ``multiprocessing`` process).
        connection: The trainer's end of the pipe; readable, so that a caller may multiplex several children
            with ``multiprocessing.connection.wait`` and then ``receive(0, ...)`` from those ready.
        name: The child in messages, e.g. "the rollout worker process".
        timed_out: Builds the error ``receive`` raises on a timeout, from ``(what, timeout)``: the caller words
            it (default: ``ChildTimedOut`` "<name> did not <what> within <timeout> s").
    """

    def __init__(self, process: subprocess.Popen | multiprocessing.process.BaseProcess, connection: Connection,
                 name: str, timed_out: Callable[[str, float], BaseException] | None = None):
        self.process = process
        self.connection = connection
        self.name = name
        self.timed_out = timed_out or _default_timed_out(name)

    @classmethod
    def interpreter(cls, target: str, name: str,
                    timed_out: Callable[[str, float], BaseException] | None = None) -> SupervisedProcess:
        """Start ``target`` ("package.module:function", called with the child's connection) in a fresh
        interpreter with the trainer's ``sys.path``, in a session of its own (Ctrl-C in a terminal reaches only
        the trainer, and ``kill`` ends whatever the child started)."""
        module, function = target.split(":")
        ours, theirs = multiprocessing.Pipe(duplex=True)
        code = (f"import sys; sys.path[:] = {list(sys.path)!r}; from rllight.supervised import _run_interpreted; "
                f"_run_interpreted({module!r}, {function!r}, {theirs.fileno()}, {os.getpid()})")
        try:
            process = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.DEVNULL,
                                       pass_fds=(theirs.fileno(),), start_new_session=True)
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()  # only the child holds it now: its death closes the pipe
        return cls(process, ours, name, timed_out)

    @classmethod
    def spawn(cls, target: Callable, *args, name: str, process_name: str | None = None,
              timed_out: Callable[[str, float], BaseException] | None = None) -> SupervisedProcess:
        """Start ``target(connection, *args)`` with ``torch.multiprocessing``'s spawn start (``target`` and
        ``args`` are pickled; shared CPU tensors among them travel as handles). The child is daemonic: at the
        trainer's orderly exit ``multiprocessing`` terminates it rather than waiting for it."""
        import torch.multiprocessing  # its reductions are what carry shared tensors through the pipe

        context = torch.multiprocessing.get_context("spawn")
        ours, theirs = context.Pipe()
        process = context.Process(target=_run_spawned, args=(os.getpid(), target, theirs, *args), daemon=True,
                                  name=process_name)
        try:
            process.start()
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()  # only the child holds it now: its death closes the pipe
        return cls(process, ours, name, timed_out)

    @property
    def pid(self) -> int:
        return self.process.pid

    def send(self, message: tuple) -> None:
        """Send ``message``; ``ChildDied`` if the child is gone (a broken pipe)."""
        try:
            self.connection.send(message)
        except OSError as err:
            raise ChildDied(self.describe_exit()) from err

    def receive(self, timeout: float, what: str) -> tuple:
        """The child's next message. ``ChildDied`` if it died first, ``self.timed_out(what, timeout)`` after
        ``timeout`` seconds; a stop asked of the trainer (``rllight.stopping``) is seen within seconds."""
        deadline = time.monotonic() + timeout
        watched = [self.connection, *([self.process.sentinel] if hasattr(self.process, "sentinel") else [])]
        while not (ready := wait(watched, max(0.0, min(_SLICE, deadline - time.monotonic())))):
            if time.monotonic() >= deadline:
                raise self.timed_out(what, timeout)
            check_stop(self.name)
        if self.connection not in ready:  # dead with nothing left to read, even if a process it started holds
            raise ChildDied(self.describe_exit())  # the pipe open (then recv would wait forever)
        try:
            return self.connection.recv()
        except (EOFError, OSError) as err:  # its end closed, also mid-message
            raise ChildDied(self.describe_exit()) from err

    def exit_code(self, wait_seconds: float = 0.0) -> int | None:
        """The child's exit code (negative: the signal that killed it) once it has ended within ``wait_seconds``,
        else None."""
        if isinstance(self.process, subprocess.Popen):
            try:
                return self.process.wait(timeout=wait_seconds)
            except subprocess.TimeoutExpired:
                return None
        self.process.join(timeout=wait_seconds)
        return self.process.exitcode

    def describe_exit(self) -> str:
        """"exit code N" once the child has ended (waiting a few seconds for it), else "still running"."""
        code = self.exit_code(wait_seconds=5.0)
        return "still running" if code is None else f"exit code {code}"

    def kill(self) -> int | None:
        """Kill the child and everything it started (its process group: a hung inner engine's own processes, a
        reward's subprocess); returns its exit code (None if it could not be reaped)."""
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):  # not a group leader yet (a spawned child importing)
            try:
                os.kill(self.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        code = self.exit_code(wait_seconds=_REAP_SECONDS)
        self.connection.close()
        return code

    def stop(self, grace_seconds: float = 5.0) -> int | None:
        """Ask the child to leave with a ``("stop",)`` message (it is between requests), give it
        ``grace_seconds``, then ``kill`` whatever is left; returns its exit code."""
        try:
            self.connection.send(("stop",))
            self.exit_code(wait_seconds=grace_seconds)
        except OSError:  # already gone
            pass
        return self.kill()


# ------------------------------------------------------------------------------------------------ child side
def become_child(cleanup: Callable[[], None] | None = None, poll_seconds: float = 0.5) -> None:
    """Make this process a well-behaved supervised child; its function calls this first thing.

    Ctrl-C is ignored (the trainer handles it, then stops the child); the child leads a session of its own (so
    that ``SupervisedProcess.kill`` reaches what it starts, and a terminal's Ctrl-C does not); and a daemon
    thread ends the process with ``os._exit(0)`` once the trainer is gone, after ``cleanup()`` (e.g. removing
    shared-memory segments the child made). A child busy with a request never reads its pipe's end-of-file,
    so without the thread it would outlive a trainer that was killed.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if os.getsid(0) != os.getpid():  # the interpreter start made it a session leader already
        os.setsid()
    parent = _supervisor_pid if _supervisor_pid is not None else os.getppid()
    threading.Thread(target=_exit_with_parent, args=(parent, cleanup, poll_seconds), daemon=True,
                     name="rllight-exit-with-parent").start()


def _exit_with_parent(parent: int, cleanup: Callable[[], None] | None, poll_seconds: float) -> None:
    while os.getppid() == parent:
        time.sleep(poll_seconds)
    try:
        if cleanup is not None:
            cleanup()
    finally:
        os._exit(0)


def _run_interpreted(module: str, function: str, fd: int, supervisor: int) -> None:
    """The fresh interpreter's entry: ``module.function(connection)``."""
    global _supervisor_pid
    _supervisor_pid = supervisor
    os.set_inheritable(fd, False)  # the child's own subprocesses must not hold its pipe open
    getattr(importlib.import_module(module), function)(Connection(fd))


def _run_spawned(supervisor: int, target: Callable, connection: Connection, *args) -> None:
    """The spawned process's entry: ``target(connection, *args)``."""
    global _supervisor_pid
    _supervisor_pid = supervisor
    target(connection, *args)


__all__ = ["ChildDied", "ChildTimedOut", "SupervisedProcess", "become_child"]
