"""tools/async_staleness.py trains each loss at each max_staleness through the worker and tabulates the runs
(a tiny model, a few steps: the pipeline and the staleness it reports, not the methods)."""

import json
import os
import subprocess
import sys

import pytest
import yaml
from helpers import TESTS

TOOL = os.path.join(os.path.dirname(TESTS), "tools", "async_staleness.py")


@pytest.mark.slow
def test_async_staleness_runs_each_loss_and_staleness_and_reports_what_it_measured(tmp_path, tiny_model_dir):
    extra = tmp_path / "tiny.yaml"
    # A reward the random model earns some of (digits in the response), so that its policy moves.
    extra.write_text(yaml.safe_dump({"model": {
        "model": {"class_path": "rllight.models.HFModel", "init_args": {"path": tiny_model_dir}},
        "reward": {"class_path": "user_strategies.DigitReward"}, "reward_preflight": 0}}))
    out = tmp_path / "out"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([TESTS, os.environ.get("PYTHONPATH", "")]))
    run = subprocess.run([sys.executable, TOOL, "--steps", "2", "--staleness", "0,1", "--algos", "grpo-tis",
                          "--val-size", "4", "--max-new-tokens", "4", "--lr", "0.01", "--parallel", "2",
                          "--config", str(extra), "--out", str(out)],
                         env=env, capture_output=True, text=True, timeout=900, check=False)
    assert run.returncode == 0, run.stderr[-3000:] + run.stdout[-3000:]
    results = {r["staleness"]: r for r in json.loads((out / "async_staleness.json").read_text())["results"]}
    # Synchronous: every step on-policy. One ahead: steps 0 and 1 train on rollouts 0 and 1 version old.
    assert (results[0]["staleness_mean"], results[0]["staleness_max"]) == (0, 0)
    assert (results[1]["staleness_mean"], results[1]["staleness_max"]) == (0.5, 1)
    assert results[0]["lag_max"] < 1e-3 < results[1]["lag_max"]  # the policy moved while rollouts waited
    for r in results.values():
        assert r["steps_logged"] == 2 and r["finite"] and r["num_val"] == 4
        config = yaml.safe_load(open(os.path.join(r["log_dir"], "config.yaml")))
        assert config["model"]["policy_loss"]["class_path"] == "rllight.strategies.TruncatedIS"
        assert config["model"]["minibatch_size"] == 32  # one update per step
    table = (out / "async_staleness.md").read_text()
    assert "| grpo-tis | 1 |" in table and "| 0.50 / 1 |" in table
    # --skip-done resumes an interrupted table: runs that finished with the same settings are not run again.
    again = subprocess.run([*run.args, "--skip-done"], env=env, capture_output=True, text=True, timeout=300,
                           check=False)
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stdout.count("finished before with the same settings, reused") == 2
    assert (out / "async_staleness.md").read_text() == table
    with pytest.raises(subprocess.CalledProcessError):
        subprocess.run([sys.executable, TOOL, "--algos", "nope"], capture_output=True, check=True)
