"""tools/model_reward_measure.py: a judge recipe whose model reward rises while its verifier falls is stopped by its
RewardHackingGuard; the tool evaluates the stopped checkpoint without another update, records how the run ended with
the guard's line, and a rerun skips the seed it has."""

import json
import os

import pytest
import yaml
from helpers import load_tool

from conftest import RECIPES
from rllight.app.records import load_records

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _drifting(per_step: float, decides: bool = False) -> dict:
    return {"class_path": "reward_fixtures.Drifting", "init_args": {"per_step": per_step, "decides": decides}}


@pytest.fixture
def hacked_overlay(tmp_path, tiny_model_dir, monkeypatch) -> str:
    """The judge recipe on the tiny model, its judge a reward whose mean rises by 1 a step while the verifier's falls
    by 1 (``reward_fixtures.Drifting``), the guard fitting 3 steps; checkpoints on, so that the stop is saved."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([TESTS, os.environ.get("PYTHONPATH", "")]))
    path = tmp_path / "hacked.yaml"
    path.write_text(yaml.safe_dump({
        "trainer": {"max_steps": 12, "accelerator": "cpu", "precision": "32-true", "enable_progress_bar": False,
                    "callbacks": [{"class_path": "rllight.callbacks.RewardHackingGuard",
                                   "init_args": {"window": 3, "min_change": 0.1, "action": "stop"}}]},
        "model": {"model": {"class_path": "rllight.models.HFModel", "init_args": {"path": tiny_model_dir}},
                  "rollout": {"init_args": {"max_new_tokens": 4}},
                  "sampler": {"init_args": {"group_size": 2}},
                  "reward": {"class_path": "rllight.rewards.Weighted", "init_args": {
                      "rewards": {"judge": _drifting(1.0), "exact": _drifting(-1.0, decides=True)},
                      "weights": {"judge": 1.0, "exact": 0.0}, "correct_from": "exact"}},
                  "reward_runner": {"class_path": "rllight.rewards.RewardRunner", "init_args": {"workers": 0}},
                  "reward_preflight": 0},
        "data": {"batch_size": 2, "val_size": 4, "task": {"class_path": "rllight.data.ArithmeticTask",
                                                          "init_args": {"num_train": 32, "num_val": 4}}},
    }))
    return str(path)


@pytest.mark.slow  # three `rllight fit` child processes
def test_a_run_the_guard_stops_is_evaluated_where_it_stopped_and_recorded_with_its_line(tmp_path, hacked_overlay,
                                                                                       monkeypatch):
    tool = load_tool("model_reward_measure")
    out, record = tmp_path / "measure", tmp_path / "records" / "judge-guard.json"
    argv = ["--recipe", os.path.join(RECIPES, "judge-quickstart.yaml"), "--seeds", "0", "--out", str(out),
            "--config", hacked_overlay, "--record", str(record)]
    assert tool.main(argv) == 0
    result = json.loads((out / "seed0" / "result.json").read_text())
    assert result["returncode"] == 2 and result["evaluate_returncode"] == 0
    assert result["stop"]["step"] == 3 and os.path.basename(result["stop"]["path"]) == "stopped-step=3.ckpt"
    assert result["stop"]["reason"].startswith("reward hacking: over RL steps 1-3 the model reward 'judge' rose by ")
    # "after" is the stopped checkpoint's: the evaluation after training of the second process, at its RL step 3,
    # made without an update (the process trained to the updates the checkpoint had made).
    evaluate_log = (out / "seed0" / "evaluate.log").read_text()
    assert f"finished: 3 RL steps, {result['stop']['updates']} optimizer updates" in evaluate_log
    versions = sorted(os.listdir(out / "seed0" / "lightning_logs"))
    assert versions == ["version_0", "version_1"]
    assert sorted(os.listdir(out / "seed0" / "lightning_logs" / "version_0" / "evaluation")) == [
        "val_step0.json", "val_step0_greedy.json", "val_step0_greedy_rows.jsonl", "val_step0_rows.jsonl"]
    assert "val_step3_greedy.json" in os.listdir(out / "seed0" / "lightning_logs" / "version_1" / "evaluation")
    (rec,) = load_records(str(record.parent))
    (row,) = rec["rows"]
    assert row["ended"] == "stopped at RL step 3" and row["guard_line"] == result["stop"]["reason"]
    metrics = result["summary"]["metrics"]["greedy accuracy"]
    assert (row["greedy_before"], row["greedy_after"]) == (round(metrics["before"], 3), round(metrics["after"], 3))
    assert rec["summary"]["stopped"] == 1

    def no_fit(*args, **kwargs):
        raise AssertionError("a seed with a result.json ran again")

    monkeypatch.setattr(tool, "fit", no_fit)
    assert tool.main(argv) == 0  # the seed's result is read back


def test_the_stop_line_is_read_from_a_runs_output():
    tool = load_tool("model_reward_measure")
    output = ("rllight: step 3/12 ...\nrllight: error: reward hacking: over RL steps 1-3 the model reward 'judge' "
              "rose by 2 while the verifier 'exact' fell by 2 (fits); 'exact' was highest at RL step 1 (0.5); RL "
              "step 3 (6 optimizer updates) is saved: resume with: rllight fit --config r.yaml --ckpt_path "
              "runs/x/stopped-step=3.ckpt\n")
    assert tool.stop_of(output) == {
        "reason": "reward hacking: over RL steps 1-3 the model reward 'judge' rose by 2 while the verifier 'exact' "
                  "fell by 2 (fits); 'exact' was highest at RL step 1 (0.5)",
        "step": 3, "updates": 6, "path": "runs/x/stopped-step=3.ckpt"}
    assert tool.stop_of("rllight: Ctrl-C: stopped after RL step 2 (4 optimizer updates); resume with: ...") is None
