"""A run's output is rllight's own lines and what the user must act on: Lightning's lines on restoring a checkpoint and
on starting torch.distributed are dropped (``rllight.app.progress.quiet_lightning``), and a run from a checkpoint says
so in one line of rllight's, with the RL steps and updates it starts from."""

import logging
import os
import re
import subprocess
import sys

import pytest
import yaml

from conftest import RECIPES
from helpers import TESTS, fit_in_child, tiny_overrides
from rllight.app.progress import LIGHTNING_LOGGERS, quiet_lightning

DASHES = "-" * 100
CKPT = "runs/x/checkpoints/last.ckpt"
DROPPED = [  # as Lightning 2.6 words them, each from where it logs it
    ("lightning.pytorch.utilities.rank_zero",  # trainer/connectors/checkpoint_connector.py: resume_start, resume_end
     f"Restoring states from the checkpoint path at {CKPT}"),
    ("lightning.pytorch.utilities.rank_zero", f"Restored all states from the checkpoint at {CKPT}"),
    ("lightning.pytorch.utilities.rank_zero", f"Loaded model weights from the checkpoint at {CKPT}"),
    ("lightning.fabric.utilities.distributed",  # fabric/utilities/distributed.py: _init_dist_connection
     "Initializing distributed: GLOBAL_RANK: 0, MEMBER: 1/1"),
    ("lightning.fabric.utilities.rank_zero", f"{DASHES}\ndistributed_backend=gloo\n"
     f"All distributed processes registered. Starting with 1 processes\n{DASHES}\n"),
    ("lightning.pytorch.utilities.rank_zero",  # trainer/setup.py: _determine_batch_limits
     "`Trainer(limit_val_batches=1.0)` was configured so 100% of the batches will be used.."),
    ("lightning.pytorch.utilities.rank_zero",  # trainer/connectors/accelerator_connector.py
     "Using bfloat16 Automatic Mixed Precision (AMP)"),
]


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def test_lightnings_lines_on_restoring_and_on_starting_torch_distributed_are_dropped_where_they_are_logged():
    """Each message reaches no handler of the logger Lightning logs it with; a line of Lightning's that is not in the
    list still does, and ``rank_zero_info`` logs through one of the filtered loggers."""
    import lightning_utilities.core.rank_zero as rank_zero

    quiet_lightning()
    assert rank_zero.log.name in LIGHTNING_LOGGERS  # where Lightning's rank_zero_info logs, whichever module set it
    seen = _Lines()
    loggers = {name: logging.getLogger(name) for name in {name for name, _ in DROPPED}}
    levels = {name: logger.level for name, logger in loggers.items()}
    for logger in loggers.values():
        logger.addHandler(seen)
        logger.setLevel(logging.INFO)  # whatever an earlier test in this process left (a tool run in-process)
    try:
        for name, message in DROPPED:
            loggers[name].info(message)
        loggers["lightning.pytorch.utilities.rank_zero"].info("A line of Lightning's that a user acts on")
    finally:
        for name, logger in loggers.items():
            logger.removeHandler(seen)
            logger.setLevel(levels[name])
    assert seen.lines == ["A line of Lightning's that a user acts on"]


@pytest.mark.parametrize("message, category", [
    ("Using `DistributedSampler` with the dataloaders. During `trainer.validate()`, it is recommended to use "
     "`Trainer(devices=1, num_nodes=1)` to ensure each sample/batch gets evaluated exactly once.",
     "PossibleUserWarning"),
    ("Detected an existing checkpoint in runs/x/checkpoints/last.ckpt, overwriting since self.overwrite=True. Past "
     "version 2.5 of PyTorch, `overwrite` will default to False.", "UserWarning"),
])
def test_warnings_of_ddp_validation_and_of_fsdp_checkpoints_replaced_are_filtered(message, category):
    """Lightning's under DDP (the evaluation counts a prompt the sampler repeats once) and torch's on each sharded
    checkpoint written over the last (rllight replaces last.ckpt by design)."""
    import warnings

    from lightning.fabric.utilities.warnings import PossibleUserWarning

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quiet_lightning()
        warnings.warn(message, {"PossibleUserWarning": PossibleUserWarning, "UserWarning": UserWarning}[category])
        warnings.warn("another warning, kept", UserWarning)
    assert [str(w.message) for w in caught] == ["another warning, kept"]


def _overlay(tmp_path, tiny_model_dir) -> str:
    """The tiny GRPO overlay under FSDP on one CPU process (whose start is Lightning's "Initializing distributed"
    block), with a checkpoint and a validation: what a user's FSDP run prints."""
    path = tiny_overrides(tmp_path, tiny_model_dir)
    with open(path) as f:
        cfg = yaml.safe_load(f)
    cfg["trainer"].update({"strategy": {"class_path": "rllight.fsdp.FSDP"}, "enable_checkpointing": True,
                           "limit_val_batches": 1.0})
    with open(path, "w") as f:
        yaml.safe_dump(cfg, f)
    return path


NOT_OURS = re.compile(r"^(?!rllight|  |WARNING rllight|INFO rllight)(.*\S.*)$", re.M)
"""A line that is not rllight's: its lines start ``rllight:`` (or a logger's ``INFO rllight.x:``), their
continuations with two spaces (the model summary's rows)."""


@pytest.mark.slow
def test_a_resumed_fsdp_run_and_a_validate_of_its_checkpoint_print_rllights_lines_only(tmp_path, tiny_model_dir):
    overlay = _overlay(tmp_path, tiny_model_dir)
    logs = [tmp_path / "first.log", tmp_path / "resumed.log", tmp_path / "validate.log"]
    first = fit_in_child("grpo.yaml", "--config", overlay, "--trainer.max_steps", "2", timeout=600,
                         log_file=str(logs[0]))
    assert first.returncode == 0, logs[0].read_text()[-3000:]
    ckpt = str(tmp_path / "checkpoints" / "last.ckpt")  # a folder of shards under FSDP
    resumed = fit_in_child("grpo.yaml", "--config", overlay, "--trainer.max_steps", "4", "--ckpt_path", ckpt,
                           timeout=600, log_file=str(logs[1]))
    assert resumed.returncode == 0, logs[1].read_text()[-3000:]
    command = [sys.executable, "-m", "rllight", "validate", "--config", os.path.join(RECIPES, "grpo.yaml"), "--config",
               overlay, "--ckpt_path", ckpt]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([TESTS, os.environ.get("PYTHONPATH", "")]))
    with open(logs[2], "w") as out:
        done = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, env=env, timeout=600, check=False)
    assert done.returncode == 0, logs[2].read_text()[-3000:]
    texts = [log.read_text() for log in logs]
    for text in texts:
        assert NOT_OURS.findall(text) == [], text
    # 1 update a rollout (2 prompts x 8 responses, one minibatch): the resume starts after 2 RL steps, and the
    # validate evaluates the checkpoint it left, after 4.
    assert f"rllight: resuming from {ckpt} after 2 RL steps (2 optimizer updates)\n" in texts[1], texts[1]
    assert f"rllight: evaluating {ckpt} (4 RL steps, 4 optimizer updates)\n" in texts[2], texts[2]
    assert "resuming from" not in texts[0] and "resuming from" not in texts[2]
