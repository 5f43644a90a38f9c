"""A curriculum (``data.curriculum``): which training prompts each step draws, by a rule of your own, with the
distributed draw done here once for every rule.

``Curriculum`` is the base class of every rule (``rllight.data.DifficultyPools`` is one). A rule says three things:

- ``choose(source, candidates, generator)``: the order in which it would draw a data source's prompts this step
  (lazily: the draw stops as soon as it has what it needs);
- ``observe(pass_rates)``: every process's ``(row index, pass rate)`` pairs of the step, the same on each process,
  heard from every training group generated (also the groups a sampler then drops);
- ``rule_state_dict()`` / ``load_rule_state_dict(state)``: what it learnt, saved in every checkpoint.

Optionally ``admit(index)`` (a gate: a drawn prompt it rejects is replaced by the next one of ``choose``) and
``metrics(draws)`` (its own ``train/curriculum/...`` values of the step).

The base class does the rest, alike on every process: how many prompts of each source the step has (the data
side's count of the step: the ``data.mix`` counts, or the seeded order's), the draw itself (each process draws the
whole step with the same seeded generator, so every process picks the same prompts, then takes its every
``world``-th), the cap on draws per step (``max_draws``), the replacements a sampler asks for (``draw``: in the
step's source proportions, under the same cap), the sharing of pass rates among the processes, an optional
profiling pass with the starting model, and its own part of the checkpoint (the steps drawn, the number of rows, a
fingerprint of each data source's rows). A resumed run therefore draws exactly the prompts an uninterrupted run
draws, whatever the rule, as long as the rule's state holds everything ``choose`` reads. What a rule learns is
keyed by row index, so a resume whose training rows differ from the checkpoint's (other text, answers or order,
whatever the file's path and row count) is refused in one line, or with ``reset_on_changed_rows`` starts the rule
afresh on them.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from rllight.bounds import NonNegativeInt, PositiveInt, bounded
from rllight.data.mix import largest_remainder, rows_by_source
from rllight.data.prompt_stream import PromptSource
from rllight.errors import RecipeError

log = logging.getLogger(__name__)

KEY = "data.curriculum.init_args"


@dataclass
class StepDraws:
    """What one step has drawn so far (the same on every process): its generator, the prompts taken, the counts."""

    generator: torch.Generator
    world: int = 1
    rank: int = 0
    counts: dict[str, int] = field(default_factory=dict)  # the step's prompts of each source, over all processes
    taken: set[int] = field(default_factory=set)  # row indices drawn, admitted or not: never twice a step
    draws: int = 0  # every prompt drawn, the rejected ones and the replacements included
    per_source: Counter = field(default_factory=Counter)  # draws of each source
    admitted: int = 0
    rejected: int = 0
    cap_hit: bool = False
    short: dict[str, str] = field(default_factory=dict)  # source -> why it gave fewer prompts than counted


class Curriculum(PromptSource):
    """The base class of a curriculum rule (see ``rllight.data.curriculum``): subclass it, define ``choose`` (and
    ``observe`` and the rule's state where it learns from pass rates), and name it in ``data.curriculum``.

    Args:
        max_draws: Prompts drawn per step over all processes, the rejected ones and the replacements a sampler
            asks for included; at the cap the step trains on what it has (None = no cap).
        profile: Before the first step, sample this many responses to every training prompt with the starting
            model and pass their pass rates to ``observe`` (0 = no profiling pass).
        profile_batch: Prompts per generation call of the profiling pass.
        seed: Seed of the draws (None = ``data.seed``).
        reset_on_changed_rows: On resume, when the training rows differ from those the checkpoint's curriculum
            learnt on (what it learnt is keyed by row index): False refuses the resume in one line; True drops what
            it learnt (and the profiling pass's rates) with a warning and starts afresh on the new rows.

    Logged each step (``train/curriculum/...``): ``draws`` and ``cap_hit`` (over all processes), ``<source>/draws``,
    and the rule's own ``metrics``.
    """

    @bounded
    def __init__(self, max_draws: PositiveInt | None = None, profile: NonNegativeInt = 0,
                 profile_batch: PositiveInt = 32, seed: int | None = None, reset_on_changed_rows: bool = False):
        self.max_draws, self.profile, self.profile_batch = max_draws, profile, profile_batch
        self.seed, self.reset_on_changed_rows = seed, reset_on_changed_rows
        self.rows: list[dict] = []
        self.steps = 0  # steps drawn, the next step's index (the draw's seed)
        self.profiled = False
        self._index: dict[int, int] = {}  # id(row) -> its index in rows
        self.by_source: dict[str, list[int]] = {}  # data source -> its rows' indices (from the first step)
        self._loaded: dict | None = None  # a checkpoint's state, applied when the rows are known
        self._fingerprint: dict[str, list] | None = None  # each source's rows, once indexed (``fingerprint``)
        self._heard: list[tuple[int, float]] = []  # this process's pass rates of the step
        self._draws: StepDraws | None = None  # the running step's
        self._warned: set[str] = set()

    # ------------------------------------------------------------------------------- the rule's part
    def choose(self, source: str, candidates: list[int], generator: torch.Generator) -> Iterable[int]:
        """The rows of ``source`` in the order to draw them: some or all of ``candidates`` (its row indices, in
        order, not yet drawn this step). Draw any randomness from ``generator`` (every process then chooses alike);
        a generator function is read only as far as the step needs."""
        raise NotImplementedError(f"{type(self).__name__} must define choose(source, candidates, generator)")

    def admit(self, index: int) -> bool:
        """A gate: False rejects the drawn row ``index`` (it counts as a draw) and the next one is drawn instead."""
        return True

    def observe(self, pass_rates: list[tuple[int, float]]) -> None:
        """The step's ``(row index, share of correct responses)`` pairs from every process, in the same order on
        each (also the profiling pass's)."""

    def metrics(self, draws: StepDraws) -> dict[str, float]:
        """The rule's own metrics of the step (after ``observe``), logged under ``train/curriculum/``."""
        return {}

    def rule_state_dict(self) -> dict:
        """What the rule has learnt, saved in checkpoints (plain Python values)."""
        return {}

    def load_rule_state_dict(self, state: dict) -> None:
        """Restore ``rule_state_dict``'s state (its keys as saved; integer keys may come back as strings)."""

    def empty_note(self, source: str) -> str:
        """Said when ``choose`` gives no more rows of ``source``: why (e.g. how many are retired)."""
        return ""

    # ------------------------------------------------------------------------------------- state
    def bind(self, rows: list[dict], seed: int) -> Curriculum:
        """The training rows to draw from (the datamodule's list: indexed at the first step, once fitted to the
        model's context) and the data's seed."""
        self.rows = rows
        self.seed = seed if self.seed is None else self.seed
        return self

    def state_dict(self) -> dict:
        if self._loaded is not None:  # a checkpoint's state not applied yet (no step drawn since): it is the run's
            return dict(self._loaded)
        fingerprint = {"fingerprint": self._fingerprint} if self._fingerprint is not None else {}
        return {"steps": self.steps, "rows": len(self.rows), "profiled": self.profiled, **fingerprint,
                **self.rule_state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self._loaded = dict(state) if state else None
        if self._index:
            self._apply_loaded()

    def fingerprint(self) -> dict[str, list]:
        """Each data source's rows as this curriculum indexes them: ``{source: [row count, hash]}``, the hash (SHA-256,
        16 hex digits) of each row's index, prompt messages and answer, in order. Saved in checkpoints: what a rule
        learns is keyed by row index, so a resume checks that the indices still mean the same rows."""
        out = {}
        for source, index in sorted(self.by_source.items()):
            digest = hashlib.sha256()
            for i in index:  # repr: about 2 us a row, a second or two for a million
                row = self.rows[i]
                digest.update(repr((i, row.get("messages", row.get("prompt")), row.get("answer"))).encode())
            out[source] = [len(index), digest.hexdigest()[:16]]
        return out

    def _apply_loaded(self) -> None:
        state, self._loaded = self._loaded, None
        if state is None or "rows" not in state:  # a checkpoint of a run without a curriculum: it starts fresh
            return
        changed = self._changed_rows(state)
        if changed and not self.reset_on_changed_rows:
            raise RecipeError(f"--ckpt_path: the training rows differ from those the checkpoint's data.curriculum "
                              f"learnt on by row index ({changed}); resume with the same training rows, or set "
                              f"{KEY}.reset_on_changed_rows: true to start the curriculum afresh on these")
        self.steps = int(state["steps"])  # the draws' seed goes on either way
        if changed:
            log.warning("data.curriculum: the training rows differ from the checkpoint's (%s); with "
                        "reset_on_changed_rows it starts afresh on them: what it learnt (pass rates, retired prompts, "
                        "the profiling pass) is dropped", changed)
            return
        self.profiled = bool(state["profiled"])
        base = ("steps", "rows", "profiled", "fingerprint")
        self.load_rule_state_dict({k: v for k, v in state.items() if k not in base})

    def _changed_rows(self, state: dict) -> str:
        """How this run's training rows differ from those of the checkpoint's ``state`` ("" when they do not): the
        sources whose rows changed, where they come from, their counts then and now. A checkpoint saved without a
        fingerprint (by an earlier version) is checked by its row count only, with a warning."""
        before = state.get("fingerprint")
        if before is None:
            if state["rows"] != len(self.rows):
                return f"{state['rows']} rows then, {len(self.rows)} now"
            if int(state.get("steps", 0)) or state.get("profiled"):
                log.warning("data.curriculum: the checkpoint holds no fingerprint of its training rows (saved by an "
                            "earlier version): its state is applied by row index, checked by the row count only "
                            "(%d rows); if the training rows changed since, set %s.reset_on_changed_rows: true",
                            len(self.rows), KEY)
            return ""
        now = self._fingerprint
        sources = sorted(s for s in {*before, *now} if list(before.get(s, [0, ""])) != now.get(s, [0, ""]))
        said = []
        for source in sources[:3]:
            index = self.by_source.get(source, [])
            where = f" from {str(self.rows[index[0]].get('source', '?')).rsplit(' row ', 1)[0]}" if index else ""
            then, count = int(before.get(source, [0])[0]), len(index)
            said.append(f"data source {source!r}{where}: {then} rows then, {count} now"
                        + (", other text, answers or order" if then == count else ""))
        return "; ".join(said) + (f"; and {len(sources) - 3} more sources" if len(sources) > 3 else "")

    def _index_rows(self) -> None:
        """Once, at the first draw (the rows fitted to the model's context by then): the rows indexed, the
        checkpoint's state applied."""
        if not self._index:
            if not self.rows:
                raise RecipeError("data.curriculum has no training rows to draw from")
            self._index = {id(row): i for i, row in enumerate(self.rows)}
            self.by_source = rows_by_source(self.rows)
            self._fingerprint = self.fingerprint()
            self._apply_loaded()

    # ------------------------------------------------------------------------------------ a step
    def sample(self, sampler, producer, rows: list[dict]):
        """The step's prompts drawn by the rule, as many of each source as the data side counts for the step
        (``data.step_counts``: the loader's ``rows`` are not used), this process's share of them sampled by
        ``sampler``, the pass rates heard meanwhile observed on every process alike, and the step's metrics in the
        rollout's extras."""
        ranks = producer.ranks
        self._index_rows()
        extras = self._profile(producer, ranks) if self.profile and not self.profiled else {}
        counts = self._step_counts()
        draws = self._new_step(ranks.world_size, ranks.rank)
        draws.counts = counts  # a sampler's replacements follow them
        picked = [i for source in sorted(counts) for i in self._pick(source, counts[source])]
        if not picked:  # the step has nothing to train on: the producer hears why, for the line that ends the run
            producer.note_no_prompts(self.shortage(draws))
        rollout = sampler(producer, self._share(picked))
        rollout.extras.update({**extras, **self._end(ranks)})
        return rollout

    def _step_counts(self) -> dict[str, int]:
        step_counts = getattr(self.data, "step_counts", None)
        if step_counts is None:
            raise RecipeError("data.curriculum needs the datamodule's step_counts (rllight.data.RLDataModule): use "
                              "it as data, or remove data.curriculum")
        return {str(s): int(c) for s, c in step_counts(self.step).items() if c}

    def draw(self, n: int) -> list[dict]:
        """``n`` more prompts for this process (a sampler's replacements): every process draws ``n`` in the same
        call, so the ``n x processes`` are drawn alike on each and dealt out; the sources in the step's proportions."""
        self._index_rows()
        draws = self._draws or self._new_step(1, 0)
        counts = draws.counts or {source: len(index) for source, index in self.by_source.items()}
        share = largest_remainder(dict(counts), n * draws.world)
        picked = [i for source in sorted(share) for i in self._pick(source, share[source])]
        return self._share(picked)

    def hear(self, rows: list[dict], pass_rates: list[float]) -> None:
        """This process's training ``rows`` answered at ``pass_rates`` (the producer's call): kept for the step's
        end, where every process's are observed."""
        for row, rate in zip(rows, pass_rates):
            index = self._index.get(id(row))
            if index is not None:
                self._heard.append((index, float(rate)))

    def _new_step(self, world: int, rank: int) -> StepDraws:
        seed = (self.seed or 0) * 1_000_003 + self.steps
        self._draws = StepDraws(torch.Generator().manual_seed(seed), world, rank)
        return self._draws

    def _pick(self, source: str, count: int) -> list[int]:
        """``count`` rows of ``source`` in the rule's order, admitted by its gate (fewer at the cap, or when the
        rule gives no more)."""
        draws, out = self._draws, []
        if count < 1 or self._capped(draws):
            return out
        order = iter(self.choose(source, [i for i in self.by_source.get(source, []) if i not in draws.taken],
                                 draws.generator))
        while len(out) < count:
            if self._capped(draws):  # before the rule's next choice: a choice past the cap draws nothing
                break
            index = next(order, None)
            if index is None:
                self._warn_empty(source)
                draws.short[source] = f"no prompt of data source {source!r} is left to draw{self.empty_note(source)}"
                break
            draws.taken.add(index)
            draws.draws += 1
            draws.per_source[source] += 1
            if self.admit(index):
                draws.admitted += 1
                out.append(index)
            else:
                draws.rejected += 1
        return out

    def _capped(self, draws: StepDraws) -> bool:
        if self.max_draws is not None and draws.draws >= self.max_draws:
            draws.cap_hit = True
        return draws.cap_hit

    def shortage(self, draws: StepDraws) -> str:
        """Why the step of ``draws`` has fewer prompts than the data side counts for it, in words."""
        why = [draws.short[source] for source in sorted(draws.short)]
        if draws.cap_hit:
            why.append(f"max_draws={self.max_draws} reached ({draws.rejected} rejected by the rule's gate)")
        if not draws.counts:
            why.append(f"the data side counts no prompt for step {self.step} (data.mix)")
        return "data.curriculum: " + ("; ".join(why) or "the rule chose no prompt")

    def _warn_empty(self, source: str) -> None:
        if source not in self._warned:
            self._warned.add(source)
            log.warning("data.curriculum: no prompt of data source %r is left to draw%s; its steps have fewer "
                        "prompts from now on (later ones are not logged)", source, self.empty_note(source))

    def _share(self, picked: list[int]) -> list[dict]:
        """The drawn rows shuffled together, this process's every ``world``-th of them."""
        draws = self._draws
        order = torch.randperm(len(picked), generator=draws.generator).tolist()
        return [self.rows[picked[j]] for j in order][draws.rank :: draws.world]

    def _end(self, ranks) -> dict[str, float]:
        """Every process's pass rates of the step observed (in rank order: the same state on each); the step's
        metrics."""
        heard = [pair for part in ranks.gather_objects(self._heard) for pair in part]
        self._heard = []
        self.observe(heard)
        draws, self._draws = self._draws, None
        self.steps += 1
        metrics = {"draws": float(draws.draws), "cap_hit": float(draws.cap_hit)}
        metrics.update({f"{source}/draws": float(draws.per_source[source]) for source in sorted(self.by_source)})
        metrics.update(self.metrics(draws))
        return {f"curriculum/{k}": v for k, v in metrics.items()}

    def _profile(self, producer, ranks) -> dict[str, float]:
        """Each process samples ``profile`` responses to its every ``world``-th training prompt with the policy as
        it is; the pass rates are shared and observed on all."""
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
        heard = [pair for part in ranks.gather_objects(heard) for pair in part]
        self.observe(heard)
        self.profiled = True
        log.info("data.curriculum: profiled %d training prompts, %d responses each", len(self.rows), self.profile)
        return {"curriculum/profiled": float(len({i for i, _ in heard})), "time/profile": time.perf_counter() - start}
