"""The ``rllight`` command: ``rllight fit --config recipes/<name>.yaml``."""

from __future__ import annotations

import json
import logging
import os
import shlex
import signal
import sys

from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.cli import LightningCLI

from rllight._compat import RunCheckpoint, resolve_last_checkpoint
from rllight.bounds import PositiveFloat
from rllight.checkpoint import AtomicCheckpointIO, CheckpointSettings, disk_size, human_size
from rllight.app.command_line import (FIT_DESCRIPTION, NOT_OFFERED, SPECIAL_CKPT, TRAINING_ONLY, RecipeParser,
                                      check_class_paths, ckpt_path_given, one_line_parse_error, relocate,
                                      without_options)
from rllight.app.recipe_files import check_config_files
from rllight.data import RLDataModule
from rllight.errors import ComponentError, RecipeError
from rllight.evaluation import column_notes, evaluation_table
from rllight.export import check_export_dir, overlaps
from rllight.app.hardware import check_hardware
from rllight.app.launch import TIMEOUT_MINUTES, launch_settings, prepare, rank_failures
from rllight.module import RLModule
from rllight.paths import add_user_import_paths, expand_config_paths, expand_path, model_path_args
from rllight.precision import bound_onednn_cache, check_float32_lm_head, resolve_config
from rllight.app.before_after import BeforeTraining, compare_before_after, evaluate_before
from rllight.app.progress import progress_callbacks, quiet_lightning
from rllight.safety import (RECIPE_KEY, Interrupts, RecipeRecord, check_resume, check_writable, read_checkpoint,
                            tolerate_closed_output)
from rllight.app.usage import DESCRIPTION, top_help

log = logging.getLogger("rllight")


class RLLightCLI(LightningCLI):
    """LightningCLI for RLModule and RLDataModule.

    Defaults it sets on the trainer (a recipe can override each): ``log_every_n_steps: 1`` (one RL
    step per batch is already coarse), ``num_sanity_val_steps: 0`` (evaluation runs whole, see below),
    ``inference_mode: false`` (validation under ``no_grad``; see ``__init__``).
    No ``link_arguments``: every value lives in exactly one place of the recipe.

    Callbacks it adds to every run: ``rllight.safety.Interrupts`` (Ctrl-C / SIGTERM save a resumable
    checkpoint), ``rllight.safety.RecipeRecord`` (the recipe stored in each checkpoint) and, unless the
    recipe configures a ``ModelCheckpoint`` or sets ``trainer.enable_checkpointing: false``, a
    ``rllight._compat.RunCheckpoint`` set by the top-level ``checkpoint`` options
    (``rllight.checkpoint.CheckpointSettings``: ``last.ckpt`` every 10 RL steps and at the end). What a run prints
    (``rllight.app.progress.progress_callbacks``): a line per RL step and evaluation progress in a log file, a bar that
    counts rollouts in a terminal, the model summary without FLOPs; messages a recipe cannot act on are filtered
    (``rllight.app.progress.quiet_lightning``).

    Before the model loads (``before_fit``): every output location (``model.export_dir``,
    ``trainer.default_root_dir``, checkpoint and log folders) must be writable, the export folder must be new,
    empty or an earlier rllight export, and a ``--ckpt_path`` must be a readable checkpoint whose stored recipe
    agrees with this one (``rllight.safety.check_resume``).

    Extra top-level options:
        ``evaluate_before_after``: run the validation loop before ``fit`` and again after it, print a
        table of both (accuracy, avg@k / pass@k / maj@k with standard errors, length, turns) and write it
        to ``<log_dir>/eval_summary.json``. A resume compares with the evaluation its checkpoint keeps
        (``rllight.app.before_after``) unless ``evaluate_before_again``.
        ``resume_allow_changes``: resume although the data batch size, the sampler or its group size changed.
        ``checkpoint``: how often rllight's own checkpoints are saved, how many are kept, and whether the last
        one holds the weights only (``rllight.checkpoint.CheckpointSettings``).

    A fit that ends normally prints where its export and checkpoint are and the commands that evaluate them and
    resume (``after_fit``). ``rllight validate`` prints the compact table of ``rllight.evaluation.evaluation_table``
    (a column per data source, a line on what each row measures) and saves it as ``validate_summary.json`` in the
    log folder, in place of Lightning's table of every logged key (``validate``).
    """

    def __init__(self, *args, **kwargs):
        argv = kwargs.get("args", args[0] if args else None)
        self._argv = list(sys.argv[1:] if argv is None else argv) if not isinstance(argv, dict) else []
        check_config_files(self._argv)
        # --model.path DIR stands for the two options that name an HFModel folder (rllight.paths). From the
        # command line, sys.argv itself is rewritten: LightningCLI reads it, and so do the processes it
        # launches for several devices.
        rewritten = model_path_args(self._argv)
        if rewritten != self._argv:
            if argv is None:
                sys.argv[1:] = rewritten
            else:
                kwargs["args"] = rewritten
        quiet_lightning()
        # A --ckpt_path is read here, before LightningCLI loads it for its hyper-parameters (which would fail
        # with a traceback on a bad file); only the stored recipe is kept, for the comparison in before_fit.
        ckpt = ckpt_path_given(self._argv)
        ckpt = expand_path(ckpt, "--ckpt_path") if ckpt and ckpt not in SPECIAL_CKPT else None
        self._saved_recipe = read_checkpoint(ckpt).get(RECIPE_KEY) if ckpt else None
        kwargs.setdefault("save_config_kwargs", {"overwrite": True})
        # inference_mode off: validation runs under no_grad instead, because a validation before fit
        # under inference mode would leave the metrics' state as inference tensors that the in-fit
        # validation then cannot update.
        kwargs.setdefault("trainer_defaults", {"log_every_n_steps": 1, "num_sanity_val_steps": 0,
                                               "inference_mode": False})
        kwargs.setdefault("auto_configure_optimizers", False)
        # A recipe without seed_everything (rllight validate or generate with --model.path alone) is seeded 0, as
        # Lightning would, without its warning that names its own file ("No seed found, seed set to 0").
        kwargs.setdefault("seed_everything_default", 0)
        kwargs.setdefault("parser_class", RecipeParser)  # trainer.precision: auto (rllight.precision)
        # A misspelt option must fail, not match a longer one by prefix; errors raise so that main()
        # can print them on one line.
        kwargs.setdefault("parser_kwargs", {"allow_abbrev": False, "exit_on_error": False,
                                            "description": DESCRIPTION, "fit": {"description": FIT_DESCRIPTION}})
        try:
            super().__init__(RLModule, RLDataModule, *args, **kwargs)
        except ValueError as err:  # a class's RecipeError names its key from where it sits in this recipe
            relocate(_recipe_cause(err), self._recipe() if hasattr(self, "subcommand") else None)  # past the parse
            raise

    @staticmethod
    def subcommands() -> dict[str, set[str]]:
        """``fit`` and ``validate``: the module has no test or predict step (``rllight validate
        --data.val_files`` evaluates other data; ``rllight generate --prompts FILE`` writes generations)."""
        return {k: v for k, v in LightningCLI.subcommands().items() if k in ("fit", "validate")}

    def parse_arguments(self, parser, args) -> None:
        super().parse_arguments(parser, args)
        # The hardware the run asks for, before the seed, the model and vLLM (rllight.app.hardware); not for generate
        # and chat (run=False), which pick their own device.
        if self.config.get("subcommand"):
            check_hardware(self.config[self.config.subcommand], self._argv)

    def before_instantiate_classes(self) -> None:
        # Paths in the recipe expand ~ and $VARIABLES (rllight.paths), before anything reads them.
        config = self.config[self.subcommand] if self.subcommand else self.config
        check_class_paths(self._recipe())  # nothing of the standard library is constructed (docs/guides/security.md)
        expand_config_paths(config)
        if config.get("smoke"):  # recipes/overlays/smoke.yaml (rllight.app.smoke_mode)
            from rllight.app.smoke_mode import apply_smoke

            apply_smoke(config)
        # The engine's dtype: auto where it came from the engine's default (the parser resolved the written ones).
        resolve_config(config)
        check_float32_lm_head(config)

    def add_arguments_to_parser(self, parser) -> None:
        parser.add_argument("--evaluate_before_after", type=bool, default=False,
                            help="Validate before and after fit and report both accuracies.")
        parser.add_argument("--evaluate_before_again", type=bool, default=False,
                            help="With evaluate_before_after and --ckpt_path: evaluate the untrained model again "
                                 "rather than compare with the evaluation before training that the checkpoint keeps "
                                 "(which is reused where its model, engine, reward, model.evaluation and held-out "
                                 "prompts are this recipe's).")
        parser.add_argument("--resume_allow_changes", type=bool, default=False,
                            help="With --ckpt_path: continue although data.batch_size, the sampler or its "
                                 "group_size differ from the checkpoint's recipe.")
        parser.add_argument("--smoke", type=bool, default=False,
                            help="Smoke test: every model source of the recipe (model.model, a critic's own model) "
                                 "becomes the tiny rllight.testing.TinyModel; recipes/overlays/smoke.yaml sets it with "
                                 "a few-step CPU budget.")
        parser.add_class_arguments(CheckpointSettings, "checkpoint")
        parser.add_argument("--distributed_timeout_minutes", type=PositiveFloat, default=TIMEOUT_MINUTES,
                            help="How long the processes of a run wait for the slowest one (at a collective, and "
                                 "at the start) before the run fails (rllight.app.launch.TIMEOUT_MINUTES: why this "
                                 "value).")
        if isinstance(parser, RecipeParser):
            parser.allow_auto_precision()

    def _recipe(self) -> dict:
        """The parsed recipe as plain values (what checkpoints store)."""
        config = self.config.get(str(self.subcommand), self.config) if self.subcommand else self.config
        plain = config.clone().as_dict()
        return json.loads(json.dumps(plain, default=str))

    def _resume_command(self) -> str:
        """This command line without ``--ckpt_path``: what to run (with a new one) to resume."""
        out, skip = [], False
        for arg in self._argv:
            if skip:
                skip = False
                continue
            if arg == "--ckpt_path":
                skip = True
                continue
            if not arg.startswith("--ckpt_path="):
                out.append(arg)
        return "rllight " + shlex.join(out)

    def instantiate_trainer(self, **kwargs):
        config = self.config_init.get(str(self.subcommand), self.config_init) if self.subcommand else self.config_init
        trainer_config = config.get("trainer", {}) or {}
        callbacks = trainer_config.get("callbacks") or []
        callbacks = list(callbacks) if isinstance(callbacks, list) else [callbacks]
        shown, settings = progress_callbacks(trainer_config, callbacks)  # a line per step in a log file, or a bar
        callbacks += shown  # before Interrupts: a step's line comes before the message that the run stops there
        kwargs.update(settings)
        callbacks += [Interrupts(self._resume_command()), RecipeRecord(self._recipe()), BeforeTraining()]
        saving = config.get("checkpoint") or CheckpointSettings()
        if trainer_config.get("enable_checkpointing") is not False and not any(
            isinstance(cb, ModelCheckpoint) for cb in callbacks
        ):
            callbacks.append(RunCheckpoint(saving.every_n_steps, saving.keep, saving.final_weights_only))
        elif not saving.is_default():
            log.warning("the checkpoint.* options set rllight's own checkpoints, which this recipe replaces (its own "
                        "ModelCheckpoint, or trainer.enable_checkpointing: false): they have no effect")
        if not trainer_config.get("plugins"):  # checkpoints written whole or not at all
            kwargs["plugins"] = [AtomicCheckpointIO()]
        if self.subcommand == "validate":
            # A validation of a run (the command a fit prints reuses its recipe, so its default_root_dir) keeps its
            # logs, evaluation files and saved recipe in a folder of its own: in the run's folder a new log version
            # starting at step 0 would read as a fresh run (tools/plot.py), and without a logger its files would
            # replace the run's own (config.yaml, evaluation/val_step<N>.json).
            kwargs["default_root_dir"] = os.path.join(trainer_config.get("default_root_dir") or os.getcwd(), "validate")
        with launch_settings(trainer_config.get("num_nodes") or 1):  # checked, in one line each (rllight.app.launch)
            trainer = super().instantiate_trainer(**{**kwargs, "callbacks": callbacks})
        prepare(trainer, config.get("distributed_timeout_minutes", TIMEOUT_MINUTES))
        return trainer

    def _check_outputs(self) -> None:
        """Every place the run writes to, checked before the model loads (one line naming the key)."""
        trainer = self.trainer
        config = self.config.fit
        root = config.trainer.default_root_dir
        check_writable(trainer.default_root_dir, "trainer.default_root_dir")
        for cb in trainer.checkpoint_callbacks:
            if getattr(cb, "dirpath", None):
                check_writable(cb.dirpath, "trainer.callbacks (ModelCheckpoint dirpath)")
        for logger in trainer.loggers:
            save_dir = getattr(logger, "save_dir", None) or getattr(logger, "root_dir", None)
            if save_dir:
                check_writable(save_dir, "trainer.logger (save_dir)")
        if not trainer.loggers:  # logs and checkpoints go straight into default_root_dir: nothing to overwrite
            folder = os.path.join(trainer.default_root_dir, "checkpoints")
            resumed = config.ckpt_path == "last" or (
                config.ckpt_path and os.path.dirname(os.path.abspath(config.ckpt_path)) == os.path.abspath(folder))
            default = [cb for cb in trainer.checkpoint_callbacks if getattr(cb, "dirpath", None) is None]
            if default and os.path.exists(os.path.join(folder, "last.ckpt")) and not resumed:
                raise RecipeError(
                    f"trainer.default_root_dir: '{folder}' already holds last.ckpt from an earlier run; resume it "
                    f"with --ckpt_path {os.path.join(folder, 'last.ckpt')}, or give another default_root_dir"
                )
            written = os.path.join(trainer.default_root_dir, "config.yaml")
            if self.save_config_callback and os.path.isfile(written):
                with open(written) as f:
                    if not f.readline().startswith("# lightning.pytorch=="):
                        raise RecipeError(
                            f"trainer.default_root_dir: '{written}' exists and was not written by a run; the run "
                            "saves its recipe there: give another default_root_dir (or a logger)"
                        )
        export_dir = self.model.export_dir
        if export_dir:
            check_export_dir(export_dir)
            check_writable(os.path.dirname(os.path.abspath(export_dir)), "model.export_dir")
            outputs = [trainer.default_root_dir if root is not None else None]
            outputs += [getattr(cb, "dirpath", None) for cb in trainer.checkpoint_callbacks]
            outputs += [getattr(lg, "save_dir", None) for lg in trainer.loggers]
            for other in filter(None, outputs):
                if overlaps(export_dir, other):
                    raise RecipeError(
                        f"model.export_dir: '{export_dir}' would hold the run's logs and checkpoints ('{other}'), "
                        "and an export replaces its folder; give a folder of its own (e.g. <default_root_dir>/model)"
                    )

    def _check_resume(self) -> None:
        ckpt_path = self.config.fit.ckpt_path
        if ckpt_path == "last":  # resumed from the file found, which Lightning's "last" may not find itself
            found = resolve_last_checkpoint(self.trainer)
            if found is None:
                raise RecipeError(f"--ckpt_path last: no last.ckpt of an earlier run where this run keeps its "
                                  f"checkpoints (under '{self.trainer.default_root_dir}'); give the checkpoint's "
                                  "path, or leave --ckpt_path out to start afresh")
            self.config.fit.ckpt_path = self.config_init.fit.ckpt_path = ckpt_path = found  # named when restored
        if not ckpt_path or ckpt_path in SPECIAL_CKPT:
            return
        saved = self._saved_recipe
        if ckpt_path_given(self._argv) != str(ckpt_path):  # given in a config file, not on the command line
            saved = read_checkpoint(str(ckpt_path)).get(RECIPE_KEY)
        for line in check_resume(saved, self._recipe(), str(ckpt_path),
                                 allow_changes=self.config.fit.resume_allow_changes):
            log.warning(line)
        self._check_resumable(str(ckpt_path))

    def _check_resumable(self, path: str) -> None:
        """A checkpoint file without the optimizer's state (saved with the weights only) is refused in one line."""
        if os.path.isfile(path) and "optimizer_states" not in read_checkpoint(path):
            raise RecipeError(f"--ckpt_path '{path}' holds the weights only, not the optimizer's state "
                              f"(checkpoint.final_weights_only): it cannot resume training; evaluate it with: "
                              f"{self._command('validate', '--ckpt_path', path)}")

    def _no_validation(self) -> str | None:
        """Why ``evaluate_before_after`` has nothing to evaluate (validation is off), or None."""
        return "trainer.limit_val_batches is 0" if not self.trainer.limit_val_batches else None

    def before_fit(self) -> None:
        self._check_outputs()
        self._check_resume()
        for callback in self.trainer.callbacks:  # e.g. a teacher's folder and tokenizer: before any model loads
            if hasattr(callback, "check_before_fit"):
                callback.check_before_fit(self.model)
        evaluate = self.config.fit.evaluate_before_after and self._no_validation() is None
        if evaluate and isinstance(self.datamodule, RLDataModule):  # not after an evaluation's minutes
            self.datamodule.setup("fit")
            self.model.preflight_rewards(self.datamodule.train_rows)
        if evaluate:  # a resume's is the checkpoint's, where it measured what this recipe would
            evaluate_before(self.trainer, self.model, self.datamodule, self._recipe(), self.config.fit.ckpt_path,
                            again=self.config.fit.evaluate_before_again)

    def after_fit(self) -> None:
        if self.config.fit.evaluate_before_after:
            compare_before_after(self.trainer, self.model, self.datamodule, self._no_validation())
        if self.trainer.is_global_zero:
            for line in self._outputs():
                print(line, flush=True)

    def _command(self, subcommand: str, *extra: str) -> str:
        """This command line as ``rllight <subcommand>``, without ``--ckpt_path``, then ``extra``; a ``validate`` also
        without the options that act on a fit alone (``TRAINING_ONLY``)."""
        words = shlex.split(self._resume_command())[1:]
        if self.subcommand in words:
            words[words.index(self.subcommand)] = subcommand
        if subcommand == "validate":
            words = without_options(words, TRAINING_ONLY)
        return "rllight " + shlex.join([*without_options(words, extra), *extra])

    def _outputs(self) -> list[str]:
        """What a fit that ended normally leaves (the export, the last checkpoint, their sizes) and the commands
        that evaluate each and resume the run."""
        rollouts = getattr(self.datamodule, "batches_trained", None)  # the steps the per-step lines count
        done = f"{rollouts} RL step{'' if rollouts == 1 else 's'}, " if rollouts is not None else ""
        lines = [f"rllight: finished: {done}{self.trainer.global_step} optimizer updates (trainer.max_steps counts "
                 "updates)."]
        export = self.model.export_dir
        if export and os.path.isdir(export):
            lines.append(f"  model: {export} (Hugging Face folder, {human_size(disk_size(export))})")
            lines.append(f"    evaluate: {self._command('validate', '--model.path', export)}")
        saved = [(cb, cb.last_model_path or cb.best_model_path) for cb in self.trainer.checkpoint_callbacks]
        saved = [(cb, path) for cb, path in saved if path and os.path.exists(path)]
        if not saved:
            lines.append("  checkpoint: none (trainer.enable_checkpointing: false, or none was saved)")
            return lines
        callback, path = saved[0]
        weights_only = getattr(callback, "final_weights_only", False) or callback.save_weights_only
        what = "the weights only" if weights_only else "the weights and the optimizer's state"
        lines.append(f"  checkpoint: {path} ({human_size(disk_size(path))}, {what})")
        lines.append(f"    evaluate: {self._command('validate', '--ckpt_path', path)}")
        if weights_only:
            lines.append("    (weights only: it cannot resume training; checkpoint.final_weights_only)")
        else:
            steps = self.trainer.max_steps
            more = ["--trainer.max_steps", str(2 * self.trainer.global_step)] if steps and steps > 0 else []
            lines.append(f"    train further: {self._command('fit', '--ckpt_path', path, *more)}")
        return lines

    def validate(self, model, datamodule=None, **kwargs):
        """``rllight validate``: Lightning's validation, reported as rllight's compact table (printed, and saved as
        ``validate_summary.json`` in the log folder) in place of Lightning's table of every logged key."""
        results = self.trainer.validate(model, datamodule=datamodule, **{**kwargs, "verbose": False})
        folder = self.trainer.log_dir or self.trainer.default_root_dir  # every rank: a collective under DDP
        if self.trainer.is_global_zero:  # the evaluation's own numbers, as in rllight.app.before_after.evaluate
            metrics = {**results[0], **model.evaluator.last_metrics} if results else {}
            self._report(metrics, folder, "validate_summary.json", kwargs.get("ckpt_path"))
        return results

    def _report(self, metrics: dict[str, float], folder: str, name: str, ckpt_path: str | None) -> None:
        """Print one evaluation's table and what its rows measure, and save the table as ``name`` in the log
        ``folder``."""
        settings = self.model.evaluation
        table, lines = evaluation_table(metrics)
        if not table:
            print(f"rllight: {self.subcommand}: nothing was evaluated ({self._no_validation() or 'no prompts'}); "
                  "set trainer.limit_val_batches above 0 and data.val_size above 0", flush=True)
            return
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, name)
        with open(path, "w") as f:
            json.dump({"settings": vars(settings), "ckpt_path": ckpt_path, "table": table}, f, indent=2)
        dropped = int(metrics.get("val/dropped_prompts", 0))
        print(f"rllight: evaluation of {table['all']['prompts']:.0f} prompts"
              f"{f' ({dropped} more too long to ask)' if dropped else ''}, {settings.describe()} "
              "(value ± standard error over prompts):", flush=True)
        for line in lines + column_notes(list(table["all"]), settings):
            print("  " + line, flush=True)
        print(f"rllight: saved to {path}", flush=True)


def main(args: list[str] | None = None) -> None:
    """Entry point of the ``rllight`` console script (and of ``python -m rllight``)."""
    argv = list(sys.argv[1:] if args is None else args)
    if argv[:1] in (["--version"], ["-V"]):
        from rllight.app.versions import version

        print(version())
        return
    if argv in (["--help"], ["-h"]):
        print(top_help())
        sys.exit(0)
    bound_onednn_cache()
    # A closed pipe on stdout (| tee, ended by the same Ctrl-C) never ends a run. Kept to the process's end (the
    # final flush of a broken stdout would turn the exit code into 120); a call from Python (args given) gets its
    # streams back.
    streams = sys.stdout, sys.stderr
    tolerate_closed_output()
    # A module of the user's own next to the recipe or in the working directory is importable by class_path.
    add_user_import_paths(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        _run_command(argv, args)
    finally:
        if args is not None:
            sys.stdout, sys.stderr = streams


def _recipe_cause(err: BaseException) -> RecipeError | ComponentError | None:
    """The ``RecipeError`` or ``ComponentError`` that ``err`` was raised from, if any (its causes, in turn)."""
    seen = set()
    while err is not None and id(err) not in seen:
        if isinstance(err, (RecipeError, ComponentError)):
            return err
        seen.add(id(err))
        err = err.__cause__ or err.__context__
    return None


def _run_command(argv: list[str], args: list[str] | None) -> None:
    """The command ``argv`` names; a user's mistake or a component's failure is one line and exit code 2."""
    from jsonargparse import ArgumentError
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    try:
        if argv[:1] and argv[0] in NOT_OFFERED:
            raise RecipeError(NOT_OFFERED[argv[0]])
        if argv[:1] in (["generate"], ["chat"]):
            from rllight.app.generate import run

            run(argv[0], argv[1:], lambda recipe: RLLightCLI(args=recipe, run=False))
        else:
            with rank_failures():  # several processes: a failing rank stops all, in one line (rllight.app.launch)
                RLLightCLI(args=args)
    except ArgumentError as err:
        print(f"rllight: error: {one_line_parse_error(str(err))}", file=sys.stderr)
        sys.exit(2)
    except (RecipeError, ComponentError) as err:
        print(f"rllight: error: {err}", file=sys.stderr)
        sys.exit(2)
    except ValueError as err:
        # A component typed ``X | None`` (model.environment, model.kl, ...) whose constructor refused its settings:
        # jsonargparse wraps the one line in a ValueError listing every alternative of the union.
        cause = _recipe_cause(err)
        if cause is None:
            raise
        print(f"rllight: error: {cause}", file=sys.stderr)
        sys.exit(2)
    except SIGTERMException:  # saved by rllight.safety.Interrupts; exit as a terminated process does
        sys.exit(128 + signal.SIGTERM)


if __name__ == "__main__":
    main()
