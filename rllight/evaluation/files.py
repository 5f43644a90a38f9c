"""Where an evaluation is saved and how: ``<name>.json`` (every metric, NaN as null, with what else the caller
adds: n, ks, the dropped prompts, the settings) and ``<name>_rows.jsonl`` (one JSON line per prompt), each written
whole through a temporary file, so that a crash never leaves half a file. ``EvalAccumulator.write`` and
``read_evaluation`` (``rllight.evaluation.accumulate``) write and read them."""

from __future__ import annotations

import json
import math
import os


def finite_or_none(value: float) -> float | None:
    """``value``, or None where it is NaN or infinite (JSON has no NaN)."""
    return value if math.isfinite(value) else None


def write_atomic(path: str, text: str) -> None:
    """Write ``text`` to ``path`` whole: into a temporary file beside it, then renamed over it."""
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)


def write_json(path: str, value) -> None:
    """Write ``value`` as indented JSON at ``path`` whole (``write_atomic``), creating its folder if missing."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    write_atomic(path, json.dumps(value, indent=1) + "\n")


def save_evaluation(directory: str, name: str, metrics: dict[str, float], records: list[dict],
                    fields: dict | None = None) -> tuple[str, str]:
    """Write ``<name>.json`` (``{"metrics": metrics, **fields}``, NaN as null) and ``<name>_rows.jsonl`` (one line
    per record) into ``directory``, created if missing; returns both paths."""
    os.makedirs(directory, exist_ok=True)
    summary = {"metrics": {k: finite_or_none(v) for k, v in metrics.items()}, **(fields or {})}
    json_path = os.path.join(directory, f"{name}.json")
    rows_path = os.path.join(directory, f"{name}_rows.jsonl")
    write_atomic(json_path, json.dumps(summary, indent=2, allow_nan=False) + "\n")
    write_atomic(rows_path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
    return json_path, rows_path


def load_evaluation(directory: str, name: str) -> tuple[dict, list[dict]]:
    """What ``save_evaluation`` wrote as ``<directory>/<name>``: the summary and the records."""
    with open(os.path.join(directory, f"{name}.json")) as f:
        summary = json.load(f)
    with open(os.path.join(directory, f"{name}_rows.jsonl")) as f:
        records = [json.loads(line) for line in f if line.strip()]
    return summary, records
