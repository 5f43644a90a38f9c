"""Every ```yaml block of the guides (docs/guides/*.md) runs as written: laid over the recipe its first line
``# base: recipes/NAME.yaml`` names (else recipes/quickstart.yaml) and under recipes/overlays/smoke.yaml, with
``--trainer.max_steps 2``, ``rllight fit`` runs to its end (its ``finished`` line, no error) and no reward or
environment failed on a batch (each would cost its samples reward 0 and the run would go on).

Each run is the command's ``main`` in this process (a child process would spend most of its time importing), in a
folder of its own laid out as the clone a reader runs from (``recipes/`` in it): the working directory, the home and
first on the import path. It holds the files the page writes: a block titled ``title="data/train.jsonl"``, and each
```python block whose first line names a file (``# my_lab.py``, ``# my_envs/guess_server.py``), the blocks of one
file joined in order; the modules are forgotten after the run, as another page may write its own under the same
name. The data files a block names only as placeholders for the reader's own (the data page's) are made there by
``PLACEHOLDERS``, in the format the page gives. (A judge's or a reward model's ``path/to/...`` needs nothing: smoke
mode gives it a tiny model of its kind.)

A block that needs what a CPU machine has not (a server at a URL) is skipped by ``ELSEWHERE``, which says why; a
block that needs an optional package (verifiers, OpenEnv, textarena, reasoning-gym) is skipped where it is not
installed.
"""

from __future__ import annotations

import glob
import logging
import os
import re
import sys

import pytest

from conftest import RECIPES
from test_docs import BASE, blocks

from rllight.app.cli import main

ROOT = os.path.dirname(RECIPES)
GUIDES = os.path.join(ROOT, "docs", "guides")
SMOKE = os.path.join(RECIPES, "overlays", "smoke.yaml")
FINISHED = re.compile(r"rllight: finished: (\d+) RL steps?, (\d+) optimizer updates")
# What the log says when a reward or an environment failed on a batch: the run goes on (with rewards 0) and finishes.
FAILED = re.compile(r"failed on|could not score")
TITLED = re.compile(r'^```\w*[ \t]+title="([^"]+)"[ \t]*\n(.*?)^```[ \t]*$', re.MULTILINE | re.DOTALL)
NAMED = re.compile(r"^# ([\w/.-]+\.py)\n")

# The blocks that cannot run on a CPU test machine, by page and a text only that block holds, and why.
ELSEWHERE = {
    ("engines.md", "VLLMServerEngine"): "generates at a vLLM server at a URL, started with its weight routes on",
    ("judges.md", "api_key_env: JUDGE_API_KEY"): "the judge is a model served at a URL",
    ("rewards.md", "rllight.serving.VLLMPooling"): "the reward model is served by vLLM at a URL",
    ("distillation.md", "rllight.serving.Endpoint"): "the teacher is served by vLLM at a URL",
}
# The optional packages a block's classes need, by a text the block holds.
PACKAGES = {"rllight.envs.Verifiers": "verifiers.v1", "rllight.envs.OpenEnv": "openenv",
            "rllight.envs.TextArena": "textarena", "rllight.data.ReasoningGymTask": "reasoning_gym"}


def _cases() -> list[tuple[str, int, str]]:
    return [(os.path.basename(page), i, block) for page in sorted(glob.glob(os.path.join(GUIDES, "*.md")))
            for i, block in enumerate(blocks(page, "yaml"))]


CASES = _cases()


def page_files(page: str) -> dict[str, str]:
    """The files a guide writes, by path: its blocks titled ``title="<path>"``, and its python blocks whose first line
    is ``# <path>.py`` (the blocks of one path joined in order)."""
    with open(os.path.join(GUIDES, page)) as f:
        files = {name: body for name, body in TITLED.findall(f.read())}
    for block in blocks(os.path.join(GUIDES, page), "python"):
        head = NAMED.match(block)
        if head:
            name = head.group(1)
            files[name] = f"{files[name]}\n\n{block}" if name in files else block
    return files


# ------------------------------------------------------------------------------------------ placeholders
def _arithmetic(n: int, prompt: str = "prompt", answer: str = "answer") -> list[dict]:
    """``n`` of the embedded arithmetic task's problems, the question and the answer under the names given."""
    from rllight.data import ArithmeticTask

    train, _ = ArithmeticTask(num_train=n, num_val=4).splits()
    return [{prompt: row["prompt"], answer: row["answer"]} for row in train]


def _jsonl(path: str, rows: list[dict]) -> None:
    import json

    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)


def _dataset(rows: list[dict]):
    import datasets

    return datasets.Dataset.from_list(rows)


def _parquet(path: str, rows: list[dict]) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    _dataset(rows).to_parquet(path)


def _verl(n: int) -> list[dict]:
    return [{"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": r["prompt"]}],
             "reward_model": {"style": "rule", "ground_truth": r["answer"]}} for r in _arithmetic(n)]


# What the guides name as the reader's own files, by their path in a block (a run's folder is the reader's clone, and
# its home): each made as the block's comment says it is (verl's parquet, TRL's JSONL, GSM8K's solutions, ...), with
# the embedded arithmetic task's problems, enough rows for a batch and the held-out prompts.
PLACEHOLDERS = {
    "data/gsm8k.jsonl": lambda path: _jsonl(path, _arithmetic(16)),
    "data/arith.jsonl": lambda path: _jsonl(path, _arithmetic(16)),
    "~/data/gsm8k/train.parquet": lambda path: _parquet(path, _verl(16)),
    "~/data/gsm8k/test.parquet": lambda path: _parquet(path, _verl(8)),
    "train.jsonl": lambda path: _jsonl(path, _arithmetic(16, answer="solution")),
    "gsm8k_train.parquet": lambda path: _parquet(path, [{**row, "answer": f"So it is.\n#### {row['answer']}"}
                                                        for row in _arithmetic(16, prompt="question")]),
    "prompts.jsonl": lambda path: _jsonl(path, _arithmetic(16, prompt="input", answer="label")),
    "data/gsm8k_saved/train": lambda path: _dataset(_arithmetic(16)).save_to_disk(path),
    "data/gsm8k_saved/test": lambda path: _dataset(_arithmetic(8)).save_to_disk(path),
}


def names_file(block: str, path: str) -> bool:
    """Whether ``block`` names the file ``path`` itself (``train.jsonl``, not ``data/train.jsonl``)."""
    return re.search(rf"(?<![\w/.~-]){re.escape(path)}(?![\w/.-])", block) is not None


# ------------------------------------------------------------------------------------------ the runs
def lay_out_clone(page: str, block: str, folder: str) -> list[str]:
    """Make ``folder`` the reader's clone for ``block`` (``recipes/``, the page's files, the placeholders the block
    names, the block as ``block.yaml``) and return the ``--config`` options of its run: the base, the block, the
    smoke overlay."""
    os.makedirs(folder)
    os.symlink(RECIPES, os.path.join(folder, "recipes"))
    for name, body in page_files(page).items():
        path = os.path.join(folder, name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(body)
        if name.endswith(".py"):
            sys.modules.pop(name.split("/")[0].removesuffix(".py"), None)  # another page's module of that name
    for name, make in PLACEHOLDERS.items():
        if names_file(block, name):
            make(os.path.join(folder, name.removeprefix("~/")))
    with open(os.path.join(folder, "block.yaml"), "w") as f:
        f.write(block)
    first = block.splitlines()[0]
    bases = first[len(BASE):].split() if first.startswith(BASE) else ["recipes/quickstart.yaml"]
    return [a for path in [*bases, "block.yaml", SMOKE] for a in ("--config", path)]


@pytest.fixture(scope="module")
def smoke_cache(tmp_path_factory) -> str:
    """One tiny-model cache for this module's runs (the first run builds it)."""
    return str(tmp_path_factory.mktemp("smoke-cache"))


def test_every_block_left_out_is_one_block_of_its_page():
    for (page, text), why in ELSEWHERE.items():
        held = [i for p, i, block in CASES if p == page and text in block]
        assert len(held) == 1, f"docs/guides/{page}: {text!r} ({why}) is in blocks {held}, not in one"


@pytest.mark.slow
@pytest.mark.parametrize("page,index,block", CASES, ids=[f"{p}:{i}" for p, i, _ in CASES])
def test_a_guides_yaml_block_runs_in_smoke_mode(page, index, block, tmp_path, smoke_cache, capfd, caplog, monkeypatch):
    for (where, text), why in ELSEWHERE.items():
        if where == page and text in block:
            pytest.skip(f"needs what this machine has not: {why}")
    for text, package in PACKAGES.items():
        if text in block:
            pytest.importorskip(package)
    folder = str(tmp_path / "clone")
    configs = lay_out_clone(page, block, folder)
    # The reader's clone is the working directory, their home and on the import path.
    monkeypatch.chdir(folder)
    monkeypatch.setenv("HOME", folder)
    monkeypatch.setenv("XDG_CACHE_HOME", smoke_cache)
    monkeypatch.setattr(sys, "path", [folder, *sys.path])
    before, environment = set(sys.modules), dict(os.environ)
    try:
        main(["fit", *configs, "--trainer.max_steps", "2", "--trainer.default_root_dir", os.path.join(folder, "run")])
        code = 0
    except SystemExit as exit_info:
        code = exit_info.code or 0
    finally:
        # A run in this process sets variables of its own (an FSDP run's MASTER_PORT, RANK...): a later test's
        # children would inherit them, and every distributed child would ask for the same port.
        os.environ.clear()
        os.environ.update(environment)
        for name in set(sys.modules) - before:  # the page's modules (and packages): a later page's may share names
            spec = getattr(sys.modules[name], "__spec__", None)
            where = [getattr(spec, "origin", None), *(getattr(spec, "submodule_search_locations", None) or [])]
            if any(isinstance(path, str) and path.startswith(folder) for path in where):
                del sys.modules[name]
    out = "".join(capfd.readouterr())
    done = FINISHED.search(out)
    assert code == 0 and done, f"docs/guides/{page}, yaml block {index + 1}:\n{out[-4000:]}"
    assert int(done.group(1)) >= 1 and int(done.group(2)) >= 2, out[-2000:]
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert not [w for w in warnings if FAILED.search(w)], f"docs/guides/{page}, yaml block {index + 1}: {warnings}"
