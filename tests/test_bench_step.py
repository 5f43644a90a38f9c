"""tools/bench_step.py runs a recipe for N steps and prints the median seconds of the step and of each phase,
generated tokens/s and peak memory (its TRL side needs TRL's own environment and is not tested here)."""

import csv
import glob
import importlib.util
import os
import re
import subprocess
import sys

import pytest
from helpers import TESTS

BENCH = os.path.join(os.path.dirname(TESTS), "tools", "bench_step.py")
PHASES = ("rollout", "reward", "score", "update")


def bench(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([TESTS, os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, BENCH, *args], env=env, capture_output=True, text=True, timeout=600,
                          check=False)


def logged_steps(run_dir) -> list[dict[str, str]]:
    """The rows of the one CSV log under ``run_dir`` that carry an RL step's time."""
    (metrics,) = glob.glob(str(run_dir / "version_*" / "metrics.csv"))
    with open(metrics) as f:
        return [r for r in csv.DictReader(f) if r["train/time/step"]]


@pytest.mark.slow
def test_bench_step_prints_the_phase_medians_tokens_per_s_peak_memory_and_the_heldout_gain(tmp_path, tiny_model_dir,
                                                                                            capsys):
    """Also ``--heldout``: the starting model and rllight's exported final model are evaluated greedily on the
    held-out problems; learning.json holds the per-step reward, entropy and length rllight logged; ``--summarize``
    prints each run and the mean over runs (one run of the tool for all of it: each start costs seconds)."""
    out = tmp_path / "bench"
    run = bench("--model-dir", tiny_model_dir, "--steps", "3", "--set", "model.rollout.init_args.max_new_tokens=8",
                "--out", str(out), "--profile", "1", "--train-prompts", "4", "--heldout", "6", "--seed", "2")
    assert run.returncode == 0, run.stderr[-3000:] + run.stdout[-3000:]
    rows = re.findall(r"^  (\w[\w /]*?) {2,}([\d.e+-]+)$", run.stdout, re.MULTILINE)
    table = {name: float(value) for name, value in rows}
    for name in ("step", *PHASES):
        assert table[f"{name} s"] > 0, name
    # With 2 timed steps each median is a mean, so the phases add up to at most the step (printed to 4 digits).
    assert sum(table[f"{name} s"] for name in PHASES) <= table["step s"] * 1.001
    assert table["generated tokens/s"] > 0 and table["step tokens/s"] > 0
    assert table["peak RSS GiB"] > 0
    # The --set override reached the run: at most 8 tokens for each of the 4 x 4 responses.
    assert "max_new_tokens 8," in run.stdout
    assert 0 < table["tokens per step"] <= 16 * 8
    last = run.stdout.strip().splitlines()[-1]
    assert re.fullmatch(r"rllight_step_s=[\d.e+-]+", last), last
    assert float(last.split("=")[1]) == table["step s"]
    # --steps RL steps ran, each one rollout with one optimizer update.
    assert [int(r["step"]) for r in logged_steps(out / "rllight")] == [0, 1, 2]
    # --profile 1: step 1's phases, generation per token among them.
    assert "| rllight.generate.token |" in (out / "profile" / "profile.md").read_text()
    _check_heldout(tmp_path, out, run, capsys)


@pytest.mark.slow
def test_bench_step_async_runs_both_ways_and_prints_async_over_sync(tmp_path, tiny_model_dir):
    out = tmp_path / "bench"
    run = bench("--model-dir", tiny_model_dir, "--steps", "3", "--set", "model.rollout.init_args.max_new_tokens=8",
                "--out", str(out), "--async", "1")
    assert run.returncode == 0, run.stderr[-3000:] + run.stdout[-3000:]
    rows = re.findall(r"^  (step s|tokens per step) +([\d.e+-]+) +([\d.e+-]+)", run.stdout, re.MULTILINE)
    table = {name: (float(sync), float(asynchronous)) for name, sync, asynchronous in rows}
    assert min(table["step s"]) > 0 and 0 < max(table["tokens per step"]) <= 16 * 8
    last = run.stdout.strip().splitlines()[-1]
    assert re.fullmatch(r"async_over_sync=[\d.]+", last), last
    assert float(last.split("=")[1]) == pytest.approx(table["step s"][0] / table["step s"][1], rel=0.01, abs=0.01)
    # The second run really was asynchronous: each step after the first trained on a rollout generated during
    # the previous step's update, one version old; the first run generated in the training process.
    steps = logged_steps(out / "rllight-async")
    assert [float(r["train/rollout/generated_ahead"]) for r in steps] == [0, 1, 1]
    assert [float(r["train/rollout/staleness_max"]) for r in steps] == [0, 1, 1]
    assert "train/rollout/generated_ahead" not in logged_steps(out / "rllight")[0]


@pytest.mark.parametrize("args, option", [(["--steps", "1"], "--steps"), (["--set", "novalue"], "--set"),
                                          (["--async", "0"], "--async"),
                                          (["--fixed-length", "--engine", "vllm"], "--fixed-length"),
                                          (["--model-dir", "/nonexistent"], "--model-dir"),
                                          (["--steps", "3", "--profile", "3"], "--profile")])
def test_bench_step_refuses_bad_options_in_one_line_naming_the_option(args, option):
    run = bench(*args)
    assert run.returncode == 2
    assert option in run.stderr.strip().splitlines()[-1]


def test_fixed_length_asks_both_sides_for_responses_of_the_longest_length(tmp_path, tiny_model_dir, monkeypatch):
    """``--fixed-length``: rllight's HF engine gets ``min_new_tokens`` equal to its ``max_new_tokens`` (also when
    ``--set`` changes it) and TRL's settings the same for its own length; without it, neither side gets one."""
    import importlib.util
    import json

    spec = importlib.util.spec_from_file_location("bench_step", BENCH)
    bench_step = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench_step)
    monkeypatch.chdir(tmp_path)
    base = ["--model-dir", tiny_model_dir, "--out", str(tmp_path / "bench")]
    for extra, rllight_min, trl_min in (
        ([], None, 0),
        (["--fixed-length"], bench_step.MAX_NEW_TOKENS, bench_step.MAX_NEW_TOKENS),
        (["--fixed-length", "--set", "model.rollout.init_args.max_new_tokens=8"], 8, bench_step.MAX_NEW_TOKENS),
    ):
        args = bench_step.parse_args(base + extra)
        assert bench_step.overlay(args)["model"]["rollout"]["init_args"].get("min_new_tokens") == rllight_min
        with open(bench_step.trl_inputs(args)) as f:
            settings = json.load(f)
        assert settings["min_new_tokens"] == trl_min and settings["max_new_tokens"] == bench_step.MAX_NEW_TOKENS


@pytest.mark.parametrize("seed", [0, 3])
def test_trl_gets_the_prompts_in_the_order_rllight_trains_on_them_over_epochs(tmp_path, tiny_model_dir, seed):
    """``--train-prompts`` fewer than the steps need: TRL's prompt file (read in order, unshuffled) repeats them
    in exactly the batches rllight's dataloader yields, epoch after epoch, for ``--seed``'s order; the held-out
    problems are none of them."""
    import importlib.util
    import json

    from rllight.data import ArithmeticTask, RLDataModule

    spec = importlib.util.spec_from_file_location("bench_step", BENCH)
    bench_step = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench_step)
    args = bench_step.parse_args(["--model-dir", tiny_model_dir, "--out", str(tmp_path / "bench"), "--steps", "7",
                                  "--train-prompts", "10", "--heldout", "5", "--seed", str(seed)])
    with open(bench_step.trl_inputs(args)) as f:
        settings = json.load(f)
    with open(settings["prompts"]) as f:
        trl_prompts = [json.loads(line)["prompt"][0]["content"] for line in f]
    data = RLDataModule(task=ArithmeticTask(num_train=10, num_val=5, seed=0), batch_size=4, seed=seed)
    data.setup()
    trained = [row["prompt"] for batch in data.upcoming_batches(0, 7) for row in batch]
    assert trl_prompts == trained and len(trained) == 28
    assert len(set(trained)) > 4  # more than one batch's problems, drawn again in later epochs
    assert not set(trained) & {row["prompt"] for row in data.val_rows}
    assert settings["seed"] == seed and settings["final_dir"] and settings["loss_type"] == "grpo"


def _check_heldout(tmp_path, out, run, capsys):
    import json

    learned = json.loads((out / "learning.json").read_text())
    steps = logged_steps(out / "rllight")
    side = learned["sides"]["rllight"]
    assert side["reward"] == [float(r["train/reward/mean"]) for r in steps]
    assert side["entropy"] == [float(r["train/policy/entropy"]) for r in steps]
    assert len(side["length"]) == 3 and (out / "rllight" / "final" / "config.json").is_file()
    for name in ("eval-start", "eval-rllight"):
        (rows,) = glob.glob(str(out / name / "**" / "val_step0_rows.jsonl"), recursive=True)
        with open(rows) as f:
            records = [json.loads(line) for line in f]
        assert len(records) == 6 and all(len(r["correct"]) == 1 for r in records)
        accuracy = sum(r["correct"][0] for r in records) / 6
        assert (learned["start"] if name == "eval-start" else side["accuracy"]) == pytest.approx(accuracy)
    # The row names the recipe's loss aggregation (recipes/grpo.yaml's), read from the config the run saved.
    assert re.search(r"^  rllight/SeqMeanTokenMean +2  [\d.]+ -> [\d.]+", run.stdout, re.MULTILINE), run.stdout[-2000:]
    outs = [out, out]
    # --summarize reads the folders only: in this process.
    spec = importlib.util.spec_from_file_location("rllight_tool_bench_step", BENCH)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    capsys.readouterr()
    assert tool.main(["--summarize", *map(str, outs)]) in (0, None)
    summary = capsys.readouterr().out
    assert re.search(r"^  rllight/SeqMeanTokenMean +2 runs: held-out gain", summary, re.MULTILINE), summary
    assert len(re.findall(r"^  rllight/SeqMeanTokenMean +2  ", summary, re.MULTILINE)) == 2
    with pytest.raises(SystemExit) as missing:
        tool.main(["--summarize", str(tmp_path / "nothing")])
    assert missing.value.code == 2 and "--summarize" in capsys.readouterr().err.strip().splitlines()[-1]
