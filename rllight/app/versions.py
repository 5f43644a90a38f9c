"""``rllight --version``: the versions of rllight and of what it runs on, read from the installed packages'
metadata, so that answering imports none of them (torch, Lightning and transformers take seconds each)."""

import sys
from importlib import metadata

RUNS_ON = ("torch", "lightning", "transformers")


def version() -> str:
    """``rllight <version> (python ..., torch ..., ...)``; ``not installed`` for a missing package."""
    from rllight import __version__

    def installed(name: str) -> str:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return "not installed"

    runs_on = ", ".join(f"{name} {installed(name)}" for name in RUNS_ON)
    return f"rllight {__version__} (python {sys.version.split()[0]}, {runs_on})"
