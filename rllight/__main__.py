"""``python -m rllight`` and the ``rllight`` console script.

The command line is imported inside ``main``, not here: processes a run starts with ``multiprocessing`` (rollout
and reward workers) import the parent's main module first, and this one costs them nothing, where
``rllight.app.cli`` would load Lightning into each of them (seconds per worker). ``--version`` and ``--help`` are
answered here (``rllight.app.versions``, ``rllight.app.usage``), without importing torch, Lightning or transformers
(seconds each)."""

import sys

from rllight.app.versions import version


def main() -> None:
    if sys.argv[1:] in (["--version"], ["-V"]):
        print(version())
        return
    if sys.argv[1:] in (["--help"], ["-h"]):
        from rllight.app.usage import top_help

        print(top_help())
        return
    from rllight.app.cli import main as cli_main

    cli_main()


if __name__ == "__main__":
    main()
