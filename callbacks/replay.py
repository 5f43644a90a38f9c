"""Self-imitation on a replay buffer of successful responses (VAPO note 000, eq. 11; SIL, Oh et al.,
arXiv:1806.05635), as a rollout callback."""

from __future__ import annotations

import hashlib
from typing import Any

import lightning as L
import torch

from rllight.bounds import NonNegativeFloat, PositiveInt, bounded
from rllight.callbacks.base import RolloutCallback, RolloutContext, saved_ranks, state_of_every_rank
from rllight.distributed import Ranks, share
from rllight.errors import RecipeError
from rllight.rollout.base import pad_left
from rllight.strategies import Aggregation
from rllight.types import Rollout

POLICIES = ("fifo", "highest_reward", "reservoir")


def build_rollout(entries: list[dict], pad_id: int, device: torch.device | str = "cpu") -> Rollout:
    """A Rollout of stored responses: prompts left-padded, responses right-padded, masks from the
    stored (unpadded) lengths. Sampling log-probs are zeros (nothing was sampled); ``correct`` is 1.

    Args:
        entries: Dicts with ``prompt_ids`` and ``response_ids`` (1-D long tensors), ``reward`` (float),
            ``answer`` and ``text`` (str); a multi-turn episode also has ``action_mask`` (1-D, 1 on the model's
            tokens, 0 on the observations between them), and the replayed row gets a ``context_mask``.
    """
    prompt_ids, prompt_mask = pad_left([e["prompt_ids"].tolist() for e in entries], pad_id)
    width = max(len(e["response_ids"]) for e in entries)
    response_ids = torch.full((len(entries), width), pad_id, dtype=torch.long)
    response_mask = torch.zeros((len(entries), width), dtype=torch.long)
    context_mask = torch.zeros((len(entries), width), dtype=torch.long)
    multi_turn = any("action_mask" in e for e in entries)
    for i, e in enumerate(entries):
        n = len(e["response_ids"])
        response_ids[i, :n] = e["response_ids"]
        context_mask[i, :n] = 1
        response_mask[i, :n] = e["action_mask"] if "action_mask" in e else 1
    rollout = Rollout(
        prompt_ids=prompt_ids, prompt_mask=prompt_mask, response_ids=response_ids, response_mask=response_mask,
        sample_logprobs=torch.zeros(response_ids.shape), truncated=torch.zeros(len(entries), dtype=torch.bool),
        group_ids=torch.arange(len(entries)), answers=[e["answer"] for e in entries],
        texts=[e["text"] for e in entries],
        rewards=torch.tensor([e["reward"] for e in entries], dtype=torch.float32),
        correct=torch.ones(len(entries)),
        context_mask=context_mask if multi_turn else None,
    )
    return rollout.to(device)


class SelfImitation(RolloutCallback):
    """Keep successful responses in a replay buffer and, every ``every_n_steps`` RL steps, take one
    supervised update on a sample of them: ``coef * -log pi(y* | x)``, aggregated like the policy loss
    (``RolloutContext.updater.nll_update``; VAPO note 000 step 5, eq. 11).

    A response is a success when ``rollout.correct`` is set (or, with ``min_reward``, when its reward is at
    least ``min_reward``). Each entry stores on CPU what rebuilds a Rollout: the prompt's and the
    response's token ids without padding (their lengths give the masks), the reward, answer and text.
    The replay runs in ``on_train_batch_end``, after the step's policy update as in note 000, with the context
    the step's ``on_rollout`` was given; a step consumed by an earlier callback (value pretraining) neither stores
    nor replays.

    Replacement when the buffer is full (note 000 leaves it open):
        ``fifo``: the oldest entry leaves.
        ``highest_reward``: the new entry replaces the lowest-reward entry (the oldest among equals) if
            its reward is at least as high; with 0/1 rewards this is fifo among the successes.
        ``reservoir``: the n-th success offered replaces a uniformly drawn slot with probability
            capacity / n (a uniform sample of every success seen; Vitter's algorithm R).

    The buffer, the counters and the sampling generator are in ``state_dict``, so resume restores them.

    Under several processes each rank keeps a buffer of its own responses and replays its share of the batch. With
    ``unique`` no response is held twice over all of them: each step the ranks tell each other what they offer and
    what left their buffers, and a response offered by several ranks at once goes to the first in rank order (one
    process would have stored it once). A checkpoint holds every rank's buffer and each rank resumes its own; resumed
    on another number of processes, the stored entries are dealt out among them, oldest first.

    Metrics: ``train/sil/{buffer_size,added}`` each step; ``train/sil/{nll,replayed}`` on replay steps.

    Args:
        capacity: Most entries kept.
        every_n_steps: Replay on every n-th RL step that reaches this callback (N_sil).
        batch_size: Entries per replay update over all processes, each drawing an equal share from its own buffer
            (without replacement; fewer while the buffer is small).
        coef: Weight of the NLL loss.
        policy: Replacement policy: fifo, highest_reward or reservoir.
        min_reward: Success threshold on the reward (None = use ``rollout.correct``).
        unique: Skip a response already in the buffer (any rank's) for the same prompt.
        seed: Seed of the buffer's own generator (reservoir slots, replay samples).
        aggregation: How the replayed tokens' NLL becomes one number (None = like the policy loss,
            ``model.aggregation``). Note 000's eq. 11 sums over each response's tokens and averages over responses:
            ``rllight.strategies.SeqMeanTokenSum``; a token mean keeps the term's scale apart from response length.
    """

    rollout_order = 40

    @bounded
    def __init__(self, capacity: PositiveInt = 256, every_n_steps: PositiveInt = 1, batch_size: PositiveInt = 8,
                 coef: NonNegativeFloat = 0.1, policy: str = "fifo", min_reward: float | None = None,
                 unique: bool = True, seed: int = 0, aggregation: Aggregation | None = None):
        if policy not in POLICIES:
            raise RecipeError(f"trainer.callbacks: SelfImitation.policy must be one of {', '.join(POLICIES)}, "
                              f"got {policy!r}")
        self.capacity = capacity
        self.every_n_steps = every_n_steps
        self.batch_size = batch_size
        self.coef = coef
        self.policy = policy
        self.min_reward = min_reward
        self.unique = unique
        self.seed = seed
        self.aggregation = aggregation
        self.entries: list[dict] = []
        self.offered = 0  # successes offered to the buffer (duplicates excluded): reservoir's n
        self.insertions = 0  # a clock for "oldest"
        self.steps_seen = 0
        self._keys: set[bytes] = set()  # the stored responses' keys; under several processes, every rank's
        self._gone: set[bytes] = set()  # keys that left this rank's buffer since the ranks last told each other
        self._ranks: Ranks | None = None
        self._generator = torch.Generator().manual_seed(seed)
        self._pending: RolloutContext | None = None  # the context of a step that reached on_rollout, until replay

    # ------------------------------------------------------------------------------- buffer
    @staticmethod
    def _key(entry: dict) -> bytes:
        """What ``unique`` compares: a digest of the prompt's and the response's token ids."""
        digest = hashlib.blake2b(digest_size=16)
        for ids in (entry["prompt_ids"], entry["response_ids"]):
            digest.update(len(ids).to_bytes(8, "little") + ids.to(torch.int64).numpy().tobytes())
        return digest.digest()

    def _evict(self, index: int) -> None:
        key = self._key(self.entries[index])
        self._keys.discard(key)
        self._gone.add(key)

    def add(self, entry: dict, cleared: bool = False) -> bool:
        """Offer one entry; returns whether it entered the buffer. ``cleared``: the ranks found it new together
        (``_new_on_every_rank``), so this rank does not check it again."""
        key = self._key(entry)
        if self.unique and key in self._keys and not cleared:
            return False
        self.offered += 1
        entry = dict(entry, order=self.insertions)
        if len(self.entries) < self.capacity:
            self.entries.append(entry)
        else:
            slot = self._slot_for(entry)
            if slot is None:
                self._gone.add(key)  # the ranks counted it as held: tell them it is not
                return False
            self._evict(slot)
            self.entries[slot] = entry
        self._keys.add(key)
        self.insertions += 1
        return True

    def _new_on_every_rank(self, offers: list[dict], ranks: Ranks) -> list[dict]:
        """This rank's ``offers`` that no rank holds and no rank before it offers this step (a collective: every
        rank hears what each offers and what left each buffer since the last step, so every rank's ``_keys`` stay
        the same: the keys held anywhere, counting this step's new ones as held until a rank reports otherwise)."""
        heard = ranks.gather_objects(([self._key(entry) for entry in offers], sorted(self._gone)))
        self._gone = set()
        for _, gone in heard:
            self._keys.difference_update(gone)
        new = []
        for rank, (keys, _) in enumerate(heard):
            for i, key in enumerate(keys):
                if key not in self._keys:
                    self._keys.add(key)
                    if rank == ranks.rank:
                        new.append(offers[i])
        return new

    def _slot_for(self, entry: dict) -> int | None:
        """The slot a new entry replaces in a full buffer, or None when the policy rejects it."""
        if self.policy == "fifo":
            return min(range(len(self.entries)), key=lambda i: self.entries[i]["order"])
        if self.policy == "highest_reward":
            slot = min(range(len(self.entries)), key=lambda i: (self.entries[i]["reward"], self.entries[i]["order"]))
            return slot if entry["reward"] >= self.entries[slot]["reward"] else None
        # reservoir: keep the n-th offer with probability capacity / n, in a uniformly drawn slot
        slot = int(torch.randint(self.offered, (1,), generator=self._generator))
        return slot if slot < self.capacity else None

    def sample(self, n: int) -> list[dict]:
        """Up to ``n`` distinct entries, uniformly."""
        order = torch.randperm(len(self.entries), generator=self._generator)[:n]
        return [self.entries[i] for i in order.tolist()]

    # -------------------------------------------------------------------------------- hooks
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._ranks = Ranks(trainer)  # before a checkpoint's state is loaded: each rank takes its own
        # refused at the start
        share(self.batch_size, trainer.world_size, "trainer.callbacks: SelfImitation.batch_size")

    def on_rollout(self, trainer: L.Trainer | None, context: RolloutContext, rollout: Rollout) -> Rollout:
        self.steps_seen += 1
        self._pending = context
        if self.min_reward is not None:
            success = rollout.rewards >= self.min_reward
        elif rollout.correct is not None:
            success = rollout.correct > 0
        else:
            raise ValueError("SelfImitation needs rollout.correct, or set min_reward")
        lengths = rollout.response_lengths
        prompt_mask = rollout.prompt_mask.bool()
        valid = rollout.valid_mask.bool()  # a multi-turn episode keeps its observations, as context
        offers = []
        for i in torch.nonzero(success & (lengths > 0)).flatten().tolist():
            entry = {
                "prompt_ids": rollout.prompt_ids[i][prompt_mask[i]].detach().cpu().clone(),
                "response_ids": rollout.response_ids[i][valid[i]].detach().cpu().clone(),
                "reward": float(rollout.rewards[i]),
                "answer": rollout.answers[i],
                "text": rollout.texts[i],
            }
            if rollout.context_mask is not None:
                entry["action_mask"] = rollout.response_mask[i][valid[i]].detach().cpu().clone()
            offers.append(entry)
        ranks = getattr(context, "ranks", None)
        if self.unique and ranks is not None and ranks.world_size > 1:
            added = sum(self.add(entry, cleared=True) for entry in self._new_on_every_rank(offers, ranks))
        else:
            added = sum(self.add(entry) for entry in offers)
            self._gone.clear()  # one process: its keys are all there is
        rollout.extras["sil/buffer_size"] = float(len(self.entries))
        rollout.extras["sil/added"] = float(added)
        return rollout

    def on_train_batch_end(self, trainer: L.Trainer | None, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        context, self._pending = self._pending, None
        if context is None or self.steps_seen % self.every_n_steps:
            return
        # Under DDP every rank replays together (the update is a collective): a rank whose own buffer is
        # still empty takes part with no rows; nobody replays until some rank has an entry.
        if not context.ranks.any(bool(self.entries)):
            return
        if self.entries:
            size = share(self.batch_size, context.ranks.world_size, "trainer.callbacks: SelfImitation.batch_size")
            replayed = build_rollout(self.sample(size), context.tokenizer.pad_token_id, context.device)
        else:
            replayed = Rollout.empty().to(context.device)
        stats = context.updater.nll_update(replayed, self.coef, aggregation=self.aggregation)
        metrics = {"train/sil/replayed": float(len(replayed))}
        if "nll/loss" in stats:
            metrics["train/sil/nll"] = float(stats["nll/loss"])
        context.log(metrics)

    # -------------------------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        own = {"entries": [dict(e) for e in self.entries], "offered": self.offered, "insertions": self.insertions,
               "steps_seen": self.steps_seen, "generator": self._generator.get_state()}
        return state_of_every_rank(self._ranks, own)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        saved = saved_ranks(state_dict)
        world, rank = (self._ranks.world_size, self._ranks.rank) if self._ranks is not None else (1, 0)
        own = saved[rank] if len(saved) == world else saved[0]
        self.offered = int(own["offered"])
        self.insertions = int(own["insertions"])
        self.steps_seen = int(own["steps_seen"])
        self._generator.set_state(own["generator"])
        if len(saved) == world:
            buffers = [[dict(e) for e in part["entries"]] for part in saved]
        else:  # another number of processes: the entries dealt out, oldest first, each rank keeping its newest
            pooled = sorted((dict(e) for part in saved for e in part["entries"]), key=lambda e: e["order"])
            buffers = [pooled[r::world][-self.capacity :] for r in range(world)]
            self.insertions = max((e["order"] + 1 for e in pooled), default=self.insertions)
        self.entries = buffers[rank]
        held = buffers if self.unique and world > 1 else [self.entries]  # the keys every rank holds
        self._keys = {self._key(e) for part in held for e in part}
        self._gone = set()
        self._pending = None
