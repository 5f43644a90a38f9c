"""Every component a recipe sets acts.

- A clip range is a knob only when the ratio leaves 1, i.e. with several optimizer updates per rollout:
  every recipe whose objective clips a ratio runs two rollouts on the tiny model with its own minibatch,
  epoch and clip settings, and some update must clip (``train/policy/clipfrac_low`` or ``_high`` > 0).
- Every ablation overlay in recipes/ablations/ changes the run: applied to its base recipe (same seed, same
  tiny budget), the trained parameters or the logged losses must differ from the base run's. Two runs of
  one recipe are bit-identical (checked first), so a difference comes from the overlay.
"""

import glob
import math
import os

import lightning as L
import pytest
import torch
import yaml

from conftest import RECIPES
from helpers import build
from rllight.models import HFModel
from rllight.rewards import Verifier

ROOT = os.path.dirname(RECIPES)
ABLATIONS = sorted(glob.glob(os.path.join(RECIPES, "ablations", "*.yaml")))

# Recipes whose policy objective clips an importance ratio (ClippedSurrogate, SequenceClippedSurrogate,
# GSPO, CISPO, and TruncatedIS around a clipped surrogate), with the overlays that make them so.
CLIPPED = [
    ("quickstart.yaml",), ("quickstart-lora.yaml",), ("grpo.yaml",),
    ("grpo.yaml", "ablations/grpo-bf16-engine.yaml", "ablations/grpo-tis.yaml"),
    ("dapo.yaml",), ("dr_grpo.yaml",), ("ppo.yaml",), ("reinforce_pp.yaml",), ("remax.yaml",), ("rloo.yaml",),
    ("gspo.yaml",), ("cispo.yaml",), ("sppo.yaml",), ("sppo.yaml", "ablations/sppo-token-level.yaml"),
    ("sppo-small-critic.yaml",), ("vapo.yaml",), ("vapo-paper-lambda.yaml",),
]

# Responses of the random tiny model rarely end before the limit (about 3 % end within 6 tokens); DAPO's
# overlong filter masks truncated responses and its punishment reads lengths, so its runs keep the recipe's
# own 24 tokens (about 1 response in 10 ends: the filter masks most, not all).
MAX_NEW_TOKENS = {"dapo.yaml": 24}
# Learning rate of the tiny runs: high enough that one update moves the tiny model's ratios past a clip.
# LoRA starts from B = 0, so its first updates change the function far less than a full update.
LR = {"quickstart-lora.yaml": 1e-1}


class HalfMixed(Verifier):
    """Correct when the reference answer is even and the response has an even number of characters: every
    group of an odd-answer prompt is all wrong (constant, as dynamic sampling must see), the others are
    usually mixed. Rewards are 0 / 1, as SPPO's critic needs."""

    def is_correct(self, response: str, answer: str) -> bool:
        return int(answer) % 2 == 0 and len(response) % 2 == 0


class DigitShare(Verifier):
    """The share of the response's characters that are digits, in [0, 1]: varies across the tiny model's
    samples, so nearly every response has a non-zero advantage (and SPPO's BCE target stays in [0, 1])."""

    def __call__(self, response: str, answer: str) -> float:
        return sum(c.isdigit() for c in response) / max(len(response), 1)


class _Recorder(L.Callback):
    """The metrics of every RL step, in order."""

    def __init__(self):
        self.steps: list[dict[str, float]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.steps.append({k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("train/")})


def _tiny_overlay(tmp_path, model_dir: str, max_new_tokens: int, lr: float, reward: str) -> str:
    """The tiny model, a reward in [0, 1], a learning rate at which the tiny model's ratios move, and no logging.
    The recipe's own batch size, group size, minibatches, epochs and clip range are kept."""
    cfg = {
        "evaluate_before_after": False,
        # float32 (the recipes' precision auto would choose bf16-mixed on some CPUs): an overlay that changes the
        # engine's precision must differ from its base on every machine.
        "trainer": {"accelerator": "cpu", "devices": 1, "precision": "32-true", "logger": False,
                    "enable_checkpointing": False,
                    "enable_progress_bar": False, "enable_model_summary": False, "limit_val_batches": 0,
                    "val_check_interval": None, "default_root_dir": str(tmp_path)},
        "model": {
            "model": {"class_path": "rllight.models.HFModel", "init_args": {"path": model_dir}},
            "rollout": {"class_path": "rllight.rollout.HFEngine", "init_args": {"max_new_tokens": max_new_tokens}},
            "reward": {"class_path": f"{__name__}.{reward}"},
            "optimizer": {"class_path": "torch.optim.AdamW", "init_args": {"lr": lr, "weight_decay": 0.0}},
            "export_dir": None,
            "reward_preflight": 0,  # the test rewards do not read the answer format
            # Rewards in this process: these runs test the objectives, not the reward workers.
            "reward_runner": {"class_path": "rllight.rewards.RewardRunner", "init_args": {"workers": 0}},
        },
        "data": {"val_size": 4, "task": {"class_path": "rllight.data.ArithmeticTask",
                                         "init_args": {"num_train": 64, "num_val": 4}}},
    }
    path = os.path.join(tmp_path, "tiny.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(cfg, f)
    return path


def _updates_per_rollout(cli) -> int:
    module = cli.model
    responses = cli.datamodule.batch_size * module.sampler.group_size
    batching = module.batching
    return batching.ppo_epochs * math.ceil(responses / (batching.minibatch_size or responses))


def _run(tmp_path, model_dir: str, *configs: str, rollouts: int = 2, reward: str = "HalfMixed"):
    """Fit ``configs`` (recipe, then overlays, relative to recipes/) on the tiny model for ``rollouts`` RL
    steps' worth of policy updates. Returns the module and the per-step metrics."""
    recipe = configs[0]
    os.makedirs(tmp_path, exist_ok=True)
    overlay = _tiny_overlay(tmp_path, model_dir, MAX_NEW_TOKENS.get(recipe, 6), LR.get(recipe, 1e-2), reward)
    cli = build(*[os.path.join(RECIPES, c) for c in configs], overlay)
    critic_source = getattr(cli.model.critic, "source", None)
    if isinstance(critic_source, HFModel):  # a separate critic: the tiny model too, not the recipe's
        cli.model.critic.source = HFModel(model_dir)
    # trainer.max_steps counts optimizer updates of the policy.
    cli.trainer.fit_loop.epoch_loop.max_steps = rollouts * _updates_per_rollout(cli)
    recorder = _Recorder()
    cli.trainer.callbacks.append(recorder)
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    return cli.model, recorder.steps


# --------------------------------------------------------------------------------------------------
# Clip ranges bind
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("configs", CLIPPED, ids=lambda c: "+".join(os.path.basename(x) for x in c))
def test_clip_binds_with_the_recipes_own_updates_per_rollout(configs, tmp_path, tiny_model_dir):
    cli = build(*[os.path.join(RECIPES, c) for c in configs])
    assert _updates_per_rollout(cli) > 1, f"{configs}: one optimizer update per rollout: every ratio is 1"
    _, steps = _run(tmp_path, tiny_model_dir, *configs, reward="DigitShare")
    clipped = [max(s.get("train/policy/clipfrac_low", 0.0), s.get("train/policy/clipfrac_high", 0.0)) for s in steps]
    assert any("train/policy/clipfrac_low" in s for s in steps), f"{configs}: no clip fraction logged"
    assert max(clipped) > 0, f"{configs}: the clip never bound in {len(steps)} steps"


def test_vespo_kernel_moves_away_from_one(tmp_path, tiny_model_dir):
    # VESPO has no clip: its kernel phi(W) weighs each response by its sequence ratio against the trainer's old
    # log-probs. W = 1 on each rollout's first minibatch, so with a single update per rollout every weight is 1:
    # the recipe's later minibatches must move it.
    _, steps = _run(tmp_path, tiny_model_dir, "vespo.yaml", reward="DigitShare")
    phi = [s["train/policy/vespo_phi_mean"] for s in steps if "train/policy/vespo_phi_mean" in s]
    assert phi and max(abs(p - 1.0) for p in phi) > 1e-3, phi


# --------------------------------------------------------------------------------------------------
# Ablation overlays change the run
# --------------------------------------------------------------------------------------------------


def _base_of(overlay: str) -> tuple[str, ...]:
    """The base an overlay names on its first line: a recipe, possibly followed by overlays (relative to
    recipes/)."""
    with open(overlay) as f:
        first = f.readline()
    assert first.startswith("# base: recipes/"), overlay
    return tuple(os.path.relpath(b, "recipes") for b in first[len("# base: "):].split())


def _fingerprint(module, steps) -> tuple[dict[str, torch.Tensor], list[float | None]]:
    """The trained policy's parameters, and of every step the policy loss and how far the behaviour policy's
    log-probs were from the trainer's (an overlay that changes only the sampling engine, e.g. its precision,
    changes the run's behaviour policy even where a tiny model happens to draw the same tokens)."""
    params = {n: p.detach().clone() for n, p in module.policy.named_parameters()}
    keys = ("train/policy/loss", "train/rollout/logprob_diff_mean")
    return params, [s.get(k) for s in steps for k in keys]


def _same(a, b, tol: float = 1e-6) -> bool:
    """Equal up to float noise: an overlay whose effect is a rounding difference (e.g. an importance weight of
    1 +- 1e-7) has not changed the run."""
    (pa, la), (pb, lb) = a, b
    if len(la) != len(lb) or pa.keys() != pb.keys():
        return False
    if any((x is None) != (y is None) or (x is not None and abs(x - y) > tol * max(1.0, abs(x))) for x, y in zip(la, lb)):
        return False
    return all(torch.allclose(pa[k], pb[k], rtol=0, atol=tol) for k in pa)


@pytest.fixture(scope="module")
def base_runs():
    """One run per base recipe, shared by its overlays."""
    return {}


def _base_run(base_runs, base: tuple[str, ...], tmp_path_factory, model_dir: str):
    if base not in base_runs:
        module, steps = _run(tmp_path_factory.mktemp("base"), model_dir, *base)
        base_runs[base] = _fingerprint(module, steps)
    return base_runs[base]


def test_two_runs_of_a_recipe_are_identical(base_runs, tmp_path_factory, tiny_model_dir):
    # The control for the test below: without it, run-to-run noise would pass for an overlay's effect.
    first = _base_run(base_runs, ("grpo.yaml",), tmp_path_factory, tiny_model_dir)
    module, steps = _run(tmp_path_factory.mktemp("again"), tiny_model_dir, "grpo.yaml")
    assert all(loss is not None for loss in first[1])
    assert _same(first, _fingerprint(module, steps))


@pytest.mark.parametrize("overlay", ABLATIONS, ids=os.path.basename)
def test_ablation_overlay_changes_the_run(overlay, base_runs, tmp_path_factory, tiny_model_dir):
    base = _base_of(overlay)
    expected = _base_run(base_runs, base, tmp_path_factory, tiny_model_dir)
    module, steps = _run(tmp_path_factory.mktemp("ablation"), tiny_model_dir, *base,
                         os.path.relpath(overlay, RECIPES))
    assert not _same(expected, _fingerprint(module, steps)), f"{os.path.basename(overlay)} trains exactly like {base}"
