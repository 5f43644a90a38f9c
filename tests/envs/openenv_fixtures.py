"""Small OpenEnv servers for the adapter's tests (``rllight.envs.openenv``), written against openenv's server
interface, and servers that misbehave.

- ``app``: ``GuessNumber``, a number-guessing game served by openenv's ``create_fastapi_app``, up to 32 sessions;
  under ``/one`` the same game allowing one session at a time (openenv's default). ``reset(seed)`` picks the
  number ``seed % 10`` (7 without a seed); a step guesses the last number in the action's ``message``: right is
  reward 1 and done, wrong is reward 0 and a hint, and the third wrong guess ends the game. Every environment
  instance (one per session) has a ``game`` number of its own; a message holding "sleep" makes the step sleep for
  a minute (a server that hangs).
- ``garbage_app``: WebSocket endpoints answering every message with garbage: ``/not-json/ws`` and
  ``/wrong-shape/ws`` (openenv's client adds ``/ws`` to the URL it is given).
- ``failing_app`` (its startup raises) and ``hanging_app`` (its startup never ends): servers that cannot start.
- ``start_server``: a server process a test starts itself (for ``url``).

openenv's server side takes seconds to import (it brings gradio): only ``app`` needs it, and imports it when first
asked for (the module's ``__getattr__``), so that the other servers start in a fraction of that.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import re
import subprocess
import sys
import time

from fastapi import FastAPI, WebSocket


@functools.cache
def _game_app() -> FastAPI:
    """The guessing game's app (see the module)."""
    import itertools

    from openenv.core.env_server import create_fastapi_app
    from openenv.core.env_server.interfaces import Environment
    from openenv.core.env_server.types import Action, Observation, State

    class GuessAction(Action):
        message: str

    class GuessObservation(Observation):
        prompt: str
        game: int
        guesses: int = 0
        won: bool = False

    games = itertools.count(1)

    class GuessNumber(Environment):
        """Guess a number from 0 to 9 in three tries."""

        SUPPORTS_CONCURRENT_SESSIONS = True

        def __init__(self):
            super().__init__()
            self.game, self.secret, self.guesses = next(games), 7, 0

        def reset(self, seed=None, episode_id=None, **kwargs) -> GuessObservation:
            self.secret, self.guesses = (7 if seed is None else int(seed)) % 10, 0
            return GuessObservation(prompt="Guess my number from 0 to 9.", game=self.game)

        def step(self, action: GuessAction, timeout_s=None, **kwargs) -> GuessObservation:
            if "sleep" in action.message:
                time.sleep(60)
            self.guesses += 1
            numbers = re.findall(r"\d+", action.message)
            guess = int(numbers[-1]) if numbers else -1
            if guess == self.secret:
                return GuessObservation(prompt=f"Right, it is {guess}.", game=self.game, guesses=self.guesses,
                                        won=True, reward=1.0, done=True)
            hint = "higher" if guess < self.secret else "lower"
            return GuessObservation(prompt=f"No, {hint} than {guess} (guess {self.guesses}).", game=self.game,
                                    guesses=self.guesses, reward=0.0, done=self.guesses >= 3)

        @property
        def state(self) -> State:
            return State(step_count=self.guesses)

    game = create_fastapi_app(GuessNumber, GuessAction, GuessObservation, max_concurrent_envs=32)
    game.mount("/one", create_fastapi_app(GuessNumber, GuessAction, GuessObservation))
    return game


def __getattr__(name: str):
    if name == "app":
        return _game_app()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


NOT_JSON = "<html>this is not JSON</html>"
WRONG_SHAPE = json.dumps({"type": "observation", "data": {"observation": "a text", "reward": "high"}})
garbage_app = FastAPI()


@garbage_app.websocket("/{kind}/ws")
async def _garbage(websocket: WebSocket, kind: str):
    await websocket.accept()
    with contextlib.suppress(Exception):  # the client leaves
        while True:
            await websocket.receive_text()
            await websocket.send_text(NOT_JSON if kind == "not-json" else WRONG_SHAPE)


@contextlib.asynccontextmanager
async def _fails(_):
    raise RuntimeError("the game board is missing")
    yield


@contextlib.asynccontextmanager
async def _hangs(_):
    await asyncio.sleep(3600)
    yield


failing_app = FastAPI(lifespan=_fails)
hanging_app = FastAPI(lifespan=_hangs)

_SERVE = """
import importlib, socket, sys, uvicorn
module, name = sys.argv[1].split(":")
app = getattr(importlib.import_module(module), name)
sock = socket.socket()
sock.bind(("127.0.0.1", 0))
sock.listen(64)
print(sock.getsockname()[1], flush=True)
uvicorn.Server(uvicorn.Config(app, log_level="warning")).run(sockets=[sock])
"""


def start_server(target: str = "openenv_fixtures:app") -> tuple[subprocess.Popen, str]:
    """A server process serving ``target`` on a free loopback port, in a session of its own (kill its group), and
    its URL. It listens before it answers: connections wait for it."""
    process = subprocess.Popen([sys.executable, "-c", _SERVE, target], stdout=subprocess.PIPE, text=True,
                               start_new_session=True)
    return process, f"http://127.0.0.1:{int(process.stdout.readline())}"
