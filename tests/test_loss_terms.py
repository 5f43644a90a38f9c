"""A loss term of a user's own, named in a recipe, joins every policy update without any change to rllight:
the README's example, run as written."""

import os
import re
import sys

import pytest
import torch

from conftest import RECIPES
from helpers import build, tiny_overrides

README = os.path.join(os.path.dirname(RECIPES), "README.md")


@pytest.fixture
def my_lab(tmp_path, monkeypatch):
    """The README's ``my_lab.py`` (the python block under "Your own loss term"), importable as ``my_lab``."""
    text = open(README).read()
    section = text[text.index("### Your own loss term"):]
    code = re.search(r"```python\n(# my_lab\.py\n.*?)```", section, re.S).group(1)
    folder = tmp_path / "user"
    folder.mkdir()
    (folder / "my_lab.py").write_text(code)
    monkeypatch.syspath_prepend(str(folder))
    sys.modules.pop("my_lab", None)
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


def test_the_readme_loss_term_joins_every_policy_update(tmp_path, tiny_model_dir, my_lab):
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
