"""What the command line does with paths before a recipe is parsed and its classes are built.

- Paths in a recipe expand ``~`` and environment variables (``~/data/gsm8k/train.parquet``,
  ``$SCRATCH/runs/grpo``), as a shell would, for every option whose name says it is a path.
- A module of the user's own, next to a recipe or in the working directory, can be named by ``class_path``
  (``my_lab.MedianBaseline``): those folders go on the import path, as ``python -m`` puts the working
  directory there.
- ``--model.path DIR`` is the one flag that points a recipe at a model folder (an rllight export, any Hugging
  Face folder, or an ``org/name`` hub id): it stands for ``--model.model rllight.models.HFModel
  --model.model.path DIR``, keeping the recipe's dtype and ``trust_remote_code``.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Iterable

from rllight.errors import RecipeError

MODEL_PATH_FLAG = "--model.path"

_PATH_NAMES = ("path", "dirpath")
_PATH_SUFFIXES = ("_path", "_dir", "_files", "_file")
_VARIABLE = re.compile(r"\$(\w+)|\$\{([^}]*)\}")


def is_path_key(name: str) -> bool:
    """Whether an option's name says that it holds a path (or a list of paths): ``path``, ``dirpath``,
    ``ckpt_path``, ``export_dir``, ``default_root_dir``, ``save_dir``, ``train_files``, ``gguf_file``, ..."""
    return name in _PATH_NAMES or (name.endswith(_PATH_SUFFIXES) and name != "class_path")


def expand_path(value: str, key: str) -> str:
    """``value`` with ``~`` and ``$VAR`` / ``${VAR}`` expanded; a variable that is not set is an error naming
    ``key`` (left as it is, it would become a folder literally named ``$VAR``)."""
    for match in _VARIABLE.finditer(value):
        name = match.group(1) or match.group(2)
        if name not in os.environ:
            raise RecipeError(f"{key}: '{value}' names the environment variable ${name}, which is not set; "
                              f"set it (export {name}=...) or write the path out")
    return os.path.expandvars(os.path.expanduser(value))


def expand_config_paths(config, prefix: str = "") -> None:
    """Expand, in place, every path-valued option of a parsed recipe (a jsonargparse ``Namespace``: nested
    namespaces, lists of them such as ``trainer.callbacks``, and plain dicts)."""
    fields = config if isinstance(config, dict) else vars(config)
    for name, value in list(fields.items()):
        key = f"{prefix}{name}"
        if isinstance(value, str) and is_path_key(name):
            value = expand_path(value, key)
        elif isinstance(value, list) and is_path_key(name):
            value = [expand_path(v, key) if isinstance(v, str) else v for v in value]
        elif isinstance(value, list):
            for item in value:
                if _is_mapping(item):
                    expand_config_paths(item, f"{key}.")
            continue
        elif _is_mapping(value):
            expand_config_paths(value, f"{key}.")
            continue
        else:
            continue
        fields[name] = value


def _is_mapping(value) -> bool:
    from argparse import Namespace

    return isinstance(value, (dict, Namespace))


def existing_ancestor(path: str) -> str:
    """``path`` itself where it exists (a link counts), else its nearest parent that does: where a file under
    ``path`` would be created, for a writability or free-space check."""
    existing = os.path.abspath(path)
    while not os.path.lexists(existing):
        existing = os.path.dirname(existing)
    return existing


def config_files(argv: Iterable[str]) -> list[str]:
    """The files given with ``--config`` / ``-c`` (``--config=FILE`` too), in order."""
    argv = list(argv)
    files = [b for a, b in zip(argv, argv[1:]) if a in ("--config", "-c")]
    return files + [a.split("=", 1)[1] for a in argv if a.startswith("--config=")]


def add_user_import_paths(argv: Iterable[str]) -> list[str]:
    """Put the working directory and the recipe's folder (the first ``--config`` file's; not an overlay's) at the
    END of ``sys.path`` (each once), so that ``class_path: my_lab.X`` finds ``my_lab.py`` there, while a stray
    module beside a recipe (a ``tensorboard.py``) can never shadow the standard library or an installed package.
    Another folder is trusted the usual way, on ``PYTHONPATH``. Returns the folders added. Worker processes
    started with ``spawn`` inherit ``sys.path``."""
    recipe = next(iter(config_files(argv)), None)
    folders = [os.getcwd()] + ([os.path.dirname(os.path.abspath(recipe))] if recipe else [])
    present = {os.path.abspath(p or os.curdir) for p in sys.path}
    added = []
    for folder in folders:
        if folder not in present:
            present.add(folder)
            added.append(folder)
    sys.path.extend(added)
    return added


def model_path_args(argv: list[str]) -> list[str]:
    """``argv`` with each ``--model.path DIR`` (or ``--model.path=DIR``) replaced by the options it stands for.

    The recipe's other ``HFModel`` settings (``dtype``, ``trust_remote_code``) carry over, while ``gguf_file``
    is cleared: it names a file inside the recipe's model folder, not the new one."""
    out: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == MODEL_PATH_FLAG or arg.startswith(MODEL_PATH_FLAG + "="):
            if arg == MODEL_PATH_FLAG:
                if i + 1 >= len(argv) or argv[i + 1].startswith("--"):
                    raise RecipeError(f"{MODEL_PATH_FLAG} needs a folder: {MODEL_PATH_FLAG} DIR (an rllight export, "
                                      "a Hugging Face folder or an org/name hub id)")
                value, i = argv[i + 1], i + 2
            else:
                value, i = arg.split("=", 1)[1], i + 1
            out += ["--model.model", "rllight.models.HFModel", "--model.model.path", value,
                    "--model.model.gguf_file", "null"]
            continue
        out.append(arg)
        i += 1
    return out
