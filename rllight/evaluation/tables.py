"""An evaluation's metrics as printed tables: one evaluation (``evaluation_table``), two of the same rows side by
side with their difference and its standard error (``before_after``, ``paired_se``), and what each row measures
(``column_notes``)."""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from rllight.evaluation.files import finite_or_none

if TYPE_CHECKING:
    from rllight.evaluation.settings import EvalSettings


_HEADLINE = re.compile(r"val/(greedy/)?(avg|pass|maj)@(\d+)")
_PLAIN = ("response_length", "truncated_ratio", "turns_mean", "first_turn_accuracy")
_SOURCE = re.compile(r"val/(?!greedy/)(.+)/prompts")


def _headline_rows(keys) -> list[tuple[str, str]]:
    """``(label, key)`` of the overall headline metrics among ``keys``, in table order: the greedy accuracy, then
    for each k avg@k, pass@k and maj@k. pass@1 and maj@1 are left out: pass@1 equals avg@n (every sample), and
    maj@1, a vote of one, is the first sample's verdict as in avg@1."""
    rows = []
    for key in keys:
        m = _HEADLINE.fullmatch(key)
        if m and (m.group(2) == "avg" or int(m.group(3)) > 1):
            label = "greedy accuracy" if m.group(1) else f"{m.group(2)}@{m.group(3)}"
            order = (0 if m.group(1) else 1, int(m.group(3)), ("avg", "pass", "maj").index(m.group(2)))
            rows.append((order, label, key))
    return [(label, key) for _, label, key in sorted(rows)]


def _in_source(key: str, source: str | None) -> str:
    """The per-source key of an overall one: ``val/avg@4`` -> ``val/<source>/avg@4``, ``val/greedy/avg@1`` ->
    ``val/greedy/<source>/avg@1`` (the key itself for None)."""
    head, _, name = key.rpartition("/")
    return key if source is None else f"{head}/{source}/{name}"


def evaluation_table(metrics: dict[str, float]) -> tuple[dict, list[str]]:
    """One evaluation's metrics (``val/...`` as logged) as a summary and the lines of a printed table, with the rows
    of ``before_after`` (the greedy accuracy, avg@k, pass@k and maj@k for k > 1, each ``value ± standard error``;
    then response length, truncation and turns) and a column for all prompts, then one per data source.

    Summary: ``{"all": {"prompts": P, "avg@4": {"value": v, "se": s}, ..., "response_length": x}, "<source>":
    {...}}`` (a standard error is None where there is none: a single prompt). Empty when nothing was evaluated.
    """
    if not metrics.get("val/prompts"):
        return {}, []
    sources = sorted({m.group(1) for m in map(_SOURCE.fullmatch, metrics) if m})
    columns = [("all", None)] + [(source, source) for source in sources]
    width = max(15, *(len(name) for name, _ in columns))
    headline = _headline_rows(metrics)
    rows = [("prompts", "val/prompts"), *headline, *((name, f"val/{name}") for name in _PLAIN)]
    summary: dict[str, dict] = {name: {} for name, _ in columns}
    lines = [f"{'metric':<16}" + "".join(f" {name:>{width}}" for name, _ in columns)]
    for label, key in rows:
        cells = []
        for name, source in columns:
            value = metrics.get(_in_source(key, source))
            if value is None:
                cells.append("")
                continue
            value = float(value)
            if (label, key) in headline:
                se = float(metrics.get(_in_source(key, source) + "_se", math.nan))
                summary[name][label] = {"value": value, "se": finite_or_none(se)}
                cells.append(f"{value:.3f} ± {se:.3f}" if math.isfinite(se) else f"{value:.3f}")
            else:
                summary[name][label] = value
                cells.append(f"{value:.0f}" if label == "prompts" else f"{value:.3f}")
        if any(cells):
            lines.append(f"{label:<16}" + "".join(f" {cell:>{width}}" for cell in cells))
    return summary, lines


def column_notes(labels: Sequence[str], settings: EvalSettings) -> list[str]:
    """What each headline row of an evaluation table measures (rows of ``before_after`` or ``evaluation_table``
    named in ``labels``), in words, for evaluations sampled as ``settings`` says."""
    n, kinds = settings.n, {label.split("@")[0] for label in labels}
    notes = []
    if "greedy accuracy" in labels:
        notes.append("greedy accuracy: the share of prompts whose one greedy answer (temperature 0) is correct")
    if "avg" in kinds and settings.greedy:
        notes.append("avg@1: the share of prompts whose greedy answer (temperature 0) is correct")
    elif "avg" in kinds:
        notes.append(f"avg@k: the share of correct answers among the first k of each prompt's {n} samples, averaged "
                     f"over prompts (avg@1: the first sample alone); avg@{n} counts all {n} and equals pass@1")
    if "pass" in kinds:
        notes.append(f"pass@k: the chance that at least one of k samples is correct, estimated without bias from all "
                     f"{n} (Chen et al., arXiv:2107.03374)")
    if "maj" in kinds:
        notes.append("maj@k: the chance that the most common final answer among the first k samples is correct "
                     "(majority vote, Wang et al., arXiv:2203.11171)")
    return notes


def before_after(
    before: dict[str, float], after: dict[str, float],
    before_per_prompt: dict[str, dict[str, float]] | None = None,
    after_per_prompt: dict[str, dict[str, float]] | None = None,
) -> tuple[dict, list[str]]:
    """The overall metrics of two validations of the same rows (``val/...`` as logged), as a summary dict
    and the lines of a printed table.

    Rows: the greedy accuracy (``also_greedy``), avg@k for every k, pass@k and maj@k for k > 1 (pass@1 equals
    avg@n, and maj@1 is avg@1's first sample), each ``before ± se``, ``after ± se`` and the difference with its
    standard error; then response length, truncation and turns without errors. ``column_notes`` says what each row is.

    The difference's standard error is paired where both evaluations give a metric prompt by prompt
    (``EvalAccumulator.per_prompt``) on the same prompts: the standard error of the mean per-prompt
    difference, ``std(after_i - before_i) / sqrt(P)``, which is what a comparison of two evaluations of the
    same prompts calls for. Otherwise it is ``sqrt(se_before^2 + se_after^2)``, which treats the two as
    independent (an upper bound when the per-prompt values correlate positively, as they do). The summary
    says which (``paired``).
    """
    summary: dict[str, dict] = {}
    by_source = _per_source_row(before, after)
    w = max([16] + [2 + len(source) for source in (by_source[2] if by_source else [])])  # the label column

    def add(label: str, name: str, key: str) -> None:
        row = summary[name] = _difference(before, after, key, before_per_prompt, after_per_prompt)
        lines.append(f"{label:<{w}} {_cell(row, 'before')} {_cell(row, 'after')} "
                     f"{row['difference']:>+8.3f} ± {_se(row['difference_se']):<5}")

    lines = [f"{'metric':<{w}} {'before':>15} {'after':>15} {'difference':>16}"]
    for label, key in _headline_rows([key for key in after if key in before]):
        add(label, label, key)
    if by_source is not None:
        label, key, sources = by_source
        lines.append(f"{label}, per data source:")
        for source in sources:
            add(f"  {source}", f"{label} / {source}", _in_source(key, source))
    for name in _PLAIN:
        key = f"val/{name}"
        if key in before and key in after:
            b, a = float(before[key]), float(after[key])
            summary[name] = {"before": b, "after": a, "difference": a - b}
            lines.append(f"{name:<{w}} {b:>15.3f} {a:>15.3f} {a - b:>+16.3f}")
    return summary, lines


def _per_source_row(before: dict[str, float], after: dict[str, float]) -> tuple[str, str, list[str]] | None:
    """The metric ``before_after`` also shows per data source, ``(label, overall key, sources)``: the greedy accuracy
    where there is one, else avg@k for the largest k (every sample); None with fewer than two data sources."""
    sources = sorted({m.group(1) for m in map(_SOURCE.fullmatch, after) if m and m.group(0) in before})
    if len(sources) < 2:
        return None
    if "val/greedy/avg@1" in after:
        return "greedy accuracy", "val/greedy/avg@1", sources
    ks = [int(m.group(3)) for m in map(_HEADLINE.fullmatch, after) if m and not m.group(1) and m.group(2) == "avg"]
    return (f"avg@{max(ks)}", f"val/avg@{max(ks)}", sources) if ks else None


def _difference(before: dict[str, float], after: dict[str, float], key: str,
                before_per_prompt: dict | None, after_per_prompt: dict | None) -> dict:
    """``key`` before and after with standard errors, and their difference with its own (paired when both
    evaluations give ``key`` prompt by prompt on the same prompts, else as if independent)."""
    b, a = float(before.get(key, math.nan)), float(after.get(key, math.nan))
    se_b, se_a = float(before.get(key + "_se", math.nan)), float(after.get(key + "_se", math.nan))
    se_d = paired_se((before_per_prompt or {}).get(key), (after_per_prompt or {}).get(key))
    paired = se_d is not None
    if not paired:
        se_d = math.sqrt(se_b**2 + se_a**2)
    return {"before": b, "after": a, "before_se": finite_or_none(se_b), "after_se": finite_or_none(se_a),
            "difference": a - b, "difference_se": finite_or_none(se_d), "paired": paired}


def _se(value: float | None) -> str:
    return "nan" if value is None else f"{value:.3f}"


def _cell(row: dict, which: str) -> str:
    return f"{row[which]:>7.3f} ± {_se(row[which + '_se']):<5}"


def paired_se(before: dict[str, float] | None, after: dict[str, float] | None) -> float | None:
    """Standard error of the mean of ``after[s] - before[s]`` over the prompts ``s`` (Bessel-corrected); None
    unless both cover the same prompts, at least two."""
    if not before or not after or before.keys() != after.keys() or len(before) < 2:
        return None
    diffs = torch.tensor([after[s] - before[s] for s in before], dtype=torch.float64)
    return float(diffs.std(unbiased=True) / math.sqrt(len(diffs)))
