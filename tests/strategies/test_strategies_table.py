"""The paper-to-classes table in ``rllight.strategies``' docstring says what each method's recipe composes: every
class it names exists, each recipe's components (advantage, policy loss, aggregation, sampler, critic, KL penalty,
rollout callbacks) are in its row and nothing else is, the settings it shows are the recipe's, and the recipe's
header cites the paper. The docstring's list of files by kind names every module and every exported class, each
under the module that defines it."""

from __future__ import annotations

import ast
import os
import re

import pytest
import yaml

import rllight.callbacks
import rllight.critics
import rllight.strategies
from conftest import RECIPES

METHODS = ("PPO", "GRPO", "DAPO", "VAPO", "SPPO", "VESPO", "RLOO", "ReMax", "REINFORCE++", "GSPO", "Dr. GRPO", "CISPO",
           "OPD")
PACKAGES = {"": rllight.strategies, "critics.": rllight.critics, "callbacks.": rllight.callbacks}
COMPONENTS = ("advantage", "policy_loss", "aggregation", "sampler", "critic", "kl")
NAME = re.compile(r"\b((?:critics\.|callbacks\.)?)([A-Z]\w*)(?:\(([^()]*)\))?")


def _table() -> dict[str, dict[str, str]]:
    """The table's rows by method: its arXiv id, recipe and the classes it composes (continuation lines joined)."""
    block = re.search(r"```text\n(.*?)```", rllight.strategies.__doc__, re.DOTALL).group(1)
    lines = block.splitlines()
    assert lines[0].split() == ["method", "arXiv", "recipe", "classes", "it", "composes"]
    rows: dict[str, dict[str, str]] = {}
    last = None
    for line in lines[1:]:
        if line.startswith(" "):
            rows[last]["composes"] += " " + line.strip()
            continue
        method, arxiv, recipe, composes = re.split(r"\s{2,}", line.strip(), maxsplit=3)
        rows[method] = {"arxiv": arxiv, "recipe": recipe, "composes": composes}
        last = method
    return rows


TABLE = _table()


def _named(composes: str) -> dict[str, dict[str, str]]:
    """The classes a row names (``critics.X`` and ``callbacks.X`` with their prefix), each with the settings shown
    after it; a class named as a setting's value (``policy_lambda=AdaptiveLambda``) counts too."""
    named: dict[str, dict[str, str]] = {}
    for prefix, name, settings in NAME.findall(composes):
        if name in ("True", "False", "None"):
            continue
        named[prefix + name] = dict(item.strip().split("=", 1) for item in settings.split(",")) if settings else {}
        for value in named[prefix + name].values():
            if re.fullmatch(r"[A-Z]\w*", value) and value not in ("True", "False", "None"):
                named.setdefault(value, {})
    return named


def _used(recipe: dict) -> dict[str, dict]:
    """The classes a recipe composes, named as in the table, each with its ``init_args``: its components' (and the
    classes inside their settings), and its rollout callbacks."""
    short = {"rllight.strategies.": "", "rllight.critics.": "critics.", "rllight.callbacks.": "callbacks."}

    def walk(value, out):
        if isinstance(value, dict):
            path = value.get("class_path")
            if isinstance(path, str):
                prefix = next((p for p in short if path.startswith(p)), None)
                if prefix is not None:  # not a critic's own model (rllight.models), which the table leaves out
                    out[short[prefix] + path[len(prefix):]] = value.get("init_args") or {}
            for item in value.values():
                walk(item, out)
        elif isinstance(value, list):
            for item in value:
                walk(item, out)

    used: dict[str, dict] = {}
    for key in COMPONENTS:
        walk(recipe["model"].get(key), used)
    walk(recipe.get("trainer", {}).get("callbacks"), used)
    return used


def _value(text: str):
    """A setting as the table writes it (``0.28``, ``True``, ``None``, ``k1``), as the recipe's YAML reads."""
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def test_the_table_has_a_row_for_each_method():
    assert list(TABLE) == list(METHODS)


@pytest.mark.parametrize("method", METHODS)
def test_each_class_the_table_names_exists(method):
    for full in _named(TABLE[method]["composes"]):
        prefix, _, name = full.rpartition(".")
        package = PACKAGES[prefix + "." if prefix else ""]
        assert isinstance(getattr(package, name, None), type), f"{method}: {package.__name__} has no class {name}"


@pytest.mark.parametrize("method", METHODS)
def test_each_row_is_what_its_recipe_composes(method):
    row = TABLE[method]
    path = os.path.join(RECIPES, row["recipe"] + ".yaml")
    with open(path) as f:
        text = f.read()
    assert f"arXiv:{row['arxiv']}" in text.split("\nseed_everything")[0], f"{path}: its header cites another paper"
    recipe = yaml.safe_load(text)
    for key in ("advantage", "policy_loss", "aggregation", "sampler"):
        assert recipe["model"][key]["class_path"].startswith("rllight.strategies."), f"{path}: model.{key}"
    named, used = _named(row["composes"]), _used(recipe)
    assert sorted(named) == sorted(used), f"{method}: the table's classes differ from {path}'s"
    for name, settings in named.items():
        for key, value in settings.items():
            got = used[name].get(key)
            got = got.get("class_path", "").rsplit(".", 1)[-1] if isinstance(got, dict) else got
            assert got == _value(value), f"{method}: {name}({key}={value}) but {path} sets {key}: {got}"


def _files_by_kind() -> dict[str, list[str]]:
    """The docstring's list of the package's files by kind: module name -> the classes its item names."""
    doc = rllight.strategies.__doc__
    section = doc[doc.index("One file per kind"):doc.index("A method is a recipe")]
    listed = {}
    for item in section.split("\n- ")[1:]:
        module = re.match(r"``(\w+)\.py``", item).group(1)
        listed[module] = re.findall(r"``([A-Z]\w*)``", item.split(": ", 1)[1])
    return listed


def test_the_docstring_says_which_file_holds_each_class():
    listed = _files_by_kind()
    folder = os.path.dirname(rllight.strategies.__file__)
    assert sorted(listed) == sorted(f[:-3] for f in os.listdir(folder) if f.endswith(".py") and f != "__init__.py")
    named = [name for names in listed.values() for name in names]
    assert sorted(named) == sorted(rllight.strategies.__all__), "each exported class once, and nothing else"
    for module, names in listed.items():
        for name in names:
            assert getattr(rllight.strategies, name).__module__ == f"rllight.strategies.{module}", name
