"""Never lose a user's work: output locations checked before the model loads, a resumable checkpoint on
Ctrl-C or SIGTERM, and the recipe stored in every checkpoint and compared on resume.

The CLI adds the two callbacks (``Interrupts``, ``RecipeRecord``) to every ``rllight fit``.
"""

from __future__ import annotations

import logging
import os
import shlex
import signal
import sys
import tempfile
import threading

import lightning as L
import torch

from rllight._compat import rl_steps_done
from rllight.errors import RecipeError, RunStopped
from rllight.paths import existing_ancestor
from rllight.stopping import Interrupted, clear_stop, ending, request_stop

log = logging.getLogger(__name__)


# ------------------------------------------------------------------------------------ output locations
class _TolerantStream:
    """A text stream whose write errors (a reader that went away: ``| tee log`` ended by the same Ctrl-C) are
    swallowed: after the first, output is dropped, and the run goes on to save its checkpoint."""

    def __init__(self, stream):
        self._stream, self.broken = stream, False

    def write(self, text: str) -> int:
        if not self.broken:
            try:
                return self._stream.write(text)
            except (BrokenPipeError, OSError, ValueError):  # EPIPE, EIO, or a stream closed under us
                self.broken = True
        return len(text)

    def flush(self) -> None:
        if not self.broken:
            try:
                self._stream.flush()
            except (BrokenPipeError, OSError, ValueError):
                self.broken = True

    def __getattr__(self, name):  # isatty, fileno, encoding, ...: the stream's own
        return getattr(self._stream, name)


def tolerate_closed_output() -> None:
    """Make ``sys.stdout`` and ``sys.stderr`` never end a run with a write error (``_TolerantStream``): Ctrl-C on
    ``rllight fit ... | tee log`` also ends ``tee``, and the run's next print would raise ``BrokenPipeError`` before
    it could save the step and print how to resume. Idempotent."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is not None and not isinstance(stream, _TolerantStream):
            setattr(sys, name, _TolerantStream(stream))


def check_writable(path: str, key: str) -> None:
    """Refuse, in one line naming ``key``, a folder the run could not create or write into: a path
    under a regular file, an existing file, or a folder (or nearest existing parent) without write access,
    found by creating (and removing) a file of its own there, since ``os.access`` says yes to root even
    on ``/proc`` or a read-only file system."""
    path = os.path.abspath(path)
    if os.path.lexists(path) and not os.path.isdir(path):
        raise RecipeError(f"{key}: '{path}' is a file, not a folder; give a folder")
    existing = existing_ancestor(path)
    if not os.path.isdir(existing):
        raise RecipeError(f"{key}: '{path}' cannot be created because '{existing}' is a file; give another folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise RecipeError(f"{key}: '{existing}' is not writable; give a folder this user can write to")
    # os.access says yes to root everywhere, also on /proc or a read-only mount: try it with a file of our own.
    try:
        handle, probe = tempfile.mkstemp(prefix=".rllight-write-check-", dir=existing)
    except OSError as err:
        raise RecipeError(f"{key}: '{existing}' is not writable ({err.strerror or err}); give a folder this user "
                          "can write to") from None
    os.close(handle)
    os.remove(probe)


# ------------------------------------------------------------------------------------------ checkpoints
RECIPE_KEY = "rllight_recipe"
"""Where a checkpoint stores the recipe of the run that wrote it (flattened, plain values)."""

STRUCTURAL = ("model.model", "model.lora", "model.critic", "model.critic.class_path", "model.optimizer.class_path")
"""Keys (and everything under them, except where listed below) whose change makes the saved weights or
optimizer state unloadable: the model source, LoRA, the critic's presence, class and model, the
optimizer class. A resume that changes one is refused."""

RUN_DEFINING = ("data.batch_size", "model.sampler.class_path", "model.sampler.init_args.group_size")
"""Keys whose change makes the resumed run a different experiment rather than a continuation: the
resumable data stream counts batches (a new batch size would skip the wrong prompts), and the group
size or sampler changes every later rollout. Refused unless ``--resume_allow_changes true``."""

# Critic settings that are hyper-parameters, not weights: a change is reported, not refused.
_CRITIC_HYPER = ("loss_coef", "clip", "lr")
# Keys that say how long or where a run goes, not what it is.
_IGNORED = ("ckpt_path", "config", "print_config", "resume_allow_changes", "distributed_timeout_minutes",
            "trainer.max_steps", "trainer.max_epochs", "trainer.default_root_dir", "trainer.logger", "trainer.callbacks",
            "trainer.enable_progress_bar", "trainer.enable_checkpointing", "model.export_dir", "checkpoint")


def flatten(config, prefix: str = "") -> dict:
    """``{"a.b.c": value}`` for a nested dict of plain values (lists and scalars are leaves)."""
    out = {}
    if isinstance(config, dict):
        if not config and prefix:
            out[prefix] = {}
        for k, v in config.items():
            out.update(flatten(v, f"{prefix}.{k}" if prefix else str(k)))
    else:
        out[prefix] = config
    return out


def _matches(key: str, prefix: str) -> bool:
    return key == prefix or key.startswith(prefix + ".")


def _ignored(key: str) -> bool:
    return any(_matches(key, p) for p in _IGNORED)


def _structural(key: str) -> bool:
    if _matches(key, "model.critic") and key.rsplit(".", 1)[-1] in _CRITIC_HYPER:
        return False
    return any(_matches(key, p) for p in STRUCTURAL)


def recipe_differences(saved: dict, current: dict) -> list[tuple[str, object, object]]:
    """``(key, saved value, current value)`` for every flattened key that differs, ignored keys left out."""
    a, b = flatten(saved), flatten(current)
    out = []
    for key in sorted(set(a) | set(b)):
        if _ignored(key):
            continue
        old, new = a.get(key, "<absent>"), b.get(key, "<absent>")
        if old != new:
            out.append((key, old, new))
    return out


def check_resume(saved: dict | None, current: dict, ckpt_path: str, allow_changes: bool = False) -> list[str]:
    """Compare the recipe stored in a checkpoint with the current one.

    Returns the warnings (one line each) for differences that a resume tolerates; raises a one-line
    ``RecipeError`` naming the keys for differences that break it (``STRUCTURAL`` always, ``RUN_DEFINING``
    unless ``allow_changes``).
    """
    if saved is None:
        return [f"--ckpt_path '{ckpt_path}' stores no recipe (not written by rllight fit); it is not compared"]
    diffs = recipe_differences(saved, current)
    broken = [d for d in diffs if _structural(d[0])]
    defining = [d for d in diffs if not _structural(d[0]) and any(_matches(d[0], p) for p in RUN_DEFINING)]

    def show(items):
        return ", ".join(f"{k} ({old!r} -> {new!r})" for k, old, new in items)

    if broken:
        raise RecipeError(
            f"--ckpt_path '{ckpt_path}' was trained with a different model, LoRA, critic or optimizer: "
            f"{show(broken)}; resume with the recipe that wrote it, or start a new run without --ckpt_path"
        )
    if defining and not allow_changes:
        raise RecipeError(
            f"--ckpt_path '{ckpt_path}': the recipe changed what a step is: {show(defining)}; resume with the "
            "same values, or pass --resume_allow_changes true to continue with the new ones"
        )
    return [f"resuming with recipe changes: {show(diffs)}"] if diffs else []


def read_checkpoint(path: str) -> dict:
    """The checkpoint at ``path``, loaded on the CPU with ``weights_only`` (memory-mapped, so a large one
    costs little), or a one-line ``RecipeError`` naming the file. A sharded checkpoint (a folder, written under
    FSDP) is read for what it holds besides the weights and optimizer state (its ``meta.pt``)."""
    if os.path.isdir(path) and os.path.isfile(os.path.join(path, "meta.pt")):
        path = os.path.join(path, "meta.pt")
    if not os.path.isfile(path):
        raise RecipeError(f"--ckpt_path '{path}' does not exist; give a .ckpt file written by rllight fit")
    try:
        try:
            return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as err:
            if "mmap" not in str(err):  # an old-format (not zip) file cannot be mapped; read it whole
                raise
            return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # truncated, not a checkpoint, or objects weights_only refuses
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        if "weights_only" in reason or "Unsupported global" in reason:
            reason = "it holds Python objects other than tensors and plain containers"
        raise RecipeError(
            f"--ckpt_path '{path}' is not a readable checkpoint ({reason[:160]}); it may be truncated or "
            "not a Lightning checkpoint: give another .ckpt file"
        ) from None


class RecipeRecord(L.Callback):
    """Stores the parsed recipe in every checkpoint (``checkpoint["rllight_recipe"]``), so that a resume
    can be compared with the run that wrote it."""

    def __init__(self, recipe: dict):
        self.recipe = recipe

    def on_save_checkpoint(self, trainer, pl_module, checkpoint: dict) -> None:
        checkpoint[RECIPE_KEY] = self.recipe


# -------------------------------------------------------------------------------------------- interrupts
class Interrupts(L.Callback):
    """On Ctrl-C (SIGINT) or SIGTERM: finish the current RL step, save a resumable checkpoint, print how
    to resume, stop.

    SIGTERM is Lightning's: its handler sets ``trainer.received_sigterm`` and its training loop raises
    ``SIGTERMException`` right after the step's ``on_train_batch_end``, where this callback saves first.
    SIGINT gets a handler here (while training runs) that only sets a flag, so the step is not cut
    short; a second Ctrl-C quits at once without saving. A signal that arrives during validation is
    acted on at the end of the next training step. With ``trainer.enable_checkpointing: false`` nothing
    is saved: the run stops and says so.

    The checkpoint goes to the ModelCheckpoint's folder (else ``<default_root_dir>/checkpoints``) as
    ``interrupted-step=N.ckpt``, N the RL steps done (never over an existing file).

    A guard that finds the run cannot usefully go on (``rllight.stopping.end_after_step``) ends it the same way,
    after its step: saved as ``stopped-step=N.ckpt``, then ``RunStopped`` (one line, exit code 2) says why and how
    to resume. A crash inside a step (``on_exception``) is saved as ``crashed-step=N.ckpt`` where one process can
    (``_save_after_crash``); every message names a checkpoint that exists, or says there is none.

    Args:
        resume_command: The command line that resumes the run, without ``--ckpt_path``.
    """

    def __init__(self, resume_command: str = "rllight fit --config <recipe>"):
        self.resume_command = resume_command
        self._sigint = False
        self._previous = None
        self._previous_term = None
        self.saved_path: str | None = None

    # signal handling ------------------------------------------------------------------------------
    def _on_sigint(self, signum, frame) -> None:
        if self._sigint:  # the second Ctrl-C: quit now
            signal.signal(signal.SIGINT, signal.default_int_handler)
            raise KeyboardInterrupt
        self._sigint = True
        request_stop("Ctrl-C")
        print("\nrllight: Ctrl-C: saving a checkpoint after this RL step (Ctrl-C again quits without saving)",
              flush=True)

    def on_train_start(self, trainer, pl_module) -> None:
        clear_stop()
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._on_sigint)
            # Lightning's SIGTERM handler (installed before training starts) still runs; this one also lets
            # a wait for an environment or a server see the stop (``wait_stoppable``).
            self._previous_term = signal.getsignal(signal.SIGTERM)
            signal.signal(signal.SIGTERM, self._on_sigterm)

    def _on_sigterm(self, signum, frame) -> None:
        request_stop("SIGTERM")
        if callable(self._previous_term):
            self._previous_term(signum, frame)
        elif self._previous_term != signal.SIG_IGN:  # no handler of Lightning's: end as SIGTERM would
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)

    def _restore(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
            self._previous = None
        if self._previous_term is not None:
            signal.signal(signal.SIGTERM, self._previous_term)
            self._previous_term = None

    def on_train_end(self, trainer, pl_module) -> None:
        self._restore()

    # saving ------------------------------------------------------------------------------------------
    def _target(self, trainer, kind: str = "interrupted") -> str:
        callback = trainer.checkpoint_callback
        folder = getattr(callback, "dirpath", None) or os.path.join(trainer.default_root_dir, "checkpoints")
        stem = f"{kind}-step={rl_steps_done(trainer)}"  # the RL step, as the progress lines count
        path, version = os.path.join(folder, f"{stem}.ckpt"), 0
        while os.path.exists(path):
            version += 1
            path = os.path.join(folder, f"{stem}-v{version}.ckpt")
        return path

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        reason = ending()  # a guard's (rllight.stopping.end_after_step), else a signal's
        stop = trainer.strategy.reduce_boolean_decision(
            self._sigint or trainer.received_sigterm or reason is not None, all=False)
        if not stop:
            return
        what = "SIGTERM" if trainer.received_sigterm else "Ctrl-C"
        done = f"RL step {rl_steps_done(trainer)} ({trainer.global_step} optimizer updates)"
        path = None
        if trainer.checkpoint_callbacks:
            path = trainer.strategy.broadcast(self._target(trainer, "interrupted" if reason is None else "stopped"))
            trainer.save_checkpoint(path, weights_only=False)  # explicit: else Lightning 2.6 logs that it assumed it
            self.saved_path = path
        self._restore()
        if not (self._sigint or trainer.received_sigterm):  # a guard's stop: its reason is the run's error
            kept = (f"{done} is saved: resume with: {self.resume_command} --ckpt_path {shlex.quote(path)}" if path
                    else f"stopped after {done}; nothing saved (trainer.enable_checkpointing: false)")
            raise RunStopped(f"{reason or 'a guard on another rank ended the run (see its log)'}; {kept}")
        if path:
            message = f"rllight: {what}: stopped after {done}; resume with: {self.resume_command} --ckpt_path " \
                      f"{shlex.quote(path)}"
        else:
            message = f"rllight: {what}: stopped after {done}; nothing saved (trainer.enable_checkpointing: false)"
        if trainer.is_global_zero:
            print(message, flush=True)
        if not trainer.received_sigterm:  # SIGTERM: Lightning's loop raises SIGTERMException next
            raise Interrupted(130)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        # What a crash in this step can save: the state as the step began, while it has made no update.
        from rllight.checkpoint import rng_state

        self._step_start = (self._updates(pl_module), rng_state(), rl_steps_done(trainer))

    @staticmethod
    def _updates(pl_module) -> int:
        return getattr(getattr(pl_module, "updater", None), "updates", 0)

    def on_exception(self, trainer, pl_module, exception) -> None:
        self._restore()
        from lightning.pytorch.utilities.exceptions import SIGTERMException

        if not isinstance(exception, (Interrupted, KeyboardInterrupt, SIGTERMException, RunStopped)):
            self._save_after_crash(trainer, pl_module)

    def _save_after_crash(self, trainer, pl_module) -> None:
        """After a crash inside a training step, on one process: save the run where it is and say how to resume.
        Where the failed step had made no update yet that is the last completed step, its batch to be drawn again;
        where it had made some (an out-of-memory in a later minibatch, an engine that died while taking the new
        weights), the updates made are kept and the step counts as done, without its other updates: nothing
        trained is lost, and the message says so. With several processes a failed rank cannot save (the others do
        not join its collectives): the message names the newest checkpoint that exists."""
        start = getattr(self, "_step_start", None)
        if start is None or not trainer.checkpoint_callbacks:
            return  # no training step yet, or checkpoints are off
        failed = f"RL step {start[2] + 1}"
        made = self._updates(pl_module) - start[0]
        if trainer.world_size > 1:  # said once (rank 0), above the line that names the failed rank (rllight.app.launch)
            if trainer.is_global_zero:
                print(f"rllight: the run failed in {failed}; with several processes it cannot be saved: "
                      f"{self._newest_saved(trainer)}", file=sys.stderr, flush=True)
            return
        if start[0] == 0 and made == 0:
            return  # the failed step is this process's first: the run's start (or its checkpoint) is as it was
        from rllight.checkpoint import set_rng_state

        progress = trainer.fit_loop.epoch_loop.batch_progress  # Lightning 2.5, 2.6
        if made == 0:
            set_rng_state(start[1])  # the streams as the failed step began: a resume draws its rollout again
            for count in (progress.total, progress.current):  # the failed batch as not begun
                count.ready = count.started = count.processed = count.completed
            kept = f"RL step {start[2]} is saved"
        else:
            datamodule = trainer.datamodule
            if getattr(datamodule, "batches_trained", None) == start[2]:  # not yet counted (RLModule.training_step)
                datamodule.batches_trained += 1  # the failed batch as done, as a checkpoint after it would count it
            for count in (progress.total, progress.current):  # as saved at the batch's end (Lightning's restart)
                count.processed = count.started
            kept = (f"it had made {made} optimizer update(s), kept: it is saved as done, without its other "
                    "updates")
        path = self._target(trainer, "crashed")
        try:
            trainer.save_checkpoint(path, weights_only=False)
        except Exception as err:  # noqa: BLE001 - the run has failed already; its own error follows
            print(f"rllight: the run failed in {failed} and could not be saved to {path} ({err}): "
                  f"{self._newest_saved(trainer)}", file=sys.stderr, flush=True)
            return
        self.saved_path = path
        print(f"rllight: the run failed in {failed}; {kept}: resume with: {self.resume_command} --ckpt_path "
              f"{shlex.quote(path)}", file=sys.stderr, flush=True)

    def _newest_saved(self, trainer) -> str:
        """How to resume from the newest checkpoint that exists (``newest_checkpoint``), or that there is none."""
        path = newest_checkpoint(trainer)
        if path is None:
            return "no checkpoint of it exists yet; start it again"
        return f"resume from the newest checkpoint with: {self.resume_command} --ckpt_path {shlex.quote(path)}"


def newest_checkpoint(trainer) -> str | None:
    """The newest checkpoint of the run that exists: in its checkpoint folders (files, or the folders of sharded
    checkpoints), or the one it resumed from. None where there is none."""
    folders = {getattr(cb, "dirpath", None) for cb in trainer.checkpoint_callbacks}
    folders = {f for f in folders if f} | {os.path.join(trainer.default_root_dir, "checkpoints")}
    found = [str(trainer.ckpt_path)] if trainer.ckpt_path and os.path.exists(str(trainer.ckpt_path)) else []
    for folder in folders:
        names = os.listdir(folder) if os.path.isdir(folder) else []
        found += [os.path.join(folder, n) for n in names if n.endswith(".ckpt") and (
            os.path.isfile(os.path.join(folder, n)) or os.path.isfile(os.path.join(folder, n, "meta.pt")))]
    return max(found, key=os.path.getmtime) if found else None
