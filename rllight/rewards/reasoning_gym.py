"""reasoning-gym's own verifiers as a reward (``bash tools/install.sh reasoning-gym``).

reasoning-gym generates tasks procedurally, offline, each with a ``score_answer(answer, entry)`` that returns a
score in [0, 1] (1 = solved). Its ``entry`` (question, answer and the generator's metadata) is what the score
needs, so a row's reference answer is a key that rebuilds it: the task, its generator settings, the seed, size
and index of the row in its dataset, and the expected answer (``row_answer``). ``ReasoningGymScore`` rebuilds
the entry from the key (the generators are deterministic; each process keeps the datasets it built) and scores
the model's final answer with the task's own ``score_answer``.
"""

from __future__ import annotations

import json
import re

from rllight.errors import RecipeError, install_hint
from rllight.rewards.base import NUMBER, Verifier, last_number

INSTALL = install_hint("reasoning-gym", "reasoning-gym")

_BOXED = re.compile(r"\\boxed\{((?:[^{}]|\{[^{}]*\})*)\}")
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_FINAL = re.compile(r"^\s*(?:final answer|answer)\s*[:=]\s*", re.IGNORECASE)


def import_reasoning_gym(key: str):
    """The ``reasoning_gym`` package, or a one-line ``RecipeError`` naming ``key`` and the install command."""
    try:
        import reasoning_gym
    except ImportError:
        raise RecipeError(f"{key} needs reasoning-gym, which is not installed: {INSTALL}") from None
    return reasoning_gym


def final_answer(response: str, numeric: bool = False) -> str:
    """The answer a response commits to: the content of its last ``\\boxed{}``, else of its last
    ``<answer>...</answer>`` (reasoning-gym's own format), else its last non-empty line without a leading
    ``Answer:`` / ``Final answer:``; stripped of spaces and a trailing full stop. ``numeric`` (the task's answer
    is a number): that text's last number when it is not a number itself, as GSM8K graders read a final line
    ("2 + 5 = 7" and "The answer is 7." answer 7); the text unchanged when it holds no number, or a ``\\boxed{``
    left open (the response was cut inside its answer)."""
    boxed = _BOXED.findall(response)
    if boxed:
        text = boxed[-1]
    else:
        tagged = _ANSWER_TAG.findall(response)
        lines = [line for line in response.splitlines() if line.strip()]
        text = tagged[-1] if tagged else (_FINAL.sub("", lines[-1]) if lines else "")
    text = text.strip().rstrip(".").strip()
    if numeric and not NUMBER.fullmatch(text) and "\\boxed" not in text:  # an open box: cut inside its answer
        text = last_number(text) or text
    return text


def row_answer(task: str, config: dict, seed: int, size: int, index: int, answer: str) -> str:
    """The reference answer of a reasoning-gym row: the key ``ReasoningGymScore`` rebuilds the entry from."""
    return json.dumps({"task": task, "config": config, "seed": seed, "size": size, "index": index,
                       "answer": answer}, sort_keys=True, separators=(",", ":"))


def create_dataset(task: str, config: dict, seed: int, size: int, key: str = "data.task"):
    """``reasoning_gym.create_dataset`` with a one-line error naming ``key`` for an unknown task or setting."""
    rg = import_reasoning_gym(key)
    try:
        return rg.create_dataset(task, seed=seed, size=size, **config)
    except Exception as err:  # an unknown name or a setting the generator refuses
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise RecipeError(f"{key}: reasoning-gym task {task!r} with settings {config} cannot be created "
                          f"({reason[:200]}); check the name and settings against reasoning-gym's list") from None


class ReasoningGymScore(Verifier):
    """The task's own ``score_answer`` on the response's final answer (``final_answer``), scaled to
    ``wrong + (correct - wrong) * score``: a response is correct (for accuracy) only with score 1; partial credit
    in between, where a task gives it. For rows made by ``rllight.data.ReasoningGymTask``.

    Args:
        correct: Reward of a solved task (score 1).
        wrong: Reward of score 0.
    """

    def __init__(self, correct: float = 1.0, wrong: float = 0.0):
        super().__init__(correct=correct, wrong=wrong)
        import_reasoning_gym("model.reward: ReasoningGymScore")
        self._datasets: dict[str, object] = {}

    def __getstate__(self) -> dict:  # sent to reward workers without the datasets built so far
        return {**self.__dict__, "_datasets": {}}

    def _entry(self, key: dict) -> tuple[object, dict]:
        name = json.dumps([key["task"], key["config"], key["seed"], key["size"]], sort_keys=True)
        if name not in self._datasets:
            self._datasets[name] = create_dataset(key["task"], key["config"], key["seed"], key["size"], "model.reward")
        dataset = self._datasets[name]
        entry = dataset[key["index"]]
        if str(entry["answer"]) != key["answer"]:
            raise ValueError(f"reasoning-gym rebuilt another row for {key['task']} #{key['index']} (a different "
                             "reasoning-gym version?): reinstall the version that made the data")
        return dataset, entry

    def task_score(self, response: str, answer: str) -> float:
        """The task's score in [0, 1] of ``response`` against the row whose key is ``answer``."""
        dataset, entry = self._entry(json.loads(answer))
        numeric = NUMBER.fullmatch(str(entry["answer"]).strip()) is not None
        return float(dataset.score_answer(final_answer(response, numeric), entry))

    def __call__(self, response: str, answer: str) -> float:
        return self.wrong + (self.correct - self.wrong) * self.task_score(response, answer)

    def is_correct(self, response: str, answer: str) -> bool:
        return self.task_score(response, answer) >= 1.0

    def reference_answer(self, answer: str) -> str:
        """The task's answer of the row whose key is ``answer`` (what a right response's final answer says)."""
        return str(json.loads(answer)["answer"])

    def check_answer(self, answer: str) -> str | None:
        try:
            key = json.loads(answer)
            missing = {"task", "config", "seed", "size", "index", "answer"} - set(key)
        except (ValueError, TypeError):
            return "it is not a reasoning-gym row key; make the rows with rllight.data.ReasoningGymTask"
        if missing:
            return f"its reasoning-gym key lacks {', '.join(sorted(missing))}; make the rows with ReasoningGymTask"
        return None


__all__ = ["INSTALL", "ReasoningGymScore", "create_dataset", "final_answer", "import_reasoning_gym", "row_answer"]
