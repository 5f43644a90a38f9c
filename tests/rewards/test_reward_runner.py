"""The reward runner: rewards scored in worker processes, where a sample that hangs, raises, overflows
float32 or kills its worker gets 0 and is counted while the rest of the batch is scored; the pre-flight check
that a reward tells right from wrong; weighted combinations of rewards."""

import copy
import os
import sys

import pytest
import yaml
from jsonargparse import ArgumentParser
from reward_fixtures import Always, DieOn, Echo, HangOn, Loads, Pid, samples_of

from rllight.errors import RecipeError
from rllight.rewards import (FormatReward, IntegerMatch, MathVerify, Reward, RewardRunner, Verifier, Weighted,
                             check_answers, preflight, scored)
from rllight.rewards.preflight import wrong_answer


@pytest.fixture(scope="module")
def runner():
    # A generous timeout: only the hanging-reward test waits one out, with its own runner.
    with RewardRunner(workers=2, timeout_seconds=60) as r:
        yield r


def test_a_hanging_sample_times_out_and_the_rest_of_the_batch_is_scored():
    with RewardRunner(workers=2, timeout_seconds=3) as runner:
        responses = ["1", "2", "7", "4", "0", "9"]
        answers = ["1", "2", "7", "4", "5", "9"]  # sample 2 hangs; sample 4 is plainly wrong
        scores = runner.score(HangOn(on="7"), responses, answers)  # HangOn never returns for "7"
        assert scores.values == [1.0, 1.0, 0.0, 1.0, 0.0, 1.0]
        assert scores.solved == [True, True, False, True, False, True]
        assert (len(scores.failed), scores.metrics["timeouts"], scores.metrics["worker_deaths"]) == (1, 1, 0)
        assert list(scores.failed) == [2] and "timed out after 3 s" in scores.failed[2]
        # the hung worker was replaced: the pool is whole and the next batch is scored
        again = runner.score(HangOn(on="7"), ["1", "3"], ["1", "2"])
        assert again.values == [1.0, 0.0] and (again.failed, again.metrics["timeouts"]) == ({}, 0)


@pytest.mark.parametrize("how", ["exit", "sigkill"])
def test_a_sample_that_kills_its_worker_is_counted_and_the_next_batch_still_works(runner, how):
    reward = DieOn(on="3", how=how)
    scores = runner.score(reward, ["1", "3", "5", "6"], ["1", "3", "5", "7"])
    assert scores.values == [1.0, 0.0, 1.0, 0.0]
    assert scores.solved == [True, False, True, False]
    assert (len(scores.failed), scores.metrics["timeouts"], scores.metrics["worker_deaths"]) == (1, 0, 1)
    code = "exit code 1" if how == "exit" else "exit code -9"
    assert "worker process died" in scores.failed[1] and code in scores.failed[1]
    again = runner.score(reward, ["2", "8"], ["2", "9"])
    assert again.values == [1.0, 0.0] and again.failed == {} and again.metrics["worker_deaths"] == 0


@pytest.mark.parametrize("workers", [1, 0])
def test_raising_and_float32_overflowing_samples_get_zero(runner, workers):
    # The largest float32 is about 3.4028e38: 1e39 becomes inf in the rollout tensor (a failure), 3e38 fits
    # (and is >= correct = 1). "boom" is not a number: float() raises. workers=0 scores in-process.
    local = runner if workers else RewardRunner(workers=0)
    scores = local.score(Echo(), ["1e39", "3e38", "boom", "1", "0.5"], [""] * 5)
    assert scores.values == [0.0, 3e38, 0.0, 1.0, 0.5]
    assert scores.solved == [False, True, False, True, False]
    assert (len(scores.failed), scores.metrics["timeouts"], scores.metrics["worker_deaths"]) == (2, 0, 0)
    assert "not finite in float32" in scores.failed[0] and "ValueError" in scores.failed[2]


def test_math_verify_runs_in_the_workers(runner):
    responses = ["\\boxed{\\frac{1}{2}}", "\\boxed{\\frac{1}{3}}", "so $x = \\sqrt{4}$", "\\boxed{3}"]
    answers = ["0.5", "0.5", "2", "4"]
    scores = runner.score(MathVerify(), responses, answers)
    assert scores.solved == [True, False, True, False]
    assert scores.values == [1.0, 0.0, 1.0, 0.0]
    assert not scores.failed


def test_workers_are_other_processes_reused_across_batches_and_get_the_reward_once(tmp_path):
    with RewardRunner(workers=1, timeout_seconds=60) as runner:
        first = runner.score(Pid(), ["a", "b"], ["", ""])
        second = runner.score(Pid(), ["c"], [""])
        assert first.values[0] == first.values[1] == second.values[0] != float(os.getpid())
        # one unpickling in the worker for 5 samples over two batches (the same reward pickles the same)
        reward = Loads()
        assert runner.score(reward, ["x"] * 3, [""] * 3).values == [1.0] * 3
        assert runner.score(reward, ["x"] * 2, [""] * 2).values == [1.0] * 2
        pid = int(first.values[0])
    with pytest.raises(ProcessLookupError):  # closed: the worker is gone (and reaped)
        os.kill(pid, 0)


def test_a_runner_copies_without_its_workers(runner):
    runner.score(IntegerMatch(), ["1"], ["1"])
    clone = copy.deepcopy(runner)
    assert (clone.workers, clone.timeout_seconds) == (2, 60.0) and clone._pool == []
    assert clone.score(IntegerMatch(), ["1", "2"], ["1", "1"]).values == [1.0, 0.0]
    clone.close()


def test_a_reward_the_workers_cannot_get_is_one_recipe_error(tmp_path, monkeypatch):
    class Local(Verifier):  # not importable by name: cannot be pickled
        def __call__(self, response, answer):
            return 1.0

    with RewardRunner(workers=1) as runner, pytest.raises(RecipeError, match=r"model.reward: Local cannot be sent"):
        runner.score(Local(), ["a"], ["a"])
    # A class of the script being run: the workers import rllight, not the trainer's __main__.
    class Script(Verifier):
        def __call__(self, response, answer):
            return 1.0

    Script.__module__, Script.__qualname__ = "__main__", "ScriptReward"
    monkeypatch.setattr(sys.modules["__main__"], "ScriptReward", Script, raising=False)
    with RewardRunner(workers=1) as runner, pytest.raises(RecipeError, match=r"Script is defined in the script being"):
        runner.score(Script(), ["a"], ["a"])
    # A module on the trainer's path when the reward was made but not when the workers start.
    (tmp_path / "gone_rewards.py").write_text(
        "from rllight.rewards import Verifier\n\n\nclass Gone(Verifier):\n"
        "    def __call__(self, response, answer):\n        return 1.0\n")
    sys.path.insert(0, str(tmp_path))
    try:
        from gone_rewards import Gone
    finally:
        sys.path.remove(str(tmp_path))
    with RewardRunner(workers=1) as runner:
        with pytest.raises(RecipeError) as err:
            runner.score(Gone(), ["a"], ["a"])
        message = str(err.value)
        assert "Gone cannot be loaded in a reward worker process" in message and "gone_rewards" in message
        assert "\n" not in message
        assert runner.score(IntegerMatch(), ["1"], ["1"]).values == [1.0]  # the runner is still usable


@pytest.mark.parametrize("kwargs,key", [({"workers": -1}, "workers"), ({"timeout_seconds": 0}, "timeout_seconds"),
                                        ({"timeout_seconds": float("inf")}, "timeout_seconds")])
def test_bad_runner_settings(kwargs, key):
    with pytest.raises(RecipeError, match=f"RewardRunner.{key} must be"):
        RewardRunner(**kwargs)


# ----------------------------------------------------------------------------------------------- pre-flight
@pytest.mark.parametrize("answer,wrong", [("17", "18"), ("9", "0"), ("1,239", "1,230"), ("-3", "-4"),
                                          ("\\frac{1}{2}", "\\frac{1}{3}"), ("x", "x + 1")])
def test_the_wrong_answer_of_the_preflight(answer, wrong):
    assert wrong_answer(answer) == wrong


def _rows(*answers):
    return [{"prompt": "?", "answer": a, "source": f"train.jsonl row {i + 1}"} for i, a in enumerate(answers)]


def test_preflight_passes_rewards_that_tell_right_from_wrong(runner):
    preflight(IntegerMatch().guarded(runner), _rows("12", "-3", "1,234", "0", "9"))
    preflight(MathVerify().guarded(runner), _rows("0.5", "\\frac{1}{3}", "x^2", "\\sqrt{2}"))
    preflight(IntegerMatch(correct=1.0, wrong=-1.0).guarded(runner), _rows("4"), k=1)  # DAPO's scale


def test_preflight_rejects_a_reward_that_accepts_a_wrong_answer(runner):
    with pytest.raises(RecipeError) as err:
        preflight(Always(1.0).guarded(runner), _rows("12", "5"))
    message = str(err.value)
    assert message.startswith("model.reward: Always gives a wrong response its full reward 1:")
    assert "'The answer is \\\\boxed{13}.'" in message and "train.jsonl row 1" in message and "\n" not in message
    assert message.endswith("(--model.reward_preflight 0 skips this check)")  # how to turn the check off


def test_preflight_rejects_a_reward_that_never_gives_the_full_reward(runner):
    with pytest.raises(RecipeError) as err:
        preflight(Always(0.0).guarded(runner), _rows("12", "5"))
    message = str(err.value)
    assert message.startswith("model.reward: Always does not give the reference answer of train.jsonl row 1 "
                              "its full reward 1:")
    assert "scored 0" in message and "\n" not in message
    assert message.endswith("(--model.reward_preflight 0 skips this check)")


def test_preflight_names_the_row_whose_answer_the_reward_cannot_read(runner):
    # k = 4 of 8 rows checks rows 1, 3, 5 and 7 (indices 0, 2, 4, 6): row 5's answer breaks IntegerMatch.
    rows = _rows("1", "2.5", "3", "4", "5.0", "6", "7", "8")
    with pytest.raises(RecipeError) as err:
        preflight(IntegerMatch().guarded(runner), rows, k=4)
    message = str(err.value)
    assert "of train.jsonl row 5 its full reward 1" in message and "ValueError" in message and "\n" not in message


# ----------------------------------------------------------------------------------------------- combined rewards
def _correct_plus_format():
    return Weighted(rewards={"correctness": IntegerMatch(), "format": FormatReward()},
                    weights={"correctness": 1.0, "format": 0.2})


def test_weighted_sums_its_components_and_follows_one_for_correctness():
    reward = _correct_plus_format()
    scores = scored(reward, samples_of(["so \\boxed{4}", "so 4", "\\boxed{5}"], ["4", "4", "4"]))
    # 1.0 * 1 + 0.2 * 1; 1.0 * 1 + 0.2 * 0; a format bonus on a wrong answer (0.2)...
    assert scores.values == pytest.approx([1.2, 1.0, 0.2])
    assert scores.solved == [True, True, False]  # ...does not make it correct
    assert scores.components == {"correctness": [1.0, 1.0, 0.0], "format": [1.0, 0.0, 1.0]}
    assert "not an integer" in reward.check_answer("2.0")  # the correctness component checks the answers
    with pytest.raises(RecipeError, match="can never be matched by Weighted"):
        check_answers(reward, _rows("2.0"))


def test_weighted_components_through_the_runner(runner):
    reward = _correct_plus_format().guarded(runner)
    assert all(type(part).__name__ == "Guarded" for part in reward.parts())  # each verifier in the workers
    scores = scored(reward, samples_of(["\\boxed{4}", "4", "\\boxed{5}", "none"], ["4", "4", "4", "4"]))
    assert scores.values == pytest.approx([1.2, 1.0, 0.2, 0.0])
    assert scores.solved == [True, True, False, False]
    assert scores.components == {"correctness": [1.0, 1.0, 0.0, 0.0], "format": [1.0, 0.0, 1.0, 0.0]}
    assert scores.metrics == {"timeouts": 0.0, "worker_deaths": 0.0}  # summed over the components
    # a component that fails fails the sample: 0 everywhere, counted
    broken = Weighted({"value": Echo(), "format": FormatReward()}, {"value": 1.0, "format": 0.5}).guarded(runner)
    scores = scored(broken, samples_of(["2", "oops \\boxed{1}"], ["", ""]))
    assert scores.values == [2.0, 0.0] and list(scores.failed) == [1] and scores.failed[1].startswith("value: ")
    assert scores.components == {"value": [2.0, 0.0], "format": [0.0, 0.0]}
    assert runner.score(IntegerMatch(), ["1"], ["1"]).components == {}
    preflight(reward, _rows("12", "7"))  # correctness decides the pre-flight, not the format


@pytest.mark.parametrize("kwargs,match", [
    ({"weights": {"correctness": 1.0}}, "Weighted.weights has no weight for 'format'"),
    ({"weights": {"correctness": 1.0, "format": 0.2, "fromat": 1.0}}, "Weighted.weights.fromat: no reward"),
    ({"weights": {"correctness": 1.0, "format": float("nan")}}, "Weighted.weights.format is nan"),
    ({"correct_from": "style"}, "Weighted.correct_from 'style' is not a reward"),
])
def test_weighted_settings_are_checked(kwargs, match):
    with pytest.raises(RecipeError, match=match):
        Weighted(rewards={"correctness": IntegerMatch(), "format": FormatReward()}, **kwargs)


def test_format_reward_reads_a_pattern():
    tags = FormatReward(pattern=r"<answer>.+</answer>")
    assert tags("<answer>\n4\n</answer>", "4") == 1.0 and tags("4", "4") == 0.0
    assert FormatReward()("\\boxed{}", "") == 0.0 and FormatReward()("\\boxed{x}", "") == 1.0
    with pytest.raises(RecipeError, match=r"FormatReward.pattern '\(' is not a regular expression"):
        FormatReward(pattern="(")


def test_weighted_and_the_runner_parse_from_yaml():
    recipe = yaml.safe_load(r"""
reward:
  class_path: rllight.rewards.Weighted
  init_args:
    rewards:
      correctness: {class_path: rllight.rewards.MathVerify, init_args: {timeout_seconds: 3}}
      format: {class_path: rllight.rewards.FormatReward, init_args: {pattern: '<answer>.+</answer>'}}
    weights: {correctness: 1.0, format: 0.2}
    correct_from: correctness
runner: {workers: 1, timeout_seconds: 2.5}
""")
    parser = ArgumentParser(exit_on_error=False)
    parser.add_argument("--reward", type=Reward)
    parser.add_class_arguments(RewardRunner, "runner")
    cfg = parser.instantiate_classes(parser.parse_object(recipe))
    reward = cfg.reward
    assert isinstance(reward, Weighted) and reward.weights == {"correctness": 1.0, "format": 0.2}
    correctness = reward.rewards["correctness"]
    assert isinstance(correctness, MathVerify) and correctness.timeout_seconds == 3
    assert reward.rewards["format"].pattern == "<answer>.+</answer>"
    assert scored(reward, samples_of(["<answer>$\\frac{1}{2}$</answer>"], ["0.5"])).values == pytest.approx([1.2])
    assert (cfg.runner.workers, cfg.runner.timeout_seconds) == (1, 2.5)


def test_a_reward_the_worker_dropped_from_its_cache_is_sent_again():
    # One worker keeps the last 4 rewards it loaded; after 5 distinct ones the first is gone from it and must be
    # sent again, not asked for by key (which failed every sample of it with a KeyError).
    with RewardRunner(workers=1, timeout_seconds=60) as runner:
        first = IntegerMatch()
        for reward in [first, *(IntegerMatch(correct=float(c)) for c in (2, 3, 4, 5))]:
            runner.score(reward, ["\\boxed{4}"], ["4"])
        again = runner.score(first, ["\\boxed{4}", "\\boxed{5}"], ["4", "4"])
        assert (again.failed, again.values) == ({}, [1.0, 0.0]), again.failed


@pytest.mark.parametrize("kwargs,message", [
    ({"workers": -1}, "RewardRunner.workers must be an integer >= 0, got -1"),
    ({"workers": True}, "RewardRunner.workers must be an integer >= 0, got True"),
    ({"timeout_seconds": 0}, "RewardRunner.timeout_seconds must be a finite number > 0, got 0"),
    ({"timeout_seconds": float("inf")}, "RewardRunner.timeout_seconds must be a finite number > 0, got inf"),
])
def test_bad_runner_settings_are_one_line(kwargs, message):
    with pytest.raises(RecipeError) as err:
        RewardRunner(**kwargs)
    assert str(err.value).startswith(message) and "\n" not in str(err.value)
