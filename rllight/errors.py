"""Errors that name what the user must fix."""


def one_line(err: BaseException, limit: int | None = None) -> str:
    """``err`` as ``Type: message`` on one line (runs of whitespace, newlines included, become one space), cut to
    ``limit`` characters (None = whole): how a failure is quoted inside a one-line message."""
    text = " ".join(f"{type(err).__name__}: {err}".split())
    return text if limit is None else text[:limit]


class RecipeError(ValueError):
    """Bad input: a recipe value, a data file or a data row. The message is one line that names the
    field, file or row and what to do; the CLI prints it without a traceback."""


class ComponentError(RuntimeError):
    """A component failed while the run was going: the remote vLLM engine, the rollout worker process or a
    multi-turn environment. The message is one line that names the component, its URL or class, and what
    to do; the CLI prints it without a traceback and exits with code 2, as for a ``RecipeError``."""


class RunStopped(RecipeError):
    """A guard ended the run after a completed RL step, saved where checkpoints are on: training could not usefully
    go on (RL steps without an update, updates without a gradient). The message says why, which option sets the
    guard, and the checkpoint that resumes the run."""


def install_hint(extra: str, package: str | None = None) -> str:
    """How to install the optional ``extra``: ``tools/install.sh`` in a clone (which installs torch first and
    keeps the venv), the editable pip form beside it, and the bare ``package`` where one is enough."""
    also = f"; or pip install {package}" if package else ""
    return f"bash tools/install.sh {extra} (in the rllight clone; or pip install -e '.[{extra}]'{also})"

