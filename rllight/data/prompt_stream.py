"""Where a step's prompts come from beyond the training loader's batch: ``PromptSource`` (the interface the module
and the rollout producer use), ``PromptStream`` (the extra prompts that samplers draw beyond a step's batch, e.g.
dynamic sampling's) and ``prompt_source`` (the datamodule's curriculum when it has one, else a stream)."""

from __future__ import annotations

import torch

from rllight.data.mix import SourceStreams, largest_remainder
from rllight.errors import RecipeError


class PromptSource:
    """What the module asks of the prompts' source at each training step.

    ``run`` makes the step's rollout from the loader's batch, ``draw`` gives the extra prompts a sampler asks
    for (``RolloutProducer.more_prompts``), ``observe`` hears each prompt's pass rate whenever a training rollout
    is scored (every group generated, also those a sampler drops), and ``state_dict`` is saved in checkpoints.
    This base class trains on the loader's batch as it is and logs the data mix's weights of the step.
    """

    mix = None  # the datamodule's SourceMix, for its per-step weights
    step = 0  # the training batch being run (counted from the run's first)

    def run(self, sampler, producer, rows: list[dict], step: int):
        """The rollout of training batch ``step`` (counted from the run's first), whose loader rows are ``rows``."""
        self.step = step
        rollout = sampler(producer, rows)
        if self.mix is not None:
            rollout.extras.update({f"data/{s}/weight": w for s, w in self.mix.weights_at(step).items()})
        return rollout

    def draw(self, n: int) -> list[dict]:
        raise NotImplementedError

    def observe(self, rows: list[dict], pass_rates: list[float]) -> None:
        """Each of ``rows`` was answered in a training rollout, its responses correct at ``pass_rates``."""

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


class PromptStream(PromptSource):
    """A seeded stream over the training rows, independent of the dataloader's order: a fresh permutation
    per pass, derived from the position alone, so a checkpoint only needs ``cursor``. Under DDP each rank
    takes every ``world``-th row from its own offset ``rank``, so ranks never draw the same extra prompts.

    With a data ``mix`` each draw of ``n`` is shared among the sources by the step's weights (largest remainders,
    the same on every rank), each source from a stream of its own rows in the same way (``source_cursors``).
    """

    def __init__(self, rows: list[dict], seed: int = 1234, world: int = 1, rank: int = 0):
        if not rows:
            raise ValueError("PromptStream needs at least one row")
        self.rows = rows
        self.seed = seed
        self.world = world
        self.rank = rank
        self.cursor = 0  # rows drawn so far by this rank
        self.source_cursors: dict[str, int] = {}  # with a mix: rows drawn so far of each source
        self._streams: SourceStreams | None = None  # with a mix: each source's stream
        self._epoch = -1
        self._order: list[int] = []

    def draw(self, n: int) -> list[dict]:
        if self.mix is not None:
            return self._draw_mixed(n)
        out = []
        for _ in range(n):
            epoch, position = divmod(self.cursor * self.world + self.rank, len(self.rows))
            if epoch != self._epoch:
                g = torch.Generator().manual_seed(self.seed + epoch)
                self._order = torch.randperm(len(self.rows), generator=g).tolist()
                self._epoch = epoch
            out.append(self.rows[self._order[position]])
            self.cursor += 1
        return out

    def _draw_mixed(self, n: int) -> list[dict]:
        if self._streams is None:  # the rows as fitted to the model's context, once the first step draws
            self._streams = SourceStreams(self.rows, self.seed)
        weights = {s: w for s, w in self.mix.weights_at(self.step).items() if w > 0 and s in self._streams.by_source}
        out = []
        for source, count in largest_remainder(weights, n).items():
            for _ in range(count):
                cursor = self.source_cursors.get(source, 0)
                out.append(self.rows[self._streams.item(source, cursor * self.world + self.rank)])
                self.source_cursors[source] = cursor + 1
        self.cursor += len(out)
        return out

    def state_dict(self) -> dict:
        """The position: the order of every pass follows from it (and each source's, with a mix)."""
        return {"cursor": self.cursor, **({"source_cursors": dict(self.source_cursors)} if self.source_cursors else {})}

    def load_state_dict(self, state: dict) -> None:
        self.cursor = state.get("cursor", 0)
        self.source_cursors = dict(state.get("source_cursors", {}))


def prompt_source(datamodule, train_rows: list[dict], ranks, engine) -> PromptSource:
    """The datamodule's ``curriculum`` (``data.curriculum``), bound to its training rows, or else a
    ``PromptStream`` over them; either logs the datamodule's ``mix`` weights. A curriculum chooses each step's
    prompts from the pass rates of the steps before, so it cannot run with rollouts generated ahead."""
    curriculum = getattr(datamodule, "curriculum", None)
    if curriculum is not None:
        if getattr(engine, "max_staleness", 0):
            raise RecipeError("data.curriculum chooses each step's prompts from the pass rates of the steps before it, "
                              "so they cannot be generated ahead: set model.rollout.init_args.max_staleness to 0, or "
                              "remove data.curriculum")
        source = curriculum.bind(train_rows, datamodule.seed)
    else:
        source = PromptStream(train_rows, world=ranks.world_size, rank=ranks.rank)
    source.mix = getattr(datamodule, "mix", None)
    return source
