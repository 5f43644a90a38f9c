"""Multi-turn environments: episodes are token in, token out; the masks mark the model's tokens; the limits
stop and count; the embedded environments score as documented; the calculator's parser refuses what it must;
the environment recipes train with the group samplers unchanged."""

import json
import os
import threading
import time
from fractions import Fraction
from typing import ClassVar

import pytest
import torch
from conftest import RECIPES
from helpers import build, fit_recording_rollouts, recorded_samples, tiny_overrides, unchanged_parameters

from rllight.envs import ArithmeticFeedback, CalcError, Calculator, Environment, StepResult, evaluate, format_number
from rllight.errors import ComponentError, RecipeError
from rllight.models import HFModel
from rllight.module import RLModule
from rllight.rewards import IntegerMatch
from rllight.rollout import HFEngine
from rllight.rollout.base import Generation, RolloutEngine, pad_left
from rllight.rollout.episodes import ChatTurns
from rllight.rollout.producer import RolloutProducer, encode_chat

QUESTION = [{"role": "user", "content": "What is 1 + 2?"}]
ROW = {"messages": QUESTION, "answer": "3"}
FEEDBACK = "That is not correct. Try again."


class ScriptedEngine(RolloutEngine):
    """Answers call c of ``generate`` with ``script[c]`` for every prompt (ids, end token included or not);
    log-prob -0.5 on every token. Records the prompts of each call."""

    def __init__(self, script: list[list[int]], eos: int):
        super().__init__(max_new_tokens=max(len(s) for s in script))
        self.script, self.eos, self.calls = script, eos, []

    def generate(self, model, tokenizer, prompts, sampling):
        ids = self.script[len(self.calls)]
        self.calls.append([list(p) for p in prompts])
        b, t = len(prompts), len(ids)
        prompt_ids, prompt_mask = pad_left(prompts, tokenizer.pad_token_id)
        return Generation(prompt_ids, prompt_mask, torch.tensor([ids] * b), torch.ones(b, t, dtype=torch.long),
                          torch.full((b, t), -0.5), torch.tensor([ids[-1] != self.eos] * b))


class Endless(Environment):
    """Never done: replies "go on" to every turn; reward 1 per turn (summed)."""

    def step(self, response_text):
        return StepResult("go on", 1.0, done=False)


class DigitFeedback(Environment):
    """Reward of a turn: the share of digits in it; the episode goes on to ``max_turns``, and the trajectory's
    reward is the last turn's. A random model's episodes differ, so groups are mixed."""

    def __init__(self, max_turns: int = 2, max_total_tokens: int = 200):
        super().__init__(max_turns=max_turns, max_total_tokens=max_total_tokens)
        self.turn = 0

    def reset(self, row):
        self.turn = 0

    def step(self, response_text):
        self.turn += 1
        share = sum(c.isdigit() for c in response_text) / max(len(response_text), 1) + 0.01 * len(response_text)
        done = self.turn >= self.max_turns
        return StepResult(None if done else "more", share, done=done, correct=share > 0.1)

    def trajectory_reward(self, rewards):
        return rewards[-1]


def _tokenizer(model_dir):
    return HFModel(model_dir).load()


def _producer(engine, env, model_dir):
    policy, tok = _tokenizer(model_dir)
    producer = RolloutProducer(engine, IntegerMatch(), environment=env)
    producer.bind(policy, tok)
    return producer, tok


# ------------------------------------------------------------------------------ chat-template ids
def _observation_ids_match_the_template(tok):
    turns = ChatTurns(tok)
    prompt = encode_chat(tok, QUESTION)
    eos = tok.eos_token_id
    # A finished turn (end token sampled) and a turn cut by the length limit (no end token).
    for sampled, content in ((tok.encode("4", add_special_tokens=False) + [eos], "4"),
                             (tok.encode("4", add_special_tokens=False), "4")):
        ids = prompt + sampled + turns.between(sampled, FEEDBACK)
        conversation = [*QUESTION, {"role": "assistant", "content": content}, {"role": "user", "content": FEEDBACK}]
        assert ids == encode_chat(tok, conversation)  # what the template renders for the whole conversation
        assert ids[: len(prompt) + len(sampled)] == prompt + sampled  # the model's ids are kept as sampled


def test_observation_ids_are_the_template_render_on_the_tiny_tokenizer(tiny_model_dir):
    _, tok = _tokenizer(tiny_model_dir)
    _observation_ids_match_the_template(tok)
    turns = ChatTurns(tok)
    assert turns.close_text == "<|im_end|>\n"
    assert turns.observation_text("hi") == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert turns.observation_text("7", role="tool") == "<|im_start|>tool\n7<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.slow
def test_observation_ids_are_the_template_render_on_the_quickstart_tokenizer():
    """SmolLM2's template inserts a default system message before the first turn: it must not reappear
    before an observation."""
    from transformers import AutoTokenizer

    from rllight.models import SmolLM2Package, smollm2_folder

    # The package's own tokenizer, read from the GGUF file as the conversion reads it (without converting the
    # weights, which takes seconds more).
    tok = AutoTokenizer.from_pretrained(smollm2_folder(), gguf_file=SmolLM2Package.GGUF)
    _observation_ids_match_the_template(tok)
    text = ChatTurns(tok).observation_text(FEEDBACK)
    assert text == f"<|im_start|>user\n{FEEDBACK}<|im_end|>\n<|im_start|>assistant\n" and "system" not in text


# ------------------------------------------------------------------------------ token in, token out
def test_a_hand_built_two_turn_episode_has_the_masks_worked_out_by_hand(tiny_model_dir):
    """Turn 1 answers 4 (wrong: feedback), turn 2 answers 3 (right). The response region is
    [4, <|im_end|>] [observation] [3, <|im_end|>]: model tokens at both turns, context everywhere."""
    _, tok = _tokenizer(tiny_model_dir)
    eos = tok.eos_token_id
    four, three = tok.encode("4", add_special_tokens=False), tok.encode("3", add_special_tokens=False)
    assert len(four) == len(three) == 1  # single digits are single tokens of the tiny BPE
    engine = ScriptedEngine([four + [eos], three + [eos]], eos)
    env = ArithmeticFeedback(max_turns=3, turn_discount=0.5)
    producer, _ = _producer(engine, env, tiny_model_dir)
    rollout = producer.sample([ROW], 1)

    # The observation: the rest of turn 1's closing ("\n" after the sampled <|im_end|>), the user turn and the
    # next assistant opening, as the template's text tokenises.
    obs = tok.encode(f"\n<|im_start|>user\n{FEEDBACK}<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
    k = len(obs)
    assert rollout.response_ids[0].tolist() == four + [eos] + obs + three + [eos]
    assert rollout.response_mask[0].tolist() == [1, 1] + [0] * k + [1, 1]
    assert rollout.context_mask[0].tolist() == [1] * (k + 4)
    assert rollout.sample_logprobs[0].tolist() == [-0.5, -0.5] + [0.0] * k + [-0.5, -0.5]
    assert rollout.prompt_ids[0].tolist() == encode_chat(tok, QUESTION)
    # The second call generated on prompt + turn 1 as sampled + observation: no text went back through the tokenizer.
    assert engine.calls[1] == [encode_chat(tok, QUESTION) + four + [eos] + obs]
    assert rollout.rewards.tolist() == [0.5]  # right at the second attempt: 0.5 ** 1
    assert rollout.correct.tolist() == [1.0] and rollout.truncated.tolist() == [False]
    assert rollout.texts == ["4\n3"]
    assert rollout.response_lengths.tolist() == [4]  # the model's tokens only
    assert rollout.last_action_index.tolist() == [k + 3]  # the outcome reward goes on the final <|im_end|>
    assert rollout.extras["episode/turns_mean"] == 2.0 and rollout.extras["episode/truncated_ratio"] == 0.0


def test_sampled_ids_are_kept_turn_by_turn_and_the_trainer_reproduces_their_logprobs(tiny_model_dir):
    """Real sampling on the tiny model (temperature 0.7), two turns each: the ids at response_mask positions are,
    turn by turn, exactly the engine's unpadded samples; the observation ids between them are the template's;
    the trainer's forward over the whole episode gives the engine's log-probs at the model's tokens."""
    torch.manual_seed(0)
    module = RLModule(HFModel(tiny_model_dir), rollout=HFEngine(max_new_tokens=5, temperature=0.7, batch_size=3))
    module.configure_model()
    tok = module.tokenizer
    producer = RolloutProducer(module.rollout, IntegerMatch(), environment=Endless(max_turns=2, max_total_tokens=200))
    producer.bind(module.policy, tok)
    rows = [{"messages": [{"role": "user", "content": "What is 1 + 2?" + " 3" * k}], "answer": "3"} for k in range(3)]
    with recorded_samples(module.rollout) as samples:
        rollout = producer.sample(rows, n=2)
    assert len(samples) == 2 and len(rollout) == 6  # one generate call per turn, over all six episodes
    turns = ChatTurns(tok)
    for i in range(6):
        mask = rollout.response_mask[i].tolist()
        ids = rollout.response_ids[i].tolist()
        first, second = samples[0][i], samples[1][i]
        a = len(first)
        between = turns.between(first, "go on")
        assert ids[:a] == first and mask[:a] == [1] * a
        assert ids[a : a + len(between)] == between and mask[a : a + len(between)] == [0] * len(between)
        rest = a + len(between)
        assert ids[rest : rest + len(second)] == second and mask[rest : rest + len(second)] == [1] * len(second)
        assert sum(mask) == a + len(second) and rollout.context_mask[i].sum() == rest + len(second)
    assert rollout.rewards.tolist() == [2.0] * 6 and rollout.truncated.all()  # out of turns, never done
    module.scoring.score(rollout, need_old=True, need_values=False)
    mask = rollout.response_mask.bool()
    torch.testing.assert_close(rollout.old_logprobs[mask], rollout.sample_logprobs[mask], atol=1e-4, rtol=1e-4)
    assert (rollout.sample_logprobs[~mask] == 0).all()


# ------------------------------------------------------------------------------ limits
def test_max_turns_stops_and_counts_truncation(tiny_model_dir):
    _, tok = _tokenizer(tiny_model_dir)
    eos = tok.eos_token_id
    engine = ScriptedEngine([[40, eos]] * 5, eos)
    producer, _ = _producer(engine, Endless(max_turns=3, max_total_tokens=500), tiny_model_dir)
    rollout = producer.sample([ROW], 2)
    assert len(engine.calls) == 3
    assert rollout.response_mask.sum(-1).tolist() == [6, 6]  # 3 turns of 2 tokens
    assert rollout.rewards.tolist() == [3.0, 3.0] and rollout.truncated.tolist() == [True, True]
    assert rollout.extras["episode/turns_mean"] == 3.0 and rollout.extras["episode/truncated_ratio"] == 1.0
    # The last position is the last model token: no observation after the final turn.
    assert rollout.last_action_index.tolist() == [rollout.context_mask.shape[1] - 1] * 2


def test_max_total_tokens_cuts_a_turn_and_refuses_an_observation_without_room(tiny_model_dir):
    _, tok = _tokenizer(tiny_model_dir)
    eos = tok.eos_token_id
    prompt = len(encode_chat(tok, QUESTION))
    obs = len(ChatTurns(tok).between([40, eos], "go on"))
    # Room for turn 1 (2 tokens), the observation and 3 of turn 2's 4 tokens: turn 2 is cut to fit.
    limit = prompt + 2 + obs + 3
    engine = ScriptedEngine([[40, eos], [41, 42, 43, eos]], eos)
    producer, _ = _producer(engine, Endless(max_turns=5, max_total_tokens=limit), tiny_model_dir)
    rollout = producer.sample([ROW], 1)
    assert rollout.context_mask.sum().item() + prompt == limit
    assert rollout.response_ids[0, -3:].tolist() == [41, 42, 43]  # a prefix of what was sampled
    assert rollout.truncated.tolist() == [True] and rollout.extras["episode/turns_mean"] == 2.0
    # An observation that would fill the context: the episode ends after turn 1, truncated.
    engine = ScriptedEngine([[40, eos], [41, eos]], eos)
    producer, _ = _producer(engine, Endless(max_turns=5, max_total_tokens=prompt + 2 + obs), tiny_model_dir)
    rollout = producer.sample([ROW], 1)
    assert rollout.response_ids[0].tolist() == [40, eos] and rollout.truncated.tolist() == [True]
    assert len(engine.calls) == 1
    # A prompt that leaves no room for one token is dropped and counted, like an over-long prompt.
    producer, _ = _producer(ScriptedEngine([[40]], eos), Endless(max_total_tokens=prompt), tiny_model_dir)
    rollout = producer.sample([ROW], 2)
    assert len(rollout) == 0 and producer.dropped_prompts == 1
    assert rollout.extras["data/dropped_long_prompts"] == 1.0


def test_truncation_is_counted_per_trajectory(tiny_model_dir):
    """Of two prompts, one is answered right at once (done, not truncated), the other never (out of attempts:
    done by the environment, not truncated either); a cut final answer is truncated."""
    _, tok = _tokenizer(tiny_model_dir)
    eos = tok.eos_token_id
    three = tok.encode("3", add_special_tokens=False)
    rows = [ROW, {"messages": QUESTION, "answer": "5"}]
    engine = ScriptedEngine([three + [eos], three + [eos]], eos)
    producer, _ = _producer(engine, ArithmeticFeedback(max_turns=2), tiny_model_dir)
    rollout = producer.sample(rows, 1)
    assert rollout.rewards.tolist() == [1.0, 0.0] and rollout.correct.tolist() == [1.0, 0.0]
    assert rollout.truncated.tolist() == [False, False]
    assert rollout.extras["episode/turns_mean"] == 1.5  # 1 turn and 2 turns
    assert len(engine.calls[1]) == 1  # only the unsolved episode goes on
    engine = ScriptedEngine([three], eos)  # no end token: cut by max_new_tokens
    producer, _ = _producer(engine, ArithmeticFeedback(max_turns=2), tiny_model_dir)
    rollout = producer.sample(rows[:1], 1)
    assert rollout.truncated.tolist() == [True] and rollout.correct.tolist() == [1.0]


def test_a_raising_environment_costs_its_episode_and_is_counted(tiny_model_dir):
    class Broken(Environment):
        def step(self, response_text):
            raise RuntimeError("boom")

    _, tok = _tokenizer(tiny_model_dir)
    producer, _ = _producer(ScriptedEngine([[40, tok.eos_token_id]], tok.eos_token_id), Broken(), tiny_model_dir)
    rollout = producer.sample([ROW], 2, training=False)
    assert rollout.rewards.tolist() == [0.0, 0.0] and producer.reward_failures == 2
    assert rollout.extras["reward/failures"] == 2.0


class Faulty(Environment):
    """Fails in one way (``fault``) on the rows whose answer is "bad" (every row with ``always``), and answers
    reward 1, done, elsewhere."""

    def __init__(self, fault: str = "raise", timeout_seconds: float | None = 30.0, marker: str | None = None,
                 always: bool = False, max_concurrency: int = 8):
        super().__init__(max_turns=2, max_total_tokens=200, timeout_seconds=timeout_seconds,
                         max_concurrency=max_concurrency)
        self.fault, self.marker, self.always, self.bad = fault, marker, always, False

    def reset(self, row):
        self.bad = self.always or row["answer"] == "bad"
        if self.bad and self.fault == "reset":
            raise KeyError("no such task")
        return None

    def step(self, response_text):
        if not self.bad:
            return StepResult(None, 1.0, done=True, correct=True)
        if self.marker:  # the test waits for this file to know the step has started
            open(self.marker, "w").close()
        values = {"nan": float("nan"), "inf": float("inf"), "1e39": 1e39, "huge": 1e39}  # "huge": for recipes
        if self.fault in values:
            return StepResult(None, values[self.fault], done=True)
        if self.fault == "none":
            return None
        if self.fault == "no-observation":
            return StepResult(None, 0.5, done=False)
        if self.fault == "hang":
            import time
            time.sleep(600)
        raise RuntimeError("boom")


BAD_ROW = {"messages": QUESTION, "answer": "bad"}


@pytest.mark.parametrize("fault, message", [
    ("raise", "Faulty.step raised RuntimeError: boom"),
    ("reset", "Faulty.reset raised KeyError: 'no such task'"),
    ("none", "Faulty.step returned NoneType, not a StepResult"),
    ("nan", "Faulty.step gave reward nan, which is not finite in float32"),
    ("inf", "Faulty.step gave reward inf, which is not finite in float32"),
    ("1e39", "Faulty.step gave reward 1e+39, which is not finite in float32"),
    ("no-observation", "Faulty.step returned done=False with no observation"),
])
def test_a_faulty_episode_gets_reward_0_is_counted_and_named_and_the_others_go_on(fault, message, tiny_model_dir,
                                                                                  caplog):
    _, tok = _tokenizer(tiny_model_dir)
    producer, _ = _producer(ScriptedEngine([[40, tok.eos_token_id]], tok.eos_token_id), Faulty(fault), tiny_model_dir)
    rollout = producer.sample([ROW, BAD_ROW], 2)
    assert rollout.rewards.tolist() == [1.0, 1.0, 0.0, 0.0]  # the healthy row's episodes keep their reward
    assert rollout.correct.tolist() == [1.0, 1.0, 0.0, 0.0]
    assert rollout.extras["episode/failures"] == 2.0 and rollout.extras["reward/failures"] == 2.0
    assert rollout.extras["episode/timeouts"] == 0.0
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1  # one line per batch, not one per episode
    assert warnings[0].startswith("the environment Faulty failed on 2 of 4 episode(s)") and message in warnings[0]
    assert "IntegerMatch" not in warnings[0]


def test_a_hanging_environment_times_out_and_a_batch_stops_calling_it_after_three(tiny_model_dir):
    """Stepped one at a time (max_concurrency 1), every episode of the bad row hangs: each of the first three costs
    the 0.5 s timeout, the fourth is not called (three timeouts in a row); the healthy row's episodes are scored."""
    _, tok = _tokenizer(tiny_model_dir)
    env = Faulty("hang", timeout_seconds=0.5, max_concurrency=1)
    producer, _ = _producer(ScriptedEngine([[40, tok.eos_token_id]], tok.eos_token_id), env, tiny_model_dir)
    rollout = producer.sample([ROW, BAD_ROW], 4)
    assert rollout.rewards.tolist() == [1.0] * 4 + [0.0] * 4
    assert rollout.extras["episode/failures"] == 4.0 and rollout.extras["episode/timeouts"] == 3.0  # not four


def test_episodes_step_at_once_up_to_the_environments_limit(tiny_model_dir):
    """With max_concurrency 8 the four hanging episodes of the bad row time out together (four timeouts, counted),
    and a sleeping environment is stepped by as many episodes at once as the limit allows, results in order."""
    _, tok = _tokenizer(tiny_model_dir)
    producer, _ = _producer(ScriptedEngine([[40, tok.eos_token_id]], tok.eos_token_id),
                            Faulty("hang", timeout_seconds=0.5), tiny_model_dir)
    rollout = producer.sample([ROW, BAD_ROW], 4)
    assert rollout.rewards.tolist() == [1.0] * 4 + [0.0] * 4
    assert rollout.extras["episode/failures"] == 4.0 and rollout.extras["episode/timeouts"] == 4.0
    for limit, expected in ((3, 3), (1, 1), (16, 8)):
        Sleepy.reset_counts()
        producer, _ = _producer(ScriptedEngine([[40, tok.eos_token_id]], tok.eos_token_id),
                                Sleepy(max_concurrency=limit), tiny_model_dir)
        rollout = producer.sample([ROW, ROW], 4)
        assert rollout.rewards.tolist() == [1.0] * 8 and rollout.extras["episode/failures"] == 0.0
        assert Sleepy.most["step"] == expected, (limit, Sleepy.most)
        assert Sleepy.most["reset"] == expected, (limit, Sleepy.most)  # resets too


class Sleepy(Environment):
    """Each reset and each step sleeps 0.2 s; a step ends the episode with reward 1. Counts how many steps, and
    how many resets, run at once (``most["step"]``, ``most["reset"]``)."""

    running: ClassVar[dict[str, int]] = {"step": 0, "reset": 0}
    most: ClassVar[dict[str, int]] = {"step": 0, "reset": 0}
    lock = threading.Lock()

    def __init__(self, max_concurrency: int = 8):
        super().__init__(max_turns=1, max_total_tokens=200, timeout_seconds=10.0, max_concurrency=max_concurrency)

    @classmethod
    def reset_counts(cls):
        cls.running, cls.most = {"step": 0, "reset": 0}, {"step": 0, "reset": 0}

    @classmethod
    def sleep_counted(cls, call: str) -> None:
        with cls.lock:
            cls.running[call] += 1
            cls.most[call] = max(cls.most[call], cls.running[call])
        time.sleep(0.2)
        with cls.lock:
            cls.running[call] -= 1

    def reset(self, row):
        Sleepy.sleep_counted("reset")

    def step(self, response_text):
        Sleepy.sleep_counted("step")
        return StepResult(observation=None, reward=1.0, done=True)


def test_an_environment_failing_on_every_episode_stops_the_run_naming_it_not_the_reward(tiny_model_dir):
    _, tok = _tokenizer(tiny_model_dir)
    producer, _ = _producer(ScriptedEngine([[40, tok.eos_token_id]] * 3, tok.eos_token_id), Faulty("nan"),
                            tiny_model_dir)
    producer.sample([BAD_ROW], 2)
    producer.sample([BAD_ROW], 2)
    with pytest.raises(ComponentError) as err:
        producer.sample([BAD_ROW], 2)
    line = str(err.value)
    assert line.startswith("model.environment: Faulty failed on every episode of 3 batches in a row (last: "
                           "Faulty.step gave reward nan")
    assert "IntegerMatch" not in line and "model.reward" not in line and "\n" not in line


@pytest.mark.parametrize("fault, last", [("reset", "Faulty.reset raised KeyError: 'no such task'"),
                                         ("none", "Faulty.step returned NoneType, not a StepResult"),
                                         ("huge", "Faulty.step gave reward 1e+39, which is not finite in float32")])
def test_an_environment_that_always_fails_ends_the_cli_with_one_line_and_exit_2(fault, last, tmp_path, capsys,
                                                                               tiny_model_dir):
    from rllight.app.cli import main

    env = {"class_path": "test_environments.Faulty", "init_args": {"fault": fault, "always": True}}
    overlay = tiny_overrides(tmp_path, tiny_model_dir, environment=env)
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", os.path.join(RECIPES, "grpo.yaml"), "--config", overlay, "--trainer.max_steps", "5"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "Traceback" not in "\n".join(err)
    assert err[-1] == (f"rllight: error: model.environment: Faulty failed on every episode of 3 batches in a row "
                       f"(last: {last}); fix the environment (model.guards.max_failed_reward_steps sets how many "
                       "batches are tolerated)")


def test_environment_timeout_setting_is_checked():
    with pytest.raises(RecipeError, match=r"^ArithmeticFeedback\.timeout_seconds must be a finite number > 0 or null, "
                                          r"got 0$"):
        ArithmeticFeedback(timeout_seconds=0)
    assert Calculator(timeout_seconds=None).timeout_seconds is None
    assert ArithmeticFeedback().timeout_seconds == Environment.DEFAULT_TIMEOUT == 30.0


# ------------------------------------------------------------------------------ the embedded environments
def test_arithmetic_feedback_rewards_and_attempts():
    env = ArithmeticFeedback(max_turns=3, turn_discount=0.8).spawn()
    assert env.reset({"answer": "12"}) is None
    assert env.step("It is 11.") == StepResult(FEEDBACK, 0.0, done=False, correct=False)
    assert env.step("I think 13") == StepResult(FEEDBACK, 0.0, done=False, correct=False)
    result = env.step("12")
    assert result.done and result.correct and result.reward == pytest.approx(0.64)  # 0.8 ** 2
    env.reset({"answer": "12"})
    assert [env.step("1").done for _ in range(3)] == [False, False, True]  # out of attempts: done, reward 0
    assert env.trajectory_reward([0.0, 0.0, 0.64]) == pytest.approx(0.64)


def test_spawned_episodes_do_not_share_state():
    env = ArithmeticFeedback(max_turns=3)
    a, b = env.spawn(), env.spawn()
    a.reset({"answer": "1"}), b.reset({"answer": "2"})
    a.step("0")
    assert (a.turn, b.turn, a.answer, b.answer) == (1, 0, "1", "2")
    assert a.max_turns == b.max_turns == 3


def test_calculator_answers_tool_calls_and_scores_the_final_answer():
    env = Calculator(max_turns=3).spawn()
    assert "<calc>" in env.reset({"answer": "84"})
    assert env.step("Let me compute <calc>12*(3+4)</calc>") == StepResult("<result>84</result>", 0.0, done=False)
    assert env.step("<calc>7/2</calc>").observation == "<result>3.5</result>"
    assert env.step("<calc>2**8</calc>").observation == "<result>error: unexpected '*'</result>"
    assert env.step("<calc>__import__('os')</calc>").observation == "<result>error: unexpected character '_'</result>"
    assert env.step("The answer is 84.") == StepResult(None, 1.0, done=True, correct=True)
    assert env.step("85") == StepResult(None, 0.0, done=True, correct=False)


def test_calculator_parser_values():
    assert evaluate("12*(3+4)") == 84
    assert evaluate("1 + 2 * 3 - 4 / 2") == 5  # precedence: 1 + 6 - 2
    assert evaluate("(1 + 2) * 3") == 9
    assert evaluate("-3 - -2") == -1 and evaluate("+4") == 4 and evaluate("-(2 + 3) * 2") == -10
    assert evaluate("10 / 4") == Fraction(5, 2) and evaluate("0.5 * 3") == Fraction(3, 2)
    assert evaluate("8 / 2 / 2") == 2  # left-associative
    assert evaluate("2 - 3 - 4") == -5
    assert format_number(Fraction(84)) == "84" and format_number(Fraction(-7, 2)) == "-3.5"
    assert format_number(Fraction(1, 3)) == "0.333333" and format_number(Fraction(-1, 10**9)) == "0"


@pytest.mark.parametrize("text, reason", [
    ("x + 1", "unexpected character 'x'"),
    ("abs(-3)", "unexpected character 'a'"),
    ("__import__('os').system('ls')", "unexpected character '_'"),
    ("2 ** 10", "unexpected '*'"),
    ("9 ** 9 ** 9", "unexpected '*'"),
    ("2 ^ 3", "unexpected character '^'"),
    ("1; 2", "unexpected character ';'"),
    ("(1 + 2", "unexpected end of expression"),
    ("1 + 2)", "unexpected ')'"),
    ("", "empty expression"),
    ("1 / (2 - 2)", "division by zero"),
    ("1" * 31, "number too long"),
    ("999999 * 999999 * 999999", "number too large"),  # 1e18 > 1e12
    ("1 / 3 / 3 / 3 / 3 / 3 / 3 / 3 / 3 / 3 / 3 / 3 / 3 / 3 / 3 / 3 / 3 / 3 / 3 / 3 / 3 / 3 / 3 / 3 / 3 / 3 / 3",
     "number too small"),  # 3^26 > 1e12
    ("(" * 21 + "1" + ")" * 21, "expression nested too deeply"),
    ("-" * 21 + "1", "expression nested too deeply"),
    ("(" * 5000 + "1" + ")" * 5000, "expression longer than 200 characters"),
])
def test_calculator_parser_refuses(text, reason):
    with pytest.raises(CalcError) as err:
        evaluate(text)
    assert str(err.value) == reason


def test_calculator_limits_are_settings():
    assert evaluate("(" * 21 + "1" + ")" * 21, max_depth=21) == 1
    assert evaluate("999999 * 999999 * 999999", max_magnitude=10**18) == 999999**3
    with pytest.raises(CalcError, match="longer than 5"):
        evaluate("1 + 2 + 3", max_chars=5)


@pytest.mark.parametrize("make, message", [  # a call from Python names Class.parameter (a recipe: its key)
    (lambda: ArithmeticFeedback(max_turns=0), "ArithmeticFeedback.max_turns must be an integer >= 1, got 0"),
    (lambda: ArithmeticFeedback(max_total_tokens=1), "ArithmeticFeedback.max_total_tokens must be an integer >= 2, "
                                                     "got 1"),
    (lambda: ArithmeticFeedback(turn_discount=0.0), "ArithmeticFeedback.turn_discount must be a number in (0, 1], "
                                                    "got 0.0"),
    (lambda: ArithmeticFeedback(turn_discount=1.5), "ArithmeticFeedback.turn_discount must be a number in (0, 1], "
                                                    "got 1.5"),
    (lambda: Calculator(max_depth=0), "Calculator.max_depth must be an integer >= 1, got 0"),
    (lambda: Calculator(max_concurrency=True), "Calculator.max_concurrency must be an integer >= 1, got True"),
])
def test_bad_environment_settings_name_the_key(make, message):
    with pytest.raises(RecipeError) as err:
        make()
    assert str(err.value) == message


# ------------------------------------------------------------------------------ recipes, end to end
ENV_RECIPES = ["env-arithmetic-feedback.yaml", "env-calculator.yaml", "env-reasoning-gym-feedback.yaml"]


@pytest.mark.parametrize("recipe", ENV_RECIPES)
def test_environment_recipe_trains_two_steps_with_groups(recipe, tmp_path, tiny_model_dir):
    """The recipe's environment and GroupSampler (G = 8) on the tiny model: every rollout is multi-turn
    episodes scored by the environment, and the run logs the episode metrics."""
    extra = []
    if "reasoning-gym" in recipe:  # its own tasks (smaller), whose answers its verifier reads
        pytest.importorskip("reasoning_gym")
        extra = ["--data.task", '{class_path: rllight.data.ReasoningGymTask, init_args: {tasks: {chain_sum: {}, '
                 'leg_counting: {}}, train_size: 16, val_size: 4}}']
    cli = build(os.path.join(RECIPES, recipe), tiny_overrides(tmp_path, tiny_model_dir), "--trainer.max_steps", "2",
                "--model.batching.minibatch_size", "null", *extra)
    env = cli.model.producer.environment
    assert type(env).__name__ == {"env-arithmetic-feedback.yaml": "ArithmeticFeedback",
                                  "env-calculator.yaml": "Calculator",
                                  "env-reasoning-gym-feedback.yaml": "Feedback"}[recipe]
    seen = fit_recording_rollouts(cli)
    assert len(seen) == 2
    for rollout in seen:
        assert len(rollout) == 2 * 8 and rollout.context_mask is not None
        assert (rollout.context_mask >= rollout.response_mask).all()
    metrics = cli.trainer.callback_metrics
    assert 1.0 <= float(metrics["train/episode/turns_mean"]) <= env.max_turns
    assert "train/episode/truncated_ratio" in metrics
    assert float(metrics.get("train/episode/failures", 0.0)) == 0.0  # every call into an episode succeeded


def test_an_environment_scores_without_a_reward_and_its_verifier_checks_the_answers(tmp_path, tiny_model_dir):
    """With no ``model.reward`` the environment scores the episodes, and its ``verifier`` does what a reward did
    before training: it checks every reference answer and passes the pre-flight."""
    cli = build(os.path.join(RECIPES, "env-calculator.yaml"),
                tiny_overrides(tmp_path, tiny_model_dir, reward=None, reward_preflight=2), "--trainer.max_steps", "1",
                "--model.batching.minibatch_size", "null")
    assert cli.model.reward is None and cli.model.producer.scorer is None
    assert cli.model.answer_checker is cli.model.environment.verifier
    seen = fit_recording_rollouts(cli)  # the pre-flight passed: IntegerMatch tells a right answer from a wrong one
    assert len(seen) == 1 and cli.model._preflight_done
    rows = tmp_path / "train.jsonl"
    rows.write_text('{"prompt": "What is half of 1?", "answer": "1/2"}\n')
    cli = build(os.path.join(RECIPES, "env-calculator.yaml"), tiny_overrides(tmp_path, tiny_model_dir, reward=None),
                "--data.train_files", f"[{rows}]", "--trainer.max_steps", "1")
    with pytest.raises(RecipeError, match=r"train.jsonl row 1: answer '1/2' can never be matched by IntegerMatch"):
        cli.trainer.fit(cli.model, datamodule=cli.datamodule)


def test_dynamic_sampling_and_group_sampler_train_on_multi_turn_rollouts(tmp_path, tiny_model_dir):
    """DAPO's dynamic sampling keeps the mixed groups of two-turn episodes and the update changes every
    parameter: the samplers run unchanged on multi-turn rollouts."""
    env = {"class_path": "test_environments.DigitFeedback", "init_args": {"max_turns": 2}}
    sampler = {"class_path": "rllight.strategies.DynamicSampling", "init_args": {"group_size": 4, "max_rounds": 3}}
    cli = build(os.path.join(RECIPES, "env-arithmetic-feedback.yaml"),
                tiny_overrides(tmp_path, tiny_model_dir, environment=env, sampler=sampler),
                "--trainer.max_steps", "2", "--model.batching.minibatch_size", "null")
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    metrics = cli.trainer.callback_metrics
    assert float(metrics["train/sampling/groups_kept"]) > 0
    assert float(metrics["train/episode/turns_mean"]) == 2.0
    assert unchanged_parameters(cli.model.policy, tiny_model_dir) == []


def test_validation_reports_the_turns_each_episode_used(tmp_path, tiny_model_dir):
    """Evaluation of multi-turn episodes logs the model's turns per episode (``val/turns_mean``) and saves
    them per response: DigitFeedback always runs to ``max_turns`` = 3."""
    env = {"class_path": "test_environments.DigitFeedback", "init_args": {"max_turns": 3}}
    cli = build(os.path.join(RECIPES, "env-arithmetic-feedback.yaml"),
                tiny_overrides(tmp_path, tiny_model_dir, environment=env), "--trainer.max_steps", "1",
                "--trainer.limit_val_batches", "1.0")
    metrics = cli.trainer.validate(cli.model, datamodule=cli.datamodule, verbose=False)[0]
    assert metrics["val/turns_mean"] == 3.0
    (rows_file,) = list(tmp_path.rglob("val_step0_rows.jsonl"))
    assert all(json.loads(line)["turns"] == [3] for line in open(rows_file))
