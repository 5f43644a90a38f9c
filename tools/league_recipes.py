"""Which recipe files a league method stands for, and whether a finished run's recipe changed since it ran
(tools/league.py)."""

from __future__ import annotations

import os
import subprocess

import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def recipe_configs(recipe: str) -> list[str]:
    """The configs a method's ``recipe`` stands for: an overlay under recipes/ablations/ names its base on its first
    line (``# base: recipes/vespo.yaml``, a recipe and overlays, space-separated) and comes after it; any other
    recipe stands alone."""
    with open(os.path.join(ROOT, recipe)) as f:
        first = f.readline()
    return [*first[len("# base: "):].split(), recipe] if first.startswith("# base: ") else [recipe]


def recipe_at(commit: str, path: str) -> object:
    """The parsed YAML of ``path`` as commit ``commit`` (``abc1234``) holds it; None where that cannot be told: no
    commit recorded, a run from a tree with uncommitted changes (``+dirty``: its recipe may be one no commit holds),
    not a git checkout, a commit this clone lacks."""
    if not commit or commit == "unknown" or commit.endswith("+dirty"):
        return None
    try:
        text = subprocess.run(["git", "show", f"{commit}:{path}"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    return yaml.safe_load(text)


def changed_since(result: dict) -> list[str]:
    """The recipe files of a finished run (its recipe and the base an overlay names) whose settings differ from those
    at the commit it ran at: its row would stand for a recipe it did not run. Comments do not count; a file that
    cannot be read there (see ``recipe_at``) counts as unchanged."""
    changed = []
    for path in recipe_configs(result["recipe"]):
        then = recipe_at(result.get("commit"), path)
        with open(os.path.join(ROOT, path)) as f:
            if then is not None and then != yaml.safe_load(f):
                changed.append(path)
    return changed
