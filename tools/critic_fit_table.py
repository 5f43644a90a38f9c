"""The numbers ``tools/critic_fit.py`` reports from its saved rollouts and fits: explained variance pooled over
rollouts, the share of the returns' variance between prompts, the recipe's stopping criterion replayed, the probe's
columns, the means over seeds, and the table."""

from __future__ import annotations

import argparse
import json
import math
import os

import torch

from rllight.app.records import printed


def seed_dir(out: str, seed: int) -> str:
    """The folder of one seed's rollouts and fits."""
    return os.path.join(out, f"seed-{seed}")


def sampling_dir(out: str, seed: int, sampling: str | None = None) -> str:
    """The folder of one seed's rollouts of ``sampling`` (None: the run's own, with the probe)."""
    return seed_dir(out, seed) if sampling is None else os.path.join(seed_dir(out, seed), sampling)


def rollout_path(folder: str, k: int) -> str:
    return os.path.join(folder, "rollouts", f"r{k:03d}.pt")


def pooled(parts: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[float, float]:
    """Explained variance and value loss of ``(values, returns)`` pairs pooled, in float64, as value pretraining's
    criterion reads them (``held_out_numbers``); NaN for none or returns that do not vary."""
    from callbacks.value_pretraining import held_out_numbers

    if not parts:
        return float("nan"), float("nan")
    loss, ev = held_out_numbers([(v.double(), r.double()) for v, r in parts])
    return ev, loss


def monte_carlo_returns(rollout) -> torch.Tensor:
    """The Monte-Carlo returns of ``rollout``'s tokens (GAE with lambda 1, gamma 1), computed on zero values, so no
    rounding of R - V + V enters them."""
    from rllight.algorithms import gae

    return gae(rollout.outcome_token_rewards(), torch.zeros(rollout.response_mask.shape), rollout.response_mask,
               1.0, 1.0)[1]


def between_prompts(rollout) -> tuple[torch.Tensor, torch.Tensor]:
    """Each response token's return and its prompt's mean return, in sample (what the prompt alone predicts)."""
    returns = monte_carlo_returns(rollout)
    means = torch.zeros_like(rollout.rewards)
    for group in rollout.group_ids.unique():
        rows = rollout.group_ids == group
        means[rows] = rollout.rewards[rows].float().mean()
    mask = rollout.response_mask.bool()
    return (means[:, None].expand_as(returns))[mask].float(), returns[mask].float()


def stop_of(held_out: list, criterion: dict, min_ev: float | None = None) -> int | None:
    """The rollout (from 1) after which ``ValuePretraining`` with the recipe's ``criterion`` settings (and
    ``min_explained_variance`` ``min_ev``) ends on these held-out numbers; None when it goes on past them."""
    from callbacks.value_pretraining import held_out_numbers

    window = criterion.get("window", 1)
    parts = [(torch.tensor(v), torch.tensor(r)) for v, r in held_out]
    numbers = (held_out_numbers(parts[max(k + 1 - window, 0) : k + 1]) for k in range(len(parts)))
    return replayed_stop(criterion, numbers, min_explained_variance=min_ev)


def replayed_stop(criterion: dict, numbers, **extra) -> int | None:
    """The rollout (from 1) after which ``ValuePretraining`` with the recipe's ``criterion`` settings (and ``extra``)
    ends, observing ``numbers``, one (loss, explained variance) per fit; None when it goes on past them."""
    from callbacks.value_pretraining import ValuePretraining

    keys = ("max_steps", "patience", "min_delta", "min_delta_explained_variance", "window")
    callback = ValuePretraining(**{k: criterion[k] for k in keys if k in criterion}, **extra)
    return next((k + 1 for k, (loss, ev) in enumerate(numbers) if callback.observe(loss, ev)), None)


def criterion_columns(args: argparse.Namespace, criterion: dict | None) -> list[tuple[str, str, float | None]]:
    """(key, label, min_explained_variance) of each replayed stopping criterion."""
    if not args.probe or criterion is None:
        return []
    return [("stop", "recipe's criterion", None)] + [(f"stop_m{m:g}", f"with min EV {m:g}", m) for m in args.min_ev]


def probe_row(args: argparse.Namespace, result: dict, criterion: dict | None) -> dict:
    """The probe's columns of one fit: its explained variance at each window's end, at its best and last, and at
    each replayed stop with the criterion's own window there."""
    probe = [ev for ev, _ in result["probe"]]
    if not probe:
        return {}
    row = {f"probe_{hi}": printed(probe[hi - 1], ".3f") for _, hi in windows_of(args)}
    best = max(range(len(probe)), key=lambda k: probe[k] if probe[k] == probe[k] else -math.inf)
    row.update(probe_best=printed(probe[best], ".3f"), probe_best_at=best + 1, probe_last=printed(probe[-1], ".3f"))
    window = (criterion or {}).get("window", 1)
    parts = [(torch.tensor(v), torch.tensor(r)) for v, r in result["held_out"]]
    for key, _, min_ev in criterion_columns(args, criterion):
        stop = stop_of(result["held_out"], criterion, min_ev)
        row[key] = stop
        if stop is not None:
            row[key + "_window"] = printed(pooled(parts[max(stop - window, 0) : stop])[0], ".3f")
            row[key + "_probe"] = printed(probe[stop - 1], ".3f")
    halves = result.get("probe_halves") or []
    if criterion is not None and halves and len(halves[0]) == 2:
        row.update(split_row(halves, criterion, row.get("stop")))
    return row


def split_row(halves: list, criterion: dict, window_stop: int | None) -> dict:
    """The probe split in two: the recipe's criterion reads the first half after each fit, as ``ValuePretraining``
    with a probe does, and the second half judges the critic where that stops and where the criterion on the window of
    fresh rollouts (``window_stop``) stops; their difference."""
    # probe=1: the criterion counts from the first fit, as with a probe (the number is not read here)
    stop = replayed_stop(criterion, ((loss, ev) for (ev, loss), _ in halves), probe=1)
    second = [judge[0] for _, judge in halves]
    row = {"split_stop": stop}
    if stop is not None:
        row["probe_b_split"] = printed(second[stop - 1], ".3f")
    if window_stop is not None:
        row["probe_b_window"] = printed(second[window_stop - 1], ".3f")
    if stop is not None and window_stop is not None:
        row["probe_b_diff"] = printed(second[stop - 1] - second[window_stop - 1], ".3f")
    return row


def windows_of(args: argparse.Namespace) -> list[tuple[int, int]]:
    """The windows of ``--window`` rollouts the table pools, as (first, end) indices."""
    return [(lo, min(lo + args.window, args.rollouts)) for lo in range(0, args.rollouts, args.window)]


def summary(args: argparse.Namespace, criterion: dict | None = None) -> tuple[list[dict], list[list]]:
    """One row per option and seed (pooled explained variance and loss, overall and per window, and the probe's)
    and one per seed of the between-prompts share; the columns."""
    windows = windows_of(args)
    columns = [["option", "option"], ["seed", "seed"], ["settings", "settings"], ["ev", "EV, rollouts 2+", ".3f"],
               ["loss", "loss, rollouts 2+", ".4f"]]
    columns += [[f"ev_{lo + 1}_{hi}", f"EV {lo + 1}-{hi}", ".3f"] for lo, hi in windows]
    if args.probe:
        columns += [[f"probe_{hi}", f"probe EV after {hi}", ".3f"] for _, hi in windows]
        columns += [["probe_best", "probe EV, best", ".3f"], ["probe_best_at", "best after"],
                    ["probe_last", "probe EV, last", ".3f"]]
        for key, label, _ in criterion_columns(args, criterion):
            columns += [[key, f"stop, {label}"], [key + "_window", "its window EV", ".3f"],
                        [key + "_probe", "probe EV there", ".3f"]]
        if criterion is not None and args.probe >= 2:
            columns += [["split_stop", "stop, criterion on the probe's 1st half"],
                        ["probe_b_split", "2nd half's EV there", ".3f"],
                        ["probe_b_window", "2nd half's EV at the recipe's criterion's stop", ".3f"],
                        ["probe_b_diff", "2nd half: 1st half's stop - recipe's", ".3f"]]
    rows = []
    for seed in args.seeds:
        folder = seed_dir(args.out, seed)
        for name in args.options:
            result = json.load(open(os.path.join(folder, f"{name}.json")))
            parts = [(torch.tensor(v), torch.tensor(r)) for v, r in result["held_out"]]
            ev, loss = pooled(parts[1:])
            settings = " ".join(f"{k}={v}" for k, v in result["settings"].items())
            if result["settings"].get("sampling"):
                settings += f" ({' '.join(args.samplings[result['settings']['sampling']])})"
            row = {"option": name, "seed": seed, "settings": settings,
                   "ev": printed(ev, ".3f"), "loss": printed(loss, ".4f"), **probe_row(args, result, criterion)}
            for lo, hi in windows:
                row[f"ev_{lo + 1}_{hi}"] = printed(pooled(parts[max(lo, 1):hi])[0], ".3f")
            rows.append(row)
        rows += between_rows(args, seed)
    return rows + seed_means(args, rows, columns), columns


def between_rows(args: argparse.Namespace, seed: int) -> list[dict]:
    """The share of the returns' variance between prompts, in sample, per window of ``seed``'s fitted rollouts, a row
    per sampling (the run's own with the probe's share too, then each ``--sampling``'s)."""
    windows, rows = windows_of(args), []
    for sampling in [None, *getattr(args, "samplings", {})]:
        folder = sampling_dir(args.out, seed, sampling)
        load = lambda k: torch.load(rollout_path(folder, k), weights_only=False)  # noqa: E731
        bound = [pooled([between_prompts(load(k)) for k in range(lo, hi)])[0] for lo, hi in windows]
        row = {"option": "(between prompts, in sample" + (f", {sampling})" if sampling else ")"), "seed": seed,
               "settings": "each prompt's mean return",
               **{f"ev_{lo + 1}_{hi}": printed(b, ".3f") for (lo, hi), b in zip(windows, bound)}}
        if args.probe and sampling is None:  # the same share on the probe's rollouts
            row["probe_last"] = printed(pooled([between_prompts(load(args.rollouts + j))
                                                for j in range(args.probe)])[0], ".3f")
        rows.append(row)
    return rows


def seed_means(args: argparse.Namespace, rows: list[dict], columns: list[list]) -> list[dict]:
    """With several seeds and a probe: per option, the mean over seeds of each probe column (the probe after each
    window, at its best and last, and at each replayed stop); for each option after the first, the mean over seeds of
    its difference from the first option on the same seed's probe (paired), the smallest and largest in settings."""
    if len(args.seeds) < 2 or not args.probe:
        return []
    keys = [c[0] for c in columns if c[0].startswith("probe_") and c[0] != "probe_best_at" or c[0].endswith("_probe")]
    names = list(args.options)
    per_seed = {(r["option"], r["seed"]): r for r in rows if r["option"] in names}

    def mean(values: list) -> float | None:
        values = [v for v in values if v is not None]
        return printed(sum(values) / len(values), ".3f") if len(values) == len(args.seeds) else None

    out = [{"option": name, "seed": "mean", "settings": "mean over seeds",
            **{k: mean([per_seed[name, s].get(k) for s in args.seeds]) for k in keys}} for name in names]
    for name in names[1:]:
        row, spans = {"option": f"{name} - {names[0]}", "seed": "mean"}, []
        for k in keys:
            pairs = [(per_seed[name, s].get(k), per_seed[names[0], s].get(k)) for s in args.seeds]
            diffs = [a - b for a, b in pairs if a is not None and b is not None]
            row[k] = mean(diffs)
            if row[k] is not None:
                spans.append(f"{k} {min(diffs):+.3f}..{max(diffs):+.3f}")
        row["settings"] = "paired, each seed's difference: mean; smallest..largest: " + ", ".join(spans)
        out.append(row)
    return out


def table(rows: list[dict], columns: list[list]) -> str:
    def cell(row, column):
        value = row.get(column[0])
        return "-" if value is None else format(value, column[2]) if len(column) > 2 else str(value)

    lines = ["| " + " | ".join(c[1] for c in columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(r, c) for c in columns) + " |" for r in rows]
    return "\n".join(lines)
