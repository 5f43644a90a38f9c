"""The embedded arithmetic task: deterministic by seed, mixed difficulty, with a held-out split."""

from __future__ import annotations

import random

from rllight.data.task import Task


class ArithmeticTask(Task):
    """Integer arithmetic problems of mixed difficulty, so that answer lengths vary (1 to 4 digits).

    Kinds, drawn uniformly: one-digit sums, two-digit sums, two-digit differences (non-negative),
    times tables up to 12, and a two-digit number times a one-digit number. Train and validation
    problems come from one stream of ``seed``; the validation problems are held out of training
    (no question text appears in both).

    Args:
        num_train: Training problems.
        num_val: Held-out problems.
        seed: Seed of the problem stream.
        instruction: Appended to each question.
    """

    def __init__(
        self,
        num_train: int = 2000,
        num_val: int = 200,
        seed: int = 0,
        instruction: str = "Answer with just the number.",
    ):
        self.num_train = num_train
        self.num_val = num_val
        self.seed = seed
        self.instruction = instruction

    def _problem(self, rng: random.Random) -> tuple[str, int]:
        kind = rng.randrange(5)
        if kind == 0:
            a, b = rng.randint(0, 9), rng.randint(0, 9)
            return f"{a} + {b}", a + b
        if kind == 1:
            a, b = rng.randint(10, 99), rng.randint(10, 99)
            return f"{a} + {b}", a + b
        if kind == 2:
            a, b = sorted((rng.randint(10, 99), rng.randint(10, 99)), reverse=True)
            return f"{a} - {b}", a - b
        if kind == 3:
            a, b = rng.randint(2, 12), rng.randint(2, 12)
            return f"{a} * {b}", a * b
        a, b = rng.randint(10, 99), rng.randint(2, 9)
        return f"{a} * {b}", a * b

    def splits(self) -> tuple[list[dict], list[dict]]:
        """``(train, val)`` rows with fields ``prompt`` and ``answer`` (strings)."""
        rng = random.Random(self.seed)
        seen: set[str] = set()
        val: list[dict] = []
        # Held-out problems are drawn first and never repeated; training problems may repeat among
        # themselves (small problem spaces) but never match a held-out one.
        while len(val) < self.num_val:
            expr, result = self._problem(rng)
            if expr not in seen:
                seen.add(expr)
                val.append(self._row(expr, result))
        train: list[dict] = []
        attempts = 0
        while len(train) < self.num_train:
            attempts += 1
            if attempts > 100 * self.num_train:
                raise ValueError("data.task: cannot draw enough training problems disjoint from the held-out split; "
                                 "lower num_val")
            expr, result = self._problem(rng)
            if expr not in seen:
                train.append(self._row(expr, result))
        return train, val

    def _row(self, expr: str, result: int) -> dict:
        question = f"What is {expr}?"
        if self.instruction:
            question = f"{question} {self.instruction}"
        return {"prompt": question, "answer": str(result)}
