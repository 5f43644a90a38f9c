"""``ValuePretraining.group_size``: the pretraining rollouts keep their number of responses and spread them over more
prompts (the step's batch and more drawn from the training prompts); RL's rollouts are the recipe's again."""

import logging
import os
from types import SimpleNamespace

import pytest
import yaml

from conftest import RECIPES
from helpers import build, tiny_overrides
from rllight.callbacks import RolloutCallback, ValuePretraining
from rllight.errors import RecipeError
from rllight.strategies import DynamicSampling, GroupSampler, Sampler


class RecordGroups(RolloutCallback):
    """Each rollout's responses per prompt, before value pretraining consumes it."""

    rollout_order = 10

    def __init__(self):
        self.groups = []

    def on_rollout(self, trainer, context, rollout):
        self.groups.append(sorted(rollout.group_ids.unique(return_counts=True)[1].tolist()))
        return rollout


def test_pretraining_rollouts_spread_the_responses_over_more_prompts_and_rl_takes_the_recipes(tmp_path,
                                                                                           tiny_model_dir, caplog):
    callbacks = os.path.join(tmp_path, "callbacks.yaml")
    with open(callbacks, "w") as f:
        yaml.safe_dump({"trainer": {"callbacks": [{"class_path": "rllight.callbacks.ValuePretraining", "init_args": {
            "max_steps": 2, "patience": None, "group_size": 2}}]}}, f)
    # recipes/vapo.yaml samples 8 responses per prompt; the tiny overlay's batch is 2 prompts: 16 responses a rollout.
    cli = build(os.path.join(RECIPES, "vapo.yaml"), tiny_overrides(tmp_path, tiny_model_dir), callbacks,
                "--trainer.max_steps", "1", "--model.critic_first.steps", "1")
    record = RecordGroups()
    cli.trainer.callbacks.append(record)
    with caplog.at_level(logging.INFO, logger="rllight.callbacks.value_pretraining"):
        cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    told = [r.getMessage() for r in caplog.records if "responses per prompt over" in r.getMessage()]
    assert told == ["value pretraining samples 2 responses per prompt over 4 times the step's prompts, until it ends; "
                    "RL then samples 8 per prompt"]  # once, not at every pretraining step
    # Two pretraining rollouts of 8 prompts x 2 responses, then RL's of 2 prompts x 8.
    assert record.groups == [[2] * 8, [2] * 8, [8, 8]]
    # The 6 more prompts of each pretraining rollout came from the training prompts' stream.
    assert cli.model.prompt_stream.cursor == 12


def test_group_size_must_divide_a_group_samplers_size_and_is_checked_before_the_model_loads():
    ValuePretraining(group_size=2).check_before_fit(SimpleNamespace(sampler=GroupSampler(8)))
    ValuePretraining().check_before_fit(SimpleNamespace(sampler=DynamicSampling(group_size=8)))  # not set: no check
    with pytest.raises(RecipeError, match="group_size 3 does not divide model.sampler's group_size 8"):
        ValuePretraining(group_size=3).check_before_fit(SimpleNamespace(sampler=GroupSampler(8)))
    with pytest.raises(RecipeError, match="needs model.sampler a GroupSampler, not DynamicSampling"):
        ValuePretraining(group_size=2).check_before_fit(SimpleNamespace(sampler=DynamicSampling(group_size=8)))


def test_once_finished_or_without_group_size_the_recipes_sampler_makes_the_rollout():
    sampler = GroupSampler(8)
    assert ValuePretraining().step_sampler(sampler) is sampler
    done = ValuePretraining(group_size=2, max_steps=0)  # no pretraining at all: finished from the start
    assert done.step_sampler(sampler) is sampler
    spread = ValuePretraining(group_size=2).step_sampler(sampler)
    assert (spread.group_size, spread.spread) == (2, 4)


def test_a_spread_rollout_is_a_sampler_that_asks_nothing_ahead():
    """An asynchronous engine's prefetch of the batch's rows alone would never be collected: the step samples them
    together with rows drawn only then."""
    asked = []
    producer = SimpleNamespace(prefetch=lambda rows, n: asked.append((rows, n)))
    spread = ValuePretraining(group_size=2).step_sampler(GroupSampler(8))
    assert isinstance(spread, Sampler)
    spread.prefetch(producer, [{"prompt": "1+1"}])
    assert asked == []
    GroupSampler(8).prefetch(producer, [{"prompt": "1+1"}])  # the recipe's sampler asks (the fake can tell)
    assert asked == [([{"prompt": "1+1"}], 8)]
