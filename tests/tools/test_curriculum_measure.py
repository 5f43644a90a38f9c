"""tools/curriculum_measure.py on the tiny model: both arms of the reasoning-gym recipe (shortened) at one seed, the
pools arm drawing through the curriculum and the uniform arm not, each task's held-out accuracy in the record as
the runs saved it, and the printed line agreeing with the record."""

import json

import pytest
import yaml
from helpers import load_tool
from test_tools import agrees, recorded

pytest.importorskip("reasoning_gym")


def _overlay(tmp_path, model_dir: str) -> str:
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump({
        "trainer": {"max_steps": 2, "accelerator": "cpu", "precision": "32-true", "enable_progress_bar": False},
        "model": {"model": {"class_path": "rllight.models.HFModel", "init_args": {"path": model_dir}},
                  "rollout": {"init_args": {"max_new_tokens": 4}}, "sampler": {"init_args": {"group_size": 2}},
                  "batching": {"minibatch_size": None, "micro_batch_size": 4},
                  "reward_runner": {"class_path": "rllight.rewards.RewardRunner", "init_args": {"workers": 0}},
                  "evaluation": {"n": 2, "ks": [1, 2], "max_new_tokens": 4}},
        "data": {"batch_size": 2, "val_batch_size": 8, "val_size": 4,
                 "task": {"init_args": {"tasks": {"chain_sum": {}, "leg_counting": {}}, "train_size": 12,
                                        "val_size": 4}}}}))
    return str(path)


def test_both_arms_run_and_the_record_holds_each_tasks_accuracy(tmp_path, tiny_model_dir, capsys):
    out, record = tmp_path / "runs", tmp_path / "records" / "curriculum-reasoning-gym.json"
    code = load_tool("curriculum_measure").main(["--seeds", "3", "--config", _overlay(tmp_path, tiny_model_dir),
                                                 "--out", str(out), "--record", str(record), "--shared", "no"])
    assert code == 0
    machine, last = capsys.readouterr().out.strip().splitlines()[-2:]
    assert machine.startswith("machine: ")
    written = recorded(record, "curriculum_measure")
    uniform, pools = written["rows"]
    assert (uniform["arm"], pools["arm"]) == ("uniform", "pools") and uniform["seed"] == pools["seed"] == 3
    assert uniform["steps"] == pools["steps"] == 2 and uniform["tokens"] > 0 and pools["tokens"] > 0
    # the pools arm drew its 2 x 2 prompts through the curriculum; the uniform arm has no curriculum
    assert pools["hard_draws"] + pools["normal_draws"] + pools["easy_draws"] == 4
    assert uniform["hard_draws"] is None
    saved = yaml.safe_load(next((out / "pools-s3").rglob("config.yaml")).read_text())
    assert saved["data"]["curriculum"]["class_path"] == "rllight.data.DifficultyPools"
    assert saved["seed_everything"] == 3
    assert not yaml.safe_load(next((out / "uniform-s3").rglob("config.yaml")).read_text())["data"].get("curriculum")
    # each task's accuracy after training is the one the run saved for its rows
    for arm, row in (("uniform", uniform), ("pools", pools)):
        evaluation = next((out / f"{arm}-s3").rglob("evaluation"))
        last_step = max(evaluation.glob("val_step*_greedy_rows.jsonl"), key=lambda p: int(p.name[8:].split("_")[0]))
        rows = [json.loads(line) for line in last_step.read_text().splitlines()]
        for task in ("chain_sum", "leg_counting"):
            mine = [r for r in rows if r["data_source"] == task]
            assert mine and row[f"{task}_after"] == pytest.approx(
                sum(sum(r["correct"]) / len(r["correct"]) for r in mine) / len(mine), abs=5e-4), task
    assert written["summary"]["seeds"] == 1
    agrees(written["summary"], last)
    # a second run into the same folder is refused: runs are never overwritten
    with pytest.raises(SystemExit):
        load_tool("curriculum_measure").main(["--seeds", "3", "--out", str(out)])
