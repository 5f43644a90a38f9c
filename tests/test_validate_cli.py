"""``rllight validate`` evaluates a recipe's model without training: sampling settings of its own, avg@k /
pass@k / maj@k per data source, a JSON of every number and a per-row file of the responses, and the compact table
of the before/after evaluation, printed and saved; on an exported model it gives the in-run evaluation's numbers."""

import itertools
import json
import os
import subprocess
import sys

import pytest

from helpers import TESTS, tiny_overrides
from conftest import RECIPES
from rllight.app.cli import RLLightCLI


@pytest.mark.slow
def test_rllight_validate_reports_pass_at_k_and_writes_the_rows(tmp_path, tiny_model_dir):
    overlay = tiny_overrides(tmp_path, tiny_model_dir, reward={"class_path": "user_strategies.EvenLength"})
    cmd = [sys.executable, "-m", "rllight", "validate", "--config", os.path.join(RECIPES, "grpo.yaml"),
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


def test_validate_of_the_export_equals_the_runs_own_evaluation_of_the_same_weights(tmp_path, tiny_model_dir, capsys):
    """Sampled (4 answers at temperature 1, and a greedy one) with a sampling seed: the run's evaluation after training
    and ``rllight validate`` of its export, in a folder of its own, give the same responses and every number; validate
    prints them as the compact table (not Lightning's), saves it, and its overall column is the before/after
    table's "after"."""
    overlay = tiny_overrides(tmp_path, tiny_model_dir, reward={"class_path": "user_strategies.EvenLength"},
                             export_dir=str(tmp_path / "model"))
    recipe = ["--config", os.path.join(RECIPES, "grpo.yaml"), "--config", overlay,
              "--trainer.limit_val_batches", "null", "--model.evaluation.n", "4", "--model.evaluation.temperature",
              "1.0", "--model.evaluation.ks", "[1, 2, 4]", "--model.evaluation.also_greedy", "true",
              "--model.evaluation.sampling_seed", "7"]
    RLLightCLI(args=["fit", *recipe, "--evaluate_before_after", "true"])
    capsys.readouterr()
    runs_own = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    # The recipe's own default_root_dir, as the command a fit prints has it: validate writes beside the run's files
    # (in <default_root_dir>/validate), never over them (its val_step0 is not the run's evaluation before training).
    RLLightCLI(args=["validate", *recipe, "--model.model.path", str(tmp_path / "model")])
    assert {p: p.read_bytes() for p in runs_own} == runs_own
    assert [p for p in tmp_path.rglob("*") if p.is_file() and p not in runs_own and "validate" not in p.parts] == []
    out = capsys.readouterr().out
    for suffix in ("", "_greedy"):  # in the run: after its 2 steps; validate: step 0 of the exported weights
        in_run = json.loads((tmp_path / "evaluation" / f"val_step2{suffix}.json").read_text())
        offline = json.loads((tmp_path / "validate" / "evaluation" / f"val_step0{suffix}.json").read_text())
        assert offline["metrics"] == in_run["metrics"], suffix
        rows = [[json.loads(line)["responses"] for line in open(folder / "evaluation" / f"{name}{suffix}_rows.jsonl")]
                for folder, name in ((tmp_path, "val_step2"), (tmp_path / "validate", "val_step0"))]
        assert rows[0] == rows[1]
    metrics = json.loads((tmp_path / "validate" / "evaluation" / "val_step0.json").read_text())["metrics"]
    assert 0 < metrics["val/avg@4"] < 1  # mixed outcomes: the samples, and so the seed, decide the numbers
    table = json.loads((tmp_path / "validate" / "validate_summary.json").read_text())["table"]
    assert list(table) == ["all", "arithmetic"]
    assert table["arithmetic"]["pass@2"] == {"value": metrics["val/arithmetic/pass@2"],
                                             "se": metrics["val/arithmetic/pass@2_se"]}
    greedy = json.loads((tmp_path / "validate" / "evaluation" / "val_step0_greedy.json").read_text())["metrics"]
    assert table["all"]["greedy accuracy"]["value"] == greedy["val/greedy/avg@1"]
    after = json.loads((tmp_path / "eval_summary.json").read_text())["metrics"]
    for label in ("greedy accuracy", "avg@1", "avg@4", "pass@2", "pass@4", "maj@4"):
        assert table["all"][label]["value"] == after[label]["after"], label
    avg4 = next(line for line in out.splitlines() if line.split()[:1] == ["avg@4"])
    assert avg4.split()[1:4] == [f"{metrics['val/avg@4']:.3f}", "±", f"{metrics['val/avg@4_se']:.3f}"]
    assert "rllight: evaluation of 4 prompts, 4 sampled answers each at temperature 1, and one greedy answer" in out
    assert "pass@k: the chance that at least one of k samples is correct" in out
    assert "DataLoader 0" not in out  # Lightning's table of every key
