"""The same run as before: fixed-seed 3-step runs of six recipes on a tiny in-process model log the same
metrics at every step and end with the same policy and critic weights as the reference stored in
``tests/assets/same_run/<recipe>.pt``, to float32 rounding.

The reference was made by this file at the commit it records (``commit`` in each file), before a redesign
of the module, the critics, the callbacks and the scoring code; a change meant to keep behaviour must pass
it unchanged. A change that alters a run on purpose (a new metric, another update order, a fixed bug)
regenerates the reference and says why in its commit:

    python tests/test_same_run.py --write tests/assets/same_run

Each run is its recipe with the tiny model in place of every model (the policy, and a critic that names a
model of its own), an in-process reward that varies between samples, 2 prompts per step, responses of at
most 6 tokens, learning rates of 1e-2 (critics included: at the recipes' rates the zero-initialised heads
would hardly move in 3 steps) and ``trainer.max_steps: 3`` (policy updates). The recipes' algorithm
settings stay: losses, clips, estimators, samplers, critics, callbacks; only what must shrink with the
batch (minibatch and micro-batch sizes, value-pretraining rollouts) and what cannot work on a random
model (DAPO's overlong filter, see ``RUNS``) changes. What each run covers (gradient accumulation over
2 micro-batches in every update but sppo's):

- ``grpo``: 2 rollouts of 2 x 8 responses, 2 shuffled minibatch updates each (4 updates).
- ``dapo``: as grpo, with dynamic sampling, token-mean loss, clip-higher and the soft overlong punishment.
- ``vapo``: 2 value-pretraining rollouts (4 critic passes each), then 2 RL rollouts, each with K_v = 4
  critic-first optimizer steps on a separate critic (its 2 minibatches in turn, twice), advantages
  recomputed (decoupled GAE, adaptive lambda) and 2 policy updates; a self-imitation NLL update from the
  replay buffer after the second RL rollout.
- ``ppo``: 2 rollouts of 2 responses, 2 epochs each, policy and value head (shared backbone) updated
  jointly; the second rollout's GAE reads the trained head.
- ``sppo``: 2 rollouts of 2 responses, 2 minibatch updates each, a separate prompt critic (BCE) trained
  jointly.
- ``vespo``: 2 rollouts of 2 x 8 responses, 2 sequential updates each (staleness N = 2).

Metrics whose values depend on the clock (``time/*``, ``*_time``, ``*per_s``) are left out of the comparison.
The numbers are those of PyTorch's CPU kernels on one thread: another PyTorch version or CPU instruction
set may round differently and, through sampling, change a run; regenerate the reference there before
reading a failure as a change of behaviour. The final weights are compared within 1e-4, which an Intel Xeon's
and an AMD EPYC's rounding stay within (up to 3.5e-5 apart); the metrics to float32 rounding.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import tempfile

import lightning
import pytest
import torch
import yaml

from conftest import RECIPES
from helpers import CaptureLogger, build, tiny_overrides
from rllight.testing import build_tiny_model

TESTS = os.path.dirname(os.path.abspath(__file__))
REFERENCE = os.path.join(TESTS, "assets", "same_run")
SEED = 0
THREADS = 1

# A tiny model smaller than the tests' default one, so that the stored weights stay small (2 layers of width
# 16: about 10k parameters per model).
TINY = {"hidden_size": 16, "num_layers": 2, "seed": 0}

# Per recipe: "model", overrides of the model section (on top of helpers.tiny_overrides); "callbacks", changes to
# the init_args of the recipe's own callbacks (by class name; None drops the callback); "critic_model", whether
# the critic gets a model of its own (the tiny model).
_SMALL_BATCHES = {"batching": {"minibatch_size": 8, "micro_batch_size": 4}}  # 2 x 8 responses: 2 updates of 2 micro-batches
RUNS: dict[str, dict] = {
    "grpo": {"model": _SMALL_BATCHES},
    "dapo": {
        "model": _SMALL_BATCHES,
        # The random tiny model almost never ends a response within 6 tokens, so the overlong filter would
        # mask every response and no update would ever happen (as in tests/strategies/test_dapo.py); the punishment stays.
        "callbacks": {"OverlongFilter": None},
    },
    "vapo": {
        "model": {**_SMALL_BATCHES,
                  "critic": {"class_path": "rllight.critics.SeparateCritic",
                             "init_args": {"lr": 1e-2, "head_lr": 1e-2}}},
        "callbacks": {
            "ValuePretraining": {"max_steps": 2},  # at most 2 pretraining rollouts (the recipe: 30); the 2nd replays
            # A random model's responses are almost never correct: every scored response counts as a success.
            "SelfImitation": {"min_reward": 0.0},
        },
    },
    "ppo": {"model": {"batching": {"minibatch_size": None, "micro_batch_size": 1}}},  # 2 responses, 2 epochs: 2 updates
    "sppo": {
        "model": {
            "batching": {"minibatch_size": 1, "micro_batch_size": 1},  # 2 responses: 2 updates
            # A 0/1 reward (the critic's BCE needs targets in [0, 1]).
            "reward": {"class_path": "user_strategies.EvenAnswer"},
            "critic": {"class_path": "rllight.critics.PromptCritic", "init_args": {"lr": 1e-2}},
        },
        "critic_model": True,  # as the recipe's critic (a model of its own)
    },
    "vespo": {"model": _SMALL_BATCHES},
}
RECIPE_NAMES = tuple(RUNS)


def _clock_dependent(key: str) -> bool:
    name = key.split("/", 1)[1] if key.startswith("train/") else key
    return name.startswith("time/") or name.endswith(("_time", "per_s")) or "/time/" in name


def _step_metrics(calls: list[dict]) -> list[dict[str, float]]:
    """The metrics of each logging call that carries more than the epoch, clock-dependent ones left out."""
    steps = [{k: float(v) for k, v in call.items() if not _clock_dependent(k)} for call in calls]
    return [dict(sorted(step.items())) for step in steps if set(step) - {"epoch"}]


def _callbacks_overlay(recipe_path: str, changes: dict, path: str) -> str | None:
    """An overlay with the recipe's own ``trainer.callbacks``, changed as ``changes`` says."""
    if not changes:
        return None
    with open(recipe_path) as f:
        callbacks = yaml.safe_load(f)["trainer"]["callbacks"]
    kept = []
    for cb in callbacks:
        name = cb["class_path"].rsplit(".", 1)[-1]
        if name in changes and changes[name] is None:
            continue
        kept.append({**cb, "init_args": {**cb.get("init_args", {}), **changes.get(name, {})}})
    unknown = set(changes) - {cb["class_path"].rsplit(".", 1)[-1] for cb in callbacks}
    assert not unknown, f"{recipe_path} has no callbacks {unknown}"
    with open(path, "w") as f:
        yaml.safe_dump({"trainer": {"callbacks": kept}}, f)
    return path


def tiny_model(folder: str) -> str:
    return build_tiny_model(os.path.join(folder, "tiny"), **TINY)


def fingerprint(model_dir: str) -> str:
    """A digest of the tiny model's initial weights and its tokenizer's vocabulary, merges and special tokens."""
    from safetensors.torch import load_file

    digest = hashlib.sha256()
    for name, tensor in sorted(load_file(os.path.join(model_dir, "model.safetensors")).items()):
        digest.update(name.encode())
        digest.update(tensor.to(torch.float32).contiguous().numpy().tobytes())
    with open(os.path.join(model_dir, "tokenizer.json")) as f:
        tokenizer = json.load(f)
    merges = [" ".join(m) if isinstance(m, list) else m for m in tokenizer["model"]["merges"]]
    specials = sorted((t["id"], t["content"]) for t in tokenizer["added_tokens"])
    digest.update(json.dumps([tokenizer["model"]["vocab"], merges, specials], sort_keys=True).encode())
    return digest.hexdigest()


def _float32_cpu(state: dict) -> dict[str, torch.Tensor]:
    # Tied weights stay one tensor (torch.save keeps a storage once).
    return {name: t.detach().to("cpu", torch.float32) for name, t in state.items()}


def run_recipe(name: str, model_dir: str, folder: str) -> dict:
    """Run ``recipes/<name>.yaml`` as ``RUNS[name]`` says, with fixed seeds, in this process; return
    ``{"global_step": policy updates, "metrics": [{key: value} per step], "weights": {"policy.<name>" /
    "critic.<name>": tensor}}``."""
    spec = RUNS[name]
    recipe = os.path.join(RECIPES, f"{name}.yaml")
    model = dict(spec.get("model", {}))
    if spec.get("critic_model"):
        critic = model["critic"]
        model["critic"] = {**critic, "init_args": {
            **critic.get("init_args", {}),
            "model": {"class_path": "rllight.models.HFModel", "init_args": {"path": model_dir}}}}
    overlays = [tiny_overrides(folder, model_dir, **model)]
    callbacks = _callbacks_overlay(recipe, spec.get("callbacks"), os.path.join(folder, "callbacks.yaml"))
    if callbacks:
        overlays.append(callbacks)
    threads = torch.get_num_threads()
    torch.set_num_threads(THREADS)
    try:
        cli = build(recipe, *overlays, "--trainer.max_steps", "3", "--seed_everything", str(SEED))
        recorder = CaptureLogger(folder)
        cli.trainer.loggers = [recorder]
        lightning.seed_everything(SEED, verbose=False)
        cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    finally:
        torch.set_num_threads(threads)
    assert cli.trainer.global_step >= 3, f"{name}: {cli.trainer.global_step} policy updates"
    weights = {f"policy.{k}": v for k, v in _float32_cpu(cli.model.policy.state_dict()).items()}
    if cli.model.critic is not None:
        weights.update({f"critic.{k}": v for k, v in _float32_cpu(cli.model.critic.state_dict()).items()})
    return {"global_step": cli.trainer.global_step, "metrics": _step_metrics(recorder.calls), "weights": weights}


def _commit() -> str:
    def git(*args):
        return subprocess.run(["git", "-C", TESTS, *args], capture_output=True, text=True, check=True).stdout.strip()

    head = git("rev-parse", "HEAD")
    return head + ("-dirty" if git("status", "--porcelain", "--untracked-files=no", "--", "..") else "")


@pytest.fixture(scope="module")
def same_run_model(tmp_path_factory) -> str:
    return tiny_model(str(tmp_path_factory.mktemp("same_run")))


@pytest.mark.parametrize("recipe", RECIPE_NAMES)
def test_same_metrics_and_weights_as_before_the_redesign(recipe, tmp_path, same_run_model):
    reference = torch.load(os.path.join(REFERENCE, f"{recipe}.pt"), weights_only=True)
    assert fingerprint(same_run_model) == reference["tiny_model"], (
        "the tiny model (rllight.testing.build_tiny_model) is not the one the reference was made with")
    got = run_recipe(recipe, same_run_model, str(tmp_path))
    assert got["global_step"] == reference["global_step"], "policy updates"
    expected_steps = reference["metrics"]
    assert len(got["metrics"]) == len(expected_steps), "number of logged steps"
    for step, (metrics, expected) in enumerate(zip(got["metrics"], expected_steps)):
        assert sorted(metrics) == sorted(expected), f"step {step}: metric keys"
        for key in sorted(expected):
            torch.testing.assert_close(torch.tensor(metrics[key], dtype=torch.float32),
                                       torch.tensor(expected[key], dtype=torch.float32), equal_nan=True,
                                       msg=lambda m, key=key, step=step: f"step {step}, {key}: {m}")
    weights, expected = got["weights"], reference["weights"]
    assert sorted(weights) == sorted(expected), "parameter names"
    # The weights within 1e-4 (about 0.1 % of their scale, 0.1): CPUs of other kinds (Intel Xeon, AMD EPYC with
    # AVX2 or AVX-512) round the 3 steps' products differently, by up to 3.5e-5 in vapo's weights, while one
    # update at lr 1e-2 moves a weight by about 1e-2. Adam turns a gradient element that is nearly 0 into a
    # step of about lr whose size its rounding decides, so at most 1 element in 1000 of a tensor may differ by
    # up to 1e-3 (seen: 1 of 4800 by 4e-4 in vapo's lm_head); a change of behaviour moves far more by far more.
    for name in sorted(expected):
        diff = (weights[name].float() - expected[name].float()).abs()
        loose = int((diff > 1e-4 + 1.3e-6 * expected[name].float().abs()).sum())
        assert loose <= diff.numel() // 1000 and float(diff.max()) <= 1e-3, (
            f"{name}: {loose} of {diff.numel()} elements differ by more than 1e-4, the most by {float(diff.max()):.3g}")


def write(out: str, recipes=RECIPE_NAMES) -> None:
    os.makedirs(out, exist_ok=True)
    commit = _commit()
    with tempfile.TemporaryDirectory() as folder:
        model_dir = tiny_model(folder)
        tiny = fingerprint(model_dir)
        for name in recipes:
            run_dir = os.path.join(folder, name)
            os.makedirs(run_dir)
            result = run_recipe(name, model_dir, run_dir)
            torch.save({"commit": commit, "tiny_model": tiny, **result}, os.path.join(out, f"{name}.pt"))
            print(f"{name}: {len(result['metrics'])} steps, {len(result['weights'])} tensors")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="Write the reference of tests/test_same_run.py.")
    parser.add_argument("--write", required=True, metavar="DIR", help="folder for <recipe>.pt (tests/assets/same_run)")
    parser.add_argument("--recipes", nargs="*", default=list(RECIPE_NAMES), choices=RECIPE_NAMES)
    args = parser.parse_args()
    write(args.write, args.recipes)
