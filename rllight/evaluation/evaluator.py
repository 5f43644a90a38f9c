"""A validation's evaluation passes: sampled and scored in ``run`` (the module's ``validation_step``), gathered
over the ranks, computed and saved in ``finish`` (its ``on_validation_epoch_end``)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from rllight.distributed import Ranks, process_rank_and_world
from rllight.evaluation.accumulate import EvalAccumulator
from rllight.evaluation.settings import EvalSettings


class Evaluator:
    """A validation's evaluation passes: the one ``settings`` describes (n responses per prompt, sampled or
    greedy), and with ``settings.also_greedy`` one greedy answer per prompt (``val/greedy/...``).

    Args:
        settings: ``model.evaluation``.
    """

    def __init__(self, settings: EvalSettings):
        self.settings = settings
        self.results = EvalAccumulator("val")
        self.greedy = EvalAccumulator("val/greedy")
        self.last_per_prompt: dict[str, dict[str, float]] = {}
        """The last validation's overall metrics prompt by prompt (``EvalAccumulator.per_prompt``), for the paired
        before/after comparison of ``evaluate_before_after``."""
        self.last_metrics: dict[str, float] = {}
        """The last validation's metrics (what ``finish`` returned), in float64: the logged copies are float32."""
        self._stream: tuple | None = None  # with settings.sampling_seed: the evaluation's random state between batches

    def passes(self) -> list[tuple[EvalAccumulator, int, bool, list[int], str]]:
        """Each pass as ``(accumulator, n, greedy, ks, file suffix)``."""
        ev = self.settings
        passes = [(self.results, ev.n, ev.greedy, ev.ks, "")]
        if ev.also_greedy:
            passes.append((self.greedy, 1, True, [1], "_greedy"))
        return passes

    def run(self, producer, engine, rows: list[dict]) -> None:
        """Sample and score every pass on ``rows`` with ``producer``, its engine ``engine`` passed the
        evaluation's sampling (``EvalSettings.sampling``), and keep the results."""
        sampling = self.settings.sampling(engine.sampling)
        for results, n, greedy, _, _ in self.passes():
            with self._own_stream():
                rollout = producer.sample(rows, n, greedy=greedy, training=False, sampling=sampling)
            kept = set(rollout.extras["kept_rows"])
            if kept:
                results.update_rollout([rows[i] for i in sorted(kept)], n, rollout)
            results.drop([row for i, row in enumerate(rows) if i not in kept])

    @contextmanager
    def _own_stream(self) -> Iterator[None]:
        """With ``settings.sampling_seed``: within the block torch draws from the evaluation's stream (seeded at a
        validation's first batch, plus the process's rank, and carried from batch to batch); the run's stream is
        restored after. Otherwise nothing changes."""
        seed = self.settings.sampling_seed
        if seed is None:
            yield
            return
        cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
        with torch.random.fork_rng(devices=[torch.cuda.current_device()] if cuda else []):
            if self._stream is None:
                rank, _ = process_rank_and_world()
                torch.manual_seed(seed + rank)
            else:
                torch.set_rng_state(self._stream[0])
                if cuda and self._stream[1] is not None:
                    torch.cuda.set_rng_state(self._stream[1])
            yield
            self._stream = (torch.get_rng_state(), torch.cuda.get_rng_state() if cuda else None)

    def finish(self, trainer, rl_step: int) -> dict[str, float]:
        """avg@k, pass@k (unbiased) and maj@k with standard errors, overall and per data source (``val/...``,
        and ``val/greedy/...`` at k = 1 with ``also_greedy``); ``val/accuracy`` is the greedy accuracy where
        there is one, else the mean correctness of every sampled response. Under DDP the ranks' results are
        gathered first. Outside a sanity check, global rank 0 writes a JSON of every number and a per-row JSONL
        of the responses to ``<log dir>/evaluation``, named by the RL steps (rollouts) trained, ``rl_step``, as the
        progress lines count them (``val_step<rl_step>``; the JSON also holds the optimizer updates). The results
        are reset for the next validation."""
        ev = self.settings
        metrics = {}
        self.last_per_prompt = {}
        # Every rank asks: under DDP the log folder is a collective (rank 0's, broadcast), so a question asked on rank 0
        # alone would wait for ranks that have gone on to the next gather.
        log_dir = getattr(trainer, "log_dir", None) or getattr(trainer, "default_root_dir", ".")
        folder = os.path.join(log_dir, "evaluation")
        for results, _, _, ks, suffix in self.passes():
            if trainer.world_size > 1:  # every rank evaluated its share of the rows
                results.merge(Ranks(trainer).gather_objects(results.state()))
            metrics.update(results.compute(ks, ev.bootstrap, ev.confidence, ev.seed))
            self.last_per_prompt.update(results.per_prompt(ks))
            if trainer.is_global_zero and results.records and not trainer.sanity_checking:
                results.write(folder, ks, name=f"val_step{rl_step}{suffix}", bootstrap=ev.bootstrap,
                              confidence=ev.confidence, seed=ev.seed,
                              extra={"settings": vars(ev), "rl_step": int(rl_step),
                                     "global_step": int(trainer.global_step)})
        if self.results.records:
            greedy = ev.also_greedy and self.greedy.records
            metrics["val/accuracy"] = metrics["val/greedy/avg@1" if greedy else f"val/avg@{ev.n}"]
            metrics["val/truncated_ratio"] = metrics.get("val/truncated_ratio", 0.0)
        for results, *_ in self.passes():
            results.reset()
        self._stream = None
        self.last_metrics = dict(metrics)
        return metrics
