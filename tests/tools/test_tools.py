"""Every script in tools/ runs end to end with its smallest settings (a tiny random model where it takes one) and
ends with its ``name=value`` line, so that no README number's tool can break unnoticed. Scripts are run in this
process through their ``main`` where they have one (no second torch import); those that need an extra skip only
without it (vLLM, TRL, matplotlib). Covered in their own files: tools/bench_step.py (tests/tools/test_bench_step.py),
tools/async_staleness.py (tests/tools/test_async_staleness.py), tools/plot.py's command line (tests/tools/test_plot.py),
tools/sanity_check.py (tests/tools/test_sanity_check_tool.py), tools/env_measure.py (tests/tools/test_env_measure.py),
tools/curriculum_measure.py (tests/tools/test_curriculum_measure.py).
tools/install.sh installs packages, which no test can do in seconds: it is only parsed here.

The numbers these runs print mean nothing (a random model, a few tokens); the checks are the output's shape,
what the tools compute exactly (the GAE and log-prob paths agree with their references to float noise, vLLM's
log-probs with the trainer's), and that tools/rerun_numbers.py still knows every command of the tools page.

Each measuring tool's run here also writes its record (``--record <tmp>/<id>.json``, ``rllight.app.records``): the
record ``load_records`` reads back, its command the tool's, and its values those the tool printed (parsed from its
output), so that a record cannot disagree with the printout. tools/bench_step.py's and tools/async_staleness.py's
runs check theirs in their own files.
"""

import json
import math
import os
import re
import subprocess
import sys
import types

import pytest
import torch
import yaml
from helpers import TESTS, load_tool

from rllight.app.records import load_records, parse_pairs, parse_value
from rllight.testing import build_tiny_model

ROOT = os.path.dirname(TESTS)
NUMBER = r"-?[\d.]+(?:e[+-]?\d+)?"



def _pairs(line: str) -> dict[str, str]:
    """``{"a": "1", "b": "x"}`` for the line ``a=1 b=x``; fails on anything else."""
    words = line.split()
    assert words and all(re.fullmatch(r"\w+=\S+", w) for w in words), line
    return dict(w.split("=", 1) for w in words)


def _last_lines(capsys, n: int = 2) -> list[str]:
    return capsys.readouterr().out.strip().splitlines()[-n:]


def recorded(path, tool: str) -> dict:
    """The one record a tool wrote to ``path`` (``<folder>/<id>.json``, alone in its folder), as ``load_records``
    reads it back (checked, its file named after its id); its command is the tool's own command line."""
    (record,) = load_records(str(path.parent))
    assert record["id"] == path.stem and record["source"] == "tool"
    assert record["command"].startswith(f".venv/bin/python tools/{tool}.py "), record["command"]
    assert f"--record {path}" in record["command"]
    return record


def agrees(row: dict, line: str) -> None:
    """``row`` holds every value of the printed ``name=value`` line, as printed."""
    values = parse_pairs(line)
    assert {k: row.get(k) for k in values} == values, (row, line)


@pytest.fixture(scope="module")
def vllm_ready_model(tmp_path_factory) -> str:
    """A tiny model with head_dim 32 (vLLM's CPU attention needs at least 32)."""
    return build_tiny_model(str(tmp_path_factory.mktemp("tiny64") / "model"), hidden_size=64)


def test_bench_gae_matches_the_loop_and_prints_speedup(tmp_path, capsys):
    record = tmp_path / "records" / "x.json"
    speedup = load_tool("bench_gae").main(["--batch", "4", "--length", "16", "--repeats", "1", "--record",
                                           str(record), "--shared", "no"])
    out = capsys.readouterr().out.strip().splitlines()
    machine, last = out[-2:]
    values = _pairs(last)
    assert set(values) == {"speedup", "max_abs_diff"}
    assert float(values["speedup"]) == pytest.approx(speedup, abs=0.006)  # printed to 2 decimals
    assert float(values["max_abs_diff"]) < 1e-5  # the blocked scan is the loop, to float32 rounding
    assert machine.startswith("machine: ") and "AVX-512 BF16 " in machine
    # The record: one row, the first line's settings and times and the last line's values, as printed.
    assert out[-3] == f"record: {record}"
    (row,) = recorded(record, "bench_gae")["rows"]
    agrees(row, last)
    first = re.fullmatch(rf"device=(\w+) B=4 T=16 gae=({NUMBER})ms loop=({NUMBER})ms \(best of 1\)", out[0])
    assert (row["device"], row["batch"], row["length"], row["gae_ms"], row["loop_ms"]) == (
        first.group(1), 4, 16, float(first.group(2)), float(first.group(3)))
    assert recorded(record, "bench_gae")["shared"] == "alone"


def test_machine_line_names_the_kernel_bounds_the_environment_sets(tmp_path, monkeypatch):
    """A number measured with the kernels held below the CPU (``ONEDNN_MAX_CPU_ISA=AVX2`` on a CPU with AVX-512
    BF16 computes as an AVX2-only one) says so in its machine line; without a bound the line has no such part."""
    from rllight.machine import ISA_BOUNDS, machine_line

    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("model name\t: AMD EPYC\nflags\t\t: avx2 avx512f avx512_bf16\n")
    for name in ISA_BOUNDS:
        monkeypatch.delenv(name, raising=False)
    line = machine_line(str(cpuinfo))
    assert line.startswith("machine: AMD EPYC, ") and "AVX-512 BF16 yes, AMX no" in line
    assert "kernels held" not in line
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    assert machine_line(str(cpuinfo)).endswith(", kernels held at ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2")


@pytest.mark.slow  # two child processes, one per path, each measuring its own peak memory
def test_bench_logprobs_chunked_equals_direct_and_prints_the_ratios(tmp_path, capsys):
    record = tmp_path / "records" / "x.json"
    load_tool("bench_logprobs").main(["--batch", "1", "--length", "8", "--vocab", "64", "--hidden", "8",
                                  "--chunk-size", "4", "--record", str(record)])
    out = capsys.readouterr().out.strip().splitlines()
    values = _pairs(out[-1])
    assert set(values) == {"memory_ratio", "time_ratio", "max_abs_diff"}
    assert float(values["memory_ratio"]) > 0 and float(values["time_ratio"]) > 0
    assert float(values["max_abs_diff"]) < 1e-5  # log-probs, entropy and both gradients
    assert [line.split()[0] for line in out[:2]] == ["direct", "chunked"]
    (row,) = recorded(record, "bench_logprobs")["rows"]
    agrees(row, out[-1])
    for line in out[:2]:
        path, peak, seconds = re.fullmatch(rf"(\w+) +peak_memory= *({NUMBER}) MiB time=({NUMBER}) s", line).groups()
        assert (row[f"{path}_peak_mib"], row[f"{path}_time_s"]) == (float(peak), float(seconds))
    assert (row["batch"], row["vocab"], row["chunk_size"]) == (1, 64, 4)


def test_bench_rollout_says_when_the_engine_did_not_sync():
    # What sync_line reads of a VLLMEngine, so that the test runs without vLLM installed.
    sync_line = load_tool("bench_rollout").sync_line
    engine = types.SimpleNamespace(llm=None, sync_every=2)
    assert sync_line({"rollout/sync_time": 0.25}, engine) == "vllm: weight sync 0.250 s"
    assert "did not sync (the engine had not started)" in sync_line({}, engine)
    engine.llm = object()  # started; this call is one that sync_every skips
    assert sync_line({}, engine).endswith("did not sync (sync_every=2 skips this call)")


@pytest.mark.vllm
def test_bench_rollout_measures_both_engines_and_prints_vllm_over_hf(vllm_ready_model, tmp_path, capsys):
    pytest.importorskip("vllm")
    # --sync-every 2: the one update_weights call does not sync, the case that used to end in a KeyError.
    ratio = load_tool("bench_rollout").main(["--model-dir", vllm_ready_model, "--prompts", "2", "--warmup", "2",
                                         "--max-new-tokens", "4", "--repeats", "1", "--kv-cache-gb", "0.0625",
                                         "--sync-every", "2", "--record", str(tmp_path / "records" / "x.json")])
    out = capsys.readouterr().out
    assert "vllm: weight sync not measured: update_weights did not sync (sync_every=2 skips this call)" in out
    rates = re.findall(rf"^ *(HFEngine|VLLMEngine): +({NUMBER}) tokens/s", out, re.MULTILINE)
    assert [name for name, _ in rates] == ["HFEngine", "VLLMEngine"] and all(float(r) > 0 for _, r in rates)
    mismatch = re.search(rf"logprob_diff_max=({NUMBER})", out)
    assert mismatch and float(mismatch.group(1)) < 1e-4  # vLLM's sampling log-probs are the trainer's
    machine, last = out.strip().splitlines()[-2:]
    assert machine.startswith("machine: ")
    assert _pairs(last) == {"vllm_over_hf": f"{ratio:.2f}"}
    (row,) = recorded(tmp_path / "records" / "x.json", "bench_rollout")["rows"]
    agrees(row, last)
    hf, vllm = re.search(rf"^hf: ({NUMBER}) tokens/s, vllm: ({NUMBER}) tokens/s over 1 run", out, re.MULTILINE).groups()
    assert (row["hf_tokens_per_s"], row["vllm_tokens_per_s"]) == (float(hf), float(vllm))
    assert row["sync_s"] is None  # sync_every=2 skipped the one timed sync
    assert row["logprob_diff_max"] == float(mismatch.group(1))


@pytest.mark.slow  # one training run in this process (Lightning, a few seconds)
def test_staleness_trains_and_reports_each_run(tmp_path, monkeypatch, capsys):
    staleness = load_tool("staleness")
    record = tmp_path / "records" / "x.json"
    monkeypatch.setattr(sys, "argv", ["staleness.py", "--steps", "1", "--ns", "2", "--algos", "grpo",
                                      "--record", str(record)])
    staleness.main()
    out = capsys.readouterr().out.strip().splitlines()
    (row,) = [line for line in out if line.startswith("grpo  N=2")]
    assert "finite=yes skipped_steps=0" in row
    assert out[-3] == "all finite" and out[-2].startswith("machine: ")
    assert _pairs(out[-1]) == {"finite_runs": "1/1"}
    # The record: the run's row as printed, the count of finite runs in the summary.
    written = recorded(record, "staleness")
    (values,) = written["rows"]
    printed = re.fullmatch(rf"(\w+) +N=(\d+) +finite=(\w+) +skipped_steps=(\d+) reward first3=({NUMBER}) "
                           rf"last3=({NUMBER}) approx_kl=({NUMBER}|nan) time=(\d+)s", row).groups()
    keys = ("algo", "n", "finite", "skipped_steps", "reward_first3", "reward_last3", "approx_kl", "time_s")
    assert {k: values[k] for k in keys} == dict(zip(keys, map(parse_value, printed)))
    assert written["summary"] == {"finite_runs": 1, "runs": 1}


@pytest.mark.slow  # two `rllight fit` child processes (the configuration, then the run)
def test_compare_runs_a_method_and_prints_its_accuracy_after(tmp_path, monkeypatch, capsys):
    pytest.importorskip("matplotlib")  # the figures after the table
    overlay = tmp_path / "tiny.yaml"
    model = build_tiny_model(str(tmp_path / "model"))
    overlay.write_text(yaml.safe_dump({"model": {
        "model": {"class_path": "rllight.models.HFModel", "init_args": {"path": model}},
        "reward": {"class_path": "user_strategies.DigitReward"}, "reward_preflight": 0,
        "reward_runner": None}}))  # scored in the training process: no reward workers to start
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([TESTS, os.environ.get("PYTHONPATH", "")]))
    out = tmp_path / "compare"
    code = load_tool("compare").main(["--methods", "grpo", "--steps", "1", "--batch-size", "1", "--group-size", "2",
                                  "--val-size", "2", "--max-new-tokens", "4", "--config", str(overlay),
                                  "--out", str(out), "--record", str(tmp_path / "records" / "x.json")])
    assert code == 0
    printout = capsys.readouterr().out
    machine, last = printout.strip().splitlines()[-2:]
    (result,) = json.loads((out / "compare.json").read_text())["results"]
    assert result["responses"] == 2 and result["num_val"] == 2
    assert _pairs(last) == {"grpo_accuracy_after": f"{result['accuracy_after']:.3f}"}
    assert machine.startswith("machine: ")
    assert (out / "figures" / "reward.png").is_file()
    # The record: the method's row of the printed table, its accuracy after in the summary.
    written = recorded(tmp_path / "records" / "x.json", "compare")
    (row,) = written["rows"]
    after = parse_pairs(last)["grpo_accuracy_after"]
    assert row["accuracy_after"] == written["summary"]["grpo_accuracy_after"] == after
    (line,) = [line for line in printout.splitlines() if line.startswith("| grpo |")]
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells[:5] == ["grpo", row["recipe"], str(row["updates"]), f"{row['accuracy_before']:.3f}",
                         f"{row['accuracy_after']:.3f}"]
    assert cells[5] == f"{row['difference']:+.3f} ± {row['difference_se']:.3f}"
    assert [parse_value(c) for c in cells[9:]] == [row[k] for k in ("responses", "tokens", "train_s", "wall_s")]


def test_before_after_reads_a_runs_saved_evaluations_back_into_its_table(tmp_path, capsys):
    """Two saved evaluations (a sampled pass and a greedy one at steps 0 and 6, two tasks): the tool's table is the
    one ``before_after`` makes from the evaluations in memory, per-task paired rows included."""
    from rllight.evaluation import EvalAccumulator, before_after

    rows = [{"source": f"row {i}", "prompt": f"p{i}", "answer": "1", "data_source": "sums" if i < 3 else "legs"}
            for i in range(6)]
    results = []
    for step, sampled, greedy in ((0, [0, 1] * 6, [0, 0, 1, 0, 0, 0]), (6, [1, 1] * 6, [1, 1, 1, 0, 1, 0])):
        metrics, per_prompt = {}, {}
        for key, ks, correct, name in (("val", [1, 2], sampled, f"val_step{step}"),
                                       ("val/greedy", [1], greedy, f"val_step{step}_greedy")):
            acc = EvalAccumulator(key)
            acc.update(rows, max(ks), correct, texts=["1" if c else "2" for c in correct])
            acc.write(str(tmp_path / "evaluation"), ks, name=name)
            metrics.update(acc.compute(ks))
            per_prompt.update(acc.per_prompt(ks))
        results.append((metrics, per_prompt))
    expected = before_after(results[0][0], results[1][0], results[0][1], results[1][1])[1]
    assert load_tool("before_after").main([str(tmp_path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [line.strip() for line in out[1 : 1 + len(expected)]] == [line.strip() for line in expected]
    assert "  sums" in "\n".join(out) and re.search(r" greedy_accuracy_/_sums 0\.333 1\.000 \+0\.667 0\.333$", out[-1])
    # The last lines: the headline (the metric shown per task) overall, then per task; no other metric.
    assert re.fullmatch(r".* greedy_accuracy 0\.167 0\.667 \+0\.500 0\.\d+", out[-3]), out[-3:]
    assert re.fullmatch(r".* greedy_accuracy_/_legs 0\.000 0\.333 \+0\.333 0\.\d+", out[-2]), out[-3:]
    assert not out[-4].startswith(str(tmp_path))
    # A run whose only evaluation is greedy avg@1 (n = 1, temperature 0: the environment recipes): avg@1 is its headline.
    single = tmp_path / "single"
    for step, correct in ((0, [0, 0, 1, 0, 0, 0]), (6, [1, 1, 1, 0, 1, 0])):
        acc = EvalAccumulator("val")
        acc.update(rows, 1, correct, texts=["1" if c else "2" for c in correct])
        acc.write(str(single / "evaluation"), [1], name=f"val_step{step}")
    assert load_tool("before_after").main([str(single)]) == 0
    tail = [line.split()[1:4] for line in capsys.readouterr().out.splitlines() if line.startswith(str(single) + " ")]
    assert tail == [["avg@1", "0.167", "0.667"], ["avg@1_/_legs", "0.000", "0.333"], ["avg@1_/_sums", "0.333", "1.000"]]
    _check_before_after_record(tmp_path, single, capsys)


def _check_before_after_record(tmp_path, single, capsys):
    """``--record``: a row per run, the headline overall and per data source as the run's last lines print them,
    the mean of the headline over the runs in the summary, the fit command given as the record's; without
    ``--command``, a one-line refusal naming it."""
    tool = load_tool("before_after")
    record = tmp_path / "records" / "x.json"
    with pytest.raises(SystemExit) as refused:
        tool.main([str(tmp_path), "--record", str(record)])
    assert refused.value.code == 2 and "--command" in capsys.readouterr().err.strip().splitlines()[-1]
    (tmp_path / "config.yaml").write_text("seed_everything: 3\n")  # the config a fit saves next to its evaluations
    fit = "rllight fit --config recipes/quickstart.yaml --seed_everything 3"
    assert tool.main([str(tmp_path), str(tmp_path), "--record", str(record), "--command", fit]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"record: {record}"
    (written,) = load_records(str(record.parent))
    assert written["command"] == fit and written["id"] == "x" and len(written["rows"]) == 2
    row = written["rows"][0]
    assert (row["run"], row["seed"], row["prompts"]) == (str(tmp_path), 3, 6)
    lines = [line.split()[1:] for line in out if line.startswith(f"{tmp_path} ")]
    assert len(lines) == 6  # each run's headline overall and per data source, twice
    for name, *values in lines[:3]:
        key = name.split("_/_", 1)[1] if "_/_" in name else tool.key_of(name.replace("_", " "))
        assert [row[f"{key}_{part}"] for part in ("before", "after", "gain", "gain_se")] == list(map(float, values))
    assert (row["avg2_before"], row["maj2_after"]) == (0.5, 1.0)  # the other metrics before and after
    assert written["summary"]["gain_mean"] == pytest.approx(row["greedy_gain"], abs=5e-4)
    assert written["summary"]["runs"] == 2
    # A greedy avg@1 run (no greedy pass): its headline, avg@1, is the record's.
    assert tool.main([str(single), "--record", str(record), "--command", fit]) == 0
    (written,) = load_records(str(record.parent))
    assert written["rows"][0]["avg1_gain"] == pytest.approx(written["summary"]["gain_mean"], abs=5e-4)
    assert "greedy_before" not in written["rows"][0]


@pytest.mark.slow  # one `rllight fit` child process (a tiny model, two steps)
def test_phase_memory_prints_each_phase_and_records_its_summary(tmp_path, tiny_model_dir):
    from helpers import tiny_overrides

    record = tmp_path / "records" / "x.json"
    overlay = tiny_overrides(tmp_path, tiny_model_dir)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([TESTS, os.environ.get("PYTHONPATH", "")]))
    run = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "phase_memory.py"), "--record", str(record),
                          "--shared", "yes", "fit", "--config", os.path.join(ROOT, "recipes", "grpo.yaml"),
                          "--config", overlay], env=env, cwd=ROOT, capture_output=True, text=True, timeout=600,
                         check=False)
    assert run.returncode == 0, run.stderr[-3000:] + run.stdout[-3000:]
    out = run.stdout.strip().splitlines()
    assert len([line for line in out if re.match(r"memory (generate|update): before \d+ peak \d+ after", line)]) == 4
    summary = re.findall(rf"(\w+) peak (\d+) MB, ({NUMBER})s after the first", out[-1])
    assert out[-1].startswith("memory summary: ") and [name for name, *_ in summary] == ["generate", "update"]
    assert out[-2] == f"record: {record}"
    written = recorded(record, "phase_memory")
    assert " fit --config " in written["command"] and written["shared"] == "shared with other work"
    assert [(r["phase"], r["peak_mb"], r["after_first_s"]) for r in written["rows"]] == [
        (name, int(peak), float(seconds)) for name, peak, seconds in summary]
    assert [r["calls"] for r in written["rows"]] == [2, 2]


def _learning_runs(tmp_path) -> list[str]:
    """Two runs' learning.json (tools/bench_step.py --heldout), both sides, two tasks: their --out folders."""
    folders = []
    for seed, (rllight_x, trl_x) in enumerate(((0.5, 0.25), (1.0, 0.75))):
        curve = {"reward": [0.1 + 0.2 * seed, 0.2, 0.3], "entropy": [1.0, 0.9, 0.8], "length": [10, 12, 14]}
        run = {"seed": seed, "steps": 3, "train_prompts": 12, "heldout": 8, "trl_loss_type": "dapo", "start": 0.25,
               "start_by_task": {"x": 0.25, "y": 0.25}, "task_sizes": {"x": 4, "y": 4},
               "sides": {"rllight": {"accuracy": (rllight_x + 0.0) / 2, "accuracy_by_task": {"x": rllight_x, "y": 0.0},
                                     "gain_se": 0.125, **curve},
                         "trl": {"accuracy": (trl_x + 0.5) / 2, "accuracy_by_task": {"x": trl_x, "y": 0.5},
                                 "gain_se": 0.1, **curve}}}
        folder = tmp_path / f"s{seed}"
        folder.mkdir()
        (folder / "learning.json").write_text(json.dumps(run))
        folders.append(str(folder))
    return folders


def test_bench_step_summarize_records_each_printed_row_and_the_mean_gains(tmp_path, capsys):
    """tools/bench_step.py --summarize --record: the learning table's rows as printed (each run and side, its tasks,
    the mean over the runs), each side's mean gain in the summary. (Its timing runs' records:
    tests/tools/test_bench_step.py.)"""
    record = tmp_path / "records" / "x.json"
    assert load_tool("bench_step").main(["--summarize", *_learning_runs(tmp_path), "--record", str(record)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[-1] == f"record: {record}"
    written = recorded(record, "bench_step")
    assert written["section"] == "Against TRL"
    rows = {(r["side"], r["seed"], r.get("task")): r for r in written["rows"]}
    runs = re.findall(rf"^  (\S+) +(\d+)  ({NUMBER}) -> ({NUMBER}) ± ({NUMBER}) +({NUMBER}) -> ({NUMBER}) +"
                      rf"({NUMBER}) -> ({NUMBER}) +({NUMBER}) -> ({NUMBER})$", "\n".join(out), re.MULTILINE)
    assert len(runs) == 4
    keys = ("start", "accuracy", "gain_se", "reward_first", "reward_last", "entropy_first", "entropy_last",
            "length_first", "length_last")
    for side, seed, *values in runs:
        assert [rows[side, int(seed), None][k] for k in keys] == [parse_value(v) for v in values]
    tasks = re.findall(rf"^    ([xy]) +({NUMBER}) -> ({NUMBER})  \(4 problems\)$", "\n".join(out), re.MULTILINE)
    assert [(rows["rllight", 0, "x"]["start"], rows["rllight", 0, "x"]["accuracy"])] == [
        tuple(map(float, tasks[0][1:]))]
    means = dict(re.findall(rf"^  (\S+) +2 runs: held-out gain ({NUMBER}) ±", "\n".join(out), re.MULTILINE))
    assert means.keys() == {"rllight", "trl/dapo"}
    for side, gain in means.items():
        assert rows[side, "mean of 2 runs", None]["gain"] == written["summary"][f"{side}_gain"] == float(gain)
    x_mean = re.findall(rf"^    x +accuracy ({NUMBER}) ± ({NUMBER}), gain ({NUMBER}) ± ({NUMBER})$", "\n".join(out),
                        re.MULTILINE)[0]  # rllight's, printed first
    x = rows["rllight", "mean of 2 runs", "x"]
    assert [x["accuracy"], x["accuracy_se"], x["gain"], x["gain_se"]] == list(map(float, x_mean))


def test_bench_step_trl_record_holds_the_comparison_as_printed(tmp_path, tiny_model_dir, capsys):
    """tools/bench_step.py --trl: the record's rows are the comparison table's numbers as printed, the last lines'
    values on their rows and in the summary (TRL itself is not run: the two sides' results stand in)."""
    bench_step = load_tool("bench_step")
    record = tmp_path / "records" / "x.json"
    args = bench_step.parse_args(["--model-dir", tiny_model_dir, "--trl", "--trl-python", sys.executable,
                                  "--out", str(tmp_path / "bench"), "--record", str(record)])
    rllight = {"step": 1.23456, "rollout": 0.5, "reward": 0.01, "score": 0.1, "update": 0.6, "other": 0.02,
               "generated_tokens_per_s": 123.456, "step_tokens_per_s": 98.765, "tokens_per_step": 300.4,
               "peak_rss_kb": 2.5 * 1024**2, "peak_cuda_bytes": None, "settings": "tiny", "steps": 5}
    trl = {"trl": "0.99", "transformers": "5", "torch": "2", "step": 2.46802, "tokens_per_step": 280.6,
           "step_tokens_per_s": 80.1234, "peak_rss_kb": 3.1 * 1024**2}
    bench_step.print_comparison(args, rllight, trl)
    last = {"rllight_step_s": float(f"{rllight['step']:.4g}"), "rllight_over_trl": float(f"{2.46802 / 1.23456:.2f}")}
    bench_step.record_timing(args, rllight, None, trl, None, last)
    out = capsys.readouterr().out
    written = recorded(record, "bench_step")
    assert (written["id"], written["section"], written["summary"]) == ("x", "Against TRL", last)
    sides = {row["side"]: row for row in written["rows"]}
    ours, theirs = sides["rllight"], sides["TRL 0.99"]
    assert ours["step_s"] == last["rllight_step_s"] and theirs["rllight_over_trl"] == last["rllight_over_trl"]
    for label, key in (("step s", "step_s"), ("tokens per step", "tokens_per_step"),
                       ("step tokens/s", "step_tokens_per_s"), ("peak RSS GiB", "peak_rss_gib")):
        printed = re.search(rf"^  {label} +(\S+) +(\S+)$", out, re.MULTILINE).groups()
        assert (ours[key], theirs[key]) == tuple(map(parse_value, printed)), label


def test_gpu_check_without_cuda_says_so_in_one_line():
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is here: tools/gpu_check.sh would run the GPU tests (minutes)")
    script = os.path.join(ROOT, "tools", "gpu_check.sh")
    run = subprocess.run(["bash", script], env=dict(os.environ, PYTHON=sys.executable), capture_output=True,
                         text=True, timeout=120, check=False)
    assert run.returncode == 2, run.stdout + run.stderr
    assert run.stdout.strip().splitlines() == [
        "gpu_check: no CUDA device here (torch.cuda.is_available() is False); nothing checked"]
    broken = subprocess.run(["bash", script], env=dict(os.environ, PYTHON="/nonexistent/python"),
                            capture_output=True, text=True, timeout=60, check=False)
    assert broken.returncode == 1 and "cannot import torch" in broken.stdout


def test_install_sh_parses():
    run = subprocess.run(["bash", "-n", os.path.join(ROOT, "tools", "install.sh")], capture_output=True, text=True,
                         check=False)
    assert run.returncode == 0, run.stderr


@pytest.mark.slow  # TRL's GRPOTrainer, two steps
def test_trl_step_trains_and_prints_trl_result(tmp_path, tiny_model_dir, capsys):
    pytest.importorskip("trl")
    bench_step = load_tool("bench_step")
    settings = bench_step.trl_inputs(bench_step.parse_args(["--model-dir", tiny_model_dir, "--steps", "2",
                                                            "--out", str(tmp_path / "bench")]))
    load_tool("trl_step").main(settings)
    (last,) = _last_lines(capsys, 1)
    assert last.startswith("trl_result=")
    result = json.loads(last.removeprefix("trl_result="))
    assert len(result["step_s"]) == 2 and all(s > 0 for s in result["step_s"])


def test_rerun_numbers_knows_every_published_command_and_reruns_one(tmp_path, capsys):
    """Each command the tool reruns is on the tools page verbatim (one changed without the other fails here), and
    ``--tiny --only speedup`` runs bench_gae through it into a table row."""
    rerun_numbers = load_tool("rerun_numbers")
    with open(os.path.join(ROOT, "docs", "development", "tools.md")) as f:
        page = f.read()
    assert [e.command for e in rerun_numbers.ENTRIES if e.command not in page] == []
    entry = rerun_numbers.ENTRIES[0]
    argv = rerun_numbers.argv_of(entry, False, None, str(tmp_path), "docs/results/")
    assert argv[-2:] == ["--record", "docs/results/"]
    assert rerun_numbers.main(["--dry-run"]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1] == f"numbers=0/{len(rerun_numbers.ENTRIES)}"
    assert rerun_numbers.main(["--tiny", "--only", "speedup", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    (row,) = [line for line in out if line.startswith("| speedup |")]
    value, command = row.split(" | ")[1:3]
    assert set(_pairs(value)) == {"speedup", "max_abs_diff"}
    assert command == "`.venv/bin/python tools/bench_gae.py --batch 4 --length 16 --repeats 1`"
    assert out[-1] == "numbers=1/1"
    with pytest.raises(SystemExit):
        rerun_numbers.parse_args(["--only", "nope"])


def test_distill_measure_distils_the_first_grpo_model_and_records_each_run(tmp_path, monkeypatch, capsys):
    """The tool's pipeline on a tiny model: a GRPO run per seed, the first one's export the teacher of each
    distillation run (its folder in the written recipe), and a record whose rows and means are the printed ones."""
    overlay = tmp_path / "tiny.yaml"
    model = build_tiny_model(str(tmp_path / "model"))
    overlay.write_text(yaml.safe_dump({
        "trainer": {"max_steps": 1},
        "model": {"model": {"class_path": "rllight.models.HFModel", "init_args": {"path": model}},
                  "reward": {"class_path": "user_strategies.DigitReward"}, "reward_preflight": 0,
                  "reward_runner": None, "batching": {"minibatch_size": None},
                  "rollout": {"init_args": {"max_new_tokens": 4}}, "sampler": {"init_args": {"group_size": 2}},
                  "evaluation": {"n": 2, "ks": [1, 2]}},
        "data": {"batch_size": 1, "val_size": 2}}))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([TESTS, os.environ.get("PYTHONPATH", "")]))
    out, tool = tmp_path / "distill", load_tool("distill_measure")
    argv = ["--seeds", "3", "4", "--config", str(overlay), "--out", str(out), "--every", "1",
            "--record", str(tmp_path / "records" / "d.json"), "--figure", str(tmp_path / "records" / "d.png")]
    assert tool.main(argv) == 0
    printout = capsys.readouterr().out
    machine, last = printout.strip().splitlines()[-2:]
    assert machine.startswith("machine: ")
    recipe = yaml.safe_load((out / "distill-quickstart.yaml").read_text())
    (teacher,) = [c for c in recipe["trainer"]["callbacks"] if c["class_path"].endswith("TeacherLogprobs")]
    assert teacher["init_args"]["model"]["init_args"]["path"] == str(out / "grpo-s3" / "model")
    assert (out / "grpo-s3" / "model" / "config.json").is_file()
    for name in ("grpo-s3", "grpo-s4", "distill-s3", "distill-s4"):
        saved = yaml.safe_load(next((out / name / "lightning_logs").glob("version_*/config.yaml")).read_text())
        assert saved["seed_everything"] == int(name[-1])
    written = recorded(tmp_path / "records" / "d.json", "distill_measure")
    assert [(r["run"], r["seed"]) for r in written["rows"]] == [("grpo", 3), ("grpo", 4), ("distill", 3),
                                                               ("distill", 4)]
    assert written["rows"][0]["teacher"] == "is the teacher" and written["rows"][2]["teacher"] == "grpo seed 3"
    assert written["summary"]["teacher_accuracy"] == written["rows"][0]["accuracy_after"]
    agrees(written["summary"], last)
    grpo_after = [r["accuracy_after"] for r in written["rows"][:2]]
    assert parse_pairs(last)["grpo_accuracy_after"] == pytest.approx(sum(grpo_after) / 2, abs=1e-3)
    # --every 1: each run's curve holds its evaluation before training (0) and after its one rollout; the figure the
    # record names lies beside it.
    for r in written["rows"]:
        assert (r["at0"], r["at1"]) == (r["accuracy_before"], r["accuracy_after"])
    assert written["figure"] == "d.png" and (tmp_path / "records" / "d.png").stat().st_size > 0
    # A rerun with the same options reads every run back; other options are refused, naming the file.
    monkeypatch.setattr(tool, "subprocess", types.SimpleNamespace(run=None))  # a launched fit would fail
    assert tool.main(argv) == 0
    with pytest.raises(SystemExit, match=r"grpo-s3/result.json was measured with .*'every': 1.*give another --out"):
        tool.main([a if a != "1" else "2" for a in argv])


def test_distill_measure_counts_the_rollouts_to_80_percent_of_the_teachers_gain():
    tool = load_tool("distill_measure")
    run = {"accuracy_before": 0.25, "curve": [[0, 0.25], [5, 0.4], [10, 0.44], [15, 0.45], [20, 0.5]]}
    target = tool.target_of(run, 0.5)  # 0.25 + 0.8 * (0.5 - 0.25)
    assert target == pytest.approx(0.45)
    assert tool.rollouts_to(run["curve"], target) == 15  # not 10: 0.44 is short of it
    assert tool.rollouts_to(run["curve"], 0.51) is None
    rows = [{"run": "grpo", "seed": 0}]
    columns = tool.speed(rows, [run], 0.5)
    assert rows[0]["to_80"] == 15 and rows[0]["at10"] == 0.44
    assert [c[0] for c in columns] == ["at0", "at5", "at10", "at15", "at20", "to_80"]


def test_train_reward_model_writes_a_classifier_the_reward_model_reads_and_records_its_check(tmp_path, tiny_model_dir,
                                                                                           capsys):
    out = tmp_path / "rm"
    code = load_tool("train_reward_model").main([
        "--base", tiny_model_dir, "--out", str(out), "--prompts", "4", "--samples", "2", "--heldout", "4", "--epochs",
        "1", "--max-new-tokens", "4", "--record", str(tmp_path / "records" / "rm.json")])
    assert code == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    values = _pairs(last)
    assert set(values) == {"auc_before", "auc_after", "accuracy_after", "positives"}
    from rllight.rewards import RewardModel, Sample

    reward = RewardModel(str(out), dtype="float32")
    reward.check()  # a one-label sequence classifier
    scores = reward.score([Sample(prompt="", messages=[{"role": "user", "content": "What is 1 + 1?"}], response=r,
                                  response_ids=[1], answer="2", row={}, group=0) for r in ("2", "7")])
    assert len(scores) == 2 and all(math.isfinite(s) for s in scores)
    with pytest.raises(SystemExit):  # the folder exists now: never overwritten
        load_tool("train_reward_model").main(["--base", tiny_model_dir, "--out", str(out)])
    agrees(recorded(tmp_path / "records" / "rm.json", "train_reward_model")["rows"][0], last)


def test_bench_env_concurrency_times_both_ways_and_records_them(tmp_path, capsys):
    code = load_tool("bench_env_concurrency").main([
        "--prompts", "2", "--group", "2", "--sleep", "0.05", "--new-tokens", "2", "--repeats", "1",
        "--record", str(tmp_path / "records" / "env.json")])
    assert code == 0
    machine, last = _last_lines(capsys)
    values = {k: float(v) for k, v in _pairs(last).items()}
    assert set(values) == {"sequential_s", "concurrent_s", "episode_sleep_s", "speedup"} and machine.startswith("machine")
    assert values["sequential_s"] >= 4 * 0.05  # four sleeps one after another cannot take less
    assert values["speedup"] == pytest.approx(values["sequential_s"] / values["concurrent_s"], rel=0.02)
    agrees(recorded(tmp_path / "records" / "env.json", "bench_env_concurrency")["rows"][0], last)
