"""A reward that fails on every sample stops the run after a few batches, and reference answers the reward
can never match are refused before the model loads: both as a user meets them, through the CLI."""

import json
import os

import pytest
import yaml

from conftest import RECIPES
from helpers import fit_in_child, tiny_overrides
from rllight.app.cli import main


@pytest.mark.slow
def test_a_reward_that_fails_on_every_sample_stops_the_run_with_one_line(tmp_path, tiny_model_dir):
    overlay = tiny_overrides(tmp_path, tiny_model_dir, reward={"class_path": "user_strategies.AlwaysFails"})
    run = fit_in_child("grpo.yaml", "--config", overlay, "--trainer.max_steps", "20",
                       "--model.guards.max_failed_reward_steps", "2", timeout=600)
    assert run.returncode == 2, run.stderr[-3000:]
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith("rllight: error: model.reward: AlwaysFails failed on every sample of 2 batches in a row")
    assert "Traceback" not in run.stderr


def test_a_failed_batch_between_good_ones_only_warns(tiny_model_dir, tmp_path):
    from helpers import build
    from conftest import RECIPES

    cli = build(f"{RECIPES}/grpo.yaml", tiny_overrides(tmp_path, tiny_model_dir),
                "--model.guards.max_failed_reward_steps", "2")
    producer = cli.model.producer
    producer.count_failed_reward_batch(True)
    producer.count_failed_reward_batch(False)  # a good batch resets the count
    producer.count_failed_reward_batch(True)
    assert producer.failed_reward_steps == 1
    with pytest.raises(Exception, match="2 batches in a row"):
        producer.count_failed_reward_batch(True)


@pytest.mark.slow
def test_answers_the_reward_can_never_match_are_refused_before_the_model_loads(tmp_path, tiny_model_dir):
    data = tmp_path / "train.jsonl"
    rows = [{"prompt": "1+1?", "answer": "2"}, {"prompt": "3-1?", "answer": "2.0"}]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    overlay = tiny_overrides(tmp_path, tiny_model_dir, reward={"class_path": "rllight.rewards.IntegerMatch"})
    run = fit_in_child("grpo.yaml", "--config", overlay, "--data.train_files", f"[{data}]", timeout=600)
    assert run.returncode == 2, run.stderr[-3000:]
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith("rllight: error: ") and str(data) in last and "row 2" in last and "'2.0'" in last
    assert "IntegerMatch" in last


@pytest.mark.slow
def test_a_reward_that_hangs_costs_its_sample_not_the_run(tmp_path, tiny_model_dir):
    """Through the CLI, rewards in a worker process with a 2 s timeout: a reward that hangs on one response
    gives it 0, counted in train/reward/timeouts, and the run finishes."""
    import csv

    overlay = tiny_overrides(tmp_path, tiny_model_dir,
                             reward={"class_path": "user_strategies.HangsOnce"},
                             reward_runner={"class_path": "rllight.rewards.RewardRunner",
                                            "init_args": {"workers": 1, "timeout_seconds": 2.0}})
    run = fit_in_child("grpo.yaml", "--config", overlay, "--trainer.max_steps", "2",
                       "--trainer.logger", "lightning.pytorch.loggers.CSVLogger",
                       "--trainer.logger.save_dir", str(tmp_path / "logs"), timeout=600,
                       RLLIGHT_TEST_HANG_ONCE=str(tmp_path / "hung"))
    assert run.returncode == 0, run.stderr[-3000:]
    (metrics,) = list((tmp_path / "logs").rglob("metrics.csv"))
    rows = list(csv.DictReader(open(metrics)))
    timeouts = [float(r["train/reward/timeouts"]) for r in rows if r.get("train/reward/timeouts")]
    assert sum(timeouts) == 1  # the one hung sample; the others were scored


def test_the_reward_preflight_refuses_a_reward_that_cannot_tell_right_from_wrong(tmp_path, tiny_model_dir):
    overlay = tiny_overrides(tmp_path, tiny_model_dir, reward={"class_path": "user_strategies.DigitReward"},
                             reward_preflight=2)
    run = fit_in_child("grpo.yaml", "--config", overlay, timeout=600)
    assert run.returncode == 2, run.stderr[-3000:]
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith("rllight: error: ") and "DigitReward" in last and "row" in last


def test_the_reward_preflight_runs_before_the_evaluation_that_precedes_training(tmp_path, tiny_model_dir, capsys,
                                                                                monkeypatch):
    """With evaluate_before_after the pre-flight's one line comes before the model loads, not after an evaluation
    of minutes."""
    from rllight.module import RLModule

    loads = []
    monkeypatch.setattr(RLModule, "configure_model", lambda self: loads.append(1))
    overlay = tiny_overrides(tmp_path, tiny_model_dir, reward={"class_path": "user_strategies.DigitReward"},
                             reward_preflight=2)
    with open(overlay) as f:
        cfg = yaml.safe_load(f)
    cfg["evaluate_before_after"] = True
    cfg["trainer"]["limit_val_batches"] = None
    with open(overlay, "w") as f:
        yaml.safe_dump(cfg, f)
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", os.path.join(RECIPES, "grpo.yaml"), "--config", overlay])
    assert exit_info.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert "DigitReward" in last and "--model.reward_preflight 0" in last
    assert loads == []  # no model loaded, so no evaluation ran
