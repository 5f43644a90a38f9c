"""``model.evaluation``: how an evaluation samples (responses per prompt, temperature, the k of its metrics),
separately from training's sampling."""

from __future__ import annotations

import math
from dataclasses import replace
from typing import TYPE_CHECKING

from rllight.bounds import NonNegativeFloat, NonNegativeInt, OpenUnitInterval, PositiveInt, UpToOne, bounded
from rllight.errors import RecipeError

if TYPE_CHECKING:
    from rllight.rollout.base import Sampling


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
        ks: The k of avg@k, pass@k and maj@k, each in 1..n (None = 1 and n). n is always added: avg@n, the mean
            over every sample, is ``val/accuracy`` when sampling.
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

    @bounded
    def __init__(
        self,
        n: PositiveInt = 1,
        temperature: NonNegativeFloat = 0.0,
        top_p: UpToOne = 1.0,
        top_k: NonNegativeInt = 0,
        max_new_tokens: PositiveInt | None = None,
        ks: list[int] | None = None,
        bootstrap: NonNegativeInt = 0,
        confidence: OpenUnitInterval = 0.95,
        seed: int = 0,
        also_greedy: bool = False,
        sampling_seed: int | None = None,
    ):
        key = "model.evaluation"
        if not math.isfinite(temperature):
            raise RecipeError(f"{key}.temperature must be finite, got {temperature!r}")
        if temperature == 0 and n > 1:
            raise RecipeError(f"{key}.n is {n} with temperature 0 (greedy): every response would be the same; set "
                              f"{key}.temperature > 0 to sample, or n: 1")
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
        if sampling_seed is not None and (isinstance(sampling_seed, bool) or not isinstance(sampling_seed, int)):
            raise RecipeError(f"{key}.sampling_seed must be an integer or null, got {sampling_seed!r}")
        self.n = n
        self.temperature = float(temperature)
        self.top_p = float(top_p)
        self.top_k = top_k
        self.max_new_tokens = max_new_tokens
        self.ks = sorted(set(ks) | {n})  # avg@n is val/accuracy: always computed
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
