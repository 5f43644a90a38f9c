"""Checkpoints are written whole or not at all, the run's last step is always in last.ckpt at its end, a
failed final save is one line that does not stop the export, a run keeps the newest checkpoint.keep of them and says
their size once, a final save can hold the weights alone, and a finished run prints commands that work."""

import json
import logging
import os
import shlex

import pytest
import torch

import rllight.checkpoint
import rllight.errors
import rllight.app.cli
from conftest import RECIPES
from helpers import build, tiny_overrides
from rllight.checkpoint import AtomicCheckpointIO, disk_size, human_size


def _fit(tmp_path, model_dir, steps, *args, **model):
    cli = build(os.path.join(RECIPES, "grpo.yaml"), tiny_overrides(tmp_path, model_dir, **model),
                "--trainer.enable_checkpointing", "true", "--trainer.max_steps", str(steps), *args)
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    return cli


def _last(tmp_path):
    return torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=True)["global_step"]


EVERY_2 = ("--checkpoint.every_n_steps", "2")


def test_the_last_checkpoint_holds_the_runs_last_step(tmp_path, tiny_model_dir):
    _fit(tmp_path, tiny_model_dir, 3, *EVERY_2)  # every 2 steps; the run ends at step 3
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
    real = AtomicCheckpointIO.save_checkpoint

    def disk_full_at_step_3(self, checkpoint, path, storage_options=None):
        if checkpoint["global_step"] == 3:
            raise OSError(28, "No space left on device")
        return real(self, checkpoint, path, storage_options)

    monkeypatch.setattr(AtomicCheckpointIO, "save_checkpoint", disk_full_at_step_3)
    export = tmp_path / "export"
    with caplog.at_level(logging.ERROR):
        cli = _fit(tmp_path, tiny_model_dir, 3, *EVERY_2, export_dir=str(export))
    assert cli.trainer.global_step == 3
    assert (export / "config.json").exists()  # the export ran after the failed save
    lines = [r.getMessage() for r in caplog.records if "could not save the final checkpoint" in r.getMessage()]
    assert len(lines) == 1 and "No space left on device" in lines[0] and "(update 2) is intact" in lines[0]
    assert _last(tmp_path) == 2  # the checkpoint before is whole


ZIP_WRITER_FULL = ("[enforce fail at inline_container.cc:778] . PytorchStreamWriter failed writing file data/3: "
                   "file write failed")
"""What torch's zip writer raises on a full disk: a RuntimeError, not an OSError."""


def test_a_full_disk_under_the_checkpoints_costs_no_step_and_leaves_no_partial_file(tmp_path, tiny_model_dir,
                                                                                    monkeypatch, caplog):
    """Every save fails as torch's zip writer fails on a full disk, mid-run and at the end: training and the export
    (on another, healthy disk) go on, each failure is one line naming the disk's free space, no partial file stays."""
    real_save = torch.save

    def zip_writer_on_a_full_disk(obj, target):
        real_save(obj, target)
        with open(target, "r+b") as f:
            f.truncate(10)
        raise RuntimeError(ZIP_WRITER_FULL)

    monkeypatch.setattr(rllight.checkpoint.torch, "save", zip_writer_on_a_full_disk)
    export = tmp_path / "export"
    with caplog.at_level(logging.ERROR):
        cli = _fit(tmp_path, tiny_model_dir, 3, "--checkpoint.every_n_steps", "1", export_dir=str(export))
    monkeypatch.setattr(rllight.checkpoint.torch, "save", real_save)
    assert cli.trainer.global_step == 3  # every step trained although no save succeeded
    assert (export / "config.json").exists()
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    final = [e for e in errors if "could not save the final checkpoint" in e]
    assert len(final) == 1 and len(errors) >= 2, errors  # the mid-run saves and the final one
    assert all("file write failed" in e and "free on the disk of" in e for e in errors)
    assert all("no checkpoint of this run was saved before" in e for e in errors)
    assert not list((tmp_path / "checkpoints").glob("*.tmp*"))  # the partial files are removed


def test_a_full_disk_under_the_export_is_one_line_and_leaves_no_partial_folder(tmp_path, tiny_model_dir,
                                                                              monkeypatch, capsys):
    import rllight.export

    def full_disk(policy, tokenizer, folder, info):
        with open(os.path.join(folder, "model.safetensors"), "wb") as f:
            f.write(b"partial")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(rllight.export, "_write_export", full_disk)
    export = tmp_path / "export"
    overlay = tiny_overrides(tmp_path, tiny_model_dir, export_dir=str(export))
    with pytest.raises(SystemExit) as exit_info:
        rllight.app.cli.main(["fit", "--config", os.path.join(RECIPES, "grpo.yaml"), "--config", overlay,
                          "--trainer.enable_checkpointing", "true"])
    assert exit_info.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("rllight: error: model.export_dir: could not write the export") and "free on" in last
    assert not export.exists() and not list(tmp_path.glob("export.new-*"))  # nothing partial left
    assert _last(tmp_path) == 2  # the trained weights are in the run's checkpoint


def test_ckpt_path_last_resumes_from_the_runs_last_checkpoint(tmp_path, tiny_model_dir):
    args = ["fit", "--config", os.path.join(RECIPES, "grpo.yaml"), "--config", tiny_overrides(tmp_path, tiny_model_dir),
            "--trainer.enable_checkpointing", "true"]
    rllight.app.cli.RLLightCLI(args=[*args, "--trainer.max_steps", "2"])
    assert _last(tmp_path) == 2
    cli = rllight.app.cli.RLLightCLI(args=[*args, "--trainer.max_steps", "3", "--ckpt_path", "last"])
    assert cli.trainer.global_step == 3 and _last(tmp_path) == 3  # one more step, from step 2


@pytest.mark.parametrize("given", ["command line", "recipe file"])
def test_ckpt_path_last_finds_the_earlier_runs_checkpoint_under_the_default_logger(given, tmp_path, tiny_model_dir):
    """With a logger each run keeps its checkpoints in its own version_N folder, where Lightning's "last" (the new
    run's empty folder) never looks: the newest last.ckpt under default_root_dir is the one resumed, whether
    ``ckpt_path: last`` comes on the command line or in a recipe file."""
    args = ["fit", "--config", os.path.join(RECIPES, "grpo.yaml"), "--config", tiny_overrides(tmp_path, tiny_model_dir),
            "--trainer.enable_checkpointing", "true", "--trainer.logger", "true"]
    rllight.app.cli.RLLightCLI(args=[*args, "--trainer.max_steps", "2"])
    (first,) = (tmp_path / "lightning_logs").glob("version_*/checkpoints/last.ckpt")
    resume = tmp_path / "resume.yaml"
    resume.write_text("ckpt_path: last\n")
    last = ["--ckpt_path", "last"] if given == "command line" else ["--config", str(resume)]
    cli = rllight.app.cli.RLLightCLI(args=[*args, "--trainer.max_steps", "3", *last])
    assert cli.trainer.global_step == 3  # one more step, from step 2: resumed, not started afresh
    assert cli.config.fit.ckpt_path == str(first)
    assert "version_1" in cli.trainer.checkpoint_callback.dirpath  # the resumed run writes a folder of its own


def test_a_resume_applies_the_recipes_new_learning_rate_and_schedule_and_says_so(tmp_path, tiny_model_dir, caplog):
    """The optimizer's and the schedule's restored state carried the checkpoint's rates: a changed lr or warm-up
    is now what the resumed steps use, and the log names the change."""
    from rllight.schedules import warmup_factor

    args = ["fit", "--config", os.path.join(RECIPES, "grpo.yaml"), "--config", tiny_overrides(tmp_path, tiny_model_dir),
            "--trainer.enable_checkpointing", "true", "--model.lr_scheduler", "rllight.schedules.WarmupSchedule",
            "--model.lr_scheduler.init_args.decay", "constant"]
    rllight.app.cli.RLLightCLI(args=[*args, "--trainer.max_steps", "2", "--model.optimizer.init_args.lr", "1e-5",
                                 "--model.lr_scheduler.init_args.warmup_steps", "8"])
    with caplog.at_level(logging.WARNING):
        cli = rllight.app.cli.RLLightCLI(args=[*args, "--trainer.max_steps", "3", "--ckpt_path", "last",
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


def test_the_newest_checkpoint_keep_stay_and_the_first_says_its_folder_and_size(tmp_path, tiny_model_dir, capsys):
    """checkpoint.keep 2 with a save every step: after 3 steps step=2 and step=3 stay (step=1 was removed),
    last.ckpt links to step=3 (no space of its own), and one line says where the first went and its size."""
    _fit(tmp_path, tiny_model_dir, 3, "--checkpoint.every_n_steps", "1", "--checkpoint.keep", "2")
    folder = tmp_path / "checkpoints"
    assert sorted(os.listdir(folder)) == ["last.ckpt", "step=2.ckpt", "step=3.ckpt"]
    assert os.readlink(folder / "last.ckpt") == "step=3.ckpt"
    assert torch.load(folder / "step=2.ckpt", weights_only=True)["global_step"] == 2 and _last(tmp_path) == 3
    said = [line for line in capsys.readouterr().out.splitlines() if "rllight: checkpoint after step" in line]
    assert len(said) == 1, said
    head = f"rllight: checkpoint after step 1 (update 1) saved to {folder / 'step=1.ckpt'}: "
    assert said[0].startswith(head)
    size, rest = said[0][len(head):].split(", ", 1)
    size, unit = size.split()
    # The same tensors at every step (a few bytes of counters apart): step 1's size is step 2's to 3 digits.
    assert unit == "kB" and float(size) * 1000 == pytest.approx(os.path.getsize(folder / "step=2.ckpt"), rel=0.01)
    assert rest.startswith("the weights and the optimizer's state; one every 1 RL steps and at the end, the newest 2 "
                           f"kept in {folder}: about ")


def test_checkpoints_come_every_n_rl_steps_however_many_updates_a_step_makes(tmp_path, tiny_model_dir, capsys):
    """Two updates per rollout (ppo_epochs 2), a checkpoint every 2 RL steps, 4 rollouts: saved after rollouts 2 and
    4 (updates 4 and 8), not after every rollout as a count of updates would have it; the files are named by the RL
    step, as the per-step lines count."""
    cli = _fit(tmp_path, tiny_model_dir, 8, "--checkpoint.every_n_steps", "2", "--checkpoint.keep", "5",
               "--model.batching.ppo_epochs", "2")
    assert (cli.datamodule.batches_trained, cli.trainer.global_step) == (4, 8)
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["last.ckpt", "step=2.ckpt", "step=4.ckpt"]
    assert torch.load(tmp_path / "checkpoints" / "step=2.ckpt", weights_only=True)["global_step"] == 4
    said = [line for line in capsys.readouterr().out.splitlines() if "rllight: checkpoint after" in line]
    assert len(said) == 1 and said[0].startswith("rllight: checkpoint after step 2 (update 4) saved to "), said
    assert "; one every 2 RL steps and at the end, the newest 5 kept in " in said[0]


def _finished(out: str, step: int) -> list[str]:
    """The lines a finished run printed about what it leaves."""
    start = out.index("rllight: finished: ")
    assert out[start:].splitlines()[0].endswith(f" {step} optimizer updates (trainer.max_steps counts updates).")
    return out[start:].splitlines()


def _command(line: str) -> list[str]:
    """The arguments of the command on a printed line (``    evaluate: rllight validate ...``)."""
    words = shlex.split(line.split(": ", 1)[1])
    assert words[0] == "rllight"
    return words[1:]


def test_a_finished_run_says_where_its_model_and_checkpoint_are_and_the_commands_work(tmp_path, tiny_model_dir,
                                                                                      capsys):
    """The end of a run names the export and last.ckpt with their sizes; the printed commands evaluate each (the same
    weights: the same table) and train further from the checkpoint."""
    export = tmp_path / "model"
    args = ["fit", "--config", os.path.join(RECIPES, "grpo.yaml"),
            "--config", tiny_overrides(tmp_path, tiny_model_dir, export_dir=str(export)),
            "--trainer.enable_checkpointing", "true", "--trainer.limit_val_batches", "null", "--trainer.max_steps", "2"]
    rllight.app.cli.RLLightCLI(args=args)
    lines = _finished(capsys.readouterr().out, 2)
    last = tmp_path / "checkpoints" / "last.ckpt"
    assert lines[1] == f"  model: {export} (Hugging Face folder, {human_size(disk_size(str(export)))})"
    size = human_size(os.path.getsize(last))
    assert lines[3] == f"  checkpoint: {last} ({size}, the weights and the optimizer's state)"
    assert [line.split(":")[0] for line in lines[2:6]] == ["    evaluate", "  checkpoint", "    evaluate",
                                                           "    train further"]
    tables = []
    for line in (lines[2], lines[4]):  # the export, then the checkpoint
        rllight.app.cli.RLLightCLI(args=_command(line))
        out = capsys.readouterr().out
        assert "rllight: evaluation of 4 prompts" in out
        tables.append(json.loads((tmp_path / "validate" / "validate_summary.json").read_text())["table"])
    assert tables[0] == tables[1] and tables[0]["all"]["prompts"] == 4
    further = _command(lines[5])
    assert further[-4:] == ["--ckpt_path", str(last), "--trainer.max_steps", "4"]
    assert further.count("--trainer.max_steps") == 1  # the run's own "--trainer.max_steps 2" replaced, not repeated
    cli = rllight.app.cli.RLLightCLI(args=further)
    assert cli.trainer.global_step == 4 and _last(tmp_path) == 4  # two more steps, from step 2


def test_a_weights_only_final_checkpoint_is_evaluated_and_not_resumed(tmp_path, tiny_model_dir, capsys):
    """checkpoint.final_weights_only: the step-2 checkpoint is whole, the final one (step 3) holds no optimizer state;
    the end of the run says so and prints no resume command; the printed evaluation runs; a resume from it (by its
    path, or as --ckpt_path last) is one line."""
    args = ["fit", "--config", os.path.join(RECIPES, "grpo.yaml"), "--config", tiny_overrides(tmp_path, tiny_model_dir),
            "--trainer.enable_checkpointing", "true", "--trainer.limit_val_batches", "null", "--trainer.max_steps", "3",
            *EVERY_2, "--checkpoint.final_weights_only", "true"]
    rllight.app.cli.RLLightCLI(args=args)
    out = capsys.readouterr().out
    last = tmp_path / "checkpoints" / "last.ckpt"
    state = torch.load(last, weights_only=True)
    assert state["global_step"] == 3 and "optimizer_states" not in state and "state_dict" in state
    assert "saved to " + str(last) + ": " in out and "the weights and the optimizer's state; replaced every 2" in out
    lines = _finished(out, 3)
    assert lines[1] == f"  checkpoint: {last} ({human_size(os.path.getsize(last))}, the weights only)"
    assert "train further" not in "\n".join(lines)
    rllight.app.cli.RLLightCLI(args=_command(lines[2]))
    assert "rllight: evaluation of 4 prompts" in capsys.readouterr().out
    for given in (str(last), "last"):
        with pytest.raises(SystemExit) as exit_info:
            rllight.app.cli.main([*args, "--trainer.max_steps", "4", "--ckpt_path", given])
        assert exit_info.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"'{last}' holds the weights only" in err[0] and "rllight validate" in err[0], err


def test_checkpoint_options_that_cannot_act_say_so(tmp_path, tiny_model_dir, caplog, capsys):
    """keep 0 is a one-line error naming the key; the options on a run without rllight's checkpoints (checkpointing
    off) are a warning that they have no effect."""
    overlay = tiny_overrides(tmp_path, tiny_model_dir)
    with pytest.raises(SystemExit) as exit_info:
        rllight.app.cli.main(["fit", "--config", os.path.join(RECIPES, "grpo.yaml"), "--config", overlay,
                          "--checkpoint.keep", "0"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "checkpoint.keep must be an integer >= 1, got 0" in err[0], err
    with caplog.at_level(logging.WARNING):
        cli = build(os.path.join(RECIPES, "grpo.yaml"), overlay, "--checkpoint.keep", "3")
    assert not cli.trainer.checkpoint_callbacks  # the overlay turns checkpointing off
    assert any("checkpoint.* options" in r.getMessage() and "no effect" in r.getMessage() for r in caplog.records)


def test_a_failure_after_some_of_a_steps_updates_keeps_them_saved_and_the_run_resumes(tmp_path, tiny_model_dir,
                                                                                      capsys):
    """The engine dies while taking the weights of step 2's first update (2 updates a step): what was trained is
    saved as it is, step 2 counted as done without its second update, and the message names that file; the resume
    from it goes on with step 3 and trains to the end."""
    engine = {"class_path": "user_strategies.FailsOnSync", "init_args": {"at": 3, "max_new_tokens": 6}}
    cli = build(os.path.join(RECIPES, "grpo.yaml"), tiny_overrides(tmp_path, tiny_model_dir, rollout=engine,
                                                                    batching={"ppo_epochs": 2}),
                "--trainer.enable_checkpointing", "true", "--trainer.max_steps", "8")
    with pytest.raises(rllight.errors.ComponentError, match="died while taking the new weights"):
        cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    saved = tmp_path / "checkpoints" / "crashed-step=2.ckpt"  # named by the RL steps it holds as done
    err = capsys.readouterr().err
    assert (f"rllight: the run failed in RL step 2; it had made 1 optimizer update(s), kept: it is saved as done, "
            f"without its other updates: resume with: ") in err and f"--ckpt_path {saved}" in err, err[-2000:]
    state = torch.load(saved, weights_only=True)
    assert state["global_step"] == 3 and state["RLDataModule"] == {"batches_trained": 2}
    resumed = build(os.path.join(RECIPES, "grpo.yaml"),
                    tiny_overrides(tmp_path, tiny_model_dir, batching={"ppo_epochs": 2}),
                    "--trainer.enable_checkpointing", "true", "--trainer.max_steps", "7")
    resumed.trainer.fit(resumed.model, datamodule=resumed.datamodule, ckpt_path=str(saved))
    assert resumed.trainer.global_step == 7 and resumed.datamodule.batches_trained == 4  # steps 3 and 4


def test_the_newest_checkpoint_is_named_where_a_failure_cannot_save(tmp_path):
    """With several processes a failed rank cannot save: the message names the newest checkpoint that exists (a
    file or a sharded checkpoint's folder), or says there is none."""
    from types import SimpleNamespace

    from rllight.safety import newest_checkpoint

    own = tmp_path / "own"
    trainer = SimpleNamespace(checkpoint_callbacks=[SimpleNamespace(dirpath=str(own))], default_root_dir=str(tmp_path),
                              ckpt_path=None)
    assert newest_checkpoint(trainer) is None
    resumed_from = tmp_path / "earlier.ckpt"
    resumed_from.write_bytes(b"x")
    trainer.ckpt_path = str(resumed_from)
    assert newest_checkpoint(trainer) == str(resumed_from)
    own.mkdir()
    (own / "notes.txt").write_text("not a checkpoint")
    (own / "sharded.ckpt").mkdir()  # a folder without meta.pt: not a checkpoint
    assert newest_checkpoint(trainer) == str(resumed_from)
    (own / "sharded.ckpt" / "meta.pt").write_bytes(b"x")
    os.utime(own / "sharded.ckpt", (2e9, 2e9))
    assert newest_checkpoint(trainer) == str(own / "sharded.ckpt")
