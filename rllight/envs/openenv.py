"""OpenEnv environments as rllight environments (``bash tools/install.sh openenv``).

An OpenEnv server (https://github.com/meta-pytorch/OpenEnv) holds environments behind HTTP and WebSocket: each
connection to its ``/ws`` is a session with an environment instance of its own, driven by ``reset`` and ``step``
messages answered with an observation (a JSON object), a reward and ``done``. ``OpenEnv`` plays one through
openenv's client, one session per episode, so no two episodes share a state. The server is one already running
(``url``) or an app this process serves (``server``). This module is the adapter (settings, episodes, observations
as text); ``rllight.envs.openenv_sessions`` holds the sessions, their event loop and the server process.

**Capacity.** An openenv server allows ``max_concurrent_envs`` sessions at once: 1 unless its ``create_app`` says
more (which needs an environment class with ``SUPPORTS_CONCURRENT_SESSIONS = True``). A batch holds one session per
episode, prompts x n at once; a session refused for capacity costs its episode, with a line saying so.
"""

from __future__ import annotations

import asyncio
import json
import re
import weakref
from urllib.parse import urlsplit

from rllight.bounds import AtLeastTwo, PositiveFiniteFloat, PositiveFloat, PositiveInt, bounded
from rllight.envs.base import Environment, StepResult
from rllight.envs.factory import refuse_system
from rllight.envs.openenv_sessions import LATE_SECONDS, BadAnswer, Runtime, close_soon, explain, open_session
from rllight.errors import ComponentError, RecipeError, install_hint

INSTALL = install_hint("openenv", "openenv-core")
KEY = "model.environment.init_args"

OBSERVATION_FIELDS = ("prompt", "text", "message", "content", "observation", "feedback", "output")
"""Fields shown to the model when ``observation_field`` is None: the first of these that holds text, else the
observation's only text field, else the observation as JSON."""

_TARGET = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")


def import_openenv(key: str):
    """The ``openenv`` package, or a one-line ``RecipeError`` naming ``key`` and the install command."""
    try:
        import openenv
    except ImportError:
        raise RecipeError(f"{key} needs OpenEnv, which is not installed: {INSTALL}") from None
    return openenv


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
            raise BadAnswer(f"its observation has no field {field!r} (observation_field), only {sorted(observation)}")
        return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, default=str)
    for name in OBSERVATION_FIELDS:
        if isinstance(observation.get(name), str):
            return observation[name]
    texts = [value for value in observation.values() if isinstance(value, str)]
    if len(texts) == 1:
        return texts[0]
    return json.dumps(observation, ensure_ascii=False, sort_keys=True, default=str)


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

    @bounded
    def __init__(self, url: str | None = None, server: str | None = None, action_field: str = "message",
                 action_args: dict | None = None, observation_field: str | None = None, show_reset: bool = True,
                 reset_args: dict | None = None, reset_from_row: dict[str, str] | None = None,
                 correct_field: str | None = None, startup_timeout_seconds: PositiveFloat = 60.0,
                 max_turns: PositiveInt = 3, max_total_tokens: AtLeastTwo = 1024,
                 timeout_seconds: PositiveFiniteFloat | None = Environment.DEFAULT_TIMEOUT,
                 max_concurrency: PositiveInt = 8):
        import_openenv(KEY)
        super().__init__(max_turns=max_turns, max_total_tokens=max_total_tokens, timeout_seconds=timeout_seconds,
                         max_concurrency=max_concurrency)
        _check_settings(url, server, action_field, action_args, observation_field, reset_args, reset_from_row,
                        correct_field)
        self.url, self.server = url, server
        self.action_field, self.action_args = action_field, dict(action_args or {})
        self.observation_field, self.show_reset, self.correct_field = observation_field, show_reset, correct_field
        self.reset_args, self.reset_from_row = dict(reset_args or {}), dict(reset_from_row or {})
        self.startup_timeout_seconds = float(startup_timeout_seconds)
        self._runtime = Runtime(url, server, self.startup_timeout_seconds, f"{KEY}.server")
        # An episode's: the server it talks to, its session (a client), what closes it if the episode is dropped
        self._url = self._client = self._finalizer = None

    # Pickling or copying carries the settings only (an episode, from ``spawn``, shares the runtime).
    def __getstate__(self) -> dict:
        return {**self.__dict__, "_runtime": None, "_url": None, "_client": None, "_finalizer": None}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._runtime = Runtime(self.url, self.server, self.startup_timeout_seconds, f"{KEY}.server")

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
        self._finalizer = weakref.finalize(self, close_soon, runtime.loop, self._client, runtime.sessions)
        self._finalizer.atexit = False  # at exit the runtime's shutdown closes every session
        observation, _, _ = self._call("reset", open_session(self._client, runtime.sessions, args))
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
        return (self.timeout_seconds or self.DEFAULT_TIMEOUT) + LATE_SECONDS

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
            raise ComponentError(f"the OpenEnv server at {self._url}: {what} failed: {explain(err, limit)}") from None

    def _text(self, what: str, observation: dict) -> str:
        try:
            return observation_text(observation, self.observation_field)
        except BadAnswer as err:
            self._end_session()
            raise ComponentError(f"the OpenEnv server at {self._url}: {what}: {err}") from None

    def _end_session(self) -> None:
        """Close this episode's session without waiting (the server frees it when the close arrives)."""
        self._client = None
        if self._finalizer is not None:
            self._finalizer()
            self._finalizer = None


def _check_settings(url, server, action_field, action_args, observation_field, reset_args, reset_from_row,
                    correct_field) -> None:
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
    if server is not None:
        refuse_system(server, f"{KEY}.server", "an OpenEnv app of your own (or of an installed package)")
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


__all__ = ["INSTALL", "OBSERVATION_FIELDS", "OpenEnv", "import_openenv", "observation_text"]
