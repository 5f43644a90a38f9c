"""reasoning-gym's procedural tasks as training and validation rows (``bash tools/install.sh reasoning-gym``).

In a recipe (with ``model.reward: rllight.rewards.ReasoningGymScore``, which scores each row with its task's own
verifier)::

    data:
      task:
        class_path: rllight.data.ReasoningGymTask
        init_args:
          tasks:
            chain_sum: {weight: 1.0, config: {min_terms: 2, max_terms: 3}}
            leg_counting: {weight: 1.0}
          train_size: 2000
          val_size: 200
"""

from __future__ import annotations

from rllight.bounds import NonNegativeInt, PositiveFloat, PositiveInt, bounded, checked
from rllight.data.task import Task
from rllight.errors import RecipeError
from rllight.rewards.reasoning_gym import create_dataset, import_reasoning_gym, row_answer

_VAL_SEED_OFFSET = 1_000_003
"""The held-out split's seed is the training seed plus this: another stream of the same generators."""


class ReasoningGymTask(Task):
    """Rows from reasoning-gym generators, mixed by weight; each row's ``data_source`` is its task's name.

    Each task's training rows are ``create_dataset(name, seed=seed, size=n, **config)`` and its held-out rows
    the same generator with another seed; a training row whose question is also a held-out question is
    dropped (small problem spaces repeat), so the splits never share a row. The held-out rows are interleaved
    task by task, so that ``data.val_size`` keeps the mix.

    Args:
        tasks: Task name -> ``{weight: float, config: {generator settings}}`` (both optional; weight 1).
        train_size: Training rows over all tasks, shared by weight.
        val_size: Held-out rows over all tasks, shared by weight.
        seed: Seed of the training split (the held-out split uses ``seed + 1000003``).
        instruction: Appended to each question: how to give the final answer (``ReasoningGymScore`` reads the
            last ``\\boxed{}``, else an ``<answer>`` tag, else the last line).
    """

    @bounded
    def __init__(self, tasks: dict[str, dict] | None = None, train_size: PositiveInt = 2000,
                 val_size: NonNegativeInt = 200, seed: int = 0,
                 instruction: str = "Give only the final answer, on the last line."):
        import_reasoning_gym("data.task: ReasoningGymTask")  # before the model loads
        tasks = dict(tasks or {"chain_sum": {}})
        for name, spec in tasks.items():
            spec = spec or {}
            unknown = set(spec) - {"weight", "config"}
            if unknown or not isinstance(spec.get("config", {}), dict):
                raise RecipeError(f"data.task.init_args.tasks.{name}: give {{weight: <number>, config: {{...}}}}, "
                                  f"got {spec!r}")
            checked(f"data.task.init_args.tasks.{name}.weight", spec.get("weight", 1.0), PositiveFloat)
        self.tasks = {name: {"weight": float((spec or {}).get("weight", 1.0)),
                             "config": dict((spec or {}).get("config", {}))} for name, spec in tasks.items()}
        self.train_size, self.val_size, self.seed, self.instruction = train_size, val_size, seed, instruction

    def _shares(self, total: int) -> dict[str, int]:
        """``total`` rows shared by weight (largest remainders), every task at least one when there is room."""
        weights = {name: spec["weight"] for name, spec in self.tasks.items()}
        whole = sum(weights.values())
        exact = {name: total * w / whole for name, w in weights.items()}
        shares = {name: int(x) for name, x in exact.items()}
        for name in sorted(exact, key=lambda n: shares[n] - exact[n])[: total - sum(shares.values())]:
            shares[name] += 1
        return shares

    def _rows(self, name: str, seed: int, size: int, skip: set[str]) -> list[dict]:
        config = self.tasks[name]["config"]
        dataset = create_dataset(name, config, seed, size, f"data.task.init_args.tasks.{name}")
        rows = []
        for index in range(size):
            entry = dataset[index]
            prompt = f"{entry['question'].strip()}\n{self.instruction}" if self.instruction else entry["question"]
            if prompt in skip:
                continue
            rows.append({"prompt": prompt, "answer": row_answer(name, config, seed, size, index, str(entry["answer"])),
                         "data_source": name})
        return rows

    def splits(self) -> tuple[list[dict], list[dict]]:
        val_by_task, train = {}, []
        for name, size in self._shares(self.val_size).items():
            val_by_task[name] = self._rows(name, self.seed + _VAL_SEED_OFFSET, size, set()) if size else []
        held_out = {row["prompt"] for rows in val_by_task.values() for row in rows}
        for name, size in self._shares(self.train_size).items():
            rows = self._rows(name, self.seed, size, held_out)
            if size and not rows:
                raise RecipeError(f"data.task.init_args.tasks.{name}: every training row is also a held-out row (the "
                                  "generator's problem space is too small); widen its config or lower val_size")
            train += rows
        longest = max((len(rows) for rows in val_by_task.values()), default=0)
        val = [rows[i] for i in range(longest) for rows in val_by_task.values() if i < len(rows)]
        return train, val


__all__ = ["ReasoningGymTask"]
