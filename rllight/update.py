"""The optimizer update: any set of loss terms, accumulated over micro-batches, and the schedules of updates
an RL step runs (the policy's epochs over minibatches, critic-only fits, NLL updates)."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import Tensor
from torch.profiler import record_function

from rllight._compat import return_free_memory
from rllight.algorithms.batching import minibatch_shares
from rllight.bounds import PositiveInt, bounded
from rllight.distributed import Ranks, share
from rllight.fsdp import full_tensor
from rllight.precision import RecastWeights
from rllight.rollout.metrics import critic_explained_variance, reduce_stats
from rllight.scoring import Outputs, Scoring
from rllight.stopping import end_after_step
from rllight.strategies import Aggregation
from rllight.terms import CriticLoss, HeadOnlyCriticFit, LossTerm, ResponseNLL
from rllight.types import Rollout

log = logging.getLogger(__name__)


class ZeroGradientGuard:
    """RL steps in a row whose every policy update had a gradient of exactly zero: nothing was learned from them
    (every advantage 0, as when each group's responses all earn one reward, or every token masked or clipped), and
    the weights did not move (``Updater.clip_gradients`` removes such a gradient before the optimizer steps). A
    warning after ``warn_after`` of them, and after ``stop_after`` the run ends after the step, saved
    (``rllight.stopping.end_after_step``): the policy no longer changes, so neither do its rollouts. The norms are of
    the gradient summed over ranks, so every rank counts alike. A step with no policy update is not counted
    (``max_steps_without_update`` guards those), and neither is one whose updates moved the policy.

    Args:
        warn_after: Steps in a row before the warning (None = never).
        stop_after: Steps in a row before the stop (None = never).
    """

    @bounded
    def __init__(self, warn_after: PositiveInt | None = 5, stop_after: PositiveInt | None = 50):
        self.warn_after, self.stop_after = warn_after, stop_after
        self.in_a_row = 0

    def note(self, grad_norms: Sequence[Tensor], step: int) -> None:
        """One RL step's policy gradient norms (one per update made, before clipping)."""
        if not grad_norms:
            return
        if any(float(n) != 0.0 for n in grad_norms):
            self.in_a_row = 0
            return
        self.in_a_row += 1
        what = (f"{self.in_a_row} RL steps in a row had a zero policy gradient in every update, so the policy did "
                "not learn from them: every advantage was 0 (each group's responses earned one reward: see "
                "train/reward/mean) or every token was masked or clipped")
        if self.stop_after is not None and self.in_a_row >= self.stop_after:
            end_after_step(f"{what}; check the reward and the task's difficulty for this model "
                           "(model.guards.max_zero_gradient_steps sets when this stops a run)")
        elif self.in_a_row == self.warn_after:
            log.warning("after update %d: %s; the run stops after %s (model.guards.max_zero_gradient_steps)", step,
                        what, self.stop_after if self.stop_after is not None else "never")


class Updater:
    """Runs the optimizer updates of a run with manual optimisation.

    One update (``update``) over a minibatch: the forward pass computes what the terms need, each micro-batch's
    terms are summed and back-propagated (the loss is normalised by the minibatch's global token or sequence
    count, so the micro-batches' gradients add up to the minibatch's), gradients are summed over ranks, the
    policy's and the critic's parameters are clipped each to its own norm, a non-finite update is skipped, and
    the optimizer steps. ``update`` returns whether the policy moved; the schedules (``policy_updates``,
    ``critic_update``, ``nll_update``) then call ``policy_moved`` at once, before the next update, where the owner
    gives the rollout engine the new weights (an engine counts every update: ``sync_every``, staleness).

    The optimizer, the schedule, the backward pass, the ranks and the step count are callables, read at each
    update: they exist once the run has started (``RLModule`` passes its ``optimizers``, ``lr_schedulers``, ...).

    Args:
        scoring: The forward passes.
        aggregation: How per-token losses are averaged.
        max_grad_norm: Gradient-norm clipping of the policy's parameters (None = off).
        critic_max_grad_norm: The critic's, separately (None = off).
        max_consecutive_skips: This many non-finite updates in a row stop the run.
        minibatch_size: Responses per update of a critic-only or NLL schedule when the caller names none (None =
            the whole rollout in one update). Every minibatch size given here is a total over the training
            processes: each takes an equal share of the rows.
        zero_gradients: Counts the RL steps in a row whose policy updates had no gradient (None = a default one).
        optimizer: The optimizer over every trained parameter, as Lightning wraps it: its ``step()`` counts a
            policy step (``trainer.global_step``), ``.optimizer.step()`` the raw optimizer's does not.
        scheduler: The learning-rate schedule stepped after each policy step (returns None when there is none).
        backward: The backward pass of a loss (Lightning's ``manual_backward``).
        no_sync: A context in which backward passes leave DDP's gradient sync out
            (``rllight._compat.no_gradient_sync``): the gradients are summed over ranks here, once per update.
        ranks: Collectives over the run's processes (default: one process).
        step: The policy steps so far (``trainer.global_step``), for the guards' messages.
        policy_moved: Called after each update that moved the policy; returns metrics logged with the update's
            (e.g. ``rollout/sync_time``).
    """

    def __init__(self, scoring: Scoring, aggregation: Aggregation, max_grad_norm: float | None,
                 critic_max_grad_norm: float | None, max_consecutive_skips: int, minibatch_size: int | None = None,
                 zero_gradients: ZeroGradientGuard | None = None, *, optimizer: Callable[[], Any],
                 scheduler: Callable[[], Any] = lambda: None, backward: Callable[[Tensor], None] = Tensor.backward,
                 no_sync: Callable[[], AbstractContextManager] = contextlib.nullcontext,
                 ranks: Callable[[], Ranks] = Ranks, step: Callable[[], int] = lambda: 0,
                 policy_moved: Callable[[], dict[str, float]] = dict):
        self.optimizer, self.scheduler, self.backward, self.no_sync = optimizer, scheduler, backward, no_sync
        self._ranks, self.step, self.policy_moved = ranks, step, policy_moved
        self.zero_gradients = zero_gradients or ZeroGradientGuard()
        self.minibatch_size = minibatch_size
        self.scoring = scoring
        self.aggregation = aggregation
        self.max_grad_norm = max_grad_norm
        self.critic_max_grad_norm = critic_max_grad_norm
        self.max_consecutive_skips = max_consecutive_skips
        self.consecutive_skips = 0
        self.updates = 0  # optimizer steps taken in this process (policy, critic-only and NLL alike)

    @property
    def ranks(self) -> Ranks:
        return self._ranks()

    def state_dict(self) -> dict[str, int]:
        """What a resumed run needs of it: the count of non-finite updates in a row."""
        return {"consecutive_skips": self.consecutive_skips}

    def load_state_dict(self, state: dict) -> None:
        self.consecutive_skips = state.get("consecutive_skips", 0)

    def local_size(self, size: int | None, name: str = "model.batching.minibatch_size") -> int | None:
        """This process's share of a minibatch size given for all processes (None stays None)."""
        return None if size is None else share(size, self.ranks.world_size, name)

    # ------------------------------------------------------------------------------------- schedules
    def plan(self, n: int, epochs: int, minibatch_size: int | None, seed: int) -> list[list[Tensor]]:
        """This process's rows (indices into its ``n``) in each update of each of ``epochs`` passes. The updates
        are planned over the rows of all ranks together (``rllight.algorithms.minibatch_shares``):
        ``ceil(total / minibatch_size)`` updates (None = one), each of ``minibatch_size`` rows but the last, so a
        rollout makes the same updates on any number of processes; each rank's rows are spread evenly over them,
        in a new order each epoch drawn from ``seed`` when there are several updates. On one process: the chunks of
        ``minibatch_size`` rows of that order. A rank with no rows in an update still takes part in it. The old
        log-probs are scored in the first epoch's minibatches (``Scoring.score``'s ``layout``). A collective."""
        ranks = self.ranks
        counts = [round(c) for c in ranks.gather(float(n))]
        shares = [share[ranks.rank] for share in minibatch_shares(counts, minibatch_size)]
        if not shares:
            return [[] for _ in range(epochs)]
        generator = torch.Generator().manual_seed(seed)
        return [list((torch.randperm(n, generator=generator) if len(shares) > 1 else torch.arange(n)).split(shares))
                for _ in range(epochs)]

    def policy_updates(self, rollout: Rollout, terms: Sequence[LossTerm], plan: list[list[Tensor]]
                       ) -> dict[str, Tensor]:
        """One update per minibatch of ``plan`` (``plan``), epoch after epoch, each minimising the sum of
        ``terms``. Each update is a policy step (``trainer.global_step``, the learning-rate schedule)."""
        stats: dict[str, list[Tensor]] = {}
        for epoch in plan:
            for index in epoch:
                out = self._update(rollout.select(index), terms, "policy", "policy/loss", policy_step=True)
                for k, v in out.items():
                    stats.setdefault(k, []).append(v)
        self.zero_gradients.note(stats.get("policy/grad_norm", []), self.step())
        return reduce_stats(stats)

    def critic_update(self, rollout: Rollout, epochs: int = 1, minibatch_size: int | None = None,
                      train_backbone: bool = True, steps: int = 0, layout: list[Tensor] | None = None
                      ) -> dict[str, Tensor]:
        """Critic-only updates on ``rollout`` (which has ``values`` and ``returns``), logged as
        ``critic_only/...``: ``epochs`` passes over its minibatches (``minibatch_size`` rows each, in row order),
        one optimizer step per minibatch; or, with ``steps`` > 0, that many optimizer steps (VAPO's K_v), one per
        minibatch of ``layout`` (None = those minibatches) in turn, cycling when ``steps`` exceeds their count.
        A separate critic trains whole and the policy does not move. A value head on the shared backbone trains
        alone with ``train_backbone`` False (``HeadOnlyCriticFit``); with True the value loss also trains the
        backbone, which is the policy's, so the policy moves (and the engine is synced). These updates do not
        advance ``trainer.global_step``, which counts policy updates."""
        critic = self.scoring.critic
        stats: dict[str, list[Tensor]] = {}
        ev = critic_explained_variance(rollout)  # of the critic as it enters these updates
        if ev is not None:
            stats["critic_only/explained_variance"] = [ev]
        head_only = critic.shared and not train_backbone
        parts = (layout if steps and layout is not None
                 else self.minibatches(len(rollout), self.local_size(minibatch_size or self.minibatch_size)))
        terms = [HeadOnlyCriticFit(critic, self.scoring.policy, self.scoring.run) if head_only else CriticLoss(critic)
                 for _ in parts]
        turns = (list(range(len(parts))) * steps)[:steps] if steps else list(range(len(parts))) * epochs
        for i in turns:
            out = self._update(rollout.select(parts[i]), [terms[i]], "value", total_key="value/total_loss")
            for k, v in out.items():
                stats.setdefault(f"critic_only/{k.split('/')[-1]}" if k.startswith("value/") else k, []).append(v)
        return {k: torch.stack(v).float().mean() for k, v in stats.items()}

    def critic_first(self, rollout: Rollout, estimate: Callable[[Rollout], None], layout: list[Tensor] | None = None,
                     steps: int = 0, epochs: int = 0) -> dict[str, Tensor]:
        """VAPO note 000: the critic fits the fresh rollout first (``critic_update``: ``steps`` K_v optimizer steps over
        ``layout``'s minibatches, or ``epochs`` passes), then its values are scored again and ``estimate`` recomputes
        the advantages with them. A shared head trains alone unless ``critic_first_trains_backbone`` (figure 5),
        which moves the policy: its old log-probs are scored first (in ``layout``'s micro-batches, as the step's)."""
        backbone = getattr(self.scoring.critic, "critic_first_trains_backbone", False)
        self.scoring.score(rollout, need_old=backbone and rollout.old_logprobs is None, need_values=False,
                           layout=layout)
        metrics = self.critic_update(rollout, steps=steps, epochs=epochs, layout=layout, train_backbone=backbone)
        self.scoring.score(rollout, need_old=False, need_values=True)
        estimate(rollout)
        return metrics

    def nll_update(self, rollout: Rollout, coef: float = 1.0, minibatch_size: int | None = None,
                   aggregation: Aggregation | None = None) -> dict[str, Tensor]:
        """Supervised updates on the responses of ``rollout`` (``ResponseNLL``, aggregated as ``aggregation`` says,
        None = as the policy loss); like ``critic_update`` they do not advance ``trainer.global_step``."""
        stats: dict[str, list[Tensor]] = {}
        for index in self.minibatches(len(rollout), self.local_size(minibatch_size or self.minibatch_size)):
            for k, v in self._update(rollout.select(index), [ResponseNLL(coef, aggregation)], "nll").items():
                stats.setdefault(k, []).append(v)
        return {k: torch.stack(v).float().mean() for k, v in stats.items()}

    def learning_rates(self) -> dict[str, float]:
        """``lr/<group>``: the optimizer's rate of each parameter group now (after any schedule)."""
        return {f"lr/{group.get('name', 'policy')}": float(group["lr"]) for group in self.optimizer().param_groups}

    def minibatches(self, n: int, size: int | None, order: Tensor | None = None) -> list[Tensor]:
        """Row indices of this process's minibatches over its ``n`` rows (``size`` rows each, this process's
        share; None = one minibatch), in ``order`` when given. Under DDP every rank must make the same number of
        optimizer updates: the count is the largest over ranks, and a rank with fewer rows adds empty minibatches
        (it contributes no gradient to those updates but takes part in them)."""
        order = torch.arange(n) if order is None else order
        size = size or max(n, 1)
        parts = [order[s : s + size] for s in range(0, n, size)]
        count = int(self.ranks.reduce(torch.tensor(float(len(parts))), op="max").item())
        return parts + [order[:0]] * (count - len(parts))

    # ----------------------------------------------------------------------------------- one update
    def _update(self, mb: Rollout, terms: Sequence[LossTerm], name: str, total_key: str | None = None,
                policy_step: bool = False) -> dict[str, Tensor]:
        """``update``, then ``policy_moved`` if the policy moved (its metrics join the update's)."""
        out, moved = self.update(mb, terms, name, total_key, policy_step)
        if moved:
            out.update({k: torch.tensor(float(v)) for k, v in self.policy_moved().items()})
        return out

    def update(self, mb: Rollout, terms: Sequence[LossTerm], name: str, total_key: str | None = None,
               policy_step: bool = False) -> tuple[dict[str, Tensor], bool]:
        """One optimizer update over the minibatch ``mb`` with the sum of ``terms``: its metrics, and whether the
        policy moved (the optimizer stepped and a term trains the policy). Logs the terms' metrics,
        ``<name>/grad_norm`` (the policy's parameters) and ``value/grad_norm`` (the critic's), the summed loss as
        ``total_key``, and the guards. ``policy_step``: a policy update (steps Lightning's optimizer, which
        counts ``trainer.global_step``, and the learning-rate schedule); else the raw optimizer steps."""
        ranks = self.ranks
        num_tokens = ranks.reduce(mb.response_mask.sum().float())
        num_seqs = ranks.reduce(torch.tensor(float(len(mb)), device=mb.response_mask.device))
        for term in terms:
            term.begin(mb, self.aggregation, ranks.reduce)
        if num_tokens.item() == 0:
            # Every response of this minibatch, on every rank, is masked (e.g. all truncated under the overlong
            # filter): nothing to learn from, and a token mean would divide by zero. No update, not a failure.
            return {"guard/empty_updates": torch.tensor(1.0)}, False

        def aggregate(per_token: Tensor, mask: Tensor, how: Aggregation | None = None) -> Tensor:
            return (how or self.aggregation)(per_token, mask, num_tokens=num_tokens, num_seqs=num_seqs)

        optimizer = self.optimizer()
        optimizer.zero_grad(set_to_none=True)
        stats, finite = self._accumulate(mb, terms, aggregate, total_key, ranks.world_size)
        params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
        ranks.sum_gradients(params)
        out = reduce_stats(stats, micro_batches=True)
        norms = self.clip_gradients(optimizer, name)
        out.update(norms)
        grad_norm = torch.stack(list(norms.values())).sum() if norms else torch.zeros(())
        if ranks.world_size > 1:  # every rank must take the same decision
            finite = bool(ranks.reduce(torch.tensor(float(not finite), device=grad_norm.device)).item() == 0)
        if not finite or not torch.isfinite(grad_norm):
            out["guard/skipped_updates"] = self._skip(optimizer)
            return out, False
        self.consecutive_skips = 0
        out["guard/skipped_updates"] = torch.tensor(0.0)
        if policy_step:
            with record_function("rllight.update.optimizer"):
                optimizer.step()
            scheduler = self.scheduler()
            if scheduler is not None:
                scheduler.step()
        else:
            optimizer.optimizer.step()  # the raw optimizer: these steps do not count as global steps
        self.updates += 1
        # The gradients are spent (the next update starts from none): freed now, they do not sit beside the
        # generation's caches and the engine's copy of the policy until then.
        optimizer.zero_grad(set_to_none=True)
        return_free_memory()  # the update's activations, casts and gradients, freed: else resident through the next phase
        return out, any("policy" in term.trains for term in terms)

    def _accumulate(self, mb: Rollout, terms: Sequence[LossTerm], aggregate, total_key: str | None,
                    world_size: int) -> tuple[dict[str, list[Tensor]], bool]:
        """Forward and backward of each micro-batch of ``mb``: the per-micro-batch metrics, and whether every
        loss was finite (a micro-batch with a non-finite loss skips its backward)."""
        with_logprobs = any(t.needs_logprobs for t in terms)
        with_values = any(t.needs_values for t in terms)
        stats: dict[str, list[Tensor]] = {}

        def record(key: str, value: Tensor) -> None:
            stats.setdefault(key, []).append(value.detach())

        finite = True
        for rows, micro in self.scoring.padded_micro_batches(mb):
            real = rows is not None  # else a padding pass: FSDP needs every rank to run as many (loss times 0)
            mask = micro.response_mask.float()
            if real:  # the share of the forward's positions that are padding (prompt and response columns alike)
                positions = micro.prompt_mask.numel() + micro.valid_mask.numel()
                tokens = micro.prompt_mask.sum() + micro.valid_mask.sum()
                record("perf/padding_share", 1.0 - tokens.float() / max(positions, 1))
            out = Outputs(None, None, None)
            if with_logprobs or with_values:
                # Under autocast the weights' low-precision casts are made again in the backward pass, not kept.
                autocast = torch.is_autocast_enabled(mask.device.type)
                recast = RecastWeights() if autocast and not self.scoring.sharded else contextlib.nullcontext()
                with record_function("rllight.update.forward"), recast:
                    out = self.scoring.forward(micro, with_values=with_values, with_logprobs=with_logprobs)
            loss = torch.zeros((), device=mask.device)
            for term in terms:
                term_loss, term_stats = term(micro, out, aggregate)
                loss = loss + term_loss
                for k_, v in term_stats.items() if real else ():
                    record(k_, v)
            if not real:
                loss = torch.nan_to_num(loss, nan=0.0, posinf=0.0, neginf=0.0) * 0.0
            elif not torch.isfinite(loss):
                finite = False  # the whole update is skipped; under FSDP the backward still runs, with the ranks
                if not self.scoring.sharded:
                    continue
            # The denominators are global (all ranks), so the ranks' gradients are summed, not averaged.
            with self.no_sync(), record_function("rllight.update.backward"):
                self.backward(loss)
            if total_key is not None and real:
                record(total_key, loss * world_size)
        return stats, finite

    def _skip(self, optimizer) -> Tensor:
        """Drop a non-finite update's gradients; stop the run after ``max_consecutive_skips`` in a row."""
        self.consecutive_skips += 1
        step = self.step()
        log.warning("after update %d: non-finite loss or gradient; update skipped (%d in a row), the run stops at "
                    "model.guards.max_consecutive_skips=%d: if it recurs, lower the learning rate or set "
                    "model.grad_clip.policy",
                    step, self.consecutive_skips, self.max_consecutive_skips)
        optimizer.zero_grad(set_to_none=True)
        if self.consecutive_skips >= self.max_consecutive_skips:
            raise FloatingPointError(
                f"stopping after update {step}: {self.consecutive_skips} consecutive updates had a non-finite loss or "
                "gradient; lower the learning rate or check the reward, then resume from the checkpoint named above"
            )
        return torch.tensor(1.0)

    def clip_gradients(self, optimizer, name: str) -> dict[str, Tensor]:
        """Clip the policy's and the critic's gradients each to its own norm (``max_grad_norm``,
        ``critic_max_grad_norm``: ``model.grad_clip``; the critic's groups, e.g. backbone and head, together) and
        return the norms before clipping, as ``<name>/grad_norm`` and ``value/grad_norm`` (parts without gradients
        are left out). A part whose gradient is exactly zero has it removed (``None``): the optimizer step that
        follows does not move those weights."""
        families: dict[bool, list[Tensor]] = {False: [], True: []}
        for group in optimizer.param_groups:
            critic = str(group.get("name", "policy")).startswith("critic")
            families[critic] += [p for p in group["params"] if p.grad is not None]
        norms = {}
        for critic, params in families.items():
            if params:
                limit = self.critic_max_grad_norm if critic else self.max_grad_norm
                # Under FSDP each rank holds a shard of each gradient: the norm is the gathered total.
                norm = full_tensor(torch.nn.utils.get_total_norm([p.grad for p in params]))
                torch.nn.utils.clip_grads_with_norm_(params, limit if limit else float("inf"), norm)
                norms["value/grad_norm" if critic else f"{name}/grad_norm"] = norm.detach()
                if float(norm) == 0.0:
                    # Nothing to learn (every advantage 0, every token masked): no gradient at all, so that the
                    # optimizer leaves these weights as they are. AdamW would otherwise still move them, by its
                    # momentum and its weight decay. The norm is the gathered total: every rank decides alike.
                    for p in params:
                        p.grad = None
        return norms
