"""Evaluation: the recipe's sampling settings for it, and the accumulator the validation loop feeds.

``EvalSettings`` is ``model.evaluation`` in a recipe: how many responses to sample per prompt and how,
separately from training's sampling. ``EvalAccumulator`` collects every scored response of a validation
epoch and computes avg@k, pass@k and maj@k with standard errors, overall and per ``data_source``, with
the estimators of ``rllight.algorithms.evaluation``; ``write`` saves every number and every response, so
that two runs can be compared prompt by prompt (join the row files on ``source``).

``Evaluator`` runs a validation's passes with them (the module's ``validation_step`` and
``on_validation_epoch_end`` call ``Evaluator.run`` and ``Evaluator.finish``)::

    run:     acc.update_rollout(rows, settings.n, rollout)     # rows kept, in order
             acc.drop(dropped_rows)                           # prompts too long to ask
    finish:  acc.merge(all_gather_object(acc.state()))      # under DDP only
             acc.compute(settings.ks); acc.write(log_dir, settings.ks); acc.reset()
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from rllight.algorithms.evaluation import Estimate, avg_at_k, bootstrap_interval, maj_at_k, pass_at_k_over_prompts
from rllight.distributed import process_rank_and_world
from rllight.errors import RecipeError
from rllight.rewards.base import last_number

if TYPE_CHECKING:
    from rllight.rollout.base import Sampling


def _canonical_number(text: str) -> str | None:
    """``text`` as a canonical number ("1,200" -> "1200", "3.50" -> "3.5", "-0" -> "0"); None if it is not one."""
    text = text.strip().replace(",", "")
    if not re.fullmatch(r"[-+]?(\d+(\.\d*)?|\.\d+)", text):
        return None
    sign = "-" if text.startswith("-") else ""
    whole, _, frac = text.lstrip("+-").partition(".")
    whole, frac = whole.lstrip("0") or "0", frac.rstrip("0")
    out = f"{whole}.{frac}" if frac else whole
    return "0" if out == "0" else sign + out


def _last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}``, nested braces included; None if there is none."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 0, start + len("\\boxed")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1 : j]
    return None  # unbalanced: the response was cut inside the box


def extract_answer(text: str) -> str | None:
    """The final answer a response commits to, as a key for majority voting: the content of its last
    ``\\boxed{}`` if any, else its last number. Numbers are written canonically ("1,200" and "1200.0"
    vote together); other boxed content is kept without spaces and ``$``. None when there is neither.

    Only the vote uses it: whether the winning answer is right is the reward's verdict on a response
    that gave it (``rllight.algorithms.maj_at_k``).
    """
    boxed = _last_boxed(text)
    if boxed is not None:
        content = "".join(boxed.replace("$", "").split())
        return _canonical_number(content) or content or None
    number = last_number(text)
    return _canonical_number(number) if number is not None else None


class EvalSettings:
    """How evaluation samples, separately from training (``model.evaluation``). Greedy: ``n: 1`` and
    ``temperature: 0``.

    Args:
        n: Responses sampled per prompt.
        temperature: Sampling temperature; 0 decodes greedily (then ``n`` must be 1: the responses would
            all be the same).
        top_p: Nucleus sampling threshold (1.0 = off).
        top_k: Top-k sampling (0 = off).
        max_new_tokens: Longest response, in tokens (None = the rollout engine's ``max_new_tokens``).
        ks: The k of avg@k, pass@k and maj@k, each in 1..n (None = 1 and n).
        bootstrap: Resamples of a percentile bootstrap interval over prompts for each metric (0 = none; the
            standard error is always reported).
        confidence: Coverage of the bootstrap interval.
        seed: Seed of the bootstrap resampling.
        also_greedy: When sampling (``temperature`` > 0), also decode one greedy response per prompt and
            report its metrics as ``val/greedy/...``; ``val/accuracy`` is then the greedy accuracy (the
            single number a before/after comparison usually quotes), else the mean over the samples.
        sampling_seed: Sample from a torch random stream of the evaluation's own, seeded with this at the start of
            every validation: its numbers then depend only on the weights and this seed (an evaluation inside a
            run equals ``rllight validate`` of the same weights), and evaluating leaves the training's random
            streams as they were. None: sample from the run's streams (seeded by ``seed_everything``), which each
            evaluation advances. Engines that sample in this process only (``HFEngine``); a worker or vLLM
            engine has its own seed.
    """

    def __init__(
        self,
        n: int = 1,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        max_new_tokens: int | None = None,
        ks: list[int] | None = None,
        bootstrap: int = 0,
        confidence: float = 0.95,
        seed: int = 0,
        also_greedy: bool = False,
        sampling_seed: int | None = None,
    ):
        key = "model.evaluation"
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise RecipeError(f"{key}.n must be an integer >= 1 (responses per prompt), got {n!r}")
        if not isinstance(temperature, (int, float)) or not math.isfinite(temperature) or temperature < 0:
            raise RecipeError(f"{key}.temperature must be >= 0 (0 = greedy), got {temperature!r}")
        if temperature == 0 and n > 1:
            raise RecipeError(f"{key}.n is {n} with temperature 0 (greedy): every response would be the same; set "
                              f"{key}.temperature > 0 to sample, or n: 1")
        if not isinstance(top_p, (int, float)) or not 0 < top_p <= 1:
            raise RecipeError(f"{key}.top_p must be in (0, 1], got {top_p!r}")
        if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
            raise RecipeError(f"{key}.top_k must be an integer >= 0 (0 = off), got {top_k!r}")
        if max_new_tokens is not None and (not isinstance(max_new_tokens, int) or max_new_tokens < 1):
            raise RecipeError(f"{key}.max_new_tokens must be >= 1 or null (the engine's), got {max_new_tokens!r}")
        if ks is None:
            ks = sorted({1, n})
        if not ks:
            raise RecipeError(f"{key}.ks is empty; list the k of pass@k, e.g. [1, {n}]")
        for k in ks:
            if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= n:
                raise RecipeError(f"{key}.ks holds {k!r}; each k must be an integer in 1..n = 1..{n} (raise "
                                  f"{key}.n to report pass@{k})")
        if also_greedy and temperature == 0:
            raise RecipeError(f"{key}.also_greedy is true while the evaluation already decodes greedily "
                              f"(temperature 0); set {key}.temperature > 0 to sample as well, or also_greedy: false")
        if isinstance(bootstrap, bool) or not isinstance(bootstrap, int) or bootstrap < 0:
            raise RecipeError(f"{key}.bootstrap must be an integer >= 0 (0 = no interval), got {bootstrap!r}")
        if not 0 < confidence < 1:
            raise RecipeError(f"{key}.confidence must be in (0, 1), got {confidence!r}")
        if sampling_seed is not None and (isinstance(sampling_seed, bool) or not isinstance(sampling_seed, int)):
            raise RecipeError(f"{key}.sampling_seed must be an integer or null, got {sampling_seed!r}")
        self.n = n
        self.temperature = float(temperature)
        self.top_p = float(top_p)
        self.top_k = top_k
        self.max_new_tokens = max_new_tokens
        self.ks = sorted(set(ks))
        self.bootstrap = bootstrap
        self.confidence = confidence
        self.seed = seed
        self.also_greedy = bool(also_greedy)
        self.sampling_seed = sampling_seed

    @property
    def greedy(self) -> bool:
        """Whether evaluation decodes greedily (``temperature`` 0)."""
        return self.temperature == 0

    def describe(self) -> str:
        """How each prompt is answered, in words (the heading of an evaluation's table)."""
        if self.greedy:
            return "one greedy answer each (temperature 0)"
        text = f"{self.n} sampled answer{'s' if self.n > 1 else ''} each at temperature {self.temperature:g}"
        text += f", top-p {self.top_p:g}" if self.top_p < 1 else ""
        text += f", top-k {self.top_k}" if self.top_k else ""
        text += ", and one greedy answer" if self.also_greedy else ""
        return text + (f", sampling seed {self.sampling_seed}" if self.sampling_seed is not None else "")

    def sampling(self, engine_sampling: Sampling) -> Sampling:
        """What evaluation passes to the engine's ``generate`` (the engine's own settings never change): the
        engine's ``engine_sampling`` with these settings in its place, and its ``max_new_tokens`` where this one is
        None; temperature 0 is the arg-max."""
        return replace(engine_sampling, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                       max_new_tokens=self.max_new_tokens or engine_sampling.max_new_tokens)


def _as_list(values, length: int, name: str) -> list | None:
    if values is None:
        return None
    if isinstance(values, Tensor):
        values = values.detach().cpu().tolist()
    values = list(values)
    if len(values) != length:
        raise ValueError(f"{name} has {len(values)} entries; expected one per response ({length})")
    return values


def _finite_or_none(value: float) -> float | None:
    return value if math.isfinite(value) else None


class EvalAccumulator:
    """Every scored response of one evaluation, and the metrics computed from them.

    Responses come prompt by prompt: the ``n`` responses of ``rows[i]`` are entries ``i * n`` to
    ``(i + 1) * n - 1`` (the order ``RolloutProducer.sample`` uses). Rows are grouped by their
    ``data_source`` field (``"unknown"`` where it is missing).

    Args:
        key: The metric namespace: ``compute`` returns ``"<key>/pass@4"``, ``"<key>/<source>/pass@4"``...
    """

    def __init__(self, key: str = "val"):
        self.key = key
        self.n: int | None = None
        self.records: list[dict] = []
        """One JSON-ready record per prompt (what ``write`` saves to the rows file)."""
        self.dropped: list[str] = []
        """Where each prompt that could not be asked (longer than ``max_prompt_tokens``) came from."""

    def reset(self) -> None:
        self.n = None
        self.records = []
        self.dropped = []

    def update(
        self,
        rows: Sequence[dict],
        n: int,
        correct: Tensor | Sequence[bool],
        rewards: Tensor | Sequence[float] | None = None,
        lengths: Tensor | Sequence[int] | None = None,
        truncated: Tensor | Sequence[bool] | None = None,
        answers_extracted: Sequence[str | None] | None = None,
        texts: Sequence[str] | None = None,
        turns: Tensor | Sequence[int] | None = None,
    ) -> None:
        """Add the responses to ``rows`` (one per prompt, each with ``n`` responses).

        Args:
            rows: The prompt rows that were asked (``prompt``, ``answer``, ``data_source``, ``source``).
            n: Responses per prompt; the same in every call of one evaluation.
            correct: Shape (B * n,), bool or 0/1: the reward's verdict on each response.
            rewards: Shape (B * n,): each response's reward.
            lengths: Shape (B * n,): response lengths in tokens.
            truncated: Shape (B * n,), bool: the response hit the token limit.
            answers_extracted: B * n final answers for the majority vote (None where there is none);
                default: ``extract_answer`` of each of ``texts``. Without both, maj@k is not reported.
            texts: B * n decoded responses (saved by ``write``).
            turns: Shape (B * n,): the model's turns in each episode (multi-turn environments).
        """
        if self.n is not None and n != self.n:
            raise ValueError(f"n changed within one evaluation ({self.n} then {n}); call reset() between evaluations")
        total = len(rows) * n
        correct = _as_list(correct, total, "correct")
        rewards, lengths = _as_list(rewards, total, "rewards"), _as_list(lengths, total, "lengths")
        truncated, texts = _as_list(truncated, total, "truncated"), _as_list(texts, total, "texts")
        answers_extracted = _as_list(answers_extracted, total, "answers_extracted")
        turns = _as_list(turns, total, "turns")
        if answers_extracted is None and texts is not None:
            answers_extracted = [extract_answer(t) for t in texts]
        self.n = n

        def part(values: list | None, i: int, cast) -> list | None:
            return None if values is None else [None if v is None else cast(v) for v in values[i * n : (i + 1) * n]]

        for i, row in enumerate(rows):
            self.records.append({
                "source": row.get("source"),
                "data_source": str(row.get("data_source") or "unknown"),
                "prompt": row.get("prompt"),
                "answer": row.get("answer"),
                "responses": part(texts, i, str),
                "extracted": part(answers_extracted, i, str),
                "correct": part(correct, i, lambda v: bool(v)),
                "rewards": part(rewards, i, float),
                "lengths": part(lengths, i, int),
                "truncated": part(truncated, i, lambda v: bool(v)),
                **({} if turns is None else {"turns": part(turns, i, int)}),  # multi-turn episodes only
            })

    def update_rollout(self, rows: Sequence[dict], n: int, rollout) -> None:
        """``update`` from a scored ``rllight.types.Rollout`` of ``rows`` sampled ``n`` times each."""
        self.update(rows, n, rollout.correct, rewards=rollout.rewards, lengths=rollout.response_lengths,
                    truncated=rollout.truncated, texts=rollout.texts, turns=getattr(rollout, "extras", {}).get("episode/turns"))

    def drop(self, rows: Sequence[dict]) -> None:
        """Count prompts that were not asked (too long): reported as ``<key>/dropped_prompts``, not scored."""
        self.dropped.extend(str(row.get("source")) for row in rows)

    def state(self) -> dict:
        """This accumulator's contents as plain Python objects, for ``torch.distributed.all_gather_object``."""
        return {"n": self.n, "records": self.records, "dropped": self.dropped}

    def merge(self, states: Sequence[dict]) -> None:
        """Replace the contents with the union of ``states`` (every rank's ``state()``, this one's included).

        A prompt that appears twice (a distributed sampler repeats rows to give every rank as many) counts
        once: records are keyed by their row's ``source``.
        """
        ns = {s["n"] for s in states if s["n"] is not None}
        if len(ns) > 1:
            raise ValueError(f"ranks sampled different n per prompt: {sorted(ns)}")
        records, seen, dropped = [], set(), []
        for state in states:
            for record in state["records"]:
                source = record.get("source")
                if source is not None and source in seen:
                    continue
                seen.add(source)
                records.append(record)
            dropped.extend(d for d in state["dropped"] if d not in dropped)
        self.n = ns.pop() if ns else None
        self.records = records
        self.dropped = dropped

    def _groups(self) -> list[tuple[str, list[dict]]]:
        by_source: dict[str, list[dict]] = {}
        for record in self.records:
            by_source.setdefault(record["data_source"], []).append(record)
        return [(f"{self.key}/", self.records)] + [(f"{self.key}/{s}/", by_source[s]) for s in sorted(by_source)]

    def _estimates(self, records: list[dict], k: int) -> dict[str, Estimate]:
        """avg@k, pass@k and (when every response has an extracted answer) maj@k of ``records``."""
        correct = torch.tensor([r["correct"] for r in records], dtype=torch.bool).reshape(len(records), self.n)
        estimates = {"avg": avg_at_k(correct, k), "pass": pass_at_k_over_prompts(correct, k)}
        if all(r["extracted"] is not None for r in records):
            estimates["maj"] = maj_at_k([r["extracted"] for r in records], correct, k)
        return estimates

    def per_prompt(self, ks: Sequence[int]) -> dict[str, dict[str, float]]:
        """The overall metrics prompt by prompt, for a paired comparison of two evaluations of the same rows:
        ``{"<key>/avg@k": {source: value, ...}, "<key>/pass@k": ..., "<key>/maj@k": ...}`` for each k, keyed
        by each row's ``source``; and the same per data source (``"<key>/<data_source>/avg@k"``). Empty when a
        record has no ``source`` or two records share one."""
        sources = [r.get("source") for r in self.records]
        if not self.records or None in sources or len(set(sources)) != len(sources):
            return {}
        return {f"{prefix}{name}@{k}": dict(zip([r["source"] for r in records], est.per_prompt.tolist()))
                for prefix, records in self._groups() for k in ks
                for name, est in self._estimates(records, k).items()}

    def compute(
        self, ks: Sequence[int], bootstrap: int = 0, confidence: float = 0.95, seed: int = 0
    ) -> dict[str, float]:
        """Every metric, overall (``<key>/avg@k``) and per data source (``<key>/<source>/avg@k``).

        For each k: ``avg@k``, ``pass@k`` and (when answers were extracted) ``maj@k``, each with ``_se``
        (standard error across prompts; NaN with a single prompt) and, with ``bootstrap`` resamples,
        ``_ci_low`` / ``_ci_high``. Also per group: ``prompts``, ``reward_mean``, ``response_length`` (mean
        tokens), ``truncated_ratio``, ``turns_mean`` and ``first_turn_accuracy`` (multi-turn episodes only: the
        model's turns per episode, and the share of episodes solved at the first turn); overall:
        ``dropped_prompts``. ``ks`` must each be in 1..n.
        """
        out: dict[str, float] = {f"{self.key}/dropped_prompts": float(len(self.dropped))}
        if not self.records:
            out[f"{self.key}/prompts"] = 0.0
            return out
        n = self.n
        for k in ks:
            if not 1 <= k <= n:
                raise ValueError(f"k = {k} needs at least k responses per prompt; this evaluation sampled n = {n}")
        for prefix, records in self._groups():
            out[f"{prefix}prompts"] = float(len(records))
            for k in ks:
                for name, est in self._estimates(records, k).items():
                    out[f"{prefix}{name}@{k}"] = est.mean
                    out[f"{prefix}{name}@{k}_se"] = est.se
                    if bootstrap:
                        low, high = bootstrap_interval(est.per_prompt, bootstrap, confidence, seed)
                        out[f"{prefix}{name}@{k}_ci_low"], out[f"{prefix}{name}@{k}_ci_high"] = low, high
            for name, field in (("reward_mean", "rewards"), ("response_length", "lengths"),
                                ("truncated_ratio", "truncated"), ("turns_mean", "turns")):
                if all(r.get(field) is not None for r in records):
                    values = [float(v) for r in records for v in r[field]]
                    out[f"{prefix}{name}"] = sum(values) / len(values)
            if all(r.get("turns") is not None for r in records):  # did the model need the environment's feedback
                first = [bool(c) and t == 1 for r in records for c, t in zip(r["correct"], r["turns"])]
                out[f"{prefix}first_turn_accuracy"] = sum(first) / len(first)
        return out

    def write(self, directory: str, ks: Sequence[int], name: str = "eval", extra: dict | None = None,
              **compute_kwargs) -> tuple[str, str]:
        """Write ``<name>.json`` (every metric of ``compute(ks, **compute_kwargs)``, NaN as null, with ``n``,
        ``ks``, the dropped prompts and ``extra``, e.g. the settings and checkpoint) and ``<name>_rows.jsonl``
        (one line per prompt: source, data_source, prompt, answer, responses, extracted answers, correct,
        rewards, lengths, truncated) into ``directory``; returns both paths. Each file is written whole
        through a temporary file, so a crash never leaves half a file."""
        os.makedirs(directory, exist_ok=True)
        metrics = {k: _finite_or_none(v) for k, v in self.compute(ks, **compute_kwargs).items()}
        summary = {"metrics": metrics, "n": self.n, "ks": list(ks), "dropped": self.dropped, **(extra or {})}
        json_path = os.path.join(directory, f"{name}.json")
        rows_path = os.path.join(directory, f"{name}_rows.jsonl")
        _write_atomic(json_path, json.dumps(summary, indent=2, allow_nan=False) + "\n")
        _write_atomic(rows_path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in self.records))
        return json_path, rows_path


def read_evaluation(directory: str, name: str) -> tuple[dict[str, float], dict[str, dict[str, float]]]:
    """An evaluation ``EvalAccumulator.write`` saved as ``<directory>/<name>.json`` and ``<name>_rows.jsonl``,
    read back: its metrics (as logged) and its per-prompt values (``EvalAccumulator.per_prompt``), recomputed from
    the rows, for ``before_after``. A greedy pass (``<name>_greedy``) is read as ``val/greedy/...``."""
    with open(os.path.join(directory, f"{name}.json")) as f:
        saved = json.load(f)
    acc = EvalAccumulator("val/greedy" if name.endswith("_greedy") else "val")
    with open(os.path.join(directory, f"{name}_rows.jsonl")) as f:
        acc.records = [json.loads(line) for line in f if line.strip()]
    acc.n, acc.dropped = saved["n"], saved.get("dropped", [])
    return acc.compute(saved["ks"]), acc.per_prompt(saved["ks"])


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
        for results, _, _, ks, suffix in self.passes():
            if trainer.world_size > 1:  # every rank evaluated its share of the rows
                states = [None] * trainer.world_size
                torch.distributed.all_gather_object(states, results.state())
                results.merge(states)
            metrics.update(results.compute(ks, ev.bootstrap, ev.confidence, ev.seed))
            self.last_per_prompt.update(results.per_prompt(ks))
            if trainer.is_global_zero and results.records and not trainer.sanity_checking:
                folder = os.path.join(trainer.log_dir or trainer.default_root_dir, "evaluation")
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


def _write_atomic(path: str, text: str) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)


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
                summary[name][label] = {"value": value, "se": _finite_or_none(se)}
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
    return {"before": b, "after": a, "before_se": _finite_or_none(se_b), "after_se": _finite_or_none(se_a),
            "difference": a - b, "difference_se": _finite_or_none(se_d), "paired": paired}


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
