"""tools/bench_step.py runs a recipe for N steps and prints the median seconds of the step and of each phase,
generated tokens/s and peak memory (its TRL side needs TRL's own environment and is not tested here)."""

import csv
import glob
import json
import os
import re
import subprocess
import sys

import pytest
from helpers import TESTS, load_tool

BENCH = os.path.join(os.path.dirname(TESTS), "tools", "bench_step.py")
PHASES = ("rollout", "reward", "score", "update")


def bench(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([TESTS, os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, BENCH, *args], env=env, capture_output=True, text=True, timeout=600,
                          check=False)


def recorded(path) -> dict:
    """The record bench_step wrote to ``path`` (``<folder>/<id>.json``), read back and checked
    (``rllight.app.records.load_records``); its command is bench_step's."""
    from rllight.app.records import load_records

    (record,) = load_records(str(path.parent))
    assert record["id"] == path.stem and record["command"].startswith(".venv/bin/python tools/bench_step.py ")
    return record


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
    record = tmp_path / "records" / "x.json"
    run = bench("--model-dir", tiny_model_dir, "--steps", "3", "--set", "model.rollout.init_args.max_new_tokens=8",
                "--out", str(out), "--profile", "1", "--train-prompts", "4", "--heldout", "6", "--seed", "2",
                "--record", str(record))
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
    assert [int(r["step"]) for r in logged_steps(out / "rllight")] == [1, 2, 3]
    # --profile 1: step 1's phases, generation per token among them.
    assert "| rllight.generate.token |" in (out / "profile" / "profile.md").read_text()
    # The record: rllight's row, the table's numbers as printed, the held-out accuracies, the last line's value.
    (row,) = recorded(record)["rows"]
    assert row["step_s"] == recorded(record)["summary"]["rllight_step_s"] == float(last.split("=")[1])
    for label, key in (("step s", "step_s"), *((f"{n} s", f"{n}_s") for n in (*PHASES, "other")),
                       ("generated tokens/s", "generated_tokens_per_s"), ("step tokens/s", "step_tokens_per_s"),
                       ("tokens per step", "tokens_per_step"), ("peak RSS GiB", "peak_rss_gib")):
        assert row[key] == table[label], label
    learned = json.loads((out / "learning.json").read_text())
    assert (row["heldout_before"], row["heldout_after"]) == (
        float(f"{learned['start']:.3f}"), float(f"{learned['sides']['rllight']['accuracy']:.3f}"))
    _check_heldout(tmp_path, out, run, capsys)


@pytest.mark.slow
def test_bench_step_async_runs_both_ways_and_prints_async_over_sync(tmp_path, tiny_model_dir):
    out = tmp_path / "bench"
    record = tmp_path / "records" / "x.json"
    run = bench("--model-dir", tiny_model_dir, "--steps", "3", "--set", "model.rollout.init_args.max_new_tokens=8",
                "--out", str(out), "--async", "1", "--record", str(record))
    assert run.returncode == 0, run.stderr[-3000:] + run.stdout[-3000:]
    rows = re.findall(r"^  (step s|tokens per step) +([\d.e+-]+) +([\d.e+-]+)", run.stdout, re.MULTILINE)
    table = {name: (float(sync), float(asynchronous)) for name, sync, asynchronous in rows}
    assert min(table["step s"]) > 0 and 0 < max(table["tokens per step"]) <= 16 * 8
    last = run.stdout.strip().splitlines()[-1]
    assert re.fullmatch(r"async_over_sync=[\d.]+", last), last
    assert float(last.split("=")[1]) == pytest.approx(table["step s"][0] / table["step s"][1], rel=0.01, abs=0.01)
    # The record: both runs' rows as the table prints them, async_over_sync on the asynchronous one's.
    written = recorded(record)
    assert written["section"] == "Asynchronous and stale rollouts"
    sync, asynchronous = written["rows"]
    assert asynchronous["async_over_sync"] == written["summary"]["async_over_sync"] == float(last.split("=")[1])
    assert (sync["step_s"], asynchronous["step_s"]) == table["step s"]
    assert (sync["tokens_per_step"], asynchronous["tokens_per_step"]) == table["tokens per step"]
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
    import json

    bench_step = load_tool("bench_step")
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
    import json

    from rllight.data import ArithmeticTask, RLDataModule

    bench_step = load_tool("bench_step")
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
    tool = load_tool("bench_step")
    capsys.readouterr()
    assert tool.main(["--summarize", *map(str, outs)]) in (0, None)
    summary = capsys.readouterr().out
    assert re.search(r"^  rllight/SeqMeanTokenMean +2 runs: held-out gain", summary, re.MULTILINE), summary
    assert len(re.findall(r"^  rllight/SeqMeanTokenMean +2  ", summary, re.MULTILINE)) == 2
    with pytest.raises(SystemExit) as missing:
        tool.main(["--summarize", str(tmp_path / "nothing")])
    assert missing.value.code == 2 and "--summarize" in capsys.readouterr().err.strip().splitlines()[-1]


RG_RECIPE = os.path.join(os.path.dirname(TESTS), "recipes", "reasoning-gym.yaml")


def test_trl_gets_the_reasoning_gym_rows_rllight_trains_on_each_with_its_entry_key_and_task(tmp_path, tiny_model_dir):
    """``--recipe recipes/reasoning-gym.yaml``: both sides train on the recipe's task mix (not the arithmetic
    task); TRL's prompt file holds rllight's batches in order, each row with the key that rebuilds its
    reasoning-gym entry and its task, and TRL scores with the recipe's reward."""
    import json

    import reasoning_gym
    import yaml

    from rllight.data import ReasoningGymTask, RLDataModule

    bench_step = load_tool("bench_step")
    args = bench_step.parse_args(["--recipe", RG_RECIPE, "--model-dir", tiny_model_dir, "--out", str(tmp_path),
                                  "--steps", "3", "--train-prompts", "8", "--heldout", "4", "--seed", "1"])
    with open(bench_step.trl_inputs(args)) as f:
        settings = json.load(f)
    with open(settings["prompts"]) as f:
        rows = [json.loads(line) for line in f]
    assert settings["reward"] == {"class_path": "rllight.rewards.ReasoningGymScore", "init_args": {}}
    with open(RG_RECIPE) as f:
        mix = yaml.safe_load(f)["data"]["task"]["init_args"]
    data = RLDataModule(task=ReasoningGymTask(**{**mix, "train_size": 8, "val_size": 4}), batch_size=4, seed=1)
    data.setup()
    trained = [row for batch in data.upcoming_batches(0, 3) for row in batch]
    assert [(r["prompt"], r["answer"], r["data_source"]) for r in rows] == [
        (r["messages"], r["answer"], r["data_source"]) for r in trained]
    assert len({r["data_source"] for r in rows}) > 1
    for row in rows:  # the key rebuilds the very entry the prompt asks
        key = json.loads(row["answer"])
        entry = reasoning_gym.create_dataset(key["task"], seed=key["seed"], size=key["size"], **key["config"])[
            key["index"]]
        assert key["task"] == row["data_source"] and str(entry["answer"]) == key["answer"]
        assert row["prompt"][-1]["content"].startswith(entry["question"].strip())
    assert not {r["prompt"] for r in trained} & {r["prompt"] for r in data.val_rows}
    # The rllight side and the held-out evaluation use the same task, sized the same.
    for section in (bench_step.overlay(args)["data"], bench_step.data_config(args, val_size=4)):
        assert section["task"]["init_args"] == {**mix, "train_size": 8, "val_size": 4}


def test_trls_reward_function_is_reasoning_gyms_own_score_of_the_final_answer():
    """tools/trl_step.py's reward function (importable without TRL) for recipes/reasoning-gym.yaml's reward
    gives each hand-written completion the score reasoning-gym's own ``score_answer`` gives its final answer
    (extracted here by hand), scaled by the reward's settings; plain and conversational completions alike."""
    import reasoning_gym

    from rllight.rewards.reasoning_gym import row_answer

    trl_step = load_tool("trl_step")
    reward = trl_step.reward_function({"class_path": "rllight.rewards.ReasoningGymScore", "init_args": {}})
    scaled = trl_step.reward_function({"class_path": "rllight.rewards.ReasoningGymScore",
                                       "init_args": {"correct": 2.0, "wrong": -1.0}})
    completions, keys, expected = [], [], []
    for task, config in (("chain_sum", {"min_terms": 2, "max_terms": 3}), ("leg_counting", {}),
                         ("gsm_symbolic", {})):
        dataset = reasoning_gym.create_dataset(task, seed=5, size=3, **config)
        entry = dataset[1]
        answer = str(entry["answer"])
        wrong = str(int(answer) + 1)
        for text, extracted in ((f"Adding up.\n\\boxed{{{answer}}}", answer),  # right
                                (f"Answer: {answer}.", answer),
                                (f"<answer>{answer}</answer>\n", answer),
                                (f"\\boxed{{{answer}}} ... no, \\boxed{{{wrong}}}", wrong),  # wrong
                                (f"The answer is {answer}, I think", answer),  # a numeric task: the last number
                                (f"\\boxed{{{answer}", f"\\boxed{{{answer}"),  # malformed: cut inside the box
                                ("", "")):
            completions.append(text)
            keys.append(row_answer(task, config, 5, 3, 1, answer))
            expected.append(float(dataset.score_answer(extracted, entry)))
    # Seven completions per task: the right ones solved (the sentence's last number too), the wrong one and the
    # empty one not, partial credit (which a 0/1 reward would not give) for the box cut open.
    assert [score for i, score in enumerate(expected) if i % 7 in (0, 1, 2, 4)] == [1.0] * 12
    assert all(score < 1.0 for score in expected[3::7]) and expected[6::7] == [0.0] * 3
    assert any(0.0 < score < 1.0 for score in expected)
    assert reward(completions, answer=keys) == expected
    conversational = [[{"role": "assistant", "content": text}] for text in completions]
    assert reward(conversational, answer=keys, data_source=["x"] * len(keys)) == expected
    assert scaled(completions, answer=keys) == [-1.0 + 3.0 * score for score in expected]
    assert trl_step.reward_function(None)(["so 12", "so 13"], answer=["12", "12"]) == [1.0, 0.0]  # IntegerMatch
    with pytest.raises(SystemExit, match="not a class of rllight.rewards"):
        trl_step.reward_function({"class_path": "rllight.data.ArithmeticTask"})


def test_summarize_prints_the_heldout_accuracy_of_each_task_and_its_mean_over_runs(tmp_path, capsys):
    import json

    bench_step = load_tool("bench_step")
    assert bench_step.by_task({"a": 1.0, "b": 0.0, "c": 1.0}, {"a": "x", "b": "x", "c": "y"}) == {"x": 0.5, "y": 1.0}
    folders = []
    for seed, (rllight_x, trl_x) in enumerate(((0.5, 0.25), (1.0, 0.75))):
        curve = {"reward": [0.1 + 0.2 * seed, 0.2 + 0.2 * seed, 0.3 + 0.2 * seed], "entropy": [1.0, 1.0, 1.0],
                 "length": [10, 10, 10]}
        run = {"seed": seed, "steps": 3, "train_prompts": 12, "heldout": 8, "trl_loss_type": "dapo", "start": 0.25,
               "start_by_task": {"x": 0.25, "y": 0.25}, "task_sizes": {"x": 4, "y": 4},
               "sides": {"rllight": {"accuracy": 0.5, "accuracy_by_task": {"x": rllight_x, "y": 0.0}, **curve},
                         "trl": {"accuracy": 0.5, "accuracy_by_task": {"x": trl_x, "y": 0.5}, **curve}}}
        folders.append(tmp_path / f"s{seed}")
        folders[-1].mkdir()
        (folders[-1] / "learning.json").write_text(json.dumps(run))
    assert bench_step.main(["--summarize", *map(str, folders)]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^  rllight +0  0.250 -> 0.500.*\n    x +0.250 -> 0.500  \(4 problems\)\n"
                     r"    y +0.250 -> 0.000  \(4 problems\)$", out, re.MULTILINE), out
    assert re.search(r"^  trl/dapo +1  .*\n    x +0.250 -> 0.750  \(4 problems\)$", out, re.MULTILINE), out
    # Means over the two runs: rllight's x 0.75 (gain 0.5 ± 0.25), TRL's y 0.5 (gain 0.25 ± 0).
    assert re.search(r"^  rllight +2 runs: .*\n    x +accuracy 0.750 ± 0.250, gain 0.500 ± 0.250\n"
                     r"    y +accuracy 0.000 ± 0.000, gain -0.250 ± 0.000$", out, re.MULTILINE), out
    assert re.search(r"^    y +accuracy 0.500 ± 0.000, gain 0.250 ± 0.000$", out, re.MULTILINE), out
    # The reward curve: 3 steps in 3 blocks, each the mean over the two runs (0.1 and 0.3, then 0.2 and 0.4...).
    assert len(re.findall(r"^    reward curve +0.200 0.300 0.400  \(mean reward of 3 consecutive blocks", out,
                          re.MULTILINE)) == 2, out
    assert bench_step.blocks([1.0, None, 3.0, 5.0, 7.0, 9.0, 11.0], 3) == [1.0, 4.0, 9.0]  # the last takes the rest


def test_setup_trl_installs_the_reasoning_gym_version_rllight_has_and_trl_refuses_a_reward_it_cannot_build(
        tmp_path, monkeypatch, capsys):
    from importlib.metadata import version

    bench_step = load_tool("bench_step")
    calls = []

    def run(cmd, **kwargs):
        calls.append(cmd)
        return subprocess.CompletedProcess(cmd, 0, stdout="trl 1, transformers 2, torch 3, reasoning-gym 4\n")

    monkeypatch.setattr(subprocess, "run", run)  # what tools/bench_step_sides.py calls
    python = str(tmp_path / "venv" / "bin" / "python")
    bench_step.setup_trl(python)
    installs = [cmd[4] for cmd in calls if cmd[:4] == [python, "-m", "pip", "install"]]
    assert installs == [bench_step.TORCH_PIN, "trl", f"reasoning-gym=={version('reasoning-gym')}"]
    recipe = tmp_path / "mixed.yaml"
    recipe.write_text("model:\n  reward:\n    class_path: rllight.rewards.Weighted\n    init_args:\n"
                      "      rewards: [{class_path: rllight.rewards.IntegerMatch}]\n")
    bench_step.parse_args(["--recipe", str(recipe)])  # only the TRL side cannot build it
    with pytest.raises(SystemExit):
        bench_step.parse_args(["--recipe", str(recipe), "--trl", "--trl-python", python])
    assert "--recipe" in capsys.readouterr().err.strip().splitlines()[-1]
