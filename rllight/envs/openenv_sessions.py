"""The sessions of ``rllight.envs.OpenEnv``'s episodes and the server they talk to (the adapter is
``rllight.envs.openenv``): openenv's client, the event loop the sessions run on, the server process an ``OpenEnv``
with ``server`` starts, and how a server's answers are checked and its failures told in one line.

**Threads.** The sessions of one ``OpenEnv`` are coroutines on one event loop with a thread of its own; each call of
an episode (on its guard's thread) hands its coroutine over with asyncio's thread-safe ``run_coroutine_threadsafe``
and waits at most ``timeout_seconds`` and ``LATE_SECONDS`` (the guard counts a hung server as a timeout).

**Server.** ``Runtime`` serves an app (``package.module:app``) in a supervised child process
(``rllight.supervised``), started by the first ``ensure``, stopped with its process group by ``close()``, garbage
collection or exit.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import json
import logging
import os
import re
import socket
import tempfile
import threading
import time
import traceback
import weakref
from urllib.parse import urlsplit

from rllight.errors import ComponentError, RecipeError, one_line
from rllight.supervised import ChildDied, ChildTimedOut, SupervisedProcess, become_child

log = logging.getLogger(__name__)

LATE_SECONDS = 0.25
"""A call gives up this long after the guard's timeout: the guard counts a timeout, not an error."""
_CLOSE_SECONDS = 2.0  # most time spent closing sessions at shutdown


class BadAnswer(ValueError):
    """The server answered something the adapter cannot use (the message says what)."""


def _client_class():
    """openenv's ``GenericEnvClient`` (JSON actions and observations, no environment package needed), with two
    changes: it connects to a loopback server without a proxy (openenv's ``connect`` sets and restores
    ``NO_PROXY`` in ``os.environ`` around each connection, which sessions connecting at once would race on), and
    ``exchange`` reports what a server said before it closed a session (openenv refuses one over capacity so)."""
    from openenv.core.generic_client import GenericEnvClient
    from websockets.asyncio.client import connect
    from websockets.exceptions import ConnectionClosed

    class Client(GenericEnvClient):
        async def connect(self):
            if self._ws is None:
                try:
                    local = urlsplit(self._ws_url).hostname in ("localhost", "127.0.0.1", "::1")
                    self._ws = await connect(self._ws_url, open_timeout=self._connect_timeout,
                                             max_size=self._max_message_size, proxy=None if local else True)
                except Exception as err:  # noqa: BLE001 - refused, no such host, a handshake rejected or unanswered
                    raise ConnectionError(f"cannot open a session: {type(err).__name__}: {err}") from None
            return self

        async def exchange(self, call) -> tuple[dict, float, bool]:
            """The checked answer to ``call`` (a ``reset`` or ``step`` coroutine of this client)."""
            try:
                return _checked(await call)
            except ConnectionClosed:
                said = None
                with contextlib.suppress(Exception):  # nothing was said, or not JSON: the closing is the news
                    message = json.loads(await asyncio.wait_for(self._ws.recv(), 0.5))
                    said = message["data"] if message.get("type") == "error" else None
                if not isinstance(said, dict):
                    raise
                raise RuntimeError(f"Server error: {said.get('message')} (code: {said.get('code')})") from None

    return Client


def _checked(result) -> tuple[dict, float, bool]:
    """``(observation, reward, done)`` of an openenv ``StepResult``, or ``BadAnswer`` saying what is wrong."""
    observation, reward, done = result.observation, result.reward, result.done
    if not isinstance(observation, dict):
        raise BadAnswer(f"it answered an observation that is {type(observation).__name__}, not a JSON object")
    if reward is not None and not isinstance(reward, (bool, int, float)):
        raise BadAnswer(f"it answered reward {reward!r}, not a number")
    if not isinstance(done, bool):
        raise BadAnswer(f"it answered done={done!r}, not true or false")
    return observation, 0.0 if reward is None else float(reward), done


def explain(err: BaseException, limit: float) -> str:
    """One line saying what went wrong with a call to the server."""
    name = type(err).__name__
    text = " ".join(str(err).split())
    if isinstance(err, TimeoutError):
        return f"no answer within {limit:g} s"
    if name.startswith("ConnectionClosed"):
        return f"the connection closed (the server stopped or dropped the session: {text or name})"
    if isinstance(err, json.JSONDecodeError):
        return f"it answered something that is not JSON ({text})"
    if isinstance(err, (AttributeError, TypeError, KeyError)):
        return f"it answered a message of the wrong shape ({name}: {text})"
    if "CAPACITY_REACHED" in text:  # openenv's refusal of a session over capacity
        return f"{text}; each episode holds a session (prompts x n per batch): raise max_concurrent_envs in its app"
    return text if isinstance(err, (BadAnswer, ConnectionError)) and text else f"{name}: {text}"


async def open_session(client, sessions: set, reset_args: dict) -> tuple[dict, float, bool]:
    """Open ``client``'s session (kept in ``sessions`` until closed) and reset it with ``reset_args``."""
    sessions.add(client)
    await client.connect()
    return await client.exchange(client.reset(**reset_args))


async def _close(client, sessions: set) -> None:
    """Close ``client``'s session (best effort, bounded: a server that hangs cannot hold it)."""
    try:
        with contextlib.suppress(Exception):  # already gone
            await asyncio.wait_for(client.close(), _CLOSE_SECONDS)
    finally:
        sessions.discard(client)


def close_soon(loop: asyncio.AbstractEventLoop, client, sessions: set) -> None:
    """Have the loop close ``client``'s session without waiting for it (an episode ends, or is collected, on any
    thread). The coroutine is made on the loop, only for a session still open: none is left unrun at shutdown."""
    def start() -> None:
        if client in sessions:  # else never opened, closed already, or taken by the shutdown
            asyncio.ensure_future(_close(client, sessions))

    with contextlib.suppress(RuntimeError):  # the loop is closed: the shutdown closed every session
        loop.call_soon_threadsafe(start)


def _shutdown(sessions: set, box: dict) -> None:
    """Close the open sessions (a few seconds at most), stop the loop, stop the server process and its group."""
    loop, thread = box.pop("loop"), box.pop("thread")

    async def close_all():  # and end what else runs (closes under way), so that no coroutine is left unrun
        clients = list(sessions)
        sessions.clear()
        await asyncio.gather(*(_close(client, sessions) for client in clients))
        others = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
        for task in others:
            task.cancel()
        await asyncio.gather(*others, return_exceptions=True)

    with contextlib.suppress(Exception):  # the loop is stuck: the server's stop ends the sessions anyway
        asyncio.run_coroutine_threadsafe(close_all(), loop).result(_CLOSE_SECONDS + 1.0)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(timeout=_CLOSE_SECONDS)
    if not thread.is_alive():
        loop.close()
    if box.get("process") is not None:
        box.pop("process").stop(grace_seconds=2.0)
    with contextlib.suppress(KeyError, OSError):  # no server, or its output removed already
        os.remove(box.pop("log"))


def _last_words(path: str | None) -> str:
    """What a server printed last: the last line naming an exception (``RuntimeError: ...``) if there is one,
    else its last line."""
    with contextlib.suppress(OSError, TypeError), open(path, "rb") as f:
        lines = [line.strip() for line in f.read()[-16384:].decode(errors="replace").splitlines() if line.strip()]
        errors = [line for line in lines if re.match(r"^[\w.]+(Error|Exception|Exit|Interrupt)\b", line)]
        return ((errors or lines or ["(nothing)"])[-1])[:300]
    return "(nothing)"


class Runtime:
    """What the episodes of one ``OpenEnv`` share: the event loop their sessions run on and, with ``server``, the
    server process. ``ensure`` starts them; the finalizer (``close``, garbage collection, exit) stops them.
    ``setting`` is the recipe key of ``server``, named where the server does not start."""

    def __init__(self, url: str | None, server: str | None, startup_timeout: float, setting: str = "server"):
        self.given_url, self.server, self.startup_timeout, self.setting = url, server, startup_timeout, setting
        self.lock = threading.Lock()
        self._fresh()

    def _fresh(self) -> None:
        self.url = self.given_url  # with ``server``: set once it has started
        self.loop: asyncio.AbstractEventLoop | None = None
        self.client_class = None
        self.sessions: set = set()  # open clients, touched on the loop's thread only
        self.box: dict = {}  # the server process and its log, for the finalizer
        self._finalizer: weakref.finalize | None = None

    def ensure(self) -> str:
        """Start what episodes need, the first time (openenv's client, the loop, the server) or again (a server
        that has exited), and return the URL of the server."""
        with self.lock:
            if self.loop is None:
                self.client_class = _client_class()  # openenv's server side comes with it: seconds, once
                self.loop = asyncio.new_event_loop()
                thread = threading.Thread(target=self.loop.run_forever, name="rllight-openenv", daemon=True)
                thread.start()
                self.box.update(loop=self.loop, thread=thread)
                self._finalizer = weakref.finalize(self, _shutdown, self.sessions, self.box)
            process = self.box.get("process")
            if self.server is not None and (process is None or process.exit_code() is not None):
                self._start_server()
            return self.url

    def _start_server(self) -> None:
        """Start the server process and wait until it accepts connections; a one-line error naming ``server`` and
        what it printed last if it does not (a ``RecipeError`` the first time, a ``ComponentError`` later)."""
        restart = self.box.get("process") is not None
        if restart:
            old, old_log = self.box.pop("process"), self.box.pop("log", None)
            log.warning("the OpenEnv server %s exited (exit code %s; it printed last: %r, its output: %s); starting "
                        "it again", self.server, old.kill(), _last_words(old_log), old_log)
        fd, log_path = tempfile.mkstemp(prefix="rllight-openenv-", suffix=".log")
        os.close(fd)
        process = SupervisedProcess.interpreter(f"{__name__}:_serve", name=f"the OpenEnv server {self.server}")
        self.box.update(log=log_path, process=process)
        try:
            process.send(("serve", self.server, log_path))
            reply = process.receive(self.startup_timeout, "start")
        except ChildDied as err:
            reply = ("error", f"it exited ({err})")
        except ChildTimedOut:
            reply = ("error", f"it did not accept connections within {self.startup_timeout:g} s")
        if reply[0] != "ready":
            self.box.pop("process").kill()
            self.box.pop("log")  # kept for the user to read
            error = ComponentError if restart else RecipeError
            raise error(f"{self.setting}={self.server!r}: the OpenEnv server did not start: {reply[1]}; it printed "
                        f"last: {_last_words(log_path)!r} (its output: {log_path})")
        self.url = f"http://127.0.0.1:{reply[1]}"
        log.info("the OpenEnv server %s listens at %s (its output: %s)", self.server, self.url, log_path)

    def close(self) -> None:
        with self.lock:
            if self._finalizer is not None:
                self._finalizer()
            self._fresh()


# ------------------------------------------------------------------------------------------ server side
def _serve(connection) -> None:
    """The server process (``SupervisedProcess.interpreter``): told ``("serve", "package.module:app", log path)``,
    it prints to that log, serves the app with uvicorn on a free loopback port and answers ``("ready", port)``
    (``("error", line)`` if the app cannot be loaded); it stops at ``("stop",)``, and with the trainer."""
    become_child()
    _, target, log_path = connection.recv()
    out = os.open(log_path, os.O_WRONLY | os.O_APPEND)
    os.dup2(out, 1)
    os.dup2(out, 2)
    try:
        import uvicorn

        module, name = target.split(":")
        app = getattr(importlib.import_module(module), name)
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", 0))
        sock.listen(512)
        server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    except BaseException as err:  # noqa: BLE001 - reported to the trainer, which raises one line
        traceback.print_exc()
        connection.send(("error", one_line(err, 300)))
        return
    threading.Thread(target=_announce, args=(connection, server, sock.getsockname()[1]), daemon=True).start()
    server.run(sockets=[sock])


def _announce(connection, server, port: int) -> None:
    """Say ``("ready", port)`` once uvicorn has started, then stop it at the trainer's ``("stop",)`` or when the
    trainer's end of the pipe closes."""
    while not server.started:
        if server.should_exit:
            return
        time.sleep(0.02)
    connection.send(("ready", port))
    with contextlib.suppress(EOFError, OSError):
        connection.recv()
    server.should_exit = True


__all__ = ["LATE_SECONDS", "BadAnswer", "Runtime", "close_soon", "explain", "open_session"]
