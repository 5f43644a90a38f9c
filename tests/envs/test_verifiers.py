"""verifiers' environments played in process (``rllight.envs.verifiers_env``): a scripted policy plays them end to end
through the rollout producer, token in and token out; the environment's reply is what the model sees next, its
rubric's score the reward; the data source gives the environment's tasks; episodes stepped at once keep their own
state; a raising environment costs its episode; tools run; verifiers' own TextArena environment plays offline."""

import gc
import random
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("verifiers.v1")

import verifiers_fixtures as fx
from test_environments import ScriptedEngine, _producer, _tokenizer

from rllight.data.module import RLDataModule
from rllight.data.verifiers_data import VerifiersTask
from rllight.envs.verifiers_env import Verifiers, load_source
from rllight.errors import RecipeError
from rllight.rollout.producer import encode_chat

WORDS = "verifiers_fixtures:load_environment"
INSTALL = "bash tools/install.sh verifiers (in the rllight clone"


def _rows(load: str = WORDS, **args) -> dict[str, dict]:
    """The environment's training rows by answer, with the ``messages`` the datamodule would add."""
    train, _ = VerifiersTask(load=load, args=args).splits()
    return {row["answer"]: {**row, "messages": row["prompt"]} for row in train}


def _ids(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def _feedback_ids(tok, word: str) -> list[int]:
    """What the template puts after a model turn that ended with its end token: the rest of the closing, the
    environment's feedback as a user turn, the next assistant opening."""
    feedback = fx.FEEDBACK.format(word=word)
    return _ids(tok, f"\n<|im_start|>user\n{feedback}<|im_end|>\n<|im_start|>assistant\n")


# ------------------------------------------------------------------------------ end to end
def test_a_scripted_policy_plays_the_environment_end_to_end_token_in_token_out(tiny_model_dir):
    """Turn 1 says "no": the environment answers with feedback, which is what the model sees next; turn 2 says the
    word: the environment ends the episode (done, two of four turns used), its rubric's 1 is the reward, and the
    trained tokens are exactly the sampled ones."""
    row, (_, tok) = _rows()["stone"], _tokenizer(tiny_model_dir)
    eos = tok.eos_token_id
    no, stone = _ids(tok, "no") + [eos], _ids(tok, "stone") + [eos]
    engine = ScriptedEngine([no, stone, no, no], eos)
    producer, _ = _producer(engine, Verifiers(load=WORDS, max_turns=4, max_total_tokens=400), tiny_model_dir)
    rollout = producer.sample([row], 1)

    prompt, feedback = encode_chat(tok, row["messages"]), _feedback_ids(tok, "stone")
    assert len(engine.calls) == 2  # done came from the environment
    assert engine.calls[1] == [prompt + no + feedback]  # the environment's reply, as the template renders it
    n = len(no) + len(feedback) + len(stone)
    assert rollout.response_ids[0, :n].tolist() == no + feedback + stone
    assert rollout.response_mask[0, :n].tolist() == [1] * len(no) + [0] * len(feedback) + [1] * len(stone)
    assert rollout.response_mask[0].sum() == len(no) + len(stone)  # trained: the sampled ids, nothing else
    assert rollout.rewards.tolist() == [1.0] and rollout.correct.tolist() == [1.0]
    assert rollout.truncated.tolist() == [False]


def test_the_environment_ends_an_episode_as_done_and_rllight_limits_end_it_as_truncated(tiny_model_dir):
    """The model never says the word. With ``attempts`` 3 and ``max_turns`` 4 the environment ends the episode at
    its third attempt (done, reward 0, not truncated); with ``max_turns`` 2 rllight ends it first: truncated, and
    the verifiers trace is stopped as ``max_turns`` and scored (0)."""
    rows, (_, tok) = _rows(), _tokenizer(tiny_model_dir)
    for max_turns, calls, truncated in ((4, 3, False), (2, 2, True)):
        engine = ScriptedEngine([_ids(tok, "no") + [tok.eos_token_id]] * 4, tok.eos_token_id)
        producer, _ = _producer(engine, Verifiers(load=WORDS, max_turns=max_turns, max_total_tokens=400),
                                tiny_model_dir)
        rollout = producer.sample([rows["river"]], 1)
        assert len(engine.calls) == calls and rollout.truncated.tolist() == [truncated]
        assert rollout.rewards.tolist() == [0.0] and rollout.extras["episode/failures"] == 0.0

    episode = Verifiers(load=WORDS, max_turns=1).spawn()
    episode.reset(rows["river"])
    assert not episode.step("no").done
    assert episode.trajectory_reward([0.0]) == 0.0
    assert episode._play.exchange.trace.stop_condition == "max_turns"

    # An episode dropped unfinished (its prompt too long for the batch, or failed) leaves nothing waiting on the loop.
    episode = Verifiers(load=WORDS).spawn()
    episode.reset(rows["river"])
    play = episode._play
    del episode
    gc.collect()
    deadline = time.monotonic() + 10
    while not play.exchange.closed and time.monotonic() < deadline:  # the loop runs the cancellation
        time.sleep(0.01)
    assert play.future.cancelled() and play.exchange.closed and play.exchange.trace.rewards == {}


# ------------------------------------------------------------------------------ data
def test_the_data_source_gives_the_environments_tasks_as_rows():
    train, val = VerifiersTask(load=WORDS, train_size=3, val_size=2).splits()
    assert [row["answer"] for row in val] == fx.WORDS[:2] and [row["answer"] for row in train] == fx.WORDS[2:5]
    row = train[0]
    assert row["prompt"] == [{"role": "system", "content": fx.SYSTEM},
                             {"role": "user", "content": "Say the word 'stone'."}]
    assert row["data_source"] == WORDS
    source = load_source(WORDS, None, {}, "test")
    assert source.task(row).data == list(source.taskset)[2].data  # the row rebuilds the task its rubric scores

    data = RLDataModule(task=VerifiersTask(load=WORDS, val_size=2), batch_size=2)
    data.setup()
    assert [r["answer"] for r in data.train_rows] == fx.WORDS[2:] and len(data.val_rows) == 2
    assert data.train_rows[0]["messages"] == data.train_rows[0]["prompt"]


def test_an_endless_taskset_needs_train_size():
    with pytest.raises(RecipeError, match=r"data\.task\.init_args\.train_size: TextArenaTaskset has no end"):
        VerifiersTask(load="verifiers_fixtures:load_textarena").splits()


# ------------------------------------------------------------------------------ concurrency and faults
def test_episodes_stepped_at_once_keep_their_own_state(tiny_model_dir):
    """Twelve episodes (six words, two each) step on the guard's threads at once: each sees the feedback naming its
    own word, and each is scored on its own task (stone at turn 2, apple at turn 3, the rest never)."""
    rows, (_, tok) = _rows(), _tokenizer(tiny_model_dir)
    eos = tok.eos_token_id
    no = _ids(tok, "no") + [eos]
    engine = ScriptedEngine([no, _ids(tok, "stone") + [eos], _ids(tok, "apple") + [eos]], eos)
    producer, _ = _producer(engine, Verifiers(load=WORDS, max_turns=3, max_total_tokens=400, max_concurrency=8),
                            tiny_model_dir)
    words = list(rows)
    rollout = producer.sample([rows[w] for w in words], 2)
    second = [w for w in words for _ in range(2)]
    for context, word in zip(engine.calls[1], second):
        assert context[-len(no) - len(_feedback_ids(tok, word)):] == no + _feedback_ids(tok, word)
    assert rollout.rewards.tolist() == [1.0 if w in ("stone", "apple") else 0.0 for w in second]
    assert rollout.extras["episode/failures"] == 0.0

    # Directly on threads too: each episode's trace holds its own replies only.
    episodes = [Verifiers(load=WORDS, max_turns=3).spawn() for _ in range(16)]
    for k, episode in enumerate(episodes):
        episode.reset(rows[words[k % len(words)]])
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda k: episodes[k].step(f"{words[k % len(words)]} {k}"), range(16)))
    assert all(r.done and r.reward == 1.0 for r in results)
    assert [e._play.exchange.trace.last_reply for e in episodes] == [f"{words[k % len(words)]} {k}" for k in range(16)]


def test_an_environment_that_raises_costs_its_episode_counted_and_the_run_goes_on(tiny_model_dir):
    """The environment raises on "boom stone" for every word but stone: that episode gets 0, counted; the stone
    episode is scored; the next batch plays as usual."""
    rows, (_, tok) = _rows(), _tokenizer(tiny_model_dir)
    eos = tok.eos_token_id
    engine = ScriptedEngine([_ids(tok, "boom stone") + [eos], _ids(tok, "apple") + [eos]], eos)
    producer, _ = _producer(engine, Verifiers(load=WORDS, max_turns=3, max_total_tokens=400), tiny_model_dir)
    rollout = producer.sample([rows["stone"], rows["apple"]], 1)
    assert rollout.rewards.tolist() == [1.0, 0.0]
    assert rollout.extras["episode/failures"] == 1.0 and producer.reward_failures == 1
    assert producer.sample([rows["apple"]], 1).rewards.tolist() == [1.0]


# ------------------------------------------------------------------------------ kinds of environment
def test_an_environment_that_opens_the_conversation_adds_its_message_to_the_prompt():
    row = _rows(opening=True)["river"]
    assert row["prompt"] == [{"role": "system", "content": fx.SYSTEM}, {"role": "user", "content": ""}]
    episode = Verifiers(load=WORDS, args={"opening": True}).spawn()
    assert episode.reset(row) == "Say the word 'river'."
    result = episode.step("river")
    assert result.done and result.reward == 1.0
    assert [m.role for m in episode._play.exchange.trace.messages] == ["system", "user", "assistant"]


def test_a_plain_taskset_plays_one_answer_and_a_tool_server_runs_in_process():
    single = Verifiers(load="verifiers_fixtures:load_taskset").spawn()
    assert single.reset(_rows("verifiers_fixtures:load_taskset")["maple"]) is None and single.tools() is None
    result = single.step("maple")
    assert result.done and result.reward == 1.0 and result.correct

    row = _rows("verifiers_fixtures:load_tool_taskset")["tiger"]
    episode = Verifiers(load="verifiers_fixtures:load_tool_taskset").spawn()
    assert episode.reset(row) is None
    (schema,) = episode.tools()
    assert schema["function"]["name"] == "speller_spell" and schema["function"]["parameters"]["required"] == ["word"]
    call = '<tool_call>{"name": "speller_spell", "arguments": {"word": "tiger"}}</tool_call>'
    result = episode.step(call)
    assert not result.done and result.observation == [
        {"role": "tool", "content": "T-I-G-E-R", "tool_call_id": "call_1_0", "name": "speller_spell"}]
    wrong = episode.step('<tool_call>{"name": "nope", "arguments": {}}</tool_call>').observation
    assert wrong[0]["content"] == "error: no tool named 'nope' (tools: speller_spell)"
    result = episode.step("T-I-G-E-R")
    assert result.done and result.reward == 1.0


def test_verifiers_textarena_environment_plays_guess_the_number_offline():
    """verifiers' TextArena environment (its ``run`` steps the game engine) on a GuessTheNumber task: a wrong guess
    gets the game's hint, the right one wins (reward 1). Its own taskset's games need downloaded word lists, so
    the task is made here as its taskset makes one."""
    ta = pytest.importorskip("textarena")
    from verifiers.v1.tasksets.textarena import TextArenaData, TextArenaTask
    from verifiers.v1.tasksets.textarena.taskset import SYSTEM_PROMPT

    state = random.getstate()
    try:
        random.seed(5)
        game = ta.make(env_id="GuessTheNumber-v0")
        game.reset(num_players=1)
        secret, prompt = game.state.game_state["game_number"], str(game.get_observation()[1])
        load = "verifiers_fixtures:load_textarena"
        task = TextArenaTask(TextArenaData(name="GuessTheNumber-v0#5", prompt=prompt, system_prompt=SYSTEM_PROMPT,
                                           info={"game": "GuessTheNumber-v0", "seed": 5}))
        row = load_source(load, None, {}, "test").row(task)
        episode = Verifiers(load=load).spawn()
        assert episode.reset(row) is None
        low = 1 if secret > 1 else 2
        hint = episode.step(f"I guess [{low}]")
        assert not hint.done and ("higher" if low < secret else "lower") in hint.observation.lower()
        result = episode.step(f"[{secret}]")
        assert result.done and result.reward == 1.0 and result.correct
    finally:
        random.setstate(state)


# ------------------------------------------------------------------------------ settings
def test_without_verifiers_a_recipe_fails_in_one_line_with_the_install_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "verifiers", None)
    for make in (lambda: Verifiers(load=WORDS), lambda: VerifiersTask(load=WORDS)):
        with pytest.raises(RecipeError) as err:
            make()
        assert INSTALL in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("settings, message", [
    ({}, r"model\.environment\.init_args: give exactly one of load"),
    ({"load": WORDS, "env_id": "textarena"}, r"model\.environment\.init_args: give exactly one of load"),
    ({"load": "no_module_path"}, r"model\.environment\.init_args\.load must be an import path"),
    ({"load": WORDS, "args": [3]}, r"model\.environment\.init_args\.args must be a mapping"),
    ({"load": WORDS, "solved_at": "all"}, r"model\.environment\.init_args\.solved_at must be a number"),
])
def test_bad_settings_are_one_line_naming_the_setting(settings, message):
    with pytest.raises(RecipeError, match=message):
        Verifiers(**settings)


def test_an_environment_that_cannot_be_built_is_one_line_naming_it():
    with pytest.raises(RecipeError, match=r"data\.task\.init_args: the verifiers environment "
                                          r"load='verifiers_fixtures:no_such' .*AttributeError"):
        VerifiersTask(load="verifiers_fixtures:no_such").splits()
    with pytest.raises(RecipeError, match=r"env_id='no-such-taskset'.*ModuleNotFoundError"):
        VerifiersTask(env_id="no-such-taskset").splits()
