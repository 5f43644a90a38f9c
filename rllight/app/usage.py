"""What ``rllight --help`` prints: every command, answered without importing torch, Lightning or transformers
(``rllight.__main__`` prints it before anything heavy loads; ``rllight.app.cli`` uses the same text)."""

DESCRIPTION = (
    "rllight: reinforcement learning for language models from YAML recipes. Recipes live in the recipes/ "
    "folder of the repository (one per method: grpo, ppo, dapo, vapo, sppo, ...; overlays in "
    "recipes/ablations and recipes/overlays). Example: rllight fit --config recipes/quickstart.yaml "
    "--trainer.max_steps 10. See: rllight fit --help. Evaluate a model: rllight validate --config R.yaml "
    "[--model.path DIR] [--data.val_files '[FILE]']. Try a trained model folder: rllight generate --model.path DIR "
    "--prompt TEXT (or --prompts FILE), rllight chat --model.path DIR (see rllight generate --help). "
    "rllight --version prints the versions; python -m rllight is the same command."
)
COMMANDS = (
    ("fit", "train with a recipe: rllight fit --config recipes/quickstart.yaml [--config overlay.yaml] [--key value]"),
    ("validate", "evaluate a recipe's model, a checkpoint (--ckpt_path) or a folder (--model.path DIR)"),
    ("generate", "write a model's responses: rllight generate --model.path DIR --prompt TEXT (or --prompts FILE)"),
    ("chat", "chat with a model: rllight chat --model.path DIR (/reset, /exit or Ctrl-D)"),
)
"""Every command of the ``rllight`` console script, with one line each."""


def top_help() -> str:
    """``rllight --help``: the usage line naming every command, the description, a line per command."""
    import textwrap

    names = ",".join(name for name, _ in COMMANDS)
    lines = [f"usage: rllight {{{names}}} ... | rllight --version", "",
             *textwrap.wrap(DESCRIPTION, 100), "", "commands:"]
    lines += [f"  {name:<10} {text}" for name, text in COMMANDS]
    lines += ["", "rllight COMMAND --help lists a command's options (every recipe key, for fit and validate)."]
    return "\n".join(lines)


__all__ = ["COMMANDS", "DESCRIPTION", "top_help"]
