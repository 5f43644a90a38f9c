"""``rllight validate`` evaluates a recipe's model without training: sampling settings of its own, avg@k /
pass@k / maj@k per data source, a JSON of every number and a per-row file of the responses."""

import itertools
import json
import os
import subprocess
import sys

import pytest

from helpers import TESTS, tiny_overrides
from conftest import RECIPES


@pytest.mark.slow
def test_rllight_validate_reports_pass_at_k_and_writes_the_rows(tmp_path, tiny_model_dir):
    overlay = tiny_overrides(tmp_path, tiny_model_dir, reward={"class_path": "user_strategies.EvenLength"})
    cmd = [sys.executable, "-m", "rllight.cli", "validate", "--config", os.path.join(RECIPES, "grpo.yaml"),
           "--config", overlay, "--trainer.limit_val_batches", "null", "--model.evaluation.n", "4",
           "--model.evaluation.temperature", "1.0", "--model.evaluation.ks", "[1, 2, 4]"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([TESTS, os.environ.get("PYTHONPATH", "")]))
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    (summary_path,) = list(tmp_path.rglob("val_step0.json"))
    summary = json.loads(summary_path.read_text())
    rows = [json.loads(line) for line in open(summary_path.with_name("val_step0_rows.jsonl"))]
    assert summary["n"] == 4 and len(rows) == 4 and all(len(r["correct"]) == 4 for r in rows)  # val_size 4
    # pass@k by brute force over the rows' own 0/1 outcomes: the share of k-subsets with a success.
    for k in (1, 2, 4):
        per_row = [sum(any(s) for s in itertools.combinations(r["correct"], k)) / len(list(itertools.combinations(
            r["correct"], k))) for r in rows]
        assert summary["metrics"][f"val/pass@{k}"] == pytest.approx(sum(per_row) / len(per_row))
        assert f"val/arithmetic/pass@{k}" in summary["metrics"]  # per data source
    avg = sum(sum(r["correct"]) for r in rows) / 16
    assert 0 < avg < 1  # mixed outcomes, so pass@k and avg@k can differ
    assert summary["metrics"]["val/avg@4"] == pytest.approx(avg)
    assert summary["metrics"]["val/pass@4"] > summary["metrics"]["val/pass@1"]
