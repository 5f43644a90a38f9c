"""The responses of one evaluation, scored, and the metrics computed from them.

``EvalAccumulator`` collects every scored response of a validation epoch and computes avg@k, pass@k and maj@k with
standard errors, overall and per ``data_source``, with the estimators of ``rllight.algorithms.evaluation``;
``write`` saves every number and every response (``rllight.evaluation.files``), so that two runs can be compared
prompt by prompt (join the row files on ``source``), and ``read_evaluation`` reads them back. ``extract_answer``
gives each response's final answer, the key of the majority vote.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import torch
from torch import Tensor

from rllight.algorithms.evaluation import Estimate, avg_at_k, bootstrap_interval, maj_at_k, pass_at_k_over_prompts
from rllight.evaluation.files import load_evaluation, save_evaluation
from rllight.rewards.base import last_number


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


def _as_list(values, length: int, name: str) -> list | None:
    if values is None:
        return None
    if isinstance(values, Tensor):
        values = values.detach().cpu().tolist()
    values = list(values)
    if len(values) != length:
        raise ValueError(f"{name} has {len(values)} entries; expected one per response ({length})")
    return values



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
        """``update`` from a scored ``rllight.types.Rollout`` of ``rows`` sampled ``n`` times each (one row per
        episode: an episode laid out as several rows counts once, with its last sample's length)."""
        from rllight.rollout.episodes import main_rows

        rollout = main_rows(rollout)
        self.update(rows, n, rollout.correct, rewards=rollout.rewards, lengths=rollout.response_lengths,
                    truncated=rollout.truncated, texts=rollout.texts, turns=getattr(rollout, "extras", {}).get("episode/turns"))

    def drop(self, rows: Sequence[dict]) -> None:
        """Count prompts that were not asked (too long): reported as ``<key>/dropped_prompts``, not scored."""
        self.dropped.extend(str(row.get("source")) for row in rows)

    def state(self) -> dict:
        """This accumulator's contents as plain Python objects, to gather over ranks (``Ranks.gather_objects``)."""
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
        fields = {"n": self.n, "ks": list(ks), "dropped": self.dropped, **(extra or {})}
        return save_evaluation(directory, name, self.compute(ks, **compute_kwargs), self.records, fields)


def read_evaluation(directory: str, name: str) -> tuple[dict[str, float], dict[str, dict[str, float]]]:
    """An evaluation ``EvalAccumulator.write`` saved as ``<directory>/<name>.json`` and ``<name>_rows.jsonl``,
    read back: its metrics (as logged) and its per-prompt values (``EvalAccumulator.per_prompt``), recomputed from
    the rows, for ``before_after``. A greedy pass (``<name>_greedy``) is read as ``val/greedy/...``."""
    saved, records = load_evaluation(directory, name)
    acc = EvalAccumulator("val/greedy" if name.endswith("_greedy") else "val")
    acc.records = records
    acc.n, acc.dropped = saved["n"], saved.get("dropped", [])
    return acc.compute(saved["ks"]), acc.per_prompt(saved["ks"])

