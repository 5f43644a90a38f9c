"""What a command prints is rllight's own lines: no warning of Lightning's that names a file in site-packages (``No
seed found``), no load report or progress bar of transformers' (``tools/train_reward_model.py``). Each runs as a user
runs it, in a process of its own with its output in a file."""

import os
import re
import subprocess
import sys

from conftest import RECIPES

ROOT = os.path.dirname(RECIPES)
WARNING_LINE = re.compile(r"^\S+\.py:\d+: .*$", re.M)  # a Python warning starts with its source, "file.py:LINE: "


def _run(args: list[str], tmp_path) -> str:
    """``python <args>`` from the repository, its stdout and stderr together in a log file as a job's; the log. The
    environment is a shell's: without the seed this test process may have set (Lightning's PL_GLOBAL_SEED)."""
    log = tmp_path / "out.log"
    env = {k: v for k, v in os.environ.items() if k != "PL_GLOBAL_SEED"}
    with open(log, "w") as out:
        done = subprocess.run([sys.executable, *args], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, timeout=600,
                              env=dict(env, OMP_NUM_THREADS="1"), check=False)
    text = log.read_text()
    assert done.returncode == 0, text[-3000:]
    return text


def test_a_command_without_a_seed_in_its_recipe_prints_no_lightning_seed_warning(tiny_model_dir, tmp_path):
    """``rllight generate --model.path DIR`` reads no recipe, so nothing sets ``seed_everything``: Lightning warned
    ``<site-packages>/lightning/fabric/utilities/seed.py:44: No seed found, seed set to 0``."""
    text = _run(["-m", "rllight", "generate", "--model.path", tiny_model_dir, "--prompt", "What is 2 + 2?",
                 "--max_new_tokens", "4"], tmp_path)
    assert text.startswith("rllight generate: "), text
    assert "No seed found" not in text and "site-packages" not in text, text
    assert WARNING_LINE.findall(text) == [], text


def test_training_a_reward_model_prints_the_tools_lines_only(tiny_model_dir, tmp_path):
    """The classifier's new score head made transformers print its load report ("score.weight | MISSING") and every
    load and save its bar, every frame of it on one line in a log file."""
    text = _run([os.path.join("tools", "train_reward_model.py"), "--base", tiny_model_dir, "--out",
                 str(tmp_path / "rm"), "--prompts", "2", "--samples", "2", "--heldout", "2", "--epochs", "1"], tmp_path)
    for noise in ("LOAD REPORT", "MISSING", "Loading weights", "Writing model shards", "it/s]", "site-packages"):
        assert noise not in text, text
    lines = text.splitlines()
    assert [line.split(":")[0] for line in lines[:-2]] == ["train_reward_model"] * (len(lines) - 2), text
    assert lines[-2].startswith("machine: ") and lines[-1].startswith("auc_before="), text
