"""Overlays (recipes/overlays/*.yaml) change only what they name: laid on each recipe of their ``# base:`` line
and on the quickstart, every setting the recipe gives keeps its value unless the overlay sets that key, and the
engine built samples with the recipe's settings (the process-worker overlay once turned the quickstart's
temperature 0.7 into the worker engine's default 1.0)."""

import functools
import glob
import importlib.util
import os

import pytest
import yaml

from rllight.errors import RecipeError
from rllight.rollout import HFEngine
from rllight.rollout.base import SAMPLING_SETTINGS
from rllight.rollout.worker import ProcessEngine

from conftest import RECIPES
from helpers import build, recipe_configs

QUICKSTART = os.path.join(RECIPES, "quickstart.yaml")
OVERLAYS = sorted(glob.glob(os.path.join(RECIPES, "overlays", "*.yaml")))


def _cases() -> list:
    """(base configs, overlay) for every overlay on each base its header names, and on the quickstart."""
    cases = []
    for overlay in OVERLAYS:
        named = recipe_configs(overlay)[:-1]
        assert named, f"{overlay}: the first line must name its base ('# base: recipes/<name>.yaml')"
        bases = [tuple(named)] + ([(QUICKSTART,)] if named != [QUICKSTART] else [])
        for base in bases:
            needs_vllm = "vllm" in os.path.basename(overlay)
            marks = [pytest.mark.skipif(needs_vllm and importlib.util.find_spec("vllm") is None,
                                        reason="the overlay's engine needs vLLM")]
            name = f"{os.path.basename(overlay)}-on-{'+'.join(os.path.basename(b) for b in base)}"
            cases.append(pytest.param(base, overlay, id=name, marks=marks))
    return cases


def _leaves(tree, prefix: str = "") -> dict:
    """A YAML mapping as ``{dotted key: value}``; lists and scalars are leaves."""
    if not isinstance(tree, dict):
        return {prefix: tree}
    out = {}
    for key, value in tree.items():
        out.update(_leaves(value, f"{prefix}.{key}" if prefix else str(key)))
    return out


def _settings(*paths: str) -> dict:
    """Every key the config files set, the later file winning."""
    out = {}
    for path in paths:
        with open(path) as f:
            out.update(_leaves(yaml.safe_load(f) or {}))
    return out


def _named_by(key: str, overlay_keys) -> bool:
    """Whether the overlay sets ``key``, something inside it, or something that holds it."""
    return any(key == k or key.startswith(k + ".") or k.startswith(key + ".") for k in overlay_keys)


@functools.cache
def _built(*configs: str):
    return build(*configs)


@pytest.mark.parametrize("base,overlay", _cases())
def test_an_overlay_keeps_every_recipe_setting_it_does_not_name(base, overlay):
    alone, laid = _built(*base), _built(*base, overlay)
    overlay_keys = _settings(overlay)
    kept = [k for k in _settings(*base) if not _named_by(k, overlay_keys)]
    assert kept  # the comparison has something to compare
    changed = {k: (alone.config.get(k), laid.config.get(k)) for k in kept if laid.config.get(k) != alone.config.get(k)}
    assert changed == {}, f"{os.path.basename(overlay)} changes settings it does not name: {changed}"


@pytest.mark.parametrize("base,overlay", _cases())
def test_the_engine_an_overlay_builds_samples_with_the_recipes_settings(base, overlay):
    overlay_keys = _settings(overlay)
    alone, laid = _built(*base).model.rollout, _built(*base, overlay).model.rollout
    for name in SAMPLING_SETTINGS:
        if _named_by(f"model.rollout.init_args.{name}", overlay_keys):
            continue
        assert getattr(laid, name) == getattr(alone, name), (name, type(laid).__name__)
    if isinstance(laid, ProcessEngine):  # the worker's engine samples with them too
        assert all(getattr(laid.engine, name) == getattr(laid, name) for name in SAMPLING_SETTINGS)


def test_the_process_worker_keeps_the_quickstarts_temperature():
    engine = _built(QUICKSTART, os.path.join(RECIPES, "overlays", "process-worker.yaml")).model.rollout
    assert isinstance(engine, ProcessEngine) and isinstance(engine.engine, HFEngine)
    assert (engine.engine.max_new_tokens, engine.engine.temperature) == (24, 0.7)  # the quickstart's, not 64 and 1.0


def test_process_engine_takes_each_sampling_setting_from_the_side_that_gives_it():
    # Here (an overlay's carried recipe settings) over the inner engine's defaults:
    engine = ProcessEngine(HFEngine(), max_new_tokens=24, temperature=0.7)
    assert (engine.engine.max_new_tokens, engine.engine.temperature, engine.engine.top_p) == (24, 0.7, 1.0)
    # None here, or the defaults (what a recipe naming no engine carries over): the inner engine's.
    engine = ProcessEngine(HFEngine(max_new_tokens=8, temperature=0.5))
    assert (engine.max_new_tokens, engine.temperature) == (8, 0.5)
    engine = ProcessEngine(HFEngine(max_new_tokens=1024, temperature=0.6), max_new_tokens=64, temperature=1.0)
    assert (engine.engine.max_new_tokens, engine.engine.temperature) == (1024, 0.6)
    assert ProcessEngine(HFEngine(temperature=0.7), temperature=0.7).engine.temperature == 0.7  # agree: fine
    with pytest.raises(RecipeError) as err:  # both given, both away from the default: neither silently wins
        ProcessEngine(HFEngine(temperature=0.9), temperature=0.7)
    message = str(err.value)
    assert "model.rollout.init_args.temperature=0.7" in message and "engine.init_args.temperature=0.9" in message
    assert len(message.splitlines()) == 1
    # declared as the inner engine's are
    with pytest.raises(RecipeError, match=r"^ProcessEngine\.temperature must be a number > 0 or null, got 0\.0$"):
        ProcessEngine(HFEngine(), temperature=0.0)


def test_an_overlay_whose_inner_engine_contradicts_the_recipe_is_refused(tmp_path):
    """The quickstart samples at 0.7; an overlay that sets 0.9 on the worker's engine would have one of the
    two win without a word."""
    overlay = tmp_path / "worker-0.9.yaml"
    overlay.write_text(yaml.safe_dump({"model": {"rollout": {
        "class_path": "rllight.rollout.worker.ProcessEngine",
        "init_args": {"engine": {"class_path": "rllight.rollout.HFEngine", "init_args": {"temperature": 0.9}}}}}}))
    with pytest.raises(RecipeError, match=r"temperature=0.7 and .*engine.init_args.temperature=0.9 disagree"):
        build(QUICKSTART, str(overlay))
