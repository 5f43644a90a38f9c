"""Several data sources mixed by weight: exact counts in every batch, schedules, resume from the batch count,
two processes sharing each global batch, one line for a source without a weight, and the logged shares."""

import os
from collections import Counter

import pytest

from rllight.data import RLDataModule, SourceMix, Task
from rllight.errors import RecipeError
from rllight.rollout.source_metrics import source_metrics


class ThreeSources(Task):
    """40 rows of a, 20 of b, 5 of c."""

    def splits(self):
        sizes = {"a": 40, "b": 20, "c": 5}
        rows = [{"prompt": f"{s} {i}", "answer": str(i), "data_source": s} for s, n in sizes.items() for i in range(n)]
        return rows, rows[:2]


def _data(mix, batch_size=8, rank=0, world=1):
    data = RLDataModule(task=ThreeSources(), batch_size=batch_size, mix=mix)
    data.setup()
    data.rank, data.world = rank, world
    return data


def _sources(batch):
    return Counter(row["data_source"] for row in batch)


def test_every_batch_holds_each_sources_share_exactly():
    data = _data(SourceMix({"a": 2, "b": 1, "c": 1}))
    batches = data.upcoming_batches(0, 20)
    assert all(_sources(b) == {"a": 4, "b": 2, "c": 2} for b in batches)  # 8 x (1/2, 1/4, 1/4)
    # c has 5 rows: its 40 draws are 8 passes over all five; a, with 40 rows, is drawn once each
    c_rows = [row["prompt"] for b in batches for row in b if row["data_source"] == "c"]
    assert Counter(c_rows) == {f"c {j}": 8 for j in range(5)}
    a_rows = [row["prompt"] for b in batches for row in b if row["data_source"] == "a"]
    assert sorted(a_rows[:40]) == sorted(f"a {j}" for j in range(40)) and a_rows[:40] != sorted(a_rows[:40])
    # the loader yields the same batches (an epoch: 65 rows / 8 = 8 batches)
    loader = [list(b) for b in data.train_dataloader()]
    assert len(loader) == 8 and [[r["prompt"] for r in b] for b in loader] == [[r["prompt"] for r in b]
                                                                              for b in batches[:8]]


@pytest.mark.parametrize("mix", [None, SourceMix({"a": 1, "b": 1, "c": 1}, schedule=[{"step": 9, "weights": {
    "a": 0, "b": 1, "c": 3}}])])
def test_the_data_side_counts_each_steps_sources_as_the_loaders_global_batch_holds_them(mix):
    """A curriculum draws ``step_counts`` prompts of each source: those of the global batch the loader's processes
    hold together, with a mix and without one (the seeded order's), past an epoch's end."""
    ranks = [_data(mix, batch_size=4, rank=r, world=2) for r in (0, 1)]
    batches = [data.upcoming_batches(0, 40) for data in ranks]
    counts = [ranks[0].step_counts(step) for step in range(40)]
    assert [{s: n for s, n in c.items() if n} for c in counts] == [
        dict(_sources(batches[0][step] + batches[1][step])) for step in range(40)]
    assert len({tuple(sorted(c.items())) for c in counts}) > 1  # the steps differ: the comparison can fail


def test_a_share_that_does_not_divide_the_batch_is_off_by_at_most_one_and_exact_over_batches():
    data = _data(SourceMix({"a": 1, "b": 1, "c": 1}), batch_size=4)
    counts = [_sources(b) for b in data.upcoming_batches(0, 30)]
    assert all(sum(c.values()) == 4 for c in counts)
    assert all(1 <= c[s] <= 2 for c in counts for s in "abc")  # 4/3 each: one or two, never 0 or 3
    assert sum(counts, Counter()) == {"a": 40, "b": 40, "c": 40}  # 120 prompts over 30 batches: a third each


def test_a_schedule_moves_the_weights_linearly_over_steps():
    mix = SourceMix({"a": 1, "b": 0, "c": 0}, schedule=[{"step": 10, "weights": {"a": 0, "b": 1, "c": 0}}])
    assert mix.weights_at(0) == {"a": 1.0, "b": 0.0, "c": 0.0}
    assert mix.weights_at(5) == {"a": 0.5, "b": 0.5, "c": 0.0}
    assert mix.weights_at(10) == mix.weights_at(99) == {"a": 0.0, "b": 1.0, "c": 0.0}
    counts = [_sources(b) for b in _data(mix).upcoming_batches(0, 12)]
    assert counts[0] == {"a": 8} and counts[5] == {"a": 4, "b": 4} and counts[11] == {"b": 8}
    assert [c["a"] for c in counts[:11]] == sorted((c["a"] for c in counts[:11]), reverse=True)


def test_weights_whose_sum_overflows_keep_their_shares_and_every_batch_full():
    """Weights of any scale: 1.7e308 twice sums to infinity in floats, which made every share 0 and the batches
    after the first empty (the run then ended blaming the prompt filter). The shares are those of the weights over
    their largest: the same as 1, 1 and ~0, before and through a schedule."""
    huge = 1.7e308
    mix = SourceMix({"a": huge, "b": huge, "c": 0}, schedule=[{"step": 4, "weights": {"a": huge, "b": 0, "c": huge}}])
    assert mix.weights_at(0) == {"a": 0.5, "b": 0.5, "c": 0.0}
    assert mix.weights_at(2) == {"a": 0.5, "b": 0.25, "c": 0.25}
    assert mix.weights_at(9) == {"a": 0.5, "b": 0.0, "c": 0.5}
    counts = [_sources(b) for b in _data(mix).upcoming_batches(0, 12)]
    assert counts[0] == {"a": 4, "b": 4} and counts[2] == {"a": 4, "b": 2, "c": 2} and counts[11] == {"a": 4, "c": 4}
    assert all(sum(c.values()) == 8 for c in counts)
    assert [len(b) for b in _data(mix).train_dataloader()] == [8] * 8


def test_a_resumed_run_draws_the_batches_an_uninterrupted_run_draws():
    mix = SourceMix({"a": 3, "b": 1, "c": 0}, schedule=[{"step": 6, "weights": {"a": 1, "b": 1, "c": 2}}])
    whole = _data(mix).upcoming_batches(0, 24)  # 65 rows / 8 = 8 batches an epoch: three epochs
    resumed = _data(mix)
    resumed.load_state_dict({"batches_trained": 11})  # mid-epoch
    loader = [list(b) for b, _ in zip(resumed.train_dataloader(), range(5))]
    assert [[r["prompt"] for r in b] for b in loader] == [[r["prompt"] for r in b] for b in whole[11:16]]


def test_two_processes_split_each_global_batch_and_keep_its_mix():
    mix = SourceMix({"a": 2, "b": 1, "c": 1})
    single = _data(mix).upcoming_batches(0, 10)
    ranks = [_data(mix, rank=r, world=2).upcoming_batches(0, 10) for r in (0, 1)]
    for k in range(10):
        assert len(ranks[0][k]) == len(ranks[1][k]) == 4
        both = sorted(r["prompt"] for r in ranks[0][k] + ranks[1][k])
        assert both == sorted(r["prompt"] for r in single[k])  # the same global batch, dealt out
        assert _sources(ranks[0][k] + ranks[1][k]) == {"a": 4, "b": 2, "c": 2}


@pytest.mark.parametrize("mix, message", [
    (SourceMix({"a": 1, "b": 1}), "data.mix.weights has no weight for data source 'c'"),
    (SourceMix({"a": 1, "b": 1, "c": 1, "d": 1}), "data.mix.weights names ['d'], which no training row has"),
])
def test_sources_and_weights_that_do_not_match_are_one_line(mix, message):
    with pytest.raises(RecipeError) as err:
        _data(mix).upcoming_batches(0, 1)
    assert message in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("kwargs, message", [
    ({"weights": {}}, "data.mix.weights must map each data source to a weight"),
    ({"weights": {"a": -1}}, "data.mix.weights.a must be a finite number >= 0, got -1"),
    ({"weights": {"a": float("inf")}}, "data.mix.weights.a must be a finite number >= 0, got inf"),
    ({"weights": {"a": 0}}, "every weight is 0"),
    ({"weights": {"a": 1}, "schedule": [{"step": 3}]}, "data.mix.schedule[0] must be {step: S, weights"),
    ({"weights": {"a": 1, "b": 1}, "schedule": [{"step": 3, "weights": {"a": 1}}]}, "schedule[0].weights names"),
    ({"weights": {"a": 1}, "schedule": [{"step": 3, "weights": {"a": 1}}, {"step": 3, "weights": {"a": 2}}]},
     "schedule[1].step must be larger"),
])
def test_bad_mix_settings_are_one_line_naming_the_key(kwargs, message):
    with pytest.raises(RecipeError) as err:
        SourceMix(**kwargs)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_the_step_logs_each_sources_share(tmp_path, tiny_model_dir):
    from conftest import RECIPES
    from helpers import build, tiny_overrides

    source = tmp_path / "two.jsonl"
    source.write_text("".join(f'{{"prompt": "What is {i} + 1?", "answer": "{i + 1}", "data_source": "{s}"}}\n'
                              for s in ("left", "right") for i in range(8)))
    cli = build(os.path.join(RECIPES, "grpo.yaml"), tiny_overrides(tmp_path, tiny_model_dir), "--trainer.max_steps",
                "2", "--data.train_files", f"[{source}]", "--data.batch_size", "4", "--data.mix",
                "{class_path: rllight.data.SourceMix, init_args: {weights: {left: 3, right: 1}}}")
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    metrics = cli.trainer.callback_metrics
    assert float(metrics["train/data/left/share"]) == 0.75 and float(metrics["train/data/right/share"]) == 0.25
    assert "train/reward/left/mean" in metrics and "train/reward/right/accuracy" in metrics
    assert float(metrics["train/data/left/weight"]) == 0.75 and float(metrics["train/data/right/weight"]) == 0.25
    assert source_metrics(["x", "x"]) == {}  # one source: nothing logged
    # worked by hand: x's rewards 1 and 0 (mean 0.5, one correct), y's 0.25
    assert source_metrics(["x", "y", "x"], [1.0, 0.25, 0.0], [1, 0, 0]) == {
        "data/x/share": 2 / 3, "data/y/share": 1 / 3, "reward/x/mean": 0.5, "reward/y/mean": 0.25,
        "reward/x/accuracy": 0.5, "reward/y/accuracy": 0.0}


def test_a_data_file_and_an_embedded_task_mix_in_one_run_with_include_task(tmp_path):
    import json

    from rllight.data import ArithmeticTask

    path = tmp_path / "words.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"word {i}", "answer": str(i)}) + "\n" for i in range(12)))
    task = ArithmeticTask(num_train=20, num_val=3)
    data = RLDataModule(train_files=[str(path)], task=task, include_task=True, batch_size=4,
                        mix=SourceMix({"words": 1, "arithmetic": 3}))
    data.setup()
    assert _sources(data.train_rows) == {"words": 12, "arithmetic": 20}
    assert all(_sources(b) == {"words": 1, "arithmetic": 3} for b in data.upcoming_batches(0, 10))
    assert [r["prompt"] for r in data.val_rows] == [r["prompt"] for r in task.splits()[1]]  # the task's held-out rows
    # without include_task the files replace the task, as a recipe's task swapped for files from the command line
    alone = RLDataModule(train_files=[str(path)], task=task, batch_size=4)
    alone.setup()
    assert _sources(alone.train_rows) == {"words": 12} and alone.val_rows == []
    with pytest.raises(RecipeError, match="include_task is true but no data.task"):
        RLDataModule(train_files=[str(path)], include_task=True)


def test_the_extra_prompts_a_sampler_draws_follow_the_steps_weights_and_resume():
    from rllight.data.prompt_stream import PromptStream

    data = _data(SourceMix({"a": 1, "b": 0, "c": 0}, schedule=[{"step": 10, "weights": {"a": 1, "b": 1, "c": 2}}]))
    ranks = [PromptStream(data.train_rows, world=2, rank=r) for r in (0, 1)]
    for stream in ranks:
        stream.mix, stream.step = data.mix, 0
    assert all(row["data_source"] == "a" for stream in ranks for row in stream.draw(8))  # step 0: a alone
    for stream in ranks:
        stream.step = 10
    drawn = [stream.draw(8) for stream in ranks]  # every rank draws in the same calls, as samplers do
    assert all(_sources(d) == {"a": 2, "b": 2, "c": 4} for d in drawn)  # 8 x (1/4, 1/4, 1/2), on each rank
    drawn = [d + stream.draw(12) for d, stream in zip(drawn, ranks)]
    prompts = [[row["prompt"] for row in d if row["data_source"] != "c"] for d in drawn]
    assert not set(prompts[0]) & set(prompts[1])  # the ranks draw different rows (c's 5 rows must repeat)
    # c has 5 rows: its 20 draws over both ranks are 4 passes over all five
    assert Counter(row["prompt"] for d in drawn for row in d if row["data_source"] == "c") == {
        f"c {j}": 4 for j in range(5)}
    # resumed from its state, a stream draws what it would have drawn
    state = ranks[0].state_dict()
    assert state == {"cursor": 28, "source_cursors": {"a": 13, "b": 5, "c": 10}}
    ahead = ranks[0].draw(8)
    resumed = PromptStream(data.train_rows, world=2, rank=0)
    resumed.mix, resumed.step = data.mix, 10
    resumed.load_state_dict(state)
    assert resumed.draw(8) == ahead
