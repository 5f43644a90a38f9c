"""The documentation site builds with no warning, and the code on its pages works.

- ``mkdocs build --strict``: no broken link or anchor, no missing API reference, no page left out of the nav.
- ``bash`` blocks: every repository path they name exists; ``rllight fit`` / ``validate`` commands parse with
  their options (``--print_config``, nothing loads); a tool's options are options of that tool.
- ``yaml`` blocks parse as recipe overlays: on ``recipes/quickstart.yaml``, or on the recipe a first line
  ``# base: recipes/NAME.yaml`` names; a ``my_lab.`` class in them is the page's own ``# my_lab.py`` block.
- every recipe file is on the recipes page.
(The ``# my_lab.py`` blocks are run on the tiny model in tests/docs/test_docs_examples.py.)
"""

from __future__ import annotations

import glob
import importlib.util
import os
import re
import shlex
import subprocess
import sys

import pytest

from conftest import RECIPES
from rllight.app.cli import main

ROOT = os.path.dirname(RECIPES)
DOCS = os.path.join(ROOT, "docs")
PAGES = sorted(glob.glob(os.path.join(DOCS, "**", "*.md"), recursive=True)) + [
    os.path.join(ROOT, "README.md"), os.path.join(ROOT, "AGENTS.md")]
FENCE = re.compile(r"^(?P<indent>[ \t]*)```(?P<lang>[\w-]*)[^\n]*\n(?P<body>.*?)^(?P=indent)```[ \t]*$",
                   re.MULTILINE | re.DOTALL)
REPO_DIRS = ("recipes/", "tools/", "docs/", "tests/", "rllight/", "callbacks/", ".ci/")
PLACEHOLDER = re.compile(r"<[^>]*>|\.\.\.|\$|^[A-Z][A-Z_]*$|^[A-Z]\.yaml$|\{|\*")
BASE = "# base: "
RLLIGHT = ("rllight", ".venv/bin/rllight")


def blocks(page: str, lang: str) -> list[str]:
    """The bodies of ``page``'s fenced blocks in ``lang``, their indentation removed."""
    with open(page) as f:
        text = f.read()
    out = []
    for m in FENCE.finditer(text):
        if m.group("lang") == lang:
            indent = len(m.group("indent"))
            out.append("\n".join(line[indent:] for line in m.group("body").splitlines()))
    return out


def rel(page: str) -> str:
    return os.path.relpath(page, ROOT)


def shell_commands(block: str) -> list[list[str]]:
    """The commands of a bash block as token lists: continuation lines joined, comments dropped, split at
    ``&&``, ``;``, ``|`` and ``>``; environment assignments before a command dropped."""
    text = block.replace("\\\n", " ")
    commands = []
    for line in text.splitlines():
        if line.lstrip().startswith("#SBATCH") or not line.strip():
            continue
        try:
            tokens = shlex.split(line, comments=True)
        except ValueError:
            continue
        current: list[str] = []
        for token in tokens + ["&&"]:
            if token in ("&&", ";", "|", "||", ">", ">>", "2>&1", "&"):
                while current and re.match(r"^[A-Z_]+=", current[0]):
                    current.pop(0)
                if current:
                    commands.append(current)
                current = []
            else:
                current.append(token)
    return commands


def _bash_cases() -> list[tuple[str, list[str]]]:
    return [(page, cmd) for page in PAGES if os.path.exists(page) for block in blocks(page, "bash")
            for cmd in shell_commands(block)]


BASH = _bash_cases()


def _record_options() -> set[str]:
    """The options ``rllight.app.records.add_record_options`` gives a tool (``--record``, ``--shared``, ...)."""
    import argparse

    from rllight.app.records import add_record_options

    parser = argparse.ArgumentParser()
    add_record_options(parser, id=None, section=None)
    return {option for action in parser._actions for option in action.option_strings}


@pytest.mark.parametrize("page,command", BASH, ids=[f"{rel(p)}:{' '.join(c)[:60]}" for p, c in BASH])
def test_shell_block_names_what_exists(page, command, tmp_path, capsys, monkeypatch):
    for token in command:
        for value in (token.split("=", 1)[-1],) if token.startswith("--") else (token,):
            generated = value.startswith("docs/quickstart")  # tools/plot.py's output folder
            if value.startswith(REPO_DIRS) and not PLACEHOLDER.search(value) and not generated:
                assert os.path.exists(os.path.join(ROOT, value)), f"{rel(page)}: `{' '.join(command)}` names {value}"
    head = command[0]
    if head in ("python", ".venv/bin/python") and command[1:2] == ["tools/phase_memory.py"]:
        command, head = ["rllight", *command[2:]], "rllight"  # it runs the rllight command given after it
    if head in ("python", ".venv/bin/python") and len(command) > 1 and command[1].startswith("tools/"):
        with open(os.path.join(ROOT, command[1])) as f:
            source = f.read()
        shared = _record_options() if "add_record_options(" in source else set()  # rllight.app.records adds them
        for token in command[2:]:
            if token.startswith("--"):
                option = token.split("=", 1)[0]
                assert f'"{option}"' in source or option in shared, f"{rel(page)}: {command[1]} has no option {option}"
    if head in RLLIGHT or command[:3] in (["python", "-m", "rllight"], [".venv/bin/python", "-m", "rllight"]):
        args = command[1:] if head in RLLIGHT else command[3:]
        if not args or args[0] not in ("fit", "validate") or any(PLACEHOLDER.search(a) for a in args):
            return
        if "--config" not in args:
            return  # a bare --model.path run: nothing of the recipe to check
        args = [a for a in args if a != "--print_config"]
        for flag in ("--ckpt_path",):  # files a run would make: parse without them
            while flag in args:
                i = args.index(flag)
                del args[i:i + 2]
        monkeypatch.chdir(ROOT)
        with pytest.raises(SystemExit) as exc:
            main([*args, "--print_config"])
        assert exc.value.code in (0, None), f"{rel(page)}: `{' '.join(command)}`: {capsys.readouterr().err}"


def _yaml_cases() -> list[tuple[str, int, str]]:
    return [(page, i, block) for page in PAGES if os.path.exists(page)
            for i, block in enumerate(blocks(page, "yaml"))]


YAML = _yaml_cases()


@pytest.mark.parametrize("page,index,block", YAML, ids=[f"{rel(p)}:{i}" for p, i, _ in YAML])
def test_yaml_block_parses_as_a_recipe_overlay(page, index, block, tmp_path, capsys, monkeypatch):
    first = block.splitlines()[0] if block.strip() else ""
    base = [os.path.join(ROOT, p) for p in first[len(BASE):].split()] if first.startswith(BASE) else [
        os.path.join(RECIPES, "quickstart.yaml")]
    overlay = tmp_path / "block.yaml"
    overlay.write_text(block)
    if "my_lab." in block:
        lab = [b for b in blocks(page, "python") if b.startswith("# my_lab.py")]
        assert lab, f"{rel(page)}: a yaml block names my_lab but the page has no '# my_lab.py' block"
        (tmp_path / "my_lab.py").write_text("\n\n".join(lab))
        monkeypatch.syspath_prepend(str(tmp_path))
        monkeypatch.setitem(sys.modules, "my_lab", None)  # undone at teardown: no my_lab stays imported
        del sys.modules["my_lab"]
    monkeypatch.chdir(ROOT)
    configs = [a for path in base for a in ("--config", path)]
    with pytest.raises(SystemExit) as exc:
        main(["fit", *configs, "--config", str(overlay), "--print_config"])
    assert exc.value.code in (0, None), f"{rel(page)}, yaml block {index + 1}: {capsys.readouterr().err}"


def test_every_recipe_is_on_the_recipes_page():
    with open(os.path.join(DOCS, "recipes.md")) as f:
        page = f.read()
    recipes = [os.path.relpath(p, RECIPES) for p in glob.glob(os.path.join(RECIPES, "**", "*.yaml"), recursive=True)]
    missing = [r for r in recipes if r not in page and not r.startswith("paper/")]
    assert not missing, f"docs/recipes.md does not name {missing}"


@pytest.mark.skipif(importlib.util.find_spec("mkdocs") is None, reason="needs the docs extra: pip install -e '.[docs]'")
def test_site_builds_strict(tmp_path):
    mkdocs = [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")]
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    done = subprocess.run(mkdocs, cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    warnings = [line for line in done.stderr.splitlines() if line.startswith(("WARNING", "ERROR"))]
    assert done.returncode == 0 and not warnings, "\n".join(warnings) or done.stderr[-3000:]
    for page in ("index.html", "algorithms/grpo/index.html", "reference/api/strategies/index.html"):
        assert os.path.getsize(tmp_path / "site" / page) > 1000, page
    # The maths renders offline: every formula is MathML written at build time, and no page loads a script or a
    # style sheet from another host.
    formulas = 0
    for page in glob.glob(str(tmp_path / "site" / "**" / "*.html"), recursive=True):
        with open(page) as f:
            text = f.read()
        where = os.path.relpath(page, tmp_path / "site")
        assert not re.search(r'class="arithmatex">\\[(\[]', text), f"{where}: a formula left as TeX"
        assert not re.search(r'<(script|link)[^>]*(src|href)="(https?:)?//', text), f"{where}: loads from the network"
        formulas += text.count('class="arithmatex"><math')
    assert formulas > 100, formulas  # the algorithm pages' formulas were found and converted
