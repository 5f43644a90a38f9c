"""The reward pre-flight: before training, the reward must tell right from wrong on a few rows.

For each checked row, the response ``REFERENCE_RESPONSE`` ("The answer is \\boxed{<answer>}.", with the answer the
row's field stands for: ``Reward.reference_answer``) must be solved and the same response with a wrong answer must
not: the answer's last digit changed (7 -> 8, 9 -> 0), or "<answer> + 1" when it has no digit. Otherwise the recipe
stops with one line naming the reward and the row: a reward that scores every response 0, or 1, would otherwise
train on nothing without a word. The check scores through the reward the trainer uses (its verifiers in the reward
workers, when there are some).
"""

from __future__ import annotations

import logging

from rllight.errors import RecipeError
from rllight.rewards.base import Reward, quote
from rllight.rewards.combine import scored
from rllight.rewards.scores import Sample

log = logging.getLogger(__name__)

REFERENCE_RESPONSE = "The answer is \\boxed{{{answer}}}."
"""The response ``preflight`` scores for a reference answer (``{answer}``: the answer, stripped): the
final-answer form ``IntegerMatch`` and ``MathVerify`` read first."""

PREFLIGHT_SKIP = " (--model.reward_preflight 0 skips this check)"
"""How the pre-flight's errors end: the option that turns the check off."""


def preflight(reward: Reward, rows: list[dict], k: int = 4, field: str = "answer") -> None:
    """Check ``reward`` on ``k`` of ``rows`` (spread evenly) per reward that scores them (``Reward.split``: per data
    source under ``PerSource``); ``RecipeError`` in one line naming the reward class and the row (its ``source``,
    e.g. "train.jsonl row 3"). A reward whose score the stated answer alone does not decide (``answers_decide``:
    a reward model, a judge, a mix with one) is not checked; one info line says so."""
    if k < 1 or not rows:
        return
    for part, index in reward.split(rows):
        if part.answers_decide:
            check_part(part, [rows[i] for i in index], k, field)
        else:
            log.info("model.reward: %s scores more than the stated answer, which reference answers cannot check: "
                     "no reward pre-flight for it", part.name)


def check_part(reward: Reward, rows: list[dict], k: int, field: str) -> None:
    """The pre-flight of one reward on its ``rows``."""
    picks = sorted({i * len(rows) // min(k, len(rows)) for i in range(min(k, len(rows)))})
    answers = [str(rows[i].get(field, "")).strip() for i in picks]
    stated = [reward.reference_answer(a) for a in answers]  # a row may hold a key to its answer
    right = [REFERENCE_RESPONSE.format(answer=a) for a in stated]
    wrong = [REFERENCE_RESPONSE.format(answer=wrong_answer(a)) for a in stated]
    samples = [Sample(prompt="", messages=None, response=text, response_ids=[], answer=answers[j % len(picks)],
                      row=rows[picks[j % len(picks)]], group=j % len(picks)) for j, text in enumerate(right + wrong)]
    scores = scored(reward, samples)
    name, full = reward.name, reward.full_reward()
    for j, i in enumerate(picks):
        where = rows[i].get("source", f"row {i + 1}")
        if not scores.solved[j]:
            why = f" ({scores.failed[j]})" if j in scores.failed else ""
            raise RecipeError(
                f"model.reward: {name} does not give the reference answer of {where} {full}: the response "
                f"{quote(right[j])} against {field} {quote(answers[j])} scored {scores.values[j]:g}{why}; "
                f"make the reward read this answer format, or fix the data{PREFLIGHT_SKIP}")
        if scores.solved[len(picks) + j]:
            raise RecipeError(
                f"model.reward: {name} gives a wrong response {full}: {quote(wrong[j])} against {field} "
                f"{quote(answers[j])} ({where}) scored {scores.values[len(picks) + j]:g}; the reward must "
                f"compare the response with the answer{PREFLIGHT_SKIP}")


def wrong_answer(answer: str) -> str:
    """``answer`` with its last digit changed (d -> d + 1 mod 10), or ``answer + 1`` when it has no digit."""
    for pos in range(len(answer) - 1, -1, -1):
        if answer[pos] in "0123456789":
            return answer[:pos] + str((int(answer[pos]) + 1) % 10) + answer[pos + 1:]
    return f"{answer} + 1"
