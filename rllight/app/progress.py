"""What a run prints while it trains.

- In a log file (output not a terminal), or without a progress bar: one line per RL step
  (``StepLog``: step / total in rollouts, reward, accuracy, entropy, response length, seconds per step, ETA),
  and during an evaluation one line per batch and at least one every 30 seconds.
- In a terminal: a progress bar that counts rollouts (``rollout_bar``), also after a resume.
- Lightning's messages that a recipe cannot act on are filtered where they arise (``quiet_lightning``), each
  with the reason; its model summary is printed without the FLOPs column (``ModelSize``).

``trainer.max_steps`` counts optimizer updates, and a rollout makes ``ppo_epochs x ceil(responses /
minibatch_size)`` of them: ``RolloutCount`` turns one into the other.
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


def planned_updates_per_rollout(module, datamodule) -> int:
    """Optimizer updates one rollout makes as the recipe plans them: ``ppo_epochs x ceil(data.batch_size x
    group_size / minibatch_size)`` (one per epoch without a minibatch size), as ``RLModule.rl_step`` counts them."""
    batching = getattr(module, "batching", None)
    epochs = max(int(getattr(batching, "ppo_epochs", 1) or 1), 1)
    minibatch = getattr(batching, "minibatch_size", None)
    batch = getattr(datamodule, "batch_size", None)
    if not minibatch or not batch:
        return epochs
    group = getattr(getattr(module, "sampler", None), "group_size", 1) or 1
    return epochs * max(math.ceil(batch * group / minibatch), 1)


class RolloutCount:
    """Rollouts (RL steps: one training batch each) done and in all, for a run that may be a resume.

    Done: ``datamodule.batches_trained`` (restored by a resume). In all: the rollouts done plus the optimizer
    updates left to ``trainer.max_steps`` divided by the updates per rollout, and no more than ``max_epochs``
    epochs of batches. The updates per rollout are planned from the recipe until this run has made some, then
    measured (a critic's own updates, dynamic sampling or value pretraining change it) over the rollouts that
    trained and those that were empty after filtering: a run whose rollouts are often empty takes that many more
    of them, and its ETA says so; one that has made no update yet has no total. A rollout that a callback used
    instead (value pretraining) is not counted: it is not part of what the updates left will cost.
    """

    def __init__(self):
        self.updates = 0  # optimizer updates made by this run's counted rollouts
        self.rollouts = 0  # ... and how many rollouts those were (empty ones included)
        self._step_at_start = 0

    def batch_start(self, trainer) -> None:
        self._step_at_start = trainer.global_step

    def batch_end(self, trainer) -> None:
        made = trainer.global_step - self._step_at_start
        if made > 0 or step_metrics(trainer).get("train/guard/empty_rollouts", 0) > 0:
            self.updates += made
            self.rollouts += 1

    def done(self, trainer) -> int:
        return rl_steps_done(trainer)

    def per_rollout(self, trainer) -> float:
        """Optimizer updates per rollout: measured (0 while every counted rollout was empty), else planned."""
        if self.rollouts:
            return self.updates / self.rollouts
        return planned_updates_per_rollout(trainer.lightning_module, trainer.datamodule)

    def total(self, trainer) -> int | None:
        """The run's rollouts in all (None when neither ``max_steps`` nor ``max_epochs`` bounds them, or only
        ``max_steps`` does and no rollout has made an update yet)."""
        totals = []
        done = self.done(trainer)
        per_rollout = self.per_rollout(trainer)
        if trainer.max_steps is not None and trainer.max_steps > 0 and per_rollout > 0:
            left = max(trainer.max_steps - trainer.global_step, 0)
            totals.append(done + math.ceil(round(left / per_rollout, 6)))
        per_epoch = trainer.num_training_batches
        if trainer.max_epochs is not None and trainer.max_epochs > 0 and math.isfinite(per_epoch):
            totals.append(int(trainer.max_epochs * per_epoch))
        return min(totals) if totals else None

    def total_updates(self, trainer) -> int | None:
        """The optimizer updates the run will have made at its end: a rollout's updates all run, so ``max_steps``
        rounded up to whole rollouts (4 for ``max_steps`` 1 with 4 updates a rollout); None where unknown."""
        total = self.total(trainer)
        if total is None:
            return trainer.max_steps if trainer.max_steps is not None and trainer.max_steps > 0 else None
        return trainer.global_step + round(max(total - self.done(trainer), 0) * self.per_rollout(trainer))


class StepLog(L.Callback):
    """One line per RL step, and evaluation progress, for a log file.

    Prints (global rank 0, to stdout) when the output is not a terminal or the run has no progress bar::

        rllight: step 3/40 | updates 6/80 | reward 0.250 | accuracy 0.250 | entropy 0.912 | length 14.2 |
            21.3s/step | ETA 13m30s      (one line)
        rllight: evaluation before training: 2 batches (200 prompts)
        rllight: evaluation: 1/2 batches in 1m45s, ETA 1m45s

    and during an evaluation a line at least every ``heartbeat`` seconds (one batch can take minutes).

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
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        self.count.batch_start(trainer)
        self._step_start = time.monotonic()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        self.count.batch_end(trainer)
        self.durations = (self.durations + [time.monotonic() - self._step_start])[-self.window:]
        if self.active:
            self.say(self.step_line(trainer, step_metrics(trainer)))

    def step_line(self, trainer, metrics: dict[str, float]) -> str:
        """The line of the step just done, from the metrics it logged."""
        done, total = self.count.done(trainer), self.count.total(trainer)
        parts = [f"step {done}/{total if total is not None else '?'}"]
        updates = self.count.total_updates(trainer)
        parts.append(f"updates {trainer.global_step}" + (f"/{updates}" if updates is not None else ""))
        parts += [f"{label} {fmt.format(metrics[key])}" for label, key, fmt in STEP_FIELDS if key in metrics]
        if metrics.get("train/sampling/cap_hit", 0) > 0:  # dynamic sampling trained on fewer groups than its target
            short = metrics.get("train/sampling/groups_short", 0)
            why = "no more prompts" if metrics.get("train/sampling/out_of_prompts", 0) > 0 else "max_rounds"
            parts.append(f"partial batch ({short:.0f} groups short: {why})")
        per_step = sum(self.durations) / len(self.durations)
        parts.append(f"{per_step:.1f}s/step")
        parts.append(f"ETA {duration(max(total - done, 0) * per_step)}" if total is not None else "ETA ?")
        return " | ".join(parts)

    # ---------------------------------------------------------------------------------- evaluation
    def on_validation_start(self, trainer, pl_module) -> None:
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


class _RolloutBarMixin:
    """A progress bar whose training bar counts rollouts of the whole run (``RolloutCount``), titled
    ``rollouts``, instead of this epoch's batches against a total in optimizer updates."""

    def _setup_count(self) -> None:
        self.count = RolloutCount()

    @property
    def total_train_batches(self) -> int | float:
        total = self.count.total(self.trainer)
        return float("inf") if total is None else total

    def on_train_start(self, trainer, *args) -> None:
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


class _DropTips(logging.Filter):
    """Drops Lightning's lines that repeat what rllight says or that a recipe has nothing to do with: its "Tip"
    lines (advertisements for its cloud services), its report of accelerators (rllight's first lines say the
    device and precision it chose), ``Seed set to`` (the seed is the recipe's ``seed_everything``) and
    ``Trainer.fit stopped: max_steps reached`` (rllight's ``finished:`` line says how the run ended)."""

    DROPPED = ("Tip:", "TPU available:", "HPU available:", "GPU available:", "Seed set to", "`Trainer.fit` stopped:")

    def filter(self, record: logging.LogRecord) -> bool:
        text = str(record.msg)
        return not any(d in text for d in self.DROPPED)


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
    # generate and chat build the recipe's CLI from their own parsed arguments: the args parameter is the point.
    warnings.filterwarnings("ignore", message="LightningCLI's args parameter is intended", category=UserWarning)
    # Under torch.distributed (DDP, FSDP, or vLLM in this process, which starts a world of one) Lightning advises, for
    # each evaluation metric, to log it with sync_dist=True; rllight's evaluation has gathered every rank's rows
    # before it logs (rllight.evaluation.Evaluator.finish), so the numbers are already the run's.
    warnings.filterwarnings("ignore", message=r"It is recommended to use `self\.log\(.*sync_dist=True\)`")
    for name in ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.seed"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropTips) for f in logger.filters):
            logger.addFilter(_DropTips())
    if not sys.stderr.isatty():
        # transformers' "Loading weights" bar redraws in place: a log file gets every frame on one line.
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
