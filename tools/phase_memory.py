"""Peak resident memory of each phase of an rllight run: every generation and every optimizer update.

Runs the ``rllight`` command given after it (``fit``, ``validate`` ...) with the HF engine's ``generate`` and the
updater's ``update`` wrapped: before each call the process's peak RSS (``VmHWM``) is reset (Linux
``/proc/self/clear_refs``), after it the peak and the RSS are printed, one line per call, and a summary at exit
(the largest peak of each phase, the time spent in it after its first call). Where a run's peak RSS comes from,
and what stays resident between phases, read directly:

    .venv/bin/python tools/phase_memory.py fit --config recipes/quickstart.yaml --trainer.precision 32-true

Output lines: ``memory generate: before 541 peak 1329 after 1027 MB 7.70s``. Linux only.

``--record PATH`` (and the other options of ``rllight.app.records.add_record_options``), given before the rllight
command, also writes the summary as a record for docs/results/ (id ``phase-memory``): one row per phase, its calls,
largest peak and time after the first call, as the summary line prints them; only when the run ends normally::

    .venv/bin/python tools/phase_memory.py --record docs/results/ --shared no fit --config recipes/quickstart.yaml
"""

from __future__ import annotations

import argparse
import atexit
import functools
import sys
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


def phases(calls: dict[str, list[tuple[float, float]]]) -> list[dict]:
    """Each phase's calls, largest peak (MB) and seconds after its first call, as the summary prints them."""
    from rllight.app.records import printed

    return [{"phase": label, "calls": len(v), "peak_mb": printed(max(p for p, _ in v), ".0f"),
             "after_first_s": printed(sum(s for _, s in v[1:]), ".1f")} for label, v in calls.items()]


def summary(calls: dict[str, list[tuple[float, float]]]) -> str:
    return "memory summary: " + ", ".join(f"{r['phase']} peak {r['peak_mb']:.0f} MB, {r['after_first_s']:.1f}s after "
                                          "the first" for r in phases(calls))


def parse_args(argv: list[str]) -> argparse.Namespace:
    from rllight.app.records import add_record_options, check_record_options

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_record_options(parser, id="phase-memory", section="Speed and memory", headline=False)
    parser.add_argument("command", nargs=argparse.REMAINDER, help="The rllight command: fit --config ...")
    args = parser.parse_args(argv)
    if not args.command:
        parser.error("give the rllight command to measure, e.g. fit --config recipes/quickstart.yaml")
    check_record_options(parser, args, argv, __file__)  # the record's command: this whole command line
    return args


def at_exit(args: argparse.Namespace, calls: dict, ended: list[bool]) -> None:
    """The record (``--record``, where the run ended normally and measured a phase), then the summary line."""
    from rllight.app.records import tool_record

    if args.record and not (ended and calls):
        print("phase_memory: no record written: the run did not end normally" if not ended else
              "phase_memory: no record written: no generation or update ran", file=sys.stderr, flush=True)
    elif ended:
        tool_record(args, id="phase-memory", section="Speed and memory",
                    title=f"Peak resident memory of each phase: rllight {' '.join(args.command)}",
                    note="The process's peak RSS (VmHWM, reset before each call) of every generation (the HF "
                         "engine's generate) and optimizer update (Updater.update): the largest of each phase, its "
                         "calls and the time spent in it after its first call.",
                    columns=[["phase", "phase"], ["calls", "calls"], ["peak_mb", "peak RSS (MB)", ".0f"],
                             ["after_first_s", "time after the first call (s)", ".1f"]],
                    rows=phases(calls),
                    summary={f"{r['phase']}_peak_mb": r["peak_mb"] for r in phases(calls)})
    print(summary(calls), flush=True)


def main() -> None:
    args = parse_args(sys.argv[1:])
    sys.argv[1:] = args.command
    from rllight.app.cli import main as rllight
    from rllight.rollout.hf import HFEngine
    from rllight.update import Updater

    calls: dict[str, list[tuple[float, float]]] = {}
    wrap(HFEngine, "generate", "generate", calls)
    wrap(Updater, "update", "update", calls)
    ended: list[bool] = []
    atexit.register(at_exit, args, calls, ended)
    # reads sys.argv, as the console script does (an explicit list would repeat it and draw Lightning's warning)
    try:
        rllight()
    except SystemExit as stop:
        if stop.code in (0, None):
            ended.append(True)
        raise
    ended.append(True)


if __name__ == "__main__":
    main()
