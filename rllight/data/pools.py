"""Difficulty pools: a curriculum rule (``rllight.data.curriculum``) that draws each data source's prompts from
pools by recent pass rate, drawn by weight, with two gates: a pass-rate bound that rejects a drawn prompt (another
is drawn in its place) and the retirement of prompts solved often enough.

The training data still sets how many prompts of each data source a step has (the ``data.mix`` counts, or the
uniform order's); the pools choose which prompts of that source. The gate on generated groups (drop a group whose
rewards are all equal, so its advantages are all 0, and sample another prompt in its place) is ``model.sampler:
rllight.strategies.DynamicSampling``: its extra prompts come from the pools, under the draw cap.

A recipe::

    data:
      curriculum:
        class_path: rllight.data.DifficultyPools
        init_args:
          pools: {hard: 0.2, normal: 0.8, easy: 1.0}   # each holds the pass rates up to its bound
          weights: {hard: 0.25, normal: 0.5, easy: 0.25}
          retire_after: 3                               # solved by every response 3 times: never drawn again
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterator

import torch

from rllight.bounds import ClosedUnitInterval, NonNegativeFiniteFloat, NonNegativeInt, PositiveInt, bounded, checked
from rllight.data.curriculum import KEY, Curriculum, StepDraws
from rllight.errors import RecipeError


def _pools(pools) -> dict[str, float]:
    """The pools by bound, checked: one holds a pass rate of 1."""
    if not isinstance(pools, dict) or not pools:
        raise RecipeError(f"{KEY}.pools must map each pool's name to the highest pass rate it holds, e.g. "
                          "{hard: 0.2, normal: 0.8, easy: 1.0}")
    rates = ((str(k), checked(f"{KEY}.pools.{k}", v, ClosedUnitInterval)) for k, v in pools.items())
    out = dict(sorted(rates, key=lambda kv: kv[1]))
    if max(out.values()) != 1.0:
        raise RecipeError(f"{KEY}.pools: no pool holds a pass rate of 1; give the last pool the bound 1.0")
    return out


def _weights(weights, pools: dict[str, float]) -> dict[str, float]:
    if not isinstance(weights, dict) or set(weights) != set(pools):
        raise RecipeError(f"{KEY}.weights must give each pool of {KEY}.pools a weight: {sorted(pools)}, "
                          f"got {weights!r}")
    weights = {k: checked(f"{KEY}.weights.{k}", v, NonNegativeFiniteFloat) for k, v in weights.items()}
    if not sum(weights.values()) > 0:
        raise RecipeError(f"{KEY}.weights: every weight is 0; give a pool a positive weight")
    return weights


class DifficultyPools(Curriculum):
    """Draws each data source's prompts from pools by recent pass rate (see ``rllight.data.pools``).

    A prompt's pass rate is the share of correct responses in its latest ``window`` groups (their mean), heard
    from every training rollout, also of groups that a sampler then drops. A prompt not yet seen is in the
    ``unseen`` pool, unless ``profile`` measured it first. Each draw picks a pool by ``weights`` among the pools
    that still hold prompts of the source (the weights renormalised), then a prompt of that pool uniformly; a
    prompt is drawn at most once per step.

    Args:
        pools: Pool name -> the highest pass rate it holds; a pass rate goes to the first pool (by bound) that
            holds it, and one pool's bound must be 1. Default: hard up to 0.2, normal up to 0.8, easy above.
        weights: Pool name -> weight (any scale) of drawing from it. Default: a quarter from each end, half from
            the middle (with ``pools`` of your own: the same weight each).
        unseen: The pool of a prompt without a pass rate yet.
        window: Groups a pass rate averages over, the latest first.
        max_pass_rate: Admission gate: a drawn prompt whose pass rate is above this is rejected and another drawn
            in its place (None = no gate).
        retire_after: A prompt whose group every response solved this many times is retired: never drawn again
            (None = never).
        max_draws: Prompts drawn per step over all processes, the rejected ones and the replacements a sampler
            asks for included; at the cap the step trains on what it has (None = no cap).
        profile: Before the first step, sample this many responses to every training prompt with the starting
            model and take their pass rates (0 = no profiling pass).
        profile_batch: Prompts per generation call of the profiling pass.
        seed: Seed of the draws (None = ``data.seed``).
        reset_on_changed_rows: On resume, when the training rows differ from those the checkpoint's pools were
            learnt on (pass rates are kept by row index): False refuses the resume in one line; True drops the pass
            rates, solved counts and retired prompts with a warning and starts the pools afresh.

    Logged each step (``train/curriculum/...``): ``<source>/pool/<pool>`` (prompts in each pool, after the step),
    ``<source>/retired``, ``<source>/draws``, ``pool/<pool>/draws``, ``draws`` and ``cap_hit`` (over all processes),
    ``gate/max_pass_rate/admitted`` and ``/rejected``, ``gate/retire/retired`` (prompts retired by this step).
    """

    @bounded
    def __init__(self, pools: dict[str, float] | None = None, weights: dict[str, float] | None = None,
                 unseen: str = "normal", window: PositiveInt = 1, max_pass_rate: ClosedUnitInterval | None = None,
                 retire_after: PositiveInt | None = None, max_draws: PositiveInt | None = None,
                 profile: NonNegativeInt = 0, profile_batch: PositiveInt = 32, seed: int | None = None,
                 reset_on_changed_rows: bool = False):
        super().__init__(max_draws=max_draws, profile=profile, profile_batch=profile_batch, seed=seed,
                         reset_on_changed_rows=reset_on_changed_rows)
        if weights is None and pools is not None:  # pools of the recipe's own: alike unless weighted
            weights = dict.fromkeys(pools, 1.0) if isinstance(pools, dict) else None
        self.pools = _pools({"hard": 0.2, "normal": 0.8, "easy": 1.0} if pools is None else pools)
        self.weights = _weights({"hard": 0.25, "normal": 0.5, "easy": 0.25} if weights is None else weights,
                                self.pools)
        if unseen not in self.pools:
            raise RecipeError(f"{KEY}.unseen is {unseen!r}; name one of the pools: {sorted(self.pools)}")
        self.unseen = unseen
        self.window, self.max_pass_rate, self.retire_after = window, max_pass_rate, retire_after
        self.history: dict[int, list[float]] = {}  # row index -> its latest pass rates, the latest last
        self.solved: Counter[int] = Counter()  # row index -> groups solved by every response
        self.retired: set[int] = set()
        self._pool_draws: Counter[str] = Counter()  # the running step's draws from each pool
        self._newly_retired = 0  # by the latest observations

    # ------------------------------------------------------------------------------- the rule
    def choose(self, source: str, candidates: list[int], generator: torch.Generator) -> Iterator[int]:
        """A pool by weight among those holding a candidate, then one of its prompts uniformly; again."""
        by_pool: dict[str, list[int]] = defaultdict(list)
        for i in candidates:
            if i not in self.retired:
                by_pool[self.pool_of(i)].append(i)
        while True:
            live = [name for name in self.pools if by_pool[name] and self.weights[name] > 0]
            if not live:
                return
            weights = torch.tensor([self.weights[name] for name in live], dtype=torch.float64)
            pool = live[int(torch.multinomial(weights, 1, generator=generator))]
            self._pool_draws[pool] += 1  # read only when the draw is made: it counts
            yield by_pool[pool].pop(int(torch.randint(len(by_pool[pool]), (1,), generator=generator)))

    def admit(self, index: int) -> bool:
        rate = self.pass_rate(index)
        return self.max_pass_rate is None or rate is None or rate <= self.max_pass_rate

    def observe(self, pass_rates: list[tuple[int, float]]) -> None:
        retired = len(self.retired)
        for index, rate in pass_rates:
            self.record(index, rate)
        self._newly_retired = len(self.retired) - retired

    def record(self, index: int, rate: float) -> None:
        """Row ``index`` was answered at pass rate ``rate``: its history, and its retirement after ``retire_after``
        groups solved by every response."""
        history = self.history.setdefault(index, [])
        history.append(rate)
        del history[: -self.window]
        if rate >= 1.0:
            self.solved[index] += 1
            if self.retire_after is not None and self.solved[index] >= self.retire_after:
                self.retired.add(index)

    def pass_rate(self, index: int) -> float | None:
        """Row ``index``'s recent pass rate (None before it is seen)."""
        h = self.history.get(index)
        return sum(h) / len(h) if h else None

    def pool_of(self, index: int) -> str:
        rate = self.pass_rate(index)
        if rate is None:
            return self.unseen
        return next(name for name, bound in self.pools.items() if rate <= bound)

    def metrics(self, draws: StepDraws) -> dict[str, float]:
        out = {}
        for source, index in sorted(self.by_source.items()):
            size = Counter("retired" if i in self.retired else self.pool_of(i) for i in index)
            out.update({f"{source}/pool/{name}": float(size[name]) for name in self.pools})
            out[f"{source}/retired"] = float(size["retired"])
        out.update({f"pool/{name}/draws": float(self._pool_draws[name]) for name in self.pools})
        self._pool_draws = Counter()
        if self.max_pass_rate is not None:
            out["gate/max_pass_rate/admitted"] = float(draws.admitted)
            out["gate/max_pass_rate/rejected"] = float(draws.rejected)
        if self.retire_after is not None:
            out["gate/retire/retired"] = float(self._newly_retired)
        return out

    def empty_note(self, source: str) -> str:
        retired = len(self.retired.intersection(self.by_source.get(source, [])))
        return f" in a pool with a positive weight ({retired} retired)"

    # ------------------------------------------------------------------------------- its state
    def rule_state_dict(self) -> dict:
        return {"history": {i: list(h) for i, h in self.history.items()}, "solved": dict(self.solved),
                "retired": sorted(self.retired)}

    def load_rule_state_dict(self, state: dict) -> None:
        if "history" not in state:
            return
        self.history = {int(i): [float(r) for r in h] for i, h in state["history"].items()}
        self.solved = Counter({int(i): int(k) for i, k in state["solved"].items()})
        self.retired = {int(i) for i in state["retired"]}
