"""What a run prints while it trains.

- In a log file (output not a terminal), or without a progress bar: one line per RL step
  (``StepLog``: step / total in rollouts, updates / total, both fixed from the first line, reward, accuracy, entropy,
  response length, seconds per step, ETA), and during an evaluation one line per batch and at least one every 30
  seconds.
- In a terminal: a progress bar that counts rollouts (``rollout_bar``), also after a resume.
- A run from a checkpoint (``--ckpt_path``) says so in one line, with the RL steps and updates it starts from
  (``StepLog``), in place of Lightning's lines on restoring it.
- Lightning's messages that a recipe cannot act on are filtered where they arise (``quiet_lightning``), each
  with the reason; its model summary is printed without the FLOPs column (``ModelSize``).

``trainer.max_steps`` counts optimizer updates, and a rollout makes ``ppo_epochs x ceil(responses /
minibatch_size)`` of them: ``rllight.app.rollout_count.RolloutCount`` turns one into the other.
"""

from __future__ import annotations

import logging
import math
import sys
import threading
import time
import warnings

import lightning as L
from lightning.pytorch.callbacks import ModelSummary, ProgressBar, RichProgressBar, TQDMProgressBar
from lightning.pytorch.utilities.imports import _RICH_AVAILABLE

from rllight._compat import rl_steps_done, step_metrics
from rllight.app.rollout_count import RolloutCount
from rllight.errors import RecipeError
from rllight.safety import read_checkpoint
from rllight.stopping import say

STEP_FIELDS = (
    ("reward", "train/reward/mean", "{:.3f}"),
    ("accuracy", "train/reward/accuracy", "{:.3f}"),
    ("entropy", "train/policy/entropy", "{:.3f}"),
    ("length", "train/response/length_mean", "{:.1f}"),
)
"""The per-step line's fields: label, logged key, format (a field the step did not log is left out)."""

HEARTBEAT_SECONDS = 30.0
"""During an evaluation, the longest a log goes without a line."""


def counted(n: int, noun: str) -> str:
    """``1 RL step``, ``4 RL steps``."""
    return f"{n} {noun}{'' if n == 1 else 's'}"


def duration(seconds: float) -> str:
    """``75`` -> ``1m15s``; ``3725`` -> ``1h02m``; under a minute with one decimal below 10 s."""
    if not math.isfinite(seconds):
        return "?"
    if seconds < 10:
        return f"{seconds:.1f}s"
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


class StepLog(L.Callback):
    """One line per RL step, and evaluation progress, for a log file.

    Prints (global rank 0, to stdout) when the output is not a terminal or the run has no progress bar::

        rllight: step 3/40 | updates 6/80 | reward 0.250 | accuracy 0.250 | entropy 0.912 | length 14.2 |
            21.3s/step | ETA 13m30s      (one line)
        rllight: evaluation before training: 2 batches (200 prompts)
        rllight: evaluation: 1/2 batches in 1m45s, ETA 1m45s

    and during an evaluation a line at least every ``heartbeat`` seconds (one batch can take minutes). Whatever the
    output, a run from a checkpoint says which, once its state is restored (Lightning's own lines on it are
    dropped: ``quiet_lightning``)::

        rllight: resuming from runs/x/checkpoints/last.ckpt after 4 RL steps (8 optimizer updates)
        rllight: evaluating runs/x/checkpoints/last.ckpt (4 RL steps, 8 optimizer updates)      (rllight validate)

    Args:
        heartbeat: Longest silence during an evaluation, in seconds.
        window: Steps whose mean duration gives the seconds per step and the ETA.
    """

    def __init__(self, heartbeat: float = HEARTBEAT_SECONDS, window: int = 10):
        self.heartbeat = heartbeat
        self.window = window
        self.count = RolloutCount()
        self.durations: list[float] = []
        self.before_fit = False
        """Set by the ``rllight`` command around ``evaluate_before_after``'s first evaluation (a ``validate`` alone
        is not "before training")."""
        self.active = False
        self._step_start = 0.0
        self._eval: dict | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def setup(self, trainer, pl_module, stage: str) -> None:
        self.active = trainer.is_global_zero and (not sys.stdout.isatty() or trainer.progress_bar_callback is None)

    def say(self, text: str) -> None:
        with self._lock:
            say(f"rllight: {text}")  # a reader that went away (| tee, ended by Ctrl-C) never ends the run
            if self._eval is not None:
                self._eval["said"] = time.monotonic()

    # ------------------------------------------------------------------------------------ training
    def on_train_start(self, trainer, pl_module) -> None:
        self.count.start(trainer)
        restored = getattr(trainer, "ckpt_path", None)
        if restored and trainer.is_global_zero:  # restored by now: the loops, the data's trained batches
            say(f"rllight: resuming from {restored} after {counted(rl_steps_done(trainer), 'RL step')} "
                f"({counted(trainer.global_step, 'optimizer update')})")

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        self.count.batch_start(trainer)
        self._step_start = time.monotonic()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        self.count.batch_end(trainer)
        self.durations = (self.durations + [time.monotonic() - self._step_start])[-self.window:]
        if self.active:
            self.say(self.step_line(trainer, step_metrics(trainer)))

    def step_line(self, trainer, metrics: dict[str, float]) -> str:
        """The line of the step just done, from the metrics it logged; its totals are fixed (``RolloutCount``)."""
        total, updates = self.count.total(trainer), self.count.total_updates(trainer)
        parts = [f"step {self.count.done(trainer)}"
                 + (f"/{'≤' if self.count.bound else ''}{total}" if total is not None else "")]
        parts.append(f"updates {trainer.global_step}" + (f"/{updates}" if updates is not None else ""))
        parts += [f"{label} {fmt.format(metrics[key])}" for label, key, fmt in STEP_FIELDS if key in metrics]
        if metrics.get("train/sampling/cap_hit", 0) > 0:  # dynamic sampling trained on fewer groups than its target
            short = metrics.get("train/sampling/groups_short", 0)
            why = "no more prompts" if metrics.get("train/sampling/out_of_prompts", 0) > 0 else "max_rounds"
            parts.append(f"partial batch ({short:.0f} groups short: {why})")
        per_step = sum(self.durations) / len(self.durations)
        parts.append(f"{per_step:.1f}s/step")
        left = self.count.left(trainer)
        parts.append(f"ETA {duration(left * per_step)}" if left is not None else "ETA ?")
        return " | ".join(parts)

    # ---------------------------------------------------------------------------------- evaluation
    def on_validation_start(self, trainer, pl_module) -> None:
        if trainer.state.fn == "validate" and getattr(trainer, "ckpt_path", None) and trainer.is_global_zero:
            say(f"rllight: evaluating {trainer.ckpt_path}{_trained(trainer)}")
        if not self.active or trainer.sanity_checking:
            return
        batches = sum(b for b in trainer.num_val_batches if math.isfinite(b))
        rows = getattr(trainer.datamodule, "val_rows", None)
        what = f"{batches} batch{'es' if batches != 1 else ''}" + (f" ({len(rows)} prompts)" if rows else "")
        self._eval = {"start": time.monotonic(), "said": time.monotonic(), "done": 0, "batches": batches}
        self.say(f"{self._evaluation_name(trainer)}: {what}")
        self._stop.clear()
        self._thread = threading.Thread(target=self._beat, name="rllight-heartbeat", daemon=True)
        self._thread.start()

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int, dataloader_idx: int = 0):
        if self._eval is None:
            return
        ev = self._eval
        ev["done"] += 1
        elapsed = time.monotonic() - ev["start"]
        eta = elapsed / ev["done"] * (ev["batches"] - ev["done"])
        self.say(f"evaluation: {ev['done']}/{ev['batches']} batches in {duration(elapsed)}"
                 + (f", ETA {duration(eta)}" if ev["done"] < ev["batches"] else ""))

    def on_validation_end(self, trainer, pl_module) -> None:
        if self._eval is None:
            return
        elapsed = time.monotonic() - self._eval["start"]
        self._end_evaluation()
        accuracy = trainer.callback_metrics.get("val/accuracy")
        self.say(f"evaluation done in {duration(elapsed)}"
                 + (f": accuracy {float(accuracy):.3f}" if accuracy is not None else ""))

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        self._end_evaluation()

    def teardown(self, trainer, pl_module, stage: str) -> None:
        self._end_evaluation()

    def _evaluation_name(self, trainer) -> str:
        if trainer.state.fn == "fit":
            return f"evaluation at step {self.count.done(trainer)}"
        if trainer.state.fn == "validate" and self.before_fit:
            return "evaluation before training"
        return f"evaluation after {trainer.global_step} updates" if trainer.global_step else "evaluation"

    def _end_evaluation(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        self._thread = None
        with self._lock:
            self._eval = None

    def _beat(self) -> None:
        """The heartbeat thread: a line whenever ``heartbeat`` seconds pass without one."""
        while not self._stop.wait(timeout=min(self.heartbeat / 4, 1.0)):
            with self._lock:
                ev = self._eval
                quiet = ev is not None and time.monotonic() - ev["said"] >= self.heartbeat
            if quiet:
                elapsed = time.monotonic() - ev["start"]
                self.say(f"evaluation: batch {min(ev['done'] + 1, ev['batches'])}/{ev['batches']} running, "
                         f"{duration(elapsed)} so far")


def _trained(trainer) -> str:
    """`` (N RL steps, M optimizer updates)``: what the weights ``rllight validate`` loaded from ``trainer.ckpt_path``
    were trained for (the data's trained batches are restored; the updates are read from the checkpoint, as
    Lightning restores its loops for a fit only); without the updates where the file says none."""
    try:
        updates = read_checkpoint(str(trainer.ckpt_path)).get("global_step")
    except RecipeError:
        updates = None
    return f" ({counted(rl_steps_done(trainer), 'RL step')}" + (
        f", {counted(updates, 'optimizer update')})" if updates is not None else ")")


class _RolloutBarMixin:
    """A progress bar whose training bar counts rollouts of the whole run (``RolloutCount``), titled
    ``rollouts``, instead of this epoch's batches against a total in optimizer updates, and shows the metrics the
    run puts on the bar without the logger's version number (Lightning's ``v_num``, the log folder's suffix)."""

    def get_metrics(self, trainer, pl_module) -> dict:
        items = super().get_metrics(trainer, pl_module)
        items.pop("v_num", None)
        return items

    def _setup_count(self) -> None:
        self.count = RolloutCount()

    @property
    def total_train_batches(self) -> int | float:
        total = self.count.total(self.trainer)
        return float("inf") if total is None else total

    def on_train_start(self, trainer, *args) -> None:
        self.count.start(trainer)
        super().on_train_start(trainer, *args)
        # A resume from the middle of an epoch skips on_train_epoch_start: show the rollouts done from the start.
        self._open()
        self._show(trainer)

    def on_train_epoch_start(self, trainer, *args) -> None:
        super().on_train_epoch_start(trainer, *args)
        self._show(trainer)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        super().on_train_batch_start(trainer, pl_module, batch, batch_idx)
        self.count.batch_start(trainer)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        self.count.batch_end(trainer)
        # The parent bars show batch_idx + 1 as the position: give them the rollouts done.
        super().on_train_batch_end(trainer, pl_module, outputs, batch, self.count.done(trainer) - 1)
        self._show(trainer)


class RichRolloutBar(_RolloutBarMixin, RichProgressBar):
    """Lightning's Rich bar, counting rollouts (``_RolloutBarMixin``)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._setup_count()

    def _open(self) -> None:
        if self.progress is not None and self.train_progress_bar_id is None:
            self.train_progress_bar_id = self.progress.add_task("rollouts", total=self.total_train_batches)

    def _show(self, trainer) -> None:
        if self.progress is None or self.train_progress_bar_id is None:
            return
        style = self.theme.description
        self.progress.update(self.train_progress_bar_id, description=f"[{style}]rollouts" if style else "rollouts",
                             total=self.total_train_batches, completed=self.count.done(trainer))
        self.refresh()


class TQDMRolloutBar(_RolloutBarMixin, TQDMProgressBar):
    """Lightning's tqdm bar, counting rollouts (``_RolloutBarMixin``)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._setup_count()

    def _open(self) -> None:
        pass  # tqdm's bar is made in on_train_start

    def _show(self, trainer) -> None:
        bar = self.train_progress_bar
        if bar is None or bar.disable:
            return
        total = self.total_train_batches
        bar.set_description("rollouts", refresh=False)
        bar.total = total if math.isfinite(total) else None
        bar.n = self.count.done(trainer)
        bar.refresh()


def rollout_bar() -> ProgressBar:
    """The rollout-counting bar of the kind Lightning would choose (Rich where it is installed)."""
    return RichRolloutBar() if _RICH_AVAILABLE else TQDMRolloutBar()


class ModelSize(ModelSummary):
    """Lightning's model summary (its modules, parameters and size) without FLOPs: Lightning counts them only
    from an ``example_input_array``, which a language model fed prompts of varying length has none of, so the
    summary said ``Total FLOPs: 0``."""

    @staticmethod
    def summarize(summary_data, total_parameters: int, trainable_parameters: int, model_size: float, *args,
                  **kwargs) -> None:
        from lightning.pytorch.utilities.model_summary.model_summary import (get_formatted_model_size,
                                                                             get_human_readable_count)

        frozen = total_parameters - trainable_parameters
        lines = [f"rllight: model: {get_human_readable_count(trainable_parameters).strip()} trainable parameters, "
                 f"{get_human_readable_count(frozen).strip()} frozen, {get_formatted_model_size(model_size)} MB"]
        columns = [(name, [str(v) for v in values]) for name, values in summary_data
                   if name.strip() and "FLOP" not in name.upper()]  # not the row index
        if columns:
            widths = [max(len(name), *(len(v) for v in values)) if values else len(name) for name, values in columns]
            rows = [" | ".join(name.ljust(w) for (name, _), w in zip(columns, widths))]
            rows += [" | ".join(values[i].ljust(w) for (_, values), w in zip(columns, widths))
                     for i in range(len(columns[0][1]))]
            lines += ["  " + r.rstrip() for r in rows]
        print("\n".join(lines), flush=True)


def progress_callbacks(trainer_config: dict, callbacks: list) -> tuple[list, dict]:
    """The callbacks the CLI adds for what a run prints, and the trainer settings it overrides.

    ``StepLog`` always (it prints only in a log file or without a bar). Where the recipe configures no progress
    bar of its own: in a terminal, the rollout-counting bar (unless ``trainer.enable_progress_bar`` is false); in a
    log file no bar at all (Lightning's bars redraw in place, which a log file receives once, at the end).
    ``ModelSize`` instead of Lightning's summary, unless the recipe configures a summary or turns it off."""
    added: list = [StepLog()]
    overrides: dict = {}
    if not any(isinstance(cb, ProgressBar) for cb in callbacks):
        if not sys.stdout.isatty():
            overrides["enable_progress_bar"] = False
        elif trainer_config.get("enable_progress_bar") is not False:
            added.append(rollout_bar())
    if trainer_config.get("enable_model_summary") is not False and not any(
            isinstance(cb, ModelSummary) for cb in callbacks):
        added.append(ModelSize())
        overrides["enable_model_summary"] = False  # Lightning's default summary: replaced, without saying so
    return added, overrides


class _LightningLines(logging.Filter):
    """Drops Lightning's information lines that repeat what rllight says or that a recipe has nothing to do with
    (``DROPPED``: a text the line holds, and why it goes)."""

    DROPPED = {
        "Tip:": "advertisements for Lightning's cloud services",
        "TPU available:": "its report of accelerators: the recipe's trainer.accelerator chose the device",
        "HPU available:": "(the same)",
        "GPU available:": "(the same)",
        "Automatic Mixed Precision (AMP)": "the recipe's trainer.precision, or rllight's line on what auto chose",
        "Seed set to": "the seed is the recipe's seed_everything",
        "`Trainer.fit` stopped:": "rllight's finished: line says how the run ended",
        "was configured so": "`Trainer(limit_val_batches=1.0)` was configured so 100% of the batches will be used: "
                             "the recipe's own setting, read back",
        "Restoring states from the checkpoint": "a run from --ckpt_path says so in one line of rllight's (StepLog)",
        "Restored all states from the checkpoint": "(the same)",
        "Loaded model weights from the checkpoint": "(the same, for rllight validate)",
        "Initializing distributed:": "under DDP or FSDP, every process joining torch.distributed, and then its "
                                     "block of dashes saying the backend and the processes registered",
        "All distributed processes registered": "(the same)",
    }

    def filter(self, record: logging.LogRecord) -> bool:
        text = str(record.msg)
        return not any(d in text for d in self.DROPPED)


LIGHTNING_LOGGERS = ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero",
                     "lightning.fabric.utilities.seed", "lightning.fabric.utilities.distributed")
"""Where Lightning's lines in ``_LightningLines.DROPPED`` are logged: its ``rank_zero_info`` (the logger of whichever
of its two rank_zero modules was imported last), its seeding, and its start of torch.distributed. A filter acts on
the logger it is added to, not on those of the modules below it."""


def quiet_lightning() -> None:
    """Filter Lightning's and PyTorch's messages that a recipe user cannot act on, each where it arises.

    Idempotent (a repeated filter replaces the same one; the log filter is added once)."""
    # Lightning's ModelCheckpoint warns (12 lines, with example code) that under manual optimisation a checkpoint
    # taken every_n_train_steps holds the weights after the step's updates. That is what rllight wants: the
    # checkpoint also counts the step as done (data.batches_trained), so a resume goes on with the next rollout; the
    # warning's remedy (saving a `layer`'s state in training_step) does not apply.
    warnings.filterwarnings("ignore", message="Using ModelCheckpoint with manual optimization", category=UserWarning)
    # Lightning's own pytree helper (lightning.pytorch.utilities._pytree) tests `isinstance(x, LeafSpec)`, which
    # recent torch deprecates; nothing in a recipe calls or avoids it (a Lightning release will change the call).
    warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated",
                            category=FutureWarning)
    # Under bf16-mixed the weights stay float32, so the model summary's 32-bit size, which Lightning warns may be
    # inaccurate for that precision, is the weights' true size.
    warnings.filterwarnings("ignore", message=r"Precision .* is not supported by the model summary",
                            category=UserWarning)
    # The frozen reference policy (and a frozen critic backbone) are in eval mode on purpose: dropout off, as the
    # importance ratio needs one deterministic function; Lightning warns of every module in eval mode at the start.
    warnings.filterwarnings("ignore", message=r"Found \d+ module\(s\) in eval mode", category=UserWarning)
    # A resumed run writes its checkpoints in a version folder of its own, by design (rllight.app.cli: --ckpt_path last
    # finds the earlier run's); only Lightning's best-model bookkeeping, which rllight does not use, is not carried.
    warnings.filterwarnings("ignore", message="The dirpath has changed from", category=UserWarning)
    # seed_everything: true asks Lightning for a seed, and it gives 0 (or $PL_GLOBAL_SEED) with a warning that names its
    # own file; the run's config.yaml records the seed. (A recipe without seed_everything is seeded 0: rllight.app.cli.)
    warnings.filterwarnings("ignore", message="No seed found, seed set to")
    # generate and chat build the recipe's CLI from their own parsed arguments: the args parameter is the point.
    warnings.filterwarnings("ignore", message="LightningCLI's args parameter is intended", category=UserWarning)
    # Under torch.distributed (DDP, FSDP, or vLLM in this process, which starts a world of one) Lightning advises, for
    # each evaluation metric, to log it with sync_dist=True; rllight's evaluation has gathered every rank's rows
    # before it logs (rllight.evaluation.Evaluator.finish), so the numbers are already the run's.
    warnings.filterwarnings("ignore", message=r"It is recommended to use `self\.log\(.*sync_dist=True\)`")
    # Under DDP Lightning deals the held-out rows out with a DistributedSampler, which repeats rows to give every rank
    # as many, and advises one device for validate; the evaluation counts a repeated prompt once
    # (rllight.evaluation.accumulate: records keyed by their row's source).
    warnings.filterwarnings("ignore", message=r"Using `DistributedSampler` with the dataloaders\. During "
                                              r"`trainer\.validate")
    # Under FSDP a sharded checkpoint (a folder) is written over the one of the same name, as rllight's checkpoints
    # are replaced (last.ckpt); torch's checkpoint writer warns each time that it overwrites, and of a default to come.
    warnings.filterwarnings("ignore", message=r"Detected an existing checkpoint in .*, overwriting since",
                            category=UserWarning)
    for name in LIGHTNING_LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _LightningLines) for f in logger.filters):
            logger.addFilter(_LightningLines())
    if not sys.stderr.isatty():
        # transformers' "Loading weights" bar redraws in place: a log file gets every frame on one line.
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
