"""Settings that name something to call accept only what their contract allows, checked before anything is called
(docs/guides/security.md): an environment ``factory`` (a class written to TRL's contract, or a function annotated to
return one), a verifiers ``load`` (``load_environment``, a function annotated to return a ``vf.Env`` or
``vf.Taskset``, or such a class), and every ``class_path`` of a recipe (a class, never of the standard library).
Each refusal is one line naming the key, and a probe file that the named callable would write proves nothing ran."""

import importlib.util
import os
import sys
import types

import pytest

from conftest import RECIPES
from rllight.app.cli import main
from rllight.envs.factory import FactoryEnvironment
from rllight.errors import RecipeError
from trl_contract_fixtures import Counter

FACTORY = "model.environment.init_args.factory"
HAS_VERIFIERS = importlib.util.find_spec("verifiers") is not None and importlib.util.find_spec("verifiers.v1")
needs_verifiers = pytest.mark.skipif(not HAS_VERIFIERS, reason="verifiers 0.4 is not installed")


def _shell(probe) -> dict:
    """Keyword arguments under which each system callable tried here would create ``probe``."""
    return {"command": f"touch {probe}", "args": f"touch {probe}", "shell": True}


def _one_line(err) -> str:
    text = str(err.value)
    assert "\n" not in text
    return text


@pytest.fixture
def aliases(monkeypatch):
    """A user's module that hands on system callables under names of its own (``make_env = os.system``)."""
    module = types.ModuleType("aliased_callables")
    module.make_env, module.run_env, module.load_environment = os.system, __import__("subprocess").run, os.system
    monkeypatch.setitem(sys.modules, "aliased_callables", module)
    return module


@pytest.mark.parametrize("factory", ["os.system", "os:system", "subprocess.run", "subprocess.Popen", "builtins.eval",
                                     "aliased_callables.make_env", "aliased_callables.run_env"])
def test_a_factory_of_the_standard_library_is_refused_before_it_is_called(factory, tmp_path, aliases):
    probe = tmp_path / "ran"
    with pytest.raises(RecipeError) as err:
        FactoryEnvironment(factory, factory_args=_shell(probe)).spawn().reset({"messages": []})
    line = _one_line(err)
    assert line.startswith(f"{FACTORY}: ") and "standard library" in line and "security.md" in line
    assert not probe.exists()


@pytest.mark.parametrize("factory, reason", [
    ("trl_contract_fixtures.write_probe", "is a function that does not say what it makes"),
    ("trl_contract_fixtures.Runner", "Runner has no reset method"),
])
def test_a_factory_outside_the_contract_is_refused_without_being_called(factory, reason, tmp_path):
    probe = tmp_path / "ran"
    with pytest.raises(RecipeError) as err:
        FactoryEnvironment(factory, factory_args={"path": str(probe)}).spawn().reset({"messages": []})
    assert _one_line(err).startswith(f"{FACTORY}: ") and reason in str(err.value)
    assert not probe.exists()


def test_a_factory_may_be_a_function_annotated_to_return_the_class():
    episode = FactoryEnvironment("trl_contract_fixtures.make_counter").spawn()
    episode.reset({"messages": [], "target": 3})
    assert isinstance(episode.obj, Counter)


def test_the_reward_method_must_be_a_public_method():
    with pytest.raises(RecipeError, match=r"reward_method must name a public method"):
        FactoryEnvironment("trl_contract_fixtures.Counter", reward_method="__init__")


@needs_verifiers
@pytest.mark.parametrize("load", ["os:system", "os.system", "subprocess:run", "builtins:eval"])
def test_a_verifiers_load_of_the_standard_library_is_refused_before_it_is_imported(load, tmp_path):
    from rllight.data.verifiers_data import VerifiersTask
    from rllight.envs.verifiers_env import Verifiers

    probe = tmp_path / "ran"
    for make, key in ((Verifiers, "model.environment.init_args.load"), (VerifiersTask, "data.task.init_args.load")):
        with pytest.raises(RecipeError) as err:
            make(load=load, args=_shell(probe))
        assert _one_line(err).startswith(f"{key}: {load!r} is in Python's standard library")
    assert not probe.exists()


@needs_verifiers
@pytest.mark.parametrize("load", ["verifiers_fixtures:write_probe", "aliased_callables:load_environment"])
def test_a_verifiers_load_that_is_no_loader_is_refused_without_being_called(load, tmp_path, aliases):
    from rllight.data.verifiers_data import VerifiersTask

    probe = tmp_path / "ran"
    args = {"path": str(probe)} if "probe" in load else _shell(probe)
    with pytest.raises(RecipeError) as err:
        VerifiersTask(load=load, args=args).splits()
    assert _one_line(err).startswith(f"data.task.init_args: {load} is not a verifiers loader")
    assert not probe.exists()


@needs_verifiers
@pytest.mark.parametrize("load", ["verifiers_fixtures:load_environment", "verifiers_fixtures:load_taskset",
                                  "verifiers_fixtures:WordTaskset"])
def test_a_verifiers_load_may_be_load_environment_an_annotated_function_or_a_class(load):
    from rllight.envs.verifiers_env import import_verifiers, loader

    vf = import_verifiers("test")
    assert callable(loader(vf, load, "test"))


def _cli_error(capsys, *args) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", os.path.join(RECIPES, "quickstart.yaml"), "--config",
              os.path.join(RECIPES, "overlays", "smoke.yaml"), *args])
    assert exit_info.value.code == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("rllight: error: ")]
    assert len(err) == 1, err
    return err[0]


def test_a_class_path_that_names_a_function_is_refused_before_anything_is_constructed(capsys, tmp_path):
    """Where a setting takes a callable (``model.optimizer``), the parser would call a function that a ``class_path``
    names with its ``init_args``: ``os.system`` ran the command."""
    probe = tmp_path / "ran"
    line = _cli_error(capsys, "--trainer.default_root_dir", str(tmp_path), "--model.optimizer",
                      f'{{class_path: os.system, init_args: {{command: "touch {probe}"}}}}')
    assert line.startswith("rllight: error: model.optimizer.class_path: 'os.system' is a builtin_function_or_method, "
                           "not a class"), line
    assert not probe.exists()


def test_a_recipes_environment_factory_of_the_standard_library_is_one_line(capsys, tmp_path):
    probe = tmp_path / "ran"
    environment = ("{class_path: rllight.envs.FactoryEnvironment, init_args: {factory: os.system, "
                   f'factory_args: {{command: "touch {probe}"}}}}}}')
    line = _cli_error(capsys, "--trainer.default_root_dir", str(tmp_path), "--model.environment", environment)
    assert line.startswith(f"rllight: error: {FACTORY}: 'os.system' is in Python's standard library"), line
    assert not probe.exists()


@pytest.mark.parametrize("server", ["os:system", "http.server:test", "antigravity:app"])
def test_an_openenv_server_of_the_standard_library_is_refused_before_it_is_imported(server):
    pytest.importorskip("openenv")
    from rllight.envs.openenv import OpenEnv

    with pytest.raises(RecipeError) as err:
        OpenEnv(server=server)
    assert _one_line(err).startswith(f"model.environment.init_args.server: {server!r} is in Python's standard library")
    assert "antigravity" not in sys.modules  # not imported: importing it opens a web browser
