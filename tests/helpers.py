import os
import subprocess
import sys
from contextlib import contextmanager

import torch
import yaml
from lightning.pytorch.loggers import Logger
from transformers import AutoModelForCausalLM

from conftest import RECIPES
from rllight.app.cli import RLLightCLI


def load_tool(name: str):
    """``tools/<name>.py`` as a module (the tools are scripts, not a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"rllight_{name}_tool", os.path.join(os.path.dirname(RECIPES), "tools",
                                                                                      f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def tiny_overrides(tmp_path, model_dir: str, **model_overrides) -> str:
    """A recipe overlay that swaps in the tiny model, a varying reward and a 2-step CPU budget."""
    cfg = {
        "evaluate_before_after": False,
        # float32 whatever the CPU: the recipes' precision auto would choose bf16-mixed on a CPU with AVX-512 BF16
        # or AMX, and the tests compare numbers (tests/test_same_run.py: stored ones) made in float32.
        "trainer": {"max_steps": 2, "accelerator": "cpu", "devices": 1, "precision": "32-true", "logger": False,
                    "enable_checkpointing": False, "enable_progress_bar": False, "limit_val_batches": 0,
                    "val_check_interval": None, "default_root_dir": str(tmp_path)},
        "model": {
            "model": {"class_path": "rllight.models.HFModel", "init_args": {"path": model_dir}},
            "rollout": {"class_path": "rllight.rollout.HFEngine", "init_args": {"max_new_tokens": 6}},
            "reward": {"class_path": "user_strategies.DigitReward"},
            "optimizer": {"class_path": "torch.optim.AdamW", "init_args": {"lr": 1e-2, "weight_decay": 0.0}},
            "export_dir": None,
            # Rewards in this process (the test rewards score digits, not answers: no pre-flight); the worker
            # processes are tested in tests/rewards/test_reward_runner.py and tests/rewards/test_reward_guards.py.
            "reward_runner": {"class_path": "rllight.rewards.RewardRunner", "init_args": {"workers": 0}},
            "reward_preflight": 0,
            **model_overrides,
        },
        "data": {"batch_size": 2, "val_size": 4, "task": {"class_path": "rllight.data.ArithmeticTask",
                                                          "init_args": {"num_train": 16, "num_val": 4}}},
    }
    path = os.path.join(tmp_path, "overlay.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(cfg, f)
    return path


def build(recipe: str, *extra: str) -> RLLightCLI:
    """Parse and instantiate a recipe (and overlays) without running it."""
    args = ["--config", recipe]
    for e in extra:
        args += ["--config", e] if e.endswith(".yaml") else [e]
    return RLLightCLI(args=args, run=False)


def unchanged_parameters(model: torch.nn.Module, model_dir: str, decoder: bool = False) -> list[str]:
    """Names of ``model``'s trainable parameters still equal to the weights saved in ``model_dir`` (the whole
    causal LM, or with ``decoder`` its backbone): after training, a test asserts there are none."""
    saved = AutoModelForCausalLM.from_pretrained(model_dir)
    before = (saved.get_decoder() if decoder else saved).state_dict()
    return [n for n, p in model.named_parameters() if p.requires_grad and torch.equal(p.detach(), before[n])]


TESTS = os.path.dirname(os.path.abspath(__file__))


def start_fit(recipe: str, *args: str, cwd: str | None = None, log_file: str | None = None,
              **env: str) -> subprocess.Popen:
    """Start ``rllight fit --config <recipes/recipe> <args>`` in a child process (in ``cwd``; output captured as
    text, or with ``log_file`` stdout and stderr written to that file, as a batch job's log). The child has this
    environment, the tests folder on PYTHONPATH (for the test strategies), and the ``env`` variables."""
    cmd = [sys.executable, "-m", "rllight", "fit", "--config", os.path.join(RECIPES, recipe), *args]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([TESTS, os.environ.get("PYTHONPATH", "")]), **env)
    if log_file is None:
        return subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    with open(log_file, "w") as out:
        return subprocess.Popen(cmd, env=env, cwd=cwd, stdout=out, stderr=subprocess.STDOUT, text=True)


def fit_in_child(recipe: str, *args: str, timeout: float, log_file: str | None = None,
                 **env: str) -> subprocess.CompletedProcess:
    """``start_fit`` and wait for it: the finished process, with its output (None with ``log_file``)."""
    child = start_fit(recipe, *args, log_file=log_file, **env)
    try:
        stdout, stderr = child.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        child.kill()
        child.communicate()
        raise
    return subprocess.CompletedProcess(child.args, child.returncode, stdout, stderr)


BASE_PREFIX = "# base: "


def recipe_configs(recipe: str) -> list[str]:
    """The config files that make up ``recipe``: an overlay under recipes/ablations/ names its base on its first
    line (``# base: recipes/vapo.yaml``, or a recipe and overlays, space-separated) and is parsed on top of it;
    any other recipe stands alone."""
    with open(recipe) as f:
        first = f.readline()
    if not first.startswith(BASE_PREFIX):
        return [recipe]
    bases = [os.path.join(os.path.dirname(RECIPES), b) for b in first[len(BASE_PREFIX):].split()]
    return [*bases, recipe]


@contextmanager
def recorded_samples(engine):
    """Within the block, every ``engine.generate`` call appends one list to the yielded list: for each
    prompt, the ids the engine sampled (padding dropped)."""
    samples = []
    real_generate = engine.generate

    def spy(model, tokenizer, prompts, sampling):
        gen = real_generate(model, tokenizer, prompts, sampling)
        samples.append([gen.response_ids[i][gen.response_mask[i].bool()].tolist() for i in range(len(prompts))])
        return gen

    engine.generate = spy
    try:
        yield samples
    finally:
        engine.generate = real_generate


def fit_recording_rollouts(cli) -> list:
    """Fit ``cli``'s model and return every rollout its sampler produced, in order (the sampler runs as it is;
    its result is kept as it goes to the step)."""
    seen, sampler = [], cli.model.sampler

    def record(producer, rows):
        seen.append(type(sampler).__call__(sampler, producer, rows))
        return seen[-1]

    cli.model.sampler = record
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    return seen


class CaptureLogger(Logger):
    """A logger that keeps every ``log_metrics`` call (what each step sends to the loggers:
    ``trainer.callback_metrics`` keeps every key ever logged, so it cannot tell which step logged what)."""

    def __init__(self, save_dir):
        super().__init__()
        self.calls = []
        self._save_dir = str(save_dir)

    @property
    def save_dir(self):
        return self._save_dir

    @property
    def log_dir(self):
        return self._save_dir

    @property
    def name(self):
        return "capture"

    @property
    def version(self):
        return 0

    def log_hyperparams(self, params, *args, **kwargs):
        pass

    def log_metrics(self, metrics, step=None):
        self.calls.append(dict(metrics))


def one_line_error(tmp_path, model_dir: str, capsys, recipe: str = "grpo.yaml", **model) -> str:
    """Run ``rllight fit`` in this process on ``recipe`` with the tiny-model overlay (and ``model`` overrides),
    expect the one-line error of a bad input or a failed component (exit code 2, no traceback), return it."""
    import pytest

    from rllight.app.cli import main

    overlay = tiny_overrides(tmp_path, model_dir, **model)
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", os.path.join(RECIPES, recipe), "--config", overlay])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "Traceback" not in "\n".join(err)
    return err[-1]



def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def vllm_server(model_dir: str, log_path: str, *args: str, env: dict | None = None, start_seconds: float = 420):
    """A vLLM OpenAI-compatible server on ``model_dir`` (float32, eager, 256 tokens, seed 0, ``args`` added) on a free
    port of 127.0.0.1, its output in ``log_path``; yields its URL once ``/v1/models`` answers, and stops it after.
    RuntimeError naming the log where it dies or does not answer within ``start_seconds``."""
    import json
    import time
    import urllib.request

    port = free_port()
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", **(env or {})}
    url = f"http://127.0.0.1:{port}"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir, "--port", str(port),
             "--host", "127.0.0.1", "--dtype", "float32", "--enforce-eager", "--max-model-len", "256", "--seed", "0",
             *args], env=env, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + start_seconds
        try:
            while True:
                try:
                    with urllib.request.urlopen(f"{url}/v1/models", timeout=5) as r:
                        json.loads(r.read())
                    break
                except OSError:
                    if proc.poll() is not None or time.monotonic() > deadline:
                        log.flush()
                        raise RuntimeError(f"the vLLM server did not start; see {log_path}") from None
                    time.sleep(2)
            yield url
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
