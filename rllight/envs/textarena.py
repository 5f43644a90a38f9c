"""textarena's single-player games as an environment (``bash tools/install.sh textarena``).

textarena (``textarena.make(env_id, **kwargs)``) ships text games with their own rules, move formats and rewards:
Guess The Number, Wordle, Mastermind, Sudoku, Tower of Hanoi, ... In a recipe, with rows that carry a seed
(``rllight.data.seeded.SeededTask``)::

    model:
      environment:
        class_path: rllight.envs.textarena.TextArena
        init_args:
          game: GuessTheNumber-v0
          game_args: {min_number: 1, max_number: 10, max_turns: 4}
    data:
      task:
        class_path: rllight.data.seeded.SeededTask
        init_args: {train_size: 2000, val_size: 100, data_source: GuessTheNumber-v0}

Each episode plays one game, seeded from its row's ``seed``: a held-out set of seeds is a held-out set of games,
and the G episodes of a group play the same game. The game's opening text is added to the prompt; each model turn
is one move (the whole turn is the action: the game finds the move in it, e.g. Guess The Number's ``[5]``); the
game's reply is the next user turn. The game decides what an invalid move costs (most let the player resubmit
once, then end the game) and what the episode earns (its reward at the end; partial credit where the game gives
it). Games that read word lists through ``nltk`` (Hangman, Wordle, WordLadder, ...) need its corpora downloaded
first; Guess The Number, Mastermind, Tower of Hanoi, Lights Out and others need nothing.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Callable

from rllight.bounds import AtLeastTwo, PositiveFiniteFloat, PositiveInt
from rllight.envs.base import Environment, StepResult
from rllight.errors import RecipeError, install_hint, one_line

INSTALL = install_hint("textarena", "textarena==0.7.4")
GAME_KEY = "model.environment.init_args.game"

_RANDOM_LOCK = threading.Lock()
"""textarena's games draw from Python's global ``random`` module (``State`` seeds it with ``random.seed``): one game
call at a time swaps its own generator state in and the process's back out."""

SUGGESTED = "GuessTheNumber-v0, Mastermind-v0, TowerOfHanoi-v0, LightsOut-v0"
"""Single-player games that need no download, named in error messages."""


def import_textarena(key: str):
    """The ``textarena`` package, or a one-line ``RecipeError`` naming ``key`` and the install command."""
    try:
        import textarena
    except ImportError:
        raise RecipeError(f"{key} needs textarena, which is not installed: {INSTALL}") from None
    return textarena


class TextArena(Environment):
    """A single-player textarena game, one per episode, seeded from the row.

    ``reset(row)`` makes the game (``textarena.make(game, **game_args)``, with the wrappers textarena registers for
    it: e.g. ``ActionFormattingWrapper``, which puts brackets around a move that has none), resets it with one
    player and the row's ``seed`` (an integer; ``rllight.data.seeded.SeededTask`` makes such rows), and returns
    its opening text. Each ``step`` plays the model's whole turn as the move and returns only what the game said
    since the model's last turn (the conversation already holds the rest; the echo of the model's own move is left
    out), as textarena's raw messages, without the history its observation wrappers rebuild every turn. Every step
    earns 0 until the game ends; its last earns the game's reward for the player, and the episode is ``correct``
    when that reward is at least ``win_reward`` (textarena gives 1 for a won single-player game).

    Invalid moves are the game's business: most single-player games tell the player why and let them resubmit
    once, then end the game (with the reward they give for it). ``max_turns`` counts model turns, resubmissions
    included: give room for the game's own turns and those retries (twice the game's turns), or the episode is
    cut before the game ends and earns 0 (truncated).

    Each episode keeps, for tools that report on games (``tools/env_measure.py``): ``transcript`` (``(speaker,
    text)`` pairs, speaker ``game`` or ``model``), ``moves``, ``invalid_moves`` (moves the game refused: it did not
    advance its turn, or ended the game for it), ``finished``, ``reward``, ``won`` and ``outcome`` (the game's own
    reason for how it ended).

    Python's ``random`` module is the one textarena's games draw from: each episode keeps its own generator state,
    swapped in for its calls under a lock, so episodes stepped at once (``max_concurrency``) draw the same numbers
    as one after another, and the trainer's own ``random`` stream is untouched.

    Args:
        game: A textarena game id for one player, e.g. ``GuessTheNumber-v0`` (textarena's registry lists them:
            ``textarena.envs.registration.ENV_REGISTRY``).
        game_args: Keyword arguments of the game, replacing its registered ones (e.g. Guess The Number's
            ``min_number``, ``max_number``, ``max_turns``).
        win_reward: The game's final reward at or above which the episode is correct (a won game).
        max_turns: Most model turns per episode (moves, invalid ones included).
        max_total_tokens: Most tokens in an episode's context, prompt included.
        timeout_seconds: Wall-clock limit of one call into an episode (see ``Environment``).
        max_concurrency: Episodes stepped at once within a turn (see ``Environment``); a game's move takes
            microseconds and runs under the lock above, so 1 loses nothing.
    """

    def __init__(self, game: str = "GuessTheNumber-v0", game_args: dict | None = None, win_reward: float = 1.0,
                 max_turns: PositiveInt = 20, max_total_tokens: AtLeastTwo = 1024,
                 timeout_seconds: PositiveFiniteFloat | None = Environment.DEFAULT_TIMEOUT,
                 max_concurrency: PositiveInt = 1):
        super().__init__(max_turns=max_turns, max_total_tokens=max_total_tokens, timeout_seconds=timeout_seconds,
                         max_concurrency=max_concurrency)
        ta = import_textarena("model.environment: TextArena")  # before the model loads
        if not isinstance(game, str) or game not in ta.envs.registration.ENV_REGISTRY:
            raise RecipeError(f"{GAME_KEY}: {game!r} is not a textarena game id; name one of its single-player "
                              f"games, e.g. {SUGGESTED}")
        if game_args is not None and not isinstance(game_args, dict):
            raise RecipeError(f"model.environment.init_args.game_args must be a mapping of the game's arguments, "
                              f"got {game_args!r}")
        self.game = game
        self.game_args = dict(game_args or {})
        self.win_reward = float(win_reward)
        self._game = self._core = self._random_state = None
        self._check_game(ta)
        self._random_state = None  # the check's game's: each episode starts from its own seed
        self._begin(None)

    # ------------------------------------------------------------------------------------- set-up
    def _check_game(self, ta) -> None:
        """Make the game and start it with one player, once, so that a bad game id, bad ``game_args`` or a game
        for several players stops the recipe before the model loads."""
        try:
            probe = ta.make(self.game, **self.game_args)
        except TypeError as err:
            raise RecipeError(f"model.environment.init_args.game_args: {self.game} does not take {self.game_args!r} "
                              f"({one_line(err, 200)}); give only the game's own arguments") from None
        except Exception as err:  # noqa: BLE001 - whatever a game raises, the recipe stops with one line
            raise RecipeError(f"{GAME_KEY}: {self.game} could not be made ({one_line(err, 200)}); name another, "
                              f"e.g. {SUGGESTED}") from None
        try:
            self._in_own_random(lambda: probe.reset(num_players=1, seed=0))
        except Exception as err:  # noqa: BLE001 - a game for several players asserts, others may raise otherwise
            raise RecipeError(f"{GAME_KEY}: {self.game} does not start with one player ({one_line(err, 200)}); "
                              f"TextArena plays single-player games, e.g. {SUGGESTED}") from None
        if not isinstance(_core(ta, probe).state, ta.SinglePlayerState):
            raise RecipeError(f"{GAME_KEY}: {self.game} is a game for several players; TextArena plays "
                              f"single-player games, e.g. {SUGGESTED}")

    def _begin(self, seed: int | None) -> None:
        """This episode's record, empty."""
        self.seed = seed
        self.transcript: list[tuple[str, str]] = []
        self.moves = self.invalid_moves = 0
        self.finished = self.won = False
        self.reward = 0.0
        self.outcome = ""

    def _in_own_random(self, call: Callable):
        """``call()`` with Python's ``random`` module drawing from this episode's generator state (the lock keeps
        episodes stepped at once from drawing from each other's); the process's state is restored after."""
        with _RANDOM_LOCK:
            outer = random.getstate()
            try:
                if self._random_state is not None:
                    random.setstate(self._random_state)
                return call()
            finally:
                self._random_state = random.getstate()
                random.setstate(outer)

    # ------------------------------------------------------------------------------------- episode
    def reset(self, row: dict) -> str | None:
        """Make and start this episode's game, seeded with ``row["seed"]``; returns the game's opening text."""
        seed = row.get("seed")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TypeError(f"the row has no integer 'seed' (got {seed!r}): a TextArena episode plays the game of "
                             "its row's seed; use data.task rllight.data.seeded.SeededTask, or give each row a seed")
        import textarena as ta

        self._begin(seed)
        self._random_state = None
        self._game = ta.make(self.game, **self.game_args)
        self._core = _core(ta, self._game)

        def start():
            random.seed(seed)  # for a game that draws before its State seeds the module
            self._game.reset(num_players=1, seed=seed)

        self._in_own_random(start)
        opening = self._news()
        self.transcript.append(("game", opening))
        return opening

    def step(self, response_text: str) -> StepResult:
        """Play the model's turn as the game's move: the game's reply, or its reward once it is over."""
        state = self._core.state
        turn = getattr(state, "turn", None)
        done, _ = self._in_own_random(lambda: self._game.step(response_text))
        self.moves += 1
        self.transcript.append(("model", response_text))
        player = getattr(state, "current_player_id", 0)
        ended_invalid = bool(done and (getattr(state, "game_info", None) or {}).get(player, {}).get("invalid_move"))
        if ended_invalid or (turn is not None and getattr(state, "turn", None) == turn):
            self.invalid_moves += 1
        if not done:
            news = self._news()
            self.transcript.append(("game", news))
            return StepResult(news, 0.0, done=False)
        return self._finish(player)

    def _finish(self, player: int) -> StepResult:
        """The end of the game: its reward for ``player`` (0 where it gives none) and whether that is a win."""
        closed = self._game.close()
        rewards, info = closed if isinstance(closed, tuple) else (closed, {})
        self.reward = float((rewards or {}).get(player, 0.0))
        self.won = self.reward >= self.win_reward
        self.finished = True
        self.outcome = str(((info or {}).get(player) or {}).get("reason", ""))
        self.transcript.append(("game", f"(game over: {self.outcome})" if self.outcome else "(game over)"))
        return StepResult(None, self.reward, done=True, correct=self.won)

    def _news(self) -> str:
        """What the game said to the player since its last turn, one message a line: the player's own move, which
        the game echoes, left out; a message from another sender prefixed with its name, as textarena does."""
        player, messages = self._core.get_observation()
        roles = getattr(self._core.state, "role_mapping", {}) or {}
        lines = []
        for sender, text, kind in messages or []:
            if sender == player and getattr(kind, "name", "") == "PLAYER_ACTION":
                continue
            lines.append(str(text) if sender == -1 else f"[{roles.get(sender, f'Player {sender}')}] {text}")
        return "\n".join(lines)


def _core(ta, game):
    """The game under textarena's wrappers: its raw messages, which its observation wrappers would accumulate."""
    while isinstance(game, ta.Wrapper):
        game = game.env
    return game


__all__ = ["INSTALL", "TextArena", "import_textarena"]
