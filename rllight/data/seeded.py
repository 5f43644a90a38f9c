"""Rows that carry a seed and nothing to answer: for an environment that makes its task from the seed.

An environment such as ``rllight.envs.textarena.TextArena`` draws its own task (a game) from each row's ``seed``, so
the data only has to say which seeds train and which are held out::

    data:
      task:
        class_path: rllight.data.seeded.SeededTask
        init_args:
          train_size: 2000   # seeds 0 .. 1999
          val_size: 100      # seeds 1000000 .. 1000099
          data_source: GuessTheNumber-v0
"""

from __future__ import annotations

from rllight.bounds import NonNegativeInt, PositiveInt, bounded
from rllight.data.task import Task
from rllight.errors import RecipeError

VAL_SEED = 1_000_000
"""The first held-out seed by default: far from the training seeds, so that growing ``train_size`` never reaches
the held-out games, and the held-out games stay the same whatever ``train_size`` is."""


class SeededTask(Task):
    """One row per seed: ``{"prompt": instruction, "answer": "", "seed": s, "data_source": data_source}``.

    The datamodule turns the prompt into the chat messages ``[{"role": "user", "content": instruction}]`` (after
    ``data.system_prompt``, where set); the environment adds its opening text to that message and scores the
    episodes itself, so the answer is empty (the recipe's ``model.reward`` is not asked, and its
    ``reward_preflight`` has no answer to check: set it to 0). Training seeds are ``seed .. seed + train_size - 1``,
    held-out seeds ``val_seed .. val_seed + val_size - 1``; the two ranges may not overlap, so a held-out game is
    never trained on.

    Args:
        train_size: Training rows (seeds).
        val_size: Held-out rows (seeds).
        seed: The first training seed.
        val_seed: The first held-out seed.
        instruction: The user message the environment's opening text follows (may be empty).
        data_source: The rows' dataset name, which evaluation reports under (e.g. the game's id).
    """

    @bounded
    def __init__(self, train_size: PositiveInt = 2000, val_size: NonNegativeInt = 200, seed: int = 0,
                 val_seed: int = VAL_SEED, instruction: str = "", data_source: str = "seeded"):
        key = "data.task.init_args"
        if val_size and seed < val_seed + val_size and val_seed < seed + train_size:
            raise RecipeError(f"{key}: the training seeds {seed}..{seed + train_size - 1} overlap the held-out seeds "
                              f"{val_seed}..{val_seed + val_size - 1}; move seed or val_seed apart")
        if not isinstance(instruction, str):
            raise RecipeError(f"{key}.instruction must be text (may be empty), got {instruction!r}")
        if not isinstance(data_source, str) or not data_source.strip():
            raise RecipeError(f"{key}.data_source must name the rows' dataset, got {data_source!r}")
        self.train_size, self.val_size, self.seed, self.val_seed = train_size, val_size, seed, val_seed
        self.instruction, self.data_source = instruction, data_source

    def rows(self, first: int, count: int) -> list[dict]:
        """Rows of the seeds ``first .. first + count - 1``."""
        return [{"prompt": self.instruction, "answer": "", "seed": s, "data_source": self.data_source}
                for s in range(first, first + count)]

    def splits(self) -> tuple[list[dict], list[dict]]:
        return self.rows(self.seed, self.train_size), self.rows(self.val_seed, self.val_size)


__all__ = ["VAL_SEED", "SeededTask"]
