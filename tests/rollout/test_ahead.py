"""The queue of generations sent ahead, and the staleness bound both asynchronous engines apply through it."""

from __future__ import annotations

import ast
import pathlib

import pytest

from rllight.errors import RecipeError
from rllight.rollout.ahead import SentAhead, steps_ahead
from rllight.rollout.hf import HFEngine
from rllight.rollout.remote import VLLMServerEngine
from rllight.serving import Endpoint
from rllight.rollout.worker import ProcessEngine

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_the_trainer_sends_as_many_batches_ahead_as_the_bound_allows_at_its_pace():
    # k = 4 updates of lag allowed: at 1 update per step 4 batches ahead, at 2 per step 2, at 3 per step 1
    # (a 2nd batch would be trained on 6 updates after it was sent), at 5 per step none.
    assert [steps_ahead(4, u) for u in (1, 2, 3, 5)] == [4, 2, 1, 0]
    assert steps_ahead(0, 1) == 0


def test_a_response_is_fresh_up_to_max_staleness_updates_and_not_one_more():
    ahead = SentAhead(2)
    assert ahead.fresh(version=3, updates=5)  # 2 updates old: allowed
    assert not ahead.fresh(version=3, updates=6)  # 3 updates old


def test_claim_returns_the_oldest_sent_for_the_key_and_drops_those_sent_before_it():
    ahead = SentAhead(1)
    for key in ("a", "b", "a", "c"):
        ahead.add((key,), 0, handle=f"answer-{key}-{len(ahead.entries)}")
    sent, answer = ahead.claim(("a",), updates=0, wait=lambda s: s.handle)
    assert (sent.key, answer) == (("a",), "answer-a-0")
    # The b sent after it stays; a second claim of a takes the next one and drops b (a step already past).
    assert [s.key for s in ahead.entries] == [("b",), ("a",), ("c",)]
    assert ahead.claim(("a",), updates=0, wait=lambda s: s.handle)[1] == "answer-a-2"
    assert [s.key for s in ahead.entries] == [("c",)]
    assert ahead.claim(("z",), updates=0, wait=lambda s: s.handle) is None


def test_a_claimed_generation_older_than_the_bound_is_waited_for_counted_and_not_used(caplog):
    ahead = SentAhead(1)
    ahead.add(("a",), 3, handle="old")
    waited = []
    assert ahead.claim(("a",), updates=5, wait=waited.append) is None
    assert waited and not ahead.entries  # its answer was read (the pipe stays in order), then dropped
    assert "2 versions old, more than max_staleness=1" in caplog.text
    assert (ahead.pop_discarded(), ahead.pop_discarded()) == (1, 0)


def test_what_a_checkpoint_saves_is_every_answer_waited_for_and_lost_ones_are_forgotten():
    ahead = SentAhead(2)
    ahead.add(("a",), 0, handle={"answer": 1})
    ahead.add(("b",), 1, handle={"answer": None})  # its worker died before answering
    assert ahead.forget(lambda s: s.handle["answer"] is None) == 1
    assert ahead.answers(lambda s: s.handle["answer"]) == [(("a",), 0, 1)]


@pytest.mark.parametrize("value", [-1, 1.5, True])
def test_a_bound_that_is_not_a_count_of_updates_is_one_line(value):
    with pytest.raises(RecipeError, match=r"^model\.rollout\.init_args\.max_staleness must be an integer >= 0 "):
        SentAhead(value)


@pytest.mark.parametrize("make", [
    lambda **kw: ProcessEngine(HFEngine(), **kw),
    lambda **kw: VLLMServerEngine(Endpoint("http://127.0.0.1:9"), weights_dir=None, **kw),
])
def test_both_asynchronous_engines_refuse_the_same_settings_in_the_same_words(make):
    with pytest.raises(RecipeError, match=r"^model\.rollout\.init_args\.max_staleness must be an integer >= 0"):
        make(max_staleness=-1)
    with pytest.raises(RecipeError, match=r"^model\.rollout\.init_args: max_staleness=2 with sync_every=3; "):
        make(max_staleness=2, sync_every=3)
    assert isinstance(make(max_staleness=2)._ahead, SentAhead)


def test_the_staleness_bound_is_written_in_one_place():
    """No module but ``rllight/rollout/ahead.py`` compares with ``max_staleness`` or divides by it: the two engines
    and the trainer's prefetch all go through ``SentAhead`` and ``steps_ahead``."""
    found = []
    for path in sorted((ROOT / "rllight").rglob("*.py")):
        if path.name == "ahead.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            bound = isinstance(node, ast.Compare) or (isinstance(node, ast.BinOp) and isinstance(node.op, ast.FloorDiv))
            if bound and "max_staleness" in ast.unparse(node):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert found == []
