"""What a run prints: one line per RL step in a log file (counted in rollouts, also after a resume), evaluation
progress, and none of the messages a recipe user cannot act on."""

import io
import os
import re
import time
from contextlib import redirect_stdout
from types import SimpleNamespace

import lightning as L
import pytest
import yaml

from conftest import RECIPES
from helpers import build, fit_in_child, tiny_overrides
from rllight.app.progress import StepLog, duration
from test_rollout_count import fake_trainer

STEP_LINE = re.compile(
    r"^rllight: step (\d+)/(\d+) \| updates (\d+)/(\d+) \| reward [\d.]+ \| accuracy [\d.]+ \| entropy [\d.]+ "
    r"\| length [\d.]+ \| [\d.]+s/step \| ETA \S+$", re.M)

NOISE = (
    "Using ModelCheckpoint with manual optimization",  # Lightning's 12-line warning with example code
    "self.saved_models",  # ... and its example code
    "LeafSpec",  # torch's deprecation of what Lightning's _pytree calls
    "Tip:",  # Lightning's litlogger / litmodels advertisements
    "FLOPs",  # "Total FLOPs: 0" in the model summary
    "Flops",
    "Epoch 0/-2",  # the bar's epoch count under max_steps
    "Trainer already configured with model summary",  # Lightning on replacing its summary
    "TPU available: False",  # an absent accelerator
    "Loading weights",  # transformers' bar, every frame on one line in a file
    "is not supported by the model summary",  # Lightning on bf16-mixed, whose weights are float32 all the same
)


def _overlay(tmp_path, tiny_model_dir, checkpoint_every: int | None = None, bar: str | None = None) -> str:
    """The tiny-model overlay as a user would run it: the default logger, progress bar and model summary, a
    validation, (``checkpoint_every``) a ModelCheckpoint of the recipe's own and (``bar``) a progress bar."""
    # 2 prompts x 8 = 16 responses: 2 updates
    path = tiny_overrides(tmp_path, tiny_model_dir, batching={"minibatch_size": 8})
    with open(path) as f:
        cfg = yaml.safe_load(f)
    cfg["trainer"].update({"logger": True, "enable_progress_bar": True, "limit_val_batches": 1.0})
    cfg["trainer"].pop("enable_checkpointing")
    if checkpoint_every:
        cfg["trainer"]["callbacks"] = [{"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                                        "init_args": {"dirpath": str(tmp_path / "ckpt"), "save_last": True,
                                                      "save_top_k": 0, "every_n_train_steps": checkpoint_every}}]
    if bar:
        cfg["trainer"].setdefault("callbacks", []).append({"class_path": f"rllight.app.progress.{bar}"})
    with open(path, "w") as f:
        yaml.safe_dump(cfg, f)
    return path


def _steps(text: str) -> list[tuple[int, int, int, int]]:
    return [tuple(int(g) for g in m.groups()) for m in STEP_LINE.finditer(text)]


@pytest.mark.slow
def test_a_log_file_gets_one_line_per_rollout_and_no_noise(tmp_path, tiny_model_dir):
    overlay = _overlay(tmp_path, tiny_model_dir, checkpoint_every=2)
    log_file = tmp_path / "fit.log"
    # In bf16-mixed, as the recipes' precision auto chooses on most machines: its messages are checked too.
    run = fit_in_child("grpo.yaml", "--config", overlay, "--trainer.max_steps", "6", "--evaluate_before_after", "true",
                       "--trainer.precision", "bf16-mixed", timeout=900, log_file=str(log_file))
    text = log_file.read_text()
    assert run.returncode == 0, text[-3000:]
    # 6 optimizer updates at 2 per rollout: 3 rollouts, numbered 1..3 of 3, with the updates alongside.
    assert _steps(text) == [(1, 3, 2, 6), (2, 3, 4, 6), (3, 3, 6, 6)], text[-3000:]
    assert "rllight: evaluation before training: 1 batch (4 prompts)" in text
    assert "rllight: evaluation after 6 updates: 1 batch (4 prompts)" in text
    # The evaluation files count RL steps, as the lines do: before training, and after 3 rollouts (6 updates).
    names = {p.name for p in tmp_path.rglob("val_step*.json")}
    assert {"val_step0.json", "val_step3.json"} <= names and "val_step6.json" not in names, names
    assert len(re.findall(r"^rllight: evaluation: 1/1 batches in \S+$", text, re.M)) == 2
    assert len(re.findall(r"^rllight: evaluation done in \S+: accuracy [\d.]+$", text, re.M)) == 2
    assert re.search(r"^rllight: model: [\d.]+ \w* ?trainable parameters, 0 frozen, [\d.]+ MB$", text, re.M)  # no FLOPs
    assert [n for n in NOISE if n in text] == []
    # No Python warning reaches the log (one starts with its source, "file.py:LINE: "): Lightning's and PyTorch's
    # are filtered where they arise, and rllight's own are logged lines that say what to do.
    assert re.findall(r"^\S+\.py:\d+: .*$", text, re.M) == []


@pytest.mark.slow
def test_a_resumed_run_counts_on_from_the_rollouts_done(tmp_path, tiny_model_dir):
    overlay = _overlay(tmp_path, tiny_model_dir, checkpoint_every=2)
    logs = [tmp_path / "first.log", tmp_path / "resumed.log"]
    first = fit_in_child("grpo.yaml", "--config", overlay, "--trainer.max_steps", "4",
                         "--trainer.limit_val_batches", "0", timeout=900, log_file=str(logs[0]))
    assert first.returncode == 0, logs[0].read_text()[-3000:]
    assert _steps(logs[0].read_text()) == [(1, 2, 2, 4), (2, 2, 4, 4)]
    resumed = fit_in_child("grpo.yaml", "--config", overlay, "--trainer.max_steps", "8",
                           "--trainer.limit_val_batches", "0", "--ckpt_path", str(tmp_path / "ckpt" / "last.ckpt"),
                           timeout=900, log_file=str(logs[1]))
    text = logs[1].read_text()
    assert resumed.returncode == 0, text[-3000:]
    # Rollouts 3 and 4 of 4 (not 1/2 again, nor 3/0).
    assert _steps(text) == [(3, 4, 6, 8), (4, 4, 8, 8)], text[-3000:]


def _shown(bar) -> tuple:
    """What the training bar shows: (position, total, title)."""
    if hasattr(bar, "train_progress_bar_id"):  # Rich
        task = {t.id: t for t in bar.progress.tasks}[bar.train_progress_bar_id]
        return int(task.completed), task.total, task.description.rsplit("]", 1)[-1]
    return bar.train_progress_bar.n, bar.train_progress_bar.total, bar.train_progress_bar.desc.rstrip(": ")


class _Watch(L.Callback):
    """Records what the bar shows after it has drawn a batch (callbacks run in order; this one is last)."""

    def __init__(self, bar):
        self.bar, self.seen = bar, []

    def on_train_start(self, trainer, pl_module):
        self.seen.append(_shown(self.bar))

    def on_train_batch_end(self, trainer, *args):
        self.seen.append(_shown(self.bar))


def _fit_watched(recipe, overlay, *args, ckpt_path=None):
    cli = build(recipe, overlay, *args)
    bar = cli.trainer.progress_bar_callback
    watch = _Watch(bar)
    cli.trainer.callbacks.append(watch)
    cli.trainer.fit(cli.model, datamodule=cli.datamodule, ckpt_path=ckpt_path)
    return watch.seen


@pytest.mark.parametrize("bar", ["RichRolloutBar", "TQDMRolloutBar"])
def test_the_terminal_bar_counts_rollouts_also_after_a_resume(bar, tmp_path, tiny_model_dir):
    overlay = _overlay(tmp_path, tiny_model_dir, checkpoint_every=2, bar=bar)
    recipe = os.path.join(RECIPES, "grpo.yaml")
    no_val = ["--trainer.limit_val_batches", "0"]
    # 4 updates at 2 a rollout: rollouts 1 and 2 of 2 (Lightning's bar: "Epoch 0/-2", 1/2 then 2/2 of 4 updates).
    seen = _fit_watched(recipe, overlay, "--trainer.max_steps", "4", *no_val)
    assert seen == [(0, 2, "rollouts"), (1, 2, "rollouts"), (2, 2, "rollouts")]
    # Resumed to 8 updates: from 2 done, rollouts 3 and 4 of 4 (Lightning's bar: 3/0).
    seen = _fit_watched(recipe, overlay, "--trainer.max_steps", "8", *no_val,
                        ckpt_path=str(tmp_path / "ckpt" / "last.ckpt"))
    assert seen == [(2, 4, "rollouts"), (3, 4, "rollouts"), (4, 4, "rollouts")]


def test_a_long_evaluation_prints_at_least_every_heartbeat():
    trainer = SimpleNamespace(sanity_checking=False, num_val_batches=[2], datamodule=SimpleNamespace(val_rows=[{}] * 8),
                              state=SimpleNamespace(fn="validate"), global_step=0, ckpt_path=None,
                              callback_metrics={"val/accuracy": 0.5})
    log = StepLog(heartbeat=0.3)
    log.active = True
    log.before_fit = True  # as the rllight command sets it for evaluate_before_after's first evaluation
    out = io.StringIO()
    with redirect_stdout(out):
        log.on_validation_start(trainer, None)
        time.sleep(1.0)  # one batch that takes more than 3 heartbeats
        log.on_validation_batch_end(trainer, None, None, None, 0)
        log.on_validation_batch_end(trainer, None, None, None, 1)
        log.on_validation_end(trainer, None)
        time.sleep(0.5)  # the heartbeat has stopped
    lines = out.getvalue().splitlines()
    assert lines[0] == "rllight: evaluation before training: 2 batches (8 prompts)"
    beats = [line for line in lines if line.startswith("rllight: evaluation: batch 1/2 running")]
    assert 2 <= len(beats) <= 4, lines
    assert lines[len(beats) + 1].startswith("rllight: evaluation: 1/2 batches in ")
    assert lines[len(beats) + 2].startswith("rllight: evaluation: 2/2 batches in ")
    assert lines[-1].startswith("rllight: evaluation done in ") and lines[-1].endswith("accuracy 0.500")


def test_a_validate_alone_is_not_called_before_training():
    """``rllight validate`` evaluates at global step 0 too: it is "evaluation", not "evaluation before training"."""
    trainer = SimpleNamespace(sanity_checking=False, num_val_batches=[1], datamodule=SimpleNamespace(val_rows=[{}] * 4),
                              state=SimpleNamespace(fn="validate"), global_step=0, ckpt_path=None,
                              callback_metrics={})
    log = StepLog(heartbeat=60)
    log.active = True
    out = io.StringIO()
    with redirect_stdout(out):
        log.on_validation_start(trainer, None)
        log.on_validation_end(trainer, None)
    assert out.getvalue().splitlines()[0] == "rllight: evaluation: 1 batch (4 prompts)"


def test_durations_read_at_a_glance():
    assert [duration(s) for s in (3.21, 42.4, 75, 3725, float("inf"))] == ["3.2s", "42s", "1m15s", "1h02m", "?"]


def test_a_step_that_trained_on_a_partial_batch_says_so():
    log = StepLog()
    log.durations = [2.0]
    trainer = fake_trainer(global_step=2, datamodule=SimpleNamespace(batches_trained=1, batch_size=4))
    full = log.step_line(trainer, {"train/reward/mean": 0.5, "train/sampling/cap_hit": 0.0})
    assert "partial batch" not in full
    partial = log.step_line(trainer, {"train/reward/mean": 0.5, "train/sampling/cap_hit": 1.0,
                                      "train/sampling/groups_short": 3.0})
    assert "| partial batch (3 groups short: max_rounds) |" in partial
    drained = log.step_line(trainer, {"train/reward/mean": 0.5, "train/sampling/cap_hit": 1.0,
                                      "train/sampling/groups_short": 2.0, "train/sampling/out_of_prompts": 1.0})
    assert "| partial batch (2 groups short: no more prompts) |" in drained


@pytest.mark.parametrize("message", [
    "Found 2 module(s) in eval mode at the start of training. This may lead to unexpected behavior during training.",
    "The dirpath has changed from 'runs/x/version_0/checkpoints' to 'runs/x/version_1/checkpoints', therefore ...",
    "LightningCLI's args parameter is intended to run from within Python like if it were from the command line.",
    "It is recommended to use `self.log('val/avg@1', ..., sync_dist=True)` when logging on epoch level in distributed "
    "setting to accumulate the metric across devices.",
    "No seed found, seed set to 0",
])
def test_lightnings_warnings_a_user_cannot_act_on_are_filtered(message):
    """The frozen reference policy in eval mode, a resume's new version folder, generate's and chat's own args, the
    evaluation's metrics logged without sync_dist (gathered already), the seed Lightning picks for seed_everything:
    true (the run's config.yaml records it): each is by design, so its warning never reaches the log (quiet_lightning,
    which every command installs)."""
    import warnings

    from lightning.fabric.utilities.warnings import PossibleUserWarning

    from rllight.app.progress import quiet_lightning

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quiet_lightning()
        warnings.warn(message, PossibleUserWarning)
        warnings.warn(message, UserWarning)
        warnings.warn("another warning, kept", UserWarning)
    assert [str(w.message) for w in caught] == ["another warning, kept"]
