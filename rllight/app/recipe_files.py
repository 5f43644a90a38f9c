"""The recipe files and options a command names, checked before the parser reads them: each ``--config`` file
exists and is YAML (one line naming the file, line and column, which the parser's own message does not), and no
``api_key_env`` holds what looks like a key, so that ``--print_config`` never prints one."""

from __future__ import annotations

import os

from rllight.errors import RecipeError


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
                recipe = yaml.safe_load(f)
        except yaml.YAMLError as err:
            mark = getattr(err, "problem_mark", None)
            where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
            problem = getattr(err, "problem", None) or str(err).splitlines()[0]
            raise RecipeError(f"--config '{path}': not valid YAML{where}: {problem}") from None
        _refuse_pasted_keys(recipe, f"--config '{path}'", "")
    for i, arg in enumerate(argv):  # --x.api_key_env=VALUE, --x.api_key_env VALUE
        name, eq, value = arg.partition("=")
        if name.startswith("--") and name.endswith("api_key_env"):
            value = value if eq else (argv[i + 1] if i + 1 < len(argv) else "")
            _refuse_pasted_keys({name[2:]: value}, "the command line", "")


def _refuse_pasted_keys(value, where: str, key: str) -> None:
    """A one-line ``RecipeError`` where an ``api_key_env`` in ``value`` (a recipe, or a part of one) looks like a key
    rather than an environment variable's name (``rllight.serving.http.looks_like_key``), before anything prints the
    recipe (``--print_config``); the value is not quoted."""
    from rllight.serving.http import looks_like_key

    if isinstance(value, dict):
        for name, inner in value.items():
            if str(name).rpartition(".")[2] == "api_key_env" and isinstance(inner, str) and looks_like_key(inner):
                raise RecipeError(f"{where}: {key + '.' if key else ''}{name} looks like an API key, not the NAME "
                                  "of the environment variable that holds one; export the key (e.g. JUDGE_API_KEY=...) "
                                  "and give that name; revoke the key if this file or command was shared")
            _refuse_pasted_keys(inner, where, f"{key}.{name}" if key else str(name))
    elif isinstance(value, list):
        for i, inner in enumerate(value):
            _refuse_pasted_keys(inner, where, f"{key}[{i}]")
