"""Every shipped recipe runs to its end in smoke mode (``--config recipes/overlays/smoke.yaml``, docs/smoke-test.md):
the tiny model in place of every model (a judge's, a reward model's, a critic's, a teacher's), the recipe's own
strategies, sampler, reward, environment and callbacks, 8 optimizer updates. The recipes run one after another in
one child process (tests/smoke_driver.py: the imports once); each is a test of its own that reads its run's output.
A paper recipe (for GPUs and vLLM) runs as docs/smoke-test.md says: the HF engine, the arithmetic task in place of
its data files, a small batch (here 2 prompts and 2 updates)."""

from __future__ import annotations

import glob
import os
import re
import subprocess
import sys

import pytest

from conftest import RECIPES
from helpers import TESTS, recipe_configs

SMOKE = os.path.join(RECIPES, "overlays", "smoke.yaml")
# Left to other tests, each run costing a minute of vLLM's start that this file's budget cannot hold: the vLLM overlay
# runs with the smoke overlay in tests/rollout/test_vllm.py; what the per-rank overlay sets up (two DDP processes,
# each with its own vLLM engine) runs in tests/test_distributed.py.
ELSEWHERE = {os.path.join(RECIPES, "overlays", "vllm.yaml"): "tests/rollout/test_vllm.py",
             os.path.join(RECIPES, "overlays", "vllm-per-rank.yaml"): "tests/test_distributed.py"}
RECIPE_FILES = sorted(path for path in glob.glob(os.path.join(RECIPES, "**", "*.yaml"), recursive=True)
                      if path != SMOKE and path not in ELSEWHERE)
# docs/smoke-test.md's options for a paper recipe on a CPU, with 2 prompts a step and 2 updates in place of its 8
# and 8 (a paper recipe's groups of up to 64 responses made these runs most of this file's time); the documented
# command itself is checked by tests/app/test_hardware.py and tests/docs/test_docs.py.
PAPER_ON_CPU = ["--model.rollout", "rllight.rollout.HFEngine", "--data.train_files", "null", "--data.val_files",
                "null", "--data.batch_size", "2", "--trainer.max_steps", "2"]
FINISHED = re.compile(r"^rllight: finished: (\d+) RL steps?, (\d+) optimizer updates", re.MULTILINE)
RUN = re.compile(r"^@@run (\d+)\n(.*?)^@@rc \1 (-?\d+)$", re.MULTILINE | re.DOTALL)


def _name(recipe: str) -> str:
    return os.path.relpath(recipe, RECIPES)


def _options(recipe: str, root: str) -> list[str]:
    configs = [a for path in recipe_configs(recipe) for a in ("--config", path)]
    paper = _name(recipe).startswith("paper" + os.sep)
    return [*configs, "--config", SMOKE, *(PAPER_ON_CPU if paper else []), "--trainer.default_root_dir",
            os.path.join(root, _name(recipe).replace(os.sep, "-"))]


@pytest.fixture(scope="module")
def smoke_runs(tmp_path_factory) -> dict[str, tuple[int, str]]:
    """Each recipe's ``(exit status, output)`` of its smoke run."""
    root = tmp_path_factory.mktemp("smoke-all")
    argv = [a for recipe in RECIPE_FILES for a in (*_options(recipe, str(root / "runs")), "--")]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([TESTS, os.environ.get("PYTHONPATH", "")]),
               XDG_CACHE_HOME=str(root / "cache"), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    done = subprocess.run([sys.executable, os.path.join(TESTS, "smoke_driver.py"), *argv], env=env,
                          cwd=os.path.dirname(RECIPES), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=1800)
    out = {RECIPE_FILES[int(n)]: (int(rc), text) for n, text, rc in RUN.findall(done.stdout)}
    assert out, done.stdout[-3000:]
    return out


def test_the_recipes_left_to_other_tests_exist():
    """The list names recipes that exist (a renamed overlay must not drop out of every test unseen)."""
    for recipe, where in ELSEWHERE.items():
        assert os.path.exists(recipe) and os.path.exists(os.path.join(os.path.dirname(RECIPES), where)), recipe


@pytest.mark.slow
@pytest.mark.parametrize("recipe", RECIPE_FILES, ids=_name)
def test_every_recipe_runs_to_its_end_in_smoke_mode(recipe, smoke_runs):
    assert recipe in smoke_runs, f"{_name(recipe)}: the driver ended before this recipe's run"
    status, output = smoke_runs[recipe]
    assert status == 0, f"{_name(recipe)} ended with {status}:\n{output[-3000:]}"
    done = FINISHED.search(output)
    assert done, output[-3000:]
    paper = _name(recipe).startswith("paper" + os.sep)
    assert int(done.group(2)) == (2 if paper else 8)  # trainer.max_steps: the overlay's 8 optimizer updates
    assert "Traceback" not in output, output[-3000:]
