"""Batch sizes are totals over all training processes, as the papers and verl state them: each process takes an
equal share, a size that does not divide is refused at the start with one line, dynamic sampling fills one global
target, and the kept groups are dealt evenly to the ranks, so a rollout makes the updates its global sizes imply."""

import os
import queue
import threading
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest
import torch
import yaml

from conftest import RECIPES
from rllight.algorithms import deal_groups, first_in_rank_order, group_retention_probability, minibatch_shares
from rllight.data import ArithmeticTask, RLDataModule
from rllight.distributed import Ranks, deal_rollout, share
from rllight.errors import RecipeError
from rllight.strategies import DynamicSampling
from rllight.update import Updater

from test_dapo import FakeSamplerModule, make_rollout


def _data(batch_size, rank=0, world=1, num_train=24):
    data = RLDataModule(task=ArithmeticTask(num_train=num_train, num_val=0), batch_size=batch_size)
    data.trainer = SimpleNamespace(global_rank=rank, world_size=world)
    data.setup("fit")
    return data


def test_a_size_that_does_not_divide_is_one_line_naming_both_numbers():
    with pytest.raises(RecipeError) as err:
        _data(batch_size=6, world=4)
    message = str(err.value)
    assert "data.batch_size=6" in message and "4 training processes" in message and len(message.splitlines()) == 1
    assert share(512, 128, "data.batch_size") == 4
    with pytest.raises(RecipeError, match=r"model\.batching\.minibatch_size=10 .* all 4 training processes"):
        share(10, 4, "model.batching.minibatch_size")


def _rows(batches):
    return [[row["prompt"] for row in batch] for batch in batches]


def test_the_processes_share_each_global_batch_without_overlap_and_resume_in_place():
    # 24 rows, 8 prompts per step over 2 processes: 3 steps per epoch, 4 prompts per process and step.
    whole = _rows(_data(batch_size=8).upcoming_batches(0, 6))
    ranks = [_data(batch_size=8, rank=r, world=2) for r in (0, 1)]
    shares = [_rows(d.upcoming_batches(0, 6)) for d in ranks]
    for step in range(6):  # two epochs
        assert all(len(s[step]) == 4 for s in shares)
        assert sorted(shares[0][step] + shares[1][step]) == sorted(whole[step])
    # What the loaders yield is what upcoming_batches says, also after a resume from 2 trained batches.
    for data, expected in zip(ranks, shares):
        assert _rows(list(data.train_dataloader()))[:3] == expected[:3]
        data.batches_trained = 2
        assert _rows(list(data.train_dataloader()))[:1] == expected[2:3]


class _Hub:
    """In-memory collectives for ranks run as threads of one process: every rank puts its value, all read all."""

    def __init__(self, world):
        self.world, self.slots = world, [None] * world
        self.barrier = threading.Barrier(world, timeout=30)
        self.mail = {(s, d): queue.Queue() for s in range(world) for d in range(world)}

    def all(self, rank, value):
        self.slots[rank] = value
        self.barrier.wait()
        out = list(self.slots)
        self.barrier.wait()
        return out


class _Strategy:
    """What ``Ranks`` uses of a Lightning strategy (``reduce``), over a hub's threads."""

    def __init__(self, hub, rank):
        self.hub, self.rank = hub, rank

    def reduce(self, value, reduce_op="sum"):
        stacked = torch.stack([torch.as_tensor(v) for v in self.hub.all(self.rank, value)])
        return stacked.amax(0) if reduce_op == "max" else stacked.sum(0)


class _ThreadRanks(Ranks):
    """Rank ``rank`` of the hub's ranks: sums, maxima, gathers and point-to-point sends between threads."""

    def __init__(self, hub, rank):
        super().__init__(SimpleNamespace(world_size=hub.world, global_rank=rank, strategy=_Strategy(hub, rank)))
        self.hub = hub

    def gather_objects(self, obj):
        return self.hub.all(self.rank, obj)

    def send(self, obj, dst):
        self.hub.mail[(self.rank, dst)].put(obj)

    def recv(self, src):
        return self.hub.mail[(src, self.rank)].get(timeout=30)


def _on_ranks(world, fn):
    """``fn(rank, ranks)`` on ``world`` ranks run as threads; their results in rank order (a rank's error raised)."""
    hub = _Hub(world)
    with ThreadPoolExecutor(world) as pool:
        futures = [pool.submit(fn, rank, _ThreadRanks(hub, rank)) for rank in range(world)]
        return [f.result(timeout=60) for f in futures]


class _RankProducer(FakeSamplerModule):
    """The scripted producer of one rank: its extra prompts are named after the rank."""

    def __init__(self, rank, ranks, rewards):
        super().__init__(rewards=rewards)
        self.rank, self.ranks = rank, ranks

    def more_prompts(self, n):
        rows = [{"answer": f"r{self.rank}x{self.drawn + i}"} for i in range(n)]
        self.drawn += n
        return rows


def test_dynamic_sampling_keeps_in_rank_order_then_the_groups_are_dealt_evenly():
    # A target of 4 mixed groups over 2 processes, 2 prompts x G = 2 per process and round. Rank 0: round 1 has 1
    # mixed group (a0), round 2 two (r0x0, r0x1): 3. Rank 1: none in round 1 (b0, b1 flat), two in round 2 (r1x0,
    # r1x1). After round 2 the ranks hold 5 >= 4 and stop. The first 4 in rank order are kept: rank 0 its 3, rank 1
    # its first (r1x0). Then the deal: 4 groups of 2 rows, 8 rows; the middles of rank 0's groups are rows 1, 3, 5
    # and rank 1's is row 7, so rank 0 keeps a0 and r0x0 and rank 1 gets r0x1 beside its own r1x0: 2 and 2.
    rewards = {0: [[1.0, 0.0, 1.0, 1.0], [0.0, 1.0, 1.0, 0.0]], 1: [[1.0, 1.0, 0.0, 0.0], [1.0, 0.0, 0.0, 1.0]]}
    first = {0: ["a0", "a1"], 1: ["b0", "b1"]}

    def step(rank, ranks):
        producer = _RankProducer(rank, ranks, rewards[rank])
        rollout = DynamicSampling(group_size=2, target_groups=4, max_rounds=5, prompts_per_round=4)(
            producer, [{"answer": a} for a in first[rank]])
        return rollout, deal_rollout(rollout, ranks, pad_id=0)

    (kept0, dealt0), (kept1, dealt1) = _on_ranks(2, step)
    assert kept0.answers == ["a0", "a0", "r0x0", "r0x0", "r0x1", "r0x1"]  # kept in rank order: 3 and 1
    assert kept1.answers == ["r1x0", "r1x0"]
    assert dealt0.answers == ["a0", "a0", "r0x0", "r0x0"]  # dealt: 2 and 2, whole groups
    assert dealt1.answers == ["r0x1", "r0x1", "r1x0", "r1x0"]
    assert dealt1.rewards.tolist() == [1.0, 0.0, 1.0, 0.0]  # the rows travel with their rewards...
    assert dealt1.group_ids.tolist() == [0, 0, 1, 1]  # ...in groups that do not share an id
    assert dealt0.group_ids.tolist() == [0, 0, 1, 1]
    # Each rank keeps its own ledger: its sampling counts are its own, not the other rank's.
    assert (kept0.extras["sampling/groups_kept"], dealt0.extras["sampling/groups_kept"]) == (3.0, 3.0)
    assert (kept1.extras["sampling/groups_kept"], dealt1.extras["sampling/groups_kept"]) == (1.0, 1.0)


def test_dealing_moves_whole_groups_with_their_per_row_extras_to_an_empty_rank():
    # Three ranks: rank 0 holds nothing, rank 1 five groups of 2, rank 2 one group of 2: 6 groups, 12 rows, so 2
    # groups each. The middles of rank 1's groups are rows 1, 3, 5, 7, 9 and of rank 2's row 11; the shares are
    # rows 0-3, 4-7, 8-11: rank 0 gets rank 1's groups 0, 1; rank 1 keeps its 2, 3; rank 2 gets rank 1's 4.
    def step(rank, ranks):
        n = {0: 0, 1: 10, 2: 2}[rank]
        rollout = make_rollout([float(i) for i in range(max(n, 1))], [1 + i % 3 for i in range(max(n, 1))],
                               group_ids=[10 * rank + i // 2 for i in range(max(n, 1))],
                               answers=[f"{rank}.{i // 2}" for i in range(max(n, 1))]).select(list(range(n)))
        rollout.extras.update({"row/x": torch.arange(n) + 100 * rank, "time/rollout": float(rank)})
        return deal_rollout(rollout, ranks, pad_id=0)

    dealt = _on_ranks(3, step)
    assert [d.answers for d in dealt] == [["1.0", "1.0", "1.1", "1.1"], ["1.2", "1.2", "1.3", "1.3"],
                                          ["1.4", "1.4", "2.0", "2.0"]]
    assert dealt[0].extras["row/x"].tolist() == [100, 101, 102, 103]
    assert dealt[2].extras["row/x"].tolist() == [108, 109, 200, 201]
    assert [d.extras["time/rollout"] for d in dealt] == [0.0, 1.0, 2.0]  # each rank's own scalars
    assert dealt[2].group_ids.tolist() == [0, 0, 1, 1]
    assert dealt[0].response_lengths.tolist() == [1, 2, 3, 1]  # the rows themselves, padding as they came

    def even(rank, ranks):  # ranks that already hold even shares keep their rollouts as they are
        rollout = make_rollout([0.0, 1.0], [1, 1], group_ids=[0, 0])
        return deal_rollout(rollout, ranks, pad_id=0) is rollout

    assert _on_ranks(2, even) == [True, True]


def test_first_in_rank_order_and_the_deal_by_hand():
    assert first_in_rank_order([3, 2, 4], 6) == [3, 2, 1]
    assert first_in_rank_order([3, 2], 9) == [3, 2] and first_in_rank_order([3, 2], 0) == [0, 0]
    # Groups of 2 rows on ranks holding 3 and 1: middles 1, 3, 5 | 7 of 8 rows, shares 0-3 and 4-7.
    assert deal_groups([[2, 2, 2], [2]]) == [[(0, 0), (0, 1)], [(0, 2), (1, 0)]]
    # Already even: nothing moves.
    assert deal_groups([[16] * 4] * 3) == [[(r, g) for g in range(4)] for r in range(3)]
    # Unequal groups: 1, 1, 1, 1 and 10 rows, middles 0.5, 1.5, 2.5, 3.5 and 9 of 14: the big one alone.
    assert deal_groups([[1, 1, 1, 1, 10], []]) == [[(0, 0), (0, 1), (0, 2), (0, 3)], [(0, 4)]]


def test_the_updates_are_planned_over_all_ranks_rows():
    # Ranks holding 6 and 2 rows, minibatch 4 (2 per rank): each rank cutting its own rows into 2-row shares
    # made updates of 4, 2 and 2 rows. Planned together: 8 rows, 2 updates of 4, each taking 3 rows of rank 0
    # (its rows at 1/12, 3/12, 5/12 | 7/12, 9/12, 11/12 of the epoch) and 1 of rank 1 (at 3/12 | 9/12).
    assert minibatch_shares([6, 2], 4) == [[3, 1], [3, 1]]
    assert minibatch_shares([10], 4) == [[4], [4], [2]]  # one process: chunks of 4, the rest last
    assert minibatch_shares([4, 4], 4) == [[2, 2], [2, 2]]
    assert minibatch_shares([6, 2], None) == [[6, 2]] and minibatch_shares([0, 0], 4) == []

    def plan(rank, ranks):
        updater = Updater(None, None, None, None, 3, 4, optimizer=None, ranks=lambda: ranks)
        return updater.plan([6, 2][rank], 2, 4, seed=5)

    plans = _on_ranks(2, plan)
    for epoch in range(2):
        assert [len(a) + len(b) for a, b in zip(plans[0][epoch], plans[1][epoch])] == [4, 4]
        assert sorted(torch.cat(plans[0][epoch]).tolist()) == list(range(6))


def _paper_sizes():
    """The paper recipe's global sizes: data.batch_size, G, max_rounds, minibatch_size, processes."""
    with open(os.path.join(RECIPES, "paper", "dapo.yaml")) as f:
        cfg = yaml.safe_load(f)
    sampler = cfg["model"]["sampler"]["init_args"]
    world = cfg["trainer"]["devices"] * cfg["trainer"]["num_nodes"]
    sizes = cfg["data"]["batch_size"], sampler["group_size"], sampler["max_rounds"], cfg["model"]["batching"]["minibatch_size"]
    return (*sizes, world)


def _simulated_rollout(generator, high, batch, group, max_rounds, world):
    """One rollout of dynamic sampling on ``world`` ranks by the sampler's own rules: each rank samples its share
    of ``batch`` prompts per round, a group of a prompt with success rate p ~ U(0, high) is mixed with probability
    a_G(p), rounds run until the ranks hold ``batch`` mixed groups or ``max_rounds``; then the first ``batch`` in
    rank order are kept. Returns the groups each rank keeps."""
    mixed = [0] * world
    for _ in range(max_rounds):
        p = torch.rand(world, batch // world, generator=generator) * high
        keep = torch.rand(p.shape, generator=generator) < group_retention_probability(p, group)
        mixed = [m + int(k) for m, k in zip(mixed, keep.sum(1))]
        if sum(mixed) >= batch:
            break
    return first_in_rank_order(mixed, batch)


@pytest.mark.parametrize("high", [1.0, 0.1])
def test_a_simulated_128_rank_dapo_rollout_makes_the_papers_16_updates_of_512(high):
    batch, group, max_rounds, minibatch, world = _paper_sizes()
    assert (batch, group, max_rounds, minibatch, world) == (512, 16, 10, 512, 128)
    generator = torch.Generator().manual_seed(0)
    for _ in range(20):  # rollouts
        kept = _simulated_rollout(generator, high, batch, group, max_rounds, world)
        assert sum(kept) == batch and max(kept) > batch // world  # kept unevenly, in rank order
        dealt = deal_groups([[group] * k for k in kept])
        rows = [group * len(picks) for picks in dealt]
        assert rows == [batch * group // world] * world  # 4 groups of 16 on every rank
        shares = minibatch_shares(rows, minibatch)
        assert len(shares) == batch * group // minibatch == 16  # the paper's 16 updates per rollout
        assert all(share == [minibatch // world] * world for share in shares)  # of 512: 4 responses per rank
        # Each rank cutting its kept rows into its 4-response shares instead: more, smaller updates.
        assert max(-(-group * k // (minibatch // world)) for k in kept) > 16


def test_a_simulated_128_rank_rollout_short_of_its_target_makes_the_updates_of_one_process():
    # Hard prompts (p ~ U(0, 0.002)): 10 rounds of 512 groups keep about 80 mixed ones, short of 512 (the cap).
    batch, group, max_rounds, minibatch, world = _paper_sizes()
    generator = torch.Generator().manual_seed(1)
    for _ in range(10):
        kept = _simulated_rollout(generator, 0.002, batch, group, max_rounds, world)
        total = group * sum(kept)
        assert 0 < sum(kept) < batch
        rows = [group * len(picks) for picks in deal_groups([[group] * k for k in kept])]
        assert max(rows) - min(rows) <= group and sum(rows) == total  # at most one group apart
        shares = minibatch_shares(rows, minibatch)
        # One process cutting the rollout's rows: ceil(total / 512) updates, of 512 rows but the last.
        last = [total % minibatch] if total % minibatch else []
        assert [sum(s) for s in shares] == [minibatch] * (total // minibatch) + last
        for share in shares:  # each rank's rows spread evenly: its share of each update within 2 of proportional
            assert all(abs(n - r * sum(share) / total) < 2 for n, r in zip(share, rows))


def test_the_module_refuses_a_minibatch_that_does_not_divide_before_the_model_loads(tiny_model_dir):
    from rllight.models import HFModel
    from rllight.module import RLModule
    from rllight.settings import Batching

    module = RLModule(HFModel(tiny_model_dir), batching=Batching(minibatch_size=10))
    module._trainer = SimpleNamespace(world_size=4, global_rank=0, strategy=None, datamodule=None)
    with pytest.raises(RecipeError, match=r"model\.batching\.minibatch_size=10 .* all 4 training processes"):
        module.setup("fit")
    assert module.policy is None
    module._trainer = SimpleNamespace(world_size=2, global_rank=0, strategy=None, datamodule=None)
    module.setup("fit")  # 5 responses per process
    assert module.updater.local_size(10) == 5
