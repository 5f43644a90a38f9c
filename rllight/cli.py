"""The ``rllight`` command: ``rllight fit --config recipes/<name>.yaml``."""

from __future__ import annotations

import json
import logging
import os
import sys

from lightning.pytorch.cli import LightningCLI

from rllight.data import RLDataModule
from rllight.errors import RecipeError
from rllight.module import RLModule

log = logging.getLogger("rllight")


class RLLightCLI(LightningCLI):
    """LightningCLI for RLModule and RLDataModule.

    Defaults it sets on the trainer (a recipe can override each): ``log_every_n_steps: 1`` (one RL
    step per batch is already coarse), ``num_sanity_val_steps: 0`` (evaluation runs whole, see below),
    ``inference_mode: false`` (validation under ``no_grad``; see ``__init__``).
    No ``link_arguments``: every value lives in exactly one place of the recipe.

    Extra top-level options:
        ``evaluate_before_after``: run the validation loop before ``fit`` and again after it, print both
        accuracies and write them to ``<log_dir>/eval_summary.json``.
    """

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("save_config_kwargs", {"overwrite": True})
        # inference_mode off: validation runs under no_grad instead, because a validation before fit
        # under inference mode would leave the metrics' state as inference tensors that the in-fit
        # validation then cannot update.
        kwargs.setdefault("trainer_defaults", {"log_every_n_steps": 1, "num_sanity_val_steps": 0,
                                               "inference_mode": False})
        kwargs.setdefault("auto_configure_optimizers", False)
        # A misspelt option must fail, not match a longer one by prefix; errors raise so that main()
        # can print them on one line.
        kwargs.setdefault("parser_kwargs", {"allow_abbrev": False, "exit_on_error": False})
        super().__init__(RLModule, RLDataModule, *args, **kwargs)

    def add_arguments_to_parser(self, parser) -> None:
        parser.add_argument("--evaluate_before_after", type=bool, default=False,
                            help="Validate before and after fit and report both accuracies.")

    def _evaluate(self) -> float | None:
        results = self.trainer.validate(self.model, datamodule=self.datamodule, verbose=False)
        return results[0].get("val/accuracy") if results else None

    def before_fit(self) -> None:
        self._before = self._evaluate() if self.config.fit.evaluate_before_after else None

    def after_fit(self) -> None:
        if not self.config.fit.evaluate_before_after:
            return
        after = self._evaluate()
        n = len(self.datamodule.val_rows)
        summary = {"accuracy_before": self._before, "accuracy_after": after, "num_val": n}
        if self._before is not None and after is not None and n:
            # Standard error of the difference of two accuracies on the same n problems (upper bound,
            # treating them as independent).
            se = ((self._before * (1 - self._before) + after * (1 - after)) / n) ** 0.5
            summary["difference"] = after - self._before
            summary["stderr_of_difference"] = se
        if self.trainer.is_global_zero:
            log_dir = self.trainer.log_dir or "."
            os.makedirs(log_dir, exist_ok=True)
            with open(os.path.join(log_dir, "eval_summary.json"), "w") as f:
                json.dump(summary, f, indent=2)
            print("rllight: " + " ".join(f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}"
                                         for k, v in summary.items()), flush=True)


_DETAIL_HINTS = ("is not accepted", "not expected", "Unrecognized", "Expected a", "does not exist", "No module",
                 "not a subclass", "Import path", "Not a valid", "missing")


def one_line_parse_error(message: str) -> str:
    """Condense jsonargparse's nested, multi-line error into one line naming the key and the problem."""
    lines = [line.strip(" -") for line in str(message).splitlines() if line.strip(" -")]
    if not lines:
        return "invalid recipe"
    head = lines[0].rstrip(":")
    index = next((i for hint in _DETAIL_HINTS for i, line in enumerate(lines) if i and hint in line),
                 1 if len(lines) > 1 else None)
    detail = ""
    if index is not None:
        detail = lines[index]
        if detail.endswith(":") and index + 1 < len(lines):  # "Problem with given class_path 'x':" + cause
            detail = f"{detail} {lines[index + 1]}"
    text = f"{head}: {detail}" if detail else head
    return f"{text} (see: rllight fit --help)"


def main(args: list[str] | None = None) -> None:
    """Entry point of the ``rllight`` console script."""
    from jsonargparse import ArgumentError

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        RLLightCLI(args=args)
    except ArgumentError as err:
        print(f"rllight: error: {one_line_parse_error(str(err))}", file=sys.stderr)
        sys.exit(2)
    except RecipeError as err:
        print(f"rllight: error: {err}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
