"""Checkpoints are written whole or not at all, the run's last step is always in last.ckpt at its end, and a
failed final save is one line that does not stop the export."""

import logging
import os

import pytest
import torch

import rllight.checkpoint
import rllight.cli
from conftest import RECIPES
from helpers import build, tiny_overrides
from rllight.checkpoint import AtomicCheckpointIO


def _fit(tmp_path, model_dir, steps, **model):
    cli = build(os.path.join(RECIPES, "grpo.yaml"), tiny_overrides(tmp_path, model_dir, **model),
                "--trainer.enable_checkpointing", "true", "--trainer.max_steps", str(steps))
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    return cli


def _last(tmp_path):
    return torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=True)["global_step"]


def test_the_last_checkpoint_holds_the_runs_last_step(tmp_path, tiny_model_dir, monkeypatch):
    monkeypatch.setattr(rllight.cli, "CHECKPOINT_EVERY", 2)  # every 2 steps; the run ends at step 3
    _fit(tmp_path, tiny_model_dir, 3)
    assert _last(tmp_path) == 3


def test_a_failed_write_leaves_the_previous_checkpoint_whole(tmp_path, monkeypatch):
    path = tmp_path / "ckpts" / "last.ckpt"
    io = AtomicCheckpointIO()
    io.save_checkpoint({"global_step": 1}, path)
    real_save = torch.save

    def full_disk(obj, target):
        real_save(obj, target)
        with open(target, "r+b") as f:  # what a full disk leaves: a truncated file
            f.truncate(10)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(rllight.checkpoint.torch, "save", full_disk)
    with pytest.raises(OSError, match="No space left"):
        io.save_checkpoint({"global_step": 2}, path)
    monkeypatch.setattr(rllight.checkpoint.torch, "save", real_save)
    assert torch.load(path, weights_only=True) == {"global_step": 1}
    assert os.listdir(tmp_path / "ckpts") == ["last.ckpt"]  # no temporary file left behind


def test_a_failed_final_save_is_one_line_and_the_export_still_runs(tmp_path, tiny_model_dir, monkeypatch, caplog):
    monkeypatch.setattr(rllight.cli, "CHECKPOINT_EVERY", 2)
    real = AtomicCheckpointIO.save_checkpoint

    def disk_full_at_step_3(self, checkpoint, path, storage_options=None):
        if checkpoint["global_step"] == 3:
            raise OSError(28, "No space left on device")
        return real(self, checkpoint, path, storage_options)

    monkeypatch.setattr(AtomicCheckpointIO, "save_checkpoint", disk_full_at_step_3)
    export = tmp_path / "export"
    with caplog.at_level(logging.ERROR):
        cli = _fit(tmp_path, tiny_model_dir, 3, export_dir=str(export))
    assert cli.trainer.global_step == 3
    assert (export / "config.json").exists()  # the export ran after the failed save
    lines = [r.getMessage() for r in caplog.records if "could not save the final checkpoint" in r.getMessage()]
    assert len(lines) == 1 and "No space left on device" in lines[0] and "(step 2)" in lines[0]
    assert _last(tmp_path) == 2  # the checkpoint before is whole


def test_ckpt_path_last_resumes_from_the_runs_last_checkpoint(tmp_path, tiny_model_dir):
    args = ["fit", "--config", os.path.join(RECIPES, "grpo.yaml"), "--config", tiny_overrides(tmp_path, tiny_model_dir),
            "--trainer.enable_checkpointing", "true"]
    rllight.cli.RLLightCLI(args=[*args, "--trainer.max_steps", "2"])
    assert _last(tmp_path) == 2
    cli = rllight.cli.RLLightCLI(args=[*args, "--trainer.max_steps", "3", "--ckpt_path", "last"])
    assert cli.trainer.global_step == 3 and _last(tmp_path) == 3  # one more step, from step 2


def test_a_resume_applies_the_recipes_new_learning_rate_and_schedule_and_says_so(tmp_path, tiny_model_dir, caplog):
    """The optimizer's and the schedule's restored state carried the checkpoint's rates: a changed lr or warm-up
    is now what the resumed steps use, and the log names the change."""
    from rllight.schedules import warmup_factor

    args = ["fit", "--config", os.path.join(RECIPES, "grpo.yaml"), "--config", tiny_overrides(tmp_path, tiny_model_dir),
            "--trainer.enable_checkpointing", "true", "--model.lr_scheduler", "rllight.schedules.WarmupSchedule",
            "--model.lr_scheduler.init_args.decay", "constant"]
    rllight.cli.RLLightCLI(args=[*args, "--trainer.max_steps", "2", "--model.optimizer.init_args.lr", "1e-5",
                                 "--model.lr_scheduler.init_args.warmup_steps", "8"])
    with caplog.at_level(logging.WARNING):
        cli = rllight.cli.RLLightCLI(args=[*args, "--trainer.max_steps", "3", "--ckpt_path", "last",
                                           "--model.optimizer.init_args.lr", "1e-3",
                                           "--model.lr_scheduler.init_args.warmup_steps", "4"])
    assert cli.trainer.global_step == 3
    lines = [r.getMessage() for r in caplog.records if "resumed with the recipe's learning rates" in r.getMessage()]
    assert lines == ["resumed with the recipe's learning rates: lr/policy 1e-05 -> 0.001, "
                     "lr_scheduler.warmup_steps 8 -> 4, lr_scheduler.critic_warmup_steps 8 -> 4"]
    # The step after the resume (update 3) ran at the new base rate and warm-up; the optimizer now holds update 4's.
    group = cli.model.optimizers().optimizer.param_groups[0]
    assert group["lr"] == pytest.approx(1e-3 * warmup_factor(3, 4, "constant", None, 0.0))
    assert cli.trainer.callback_metrics["train/lr/policy"] == pytest.approx(1e-3 * warmup_factor(2, 4, "constant",
                                                                                                  None, 0.0))
