"""tools/async_staleness.py: every loss name it offers builds a recipe the CLI accepts, bad arguments are refused,
and one loss trains through the worker at max_staleness 0 and 1 and is tabulated (a tiny model, two steps: the
pipeline and the staleness it reports, not the methods)."""

import json
import os
import shutil
import subprocess
import sys

import pytest
import yaml
from helpers import TESTS, build, load_tool

ROOT = os.path.dirname(TESTS)
TOOL = os.path.join(ROOT, "tools", "async_staleness.py")


def _tool():
    return load_tool("async_staleness")


def test_every_loss_name_builds_a_run_the_cli_accepts(tmp_path):
    tool = _tool()
    assert {"grpo", "grpo-tis", "vespo", "vespo-engine", "vespo-tis", "grpo-token-mask", "grpo-seq-mask",
            "grpo-icepop"} <= set(tool.LOSSES)
    args = tool.parse_args(["--algos", ",".join(tool.LOSSES), "--staleness", "0,4", "--out", str(tmp_path)])
    assert args.algos == list(tool.LOSSES) and args.staleness == [0, 4]
    masks, weights = {}, {}
    for algo in tool.LOSSES:
        path = tmp_path / f"{algo}.yaml"
        path.write_text(yaml.safe_dump(tool.overlay(args, algo, 4, str(tmp_path / algo))))
        module = build(os.path.join(ROOT, "recipes", "quickstart.yaml"), str(path)).model
        spec = tool.LOSSES[algo]
        assert type(module.policy_loss).__name__ == spec["class_path"].rsplit(".", 1)[1]
        assert module.rollout.max_staleness == 4
        if spec["class_path"].endswith("MaskedIS"):
            masks[algo] = (module.policy_loss.mask, module.policy_loss.low, module.policy_loss.high)
        if algo.startswith("vespo"):  # VESPO itself, or VESPO inside TruncatedIS
            weights[algo] = getattr(module.policy_loss, "loss", module.policy_loss).weight_against
    # MaskedIS's defaults: [0.5, 2] for the token and sequence masks, IcePop's [0.5, 5].
    assert masks == {"grpo-token-mask": ("token", 0.5, 2.0), "grpo-seq-mask": ("sequence", 0.5, 2.0),
                     "grpo-icepop": ("icepop", 0.5, 5.0)}
    # VESPO's default weight (the trainer's old log-probs), note 002's (the sampler's), and the default under TIS
    assert weights == {"vespo": "trainer", "vespo-engine": "engine", "vespo-tis": "trainer"}


@pytest.mark.parametrize("argv, message", [
    (["--algos", "grpo,nope"], "--algos: unknown nope"),
    (["--staleness", "0,x"], "--staleness expects comma-separated integers"),
    (["--staleness", "-1"], "--staleness values must be >= 0"),
    (["--steps", "0"], "--steps must be >= 1"),
    (["--config", "missing.yaml"], "--config 'missing.yaml': no such file"),
])
def test_bad_arguments_are_refused_with_one_line(argv, message, capsys):
    with pytest.raises(SystemExit):
        _tool().parse_args(argv)
    assert message in capsys.readouterr().err


@pytest.mark.slow
def test_async_staleness_runs_a_masked_loss_one_step_stale_and_reports_it(tmp_path, tiny_model_dir, capsys):
    extra = tmp_path / "tiny.yaml"
    # A reward the random model earns some of (digits in the response), so that its policy moves.
    extra.write_text(yaml.safe_dump({"model": {
        "model": {"class_path": "rllight.models.HFModel", "init_args": {"path": tiny_model_dir}},
        "reward": {"class_path": "user_strategies.DigitReward"}, "reward_preflight": 0}}))
    out = tmp_path / "out"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([TESTS, os.environ.get("PYTHONPATH", "")]))
    argv = ["--steps", "2", "--staleness", "1", "--algos", "grpo-seq-mask", "--batch-size", "2", "--group-size",
            "4", "--val-size", "2", "--max-new-tokens", "4", "--lr", "0.01", "--parallel", "1",
            "--config", str(extra), "--out", str(out)]
    keep = ["--keep", str(tmp_path / "kept")]
    record = tmp_path / "records" / "x.json"
    run = subprocess.run([sys.executable, TOOL, *argv, *keep, "--record", str(record)], env=env, capture_output=True,
                         text=True, timeout=900, check=False)
    assert run.returncode == 0, run.stderr[-3000:] + run.stdout[-3000:]
    results = {r["staleness"]: r for r in json.loads((out / "async_staleness.json").read_text())["results"]}
    # One ahead: steps 0 and 1 train on rollouts 0 and 1 version old. (k = 0, synchronous, is the worker's
    # on-policy path, tested in tests/rollout/test_worker.py.)
    assert (results[1]["staleness_mean"], results[1]["staleness_max"]) == (0.5, 1)
    assert 1e-3 < results[1]["lag_max"]  # the policy moved while a rollout waited
    for r in results.values():
        assert r["steps_logged"] == 2 and r["finite"] and r["num_val"] == 2
        config = yaml.safe_load(open(os.path.join(r["log_dir"], "config.yaml")))
        assert config["model"]["policy_loss"]["init_args"]["mask"] == "sequence"
        assert config["model"]["batching"]["minibatch_size"] == 8  # one update per step
        assert config["trainer"]["precision"] == "32-true"
    table = (out / "async_staleness.md").read_text()
    assert "| grpo-seq-mask | 1 | 0 |" in table and "| 0.50 / 1 |" in table
    assert table.strip() in run.stdout  # the report is printed too
    machine, last = run.stdout.strip().splitlines()[-2:]
    assert machine.startswith("machine: ") and last == "runs_finished=1/1"
    # The record: the run's row of the table as printed, the runs that finished in the summary.
    from rllight.app.records import load_records, parse_value

    (written,) = load_records(str(record.parent))
    assert written["command"].startswith(".venv/bin/python tools/async_staleness.py ")
    (row,) = written["rows"]
    assert sorted(written["summary"]) == ["before", "grpo_seq_mask_k1"]  # the accuracy before and the run's gain
    assert written["summary"]["before"] == pytest.approx(row["accuracy_before"], abs=5e-4)
    assert written["summary"]["grpo_seq_mask_k1"] == pytest.approx(row["difference"], abs=5e-4)
    assert (row["algo"], row["staleness"], row["staleness_mean"], row["staleness_max"]) == ("grpo-seq-mask", 1, 0.5, 1)
    assert row["seeds"] == "0" and row["difference_min"] == row["difference_max"] == row["difference"]  # one seed
    (line,) = [line for line in table.splitlines() if line.startswith("| grpo-seq-mask | 1 | 0 |")]
    assert (f"| {row['accuracy_before']:.3f} → {row['accuracy_after']:.3f} ({row['difference']:+.3f} ± "
            f"{row['difference_se']:.3f}) |") in line
    cells = [cell.strip() for cell in line.strip("|").split("|")]
    assert [parse_value(c) for c in cells[6:]] == [row["lag_max"], row["grad_norm_max"], "yes"]
    # --skip-done resumes an interrupted table: runs that finished with the same settings are not run again
    # (in this process: nothing is started, only the finished runs' logs are read).
    assert _tool().main([*argv, "--skip-done"]) == 0
    assert capsys.readouterr().out.count("finished before with the same settings, reused") == 1
    assert (out / "async_staleness.md").read_text() == table
    # --keep resumes it on a fresh machine: the run folders are gone, the kept results are reused, the table is the
    # same; with another learning rate the kept run is not this table's and runs again.
    shutil.rmtree(out)
    assert _tool().main([*argv, *keep]) == 0
    assert capsys.readouterr().out.count("kept in") == 1
    assert (out / "async_staleness.md").read_text() == table
    other = _tool().parse_args([*argv[:argv.index("--lr") + 1], "0.02", *argv[argv.index("--lr") + 2:], *keep])
    assert _tool().kept_result(other, "grpo-seq-mask-k1-s0", _tool().settings_of(other, "grpo-seq-mask", 1, 0)) is None


def test_the_record_gives_each_loss_and_staleness_over_its_seeds():
    tool = _tool()
    runs = [{"algo": "grpo", "staleness": 1, "seed": s, "accuracy_before": 0.34, "accuracy_after": 0.34 + d,
             "difference": d, "stderr_of_difference": se, "reward_first": 0.2, "reward_last": last,
             "staleness_mean": 0.9, "staleness_max": 1, "lag_max": lag, "grad_norm_max": 1.0, "finite": finite}
            for s, d, se, last, lag, finite in [(0, 0.1, 0.03, 0.5, 0.2, True), (1, -0.05, 0.05, 0.3, 0.4, True),
                                                 (2, 0.04, 0.04, 0.4, 0.1, False)]]
    runs.append({"algo": "grpo", "staleness": 1, "seed": 3, "accuracy_after": None, "returncode": 1})  # failed
    (arm,) = tool.by_arm(runs)
    row = tool.record_row(arm)
    # Means over the three finished seeds: difference (0.1 - 0.05 + 0.04) / 3 = 0.03, last third 0.4; the se over
    # the problems (mean 0.04) and the seeds (sd^2 = (0.07^2 + 0.08^2 + 0.01^2) / 2 = 0.0057, / 3 = 0.0019):
    # sqrt(0.0016 + 0.0019) = 0.059; the seed min and max of the difference; the largest gap; finite only if every
    # seed was.
    assert row == {"algo": "grpo", "staleness": 1, "seeds": "0, 1, 2", "accuracy_before": 0.34,
                   "accuracy_after": 0.37, "difference": 0.03, "difference_min": -0.05, "difference_max": 0.1,
                   "difference_se": 0.059, "reward_first": 0.2, "reward_last": 0.4, "staleness_mean": 0.9,
                   "staleness_max": 1, "lag_max": 0.4, "grad_norm_max": 1.0, "finite": "NO"}
    assert tool.summary_of(runs) == pytest.approx({"before": 0.34, "grpo_k1": 0.03})


def test_the_readme_row_names_each_loss_gain_at_the_smallest_staleness_above_zero():
    tool = _tool()
    runs = [{"algo": a, "staleness": k, "accuracy_before": 0.34, "accuracy_after": after, "difference": after - 0.34}
            for a, k, after in [("grpo", 0, 0.4), ("grpo", 1, 0.1), ("vespo-engine", 1, 0.38),
                                ("vespo-engine", 4, 0.3)]]
    runs.append({"algo": "vespo", "staleness": 1, "accuracy_after": None})  # failed: not in the summary
    summary = tool.summary_of(runs)
    assert summary == pytest.approx({"before": 0.34, "grpo_k0": 0.06, "grpo_k1": -0.24, "vespo_engine_k1": 0.04,
                                     "vespo_engine_k4": -0.04})
    template = tool.headline_of([r for r in runs if r.get("accuracy_after") is not None])
    assert template.format(**summary) == ("held-out greedy accuracy from 0.340 at staleness 1: grpo -0.240, "
                                          "vespo-engine +0.040")
    # Over two seeds each loss is named once, with its mean: (0.1 + 0.2) / 2 - 0.34 = -0.19.
    seeds = [{**r, "seed": s, "difference": r["difference"] + 0.1 * s} for r in runs[:2] for s in (0, 1)]
    template = tool.headline_of(seeds)
    assert template.format(**tool.summary_of(seeds)) == ("held-out greedy accuracy from 0.340 at staleness 1: "
                                                         "grpo -0.190")
