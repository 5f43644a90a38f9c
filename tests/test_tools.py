"""Every script in tools/ runs end to end with its smallest settings (a tiny random model where it takes one) and
ends with its ``name=value`` line, so that no README number's tool can break unnoticed. Scripts are run in this
process through their ``main`` where they have one (no second torch import); those that need an extra skip only
without it (vLLM, TRL, matplotlib). Covered in their own files: tools/bench_step.py (tests/test_bench_step.py),
tools/async_staleness.py (tests/test_async_staleness.py), tools/plot.py's command line (tests/test_plot.py).
tools/install.sh installs packages, which no test can do in seconds: it is only parsed here.

The numbers these runs print mean nothing (a random model, a few tokens); the checks are the output's shape,
what the tools compute exactly (the GAE and log-prob paths agree with their references to float noise, vLLM's
log-probs with the trainer's), and that tools/readme_numbers.py still knows every README command.
"""

import json
import os
import re
import subprocess
import sys

import pytest
import torch
import yaml
from helpers import TESTS, load_tool

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


@pytest.fixture(scope="module")
def vllm_ready_model(tmp_path_factory) -> str:
    """A tiny model with head_dim 32 (vLLM's CPU attention needs at least 32)."""
    return build_tiny_model(str(tmp_path_factory.mktemp("tiny64") / "model"), hidden_size=64)


def test_bench_gae_matches_the_loop_and_prints_speedup(capsys):
    speedup = load_tool("bench_gae").main(["--batch", "4", "--length", "16", "--repeats", "1"])
    machine, last = _last_lines(capsys)
    values = _pairs(last)
    assert set(values) == {"speedup", "max_abs_diff"}
    assert float(values["speedup"]) == pytest.approx(speedup, abs=0.006)  # printed to 2 decimals
    assert float(values["max_abs_diff"]) < 1e-5  # the blocked scan is the loop, to float32 rounding
    assert machine.startswith("machine: ") and "AVX-512 BF16 " in machine


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
def test_bench_logprobs_chunked_equals_direct_and_prints_the_ratios(capsys):
    load_tool("bench_logprobs").main(["--batch", "1", "--length", "8", "--vocab", "64", "--hidden", "8",
                                  "--chunk-size", "4"])
    out = capsys.readouterr().out.strip().splitlines()
    values = _pairs(out[-1])
    assert set(values) == {"memory_ratio", "time_ratio", "max_abs_diff"}
    assert float(values["memory_ratio"]) > 0 and float(values["time_ratio"]) > 0
    assert float(values["max_abs_diff"]) < 1e-5  # log-probs, entropy and both gradients
    assert [line.split()[0] for line in out[:2]] == ["direct", "chunked"]


def test_bench_rollout_says_when_the_engine_did_not_sync():
    from rllight.rollout.vllm import VLLMEngine

    sync_line = load_tool("bench_rollout").sync_line
    engine = VLLMEngine(sync_every=2)
    assert sync_line({"rollout/sync_time": 0.25}, engine) == "vllm: weight sync 0.250 s"
    assert "did not sync (the engine had not started)" in sync_line({}, engine)
    engine.llm = object()  # started; this call is one that sync_every skips
    assert sync_line({}, engine).endswith("did not sync (sync_every=2 skips this call)")


@pytest.mark.vllm
def test_bench_rollout_measures_both_engines_and_prints_vllm_over_hf(vllm_ready_model, capsys):
    pytest.importorskip("vllm")
    # --sync-every 2: the one update_weights call does not sync, the case that used to end in a KeyError.
    ratio = load_tool("bench_rollout").main(["--model-dir", vllm_ready_model, "--prompts", "2", "--warmup", "2",
                                         "--max-new-tokens", "4", "--repeats", "1", "--kv-cache-gb", "0.0625",
                                         "--sync-every", "2"])
    out = capsys.readouterr().out
    assert "vllm: weight sync not measured: update_weights did not sync (sync_every=2 skips this call)" in out
    rates = re.findall(rf"^ *(HFEngine|VLLMEngine): +({NUMBER}) tokens/s", out, re.MULTILINE)
    assert [name for name, _ in rates] == ["HFEngine", "VLLMEngine"] and all(float(r) > 0 for _, r in rates)
    mismatch = re.search(rf"logprob_diff_max=({NUMBER})", out)
    assert mismatch and float(mismatch.group(1)) < 1e-4  # vLLM's sampling log-probs are the trainer's
    machine, last = out.strip().splitlines()[-2:]
    assert machine.startswith("machine: ")
    assert _pairs(last) == {"vllm_over_hf": f"{ratio:.2f}"}


@pytest.mark.slow  # one training run in this process (Lightning, a few seconds)
def test_staleness_trains_and_reports_each_run(monkeypatch, capsys):
    staleness = load_tool("staleness")
    monkeypatch.setattr(sys, "argv", ["staleness.py", "--steps", "1", "--ns", "2", "--algos", "grpo"])
    staleness.main()
    out = capsys.readouterr().out.strip().splitlines()
    (row,) = [line for line in out if line.startswith("grpo  N=2")]
    assert "finite=yes skipped_steps=0" in row
    assert out[-3] == "all finite" and out[-2].startswith("machine: ")
    assert _pairs(out[-1]) == {"finite_runs": "1/1"}


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
                                  "--out", str(out)])
    assert code == 0
    machine, last = _last_lines(capsys)
    (result,) = json.loads((out / "compare.json").read_text())["results"]
    assert result["responses"] == 2 and result["num_val"] == 2
    assert _pairs(last) == {"grpo_accuracy_after": f"{result['accuracy_after']:.3f}"}
    assert machine.startswith("machine: ")
    assert (out / "figures" / "reward.png").is_file()


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


def test_readme_numbers_knows_every_readme_command_and_reruns_one(tmp_path, capsys):
    """Each command the tool reruns is in the README verbatim (one changed without the other fails here), and
    ``--tiny --only speedup`` runs bench_gae through it into a table row."""
    readme_numbers = load_tool("readme_numbers")
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    assert [e.command for e in readme_numbers.ENTRIES if e.command not in readme] == []
    assert readme_numbers.main(["--dry-run"]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1] == f"numbers=0/{len(readme_numbers.ENTRIES)}"
    assert readme_numbers.main(["--tiny", "--only", "speedup", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    (row,) = [line for line in out if line.startswith("| speedup |")]
    value, command = row.split(" | ")[1:3]
    assert set(_pairs(value)) == {"speedup", "max_abs_diff"}
    assert command == "`.venv/bin/python tools/bench_gae.py --batch 4 --length 16 --repeats 1`"
    assert out[-1] == "numbers=1/1"
    with pytest.raises(SystemExit):
        readme_numbers.parse_args(["--only", "nope"])
