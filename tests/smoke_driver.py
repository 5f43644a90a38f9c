"""Run recipes with the smoke overlay one after another in this process, as ``rllight fit`` would run each
(``python tests/smoke_driver.py <fit options of run 1> -- <fit options of run 2> -- ...``): one process pays the
imports once, where a process per recipe would spend most of its time importing. Before each run a line
``@@run <n>`` and after it ``@@rc <n> <exit status>`` go to stderr, so that a reader can cut each run's output
(stdout and stderr merged, unbuffered) from the whole."""

from __future__ import annotations

import sys

from rllight.app.cli import main


def runs(argv: list[str]) -> list[list[str]]:
    out, current = [], []
    for arg in argv + ["--"]:
        if arg == "--":
            if current:
                out.append(current)
            current = []
        else:
            current.append(arg)
    return out


if __name__ == "__main__":
    for n, args in enumerate(runs(sys.argv[1:])):
        print(f"@@run {n}", file=sys.stderr, flush=True)
        try:
            main(["fit", *args])
            status = 0
        except SystemExit as exc:
            status = exc.code if isinstance(exc.code, int) else 1
        except BaseException as exc:  # noqa: BLE001 - the next recipe still runs; the test reads this one's failure
            print(f"{type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
            status = 1
        sys.stdout.flush()
        print(f"@@rc {n} {status}", file=sys.stderr, flush=True)
