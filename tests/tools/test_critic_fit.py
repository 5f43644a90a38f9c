"""tools/critic_fit.py and its table (tools/critic_fit_table.py): rollouts sampled once with the policy frozen, critic
options fitted on the same ones and their held-out explained variance pooled; a probe of rollouts no option fits,
scored after each fit, and the recipe's stopping criterion replayed on the held-out numbers; the means over seeds; a
rerun samples and fits nothing again."""

import json
import os

import pytest
import torch
from helpers import TESTS, load_tool, tiny_overrides

from rllight.app.records import load_records


def test_pooled_numbers_by_hand():
    table = load_tool("critic_fit_table")
    # V = (0.5, 0.5, 1, 0), R = (1, 0, 1, 0): R - V = (0.5, -0.5, 0, 0), Var(R - V) = 0.125, Var(R) = 0.25;
    # explained variance 1 - 0.125 / 0.25 = 0.5, loss 0.5 * mean((R - V)^2) = 0.5 * 0.125 = 0.0625.
    ev, loss = table.pooled([(torch.tensor([0.5, 0.5]), torch.tensor([1.0, 0.0])),
                            (torch.tensor([1.0, 0.0]), torch.tensor([1.0, 0.0]))])
    assert ev == pytest.approx(0.5) and loss == pytest.approx(0.0625)
    ev, loss = table.pooled([(torch.tensor([0.2]), torch.tensor([1.0]))])
    assert ev != ev and loss == pytest.approx(0.5 * 0.8 ** 2)  # returns that do not vary: no explained variance


def _pair(a: float) -> list[list[float]]:
    """One rollout's held-out (values, returns): returns (1, 0), values (a, 1 - a). R - V = (1 - a, a - 1), so the
    explained variance is 1 - (1 - a)^2 / 0.25 and the loss 0.5 (1 - a)^2."""
    return [[a, 1 - a], [1.0, 0.0]]


CRITERION = {"max_steps": 10, "patience": 2, "min_delta": 1e-3, "min_delta_explained_variance": 0.01, "window": 1}


def test_the_recipes_stopping_criterion_replayed_by_hand():
    table = load_tool("critic_fit_table")
    # EV 0, then 0.75 (and the loss 0.125, then 0.03125): rollouts 1 and 2 improve, 3 and 4 do not: patience 2 ends
    # it after rollout 4.
    held_out = [_pair(0.5), _pair(0.75), _pair(0.75), _pair(0.75)]
    assert table.stop_of(held_out, CRITERION) == 4
    assert table.stop_of(held_out, CRITERION, min_ev=0.7) == 4
    assert table.stop_of(held_out, CRITERION, min_ev=0.8) is None  # below the minimum: it goes on past them
    assert table.stop_of(held_out, {**CRITERION, "max_steps": 3}) == 3  # the cap
    # Pooled over a window of 2, rollouts 3 and 4 improve on the window (0.5, 0.75) of rollout 2: it goes on.
    assert table.stop_of(held_out, {**CRITERION, "window": 2}) is None


def test_the_probe_row_reads_the_probe_at_each_stop():
    tool, table = load_tool("critic_fit"), load_tool("critic_fit_table")
    args = tool.parse_args(["--option", "x", "--rollouts", "4", "--window", "2", "--probe", "3", "--min-ev", "0.8"])
    result = {"held_out": [_pair(0.5), _pair(0.75), _pair(0.75), _pair(0.75)],
              "probe": [[0.1, 0.2], [0.3, 0.1], [0.2, 0.1], [0.25, 0.1]]}
    row = table.probe_row(args, result, CRITERION)
    assert row["probe_2"] == 0.3 and row["probe_4"] == 0.25  # after each window's last rollout
    assert (row["probe_best"], row["probe_best_at"], row["probe_last"]) == (0.3, 2, 0.25)
    assert (row["stop"], row["stop_window"], row["stop_probe"]) == (4, 0.75, 0.25)
    assert row["stop_m0.8"] is None and "stop_m0.8_probe" not in row
    assert "split_stop" not in row  # no halves recorded: no split


def test_the_probe_split_in_two_judges_each_criterions_stop_on_the_second_half():
    tool, table = load_tool("critic_fit"), load_tool("critic_fit_table")
    args = tool.parse_args(["--option", "x", "--rollouts", "4", "--window", "2", "--probe", "2"])
    # The first half's (EV, loss) after each fit: the first improves, the next two do not, so patience 2 ends it after
    # fit 3; the window's criterion ends after rollout 4 (the test above). The second half's EV is 0.4 after fit 3 and
    # 0.15 after fit 4: 0.25 more where the first half stopped.
    first = [[0.3, 0.1], [0.3, 0.1], [0.3, 0.1], [0.3, 0.1]]
    second = [[0.1, 0.2], [0.2, 0.2], [0.4, 0.1], [0.15, 0.2]]
    result = {"held_out": [_pair(0.5), _pair(0.75), _pair(0.75), _pair(0.75)], "probe": [[0.2, 0.1]] * 4,
              "probe_halves": [[a, b] for a, b in zip(first, second)]}
    row = table.probe_row(args, result, CRITERION)
    assert (row["split_stop"], row["stop"]) == (3, 4)
    assert (row["probe_b_split"], row["probe_b_window"], row["probe_b_diff"]) == (0.4, 0.15, 0.25)
    # A criterion that never stops on them: no difference.
    row = table.probe_row(args, result, {**CRITERION, "patience": None, "max_steps": 10})
    assert row["split_stop"] is None and "probe_b_split" not in row and "probe_b_diff" not in row
    # One probe rollout: a single half, no split.
    assert "split_stop" not in table.probe_row(args, {**result, "probe_halves": [[a] for a in first]}, CRITERION)


@pytest.mark.slow  # a `rllight fit` child samples the rollouts, two children fit
def test_seed_means_and_paired_differences_by_hand():
    tool, table = load_tool("critic_fit"), load_tool("critic_fit_table")
    args = tool.parse_args(["--rollouts", "2", "--window", "2", "--probe", "1", "--seeds", "0", "1",
                            "--option", "a", "lr=1e-5", "--option", "b", "lr=2e-5"])
    columns = [["option", "option"], ["seed", "seed"], ["probe_2", "probe EV after 2", ".3f"],
               ["probe_best_at", "best after"], ["stop_probe", "probe EV there", ".3f"]]
    rows = [{"option": "a", "seed": 0, "probe_2": 0.1, "probe_best_at": 1, "stop_probe": 0.2},
            {"option": "b", "seed": 0, "probe_2": 0.4, "probe_best_at": 2, "stop_probe": None},
            {"option": "(between prompts, in sample)", "seed": 0, "probe_2": 0.9},
            {"option": "a", "seed": 1, "probe_2": 0.3, "probe_best_at": 2, "stop_probe": 0.0},
            {"option": "b", "seed": 1, "probe_2": 0.2, "probe_best_at": 1, "stop_probe": 0.1}]
    means = table.seed_means(args, rows, columns)
    # a: (0.1 + 0.3) / 2 = 0.2; b: (0.4 + 0.2) / 2 = 0.3; b - a per seed: +0.3 and -0.1, mean 0.1. A stop missing on
    # one seed leaves no mean; "best after" is a rollout, not averaged.
    assert [(m["option"], m["probe_2"], m["stop_probe"]) for m in means] == [
        ("a", 0.2, 0.1), ("b", 0.3, None), ("b - a", 0.1, None)]
    assert "probe_best_at" not in means[0] and "probe_2 -0.100..+0.300" in means[2]["settings"]
    one_seed = tool.parse_args(["--probe", "1", "--option", "a", "lr=1e-5"])
    assert table.seed_means(one_seed, rows, columns) == []


def test_options_fit_the_same_rollouts_and_a_rerun_does_nothing_again(tmp_path, tiny_model_dir, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", TESTS)  # the tiny overlay's reward lives beside the tests
    overlay = tiny_overrides(tmp_path, tiny_model_dir)
    out, record = tmp_path / "fit", tmp_path / "records" / "critic-fit.json"
    os.makedirs(record.parent)
    argv = ["--recipe", "recipes/vapo.yaml", "--config", overlay, "--set", "data.batch_size=2", "--rollouts", "3",
            "--window", "2", "--probe", "2", "--option", "still", "epochs=0", "--option", "fits", "lr=1e-2",
            "head_lr=1e-1", "clip=0", "epochs=2", "minibatch=4", "replay=1", "--option", "wide", "epochs=0",
            "sampling=wide", "--sampling", "wide", "data.batch_size=4", "model.sampler.init_args.group_size=2",
            "--out", str(out), "--record", str(record)]
    tool = load_tool("critic_fit")
    assert tool.main(argv) == 0
    saved = [out / "seed-0" / "rollouts" / f"r00{k}.pt" for k in range(5)]  # 3 to fit, 2 of the probe
    rollouts = [torch.load(p, weights_only=False) for p in saved]
    still, fits = (json.loads((out / "seed-0" / f"{name}.json").read_text()) for name in ("still", "fits"))
    # Both options saw the same responses: the same returns, token by token, on every rollout.
    assert [r for _, r in still["held_out"]] == [r for _, r in fits["held_out"]]
    assert [len(r) for _, r in still["held_out"]] == [int(x.response_mask.sum()) for x in rollouts[:3]]
    assert all(v == 0.0 for values, _ in still["held_out"] for v in values)  # never trained: the zero head
    assert any(v != 0.0 for values, _ in fits["held_out"][1:] for v in values)  # trained: it moved
    # The probe, scored after each of the 3 fits: by the zero head, no explained variance; by a critic that
    # trains, a number that moves from fit to fit.
    assert [ev for ev, _ in still["probe"]] == [0.0, 0.0, 0.0]
    # The probe in halves, one rollout each here: the zero head's loss on each is 0.5 R^2 averaged over its tokens.
    halves = [[float(0.5 * (r.rewards.float() ** 2 * r.response_mask.sum(1)).sum() / r.response_mask.sum())]
              for r in rollouts[3:]]
    assert [[loss for _, loss in fit] for fit in still["probe_halves"]] == [pytest.approx([h[0] for h in halves])] * 3
    assert len(fits["probe"]) == 3 and len({ev for ev, _ in fits["probe"]}) > 1
    # The option with its own sampling fitted those rollouts (4 prompts x 2 responses each, none of the probe's),
    # and was scored on the same probe after each of its 3 fits.
    wide_saved = sorted(os.listdir(out / "seed-0" / "wide" / "rollouts"))
    assert wide_saved == ["r000.pt", "r001.pt", "r002.pt"]
    wide_rollouts = [torch.load(out / "seed-0" / "wide" / "rollouts" / name, weights_only=False) for name in wide_saved]
    assert all(sorted(r.group_ids.unique(return_counts=True)[1].tolist()) == [2, 2, 2, 2] for r in wide_rollouts)
    wide = json.loads((out / "seed-0" / "wide.json").read_text())
    assert [len(r) for _, r in wide["held_out"]] == [int(x.response_mask.sum()) for x in wide_rollouts]
    assert [ev for ev, _ in wide["probe"]] == [0.0, 0.0, 0.0]
    (written,) = load_records(str(record.parent))
    rows = {row["option"]: row for row in written["rows"]}
    assert rows["still"]["probe_last"] == 0.0 and rows["still"]["seed"] == 0
    assert rows["still"]["ev"] == 0.0  # a constant critic explains none of the variance
    # The between-prompts share, worked out here from the rewards: each prompt's mean reward on its tokens.
    assert rows["(between prompts, in sample)"]["ev_1_2"] == pytest.approx(round(share_of(rollouts[:2]), 3), abs=1e-3)
    assert rows["(between prompts, in sample, wide)"]["ev_1_2"] == pytest.approx(round(share_of(wide_rollouts[:2]), 3),
                                                                                  abs=1e-3)
    assert "sampling=wide (data.batch_size=4 model.sampler.init_args.group_size=2)" in rows["wide"]["settings"]

    results = [out / "seed-0" / f"{name}.json" for name in ("still", "fits", "wide")]
    stamps = {p: os.path.getmtime(p) for p in [*saved, *(out / "seed-0" / "wide" / "rollouts").iterdir(), *results]}
    monkeypatch.setattr(tool.subprocess, "call", lambda *a, **k: pytest.fail("sampled again"))
    real_popen = tool.subprocess.Popen

    def popen(cmd, *a, **k):  # the record asks git for its commit; a fit would start this tool again
        assert "--fit-one" not in cmd, "fitted again"
        return real_popen(cmd, *a, **k)

    monkeypatch.setattr(tool.subprocess, "Popen", popen)
    assert tool.main(argv) == 0
    assert {p: os.path.getmtime(p) for p in stamps} == stamps


def share_of(rollouts) -> float:
    """The share of the returns' variance between prompts, worked out from the rewards: each prompt's mean reward
    on its tokens."""
    values, returns = [], []
    for rollout in rollouts:
        for i in range(len(rollout)):
            same = rollout.group_ids == rollout.group_ids[i]
            n = int(rollout.response_mask[i].sum())
            values += [float(rollout.rewards[same].mean())] * n
            returns += [float(rollout.rewards[i])] * n
    values, returns = torch.tensor(values, dtype=torch.float64), torch.tensor(returns, dtype=torch.float64)
    return 1 - float((returns - values).var(unbiased=False) / returns.var(unbiased=False))


@pytest.mark.parametrize("argv, says", [
    (["--option", "a", "sampling=wide"], "options use ['wide'], --sampling names none"),  # no such sampling
    (["--option", "a", "--sampling", "wide", "data.batch_size=4"], "options use none, --sampling names ['wide']"),
    (["--option", "a", "sampling=rollouts", "--sampling", "rollouts", "data.batch_size=4"],  # the run's own folder
     "--sampling rollouts: give a name"),
    (["--option", "a", "sampling=wide", "--sampling", "wide", "data.batch_size"], "then recipe settings KEY=VALUE"),
])
def test_a_sampling_must_be_named_used_and_set(argv, says, capsys):
    with pytest.raises(SystemExit):
        load_tool("critic_fit").parse_args(argv)
    assert says in capsys.readouterr().err
