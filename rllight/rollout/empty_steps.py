"""Why RL steps had nothing to train on: ``EmptySteps`` counts the causes as a step's rollout is made, so that the
line that ends a run without updates names them, with their counts, instead of one guess."""

from __future__ import annotations

from collections import Counter

NO_PROMPTS = "no_prompts"
"""A step whose data side gave no prompt (e.g. a curriculum whose prompts are all retired)."""
TOO_LONG = "too_long"
"""Prompts dropped as longer than the limit (``max_prompt_tokens``, an environment's ``max_total_tokens``)."""
FAILED_BEFORE_FIRST_TURN = "failed_before_first_turn"
"""Episodes whose environment failed in ``reset`` (or ``tools``): not played, no model token."""
MALFORMED = "malformed"
"""Engine batches dropped as malformed (``rllight.rollout.base.malformed``)."""
SAMPLED = "sampled"
"""Responses (or episodes) with at least one model token: something to train on, unless a filter drops it."""
EMPTY_RESPONSES = "empty_responses"
"""Responses (or episodes) without a model token."""
EMPTIED = "emptied"
"""Steps whose rollout a rollout callback emptied."""


class EmptySteps:
    """The causes of the current step (``add``, from ``begin_step`` on), and those of the steps without an update in
    a row (``no_update``: the step's added to the run's, or a new run started from them); ``describe`` says them in
    words. Each cause may carry one note (the first given: a limit, an error, the data side's reason)."""

    def __init__(self):
        self.step: Counter[str] = Counter()
        self.run: Counter[str] = Counter()
        self.steps = 0  # steps in the run without an update
        self.notes: dict[str, str] = {}
        self._step_notes: dict[str, str] = {}

    def begin_step(self) -> None:
        self.step, self._step_notes = Counter(), {}

    def add(self, cause: str, count: int = 1, note: str | None = None) -> None:
        if count:
            self.step[cause] += count
            if note and cause not in self._step_notes:
                self._step_notes[cause] = note

    def no_update(self, new_run: bool, emptied_by: str | None = None) -> None:
        """The step made no update: its causes join the run's (a new run with ``new_run``); ``emptied_by`` names the
        rollout callback that emptied the step's rollout, if one did."""
        if emptied_by:
            self.add(EMPTIED, 1, emptied_by)
        if new_run:
            self.run, self.notes, self.steps = Counter(), {}, 0
        self.run.update(self.step)
        for cause, note in self._step_notes.items():
            self.notes.setdefault(cause, note)
        self.steps += 1
        self.begin_step()

    def describe(self) -> str:
        """The run's causes in words, e.g. ``"8 RL steps drew no prompt (...); 16 prompts dropped as longer than
        max_prompt_tokens=3"``."""
        run, notes = self.run, self.notes
        if not self.steps:
            return ("no RL step had an empty rollout: no training batch reached an RL step, or every update was "
                    "skipped (see train/guard/skipped_updates)")
        parts = []
        if run[NO_PROMPTS]:
            why = notes.get(NO_PROMPTS, "the data side gave none")
            parts.append(f"{run[NO_PROMPTS]} RL step(s) drew no prompt ({why})")
        if run[TOO_LONG]:
            parts.append(f"{run[TOO_LONG]} prompt(s) dropped as longer than {notes.get(TOO_LONG, 'the limit')}")
        if run[FAILED_BEFORE_FIRST_TURN]:
            parts.append(f"{run[FAILED_BEFORE_FIRST_TURN]} episode(s) whose environment failed before the first turn "
                         f"(first: {notes.get(FAILED_BEFORE_FIRST_TURN, '?')})")
        if run[MALFORMED]:
            parts.append(f"{run[MALFORMED]} engine batch(es) that could not be trained on (first: "
                         f"{notes.get(MALFORMED, '?')})")
        if run[EMPTY_RESPONSES]:
            parts.append(f"{run[EMPTY_RESPONSES]} response(s) without a token")
        if run[EMPTIED]:
            parts.append(f"{run[EMPTIED]} rollout(s) emptied by the rollout callback {notes[EMPTIED]}")
        elif run[SAMPLED]:
            parts.append(f"model.sampler kept none of the {run[SAMPLED]} response(s) it sampled (see "
                         "train/sampling/*: e.g. dynamic sampling drops the groups whose rewards are all equal)")
        return "; ".join(parts) or "the rollouts were empty"
