"""OpenEnv environments as rllight environments (``pip install 'rllight[openenv]'``).

An OpenEnv server (https://github.com/meta-pytorch/OpenEnv) holds environments behind HTTP and WebSocket: each
connection to its ``/ws`` is a session with an environment instance of its own, driven by ``reset`` and ``step``
messages answered with an observation (a JSON object), a reward and ``done``. ``OpenEnv`` plays one through
openenv's client, one session per episode, so no two episodes share a state. The server is one already running
(``url``) or an app this process serves (``server``) in a supervised child process (``rllight.supervised``),
started by the first ``spawn``, stopped with its process group by ``close()``, garbage collection or exit.

**Capacity.** An openenv server allows ``max_concurrent_envs`` sessions at once: 1 unless its ``create_app`` says
more (which needs an environment class with ``SUPPORTS_CONCURRENT_SESSIONS = True``). A batch holds one session per
episode, prompts x n at once; a session refused for capacity costs its episode, with a line saying so.

**Threads.** The sessions of one ``OpenEnv`` are coroutines on one event loop with a thread of its own; each call of
an episode (on its guard's thread) hands its coroutine over with asyncio's thread-safe ``run_coroutine_threadsafe``
and waits at most ``timeout_seconds`` and a quarter of a second (the guard counts a hung server as a timeout).
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

from rllight.envs.base import Environment, StepResult
from rllight.errors import ComponentError, RecipeError, one_line
from rllight.supervised import ChildDied, ChildTimedOut, SupervisedProcess, become_child

log = logging.getLogger(__name__)

INSTALL = "pip install 'rllight[openenv]' (or pip install openenv-core)"
KEY = "model.environment.init_args"

OBSERVATION_FIELDS = ("prompt", "text", "message", "content", "observation", "feedback", "output")
"""Fields shown to the model when ``observation_field`` is None: the first of these that holds text, else the
observation's only text field, else the observation as JSON."""

_LATE = 0.25  # a call gives up this long after the guard's timeout: the guard counts a timeout, not an error
_CLOSE_SECONDS = 2.0  # most time spent closing sessions at shutdown
_TARGET = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")


def import_openenv(key: str):
    """The ``openenv`` package, or a one-line ``RecipeError`` naming ``key`` and the install command."""
    try:
        import openenv
    except ImportError:
        raise RecipeError(f"{key} needs OpenEnv, which is not installed: {INSTALL}") from None
    return openenv


class _BadAnswer(ValueError):
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


def _lookup(observation: dict, path: str) -> tuple[bool, object]:
    """``(found, value)`` of the field ``path`` of ``observation`` (dots go into nested objects: ``a.b``)."""
    value = observation
    for part in path.split("."):
        if not isinstance(value, dict) or part not in value:
            return False, None
        value = value[part]
    return True, value


def observation_text(observation: dict, field: str | None = None) -> str:
    """The text the model is shown for an OpenEnv observation: the field ``field`` (dots go into nested objects;
    text as is, anything else as JSON); with None the first of ``OBSERVATION_FIELDS`` that holds text, else the
    only text field, else the whole observation as JSON. A missing ``field`` raises, naming the fields there are."""
    if field is not None:
        found, value = _lookup(observation, field)
        if not found:
            raise _BadAnswer(f"its observation has no field {field!r} (observation_field), only {sorted(observation)}")
        return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, default=str)
    for name in OBSERVATION_FIELDS:
        if isinstance(observation.get(name), str):
            return observation[name]
    texts = [value for value in observation.values() if isinstance(value, str)]
    if len(texts) == 1:
        return texts[0]
    return json.dumps(observation, ensure_ascii=False, sort_keys=True, default=str)


def _checked(result) -> tuple[dict, float, bool]:
    """``(observation, reward, done)`` of an openenv ``StepResult``, or ``_BadAnswer`` saying what is wrong."""
    observation, reward, done = result.observation, result.reward, result.done
    if not isinstance(observation, dict):
        raise _BadAnswer(f"it answered an observation that is {type(observation).__name__}, not a JSON object")
    if reward is not None and not isinstance(reward, (bool, int, float)):
        raise _BadAnswer(f"it answered reward {reward!r}, not a number")
    if not isinstance(done, bool):
        raise _BadAnswer(f"it answered done={done!r}, not true or false")
    return observation, 0.0 if reward is None else float(reward), done


def _explain(err: BaseException, limit: float) -> str:
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
    return text if isinstance(err, (_BadAnswer, ConnectionError)) and text else f"{name}: {text}"


async def _open(client, sessions: set, reset_args: dict) -> tuple[dict, float, bool]:
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


def _close_soon(loop: asyncio.AbstractEventLoop, client, sessions: set) -> None:
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


class _Runtime:
    """What the episodes of one ``OpenEnv`` share: the event loop their sessions run on and, with ``server``, the
    server process. ``ensure`` starts them; the finalizer (``close``, garbage collection, exit) stops them."""

    def __init__(self, url: str | None, server: str | None, startup_timeout: float):
        self.given_url, self.server, self.startup_timeout = url, server, startup_timeout
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
            raise error(f"{KEY}.server={self.server!r}: the OpenEnv server did not start: {reply[1]}; it printed "
                        f"last: {_last_words(log_path)!r} (its output: {log_path})")
        self.url = f"http://127.0.0.1:{reply[1]}"
        log.info("the OpenEnv server %s listens at %s (its output: %s)", self.server, self.url, log_path)

    def close(self) -> None:
        with self.lock:
            if self._finalizer is not None:
                self._finalizer()
            self._fresh()


class OpenEnv(Environment):
    """An OpenEnv environment, played through its server (see ``rllight.envs.openenv``).

    Each episode opens a session at ``reset`` (its observation joins the prompt) and sends each model turn as a
    ``step`` action, ``{action_field: the turn's text, **action_args}``. The server's reward is the turn's (None
    counts 0; a trajectory's is their sum), its ``done`` ends the episode, and the observation's text
    (``observation_text``) is the next user turn. ``correct`` (accuracy) is the observation's ``correct_field`` when
    it has one, else whether the turn that ends the episode has a reward above 0. The session closes with the episode.

    Args:
        url: A running OpenEnv server (``http://host:port``; ``ws://`` too). Exactly one of ``url`` and ``server``.
        server: The import path of an OpenEnv ASGI app, ``package.module:app`` (made with openenv's ``create_app``),
            which this process serves on a free loopback port (``startup_timeout_seconds`` to come up).
        action_field: The action's field that holds the model's text.
        action_args: Constant fields added to every action (e.g. ``{tool_name: answer}``).
        observation_field: The observation's field shown to the model (``a.b`` for a nested one); None = the first
            of ``OBSERVATION_FIELDS`` that holds text, else its only text field, else the observation as JSON.
        show_reset: Add the text of the observation ``reset`` answers to the prompt's last message.
        reset_args: Constant keyword arguments of the server's ``reset`` (e.g. ``{difficulty: easy}``).
        reset_from_row: ``reset`` arguments read from the prompt row, ``{argument: row field}``: ``{seed: seed}``
            gives a row's episodes the same game. openenv passes only the arguments its ``reset`` accepts.
        correct_field: The observation's field saying the task is solved (``a.b`` for a nested one); None = a
            positive reward at the last turn.
        startup_timeout_seconds: Most seconds the ``server`` may take to accept connections.
        max_turns: Most model turns per episode.
        max_total_tokens: Most tokens in an episode's context, prompt included.
        timeout_seconds: Wall-clock limit of one call (a reset with its connection, a step); the client gives up
            soon after. None = calls in the trainer's thread, the client giving up after ``DEFAULT_TIMEOUT``.
        max_concurrency: Episodes stepped at once within a turn (see ``Environment``).
    """

    def __init__(self, url: str | None = None, server: str | None = None, action_field: str = "message",
                 action_args: dict | None = None, observation_field: str | None = None, show_reset: bool = True,
                 reset_args: dict | None = None, reset_from_row: dict[str, str] | None = None,
                 correct_field: str | None = None, startup_timeout_seconds: float = 60.0, max_turns: int = 3,
                 max_total_tokens: int = 1024, timeout_seconds: float | None = Environment.DEFAULT_TIMEOUT,
                 max_concurrency: int = 8):
        import_openenv(KEY)
        super().__init__(max_turns=max_turns, max_total_tokens=max_total_tokens, timeout_seconds=timeout_seconds,
                         max_concurrency=max_concurrency)
        _check_settings(url, server, action_field, action_args, observation_field, reset_args, reset_from_row,
                        correct_field, startup_timeout_seconds)
        self.url, self.server = url, server
        self.action_field, self.action_args = action_field, dict(action_args or {})
        self.observation_field, self.show_reset, self.correct_field = observation_field, show_reset, correct_field
        self.reset_args, self.reset_from_row = dict(reset_args or {}), dict(reset_from_row or {})
        self.startup_timeout_seconds = float(startup_timeout_seconds)
        self._runtime = _Runtime(url, server, self.startup_timeout_seconds)
        # An episode's: the server it talks to, its session (a client), what closes it if the episode is dropped
        self._url = self._client = self._finalizer = None

    # Pickling or copying carries the settings only (an episode, from ``spawn``, shares the runtime).
    def __getstate__(self) -> dict:
        return {**self.__dict__, "_runtime": None, "_url": None, "_client": None, "_finalizer": None}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._runtime = _Runtime(self.url, self.server, self.startup_timeout_seconds)

    def spawn(self) -> OpenEnv:
        """A fresh episode; the first one starts what episodes need (openenv's client, and the ``server``, which a
        later one starts again if it has died). A server that does not start raises one line naming it."""
        episode = object.__new__(type(self))
        episode.__dict__.update(self.__dict__, _url=self._runtime.ensure(), _client=None, _finalizer=None)
        return episode

    def reset(self, row: dict) -> str | None:
        args = dict(self.reset_args)
        for name, field in self.reset_from_row.items():
            if field not in row:
                raise RecipeError(f"{KEY}.reset_from_row: the row has no field {field!r} (it has {sorted(row)})")
            args[name] = row[field]
        if self._url is None:  # reset on the object itself, not on a spawned episode
            self._url = self._runtime.ensure()
        runtime, limit = self._runtime, self._limit()
        self._client = runtime.client_class(base_url=self._url, connect_timeout_s=limit, message_timeout_s=limit)
        self._finalizer = weakref.finalize(self, _close_soon, runtime.loop, self._client, runtime.sessions)
        self._finalizer.atexit = False  # at exit the runtime's shutdown closes every session
        observation, _, _ = self._call("reset", _open(self._client, runtime.sessions, args))
        return (self._text("reset", observation) or None) if self.show_reset else None

    def step(self, response_text: str) -> StepResult:
        if self._client is None:
            raise ComponentError(f"the OpenEnv server at {self._url}: step without a session (the episode ended)")
        action = {**self.action_args, self.action_field: response_text}
        observation, reward, done = self._call("step", self._client.exchange(self._client.step(action)))
        correct = reward > 0 if done else None
        if self.correct_field is not None:
            found, value = _lookup(observation, self.correct_field)
            correct = bool(value) if found and value is not None else None
        if done:
            self._end_session()
            return StepResult(None, reward, done=True, correct=correct)
        return StepResult(self._text("step", observation), reward, done=False, correct=correct)

    def trajectory_reward(self, rewards: list[float]) -> float:
        """The sum of the turns' rewards; the episode is over, so its session closes (if it is still open)."""
        self._end_session()
        return super().trajectory_reward(rewards)

    def close(self) -> None:
        """Close the open sessions and stop the server this object started; a later episode starts it again."""
        self._runtime.close()

    # ------------------------------------------------------------------------------------------- calls
    def _limit(self) -> float:
        return (self.timeout_seconds or self.DEFAULT_TIMEOUT) + _LATE

    def _call(self, what: str, coroutine) -> tuple[dict, float, bool]:
        """Run ``coroutine`` (an exchange of this episode's session) on the shared loop and wait for it, at most
        ``_limit()`` seconds; any failure ends the session and raises one line naming the server's URL."""
        limit, future = self._limit(), None
        try:
            future = asyncio.run_coroutine_threadsafe(asyncio.wait_for(coroutine, limit), self._runtime.loop)
            return future.result(limit + 1.0)
        except BaseException as err:
            if future is None:
                coroutine.close()  # never started (the runtime was closed)
            else:
                future.cancel()
            self._end_session()
            if not isinstance(err, Exception):  # the guard gave up on this call, or a stop
                raise
            raise ComponentError(f"the OpenEnv server at {self._url}: {what} failed: {_explain(err, limit)}") from None

    def _text(self, what: str, observation: dict) -> str:
        try:
            return observation_text(observation, self.observation_field)
        except _BadAnswer as err:
            self._end_session()
            raise ComponentError(f"the OpenEnv server at {self._url}: {what}: {err}") from None

    def _end_session(self) -> None:
        """Close this episode's session without waiting (the server frees it when the close arrives)."""
        self._client = None
        if self._finalizer is not None:
            self._finalizer()
            self._finalizer = None


def _check_settings(url, server, action_field, action_args, observation_field, reset_args, reset_from_row,
                    correct_field, startup_timeout_seconds) -> None:
    """One-line ``RecipeError`` naming the first setting that cannot work."""
    def bad(name: str, problem: str):
        raise RecipeError(f"{KEY}.{name} {problem}")

    if (url is None) == (server is None):
        bad(f"url and {KEY}.server", f"are both {'set' if url is not None else 'unset'}: set exactly one (url: a "
            "running OpenEnv server; server: the import path of its app, served here)")
    parts = urlsplit(url) if isinstance(url, str) else None
    if url is not None and (parts is None or parts.scheme not in ("http", "https", "ws", "wss") or not parts.hostname):
        bad("url", f"must be the http:// or https:// URL of a running OpenEnv server (ws:// works too), got {url!r}")
    if server is not None and not (isinstance(server, str) and _TARGET.match(server)):
        bad("server", f"must be the import path of an OpenEnv ASGI app, 'package.module:app', got {server!r}")
    for name, value in (("action_field", action_field), ("observation_field", observation_field),
                        ("correct_field", correct_field)):
        if (value is not None or name == "action_field") and not (isinstance(value, str) and value.strip()):
            bad(name, f"must be a field name, got {value!r}")
    for name, value in (("action_args", action_args), ("reset_args", reset_args)):
        if value is not None and not isinstance(value, dict):
            bad(name, f"must be a mapping, got {value!r}")
    if action_field in (action_args or {}):
        bad("action_args", f"sets {action_field!r}, the field that holds the model's text")
    if reset_from_row is not None and not (isinstance(reset_from_row, dict)
                                           and all(isinstance(v, str) for v in reset_from_row.values())):
        bad("reset_from_row", f"maps reset arguments to row field names, got {reset_from_row!r}")
    if not (isinstance(startup_timeout_seconds, (int, float)) and startup_timeout_seconds > 0):
        bad("startup_timeout_seconds", f"must be a positive number, got {startup_timeout_seconds!r}")


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


__all__ = ["INSTALL", "OBSERVATION_FIELDS", "OpenEnv", "import_openenv", "observation_text"]
