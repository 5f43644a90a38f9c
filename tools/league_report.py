"""tools/league.py's statistics over seeds and problems, its table and record, and the results page made from a
record: the accuracy table, the figure of each method's gain with its standard error, the run table and the
mechanisms' signals, the missing runs and the provenance (``write_league``, ``write_page``). The statistics are
defined in tools/league.py's docstring."""

from __future__ import annotations

import collections
import importlib.util
import json
import math
import os
import statistics
import sys

sys.path.append(os.path.dirname(os.path.abspath(__file__)))  # the tools beside it

from results_pages import provenance, table, tables  # noqa: E402

from rllight.app.records import make_record, printed, tool_record  # noqa: E402
from rllight.evaluation import paired_se  # noqa: E402
from rllight.evaluation.files import write_atomic, write_json  # noqa: E402

REFERENCE = "grpo"
"""The method every other is compared with (the flag column)."""
FLAG_SE = 2.0
"""A method is flagged where its gain is more than this many standard errors below the reference's."""
SIGNALS = [["ev_pretraining_window_end", "critic EV, pretraining's last window", ".3f"],
           ["ev_pretraining_end", "critic EV, last pretraining rollout", ".3f"],
           ["ev_pretraining_probe_end", "critic EV, pretraining's probe at its end", ".3f"],
           ["pretraining_rollouts", "value-pretraining rollouts", ".1f"],
           ["ev_rl_last_half", "critic EV, RL last half", ".3f"],
           ["kept_share", "kept-group share", ".3f"], ["extra_draws", "extra sampling rounds", ".1f"],
           ["value_loss", "critic loss, RL last half", ".4f"], ["calibration_corr", "critic calibration corr", ".3f"],
           ["vespo_ess", "VESPO ESS", ".3f"], ["vespo_log_weight_absmax", "VESPO max abs log-weight", ".3f"],
           ["clipfrac_low", "clip fraction low", ".4f"], ["clipfrac_high", "clip fraction high", ".4f"]]
"""The mechanisms' signals (tools/league.py's ``signals``), each the mean over a method's seeds."""
RUN_COLUMNS = [["method", "method"], ["recipe", "recipe"], ["sampling", "prompts x responses"], ["lr", "policy lr"],
               ["critic_lr", "critic lr"], ["temperature", "temperature"], ["rl_steps", "RL steps", ".1f"],
               ["updates", "optimizer updates", ".1f"], ["responses", "responses", ".0f"],
               ["tokens", "tokens", ".0f"], ["wall_s", "wall time (s)", ".0f"]]
"""The budget each method actually spent and its own settings, means over its seeds."""
CURVE_COLUMNS = [["tokens_to_grpo", f"tokens to {REFERENCE}'s greedy accuracy", ".0f"],
                 ["reached_grpo", "seeds that reached it"]]
"""With ``--curve-every``: the response tokens a method generated until its greedy accuracy first reached the
reference's (the mean over the reference's seeds of its accuracy after training), the mean over the seeds that reached
it, and how many did."""


def finite_mean(values: list[float]) -> float | None:
    """The mean of the finite ``values`` (NaN marks a step without the quantity), None where there is none."""
    values = [v for v in values if v is not None and math.isfinite(v)]
    return sum(values) / len(values) if values else None


def _mean(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.fmean(values) if values else None


def per_problem_gain(runs: list[dict], metric: str) -> tuple[dict[str, float], dict[str, float]] | None:
    """Each problem's value before and after training of ``metric``, averaged over the seeds of ``runs``, on the
    problems every run has; None where a run has no per-problem values."""
    pairs = [r["per_problem"][metric] for r in runs]
    if not pairs or any(not p["before"] or not p["after"] for p in pairs):
        return None
    problems = sorted(set.intersection(*(set(p["before"]) & set(p["after"]) for p in pairs)))
    before = {s: statistics.fmean(p["before"][s] for p in pairs) for s in problems}
    after = {s: statistics.fmean(p["after"][s] for p in pairs) for s in problems}
    return before, after


def seed_gains(runs: list[dict], metric: str, problems: list[str]) -> list[float]:
    """Each of ``runs``' seed-level gain: the mean over ``problems`` of its after - before."""
    values = [r["per_problem"][metric] for r in runs]
    return [statistics.fmean(v["after"][p] - v["before"][p] for p in problems) for v in values]


def seed_se(gains: list[float]) -> float | None:
    """The standard error over the seeds of their seed-level ``gains``: sd_s / sqrt(S), Bessel-corrected; None with
    fewer than two seeds."""
    return statistics.stdev(gains) / math.sqrt(len(gains)) if len(gains) >= 2 else None


def combined_se(*parts: float | None) -> float | None:
    """sqrt of the sum of the squares of the known ``parts``; None where none is known."""
    known = [p for p in parts if p is not None]
    return math.sqrt(sum(p * p for p in known)) if known else None


def gain(runs: list[dict], metric: str) -> dict:
    """``metric`` of one method over its seeds ``runs``: before and after (means over problems and seeds), the gain,
    its standard error over the problems (``se_problems``, paired), over the seeds (``se_seeds``) and both together
    (``se``), and the seed-level gains' min and max."""
    averaged = per_problem_gain(runs, metric)
    if averaged is None or not averaged[0]:
        return {}
    before, after = averaged
    seeds = seed_gains(runs, metric, list(before))
    problems, over_seeds = paired_se(before, after), seed_se(seeds)
    return {"before": statistics.fmean(before.values()), "after": statistics.fmean(after.values()),
            "gain": statistics.fmean(after[s] - before[s] for s in before), "se": combined_se(problems, over_seeds),
            "se_problems": problems, "se_seeds": over_seeds, "seed_min": min(seeds), "seed_max": max(seeds)}


def versus(runs: list[dict], reference: list[dict], metric: str) -> dict:
    """The gain of ``runs`` less that of ``reference``, problem by problem on the problems both have, with its
    standard error (over those problems, and over each method's seeds, taken as independent), and whether it is
    more than ``FLAG_SE`` standard errors below zero."""
    ours, theirs = per_problem_gain(runs, metric), per_problem_gain(reference, metric)
    if ours is None or theirs is None:
        return {}
    common = sorted(set(ours[0]) & set(theirs[0]))
    if not common:
        return {}
    d_ours = {s: ours[1][s] - ours[0][s] for s in common}
    d_theirs = {s: theirs[1][s] - theirs[0][s] for s in common}
    diff = statistics.fmean(d_ours[s] - d_theirs[s] for s in common)
    se = combined_se(paired_se(d_theirs, d_ours), seed_se(seed_gains(runs, metric, common)),
                     seed_se(seed_gains(reference, metric, common)))
    return {"diff": diff, "se": se, "below": None if se is None else diff < -FLAG_SE * se}


def table_groups(metrics: dict[str, tuple[str, str]]) -> list:
    """The record's ``tables`` (``rllight.app.records.make_record``): greedy accuracy with the comparison against the
    reference, the other metrics, the budget spent, and the mechanisms' signals; each with the method first."""
    first, others = next(iter(metrics)), [k for k in metrics][1:]
    parts = ("before", "after", "gain", "se", "seed_min", "seed_max")
    against = ["vs_grpo", "vs_grpo_se", "below_grpo"]
    return [[f"{metrics[first][1].capitalize()}, and against {REFERENCE}",
             ["method", "seeds", "missing"] + [f"{first}_{p}" for p in parts] + against],
            [" and ".join(metrics[k][1] for k in others).capitalize(),
             ["method"] + [f"{k}_{p}" for k in others for p in parts]],
            ["The budget each method spent and its own settings (means over its seeds)",
             ["method"] + [c[0] for c in RUN_COLUMNS[1:] + CURVE_COLUMNS]],
            ["The mechanisms' signals (means over the seeds)", ["method"] + [c[0] for c in SIGNALS]]]


def columns(metrics: dict[str, tuple[str, str]]) -> list:
    """The record's columns: the accuracy table's (up to ``recipe``), then the run table's and the signals'."""
    accuracy = [["method", "method"], ["seeds", "seeds"], ["missing", "missing seeds"]]
    for key, (_, label) in metrics.items():
        accuracy += [[f"{key}_before", f"{label} before", ".3f"], [f"{key}_after", "after", ".3f"],
                     [f"{key}_gain", "gain", "+.3f"], [f"{key}_se", "± se", ".3f"],
                     [f"{key}_seed_min", "seed min", "+.3f"], [f"{key}_seed_max", "seed max", "+.3f"]]
    accuracy += [["vs_grpo", f"gain − {REFERENCE}'s", "+.3f"], ["vs_grpo_se", "± se", ".3f"],
                 ["below_grpo", f"> {FLAG_SE:g} se below {REFERENCE}"]]
    return accuracy + RUN_COLUMNS[1:] + CURVE_COLUMNS + SIGNALS


def method_row(method: str, recipe: str, planned: list[int], runs: list[dict], reference: list[dict],
               metrics: dict) -> dict:
    """One method's row: its seeds, what its finished ``runs`` measured (nothing for a method without one), and
    its greedy gain against the ``reference`` method's runs."""
    row = {"method": method, "recipe": recipe, "seeds": ", ".join(str(r["seed"]) for r in runs) or None,
           "missing": ", ".join(str(s) for s in planned if s not in {r["seed"] for r in runs}) or None}
    if not runs:
        return row
    for key in metrics:
        stats = gain(runs, key)
        for part, spec in (("before", ".3f"), ("after", ".3f"), ("gain", "+.3f"), ("se", ".3f"),
                           ("seed_min", "+.3f"), ("seed_max", "+.3f")):
            row[f"{key}_{part}"] = printed(stats.get(part), spec)
    if reference and method != REFERENCE:
        against = versus(runs, reference, "greedy")
        row["vs_grpo"], row["vs_grpo_se"] = printed(against.get("diff"), "+.3f"), printed(against.get("se"), ".3f")
        row["below_grpo"] = None if against.get("below") is None else ("yes" if against["below"] else "no")
    first = runs[0]
    row["sampling"] = " / ".join(sorted({f"{r['prompts']} x {r['group_size']}" for r in runs}))
    row["lr"], row["critic_lr"], row["temperature"] = first.get("lr"), first.get("critic_lr"), first.get("temperature")
    for key, _, spec in RUN_COLUMNS[6:]:
        row[key] = printed(_mean([r.get(key) for r in runs]), spec)
    for key, _, spec in SIGNALS:
        row[key] = printed(_mean([r["signals"].get(key) for r in runs]), spec)
    row.update(tokens_to_reference(runs, reference))
    return row


def tokens_to_reference(runs: list[dict], reference: list[dict]) -> dict:
    """``tokens_to_grpo`` and ``reached_grpo`` of one method's ``runs`` (``CURVE_COLUMNS``); nothing where no run has
    a curve or the reference has no accuracy after training."""
    curves = [r["curve"] for r in runs if r.get("curve")]
    level = _mean([((r.get("metrics") or {}).get("greedy") or {}).get("after") for r in reference])
    if level is None or not curves:
        return {}
    tokens = [next((t for _, greedy, t in c if greedy is not None and greedy >= level - 1e-12), None) for c in curves]
    reached = [t for t in tokens if t is not None]
    return {"tokens_to_grpo": printed(_mean(reached), ".0f"), "reached_grpo": f"{len(reached)}/{len(curves)}"}


def missing_runs(runs: list[dict], done: dict, failed: dict) -> list[str]:
    """Each planned run that has not finished, and why."""
    out = []
    for run in runs:
        key = (run["method"], run["seed"])
        if key in done:
            continue
        why = failed.get(key)
        state = "not run yet" if why is None else f"failed (exit {why.get('returncode')})"
        out.append(f"{key[0]} seed {key[1]}: {state}")
    return out


def where_run(done: dict) -> str:
    """Where and on which code the finished runs ran (a league spans sittings, and machines): each machine line
    and commit with its number of runs."""
    def counted(key: str) -> str:
        counts = collections.Counter(r.get(key) or "not recorded" for r in done.values())
        return "; ".join(f"{value} ({n} run{'s' if n > 1 else ''})" for value, n in sorted(counts.items()))

    return f"Runs made on: {counted('machine')}. Code (commit at each run's start): {counted('commit')}." if done \
        else ""


def league_fields(spent: dict, metrics: dict, runs: list[dict], done: dict, failed: dict) -> dict:
    """The record's fields (``tool_record``'s keywords) of the league so far."""
    order = {}
    for run in runs:
        order.setdefault(run["method"], (run["recipe"], []))[1].append(run["seed"])
    finished = {m: [done[m, s] for s in seeds if (m, s) in done] for m, (_, seeds) in order.items()}
    rows = [method_row(m, recipe, seeds, finished[m], finished.get(REFERENCE, []), metrics)
            for m, (recipe, seeds) in order.items()]
    k = spent["k"]
    missing = missing_runs(runs, done, failed)
    summary = {f"{r['method']}_greedy_{part}": r[f"greedy_{part}"] for r in rows for part in ("gain", "se")
               if r.get(f"greedy_{part}") is not None}
    summary.update(runs=len(done), missing=len(missing))
    shown = [r["method"] for r in rows if r.get("greedy_gain") is not None and r.get("greedy_se") is not None]
    return dict(
        id="league", section="Methods on the quickstart task", columns=columns(metrics), rows=rows, summary=summary,
        tables=table_groups(metrics),
        title=f"{len(order)} methods on the quickstart task at one budget: {spent['rollouts']} rollouts of "
              f"{spent['prompts'] * spent['responses']} responses, {spent['precision']}, over seeds",
        note=f"Each method's recipe (tools/league.py) for {spent['rollouts']} rollouts with a policy update of "
             f"{spent['prompts']} prompts x {spent['responses']} responses (a recipe with one response per prompt "
             f"draws {spent['prompts'] * spent['responses']} prompts), responses of at most "
             f"{spent['max_new_tokens']} tokens, precision {spent['precision']}, each recipe's own learning rates "
             f"and temperature. Evaluated before and after on the same {spent['val_size']} held-out problems: one "
             f"greedy answer and {k} samples each. Gain: the per-problem after-minus-before difference averaged over "
             f"seeds and problems, ± its standard error over the problems and the seeds (the root of the sum of "
             f"both squared; a method with one seed has the problems' only); seed min and max: the seed-level "
             f"gains. Against {REFERENCE}: the greedy gain less {REFERENCE}'s, problem by problem, ± its standard "
             f"error over the problems and both methods' seeds; flagged where below -{FLAG_SE:g} standard errors. "
             "Means over seeds: RL steps, optimizer updates, "
             "responses and tokens generated, wall time and the mechanisms' signals. "
             + (f"Missing: {'; '.join(missing)}. " if missing else "No run is missing. ") + where_run(done),
        headline=", ".join(f"{m} {{{m}_greedy_gain:+.3f}} ± {{{m}_greedy_se:.3f}}" for m in shown) or None)


def write_league(args, spent: dict, metrics: dict, runs: list[dict], done: dict, failed: dict,
                 final: bool = False) -> dict:
    """The league so far: ``<out>/league.json`` and the page (``--page``, default ``<out>/league.md``; its figure
    only when ``final``); at the end, with ``--record``, the record and its figure beside it (``<id>.png``). Returns
    the record it rendered."""
    fields = league_fields(spent, metrics, runs, done, failed)
    headline = fields.pop("headline")
    record = make_record(**fields, command=args.record_command)  # what the record holds, written or not
    if final and args.record:
        figure = f"{args.record_id or fields['id']}.png" if importlib.util.find_spec("matplotlib") else None
        # the record first: its commit is the tree's before this writes anything tracked (the figure beside it)
        path = tool_record(args, **fields, headline=headline, figure=figure)
        with open(path) as f:
            record = json.load(f)
        if figure:
            plot_gains(record, os.path.join(os.path.dirname(os.path.abspath(path)), figure))
    results = [{k: v for k, v in r.items() if k != "per_problem"} for r in done.values()]
    payload = {"budget": spent, "missing": missing_runs(runs, done, failed), "record": record, "runs": results}
    write_json(os.path.join(args.out, "league.json"), payload)
    write_page(record, args.page or os.path.join(args.out, "league.md"), plot=final)
    if final:
        print("\n".join(table(record["columns"][:[c[0] for c in record["columns"]].index("recipe")], record["rows"])))
    return record


def write_page(record: dict, path: str, plot: bool = True) -> str:
    """The results page of a league ``record`` at ``path`` (markdown): its title and note, its tables (the record's
    ``tables``), the figure (``<path stem>.png``, with ``plot`` and matplotlib) and its provenance. Returns the
    page's text."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    figure = os.path.splitext(path)[0] + ".png"
    why = plot_gains(record, figure) if plot else "the figure is drawn when the league ends"
    out = [f"# {record['title']}", "", record.get("note", ""), ""] + tables(record)
    out += ["", f"![each method's gain ± its standard error]({os.path.basename(figure)})" if why is None
            else f"No figure: {why}."]
    text = "\n".join(out + provenance(record)) + "\n"
    write_atomic(path, text)
    return text


def plot_gains(record: dict, path: str) -> str | None:
    """Each method's gain of each metric with ± its standard error (bars) and its seed-level min and max (x), to
    ``path``; None when written, else why not."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        print("league: no figure: matplotlib is not installed (pip install -e '.[plot]')", file=sys.stderr)
        return "matplotlib is not installed"
    metrics = [(c[0][:-len("_gain")], c[1]) for c in record["columns"] if c[0].endswith("_gain")]
    labels = {c[0][:-len("_before")]: c[1][:-len(" before")] for c in record["columns"] if c[0].endswith("_before")}
    rows = [r for r in record["rows"] if any(r.get(f"{m}_gain") is not None for m, _ in metrics)]
    if not rows:
        return "no method has finished a run"
    fig = Figure(figsize=(4 * len(metrics), 0.45 * len(rows) + 1.8), layout="constrained")
    for ax, (metric, _) in zip(fig.subplots(1, len(metrics), squeeze=False)[0], metrics):
        names = [r["method"] for r in rows]
        gains = [r.get(f"{metric}_gain") for r in rows]
        ses = [r.get(f"{metric}_se") or 0.0 for r in rows]
        ys = list(range(len(rows)))[::-1]
        shown = [(y, g, s) for y, g, s in zip(ys, gains, ses) if g is not None]
        ax.errorbar([g for _, g, _ in shown], [y for y, _, _ in shown], xerr=[s for _, _, s in shown], fmt="o",
                    capsize=3)
        for y, r in zip(ys, rows):
            seeds = [r.get(f"{metric}_seed_min"), r.get(f"{metric}_seed_max")]
            ax.plot([v for v in seeds if v is not None], [y] * sum(v is not None for v in seeds), "x", color="C1")
        ax.axvline(0.0, color="0.6", linewidth=0.8)
        ax.set_yticks(ys, names)
        ax.set_title(f"{labels.get(metric, metric)}: gain")
    fig.suptitle("gain after - before, ± 1 standard error (bars); seed-level min and max (x)", fontsize=9)
    fig.savefig(path, dpi=100)
    return None


__all__ = ["finite_mean", "gain", "league_fields", "versus", "write_league", "write_page"]
