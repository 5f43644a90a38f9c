"""Each part owns its state and its inputs: the module composes its parts' ``state_dict()``s into a checkpoint
(``rllight.checkpoint`` adds only the random streams, the per-rank gathering and the framing), a checkpoint of the
earlier flat layout still restores every counter and resumes, rollout callbacks get a declared ``RolloutContext``,
the ``Updater`` is given what it uses and the engine is synced once per update that moved the policy, and nothing
under ``rllight/rollout/`` reads the trainer.

``tests/assets/checkpoints/dapo-2-steps-flat-run-state.ckpt`` was written by the code of commit f3ad3c9 (before the
parts kept their own state: ``checkpoint["rllight"]`` a flat dict of counters) with ``RUN`` below: 2 RL steps of
recipes/dapo.yaml on the tiny model of hidden size 16 (``TINY``), 3 groups of 8 per step (dynamic sampling draws
2 extra prompts each step), a reward that fails on half the samples (``user_strategies.FlakyReward``), and
``max_prompt_tokens`` 43, which drops the longest prompts. That code, resumed from it for one more step, ended
with the counters of ``RESUMED``."""

from __future__ import annotations

import ast
import os
import pathlib
from types import SimpleNamespace

import lightning as L
import pytest
import torch
import yaml

from conftest import RECIPES
from helpers import build, tiny_overrides
from rllight.callbacks import RolloutContext
from rllight.checkpoint import load_run_state, rng_state, set_rng_state
from rllight.distributed import Ranks
from rllight.errors import RecipeError
from rllight.rollout.producer import prefetch_ahead
from rllight.testing import build_tiny_model

ROOT = pathlib.Path(__file__).resolve().parents[1]
FLAT = os.path.join(os.path.dirname(__file__), "assets", "checkpoints", "dapo-2-steps-flat-run-state.ckpt")
TINY = {"hidden_size": 16, "num_layers": 2, "seed": 0}
RUN = ("--model.sampler.init_args.target_groups", "3", "--model.sampler.init_args.max_rounds", "2",
       "--seed_everything", "0")
SAVED = {"extra_prompt_cursor": 4, "consecutive_skips": 0, "prefetched_through": -1, "rollout_engine": {},
         "reward_failures": 24, "dropped_prompts": 2, "failed_reward_steps": 0}
"""``checkpoint["rllight"]`` of the stored checkpoint, as that code wrote it."""
RESUMED = {"global_step": 3, "batches_trained": 3, "cursor": 6,
           "producer": {"reward_failures": 36, "dropped_prompts": 3, "truncated_prompts": 0, "failed_reward_steps": 0}}


@pytest.fixture(scope="module")
def small_model(tmp_path_factory) -> str:
    return build_tiny_model(str(tmp_path_factory.mktemp("small") / "model"), **TINY)


def _dapo(tmp_path, model_dir, *args):
    """recipes/dapo.yaml as ``RUN`` ran it (the soft overlong punishment kept, the filter dropped)."""
    overlay = tiny_overrides(tmp_path, model_dir, batching={"minibatch_size": None, "micro_batch_size": 8},
                             max_prompt_tokens=43,
                             reward={"class_path": "user_strategies.FlakyReward"})
    callbacks = tmp_path / "callbacks.yaml"
    callbacks.write_text(yaml.safe_dump({"trainer": {"callbacks": [
        {"class_path": "rllight.callbacks.SoftOverlongPunishment", "init_args": {"cache_len": 6}}]}}))
    return build(os.path.join(RECIPES, "dapo.yaml"), overlay, str(callbacks), *RUN, *args)


@pytest.fixture
def kept_rng():
    """The test's loads set the process's random streams: they are put back after it."""
    state = rng_state()
    yield
    set_rng_state(state)


def test_the_stored_checkpoint_has_the_flat_layout():
    checkpoint = torch.load(FLAT, weights_only=True)
    assert checkpoint["rllight"] == SAVED and "ranks" not in checkpoint and checkpoint["global_step"] == 2


def test_a_checkpoint_of_the_flat_layout_restores_every_counter(tmp_path, small_model, kept_rng):
    checkpoint = torch.load(FLAT, weights_only=True)
    # The flat keys, read as the parts they belong to now.
    assert load_run_state(checkpoint, Ranks()) == {
        "prompt_stream": {"cursor": 4}, "updater": {"consecutive_skips": 0}, "prefetched_through": -1,
        "rollout_engine": {}, "producer": {"reward_failures": 24, "dropped_prompts": 2, "failed_reward_steps": 0}}
    module = _dapo(tmp_path, small_model).model
    # Counters other than the saved ones first, so that a counter the load missed shows.
    module.updater.consecutive_skips, module.prefetched_through = 2, 7
    module.producer.load_state_dict({"reward_failures": 99, "dropped_prompts": 99, "failed_reward_steps": 1})
    module.on_load_checkpoint(checkpoint)
    assert module.updater.consecutive_skips == 0 and module.prefetched_through == -1
    assert module.producer.state_dict() == {"reward_failures": 24, "dropped_prompts": 2, "truncated_prompts": 0,
                                            "failed_reward_steps": 0}
    assert torch.equal(torch.get_rng_state(), checkpoint["rng"]["torch"])
    # The prompt stream is built by setup: its cursor waits until then, and a save before then keeps it.
    saved = {}
    module.on_save_checkpoint(saved)
    assert saved["rllight"] == {"format": 2, "parts": {
        "updater": {"consecutive_skips": 0}, "prompt_stream": {"cursor": 4},
        "producer": {"reward_failures": 24, "dropped_prompts": 2, "truncated_prompts": 0, "failed_reward_steps": 0},
        "rollout_engine": {}, "prefetched_through": -1}}


def test_a_run_resumes_from_a_checkpoint_of_the_flat_layout(tmp_path, small_model):
    cli = _dapo(tmp_path, small_model, "--trainer.max_steps", "3")
    cli.trainer.fit(cli.model, datamodule=cli.datamodule, ckpt_path=FLAT)
    module = cli.model
    # The run went on from step 2's batch, prompt cursor and counters, as the code that wrote it did.
    assert {"global_step": cli.trainer.global_step, "batches_trained": cli.datamodule.batches_trained,
            "cursor": module.prompt_stream.cursor, "producer": module.producer.state_dict()} == RESUMED


def test_each_part_saves_its_own_state_and_a_resume_restores_it(tmp_path, small_model, kept_rng):
    cli = _dapo(tmp_path, small_model, "--trainer.max_steps", "1")
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    saved = {}
    cli.model.on_save_checkpoint(saved)
    parts = saved["rllight"]["parts"]
    assert saved["rllight"]["format"] == 2 and parts["prompt_stream"] == {"cursor": 2}
    assert parts["producer"] == {"reward_failures": 12, "dropped_prompts": 1, "truncated_prompts": 0,
                                 "failed_reward_steps": 0}
    fresh = _dapo(tmp_path, small_model).model
    fresh.on_load_checkpoint(saved)
    again = {}
    fresh.on_save_checkpoint(again)
    assert again["rllight"] == saved["rllight"]


def test_a_run_state_of_a_newer_layout_is_refused_in_one_line():
    with pytest.raises(RecipeError, match=r"format 3, newer than this rllight reads \(2\)") as err:
        load_run_state({"rllight": {"format": 3, "parts": {}}}, Ranks())
    assert "\n" not in str(err.value)
    assert load_run_state({}, Ranks()) == {}  # a checkpoint without a run state: every part starts fresh


# ------------------------------------------------------------------------------------- the module's parts
def test_rollout_callbacks_get_a_declared_context_not_the_module(tmp_path, small_model):
    module = _dapo(tmp_path, small_model).model
    context = module.rollout_context()
    assert isinstance(context, RolloutContext) and not isinstance(context, L.LightningModule)
    assert context.updater is module.updater and context.scoring is module.scoring and context.critic is None
    assert context.max_new_tokens == module.rollout.max_new_tokens == 6 and context.gamma == 1.0
    assert context.ranks.world_size == 1


def test_the_updater_holds_no_module_and_the_engine_syncs_after_each_update_that_moved_the_policy(tmp_path,
                                                                                                   small_model):
    # 16 responses in minibatches of 8: 2 policy updates per step, 4 in 2 steps; the engine counts its syncs.
    overlay = tiny_overrides(tmp_path, small_model, batching={"minibatch_size": 8, "micro_batch_size": 8},
                             rollout={"class_path": "user_strategies.FailsOnSync", "init_args": {"max_new_tokens": 6}})
    cli = build(os.path.join(RECIPES, "grpo.yaml"), overlay, "--trainer.max_steps", "4")
    module = cli.model
    assert not any(isinstance(v, L.LightningModule) for v in vars(module.updater).values())
    moved = []
    update = module.updater.update

    def spy(*args, **kwargs):
        out, policy_moved = update(*args, **kwargs)
        moved.append(policy_moved)
        return out, policy_moved

    module.updater.update = spy
    cli.trainer.fit(module, datamodule=cli.datamodule)
    assert cli.trainer.global_step == 4 and moved == [True] * 4
    assert module.rollout.syncs == 4


def test_prefetch_ahead_reads_plain_values():
    # k = 4 updates of lag at 2 updates per step: the 2 batches after this step's are asked for, once each, and
    # none past the run's last update.
    producer = SimpleNamespace(engine=SimpleNamespace(max_staleness=4))
    sent, asked = [], []
    sampler = SimpleNamespace(prefetch=lambda producer, rows: sent.append(rows))

    def upcoming(first, count):
        asked.append((first, count))
        return [[{"batch": first + i}] for i in range(count)]

    assert prefetch_ahead(sampler, producer, 2, -1, upcoming, 2, None) == 4 and asked == [(3, 2)]
    assert sent == [[{"batch": 3}], [{"batch": 4}]]
    assert prefetch_ahead(sampler, producer, 2, 4, upcoming, 3, None) == 5 and asked[-1] == (5, 1)  # 4: asked
    # 3 updates left, this step's 2 among them: one batch after this one is trained on.
    assert prefetch_ahead(sampler, producer, 2, -1, upcoming, 3, 3) == 4 and asked[-1] == (4, 1)
    assert prefetch_ahead(sampler, producer, 2, 7, None, 3, None) == 7  # no batches to send ahead
    producer.engine.max_staleness = 0  # a synchronous engine
    assert prefetch_ahead(sampler, producer, 2, 7, upcoming, 3, None) == 7 and len(asked) == 3


def test_nothing_under_rllight_rollout_reads_the_trainer():
    """No name, argument or attribute of the trainer's in the rollout floor's code (prose may name its settings)."""
    trainer_names = {"trainer", "datamodule", "global_step", "lightning_module", "pl_module", "max_steps"}
    found = []
    for path in sorted((ROOT / "rllight" / "rollout").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            name = (node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute)
                    else node.arg if isinstance(node, ast.arg) else None)
            if name in trainer_names:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {name}")
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                modules = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                found += [f"{path.relative_to(ROOT)}:{node.lineno}: imports {m}" for m in modules
                          if m.split(".")[0] in ("lightning", "pytorch_lightning")]
    assert found == []
