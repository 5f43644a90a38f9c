"""RLModule's groups of options (``rllight.settings``): a value out of a group field's declared range is one line
naming its full key, an overlay that sets one field of a group keeps the recipe's others, and ``--help`` shows
each group with the docstring under each field."""

import os

import pytest

from conftest import RECIPES
from helpers import build
from rllight.app.cli import main
from rllight.errors import RecipeError
from rllight.settings import Batching, CriticFirst, GradClip, Guards


def _error(capsys, *args) -> str:
    """The one error line of ``rllight <args>``, which must exit with code 2."""
    with pytest.raises(SystemExit) as exit_info:
        main(list(args))
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "Traceback" not in "\n".join(err)
    return err[-1]


@pytest.mark.parametrize("recipe, args, expected", [
    ("grpo.yaml", ("--model.batching.ppo_epochs", "0"), "model.batching.ppo_epochs must be an integer >= 1, got 0"),
    ("grpo.yaml", ("--model.batching.micro_batch_tokens", "-5"),
     "model.batching.micro_batch_tokens must be an integer >= 1, got -5"),
    ("grpo.yaml", ("--model.guards.max_failed_reward_steps", "0"),
     "model.guards.max_failed_reward_steps must be an integer >= 1, got 0"),
    ("vapo.yaml", ("--model.critic_first.steps", "-1"), "model.critic_first.steps must be an integer >= 0, got -1"),
    ("grpo.yaml", ("--model.grad_clip.policy", "0"), "model.grad_clip.policy must be a number > 0, got 0"),
    ("ppo.yaml", ("--model.grad_clip.critic", "-1"), "model.grad_clip.critic must be a number > 0, got -1"),
])
def test_a_bad_value_in_a_group_is_one_line_naming_its_key(capsys, recipe, args, expected):
    line = _error(capsys, "fit", "--config", os.path.join(RECIPES, recipe), *args)
    assert line == f"rllight: error: {expected} (see: rllight fit --help)"


def test_a_bad_value_in_an_overlay_file_names_its_key(capsys, tmp_path):
    overlay = tmp_path / "overlay.yaml"
    overlay.write_text("model:\n  batching:\n    minibatch_size: 0\n")
    line = _error(capsys, "fit", "--config", os.path.join(RECIPES, "grpo.yaml"), "--config", str(overlay))
    assert line == ("rllight: error: model.batching.minibatch_size must be an integer >= 1, got 0 "
                    "(see: rllight fit --help)")


@pytest.mark.parametrize("make, message", [
    (lambda: Batching(ppo_epochs=0), "Batching.ppo_epochs must be an integer >= 1, got 0"),
    (lambda: Guards(max_steps_without_update=0),
     "Guards.max_steps_without_update must be an integer >= 1 or null, got 0"),
    (lambda: CriticFirst(epochs=-1), "CriticFirst.epochs must be an integer >= 0, got -1"),
    (lambda: GradClip(critic=0.0), "GradClip.critic must be a number > 0 or null, got 0.0"),
])
def test_a_group_built_in_python_checks_its_bounds(make, message):
    with pytest.raises(RecipeError) as err:
        make()
    assert str(err.value) == message


def test_an_overlay_that_sets_one_field_keeps_the_recipes_others(tmp_path):
    """recipes/grpo.yaml sets batching's ppo_epochs 1, minibatch_size 16 and micro_batch_size 16; an overlay that
    sets ppo_epochs alone changes that one (as an ablation overlay does) and keeps the others."""
    overlay = tmp_path / "overlay.yaml"
    overlay.write_text("model:\n  batching:\n    ppo_epochs: 3\n")
    module = build(os.path.join(RECIPES, "grpo.yaml"), str(overlay)).model
    assert module.batching == Batching(ppo_epochs=3, minibatch_size=16, micro_batch_size=16)
    assert module.critic_first == CriticFirst() and module.guards == Guards() and module.grad_clip == GradClip()


def test_help_shows_each_group_with_the_docstring_of_each_field(capsys):
    with pytest.raises(SystemExit):
        main(["fit", "--config", os.path.join(RECIPES, "grpo.yaml"), "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for key, doc in [("model.batching.ppo_epochs", "Passes over each rollout."),
                     ("model.batching.micro_batch_tokens", "Split minibatches by a token budget instead"),
                     ("model.guards.max_consecutive_skips", "An update whose loss or gradient is not finite is"),
                     ("model.critic_first.steps", "Critic-only optimizer steps, one minibatch each"),
                     ("model.grad_clip.policy", "The largest norm of the policy's gradients")]:
        option = key.rsplit(".", 1)[1].upper()
        assert f"--{key} {option} {doc}" in text, key
    # each group is a section of its own, titled by RLModule's Args: entry
    assert "How a rollout is cut into optimizer updates and forward passes" in text
    assert "When a run warns or ends by itself" in text
