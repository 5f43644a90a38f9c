"""Difficulty-aware choice of the training prompts (``data.curriculum``): pools by each prompt's recent pass rate,
drawn by weight; admission gates that reject a drawn prompt and draw another in its place; a cap on draws per step;
an optional profiling pass with the starting model. Its state is saved in every checkpoint, so a resumed run draws
exactly the prompts an uninterrupted run draws.

The training loader still sets how many prompts of each data source a step has (the ``data.mix`` counts, or the
uniform order's); the curriculum chooses which prompts of that source. The gate on generated groups (drop a group
whose rewards are all equal, so its advantages are all 0, and sample another prompt in its place) is
``model.sampler: rllight.strategies.DynamicSampling``: its extra prompts come from the curriculum, under its cap.

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

import logging
import math
import time
from collections import Counter, defaultdict

import torch

from rllight.data.mix import largest_remainder, rows_by_source
from rllight.data.prompt_stream import PromptSource
from rllight.errors import RecipeError

log = logging.getLogger(__name__)

KEY = "data.curriculum.init_args"


def _rate(value, key: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
        raise RecipeError(f"{key} must be a pass rate between 0 and 1, got {value!r}")
    return float(value)


def _count(value, key: str, least: int, optional: bool = True) -> int | None:
    if (value is None and not optional) or (value is not None and (isinstance(value, bool) or not isinstance(
            value, int) or value < least)):
        raise RecipeError(f"{key} must be an integer >= {least}{' or null' if optional else ''}, got {value!r}")
    return value


class DifficultyPools(PromptSource):
    """Draws each data source's prompts from pools by recent pass rate (see ``rllight.data.curriculum``).

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

    Logged each step (``train/curriculum/...``): ``<source>/pool/<pool>`` (prompts in each pool, after the step),
    ``<source>/retired``, ``<source>/draws``, ``pool/<pool>/draws``, ``draws`` and ``cap_hit`` (over all processes),
    ``gate/max_pass_rate/admitted`` and ``/rejected``, ``gate/retire/retired`` (prompts retired by this step).
    """

    def __init__(self, pools: dict[str, float] | None = None, weights: dict[str, float] | None = None,
                 unseen: str = "normal", window: int = 1, max_pass_rate: float | None = None,
                 retire_after: int | None = None, max_draws: int | None = None, profile: int = 0,
                 profile_batch: int = 32, seed: int | None = None):
        if weights is None and pools is not None:  # pools of the recipe's own: alike unless weighted
            weights = dict.fromkeys(pools, 1.0) if isinstance(pools, dict) else None
        pools = {"hard": 0.2, "normal": 0.8, "easy": 1.0} if pools is None else pools
        if not isinstance(pools, dict) or not pools:
            raise RecipeError(f"{KEY}.pools must map each pool's name to the highest pass rate it holds, e.g. "
                              "{hard: 0.2, normal: 0.8, easy: 1.0}")
        self.pools = dict(sorted(((str(k), _rate(v, f"{KEY}.pools.{k}")) for k, v in pools.items()),
                                 key=lambda kv: kv[1]))
        if max(self.pools.values()) != 1.0:
            raise RecipeError(f"{KEY}.pools: no pool holds a pass rate of 1; give the last pool the bound 1.0")
        weights = {"hard": 0.25, "normal": 0.5, "easy": 0.25} if weights is None else weights
        if not isinstance(weights, dict) or set(weights) != set(self.pools):
            raise RecipeError(f"{KEY}.weights must give each pool of {KEY}.pools a weight: {sorted(self.pools)}, "
                              f"got {weights!r}")
        for name, w in weights.items():
            if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w) or w < 0:
                raise RecipeError(f"{KEY}.weights.{name} must be a number >= 0, got {w!r}")
        if not sum(weights.values()) > 0:
            raise RecipeError(f"{KEY}.weights: every weight is 0; give a pool a positive weight")
        self.weights = {k: float(v) for k, v in weights.items()}
        if unseen not in self.pools:
            raise RecipeError(f"{KEY}.unseen is {unseen!r}; name one of the pools: {sorted(self.pools)}")
        self.unseen = unseen
        self.window = _count(window, f"{KEY}.window", 1, optional=False)
        self.max_pass_rate = None if max_pass_rate is None else _rate(max_pass_rate, f"{KEY}.max_pass_rate")
        self.retire_after = _count(retire_after, f"{KEY}.retire_after", 1)
        self.max_draws = _count(max_draws, f"{KEY}.max_draws", 1)
        self.profile = _count(profile, f"{KEY}.profile", 0, optional=False)
        self.profile_batch = _count(profile_batch, f"{KEY}.profile_batch", 1, optional=False)
        self.seed = seed
        self.rows: list[dict] = []
        self._index: dict[int, int] = {}  # id(row) -> its index in rows
        self._by_source: dict[str, list[int]] = {}  # data source -> its rows' indices
        self.history: dict[int, list[float]] = {}  # row index -> its latest pass rates, the latest last
        self.solved: Counter[int] = Counter()  # row index -> groups solved by every response
        self.retired: set[int] = set()
        self.steps = 0  # steps drawn, the next step's index
        self.profiled = False
        self._loaded: dict | None = None  # a checkpoint's state, applied when the rows are known
        self._heard: list[tuple[int, float]] = []  # this process's observations of the step
        self._step: dict | None = None  # the running step's draw state
        self._warned: set[str] = set()

    # ------------------------------------------------------------------------------------- state
    def bind(self, rows: list[dict], seed: int) -> DifficultyPools:
        """The training rows to draw from (the datamodule's list: indexed at the first step, once fitted to the
        model's context) and the data's seed."""
        self.rows = rows
        self.seed = seed if self.seed is None else self.seed
        return self

    def state_dict(self) -> dict:
        return {"steps": self.steps, "rows": len(self.rows), "profiled": self.profiled,
                "history": {i: list(h) for i, h in self.history.items()}, "solved": dict(self.solved),
                "retired": sorted(self.retired)}

    def load_state_dict(self, state: dict) -> None:
        self._loaded = dict(state) if state else None
        if self._index:
            self._apply_loaded()

    def _apply_loaded(self) -> None:
        state, self._loaded = self._loaded, None
        if state is None or "history" not in state:  # a checkpoint of a run without a curriculum: it starts fresh
            return
        if state.get("rows") != len(self.rows):
            raise RecipeError(f"--ckpt_path: the checkpoint's data.curriculum drew from {state.get('rows')} training "
                              f"rows, this run has {len(self.rows)}; resume with the same training data")
        self.steps, self.profiled = int(state["steps"]), bool(state["profiled"])
        self.history = {int(i): [float(r) for r in h] for i, h in state["history"].items()}
        self.solved = Counter({int(i): int(k) for i, k in state["solved"].items()})
        self.retired = {int(i) for i in state["retired"]}

    def pass_rate(self, index: int) -> float | None:
        """Row ``index``'s recent pass rate (None before it is seen)."""
        h = self.history.get(index)
        return sum(h) / len(h) if h else None

    def pool_of(self, index: int) -> str:
        rate = self.pass_rate(index)
        if rate is None:
            return self.unseen
        return next(name for name, bound in self.pools.items() if rate <= bound)

    # ------------------------------------------------------------------------------------ a step
    def run(self, sampler, producer, rows: list[dict], step: int):
        """The step's prompts (as many of each source as ``rows`` has, over all processes) drawn from the pools,
        this process's share of them sampled by ``sampler``, the pass rates heard meanwhile applied on every
        process alike, and the step's metrics in the rollout's extras."""
        ranks = producer.ranks
        extras = self._begin(producer, ranks)
        counts: Counter[str] = Counter()
        for part in ranks.gather_objects(Counter(str(r.get("data_source")) for r in rows)):
            counts.update(part)
        self._step["counts"] = counts  # a sampler's replacements follow them
        picked = [i for source in sorted(counts) for i in self._pick(source, counts[source])]
        rollout = super().run(sampler, producer, self._share(picked, ranks.world_size, ranks.rank), step)
        rollout.extras.update({**extras, **self._end(ranks)})
        return rollout

    def draw(self, n: int) -> list[dict]:
        """``n`` more prompts for this process (a sampler's replacements): every process draws ``n`` in the same
        call, so the ``n x processes`` are drawn alike on each and dealt out; the sources in the step's proportions."""
        self._index_rows()
        step = self._step or self._new_step()
        counts = step["counts"] or {source: len(index) for source, index in self._by_source.items()}
        share = largest_remainder(dict(counts), n * step["world"])
        picked = [i for source in sorted(share) for i in self._pick(source, share[source])]
        return self._share(picked, step["world"], step["rank"])

    def observe(self, rows: list[dict], pass_rates: list[float]) -> None:
        for row, rate in zip(rows, pass_rates):
            index = self._index.get(id(row))
            if index is not None:
                self._heard.append((index, float(rate)))

    def _new_step(self, ranks=None) -> dict:
        seed = (self.seed or 0) * 1_000_003 + self.steps
        self._step = {"gen": torch.Generator().manual_seed(seed), "taken": set(), "counts": Counter(),
                      "draws": 0, "source_draws": Counter(), "pool_draws": Counter(), "admitted": 0, "rejected": 0,
                      "cap_hit": False, "world": ranks.world_size if ranks else 1, "rank": ranks.rank if ranks else 0}
        return self._step

    def _index_rows(self) -> None:
        """Once, at the first draw (the rows fitted to the model's context by then): the rows indexed, the
        checkpoint's state applied."""
        if not self._index:
            if not self.rows:
                raise RecipeError("data.curriculum has no training rows to draw from")
            self._index = {id(row): i for i, row in enumerate(self.rows)}
            self._by_source = rows_by_source(self.rows)
            self._apply_loaded()

    def _begin(self, producer, ranks) -> dict:
        self._index_rows()
        extras = {}
        if self.profile and not self.profiled:
            extras = self._profile(producer, ranks)
        self._new_step(ranks)
        return extras

    def _pick(self, source: str, count: int) -> list[int]:
        """``count`` prompts of ``source`` admitted by the gates (fewer at the cap, or when its pools run out)."""
        step, out = self._step, []
        candidates: dict[str, list[int]] = defaultdict(list)
        for i in self._by_source.get(source, []):
            if i not in self.retired and i not in step["taken"]:
                candidates[self.pool_of(i)].append(i)
        while len(out) < count:
            if self.max_draws is not None and step["draws"] >= self.max_draws:
                step["cap_hit"] = True
                break
            live = [name for name in self.pools if candidates[name] and self.weights[name] > 0]
            if not live:
                self._warn_empty(source)
                break
            weights = torch.tensor([self.weights[name] for name in live], dtype=torch.float64)
            pool = live[int(torch.multinomial(weights, 1, generator=step["gen"]))]
            index = candidates[pool].pop(int(torch.randint(len(candidates[pool]), (1,), generator=step["gen"])))
            step["taken"].add(index)
            step["draws"] += 1
            step["source_draws"][source] += 1
            step["pool_draws"][pool] += 1
            rate = self.pass_rate(index)
            if self.max_pass_rate is not None and rate is not None and rate > self.max_pass_rate:
                step["rejected"] += 1
                continue
            step["admitted"] += 1
            out.append(index)
        return out

    def _warn_empty(self, source: str) -> None:
        if source not in self._warned:
            self._warned.add(source)
            log.warning("data.curriculum: no prompt of data source %r is left in a pool with a positive weight "
                        "(%d retired); its steps have fewer prompts from now on (later ones are not logged)", source,
                        len(self.retired.intersection(self._by_source.get(source, []))))

    def _share(self, picked: list[int], world: int, rank: int) -> list[dict]:
        """The drawn prompts shuffled together, this process's every ``world``-th of them."""
        order = torch.randperm(len(picked), generator=self._step["gen"]).tolist()
        return [self.rows[picked[j]] for j in order][rank::world]

    def _end(self, ranks) -> dict[str, float]:
        """Apply every process's observations of the step (in rank order: the same state on each), the step's
        metrics."""
        retired_before = len(self.retired)
        for heard in ranks.gather_objects(self._heard):
            for index, rate in heard:
                self.record(index, rate)
        self._heard = []
        step, self._step = self._step, None
        self.steps += 1
        metrics = {"curriculum/draws": float(step["draws"]), "curriculum/cap_hit": float(step["cap_hit"])}
        for source, index in sorted(self._by_source.items()):
            size = Counter("retired" if i in self.retired else self.pool_of(i) for i in index)
            metrics.update({f"curriculum/{source}/pool/{name}": float(size[name]) for name in self.pools})
            metrics[f"curriculum/{source}/retired"] = float(size["retired"])
            metrics[f"curriculum/{source}/draws"] = float(step["source_draws"][source])
        metrics.update({f"curriculum/pool/{name}/draws": float(step["pool_draws"][name]) for name in self.pools})
        if self.max_pass_rate is not None:
            metrics["curriculum/gate/max_pass_rate/admitted"] = float(step["admitted"])
            metrics["curriculum/gate/max_pass_rate/rejected"] = float(step["rejected"])
        if self.retire_after is not None:
            metrics["curriculum/gate/retire/retired"] = float(len(self.retired) - retired_before)
        return metrics

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

    def _profile(self, producer, ranks) -> dict[str, float]:
        """Each process samples ``profile`` responses to its every ``world``-th training prompt with the policy as
        it is; the pass rates are shared and recorded on all."""
        from rllight.rollout.episodes import main_rows

        start = time.perf_counter()
        mine = list(range(ranks.rank, len(self.rows), ranks.world_size))
        heard = []
        for first in range(0, len(mine), self.profile_batch):
            chunk = mine[first : first + self.profile_batch]
            rollout = producer.sample([self.rows[i] for i in chunk], self.profile, training=False)
            kept, rollout = rollout.extras.get("kept_rows", ()), main_rows(rollout)
            for group, k in enumerate(kept):
                correct = rollout.correct[rollout.group_ids == group]
                heard.append((chunk[k], float(correct.float().mean())))
        for part in ranks.gather_objects(heard):
            for index, rate in part:
                self.record(index, rate)
        self.profiled = True
        log.info("data.curriculum: profiled %d training prompts, %d responses each", len(self.rows), self.profile)
        return {"curriculum/profiled": float(len(self.history)), "time/profile": time.perf_counter() - start}
