"""textarena's games as an environment: scripted moves play Guess The Number end to end through the rollout
producer and score as the game says; an invalid move is handled by the game's own rules; the game's reply is what
the model sees next; a seed is a game and held-out seeds are not trained on; bad settings and a missing package are
one line each; the recipe trains two steps on the tiny model."""

import os
import random
import sys

import pytest
from conftest import RECIPES
from helpers import build, fit_recording_rollouts, tiny_overrides
from test_environments import ScriptedEngine, _producer, _tokenizer

from rllight.data.seeded import SeededTask
from rllight.envs.guard import EpisodeGuard
from rllight.envs.textarena import TextArena
from rllight.errors import RecipeError
from rllight.rollout.episodes import ChatTurns
from rllight.rollout.producer import encode_chat, with_first_observation

ta = pytest.importorskip("textarena")

GAME = {"min_number": 1, "max_number": 10, "max_turns": 4}
SEED = 7


def _env(**kwargs) -> TextArena:
    # The tiny tokenizer spends ~490 tokens on the game's opening: room for it and a few turns (no model positions
    # are used by a scripted engine).
    return TextArena("GuessTheNumber-v0", GAME, max_turns=8, max_total_tokens=2048, **kwargs)


def _row(seed: int = SEED) -> dict:
    return {"messages": [{"role": "user", "content": ""}], "answer": "", "seed": seed}


def _raw_game(moves: list[str], seed: int = SEED) -> tuple[list[str], float]:
    """The same moves on textarena's own game, without rllight: the game's replies (the last message of each
    step's observation) and its final reward for the player."""
    game = ta.make("GuessTheNumber-v0", **GAME)
    game.reset(num_players=1, seed=seed)
    game.get_observation()
    replies = []
    for move in moves:
        done, _ = game.step(move)
        if done:
            break
        replies.append(game.get_observation()[1].split("\n[GAME] ")[-1])
    rewards, _ = game.close()
    return replies, float(rewards[0])


def _target(seed: int = SEED) -> int:
    """The game's number, found as a player would: the one guess that wins at once."""
    for k in range(1, 11):
        episode = _env().spawn()
        episode.reset(_row(seed))
        if episode.step(f"[{k}]").correct:
            return k
    raise AssertionError("no guess wins")


def _ids(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]


# ------------------------------------------------------------------------------------- a game end to end
def test_scripted_winning_moves_win_and_the_games_reply_is_the_next_prompt(tiny_model_dir):
    """A wrong guess, then the number: the game says higher or lower, that text's ids follow the model's turn in
    the next prompt, and the win earns the game's reward 1 and counts as correct."""
    target = _target()
    wrong = 1 if target != 1 else 2
    _, tok = _tokenizer(tiny_model_dir)
    first, second = _ids(tok, f"[{wrong}]"), _ids(tok, f"I guess [{target}].")
    engine = ScriptedEngine([first, second], tok.eos_token_id)
    producer, _ = _producer(engine, _env(), tiny_model_dir)
    rollout = producer.sample([_row()], 2)

    replies, reward = _raw_game([f"[{wrong}]", f"I guess [{target}]."])
    assert replies == [f"The target number is {'higher' if wrong < target else 'lower'}."] and reward == 1.0
    opening = _env().spawn().reset(_row())
    prompt = encode_chat(tok, with_first_observation(_row()["messages"], opening))
    assert opening.startswith("You are Player 0. You are playing Guess The Number.")
    assert engine.calls[0] == [prompt, prompt]  # the G episodes of a group play the same game
    # The model sees only the game's new message after its own turn: its ids, as the chat template renders them.
    assert engine.calls[1][0] == prompt + first + ChatTurns(tok).between(first, replies[0])
    assert rollout.rewards.tolist() == [1.0, 1.0] and rollout.correct.tolist() == [1.0, 1.0]
    assert rollout.truncated.tolist() == [False, False] and rollout.extras["episode/turns_mean"] == 2.0


def test_an_invalid_move_is_told_and_a_second_one_ends_the_game_as_the_game_says(tiny_model_dir):
    """A valid guess one away, then two moves without a [number]: the game explains the first refusal and lets the
    player resubmit; the second ends the game with the game's own partial credit (not a win)."""
    target = _target()
    guess = target + 1 if target < 10 else target - 1
    _, tok = _tokenizer(tiny_model_dir)
    moves = [f"[{guess}]", "five", "five"]
    engine = ScriptedEngine([_ids(tok, m) for m in moves], tok.eos_token_id)
    producer, _ = _producer(engine, _env(), tiny_model_dir)
    rollout = producer.sample([_row()], 1)

    replies, reward = _raw_game(moves)
    assert replies[1].startswith("You attempted an invalid move.") and "[number]" in replies[1]
    assert reward == pytest.approx(1 - 1 / 9)  # the game's partial credit: its last guess was 1 away
    assert len(engine.calls) == 3  # the game went on after the first invalid move, not after the second
    assert rollout.rewards.tolist() == [pytest.approx(reward)] and rollout.correct.tolist() == [0.0]
    assert rollout.truncated.tolist() == [False]

    episode = _env().spawn()
    episode.reset(_row())
    results = [episode.step(m) for m in moves]
    assert [r.observation for r in results[:2]] == replies and results[2].done and not results[1].done
    assert (episode.moves, episode.invalid_moves, episode.finished, episode.won) == (3, 2, True, False)
    assert "Invalid" in episode.outcome


# ------------------------------------------------------------------------------------- seeds
def test_the_same_seed_is_the_same_game_and_another_seed_another(tiny_model_dir):
    def replies(seed: int) -> list[str]:
        episode = _env().spawn()
        episode.reset(_row(seed))
        return [episode.step(f"[{k}]").observation for k in (5, 3, 8)]

    assert replies(SEED) == replies(SEED)
    assert len({tuple(replies(s)) for s in range(8)}) > 1  # the number differs between seeds
    # The game draws from its own generator state: the trainer's random stream is untouched, however episodes
    # interleave.
    random.seed(123)
    expected = random.random()
    random.seed(123)
    a, b = _env().spawn(), _env().spawn()
    a.reset(_row(1))
    b.reset(_row(2))
    a.step("[5]")
    b.step("[5]")
    assert random.random() == expected


def test_episodes_stepped_at_once_play_as_one_after_another():
    """Eight games stepped on threads (the guard's max_concurrency) answer as the same games stepped in turn."""
    env = _env(max_concurrency=8)

    def replies(at_once: bool) -> list[str]:
        episodes = [env.spawn() for _ in range(8)]
        for seed, episode in enumerate(episodes):
            episode.reset(_row(seed))
        if at_once:
            return [r.observation for r in EpisodeGuard(env).step_all([(e, "[5]") for e in episodes])]
        return [e.step("[5]").observation for e in episodes]

    assert replies(True) == replies(False)


def test_seeded_rows_hold_out_seeds_that_training_never_sees():
    task = SeededTask(train_size=50, val_size=10, instruction="Play.", data_source="GuessTheNumber-v0")
    train, val = task.splits()
    assert [r["seed"] for r in train] == list(range(50)) and [r["seed"] for r in val] == list(range(10**6, 10**6 + 10))
    assert train[0] == {"prompt": "Play.", "answer": "", "seed": 0, "data_source": "GuessTheNumber-v0"}
    with pytest.raises(RecipeError, match="overlap"):
        SeededTask(train_size=100, val_size=10, val_seed=95)


# ------------------------------------------------------------------------------------- settings
def test_a_missing_textarena_is_one_line_with_the_install_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "textarena", None)
    with pytest.raises(RecipeError) as err:
        TextArena()
    assert "bash tools/install.sh textarena (in the rllight clone" in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize(("game", "args", "key"), [
    ("NoSuchGame-v0", None, "init_args.game:"),
    ("TicTacToe-v0", None, "init_args.game:"),  # two players
    ("GuessTheNumber-v0", {"maximum": 5}, "init_args.game_args:"),
])
def test_bad_game_settings_are_one_line_naming_the_key(game, args, key):
    with pytest.raises(RecipeError) as err:
        TextArena(game, args)
    message = str(err.value)
    assert message.startswith(f"model.environment.{key}") and "\n" not in message
    assert "GuessTheNumber-v0" in message  # what to use instead


def test_a_row_without_a_seed_fails_its_episode_naming_the_data_task():
    with pytest.raises(TypeError, match="SeededTask"):
        _env().spawn().reset({"messages": [], "answer": ""})


# ------------------------------------------------------------------------------------- the recipe
def test_the_recipe_trains_two_steps_on_the_tiny_model(tmp_path, tiny_model_dir):
    """The recipe's environment, seeded rows and GroupSampler (G = 8) on the tiny model: every rollout is games
    played to their end or to the context limit, and no call into a game failed."""
    recipe = os.path.join(RECIPES, "env-textarena-guess.yaml")
    cli = build(recipe, tiny_overrides(tmp_path, tiny_model_dir), "--trainer.max_steps", "2",
                "--model.batching.minibatch_size", "null", "--model.environment.init_args.max_total_tokens", "512",
                "--data.task", "{class_path: rllight.data.seeded.SeededTask, init_args: {train_size: 16, val_size: 4}}")
    assert isinstance(cli.model.producer.environment, TextArena)
    seen = fit_recording_rollouts(cli)
    assert len(seen) == 2
    for rollout in seen:
        assert len(rollout) == 2 * 8 and (rollout.context_mask >= rollout.response_mask).all()
    metrics = cli.trainer.callback_metrics
    assert 1.0 <= float(metrics["train/episode/turns_mean"]) <= 8
    assert float(metrics.get("train/episode/failures", 0.0)) == 0.0
