"""The reward-hacking guard (rllight.callbacks.RewardHackingGuard): a model reward that rises while the verifier
beside it falls warns, or ends the run saved with one line naming the best checkpoint by the verifier; an honest
reward never fires it; the rewards it watches are found in the recipe's Weighted reward."""

import logging
import os

import pytest
import torch
import yaml

from conftest import RECIPES
from helpers import CaptureLogger, build, tiny_overrides
from reward_fixtures import ContainsJudge
from rllight.callbacks import RewardHackingGuard
from rllight.callbacks.reward_guard import watched_pair
from rllight.errors import RecipeError, RunStopped
from rllight.rewards import IntegerMatch, MathVerify, PerSource, Weighted
from rllight.stopping import clear_stop, ending
from rllight.types import Rollout


@pytest.fixture(autouse=True)
def no_stop_left():
    """A guard's ``end_after_step`` is kept in the process: clear it after each test."""
    yield
    clear_stop()


def _steps(guard, model, verifier, corrs=None):
    """Feed ``guard`` one RL step per pair of means and rank correlation (None: the step has none), as ``Weighted``
    leaves them in ``rollout.extras``; each step's rollout extras."""
    out = []
    for m, v, c in zip(model, verifier, corrs or [None] * len(model)):
        extras = {"reward/judge": m, "reward/exact": v}
        if c is not None:
            extras["reward/agreement/judge_vs_exact/rank_corr"] = c
        out.append(guard.on_rollout(None, None, Rollout.empty(extras)).extras)
    return out


def test_a_rising_model_reward_and_a_falling_verifier_warn_once_a_window(caplog):
    guard = RewardHackingGuard("judge", "exact", window=3, min_change=0.1)
    with caplog.at_level(logging.WARNING):
        extras = _steps(guard, [0.5, 0.6, 0.8, 0.9, 0.95], [0.3, 0.2, 0.1, 0.05, 0.0])
    # steps 1-3: judge 0.5, 0.6, 0.8 -> slope 0.15 -> change 0.3; exact 0.3, 0.2, 0.1 -> change -0.2
    assert extras[2]["guard/reward_hacking/model_change"] == pytest.approx(0.3)
    assert extras[2]["guard/reward_hacking/verifier_change"] == pytest.approx(-0.2)
    assert "guard/reward_hacking/model_change" not in extras[1]  # the window is not full yet
    warned = [r.getMessage() for r in caplog.records if "reward hacking" in r.getMessage()]
    # The window starts afresh after the warning: steps 4 and 5 are two steps of a new window, not a second warning.
    assert warned == ["reward hacking: over RL steps 1-3 the model reward 'judge' rose by 0.3 while the verifier "
                      "'exact' fell by 0.2 (least-squares fits of train/reward/judge and train/reward/exact): the "
                      "policy is learning what 'judge' likes, not the task; see "
                      "train/reward/agreement/judge_vs_exact/rank_corr; training goes on (trainer.callbacks: "
                      "RewardHackingGuard's window, min_change, min_agreement and action set when this fires; action: "
                      "stop ends the run)"]
    assert ending() is None


@pytest.mark.parametrize("model,verifier", [
    ([0.5, 0.4, 0.3, 0.2], [0.5, 0.4, 0.3, 0.2]),  # honest: the model reward is the verifier, falling
    ([0.2, 0.4, 0.6, 0.8], [0.1, 0.3, 0.5, 0.7]),  # both rise
    ([0.2, 0.4, 0.6, 0.8], [0.5, 0.5, 0.5, 0.5]),  # the model rises, the verifier holds
    ([0.5, 0.52, 0.54, 0.56], [0.5, 0.48, 0.46, 0.44]),  # opposite, by 0.06 each: under min_change 0.1
])
def test_rewards_that_do_not_diverge_by_min_change_never_fire_it(model, verifier, caplog):
    guard = RewardHackingGuard("judge", "exact", window=3, min_change=0.1, action="stop")
    with caplog.at_level(logging.WARNING):
        _steps(guard, model, verifier)
    assert ending() is None
    assert not [r for r in caplog.records if "reward hacking" in r.getMessage()]


def test_stop_ends_the_run_after_the_step_naming_the_verifiers_best_step():
    guard = RewardHackingGuard("judge", "exact", window=3, min_change=0.1, action="stop")
    _steps(guard, [0.5, 0.4, 0.6, 0.8], [0.2, 0.35, 0.2, 0.1])
    # steps 1-3: judge change 0.1, exact 0 -> nothing; steps 2-4: judge 0.4, exact -0.25 -> stop
    assert ending() == ("reward hacking: over RL steps 2-4 the model reward 'judge' rose by 0.4 while the verifier "
                        "'exact' fell by 0.25 (least-squares fits of train/reward/judge and train/reward/exact): the "
                        "policy is learning what 'judge' likes, not the task; see "
                        "train/reward/agreement/judge_vs_exact/rank_corr; 'exact' was highest at RL step 2 (0.35), "
                        "which no checkpoint keeps (a ModelCheckpoint monitoring train/reward/exact, mode max, would) "
                        "(trainer.callbacks: RewardHackingGuard's window, min_change, min_agreement and action set "
                        "when this fires)")


def test_a_step_without_the_rewards_is_not_counted_and_state_resumes():
    guard = RewardHackingGuard("judge", "exact", window=3)
    _steps(guard, [0.5, 0.6], [0.3, 0.2], [0.1, None])
    guard.on_rollout(None, None, Rollout.empty({"data/dropped_long_prompts": 2.0}))  # nothing scored
    assert [m for _, m, _ in guard.recent] == [0.5, 0.6]
    assert guard.agreements == [(1, 0.1)]  # step 2's rewards were constant: no correlation
    again = RewardHackingGuard("judge", "exact", window=3)
    again.load_state_dict(guard.state_dict())
    assert (again.recent, again.best, again.steps, again.agreements) == (guard.recent, guard.best, guard.steps,
                                                                         guard.agreements)


def test_a_model_reward_that_does_not_rank_as_the_verifier_does_stops_the_run():
    """Correlations 0.2, -0.1, 0.05 (mean 0.05, standard deviation 0.15, standard error 0.0866: 0.05 - 0.173 <= 0)
    fire the agreement test at step 3, though the means neither rose nor fell."""
    guard = RewardHackingGuard("judge", "exact", window=3, action="stop")
    extras = _steps(guard, [0.5] * 3, [0.3] * 3, [0.2, -0.1, 0.05])
    assert extras[2]["guard/reward_hacking/agreement_lower"] == pytest.approx(0.05 - 2 * 0.15 / 3 ** 0.5)
    assert ending() == ("reward hacking: over RL steps 1-3 the model reward 'judge' did not rank responses as the "
                        "verifier 'exact' does (rank correlation 0.05 ± 0.087 a step, not clearly above min_agreement "
                        "0; train/reward/agreement/judge_vs_exact/rank_corr): it is no proxy for the task, and "
                        "training on it teaches what it likes; 'exact' was highest at RL step 1 (0.3), which no "
                        "checkpoint keeps (a ModelCheckpoint monitoring train/reward/exact, mode max, would) "
                        "(trainer.callbacks: RewardHackingGuard's window, min_change, min_agreement and action set "
                        "when this fires)")


def test_the_step_one_test_fires_on_logs_both_tests():
    """The divergence test fires at step 3; the agreement test, which passes (0.5, 0.6, 0.55), is logged beside it."""
    guard = RewardHackingGuard("judge", "exact", window=3, action="stop")
    extras = _steps(guard, [0.5, 0.6, 0.8], [0.3, 0.2, 0.1], [0.5, 0.6, 0.55])
    assert ending().startswith("reward hacking: over RL steps 1-3 the model reward 'judge' rose by 0.3 ")
    assert extras[2]["guard/reward_hacking/agreement_lower"] == pytest.approx(0.55 - 2 * 0.05 / 3 ** 0.5)
    assert extras[2]["guard/reward_hacking/model_change"] == pytest.approx(0.3)


@pytest.mark.parametrize("corrs,min_agreement", [
    ([0.3, 0.35, 0.25], 0.0),  # mean 0.3, standard error 0.029: clearly above 0
    ([0.05, -0.3, 0.0], None),  # no relation, but the test is off
    ([0.9, 0.95, 0.85], 0.8),  # above a stricter bar: 0.9 - 0.058 > 0.8
])
def test_a_model_reward_that_ranks_as_the_verifier_does_passes_the_agreement_test(corrs, min_agreement):
    guard = RewardHackingGuard("judge", "exact", window=3, min_agreement=min_agreement, action="stop")
    _steps(guard, [0.5] * 3, [0.3] * 3, corrs)
    assert ending() is None


def test_the_agreement_test_fires_at_a_stricter_bar_and_counts_only_steps_with_a_correlation():
    guard = RewardHackingGuard("judge", "exact", window=3, min_agreement=0.8, action="stop")
    _steps(guard, [0.5] * 4, [0.3] * 4, [0.9, None, 0.6, 0.85])  # steps 1, 3, 4: mean 0.783
    assert ending().startswith("reward hacking: over RL steps 1-4 the model reward 'judge' did not rank responses "
                               "as the verifier 'exact' does (rank correlation 0.783 ± 0.093 a step, not clearly "
                               "above min_agreement 0.8;")


def test_settings_out_of_range_are_one_line():
    with pytest.raises(RecipeError, match="RewardHackingGuard.window must be an integer >= 2, got 1"):
        RewardHackingGuard(window=1)
    with pytest.raises(RecipeError, match="RewardHackingGuard.min_change must be a finite number > 0, got 0"):
        RewardHackingGuard(min_change=0)
    with pytest.raises(RecipeError, match=r"min_agreement must be a number in \[-1, 1\) or null, got 1.0"):
        RewardHackingGuard(min_agreement=1.0)
    with pytest.raises(RecipeError, match="action is 'halt'; give warn or stop"):
        RewardHackingGuard(action="halt")


def test_the_watched_rewards_are_found_in_the_weighted_reward():
    judge = ContainsJudge()
    mixed = Weighted({"format": MathVerify(), "judge": judge, "exact": IntegerMatch()}, correct_from="exact")
    assert watched_pair(mixed) == ("judge", "exact")  # the verifier that decides correctness, before "format"
    assert watched_pair(mixed, verifier="format") == ("judge", "format")
    assert watched_pair(PerSource({"gsm8k": IntegerMatch()}, default=mixed)) == ("judge", "exact")
    with pytest.raises(RecipeError) as err:
        watched_pair(IntegerMatch())
    assert str(err.value) == ("trainer.callbacks: RewardHackingGuard finds no model-served reward beside a verifier "
                              "to watch (model.reward is IntegerMatch, no rllight.rewards.Weighted); put both in a "
                              "rllight.rewards.Weighted (a verifier of weight 0 is scored and logged without training "
                              "on it) and name them, or remove the guard")
    with pytest.raises(RecipeError, match=r"\(model_reward: 'judge2'\) finds no .*Weighted components format "
                                          r"\(verifier\), judge \(model reward\), exact \(verifier\)\)"):
        watched_pair(mixed, model_reward="judge2")


# ------------------------------------------------------------------------------------------ runs of the tiny model
def _run(tmp_path, tiny_model_dir, judge_per_step: float, *args: str, judge: dict | None = None,
         exact_per_step: float = -1.0, **guard):
    """grpo.yaml on the tiny model with a ``Weighted`` reward of a model reward ``judge`` (weight 1) whose mean moves by
    ``judge_per_step`` a step (or the reward ``judge`` gives) and a verifier ``exact`` (weight 0) whose mean moves by
    ``exact_per_step`` (``reward_fixtures.Drifting``), the guard in trainer.callbacks; the CLI, its logger capturing."""
    judge = judge or {"class_path": "reward_fixtures.Drifting", "init_args": {"per_step": judge_per_step}}
    reward = {"class_path": "rllight.rewards.Weighted", "init_args": {
        "rewards": {"judge": judge,
                    "exact": {"class_path": "reward_fixtures.Drifting",
                              "init_args": {"per_step": exact_per_step, "decides": True}}},
        "weights": {"judge": 1.0, "exact": 0.0}, "correct_from": "exact"}}
    callbacks = os.path.join(tmp_path, "callbacks.yaml")
    with open(callbacks, "w") as f:
        yaml.safe_dump({"trainer": {"callbacks": [{"class_path": "rllight.callbacks.RewardHackingGuard",
                                                   "init_args": {"window": 3, **guard}}]}}, f)
    cli = build(os.path.join(RECIPES, "grpo.yaml"), tiny_overrides(tmp_path, tiny_model_dir, reward=reward), callbacks,
                *args)
    cli.trainer.loggers = [CaptureLogger(tmp_path)]
    return cli


def test_a_judge_that_rises_while_the_verifier_falls_warns_and_the_run_goes_on(tmp_path, tiny_model_dir, caplog):
    cli = _run(tmp_path, tiny_model_dir, 1.0, "--trainer.max_steps", "4")
    with caplog.at_level(logging.WARNING):
        cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    assert cli.trainer.global_step == 4
    warned = [r.getMessage() for r in caplog.records if "reward hacking" in r.getMessage()]
    assert len(warned) == 1  # at step 3; step 4 starts a new window
    assert warned[0].startswith("reward hacking: over RL steps 1-3 the model reward 'judge' rose by ")
    assert "while the verifier 'exact' fell by " in warned[0] and warned[0].endswith("action: stop ends the run)")
    steps = [c for c in cli.trainer.loggers[0].calls if "train/reward/judge" in c]
    assert len(steps) == 4
    assert all("train/reward/agreement/judge_vs_exact/verifier_at_top" in c for c in steps)
    assert steps[2]["train/guard/reward_hacking/model_change"] > 1.0  # about 2 over steps 1-3
    assert steps[2]["train/guard/reward_hacking/verifier_change"] < -1.0


def test_an_honest_reward_that_is_the_verifier_stays_silent(tmp_path, tiny_model_dir, caplog):
    """The model reward equals the verifier, which falls: the guard sees both fall and says nothing; the agreement is
    perfect wherever it is defined."""
    cli = _run(tmp_path, tiny_model_dir, -1.0, "--trainer.max_steps", "4", action="stop")
    with caplog.at_level(logging.WARNING):
        cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    assert cli.trainer.global_step == 4 and ending() is None
    assert not [r for r in caplog.records if "reward hacking" in r.getMessage()]
    steps = [c for c in cli.trainer.loggers[0].calls if "train/reward/judge" in c]
    assert [c["train/reward/judge"] for c in steps] == [c["train/reward/exact"] for c in steps]
    assert all(c.get("train/reward/agreement/judge_vs_exact/rank_corr", 1.0) == pytest.approx(1.0) for c in steps)
    last = steps[-1]
    assert last["train/guard/reward_hacking/model_change"] == last["train/guard/reward_hacking/verifier_change"]


def test_a_judge_unrelated_to_the_verifier_stops_the_run_on_agreement(tmp_path, tiny_model_dir):
    """A judge whose score is a hash of the response (``reward_fixtures.Unrelated``) beside a verifier that neither
    rises nor falls by itself: the agreement test stops the run once it holds 3 correlations, and the step that
    stopped it is logged with the others (its metrics are sent before the stop is raised)."""
    cli = _run(tmp_path, tiny_model_dir, 0.0, "--trainer.max_steps", "12", "--trainer.enable_checkpointing", "true",
               judge={"class_path": "reward_fixtures.Unrelated"}, exact_per_step=0.0, action="stop")
    with pytest.raises(RunStopped, match=r"^reward hacking: over RL steps \d+-(\d+) the model reward 'judge' did not "
                                         r"rank responses as the verifier 'exact' does \(rank correlation -?[\d.]+ ± "
                                         r"[\d.]+ a step, not clearly above min_agreement 0;.* RL step \1 .*is saved"):
        cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    steps = [c for c in cli.trainer.loggers[0].calls if "train/reward/judge" in c]
    corrs = [c["train/reward/agreement/judge_vs_exact/rank_corr"] for c in steps
             if "train/reward/agreement/judge_vs_exact/rank_corr" in c]
    assert len(corrs) == 3 and steps[-1]["train/guard/reward_hacking/agreement_lower"] <= 0


def test_stop_ends_the_run_saved_with_one_line(tmp_path, tiny_model_dir):
    cli = _run(tmp_path, tiny_model_dir, 1.0, "--trainer.max_steps", "12", "--trainer.enable_checkpointing", "true",
               action="stop")
    with pytest.raises(RunStopped, match=r"^reward hacking: over RL steps 1-3 the model reward 'judge' rose by "
                                         r"[\d.]+ while the verifier 'exact' fell by [\d.]+ .*; 'exact' was highest "
                                         r"at RL step 1 \(.*\), which no checkpoint keeps .*RL step 3 \(3 optimizer "
                                         r"updates\) is saved: resume with: rllight .* --ckpt_path \S+$") as stopped:
        cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    assert "\n" not in str(stopped.value)
    path = str(stopped.value).rsplit("--ckpt_path ", 1)[1]
    assert os.path.basename(path) == "stopped-step=3.ckpt" and os.path.isfile(path)
    assert torch.load(path, weights_only=True)["global_step"] == 3


def test_stop_names_the_checkpoint_a_model_checkpoint_keeps_by_the_verifier(tmp_path, tiny_model_dir):
    """A recipe that keeps its best checkpoint by the verifier (a ModelCheckpoint monitoring train/reward/exact, mode
    max): the stop's line names it, the first step's, where the verifier was highest."""
    cli = _run(tmp_path, tiny_model_dir, 1.0, "--trainer.max_steps", "12", "--trainer.enable_checkpointing", "true",
               "--trainer.callbacks+", "lightning.pytorch.callbacks.ModelCheckpoint",
               "--trainer.callbacks.monitor", "train/reward/exact", "--trainer.callbacks.mode", "max",
               "--trainer.callbacks.every_n_train_steps", "1", "--trainer.callbacks.dirpath", str(tmp_path / "best"),
               action="stop")
    with pytest.raises(RunStopped, match=r"; the best checkpoint by 'exact' is (\S+) \(train/reward/exact [-\d.]+\) "
                                         r"\(trainer\.callbacks.*RL step 3 .* is saved") as stopped:
        cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    best = str(stopped.value).split("the best checkpoint by 'exact' is ", 1)[1].split(" ", 1)[0]
    assert os.path.isfile(best) and os.path.dirname(best) == str(tmp_path / "best")
    assert torch.load(best, weights_only=True)["global_step"] == 1
