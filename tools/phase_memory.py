"""Peak resident memory of each phase of an rllight run: every generation and every optimizer update.

Runs the ``rllight`` command given after it (``fit``, ``validate`` ...) with the HF engine's ``generate`` and the
updater's ``update`` wrapped: before each call the process's peak RSS (``VmHWM``) is reset (Linux
``/proc/self/clear_refs``), after it the peak and the RSS are printed, one line per call, and a summary at exit
(the largest peak of each phase, the time spent in it after its first call). Where a run's peak RSS comes from,
and what stays resident between phases, read directly:

    .venv/bin/python tools/phase_memory.py fit --config recipes/quickstart.yaml --trainer.precision 32-true

Output lines: ``memory generate: before 541 peak 1329 after 1027 MB 7.70s``. Linux only.
"""

from __future__ import annotations

import atexit
import functools
import time


def status() -> dict[str, float]:
    """``VmRSS`` and ``VmHWM`` (the peak since the last reset) of this process, in MB."""
    values = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                values[key] = int(rest.split()[0]) / 1024
    return values


def reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS


def wrap(cls, name: str, label: str, calls: dict[str, list[tuple[float, float]]]) -> None:
    """Print the peak RSS of each ``cls.name`` call under ``label``."""
    original = getattr(cls, name)

    @functools.wraps(original)
    def measured(*args, **kwargs):
        before = status()["VmRSS"]
        reset_peak()
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            now, seconds = status(), time.perf_counter() - start
            calls.setdefault(label, []).append((now["VmHWM"], seconds))
            print(f"memory {label}: before {before:.0f} peak {now['VmHWM']:.0f} after {now['VmRSS']:.0f} MB "
                  f"{seconds:.2f}s", flush=True)

    setattr(cls, name, measured)


def summary(calls: dict[str, list[tuple[float, float]]]) -> str:
    return "memory summary: " + ", ".join(
        f"{label} peak {max(p for p, _ in v):.0f} MB, {sum(s for _, s in v[1:]):.1f}s after the first"
        for label, v in calls.items())


def main() -> None:
    from rllight.cli import main as rllight
    from rllight.rollout.hf import HFEngine
    from rllight.update import Updater

    calls: dict[str, list[tuple[float, float]]] = {}
    wrap(HFEngine, "generate", "generate", calls)
    wrap(Updater, "update", "update", calls)
    atexit.register(lambda: print(summary(calls), flush=True))
    # reads sys.argv, as the console script does (an explicit list would repeat it and draw Lightning's warning)
    rllight()


if __name__ == "__main__":
    main()
