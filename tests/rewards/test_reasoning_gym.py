"""reasoning-gym as data and reward: its generators make the rows (train and validation disjoint, each row's
data_source its task), its own verifiers score the final answers, and evaluation reports each task."""

import json
import os
import sys

import pytest

from conftest import RECIPES
from helpers import build, tiny_overrides
from rllight.errors import RecipeError

pytest.importorskip("reasoning_gym")  # the dev extra installs it; without it only this file is skipped

from rllight.data import ReasoningGymTask  # noqa: E402
from rllight.rewards import ReasoningGymScore  # noqa: E402
from rllight.rewards.reasoning_gym import final_answer  # noqa: E402

MIX = {"chain_sum": {"config": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}},
       "basic_arithmetic": {}, "leg_counting": {"weight": 2.0}, "gsm_symbolic": {}}


def test_the_splits_never_share_a_question_and_each_row_names_its_task():
    train, val = ReasoningGymTask(MIX, train_size=200, val_size=20, seed=3).splits()
    counts = {name: sum(r["data_source"] == name for r in val) for name in MIX}
    assert counts == {"chain_sum": 4, "basic_arithmetic": 4, "leg_counting": 8, "gsm_symbolic": 4}
    assert [r["data_source"] for r in val[:4]] == list(MIX)  # interleaved: data.val_size keeps the mix
    assert sum(r["data_source"] == "leg_counting" for r in train) == 80
    # Two one-digit terms make at most 200 problems: 400 draws repeat held-out ones, which are dropped.
    small, held_out = ReasoningGymTask({"chain_sum": MIX["chain_sum"]}, train_size=400, val_size=20).splits()
    assert len(held_out) == 20 and 300 < len(small) < 400
    assert not {r["prompt"] for r in small} & {r["prompt"] for r in held_out}
    again, _ = ReasoningGymTask(MIX, train_size=200, val_size=20, seed=3).splits()
    assert again == train  # the generators are deterministic by seed
    other, _ = ReasoningGymTask(MIX, train_size=200, val_size=20, seed=4).splits()
    assert other != train


def test_the_tasks_own_verifier_scores_the_final_answer():
    _, val = ReasoningGymTask(MIX, train_size=8, val_size=8).splits()
    reward = ReasoningGymScore(correct=1.0, wrong=-1.0)
    for row in val:
        answer = json.loads(row["answer"])["answer"]
        assert reward(f"Let me think.\nThe total is \\boxed{{{answer}}}", row["answer"]) == 1.0, row
        assert reward(f"I think\n{answer}", row["answer"]) == 1.0  # the last line
        # A wrong answer: not solved; some tasks give a little credit for the form (gsm_symbolic: 0.01).
        assert reward("\\boxed{-99999}", row["answer"]) < -0.9 and not reward.is_correct("-99999", row["answer"])
        assert reward.is_correct(f"<answer>{answer}</answer>", row["answer"])
        # A numeric answer is read as its final line's last number, as a small model writes it.
        assert reward.is_correct(f"Adding them up:\n1 + 2 = {answer}", row["answer"])
        assert reward.is_correct(f"The answer is {answer}.", row["answer"])
        assert not reward.is_correct(f"The answer is {answer}1.", row["answer"])
        assert not reward.is_correct(f"{answer} is what I first thought, but it is 99999", row["answer"])


def test_the_preflight_check_states_the_answer_a_rows_key_stands_for():
    """The pre-flight boxes the answer a reasoning-gym row's key stands for (not the key itself), so the task's
    verifier passes the right response and fails the one with a changed digit, on every task of the mix."""
    from rllight.rewards import IntegerMatch, preflight

    train, _ = ReasoningGymTask(MIX, train_size=16, val_size=4).splits()
    preflight(ReasoningGymScore(), train, k=8)
    with pytest.raises(RecipeError, match=r"^model\.reward: IntegerMatch does not give the reference answer"):
        preflight(IntegerMatch(), train, k=8)  # it would compare with the key


@pytest.mark.parametrize("response, expected", [
    ("so \\boxed{12} and later \\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
    ("<answer> 7 </answer> and more text", "7"),
    ("work\n\nFinal answer: 42.\n", "42"),
    ("", ""),
])
def test_final_answer(response, expected):
    assert final_answer(response) == expected


@pytest.mark.parametrize("response, expected", [
    ("2 + 5 = 7", "7"),
    ("The final answer is -1,200.", "-1,200"),
    ("\\boxed{x = 3}", "3"),
    ("12 legs in all\nno number here", "no number here"),  # the final line has none: unchanged, and wrong
    ("3.5", "3.5"),
    ("It is 30, I think", "30"),
    ("\\boxed{12", "\\boxed{12"),  # cut inside the box: unchanged, and wrong
])
def test_final_answer_of_a_numeric_task_is_the_last_number_of_the_final_line(response, expected):
    assert final_answer(response, numeric=True) == expected


def test_without_the_extra_a_recipe_naming_it_is_one_line_with_the_install_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # as if it were not installed
    with pytest.raises(RecipeError) as err:
        ReasoningGymTask(MIX)
    line = str(err.value)
    assert len(line.splitlines()) == 1 and "bash tools/install.sh reasoning-gym (in the rllight clone" in line
    with pytest.raises(RecipeError, match=r"model\.reward: ReasoningGymScore needs reasoning-gym"):
        ReasoningGymScore()


def test_an_unknown_task_or_setting_is_one_line_naming_it():
    with pytest.raises(RecipeError, match=r"tasks\.no_such_task: reasoning-gym task 'no_such_task'"):
        ReasoningGymTask({"no_such_task": {}}, train_size=4, val_size=2).splits()
    with pytest.raises(RecipeError, match=r"tasks\.chain_sum: give \{weight"):
        ReasoningGymTask({"chain_sum": {"wieght": 2}})


def test_a_run_scores_in_the_reward_workers_and_evaluates_each_task(tmp_path, tiny_model_dir):
    overlay = tiny_overrides(tmp_path, tiny_model_dir, reward={"class_path": "rllight.rewards.ReasoningGymScore"},
                             reward_runner={"class_path": "rllight.rewards.RewardRunner",
                                            "init_args": {"workers": 1, "timeout_seconds": 30}})
    task = json.dumps({"class_path": "rllight.data.ReasoningGymTask",
                       "init_args": {"tasks": MIX, "train_size": 16, "val_size": 10}})
    cli = build(os.path.join(RECIPES, "grpo.yaml"), overlay, "--data.task", task, "--data.val_size", "10",
                "--trainer.max_steps", "1", "--trainer.limit_val_batches", "1.0",
                "--model.reward_preflight", "4")  # the recipes' pre-flight check passes on these rows
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    assert cli.trainer.global_step == 1
    metrics = cli.trainer.validate(cli.model, datamodule=cli.datamodule, verbose=False)[0]
    for name in MIX:
        assert f"val/{name}/avg@1" in metrics, sorted(metrics)
    assert metrics["val/prompts"] == 10


def test_a_reasoning_gym_task_as_an_environment_gives_feedback_and_a_second_attempt():
    """Multi-turn: ``rllight.envs.Feedback`` with the task's own verifier says a wrong answer is wrong and
    takes a correction; a right first answer ends the episode at once, with full reward."""
    from rllight.envs import Feedback

    (row,) = ReasoningGymTask({"leg_counting": {}}, train_size=1, val_size=1).splits()[1]
    answer = json.loads(row["answer"])["answer"]
    env = Feedback(ReasoningGymScore(), max_turns=3, turn_discount=0.5, feedback="No. Try again.")
    episode = env.spawn()
    assert episode.reset(row) is None
    first = episode.step("\\boxed{-1}")
    assert (first.observation, first.reward, first.done, first.correct) == ("No. Try again.", 0.0, False, False)
    second = episode.step(f"Counting again: \\boxed{{{answer}}}")
    assert (second.observation, second.reward, second.done, second.correct) == (None, 0.5, True, True)
    again = env.spawn()  # a fresh episode: the first attempt counts in full
    again.reset(row)
    assert again.step(f"<answer>{answer}</answer>").reward == 1.0
    wrong = env.spawn()
    wrong.reset(row)
    results = [wrong.step("\\boxed{-1}") for _ in range(3)]
    assert [r.done for r in results] == [False, False, True] and results[-1].reward == 0.0
    with pytest.raises(RecipeError, match="verifier"):
        Feedback(verifier=lambda response, answer: 1.0)
