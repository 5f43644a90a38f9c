"""Where the time of one RL step goes: a callback that runs the PyTorch profiler over one training step.

Add it to a run (``trainer.callbacks`` in a recipe, or ``--trainer.callbacks+=rllight.profiling.ProfileStep``)::

    trainer:
      callbacks:
        - class_path: rllight.profiling.ProfileStep
          init_args: {step: 2, out: runs/profile}

It profiles the ``step``-th rollout (0-based; later than the first, whose one-time costs would dominate) and
writes ``profile.md`` and ``profile.json`` to ``out``: the wall time of each phase the module and the HF engine
mark (``rllight.rollout``: generation and reward; ``rllight.generate.prefill`` / ``.token``: the prompt pass
and each decoding step; ``rllight.score``: the no-gradient scoring pass; ``rllight.update.forward`` /
``.backward`` / ``.optimizer``), and the operators that took the most time of their own. The share of padded
positions in the update's forward passes is the logged metric ``train/perf/padding_share``.
"""

from __future__ import annotations

import json
import os
import time

import lightning as L
from torch.profiler import ProfilerActivity, profile

PHASES = (
    "rllight.rollout",
    "rllight.generate.prefill",
    "rllight.generate.token",
    "rllight.score",
    "rllight.update.forward",
    "rllight.update.backward",
    "rllight.update.optimizer",
)


def summarize(events, step_seconds: float, row_limit: int = 12) -> dict:
    """Phases and top operators from ``prof.key_averages()``: for each phase its calls, total and mean
    seconds and share of the step; for the ``row_limit`` operators with the most self time, their calls,
    self seconds and share."""
    by_key = {e.key: e for e in events}
    phases = {}
    for name in PHASES:
        if name in by_key:
            e = by_key[name]
            total = e.cpu_time_total / 1e6
            phases[name] = {"calls": e.count, "seconds": total, "mean_seconds": total / max(e.count, 1),
                            "share_of_step": total / step_seconds if step_seconds else None}
    operators = sorted((e for e in events if not e.key.startswith("rllight.")),
                       key=lambda e: e.self_cpu_time_total, reverse=True)[:row_limit]
    ops = [{"name": e.key, "calls": e.count, "self_seconds": e.self_cpu_time_total / 1e6,
            "share_of_step": e.self_cpu_time_total / 1e6 / step_seconds if step_seconds else None}
           for e in operators]
    return {"step_seconds": step_seconds, "phases": phases, "operators": ops}


def to_markdown(summary: dict) -> str:
    """The summary as two markdown tables."""
    lines = [f"One step: {summary['step_seconds']:.2f} s", "", "| phase | calls | seconds | mean (s) | share |",
             "|---|---|---|---|---|"]
    for name, p in summary["phases"].items():
        share = f"{p['share_of_step']:.0%}" if p["share_of_step"] is not None else ""
        lines.append(f"| {name} | {p['calls']} | {p['seconds']:.2f} | {p['mean_seconds']:.4f} | {share} |")
    lines += ["", "| operator (self time) | calls | seconds | share |", "|---|---|---|---|"]
    for op in summary["operators"]:
        share = f"{op['share_of_step']:.0%}" if op["share_of_step"] is not None else ""
        lines.append(f"| {op['name']} | {op['calls']} | {op['self_seconds']:.2f} | {share} |")
    return "\n".join(lines) + "\n"


class ProfileStep(L.Callback):
    """Profile one training step (the ``step``-th rollout of this run, 0-based, counted across epochs; a resumed
    run counts from its resume) on the CPU and write its summary.

    Args:
        step: Which training batch (rollout) to profile.
        out: Folder for ``profile.md`` and ``profile.json`` (None = the run's log folder).
        row_limit: How many operators to list.
    """

    def __init__(self, step: int = 2, out: str | None = None, row_limit: int = 12):
        if step < 0:
            raise ValueError(f"ProfileStep.step must be >= 0, got {step}")
        self.step = step
        self.out = out
        self.row_limit = row_limit
        self._prof = None
        self._start = 0.0
        self._batches = 0  # training batches started in this run (batch_idx starts again at 0 every epoch)
        self.summary: dict | None = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        self._batches += 1
        if self._batches - 1 == self.step and self._prof is None:
            self._prof = profile(activities=[ProfilerActivity.CPU])
            self._prof.__enter__()
            self._start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        if self._prof is None or self.summary is not None:
            return
        seconds = time.perf_counter() - self._start
        self._prof.__exit__(None, None, None)
        self.summary = summarize(self._prof.key_averages(), seconds, self.row_limit)
        folder = self.out or trainer.log_dir or trainer.default_root_dir  # every rank: a collective under DDP
        if trainer.is_global_zero:
            os.makedirs(folder, exist_ok=True)
            with open(os.path.join(folder, "profile.json"), "w") as f:
                json.dump(self.summary, f, indent=2)
            text = to_markdown(self.summary)
            with open(os.path.join(folder, "profile.md"), "w") as f:
                f.write(text)
            print(f"rllight: profile of step {self.step} in {folder}/profile.md\n{text}", flush=True)
