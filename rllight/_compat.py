"""The few places where rllight reaches into Lightning's or PyTorch's internals, each with why."""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
import sys
import warnings

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.nn.parallel import DistributedDataParallel

log = logging.getLogger(__name__)


def forget_step_metrics(trainer: L.Trainer) -> None:
    """Drop the step-level values Lightning keeps for the epoch (``trainer._results``). Lightning sends the
    last value of each step metric to the logger again at every later step, so a metric logged on some
    steps only (replay, value pretraining, critic-only updates) would show stale repeats;
    ``trainer.callback_metrics`` keeps them."""
    results = getattr(trainer, "_results", None)
    if results is not None:
        results.reset(metrics=False)


def no_gradient_sync(trainer: L.Trainer | None):
    """A context in which backward passes leave DDP's reducer out (``DistributedDataParallel.no_sync``).

    rllight sums gradients over ranks itself, once per optimizer update (``rllight.distributed.Ranks.sum_gradients``):
    updates that train only part of the model (the critic alone, a replay NLL) or ranks with no rows in a
    minibatch would otherwise leave DDP waiting for gradients that never come. Elsewhere: no effect."""
    model = getattr(getattr(trainer, "strategy", None), "model", None) if trainer is not None else None
    if isinstance(model, DistributedDataParallel):
        return model.no_sync()
    return contextlib.nullcontext()


def lazy_default(class_type: type, **kwargs):
    """``jsonargparse.lazy_instance(class_type, **kwargs)`` (the default a recipe shows as a ``class_path``),
    without its lookup of the calling module through ``inspect.stack()``: that reads the source lines of every
    frame on the stack, about a second per default in a process that has torch and transformers loaded, paid by
    every process that imports rllight. The caller's frame is handed over instead, the one frame jsonargparse
    reads from that stack."""
    from jsonargparse import lazy_instance

    caller = sys._getframe(1)
    stack = inspect.stack
    inspect.stack = lambda context=1: [None, (caller,)]
    try:
        return lazy_instance(class_type, **kwargs)
    finally:
        inspect.stack = stack


def plain_instance(obj):
    """A default made with ``jsonargparse.lazy_instance`` as a plain instance of its class (others unchanged).

    A lazy instance is one object shared by every call that takes the default, of a generated class that
    cannot be pickled, and initialised only when one of its methods is first called (a property read before
    that finds no attributes): a reward must be sent to worker processes, a reward runner holds processes of
    its own, and a rollout engine holds state and is asked how it samples, so each module gets its own plain
    instance."""
    lazy_type = getattr(obj, "_lazy_class_type", None)
    if lazy_type is None or not hasattr(obj, "lazy_get_init_args"):
        return obj
    return lazy_type(**dict(obj._lazy_kwargs))


class RunCheckpoint(ModelCheckpoint):
    """The checkpoint callback rllight adds to a run (``rllight.checkpoint.CheckpointSettings``): Lightning's
    ``ModelCheckpoint`` keeping the newest ``keep`` checkpoints (1: ``last.ckpt`` alone; more: ``step=K.ckpt``, K
    the RL steps done, ranked by it, Lightning's way to keep the latest N, with ``last.ckpt`` a link to the
    newest), which also

    - saves every ``every_n_train_steps`` RL steps (rollouts, ``datamodule.batches_trained``), not optimizer
      updates: Lightning's test ``global_step % n == 0`` under manual optimisation saved every 5 rollouts of 2
      updates with n = 10, and with 3 updates a rollout only where 3 x rollouts is a multiple of n;
    - saves the run's last step when that is not a multiple of ``every_n_train_steps`` (Lightning's own
      ``on_train_end`` saves only when no checkpoint was saved at all: a 12-step run checkpointed every 10 ended
      with step 10 in ``last.ckpt``), with ``final_weights_only`` without the optimizer's state;
    - says where the first checkpoint it writes went and its size, once;
    - makes a failed save (a full disk, ``rllight.checkpoint.DiskWriteError``), mid-run or final, one logged line,
      not the end of the run: training and the export that follows go on, and the previous checkpoint stays whole
      (``rllight.checkpoint.AtomicCheckpointIO``).

    Reads the callback's ``_last_global_step_saved`` and ``_last_checkpoint_saved`` and calls its
    ``_save_checkpoint``, ``_save_topk_checkpoint`` and ``_save_last_checkpoint`` (Lightning 2.5 and 2.6)."""

    def __init__(self, every_n_train_steps: int, keep: int = 1, final_weights_only: bool = False, **kwargs):
        if keep > 1:  # named by the RL step, as the progress lines count (the candidate added below)
            kwargs.update(save_top_k=keep, monitor="rl_step", mode="max", filename="step={rl_step}",
                          auto_insert_metric_name=False, save_last="link")
        else:
            kwargs.update(save_top_k=0, save_last=True)
        super().__init__(every_n_train_steps=every_n_train_steps, **kwargs)
        self.keep, self.final_weights_only = keep, final_weights_only
        self.announced = False

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx) -> None:
        if self._every_n_train_steps < 1 or rl_steps_done(trainer) % self._every_n_train_steps:
            return
        if self._should_skip_saving_checkpoint(trainer):  # e.g. no update since the last save
            return
        candidates = self._monitor_candidates(trainer)
        try:
            self._save_topk_checkpoint(trainer, candidates)
            self._save_last_checkpoint(trainer, candidates)
        except OSError as err:  # a full disk: the previous checkpoint is whole, training goes on
            from rllight.checkpoint import DiskWriteError

            if isinstance(err, DiskWriteError) and trainer.world_size > 1:
                trainer.strategy.barrier("rllight: a failed checkpoint save")  # the one its save skipped
            log.error("%s; training goes on, %s, and the next save is tried in %d RL steps", err,
                      self._saved_before(), self._every_n_train_steps)

    def _monitor_candidates(self, trainer: L.Trainer) -> dict:
        candidates = super()._monitor_candidates(trainer)
        candidates["rl_step"] = torch.tensor(rl_steps_done(trainer))
        return candidates

    def _saved_before(self) -> str:
        """What a failed save leaves: the checkpoint saved before it, intact, or none yet."""
        if not self._last_checkpoint_saved:
            return "no checkpoint of this run was saved before"
        return f"the checkpoint saved before (update {self._last_global_step_saved}) is intact"

    def _save_checkpoint(self, trainer: L.Trainer, filepath: str) -> None:
        super()._save_checkpoint(trainer, filepath)
        if not self.announced and trainer.is_global_zero:
            self.announced = True
            print(self._announcement(trainer, filepath), flush=True)

    def _announcement(self, trainer: L.Trainer, filepath: str) -> str:
        from rllight.checkpoint import disk_size, human_size

        size = disk_size(filepath)
        what = "the weights only" if self.save_weights_only else "the weights and the optimizer's state"
        line = (f"rllight: checkpoint after step {rl_steps_done(trainer)} (update {trainer.global_step}) saved to "
                f"{filepath}: {human_size(size)}, {what}; ")
        if self.keep == 1:
            return line + (f"replaced every {self._every_n_train_steps} RL steps and at the end (checkpoint.keep 1, "
                           "checkpoint.every_n_steps)")
        return line + (f"one every {self._every_n_train_steps} RL steps and at the end, the newest {self.keep} kept in "
                       f"{self.dirpath}: about {human_size(self.keep * size)} (checkpoint.keep)")

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        saved = self._last_global_step_saved == trainer.global_step
        rewrite = saved and self.final_weights_only and bool(self._last_checkpoint_saved)
        if not self.save_last or (saved and not rewrite):
            return super().on_train_end(trainer, pl_module)
        candidates = self._monitor_candidates(trainer)
        self.save_weights_only = self.final_weights_only
        try:
            if rewrite and self.keep > 1:  # the step's own file, which last.ckpt links to
                self._save_checkpoint(trainer, self._last_checkpoint_saved)
            elif self.keep > 1:
                self._save_topk_checkpoint(trainer, candidates)
                self._save_last_checkpoint(trainer, candidates)
            else:
                self._save_last_checkpoint(trainer, candidates)
        except OSError as err:
            where = self.format_checkpoint_name(candidates, None if self.keep > 1 else self.CHECKPOINT_NAME_LAST)
            log.error("could not save the final checkpoint %s (%s); the run goes on to its export, and %s", where, err,
                      self._saved_before())
        finally:
            self.save_weights_only = False


def rl_steps_done(trainer: L.Trainer) -> int:
    """The RL steps (rollouts) the run has trained, a resume's earlier ones included: ``datamodule.batches_trained``
    (counted in the training step, before the callbacks see it), else the batches Lightning's loop has processed."""
    done = getattr(trainer.datamodule, "batches_trained", None)
    return int(done) if done is not None else trainer.fit_loop.epoch_loop.batch_progress.total.processed


def resolve_last_checkpoint(trainer: L.Trainer) -> str | None:
    """The checkpoint ``--ckpt_path last`` resumes from, found as Lightning finds it, else the newest ``last.ckpt``
    under ``default_root_dir`` (``newest_last_checkpoint``) (None: there is none, where Lightning would warn and
    train from scratch). Calls ``_CheckpointConnector._parse_ckpt_path`` (Lightning 2.5 and
    2.6) with its warning silenced: the caller makes it an error."""
    from lightning.pytorch.trainer.states import TrainerFn

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        found = trainer._checkpoint_connector._parse_ckpt_path(TrainerFn.FITTING, "last", model_provided=True,
                                                               model_connected=False)
    return found or newest_last_checkpoint(trainer.default_root_dir)


def newest_last_checkpoint(root: str) -> str | None:
    """The newest ``last.ckpt`` of an earlier run under ``root``: with a logger each run keeps its checkpoints in a
    folder of its own (``lightning_logs/version_N/checkpoints``), where Lightning's ``last`` (the new run's folder,
    still empty) never looks."""
    import glob

    # A file, or under FSDP's save_distributed_checkpoint a folder of shards with its meta.pt (rllight.safety).
    found = [p for p in glob.glob(os.path.join(glob.escape(root), "**", "last.ckpt"), recursive=True)
             if os.path.isfile(p) or os.path.isfile(os.path.join(p, "meta.pt"))]
    return max(found, key=os.path.getmtime) if found else None


def step_metrics(trainer: L.Trainer) -> dict[str, float]:
    """The metrics logged during the current training step only, as floats. ``trainer.callback_metrics`` keeps
    every key ever logged, so a metric of some steps only (the entropy, with no policy update) would show a stale
    value; the step's own are the active loop's results not reset since the step began (``forget_step_metrics``).
    Reads ``trainer._results.metrics`` (Lightning 2.5 and 2.6)."""
    results = getattr(trainer, "_results", None)
    if results is None:
        return {}
    return {k: float(v) for k, v in results.metrics(on_step=True)["callback"].items() if v.numel() == 1}


def log_step_now(trainer: L.Trainer) -> None:
    """Send the current training step's metrics to the loggers now, from ``on_train_batch_end``: Lightning's loop
    sends them after that hook (``_logger_connector.on_batch_end`` and ``update_train_step_metrics``, Lightning 2.5
    and 2.6), so a run that ends by raising there would lose the very step that ended it (a guard's own metrics)."""
    connector = getattr(trainer, "_logger_connector", None)
    if connector is not None:
        connector.on_batch_end()
        connector.update_train_step_metrics()


_LIBC = None


def return_free_memory() -> None:
    """Give the C heap's free pages back to the operating system (glibc's ``malloc_trim``; nothing elsewhere).

    PyTorch's CPU tensors come from ``malloc``. glibc raises its mmap threshold to the size of each large block
    freed (up to 32 MB), so a model's weight-sized tensors then live on the heap, and a phase that frees many of
    them (the rollout engine's bfloat16 copy of the policy after a generation, an update's activations and
    gradients) leaves its pages resident, free but counted in the process's RSS, until a later phase happens to
    reuse them. Called where a phase ends (after each generation and each optimizer update), it costs tens of
    milliseconds on a 3 GB heap and keeps the peak RSS to what the tensors alive at once need
    (``tests/test_precision.py``)."""
    global _LIBC
    if _LIBC is None:
        import ctypes

        try:
            _LIBC = ctypes.CDLL("libc.so.6")
            _LIBC.malloc_trim  # noqa: B018 (glibc only: musl and macOS have none)
        except (OSError, AttributeError):
            _LIBC = False
    if _LIBC:
        _LIBC.malloc_trim(0)


def set_process_group_timeout(strategy, timeout) -> None:
    """Give ``strategy``'s process group ``timeout`` (a ``timedelta``), unless the recipe gave the strategy one of its
    own (``trainer.strategy.init_args.timeout``). Lightning's DDP and model-parallel strategies keep it in
    ``_timeout`` (Lightning 2.5, 2.6), with a 30-minute default; a strategy without one is left as it is."""
    from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout

    if getattr(strategy, "_timeout", None) == default_pg_timeout:
        strategy._timeout = timeout


_WATCHED: list = []  # the process lists of the launches whose ranks rllight watches itself


def watch_ranks_yourself(launcher, before, after) -> bool:
    """Have ``launcher`` (Lightning's ``_SubprocessScriptLauncher``, which starts this machine's other ranks from
    this process) call ``before()`` just before it starts them and ``after(procs)`` just after, with no watcher
    thread of Lightning's: that one SIGKILLs this process up to 5 s after another rank exits with an error, whether
    or not this one is saying which rank failed and why (``rllight.app.launch``). Wraps the launcher's
    ``_call_children_scripts`` and skips ``_launch_process_observer`` for its processes (Lightning 2.5, 2.6). False
    where either is missing: the launch is then Lightning's alone."""
    from lightning.pytorch.strategies.launchers import subprocess_script as script

    spawn = getattr(launcher, "_call_children_scripts", None)
    observer = getattr(script, "_launch_process_observer", None)
    if spawn is None or observer is None:
        return False
    if not getattr(observer, "skips_rllight", False):
        def lightning_observer(procs):
            if not any(procs is watched for watched in _WATCHED):
                observer(procs)

        lightning_observer.skips_rllight = True
        script._launch_process_observer = lightning_observer

    def spawn_watched():
        before()
        spawn()
        _WATCHED.append(launcher.procs)
        after(launcher.procs)

    launcher._call_children_scripts = spawn_watched
    return True
