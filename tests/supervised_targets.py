"""Children for tests/test_supervised.py, in a module both ways of starting one can import (a fresh interpreter
gets the test's ``sys.path``; a spawned process unpickles its target from here)."""

import os
import subprocess
import sys
import time
from pathlib import Path

from rllight.supervised import SupervisedProcess, become_child


def start(how: str, target: str, **kwargs) -> SupervisedProcess:
    """Start ``target`` (a function of this module) as a supervised child, ``how``: "interpreter" or "spawn"."""
    if how == "interpreter":
        return SupervisedProcess.interpreter(f"supervised_targets:{target}", name="the test child", **kwargs)
    return SupervisedProcess.spawn(globals()[target], name="the test child", **kwargs)


def echo(connection) -> None:
    """Answers every message with ``("echo", its pid, *the message's fields after the first)`` until "stop"."""
    become_child()
    while (message := connection.recv())[0] != "stop":
        connection.send(("echo", os.getpid(), *message[1:]))


def die_on_request(connection) -> None:
    """Says it is ready, then exits with code 3 on the first request, without answering."""
    become_child()
    connection.send(("ready",))
    connection.recv()
    os._exit(3)


def hang(connection) -> None:
    """Says it is ready, then never answers."""
    become_child()
    connection.send(("ready",))
    connection.recv()
    time.sleep(3600)


def start_grandchild(connection) -> None:
    """Starts a process of its own (which sleeps), sends its pid, then hangs."""
    become_child()
    grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    connection.send(("grandchild", grandchild.pid))
    time.sleep(3600)


def busy_with_cleanup(connection) -> None:
    """Gets a file's path, sends its pid, then stays busy (never reading its pipe's end-of-file); when the
    trainer is gone, its cleanup writes "cleaned" to the file."""
    marker = {}
    become_child(cleanup=lambda: Path(marker["path"]).write_text("cleaned"))
    _, marker["path"] = connection.recv()
    connection.send(("started", os.getpid()))
    time.sleep(3600)


def orphan(how: str, marker: str) -> None:
    """Run as a trainer process of its own: start ``busy_with_cleanup``, print its pid, and exit at once
    (``os._exit``: no cleanup, no ``multiprocessing`` exit handlers), leaving the child behind."""
    child = start(how, "busy_with_cleanup")
    child.send(("marker", marker))
    _, pid = child.receive(120, "start")
    print(pid, flush=True)
    os._exit(0)
