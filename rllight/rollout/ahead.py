"""Generations sent ahead of the step that trains on them, and the staleness bound: the one queue both engines that
generate asynchronously use (``ProcessEngine`` with its worker process, ``VLLMServerEngine`` with its server).

With ``max_staleness`` k > 0 the trainer asks the engine for the next steps' rollouts before it updates
(``RolloutEngine.prefetch``), so that generation overlaps training. Each generation sent ahead is queued here with
its request key (prompts and sampling: ``rllight.rollout.base.request_key``) and the policy version that generates
it (optimizer updates in the weights); the step that needs these prompts claims it, and the bound is applied here
alone:

- ``steps_ahead``: how many training batches ahead the trainer sends (``k // updates_per_step``), so that at the
  planned pace no response is trained on more than k updates after the weights that generated it;
- ``fresh``: a response is trained on only when ``updates - version <= k``; one older than that (a step made more
  updates than planned) is dropped, counted and generated again.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rllight.errors import RecipeError

log = logging.getLogger(__name__)


def steps_ahead(max_staleness: int, updates_per_step: int) -> int:
    """Training batches whose rollouts may be generated before this step's update: ``max_staleness //
    updates_per_step`` (0: synchronous). Sent that far ahead, a response is at most ``max_staleness`` updates old
    when its step trains on it."""
    return max_staleness // max(updates_per_step, 1)


@dataclass
class Sent:
    """One generation sent ahead."""

    key: tuple
    """Its request key (``request_key(prompts, sampling)``): what a later ``generate`` call matches."""
    version: int
    """The policy version it was sent with (optimizer updates in the weights that generate it)."""
    handle: Any
    """What the engine waits on for its answer (a request awaiting the worker's reply, a future)."""


class SentAhead:
    """The generations an engine has sent ahead, oldest first, and the staleness bound (see
    ``rllight.rollout.ahead``).

    Args:
        max_staleness: The most optimizer updates a trained-on response may lag the weights (0 = synchronous:
            nothing is sent ahead).
        key: The recipe key that sets it, for the error messages.
    """

    def __init__(self, max_staleness: int, key: str = "model.rollout.init_args"):
        if isinstance(max_staleness, bool) or not isinstance(max_staleness, int) or max_staleness < 0:
            raise RecipeError(f"{key}.max_staleness must be an integer >= 0 (0 = synchronous), got {max_staleness!r}")
        self.max_staleness = max_staleness
        self.entries: list[Sent] = []
        self.discarded = 0
        """Generations dropped as too stale since ``pop_discarded`` last read the count."""

    @property
    def asynchronous(self) -> bool:
        return self.max_staleness > 0

    def check_sync_every(self, sync_every: int, key: str = "model.rollout.init_args") -> None:
        """Asynchronous rollouts send the weights with the next request after an update: a ``sync_every`` other than
        1 would leave the lag unbounded by ``max_staleness``, so it is refused in one line."""
        if self.asynchronous and sync_every != 1:
            raise RecipeError(f"{key}: max_staleness={self.max_staleness} with sync_every={sync_every}; asynchronous "
                              "rollouts send the weights with the next request after an update, so leave sync_every "
                              "at 1 and bound the lag with max_staleness")

    def fresh(self, version: int, updates: int) -> bool:
        """Whether a response generated with policy ``version`` may be trained on after ``updates`` updates."""
        return updates - version <= self.max_staleness

    def add(self, key: tuple, version: int, handle: Any) -> Sent:
        """Queue a generation just sent."""
        sent = Sent(tuple(key), version, handle)
        self.entries.append(sent)
        return sent

    def claim(self, key: tuple, updates: int, wait: Callable[[Sent], Any]) -> tuple[Sent, Any] | None:
        """The oldest generation sent for ``key`` and its answer (``wait(sent)``), when it is ``fresh``; None when
        none was sent for ``key`` or it is too old (then counted in ``discarded``). It leaves the queue together
        with every older one (sent for steps already past)."""
        index = next((i for i, sent in enumerate(self.entries) if sent.key == tuple(key)), None)
        if index is None:
            return None
        sent = self.entries[index]
        del self.entries[: index + 1]
        answer = wait(sent)
        if self.fresh(sent.version, updates):
            return sent, answer
        self.discarded += 1
        log.warning("a rollout generated ahead with policy version %d is %d versions old, more than max_staleness=%d; "
                    "it is generated again", sent.version, updates - sent.version, self.max_staleness)
        return None

    def pop_discarded(self) -> int:
        """Generations dropped as too stale since the last call."""
        count, self.discarded = self.discarded, 0
        return count

    def answers(self, wait: Callable[[Sent], Any]) -> list[tuple[tuple, int, Any]]:
        """``(key, version, answer)`` of every generation queued, each waited for: what a checkpoint saves, so that
        a resumed run trains on exactly these."""
        return [(sent.key, sent.version, wait(sent)) for sent in self.entries]

    def forget(self, lost: Callable[[Sent], bool]) -> int:
        """Drop the generations for which ``lost(sent)`` holds (e.g. their worker died before answering: a later
        ``claim`` finds none and they are generated again); returns how many."""
        kept = [sent for sent in self.entries if not lost(sent)]
        count, self.entries[:] = len(self.entries) - len(kept), kept
        return count
