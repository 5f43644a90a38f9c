"""A loss term of a user's own, named in a recipe, joins every policy update without any change to rllight:
the example of docs/extending/loss-term.md, run as written."""

import os
import sys

import pytest
import torch

from conftest import RECIPES
from helpers import build, tiny_overrides
from test_docs_examples import install_my_lab


@pytest.fixture
def my_lab(tmp_path, monkeypatch):
    """The ``my_lab.py`` of docs/extending/loss-term.md (its python block), importable as ``my_lab``."""
    install_my_lab("extending/loss-term.md", tmp_path / "user", monkeypatch)
    yield
    sys.modules.pop("my_lab", None)


def _fit(tmp_path, model_dir, name, terms):
    (tmp_path / name).mkdir()
    cli = build(os.path.join(RECIPES, "grpo.yaml"), tiny_overrides(tmp_path / name, model_dir, loss_terms=terms))
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    weights = {k: v.detach().clone() for k, v in cli.model.policy.state_dict().items()}
    return cli, weights


def _penalty(coef):
    # The tiny model's responses run 1 to 6 tokens: a limit of 2 penalises some of them.
    return [{"class_path": "my_lab.LengthPenalty", "init_args": {"coef": coef, "max_len": 2}}]


def test_the_documented_loss_term_joins_every_policy_update(tmp_path, tiny_model_dir, my_lab):
    _, plain = _fit(tmp_path, tiny_model_dir, "plain", None)
    cli, penalised = _fit(tmp_path, tiny_model_dir, "penalised", _penalty(5.0))
    assert type(cli.model.loss_terms[0]).__module__ == "my_lab"
    assert cli.trainer.global_step == 2
    logged = cli.trainer.callback_metrics
    assert "train/length_penalty/value" in logged and torch.isfinite(logged["train/length_penalty/value"])
    moved = [k for k in plain if not torch.equal(plain[k], penalised[k])]
    assert moved  # the term changed the updates ...
    _, zero = _fit(tmp_path, tiny_model_dir, "zero", _penalty(0.0))
    # ... by its own contribution alone: at weight 0 the run is the plain one, to the last bit.
    assert all(torch.equal(plain[k], zero[k]) for k in plain)
