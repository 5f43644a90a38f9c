"""Where a step's prompts come from: ``PromptSource`` (the data side of a training step, which the module and the
rollout producer use), ``PromptStream`` (the extra prompts that samplers draw beyond a step's batch, e.g. dynamic
sampling's) and ``prompt_source`` (the datamodule's curriculum when it has one, else a stream)."""

from __future__ import annotations

import torch

from rllight.data.mix import SourceStreams, largest_remainder
from rllight.errors import RecipeError


class PromptSource:
    """The data side of each training step: it makes the step's prompts and counts the step.

    ``run`` makes the step's rollout (this base class: from the loader's batch as it is), ``draw`` gives the extra
    prompts a sampler asks for (``RolloutProducer.more_prompts``), ``hear`` hears each prompt's pass rate whenever
    a training rollout is scored (every group generated, also those a sampler drops), ``trained`` counts the step
    done, and ``state_dict`` is saved in checkpoints. The mix's weights of the step are read once, logged as
    ``data/<source>/weight``.
    """

    mix = None  # the datamodule's SourceMix, for its per-step weights
    data = None  # the datamodule: its ``batches_trained`` counts the steps, its ``step_counts`` sizes a step
    step = 0  # the training batch being run (counted from the run's first)
    _step_weights: tuple[int, dict[str, float]] | None = None  # (step, the mix's weights at it)

    def run(self, sampler, producer, rows: list[dict]):
        """The rollout of the next training batch (the data's ``batches_trained``), whose loader rows are ``rows``."""
        self.step = int(getattr(self.data, "batches_trained", 0))
        rollout = self.sample(sampler, producer, rows)
        if self.mix is not None:
            rollout.extras.update({f"data/{s}/weight": w for s, w in self.mix_weights().items()})
        return rollout

    def sample(self, sampler, producer, rows: list[dict]):
        """The step's rollout: here ``sampler`` on the loader's ``rows``."""
        return sampler(producer, rows)

    def trained(self) -> None:
        """The step is trained: the data counts it (``batches_trained``, saved in checkpoints: a resumed run's loader
        and prompts go on from the next batch)."""
        if hasattr(self.data, "batches_trained"):
            self.data.batches_trained += 1

    def mix_weights(self) -> dict[str, float]:
        """The mix's weights of the running step, normalised (computed once a step)."""
        if self._step_weights is None or self._step_weights[0] != self.step:
            self._step_weights = (self.step, self.mix.weights_at(self.step))
        return self._step_weights[1]

    def draw(self, n: int) -> list[dict]:
        raise NotImplementedError

    def hear(self, rows: list[dict], pass_rates: list[float]) -> None:
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
        weights = {s: w for s, w in self.mix_weights().items() if w > 0 and s in self._streams.by_source}
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
    """The data side of the training steps: the datamodule's ``curriculum`` (``data.curriculum``), bound to its
    training rows, or else a ``PromptStream`` over them; either logs the datamodule's ``mix`` weights and counts
    the steps in its ``batches_trained``. A curriculum chooses each step's prompts from the pass rates of the steps
    before, so it cannot run with rollouts generated ahead."""
    curriculum = getattr(datamodule, "curriculum", None)
    if curriculum is not None:
        if getattr(engine, "max_staleness", 0):
            raise RecipeError("data.curriculum chooses each step's prompts from the pass rates of the steps before it, "
                              "so they cannot be generated ahead: set model.rollout.init_args.max_staleness to 0, or "
                              "remove data.curriculum")
        source = curriculum.bind(train_rows, datamodule.seed)
    else:
        source = PromptStream(train_rows, world=ranks.world_size, rank=ranks.rank)
    source.mix, source.data = getattr(datamodule, "mix", None), datamodule
    return source
