"""The ``rllight`` command line around its parse: the parser (``trainer.precision: auto`` resolved while parsing),
the help texts of ``fit`` and of the commands not offered, what is read from the arguments before the parse (every
``--config`` file checked, the ``--ckpt_path`` given) and jsonargparse's errors condensed into one line.
``rllight.app.cli`` runs the command."""

from __future__ import annotations

import os
import re
from typing import Literal, Union

from lightning.pytorch.cli import LightningArgumentParser

from rllight.bounds import bound_of
from rllight.errors import RecipeError
from rllight.precision import resolve_config


FIT_DESCRIPTION = (
    "Train with a recipe: rllight fit --config recipes/grpo.yaml [--config overlay.yaml] [--key value ...]. "
    "Rollout callbacks go in trainer.callbacks (class_path + init_args): rllight.callbacks.OverlongFilter, "
    "rllight.callbacks.SoftOverlongPunishment, rllight.callbacks.SelfImitation, "
    "rllight.callbacks.ValuePretraining (see recipes/dapo.yaml and recipes/vapo.yaml). "
    "A checkpoint (last.ckpt) is saved every 10 RL steps (rollouts) and at the end (--checkpoint.every_n_steps; "
    "--checkpoint.keep N "
    "keeps the newest N; --checkpoint.final_weights_only true saves the last without the optimizer state) unless "
    "the recipe configures a ModelCheckpoint or sets trainer.enable_checkpointing: false; "
    "Ctrl-C or SIGTERM saves one after the current step and prints the "
    "command that resumes (--ckpt_path FILE)."
)


class RecipeParser(LightningArgumentParser):
    """Lightning's parser, with ``trainer.precision: auto`` and the engine's ``dtype: auto`` resolved as part of
    parsing, before ``--print_config`` prints (jsonargparse prints inside ``_parse_common``, the one step every
    parse goes through: ``tests/test_precision.py`` checks the printed value, so a jsonargparse that renames
    it fails there)."""

    def _parse_common(self, cfg, env, defaults, skip_validation, *args, **kwargs):
        # The whole command line's parse, not that of one --config file inside it (defaults off, no validation):
        # a later --trainer.precision must still win over a file's auto.
        if defaults and not skip_validation:
            for prefix in ("", "fit.", "validate."):
                if cfg.get(prefix + "trainer") is not None:
                    resolve_config(cfg.get(prefix[:-1]) if prefix else cfg)
        return super()._parse_common(cfg, env, defaults, skip_validation, *args, **kwargs)

    def allow_auto_precision(self) -> None:
        """Let ``trainer.precision`` take ``auto`` (Lightning's type lists its own values only)."""
        for action in self._actions:
            if action.dest == "trainer.precision" and hasattr(action, "_typehint"):
                action._typehint = Union[Literal["auto"], action._typehint]


SPECIAL_CKPT = ("last", "best", "hpc", "registry")
"""``--ckpt_path`` values that Lightning resolves itself (not files)."""


def ckpt_path_given(argv: list[str]) -> str | None:
    """The ``--ckpt_path`` given on the command line (the last one wins, as in the parser)."""
    found = None
    for a, b in zip(argv, argv[1:] + [None]):
        if a == "--ckpt_path":
            found = b
        elif a.startswith("--ckpt_path="):
            found = a.split("=", 1)[1]
    return found


def check_config_files(argv: list[str]) -> None:
    """Every ``--config FILE`` exists and is valid YAML; else one line naming the file, line and column
    (the parser's own message names neither)."""
    import yaml

    files = [b for a, b in zip(argv, argv[1:]) if a in ("--config", "-c")]
    files += [a.split("=", 1)[1] for a in argv if a.startswith("--config=")]
    for path in files:
        if not os.path.isfile(path):
            raise RecipeError(f"--config '{path}': no such file (recipes are in the recipes/ folder)")
        try:
            with open(path) as f:
                yaml.safe_load(f)
        except yaml.YAMLError as err:
            mark = getattr(err, "problem_mark", None)
            where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
            problem = getattr(err, "problem", None) or str(err).splitlines()[0]
            raise RecipeError(f"--config '{path}': not valid YAML{where}: {problem}") from None


_DETAIL_HINTS = ("is not accepted", "not expected", "Unrecognized", "Expected a", "does not exist", "No module",
                 "not a subclass", "Import path", "Not a valid", "missing")
_EXPECTED_TYPE = re.compile(r"Expected a <class '(\w+)'>")
_NESTED_KEY = re.compile(r'Parser key "([\w.]+)"')
_GIVEN = re.compile(r"Given value: (.*?)(?:\. Got value:|$)")
_BOUND = re.compile(r"Not of type (\w+): got (.*)")  # rllight.bounds.plain's refusal
_CLASS_PATH = re.compile(r"Problem with given class_path '([\w.]+)'")


def _bound_error(message: str) -> str | None:
    """A value out of a declared bound (``rllight.bounds``) as one line, ``<key> must be <range>, got <value>``,
    the key joined from the parser's nested keys; None for any other error."""
    found = _BOUND.search(message)
    bound = bound_of(found.group(1)) if found else None
    if bound is None:
        return None
    keys = _NESTED_KEY.findall(message)  # the outer key, then one per class's init_args
    key = ".init_args.".join(keys)
    owner = _CLASS_PATH.search(message)
    if "Subtypes: [list[" in message and owner and len(keys) > 1:  # an item of a list (trainer.callbacks): its class
        key = f"{keys[0]}: {owner.group(1).rsplit('.', 1)[-1]}.{'.init_args.'.join(keys[1:])}"
    return f"{key} must be {bound}, got {found.group(2)} (see: rllight fit --help)"


def one_line_parse_error(message: str) -> str:
    """Condense jsonargparse's nested, multi-line error into one line naming the key and the problem."""
    lines = [line.strip(" -") for line in str(message).splitlines() if line.strip(" -")]
    if not lines:
        return "invalid recipe"
    head = lines[0].rstrip(":")
    bound = _bound_error(str(message))
    if bound is not None:
        return bound
    # A value of the wrong type inside a class's init_args (e.g. an optimizer's lr): name the full key and
    # the type expected, not the first alternative the parser tried ("Expected a path").
    keys = _NESTED_KEY.findall(str(message))
    expected = _EXPECTED_TYPE.search(str(message))
    if len(keys) > 1 and expected and expected.group(1) != "str":
        given = _GIVEN.search(str(message))
        value = f", got {given.group(1)!r}" if given else ""
        return f"{keys[0]}.init_args.{keys[-1]} expects a {expected.group(1)}{value} (see: rllight fit --help)"
    index = next((i for hint in _DETAIL_HINTS for i, line in enumerate(lines) if i and hint in line),
                 1 if len(lines) > 1 else None)
    detail = ""
    if index is not None:
        detail = lines[index]
        if detail.endswith(":") and index + 1 < len(lines):  # "Problem with given class_path 'x':" + cause
            detail = f"{detail} {lines[index + 1]}"
    text = f"{head}: {detail}" if detail else head
    return f"{text} (see: rllight fit --help)"


NOT_OFFERED = {
    "test": "rllight test is not offered: evaluate on other data with rllight validate --config R.yaml "
            "--data.val_files '[FILE]' (add --model.path DIR for a trained model folder)",
    "predict": "rllight predict is not offered: write generations for a file of prompts with rllight generate "
               "--model.path DIR --prompts FILE --output out.jsonl",
}
