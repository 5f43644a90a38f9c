"""Every user's module the documentation shows runs as written: each page's ```python blocks whose first line is
``# my_lab.py`` are written, in order, as ``my_lab.py`` in a folder on the import path, and each of the page's
```yaml blocks that names ``my_lab.`` trains 2 steps on the tiny model as an overlay (on the recipe its
``# base: recipes/X.yaml`` line names, else recipes/quickstart.yaml). Every class the overlay names must take
part in the run (its own hook, e.g. ``__call__`` or ``on_rollout``, is called) and the page's own metric, where it
has one, must be logged."""

import functools
import inspect
import os
import re
import sys

import pytest
import torch
import yaml

from conftest import RECIPES
from helpers import build, tiny_overrides

ROOT = os.path.dirname(RECIPES)
DOCS = os.path.join(ROOT, "docs")
MY_LAB = "# my_lab.py"
BASE = "# base: "
OPEN = re.compile(r"^(\s*)```(\w*)")

# The metric each page's example logs, which its 2-step run must log too.
METRICS = {
    "extending/loss-term.md": "train/length_penalty/value",
    "extending/callback.md": "train/repeats/masked_ratio",
    "extending/environment.md": "train/episode/turns_mean",
    "extending/engine.md": "train/rollout/new_tokens",
    "extending/strategy.md": "train/policy/ratio_max",
    "extending/curriculum.md": "train/curriculum/unseen",
}
# The methods through which a class of each kind takes part in a run; each one a class defines itself must run.
HOOKS = ("__call__", "on_rollout", "step", "generate", "is_correct", "choose", "score", "splits")
# Pages whose classes are parts a run's owner uses (a placement, a wire protocol that needs a server), not a 2-step run
# of their own: the test file named runs each one's my_lab.py as written instead.
OWN_TESTS = {"extending/serving.md": "test_docs_serving.py"}


def code_blocks(page: str) -> list[tuple[str, str]]:
    """``(language, text)`` of each fenced block of a docs page (``page`` relative to docs/), dedented to its
    fence."""
    blocks, lines, i = [], open(os.path.join(DOCS, page)).read().splitlines(), 0
    while i < len(lines):
        start = OPEN.match(lines[i])
        if not start:
            i += 1
            continue
        indent, language, body = len(start.group(1)), start.group(2), []
        i += 1
        while i < len(lines) and lines[i].strip() != "```":
            body.append(lines[i][indent:])
            i += 1
        blocks.append((language, "\n".join(body) + "\n"))
        i += 1
    return blocks


def my_lab_code(page: str) -> str:
    """The page's ``my_lab.py``: its python blocks that start with ``# my_lab.py``, in order."""
    parts = [text for language, text in code_blocks(page) if language == "python" and text.startswith(MY_LAB)]
    assert parts, f"docs/{page} has no ```python block starting with {MY_LAB!r}"
    return "\n\n".join(parts)


def my_lab_overlays(page: str) -> list[str]:
    """The page's yaml blocks that name a class of ``my_lab``."""
    return [text for language, text in code_blocks(page) if language == "yaml" and "my_lab." in text]


def example_pages() -> list[str]:
    """Every docs page (relative to docs/) with a ``# my_lab.py`` block."""
    found = []
    for folder, _, files in os.walk(DOCS):
        for f in sorted(files):
            page = os.path.relpath(os.path.join(folder, f), DOCS).replace(os.sep, "/")
            if f.endswith(".md") and any(language == "python" and text.startswith(MY_LAB)
                                         for language, text in code_blocks(page)):
                found.append(page)
    return sorted(found)


def install_my_lab(page: str, folder, monkeypatch) -> None:
    """Write the page's ``my_lab.py`` into ``folder`` and make it the module ``my_lab`` (for the test that
    ``monkeypatch`` belongs to: afterwards no ``my_lab`` stays imported)."""
    folder.mkdir(exist_ok=True)
    (folder / "my_lab.py").write_text(my_lab_code(page))
    monkeypatch.syspath_prepend(str(folder))
    monkeypatch.setitem(sys.modules, "my_lab", None)  # undone at teardown: removed again, whatever imported it
    del sys.modules["my_lab"]


def _named_classes(overlay: str) -> list[str]:
    return re.findall(r"class_path:\s*my_lab\.(\w+)", overlay)


def _base_recipe(overlay: str) -> str:
    first = overlay.splitlines()[0]
    return os.path.join(ROOT, first[len(BASE):].split()[0]) if first.startswith(BASE) else os.path.join(
        RECIPES, "quickstart.yaml")


def _count_hooks(cls, calls: dict, monkeypatch) -> list[str]:
    """Wrap the hooks ``cls`` defines itself so that each call is counted in ``calls``; their names."""
    hooks = [name for name in HOOKS if inspect.isfunction(cls.__dict__.get(name))]

    def counted(name, fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            calls[name] = calls.get(name, 0) + 1
            return fn(*args, **kwargs)
        return wrapper

    for name in hooks:
        monkeypatch.setattr(cls, name, counted(f"{cls.__name__}.{name}", cls.__dict__[name]))
    return [f"{cls.__name__}.{name}" for name in hooks]


def test_the_extending_pages_each_have_an_example():
    pages = example_pages()
    for name in ("strategy", "loss-term", "callback", "environment", "reward", "engine", "curriculum", "serving"):
        assert f"extending/{name}.md" in pages
    assert set(METRICS) <= set(pages)  # no metric of a page that lost its example
    for page, test in OWN_TESTS.items():  # no page left to a test that is gone
        assert page in pages and os.path.exists(os.path.join(os.path.dirname(__file__), test)), (page, test)


@pytest.mark.parametrize("page", [page for page in example_pages() if page not in OWN_TESTS])
def test_a_docs_example_trains_two_steps_as_written(page, tmp_path, tiny_model_dir, monkeypatch):
    install_my_lab(page, tmp_path / "user", monkeypatch)
    overlays = my_lab_overlays(page)
    assert overlays, f"docs/{page}: no ```yaml block names a class of my_lab"
    logged = set()
    for n, overlay in enumerate(overlays):
        names = _named_classes(overlay)
        assert names, f"docs/{page}: a yaml block mentions my_lab without a class_path: my_lab.X"
        run = tmp_path / f"run{n}"
        run.mkdir()
        (run / "page.yaml").write_text(overlay)
        assert isinstance(yaml.safe_load(overlay), dict)
        cli = build(_base_recipe(overlay), tiny_overrides(run, tiny_model_dir), str(run / "page.yaml"))
        my_lab = sys.modules["my_lab"]
        calls: dict[str, int] = {}
        hooks = {name: _count_hooks(getattr(my_lab, name), calls, monkeypatch) for name in names}
        parts = [*vars(cli.model).values(), *cli.model.loss_terms, *cli.trainer.callbacks, cli.datamodule.curriculum,
                 cli.datamodule.task]
        for name in names:  # the recipe built the page's class, not a built-in one
            assert any(type(p).__module__ == "my_lab" and type(p).__name__ == name for p in parts), name
        cli.trainer.fit(cli.model, datamodule=cli.datamodule)
        assert cli.trainer.global_step == 2
        for name, own in hooks.items():
            assert own, f"my_lab.{name} defines none of {HOOKS}"
            assert all(calls.get(hook) for hook in own), f"{page}: not called in the run: {own}, called: {calls}"
        metrics = cli.trainer.callback_metrics
        assert all(torch.isfinite(v).all() for k, v in metrics.items() if k.startswith("train/policy/loss"))
        logged |= set(metrics)
    if page in METRICS:
        assert METRICS[page] in logged, f"{page}: {METRICS[page]} was not logged"
