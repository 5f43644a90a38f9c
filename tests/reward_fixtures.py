"""Rewards that misbehave on purpose, in a module the reward worker processes can import (they get the
trainer's sys.path, where pytest puts this folder)."""

import os
import signal
import time
import zlib

from rllight.rewards import IntegerMatch, Reward, Sample, Verifier


class HangOn(IntegerMatch):
    """IntegerMatch that never returns for the answer ``on``."""

    def __init__(self, on: str):
        super().__init__()
        self.on = on

    def __call__(self, response: str, answer: str) -> float:
        while answer == self.on:
            time.sleep(1)
        return super().__call__(response, answer)


class DieOn(IntegerMatch):
    """IntegerMatch whose process ends on the answer ``on``: ``os._exit(1)``, or SIGKILL to itself."""

    def __init__(self, on: str, how: str = "exit"):
        super().__init__()
        self.on = on
        self.how = how

    def __call__(self, response: str, answer: str) -> float:
        if answer == self.on:
            if self.how == "exit":
                os._exit(1)
            os.kill(os.getpid(), signal.SIGKILL)
        return super().__call__(response, answer)


class Echo(Verifier):
    """The response read as a number (raises on text that is not one)."""

    def __call__(self, response: str, answer: str) -> float:
        return float(response)


class Always(Verifier):
    """``value`` whatever the response: 1 accepts every wrong answer, 0 rejects every right one."""

    def __init__(self, value: float):
        super().__init__()
        self.value = value

    def __call__(self, response: str, answer: str) -> float:
        return self.value


class Pid(Verifier):
    """The id of the process that scores: tells the worker processes apart from the test's."""

    def __call__(self, response: str, answer: str) -> float:
        return float(os.getpid())


class Loads(Verifier):
    """How many times this process has unpickled a ``Loads``: stays 1 in a worker that got it once."""

    loads = 0

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        type(self).loads += 1

    def __call__(self, response: str, answer: str) -> float:
        return float(type(self).loads)


class ContainsJudge(Reward):
    """A judge that can be hacked: 1.0 for a response that contains ``phrase``, else the exact match's value
    (``IntegerMatch``). A policy that learns to write ``phrase`` earns the most whatever its answer. Like an
    ``LLMJudge``, its score is not decided by the stated answer alone (``answers_decide`` False)."""

    def __init__(self, phrase: str = "the answer is correct"):
        self.phrase = phrase
        self.exact = IntegerMatch()

    def score(self, samples):
        return [1.0 if self.phrase in s.response else self.exact(s.response, s.answer) for s in samples]


class Drifting(Reward):
    """The share of a response's characters that are digits (it varies across the samples of a random model, so
    advantages are not 0), plus ``per_step`` times the batches it scored before: a reward whose mean rises
    (``per_step`` > 0) or falls (< 0) by about ``per_step`` a step, whatever the policy does. ``decides``: whether
    it counts as a verifier (``answers_decide``)."""

    def __init__(self, per_step: float, decides: bool = False):
        self.per_step, self.decides = per_step, decides
        self.batches = 0

    def score(self, samples):
        offset = self.per_step * self.batches
        self.batches += 1
        return [sum(c.isdigit() for c in s.response) / max(len(s.response), 1) + offset for s in samples]

    @property
    def answers_decide(self) -> bool:
        return self.decides


class Unrelated(Reward):
    """A model reward that knows nothing of the task: a stable hash of the response (CRC-32) scaled to [0, 1), as
    likely high for a right answer as for a wrong one."""

    def score(self, samples):
        return [zlib.crc32(s.response.encode()) / 2**32 for s in samples]


def samples_of(responses, answers, sources=None):
    """One ``Sample`` per response, against ``answers`` (and rows of ``sources``' data sources), each its own group."""
    sources = sources or [None] * len(responses)
    return [Sample(prompt="", messages=None, response=r, response_ids=[], answer=str(a),
                   row={"answer": a, "data_source": s}, group=i)
            for i, (r, a, s) in enumerate(zip(responses, answers, sources))]
