"""Samplers (``model.sampler``) decide which responses make up a rollout: ``GroupSampler`` (G responses per prompt),
``ReMaxSampler`` (and one greedy response per prompt, for ``ReMax``), ``DynamicSampling`` (DAPO: over-sample and keep
the groups with mixed outcomes)."""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING

import torch

from rllight.algorithms.batching import first_in_rank_order
from rllight.algorithms.shaping import mixed_groups
from rllight.bounds import AtLeastTwo, PositiveInt, bounded
from rllight.distributed import share
from rllight.errors import RecipeError
from rllight.types import MEAN_EXTRAS, Rollout

if TYPE_CHECKING:
    from rllight.rollout.producer import RolloutProducer

__all__ = ["DynamicSampling", "GroupSampler", "ReMaxSampler", "Sampler"]

log = logging.getLogger(__name__)


GREEDY_REWARDS = "greedy_rewards"
"""Key in ``rollout.extras`` of the (B,) rewards of the greedy response to each row's prompt."""


class Sampler:
    """Base class: ``__call__(producer, rows) -> Rollout`` for a batch of prompt rows.

    ``producer.sample(rows, n)`` samples ``n`` responses per row and scores them; ``producer.more_prompts(n)``
    draws further training rows (the datamodule's stream) when a step needs more than its batch.
    """

    fixed_size: bool = False
    """Whether every rollout holds ``group_size`` responses for each prompt of its batch, so that it makes the
    optimizer updates the recipe plans (``rllight.app.rollout_count.planned_updates_per_rollout``) and the progress
    lines can show the run's RL steps in all. False where a rollout may hold fewer (``DynamicSampling`` keeps only
    the groups with mixed rewards), and for a sampler that does not say."""

    def __call__(self, producer: RolloutProducer, rows: list[dict]) -> Rollout:
        raise NotImplementedError

    def prefetch(self, producer: RolloutProducer, rows: list[dict]) -> None:
        """Ask the engine to start on a later step's ``rows`` now (asynchronous rollouts, see
        ``rllight.rollout.worker``): the first ``producer.sample`` that step makes then finds its responses
        ready. The default asks for ``group_size`` responses per row, which is the first call of every sampler
        here; a sampler whose first call differs overrides it (a request nobody collects is dropped)."""
        n = getattr(self, "group_size", None)
        if n:
            producer.prefetch(rows, n)


class GroupSampler(Sampler):
    """``group_size`` responses per prompt (GRPO's G), tied by ``group_ids``.

    Args:
        group_size: Responses per prompt (1 for PPO / SPPO-style single samples).
    """

    fixed_size = True

    @bounded
    def __init__(self, group_size: PositiveInt = 4):
        self.group_size = group_size

    def __call__(self, producer: RolloutProducer, rows: list[dict]) -> Rollout:
        return producer.sample(rows, self.group_size)


class ReMaxSampler(Sampler):
    """ReMax's rollout (Li et al., arXiv:2310.10505): ``group_size`` sampled responses per prompt, plus
    one greedy response per prompt that is scored but not trained on; its reward is stored per row in
    ``rollout.extras["greedy_rewards"]`` (B,) for ``ReMax``. Logs ``reward/greedy_mean``.

    Args:
        group_size: Sampled responses per prompt (ReMax uses 1).
    """

    fixed_size = True  # the greedy responses only score the baseline: they are not trained on

    @bounded
    def __init__(self, group_size: PositiveInt = 1):
        self.group_size = group_size

    def __call__(self, producer: RolloutProducer, rows: list[dict]) -> Rollout:
        rollout = producer.sample(rows, self.group_size)
        if len(rollout) == 0:
            return rollout
        greedy = producer.sample(rows, 1, greedy=True, training=False)  # dropped prompts counted above
        if len(greedy) * self.group_size != len(rollout):  # both calls drop the same over-long prompts
            raise RuntimeError(f"ReMaxSampler: {len(greedy)} greedy responses for {len(rollout)} samples")
        rollout.extras[GREEDY_REWARDS] = greedy.rewards.repeat_interleave(self.group_size)
        rollout.extras["reward/greedy_mean"] = greedy.rewards.mean()
        # The greedy pass is part of the rollout's cost.
        for key in ("time/rollout", "time/reward"):
            rollout.extras[key] = rollout.extras.get(key, 0.0) + greedy.extras.get(key, 0.0)
        return rollout


_METRICS = ("reward", "correct")


class RoundTotals:
    """The scalar extras of several rounds' rollouts as one batch's: a mean or rate the producer names in
    ``MEAN_EXTRAS`` (a component's mean reward, an agreement, a data source's share) weighted by each round's
    responses, a ``*_max`` the largest, anything else (counts, times) summed."""

    def __init__(self):
        self.sums: dict[str, float] = {}
        self.weights: dict[str, float] = {}
        self.maxima: dict[str, float] = {}

    def add(self, part: Rollout) -> None:
        means = set(part.extras.get(MEAN_EXTRAS, ()))
        for key, value in part.extras.items():
            if not (isinstance(value, (int, float)) or (isinstance(value, torch.Tensor) and value.dim() == 0)):
                continue
            if key.endswith("_max"):
                self.maxima[key] = max(self.maxima.get(key, -math.inf), float(value))
            elif key in means:
                self.sums[key] = self.sums.get(key, 0.0) + float(value) * len(part)
                self.weights[key] = self.weights.get(key, 0.0) + len(part)
            else:
                self.sums[key] = self.sums.get(key, 0.0) + float(value)

    def values(self) -> dict[str, float]:
        out = {k: v / self.weights[k] if self.weights.get(k) else v for k, v in self.sums.items()}
        return {**out, **self.maxima}


class DynamicSampling(Sampler):
    """Over-sample and keep only groups with mixed outcomes (DAPO, arXiv:2503.14476, section 3.2).

    Each round samples ``group_size`` responses for a set of prompts and drops every group whose
    rewards are all equal (all right or all wrong: its group-relative advantage is zero). Rounds repeat
    with fresh prompts from ``producer.more_prompts`` (the datamodule's stream, or its ``data.curriculum``) until
    ``target_groups`` mixed groups are kept (surplus mixed groups of the last round are dropped, as verl does),
    ``max_rounds`` rounds ran, or no prompt is left to draw.
    When the cap is hit the step trains on the mixed groups it has (possibly none: the module then
    skips the update), logs a warning and sets ``sampling/cap_hit``.
    On several processes the target is global and the first mixed groups in rank order are kept
    (``rllight.algorithms.first_in_rank_order``), so the ranks keep different numbers; the module then deals
    the kept groups evenly to the ranks before the update (``rllight.distributed.deal_rollout``), so a
    rollout makes the updates its global sizes imply (``rllight.algorithms.minibatch_shares``).

    With success rate p a group survives with probability ``a_G(p) = 1 - (1-p)^G - p^G``
    (``rllight.algorithms.group_retention_probability``), so the cost per kept group is ``1 / a_G(p)``
    groups; the metrics make that cost visible.

    Metrics (``train/sampling/...``): ``groups_drawn``, ``groups_kept``, ``groups_rejected`` (rewards all equal),
    ``rounds``, ``cap_hit`` (0/1), ``out_of_prompts`` (0/1: the prompts' source gave no more, e.g. a curriculum at
    its ``max_draws``),
    ``groups_short`` (mixed groups the step lacks against its target, over all processes),
    ``retention`` (mixed / drawn), ``responses_drawn`` and ``generated_tokens`` (every generated
    response token, discarded groups included).

    Args:
        group_size: G, responses per prompt (DAPO: 16; at least 2, as a group of one is never mixed).
        target_groups: Mixed groups a step trains on (None = the number of prompts in the step's batch).
        max_rounds: Cap on sampling rounds per step, the first included (verl's max_num_gen_batches).
        prompts_per_round: Prompts drawn in each extra round (None = the step's batch size).
        metric: What must vary inside a group: ``reward`` (the task reward, as ALGORITHMS.md states it)
            or ``correct`` (the 0/1 accuracy, as DAPO's verl recipe filters on ``acc``).
    """

    @bounded
    def __init__(self, group_size: AtLeastTwo = 16, target_groups: PositiveInt | None = None,
                 max_rounds: PositiveInt = 10, prompts_per_round: PositiveInt | None = None, metric: str = "reward"):
        if metric not in _METRICS:
            raise RecipeError(f"model.sampler.init_args.metric must be one of {', '.join(_METRICS)}, got {metric!r}")
        self.group_size = group_size
        self.target_groups = target_groups
        self.max_rounds = max_rounds
        self.prompts_per_round = prompts_per_round
        self.metric = metric

    def __call__(self, producer: RolloutProducer, rows: list[dict]) -> Rollout:
        ranks = producer.ranks
        # Over all processes, as data.batch_size (summed: a curriculum at its draw cap may deal the ranks unevenly).
        target = self.target_groups or round(float(ranks.sum(float(len(rows)))))
        per_round = len(rows)
        if self.prompts_per_round is not None:
            per_round = share(self.prompts_per_round, ranks.world_size, "model.sampler.init_args.prompts_per_round")
        mixed_parts: list[tuple[Rollout, list[int]]] = []  # each round's rollout and its mixed groups
        n_kept = n_drawn = n_mixed = responses = 0
        tokens = 0.0
        totals = RoundTotals()  # the rounds' scalar extras: counts and times summed, means weighted by responses
        rounds, out_of_prompts = 0, False
        batch = rows
        while not rounds or (rounds < self.max_rounds and n_kept < target):  # n_kept: over all processes
            if rounds:
                batch = producer.more_prompts(per_round)
                if not ranks.any(bool(batch)):  # the source gave none (a curriculum at its max_draws, or emptied)
                    out_of_prompts = True
                    break
            part = producer.sample(batch, self.group_size)
            rounds += 1
            totals.add(part)
            # producer.sample numbers groups 0..n-1 in every call: shift them so that groups of
            # different rounds never share an id.
            part.group_ids = part.group_ids + n_drawn
            n_drawn += len(batch)
            responses += len(part)
            tokens += float(part.response_lengths.sum())
            values = part.rewards if self.metric == "reward" else part.correct
            ids = torch.unique(part.group_ids[mixed_groups(values, part.group_ids)]).tolist()  # in prompt order
            n_mixed += len(ids)
            mixed_parts.append((part, ids))
            n_kept = int(ranks.sum(float(n_mixed)).item())
        # The first `target` mixed groups over the processes are kept, the processes in rank order (a surplus of
        # the last round is dropped, as verl does); the module then deals them evenly to the ranks (deal_rollout).
        quota = first_in_rank_order([round(c) for c in ranks.gather(float(n_mixed))], target)[ranks.rank]
        kept = self._first_groups(mixed_parts, quota)
        n_kept = min(n_kept, target)
        cap_hit = n_kept < target
        if cap_hit and out_of_prompts:
            log.warning("dynamic sampling: %d of %d mixed groups after %d round(s) (%d groups drawn): no more "
                        "prompts to draw (data.curriculum's max_draws, or its pools are empty); training on the %d "
                        "kept", n_kept, target, rounds, n_drawn, n_kept)
        elif cap_hit:
            log.warning("dynamic sampling: cap hit, %d of %d mixed groups after max_rounds=%d (%d groups drawn); "
                        "training on the %d kept (if it recurs, raise max_rounds or the group size)", n_kept, target,
                        self.max_rounds, n_drawn, n_kept)
        rollout = Rollout.cat(kept, pad_id=producer.pad_id)
        rollout.extras.update(totals.values())
        rollout.extras.update({
            "sampling/groups_drawn": float(n_drawn),
            "sampling/groups_kept": float(quota),
            "sampling/groups_rejected": float(n_drawn - n_mixed),  # the admission gate: no advantage spread
            "sampling/rounds": float(rounds),
            "sampling/cap_hit": float(cap_hit),
            "sampling/out_of_prompts": float(out_of_prompts),  # the rounds ended as no prompt was left to draw
            "sampling/groups_short": float(target - n_kept),  # over all processes: the partial batch's gap
            "sampling/retention": n_mixed / max(n_drawn, 1),
            "sampling/responses_drawn": float(responses),
            "sampling/generated_tokens": tokens,
        })
        return rollout

    @staticmethod
    def _first_groups(parts: list[tuple[Rollout, list[int]]], quota: int) -> list[Rollout]:
        """The first ``quota`` mixed groups of the rounds' rollouts, in order (an empty rollout of the right shape
        when there are none)."""
        kept = []
        for part, ids in parts:
            ids = ids[:quota]
            if ids:
                keep = torch.isin(part.group_ids, torch.tensor(ids, device=part.group_ids.device))
                kept.append(part.select(torch.nonzero(keep).squeeze(-1).cpu()))
                quota -= len(ids)
        return kept or [parts[-1][0].select([])]
