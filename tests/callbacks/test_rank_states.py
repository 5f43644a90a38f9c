"""Callbacks under several processes, two ranks simulated in threads that meet at each collective: SelfImitation holds
no response twice over the ranks' buffers, and a checkpoint gives each rank its own buffer (and ValuePretraining its
own window) back."""

import threading
from types import SimpleNamespace

import pytest
import torch

from rllight.callbacks import RolloutContext, SelfImitation, ValuePretraining
from strategies.test_dapo import make_rollout

# Rows 0..3 of ``make_rollout`` are four different (prompt, response) pairs: A, B, C, D.
A, B, C, D = range(4)


class TwoRanks:
    """Two ranks' ``Ranks``: ``gather_objects`` waits for both and returns their objects in rank order."""

    def __init__(self):
        self.barrier, self.slots = threading.Barrier(2), [None, None]

    def rank(self, r: int) -> SimpleNamespace:
        return SimpleNamespace(world_size=2, rank=r, gather_objects=lambda obj: self._gather(r, obj),
                               any=lambda flag: flag)

    def _gather(self, r: int, obj) -> list:
        self.slots[r] = obj
        self.barrier.wait(timeout=30)
        out = list(self.slots)
        self.barrier.wait(timeout=30)
        return out


def on_both(*calls):
    """Run ``calls[r]()`` as rank r, both at once; their results in rank order."""
    results, errors = [None, None], []

    def run(r):
        try:
            results[r] = calls[r]()
        except Exception as err:  # re-raised below, in the test's thread
            errors.append(err)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    return results


def offer(cb, ranks, rows):
    """``cb`` (on rank ``ranks``) sees a rollout whose rows ``rows`` of A..D are correct."""
    rollout = make_rollout([1.0 if i in rows else 0.0 for i in range(4)], lengths=[2, 2, 2, 2])
    context = RolloutContext(ranks=ranks, tokenizer=SimpleNamespace(pad_token_id=0), device=torch.device("cpu"))
    return cb.on_rollout(None, context, rollout)


def held(cb) -> list[int]:
    """Which of A..D ``cb`` holds, oldest first (row i's response ids start at 100 (i + 1) + 50)."""
    return [(int(e["response_ids"][0]) - 150) // 100 for e in sorted(cb.entries, key=lambda e: e["order"])]


def test_a_response_is_held_by_one_rank_only_and_free_again_once_it_leaves():
    pair = TwoRanks()
    ranks = [pair.rank(0), pair.rank(1)]
    cbs = [SelfImitation(capacity=2, policy="fifo"), SelfImitation(capacity=2, policy="fifo")]
    # Step 1: both offer A in the same step; the first rank keeps it, as one process stores it once.
    on_both(lambda: offer(cbs[0], ranks[0], [A, B]), lambda: offer(cbs[1], ranks[1], [A, C]))
    assert (held(cbs[0]), held(cbs[1])) == ([A, B], [C])
    # Step 2: rank 1 offers B, which rank 0 holds: skipped. Rank 0 stores D and, full, drops its oldest, A.
    out = on_both(lambda: offer(cbs[0], ranks[0], [D]), lambda: offer(cbs[1], ranks[1], [B]))
    assert (held(cbs[0]), held(cbs[1])) == ([B, D], [C])
    assert [o.extras["sil/added"] for o in out] == [1.0, 0.0]
    # Step 3: A left rank 0's buffer, so rank 1 may store it now.
    on_both(lambda: offer(cbs[0], ranks[0], []), lambda: offer(cbs[1], ranks[1], [A]))
    assert (held(cbs[0]), held(cbs[1])) == ([B, D], [C, A])


def test_a_response_the_buffer_refuses_is_free_again_on_every_rank():
    # highest_reward refuses a reward below everything kept: the ranks counted it as held until told otherwise.
    # Rewards of -1 are below min_reward: not offered.
    pair = TwoRanks()
    ranks = [pair.rank(0), pair.rank(1)]
    cbs = [SelfImitation(capacity=1, policy="highest_reward", min_reward=0.0) for _ in range(2)]
    context = [RolloutContext(ranks=r, tokenizer=SimpleNamespace(pad_token_id=0), device=torch.device("cpu"))
               for r in ranks]

    def step(rewards0, rewards1):
        on_both(*(lambda r=r, rewards=rewards: cbs[r].on_rollout(None, context[r], make_rollout(rewards, [2] * 4))
                  for r, rewards in enumerate((rewards0, rewards1))))

    none = [-1.0] * 4
    step([0.9, -1.0, -1.0, -1.0], none)  # rank 0 keeps A at 0.9
    step([-1.0, 0.5, -1.0, -1.0], [-1.0, 0.5, -1.0, -1.0])  # both offer B: rank 0 gets it and refuses it (0.5 < 0.9)
    assert (held(cbs[0]), held(cbs[1])) == ([A], [])
    step(none, [-1.0, 0.5, -1.0, -1.0])  # rank 1 offers B again: no rank holds it now
    assert held(cbs[1]) == [B]


def test_each_rank_resumes_its_own_buffer_and_the_others_keys():
    pair = TwoRanks()
    ranks = [pair.rank(0), pair.rank(1)]
    cbs = [SelfImitation(), SelfImitation()]
    for r in range(2):
        cbs[r]._ranks = ranks[r]
    on_both(lambda: offer(cbs[0], ranks[0], [A]), lambda: offer(cbs[1], ranks[1], [B, C]))
    states = on_both(cbs[0].state_dict, cbs[1].state_dict)
    assert states[0] == states[1] and len(states[0]["ranks"]) == 2  # what rank 0 writes holds both buffers
    resumed = [SelfImitation(), SelfImitation()]
    for r in range(2):
        resumed[r]._ranks = ranks[r]
        resumed[r].load_state_dict(states[0])
    assert (held(resumed[0]), held(resumed[1])) == ([A], [B, C])
    # Rank 1 knows rank 0 holds A: offered again, it is skipped; D is new.
    on_both(lambda: offer(resumed[0], ranks[0], []), lambda: offer(resumed[1], ranks[1], [A, D]))
    assert held(resumed[1]) == [B, C, D]


def test_a_checkpoint_resumed_on_another_number_of_processes_deals_its_entries_out():
    one = SelfImitation()
    one.on_rollout(None, RolloutContext(ranks=SimpleNamespace(world_size=1, rank=0), device=torch.device("cpu"),
                                        tokenizer=SimpleNamespace(pad_token_id=0)),
                   make_rollout([1.0, 1.0, 1.0, 1.0], lengths=[2, 2, 2, 2]))
    state = one.state_dict()
    assert "ranks" not in state  # one process: its own state, as before
    pair = TwoRanks()
    resumed = [SelfImitation(), SelfImitation()]
    for r in range(2):
        resumed[r]._ranks = pair.rank(r)
        resumed[r].load_state_dict(state)
    assert (held(resumed[0]), held(resumed[1])) == ([A, C], [B, D])
    # And back: two ranks' buffers on one process pool into one.
    states = on_both(resumed[0].state_dict, resumed[1].state_dict)
    alone = SelfImitation()
    alone.load_state_dict(states[0])
    assert sorted(held(alone)) == [A, B, C, D]


def test_value_pretraining_resumes_each_ranks_own_window():
    pair = TwoRanks()
    ranks = [pair.rank(0), pair.rank(1)]
    cbs = [ValuePretraining(window=2), ValuePretraining(window=2)]
    for r in range(2):
        cbs[r]._ranks = ranks[r]
        cbs[r].steps_done = 2
        # rank r's share of two rollouts: values and returns of its response tokens
        cbs[r].held_out = [(torch.tensor([r + 0.1]), torch.tensor([1.0])), (torch.tensor([r + 0.2]), torch.tensor([0.0]))]
    states = on_both(cbs[0].state_dict, cbs[1].state_dict)
    resumed = [ValuePretraining(window=2), ValuePretraining(window=2)]
    for r in range(2):
        resumed[r]._ranks = ranks[r]
        resumed[r].load_state_dict(states[0])
    assert [v.tolist() for v, _ in resumed[1].held_out] == [[pytest.approx(1.1)], [pytest.approx(1.2)]]
    assert resumed[1].steps_done == 2
    # On one process: each rollout's shares pooled, rank 0's tokens first.
    alone = ValuePretraining(window=2)
    alone.load_state_dict(states[0])
    assert [v.tolist() for v, _ in alone.held_out] == [[pytest.approx(0.1), pytest.approx(1.1)],
                                                       [pytest.approx(0.2), pytest.approx(1.2)]]
    assert [r.tolist() for _, r in alone.held_out] == [[1.0, 1.0], [0.0, 0.0]]
