"""``python -m rllight`` and the ``rllight`` console script.

The command line is imported inside ``main``, not here: processes a run starts with ``multiprocessing`` (rollout
and reward workers) import the parent's main module first, and this one costs them nothing, where
``rllight.cli`` would load Lightning into each of them (seconds per worker). ``--version`` is answered here from
the installed packages' metadata, without importing torch, Lightning or transformers (seconds each)."""

import sys
from importlib import metadata

RUNS_ON = ("torch", "lightning", "transformers")


def version() -> str:
    """``rllight <version>`` and the versions of what it runs on (``not installed`` for a missing one)."""
    from rllight import __version__

    def installed(name: str) -> str:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return "not installed"

    runs_on = ", ".join(f"{name} {installed(name)}" for name in RUNS_ON)
    return f"rllight {__version__} (python {sys.version.split()[0]}, {runs_on})"


def main() -> None:
    if sys.argv[1:] in (["--version"], ["-V"]):
        print(version())
        return
    from rllight.cli import main as cli_main

    cli_main()


if __name__ == "__main__":
    main()
