"""tools/bench_step.py's timing report: the rllight side's medians, the comparison with TRL and with asynchronous
rollouts as printed (``print_rllight``, ``print_comparison``, ``print_async``), and the record of a timing run
(``record_timing``)."""

from __future__ import annotations

import argparse
import os

from bench_step_sides import PHASES, ROOT

from rllight.app.records import printed, tool_record

def gib(kb: float | None) -> str:
    return "-" if kb is None else f"{kb / 1024**2:.2f}"


def print_rllight(r: dict) -> None:
    print(f"\nrllight: {r['settings']}")
    print(f"median of steps 2..{r['steps'] + 1}:")
    print(f"  {'step s':<22}{r['step']:.4g}")
    for name in (*PHASES, "other"):
        print(f"  {name + ' s':<22}{r[name]:.4g}")
    print(f"  {'generated tokens/s':<22}{r['generated_tokens_per_s']:.4g}")
    print(f"  {'step tokens/s':<22}{r['step_tokens_per_s']:.4g}")
    print(f"  {'tokens per step':<22}{r['tokens_per_step']:.0f}")
    print(f"  {'peak RSS GiB':<22}{gib(r['peak_rss_kb'])}")
    if r["peak_cuda_bytes"] is not None:
        print(f"  {'peak CUDA GiB':<22}{r['peak_cuda_bytes'] / 1024**3:.2f}")


def print_comparison(args: argparse.Namespace, rllight: dict, trl: dict) -> None:
    print(f"\nTRL {trl['trl']} (transformers {trl['transformers']}, torch {trl['torch']}): GRPOTrainer, same config "
          f"and prompts, both sides in {args.precision}"
          + (" (TRL's bf16=True)" if args.precision == "bf16-mixed" else ""))
    rllight_only = [option for option, given in (("--set", args.overrides), ("--dtype", args.dtype),
                                                  (f"--engine {args.engine}", args.engine != "hf")) if given]
    if rllight_only:
        print(f"  note: {', '.join(rllight_only)} changed the rllight side only")
    if rllight["peak_cuda_bytes"] is not None:
        print("  note: rllight ran on CUDA, TRL on the CPU")
    print(f"  {'':<22}{'rllight':>10}{'trl':>10}")
    print(f"  {'step s':<22}{rllight['step']:>10.4g}{trl['step']:>10.4g}")
    print(f"  {'tokens per step':<22}{rllight['tokens_per_step']:>10.0f}{trl['tokens_per_step']:>10.0f}")
    print(f"  {'step tokens/s':<22}{rllight['step_tokens_per_s']:>10.4g}{trl['step_tokens_per_s']:>10.4g}")
    print(f"  {'peak RSS GiB':<22}{gib(rllight['peak_rss_kb']):>10}{gib(trl['peak_rss_kb']):>10}")


def print_async(args: argparse.Namespace, sync: dict, asynchronous: dict) -> None:
    print(f"\nasynchronous rollouts (worker process, max_staleness {args.staleness}; {asynchronous['threads']} "
          f"thread(s) each for trainer and worker) against synchronous (in-process engine, every core):")
    print(f"  {'':<22}{'sync':>10}{'async':>10}")
    for label, key, spec in (("step s", "step", ".4g"), ("rollout wait s", "rollout", ".4g"),
                             ("update s", "update", ".4g"), ("tokens per step", "tokens_per_step", ".0f"),
                             ("step tokens/s", "step_tokens_per_s", ".4g")):
        print(f"  {label:<22}{sync[key]:>10{spec}}{asynchronous[key]:>10{spec}}")
    print(f"  {'peak RSS GiB':<22}{gib(sync['peak_rss_kb']):>10}{gib(asynchronous['peak_rss_kb']):>10}"
          "  (the trainer's process; the worker holds another copy of the policy)")


TIMING_COLUMNS = [
    ["side", "side"], ["step_s", "step s", ".4g"], ["rollout_s", "rollout s (async: wait)", ".4g"],
    ["reward_s", "reward s", ".4g"], ["score_s", "score s", ".4g"], ["update_s", "update s", ".4g"],
    ["other_s", "other s", ".4g"], ["generated_tokens_per_s", "generated tokens/s", ".4g"],
    ["step_tokens_per_s", "step tokens/s", ".4g"], ["tokens_per_step", "tokens per step", ".0f"],
    ["peak_rss_gib", "peak RSS GiB", ".2f"], ["peak_cuda_gib", "peak CUDA GiB", ".2f"],
    ["heldout_before", "held-out accuracy before", ".3f"], ["heldout_after", "after", ".3f"],
    ["heldout_gain_se", "± se of the gain", ".3f"], ["async_over_sync", "async / sync (steps per second)", ".2f"],
    ["rllight_over_trl", "TRL s/step / rllight s/step", ".2f"]]
"""The columns of a timing run's record; those no row fills are left out."""
TIMED = ("step", *PHASES, "other", "generated_tokens_per_s", "step_tokens_per_s", "tokens_per_step")


def timing_row(side: str, r: dict, keys: tuple[str, ...], cuda: bool = False) -> dict:
    """One side's row of the record: ``keys`` of its medians and its peak RSS (and CUDA memory), as printed."""
    row = {"side": side}
    for key in keys:
        row[f"{key}_s" if key in ("step", *PHASES, "other") else key] = printed(
            r[key], ".0f" if key == "tokens_per_step" else ".4g")
    row["peak_rss_gib"] = printed(None if r["peak_rss_kb"] is None else r["peak_rss_kb"] / 1024**2, ".2f")
    if cuda and r.get("peak_cuda_bytes") is not None:
        row["peak_cuda_gib"] = printed(r["peak_cuda_bytes"] / 1024**3, ".2f")
    return row


def record_timing(args: argparse.Namespace, rllight: dict, asynchronous: dict | None, trl: dict | None,
                  learned: dict | None, last: dict) -> None:
    """The record of a timing run (``--record``): a row per side, ``last`` (the last lines' values) as summary."""
    if not args.record:
        return
    def heldout(side: str) -> dict:  # the side's held-out accuracy before and after (--heldout), as printed
        if learned is None:
            return {}
        return {"heldout_before": printed(learned["start"], ".3f"),
                "heldout_after": printed(learned["sides"][side]["accuracy"], ".3f"),
                "heldout_gain_se": printed(learned["sides"][side]["gain_se"], ".3f")}

    rows = [{**timing_row("rllight" + (" synchronous" if asynchronous else ""), rllight, TIMED, cuda=True),
             **heldout("rllight")}]
    if asynchronous is not None:
        rows.append({**timing_row(f"rllight asynchronous (max_staleness {args.staleness}, "
                                  f"{asynchronous['threads']} threads each)", asynchronous,
                                  ("step", "rollout", "update", "tokens_per_step", "step_tokens_per_s")),
                     "async_over_sync": last["async_over_sync"]})
    if trl is not None:
        rows.append({**timing_row(f"TRL {trl['trl']}", trl, ("step", "tokens_per_step", "step_tokens_per_s")),
                     **heldout("trl"), "rllight_over_trl": last["rllight_over_trl"]})
    model = os.path.basename(args.model_dir) if args.model_dir else "SmolLM2-135M-Instruct"
    setup = f"{model}, {os.path.relpath(args.recipe, ROOT)}, {args.precision}, {args.steps} steps, seed {args.seed}"
    if trl is not None:
        id, section, headline = "bench-step-trl", "Against TRL", "{rllight_over_trl:.2f}x TRL's steps per second"
        title = f"rllight against TRL {trl['trl']}'s GRPOTrainer, seconds per RL step: {setup}"
    elif asynchronous is not None:
        id, section = "bench-step-async", "Asynchronous and stale rollouts"
        headline = "{async_over_sync:.2f}x the synchronous steps per second"
        title = (f"Asynchronous rollouts (max_staleness {args.staleness}) against synchronous, seconds per RL step: "
                 f"{setup}")
    else:
        id, section, headline = "bench-step", "Speed and memory", "{rllight_step_s:.4g} s per RL step"
        title = f"Seconds per RL step by phase: {setup}"
    used = {k for row in rows for k, v in row.items() if v is not None}
    tool_record(args, id=id, section=section, title=title, headline=headline, summary=last, rows=rows,
                columns=[c for c in TIMING_COLUMNS if c[0] in used],
                note=f"rllight: {rllight['settings']}. Each number is the median over steps 2..{args.steps} (the first "
                     "step, a warm-up, left out); peak RSS is the training process's"
                     + (f"; TRL {trl['trl']} (transformers {trl['transformers']}, torch {trl['torch']}) on the same "
                        "config and prompts, sampling independently" if trl is not None else "")
                     + (f"; held-out: greedy accuracy on {args.heldout} problems, the gain's standard error paired"
                        if learned is not None else "") + ".")
