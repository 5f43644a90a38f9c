"""Never lose a user's work: output locations checked before the model loads, a resumable checkpoint on
Ctrl-C or SIGTERM (also where the output's reader went away: ``rllight.stopping.tolerate_closed_output``), and the
recipe stored in every checkpoint and compared on resume.

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

from rllight._compat import log_step_now, rl_steps_done
from rllight.errors import RecipeError, RunStopped
from rllight.paths import existing_ancestor
from rllight.stopping import (Interrupted, clear_stop, ending, exit_code, request_stop, say, say_in_handler,
                              stop_requested)
from rllight.stopping import tolerate_closed_output  # noqa: F401 (the CLI's, importable from here too)

log = logging.getLogger(__name__)


# ------------------------------------------------------------------------------------ output locations
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
_IGNORED = ("ckpt_path", "config", "print_config", "resume_allow_changes", "evaluate_before_again",
            "distributed_timeout_minutes",
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
    SIGINT gets a handler here that, while training runs, only sets a flag, so the step is not cut
    short; a second Ctrl-C quits at once without saving. A signal that arrives during validation is
    acted on at the end of the next training step. With ``trainer.enable_checkpointing: false`` nothing
    is saved: the run stops and says so.

    Where no step is in progress, a signal stops the run at once, with the same exit codes and a line saying what
    is saved: Ctrl-C before training begins (the model loading, a checkpoint restored), Ctrl-C and SIGTERM during an
    evaluation outside training (``evaluate_before_after``, ``rllight validate``). Once the run is over, the handlers
    (which Lightning's teardown may put back) do what those before them did.

    The checkpoint goes to the ModelCheckpoint's folder (else ``<default_root_dir>/checkpoints``) as
    ``interrupted-step=N.ckpt``, N the RL steps done (never over an existing file). A stop that cuts short a wait
    inside a step (for an environment, a server, a worker: ``rllight.stopping.check_stop``) saves the run as that
    step began, as a crash does (``_save_unfinished``).

    A guard that finds the run cannot usefully go on (``rllight.stopping.end_after_step``) ends it the same way,
    after its step: saved as ``stopped-step=N.ckpt``, then ``RunStopped`` (one line, exit code 2) says why and how
    to resume. A crash inside a step (``on_exception``) is saved as ``crashed-step=N.ckpt`` where one process can
    (``_save_unfinished``); every message names a checkpoint that exists, or says there is none.

    The line that names the checkpoint comes after the save, and no write (``| tee`` ended by the same Ctrl-C, a
    signal handler's inside the interrupted code's own) can end the stop: ``rllight.stopping.say`` and
    ``say_in_handler``.

    Args:
        resume_command: The command line that resumes the run, without ``--ckpt_path``.
    """

    def __init__(self, resume_command: str = "rllight fit --config <recipe>"):
        self.resume_command = resume_command
        self._phase: str | None = None  # "starting" (a fit, before training), "training", "evaluating"; None: done
        self._sigint = False
        self._stopped_now: str | None = None  # "Ctrl-C" or "SIGTERM" where a signal stopped the run at once
        self._in_step = False
        self._before: dict = {}  # {signal: the handler ours replaced}: put back after the run, and what ours does then
        self.saved_path: str | None = None

    # signal handling ------------------------------------------------------------------------------
    def _install(self, signum: int, handler) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        current = signal.getsignal(signum)
        if current != handler:
            self._before[signum] = signal.SIG_DFL if current is None else current
            signal.signal(signum, handler)

    def _restore(self) -> None:
        """Put back the handlers ours replaced, where ours are installed (also where Lightning's teardown put them
        back: it restores the handlers it found as the trainer started)."""
        if threading.current_thread() is threading.main_thread():
            for signum, handler in ((signal.SIGINT, self._on_sigint), (signal.SIGTERM, self._on_sigterm)):
                if signum in self._before and signal.getsignal(signum) == handler:
                    signal.signal(signum, self._before[signum])

    def _as_before(self, signum, frame) -> None:
        """A signal once this callback's run is over (Lightning's teardown puts back the handlers it found, ours
        among them): what the handler before ours does."""
        previous = self._before.get(signum, signal.SIG_DFL)
        if callable(previous):
            previous(signum, frame)
        elif previous == signal.SIG_DFL and signum == signal.SIGINT:
            raise KeyboardInterrupt
        elif previous == signal.SIG_DFL:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)

    def _stop_now(self, what: str) -> None:
        self._stopped_now = what
        request_stop(what)
        raise Interrupted(exit_code(what))

    def _on_sigint(self, signum, frame) -> None:
        if self._phase is None:
            return self._as_before(signum, frame)
        if self._phase != "training":
            self._stop_now("Ctrl-C")
        if self._sigint:  # the second Ctrl-C: quit now
            signal.signal(signal.SIGINT, signal.default_int_handler)
            raise KeyboardInterrupt
        self._sigint = True
        request_stop("Ctrl-C")
        say_in_handler("\nrllight: Ctrl-C: saving a checkpoint after this RL step (Ctrl-C again quits without saving)")

    def _on_sigterm(self, signum, frame) -> None:
        if self._phase is None:
            return self._as_before(signum, frame)
        if self._phase != "training":
            self._stop_now("SIGTERM")
        request_stop("SIGTERM")  # also lets a wait for an environment or a server see it (``wait_stoppable``)
        self._as_before(signum, frame)  # Lightning's, which sets trainer.received_sigterm

    def setup(self, trainer, pl_module, stage: str) -> None:
        self._phase = "starting" if stage == "fit" else "evaluating"
        self._sigint, self._stopped_now, self._in_step = False, None, False
        self._install(signal.SIGINT, self._on_sigint)
        if stage != "fit":  # in a fit, Lightning's SIGTERM handler (installed after setup) acts until training starts
            self._install(signal.SIGTERM, self._on_sigterm)

    def on_train_start(self, trainer, pl_module) -> None:
        clear_stop()
        self._install(signal.SIGINT, self._on_sigint)
        # Lightning's SIGTERM handler (installed before training starts) still runs; this one also lets
        # a wait for an environment or a server see the stop (``wait_stoppable``).
        self._install(signal.SIGTERM, self._on_sigterm)
        self._phase = "training"

    def on_train_end(self, trainer, pl_module) -> None:
        self._phase = None
        self._restore()

    def teardown(self, trainer, pl_module, stage: str) -> None:
        self._phase = None
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
        self._in_step = False
        reason = ending()  # a guard's (rllight.stopping.end_after_step), else a signal's
        stop = trainer.strategy.reduce_boolean_decision(
            self._sigint or trainer.received_sigterm or reason is not None, all=False)
        if not stop:
            return
        if not trainer.received_sigterm:  # this hook raises, before the loop would log the step
            log_step_now(trainer)
        what = "SIGTERM" if trainer.received_sigterm else "Ctrl-C"
        done = f"RL step {rl_steps_done(trainer)} ({trainer.global_step} optimizer updates)"
        path = None
        if trainer.checkpoint_callbacks:
            path = trainer.strategy.broadcast(self._target(trainer, "interrupted" if reason is None else "stopped"))
            trainer.save_checkpoint(path, weights_only=False)  # explicit: else Lightning 2.6 logs that it assumed it
            self.saved_path = path
        self._phase = None
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
            say(message)
        if not trainer.received_sigterm:  # SIGTERM: Lightning's loop raises SIGTERMException next
            raise Interrupted(130)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        # What a crash in this step can save: the state as the step began, while it has made no update.
        from rllight.checkpoint import rng_state

        self._step_start = (self._updates(pl_module), rng_state(), rl_steps_done(trainer))
        self._in_step = True

    @staticmethod
    def _updates(pl_module) -> int:
        return getattr(getattr(pl_module, "updater", None), "updates", 0)

    def on_exception(self, trainer, pl_module, exception) -> None:
        phase, self._phase = self._phase, None
        self._restore()
        from lightning.pytorch.utilities.exceptions import SIGTERMException

        if self._stopped_now is not None:  # a signal where no step was in progress
            self._say_stopped_now(trainer, phase)
        elif isinstance(exception, Interrupted) and exception.waiting_for is not None:  # a wait cut short
            self._save_cut_short(trainer, pl_module)
        elif not isinstance(exception, (Interrupted, KeyboardInterrupt, SIGTERMException, RunStopped)):
            self._save_unfinished(trainer, pl_module, "crashed", "the run failed in {step}", sys.stderr)

    def _say_stopped_now(self, trainer, phase: str | None) -> None:
        if not trainer.is_global_zero:
            return
        what = self._stopped_now
        if phase == "starting":
            say(f"rllight: {what}: stopped before training began; {self._as_it_began(trainer)}")
            return
        newest = newest_checkpoint(trainer)
        say(f"rllight: {what}: stopped during the evaluation" + (f"; the run's newest checkpoint is {newest}"
                                                                  if newest else ""))

    def _as_it_began(self, trainer) -> str:
        """What a stop before this process trained leaves: the checkpoint it resumed from, or nothing."""
        ckpt = trainer.ckpt_path
        if not ckpt:
            return "nothing was trained"
        return f"the run is as {ckpt} left it: resume with: {self.resume_command} --ckpt_path {shlex.quote(str(ckpt))}"

    def _save_cut_short(self, trainer, pl_module) -> None:
        """A stop that gave up a wait (``rllight.stopping.check_stop``, which named it): inside a training step, the
        run as that step began (``_save_unfinished``); elsewhere (an evaluation during training), nothing."""
        stop = stop_requested()
        what = stop[0] if stop else "Ctrl-C"
        if not trainer.checkpoint_callbacks:
            say(f"rllight: {what}: nothing saved (trainer.enable_checkpointing: false)")
        elif not self._in_step:
            say(f"rllight: {what}: stopped outside a training step; {self._newest_saved(trainer)}")
        elif not self._save_unfinished(trainer, pl_module, "interrupted", f"{what}: stopped in {{step}}", sys.stdout):
            say(f"rllight: {what}: stopped in RL step {self._step_start[2] + 1}, this process's first: "
                f"{self._as_it_began(trainer)}")  # no update made: nothing to save

    def _save_unfinished(self, trainer, pl_module, kind: str, event: str, file) -> bool:
        """After a crash or a stop inside a training step, on one process: save the run where it is as
        ``<kind>-step=N.ckpt`` and say how to resume, in a line that begins with ``event`` (``{step}``: the step).
        Where the step had made no update yet that is the last completed step, its batch to be drawn again;
        where it had made some (an out-of-memory in a later minibatch, an engine that died while taking the new
        weights), the updates made are kept and the step counts as done, without its other updates: nothing
        trained is lost, and the message says so. With several processes a rank cannot save (the others do not join
        its collectives): the message names the newest checkpoint that exists. False where there was nothing to
        save (no step yet, checkpoints off, or the step was this process's first and made no update)."""
        start = getattr(self, "_step_start", None)
        if start is None or not trainer.checkpoint_callbacks:
            return False  # no training step yet, or checkpoints are off
        failed = event.format(step=f"RL step {start[2] + 1}")
        made = self._updates(pl_module) - start[0]
        if trainer.world_size > 1:  # said once (rank 0), above the line that names the failed rank (rllight.app.launch)
            if trainer.is_global_zero:
                say(f"rllight: {failed}; with several processes it cannot be saved: {self._newest_saved(trainer)}",
                    file)
            return True
        if start[0] == 0 and made == 0:
            return False  # the step is this process's first: the run's start (or its checkpoint) is as it was
        from rllight.checkpoint import set_rng_state

        progress = trainer.fit_loop.epoch_loop.batch_progress  # Lightning 2.5, 2.6
        if made == 0:
            set_rng_state(start[1])  # the streams as the step began: a resume draws its rollout again
            for count in (progress.total, progress.current):  # the batch as not begun
                count.ready = count.started = count.processed = count.completed
            kept = f"RL step {start[2]} is saved"
        else:
            datamodule = trainer.datamodule
            if getattr(datamodule, "batches_trained", None) == start[2]:  # not yet counted (RLModule.training_step)
                datamodule.batches_trained += 1  # the batch as done, as a checkpoint after it would count it
            for count in (progress.total, progress.current):  # as saved at the batch's end (Lightning's restart)
                count.processed = count.started
            kept = (f"it had made {made} optimizer update(s), kept: it is saved as done, without its other "
                    "updates")
        path = self._target(trainer, kind)
        try:
            trainer.save_checkpoint(path, weights_only=False)
        except Exception as err:  # noqa: BLE001 - the run has failed or stopped already; its own line follows
            say(f"rllight: {failed} and could not be saved to {path} ({err}): {self._newest_saved(trainer)}", file)
            return True
        self.saved_path = path
        say(f"rllight: {failed}; {kept}: resume with: {self.resume_command} --ckpt_path {shlex.quote(path)}", file)
        return True

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
