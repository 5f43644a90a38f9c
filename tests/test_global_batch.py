"""Batch sizes are totals over all training processes, as the papers and verl state them: each process takes an
equal share, a size that does not divide is refused at the start with one line, and dynamic sampling fills one
global target."""

from types import SimpleNamespace

import pytest
import torch

from rllight.data import ArithmeticTask, RLDataModule
from rllight.distributed import Ranks, share
from rllight.errors import RecipeError
from rllight.strategies import DynamicSampling

from test_dapo import FakeSamplerModule


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
    with pytest.raises(RecipeError, match=r"model\.minibatch_size=10 .* all 4 training processes"):
        share(10, 4, "model.minibatch_size")


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


class _TwoRanks(Ranks):
    """Rank ``rank`` of two, the other rank having ``other[i]`` mixed groups after round ``i + 1``."""

    def __init__(self, rank, other):
        super().__init__()
        self.world_size, self.rank, self.other, self.rounds = 2, rank, other, 0

    def sum(self, value):  # called once per round
        self.rounds += 1
        return torch.tensor(float(value) + self.other[self.rounds - 1])

    def gather(self, value):
        theirs = float(self.other[self.rounds - 1])
        return [float(value), theirs] if self.rank == 0 else [theirs, float(value)]


@pytest.mark.parametrize("rank,kept_groups", [(0, [0, 2, 3]), (1, [0, 2])])
def test_dynamic_sampling_fills_one_global_target_in_rank_order(rank, kept_groups):
    # A target of 4 mixed groups over 2 processes. This process samples 2 prompts x 2 per round: round 1 has 1
    # mixed group (id 0), round 2 two (ids 2, 3): 3 in all. The other process has 0 after round 1 and 2 after
    # round 2, so both stop after round 2 with 5 >= 4. Kept: the first 4 in rank order, so rank 0 keeps its 3
    # (the other, as rank 1, keeps 1), and rank 1 keeps 2 after the other's 2.
    producer = FakeSamplerModule(rewards=[[1.0, 0.0, 1.0, 1.0], [0.0, 1.0, 0.0, 1.0]])
    producer.ranks = _TwoRanks(rank, [0, 2])
    rollout = DynamicSampling(group_size=2, target_groups=4, max_rounds=5, prompts_per_round=4)(
        producer, [{"answer": "a"}, {"answer": "b"}])
    assert float(rollout.extras["sampling/rounds"]) == 2
    assert float(rollout.extras["sampling/groups_kept"]) == len(kept_groups)
    assert torch.unique(rollout.group_ids).tolist() == kept_groups
    assert float(rollout.extras["sampling/cap_hit"]) == 0
    assert producer.generated_for[1] == ["extra0", "extra1"]  # prompts_per_round 4 over 2 processes: 2 each


def test_the_module_refuses_a_minibatch_that_does_not_divide_before_the_model_loads(tiny_model_dir):
    from rllight.models import HFModel
    from rllight.module import RLModule

    module = RLModule(HFModel(tiny_model_dir), minibatch_size=10)
    module._trainer = SimpleNamespace(world_size=4, global_rank=0, strategy=None, datamodule=None)
    with pytest.raises(RecipeError, match=r"model\.minibatch_size=10 .* all 4 training processes"):
        module.setup("fit")
    assert module.policy is None
    module._trainer = SimpleNamespace(world_size=2, global_rank=0, strategy=None, datamodule=None)
    module.setup("fit")  # 5 responses per process
    assert module.updater.local_size(10) == 5
