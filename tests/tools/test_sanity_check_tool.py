"""tools/sanity_check.py: which profiled prompts it keeps, how it reads a run's training accuracy and judges it, what it
reads from the recipe, its printout, exit code and record (the ``rllight`` commands replaced by fakes that write what
the real ones would: the evaluation's rows, a TensorBoard log), its ``--help``, and, marked slow, the whole tool on the
tiny model. Whether its verdict catches a broken trainer is tests/test_sanity_check.py's."""

import json
import os
import subprocess
import sys

import pytest
from helpers import TESTS, load_tool, tiny_overrides
from test_tools import agrees, recorded

from rllight.app.records import parse_pairs

ROOT = os.path.dirname(TESTS)
tool = load_tool("sanity_check")


def _rows(rates: list[float]) -> list[dict]:
    return [{"prompt": f"q{i}", "answer": str(i), "data_source": "arithmetic", "pass_rate": r}
            for i, r in enumerate(rates)]


def _write_log(run_dir: str, accuracy: list[float], tag: str = tool.ACCURACY) -> None:
    """A TensorBoard log as a run writes it: ``tag`` at RL steps 1, 2, ..."""
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(log_dir=os.path.join(run_dir, "lightning_logs", "version_0"))
    for step, value in enumerate(accuracy, start=1):
        writer.add_scalar(tag, value, step)
        writer.add_scalar("train/reward/mean", 0.5, step)  # other tags are not read
    writer.close()


def test_select_keeps_the_band_in_order_up_to_the_limit_in_whole_batches():
    rates = [0.0, 0.25, 0.5, 0.75, 1.0, 0.125, 0.2, 0.8, 0.625]

    def names(rows):
        return [r["prompt"] for r in rows]

    # [0.2, 0.8], both ends kept: q1 q2 q3 q6 q7 q8, in the profile's order.
    assert names(tool.select(_rows(rates), 0.2, 0.8, 10, 1)) == ["q1", "q2", "q3", "q6", "q7", "q8"]
    # At most 5, then cut to whole batches of 2: q1 q2 q3 q6.
    assert names(tool.select(_rows(rates), 0.2, 0.8, 5, 2)) == ["q1", "q2", "q3", "q6"]
    # Fewer than one batch: kept as they are (the caller refuses them with one line).
    assert names(tool.select(_rows(rates), 0.7, 0.8, 10, 4)) == ["q3", "q7"]
    assert tool.select(_rows(rates), 0.3, 0.4, 10, 1) == []


def test_judge_finds_the_first_step_where_the_moving_average_reaches_the_bar():
    curve = [0.0, 0.25, 0.5, 0.5, 1.0, 0.75, 1.0]
    # Window 2: averages at steps 2..7 are 0.125, 0.375, 0.5, 0.75, 0.875, 0.875.
    assert tool.moving_average(curve, 2) == [0.125, 0.375, 0.5, 0.75, 0.875, 0.875]
    verdict = tool.judge(curve, 0.75, 2)
    assert verdict == {"start": 0.125, "best": 0.875, "final": 0.875, "first_pass_step": 5, "passed": True,
                       "blocks": [0.125, 0.5, 0.875, 1.0]}  # steps 1-2, 3-4, 5-6, 7
    assert tool.judge(curve, 0.875, 2)["first_pass_step"] == 6  # reaching the bar is enough
    failed = tool.judge(curve, 0.9, 2)
    assert (failed["passed"], failed["first_pass_step"], failed["best"]) == (False, None, 0.875)
    short = tool.judge([1.0, 1.0], 0.5, 3)  # fewer steps than the window: no average, no pass
    assert (short["passed"], short["start"], short["best"]) == (False, None, None)


def test_accuracy_curve_reads_the_runs_log_up_to_the_budget(tmp_path):
    _write_log(str(tmp_path), [0.25, 0.5, 0.75, 1.0, 1.0])
    assert tool.accuracy_curve(str(tmp_path), 4) == [0.25, 0.5, 0.75, 1.0]  # exact in float32
    assert tool.accuracy_curve(str(tmp_path), 10) == [0.25, 0.5, 0.75, 1.0, 1.0]


def test_recipe_settings_are_the_quickstarts():
    settings = tool.recipe_settings(tool.parse_args([]))
    assert settings["sampling"] == {"temperature": 0.7, "top_p": 1.0, "top_k": 0}
    assert (settings["batch_size"], settings["updates_per_step"]) == (4, 2)  # 4 x 8 responses, minibatches of 16
    assert len(settings["rows"]) == 2000
    assert set(settings["rows"][0]) == {"prompt", "answer", "data_source"}


def _fake_rllight(correct_counts: list[int], curves: dict[int, list[float]], calls: list):
    """``run_rllight`` as the real commands would answer: ``validate`` writes the evaluation's rows (the i-th prompt
    right in ``correct_counts[i]`` of its samples), ``fit`` the TensorBoard log of ``curves[seed]``."""

    def fake(command, args, overlay, folder):
        calls.append((command, overlay))
        if command == "validate":
            with open(overlay["data"]["val_files"][0]) as f:
                rows = [json.loads(line) for line in f]
            n = overlay["model"]["evaluation"]["n"]
            out = os.path.join(folder, "validate", "lightning_logs", "version_0", "evaluation")
            os.makedirs(out)
            with open(os.path.join(out, "val_step0_rows.jsonl"), "w") as f:
                f.writelines(json.dumps({**row, "correct": [i < right for i in range(n)]}) + "\n"
                             for row, right in zip(rows, correct_counts))
        else:
            _write_log(overlay["trainer"]["default_root_dir"], curves[overlay["seed_everything"]])
        return 0, 12.0

    return fake


def test_main_profiles_trains_each_seed_and_records_what_it_printed(tmp_path, monkeypatch, capsys):
    rows = [{"prompt": f"q{i}", "answer": str(i), "data_source": "arithmetic"} for i in range(10)]
    settings = {"rows": rows, "batch_size": 2, "updates_per_step": 2,
                "sampling": {"temperature": 0.7, "top_p": 1.0, "top_k": 0}}
    calls = []
    curves = {0: [0.25, 0.5, 0.75, 1.0, 1.0, 1.0], 1: [0.25, 0.25, 0.5, 0.5, 0.5, 0.75]}
    monkeypatch.setattr(tool, "recipe_settings", lambda args: settings)
    monkeypatch.setattr(tool, "run_rllight", _fake_rllight([0, 1, 2, 3, 4, 1, 2, 2, 3, 0], curves, calls))
    record = tmp_path / "records" / "s.json"
    code = tool.main(["--out", str(tmp_path / "out"), "--profile-prompts", "10", "--samples", "4", "--prompts", "5",
                      "--steps", "6", "--window", "2", "--bar", "0.75", "--seeds", "0", "1", "--record", str(record),
                      "--shared", "no"])
    assert code == 1  # seed 1 never reaches the bar
    validate, fit0, fit1 = calls
    assert validate[0] == "validate" and validate[1]["model"]["evaluation"]["n"] == 4
    assert validate[1]["model"]["evaluation"]["temperature"] == 0.7  # sampled as training samples
    # Pass rates 0, .25, .5, .75, 1, .25, .5, .5, .75, 0: in [0.2, 0.8] q1 q2 q3 q5 q6 ..., at most 5, whole batches.
    fixed = tmp_path / "out" / "fixed_set.jsonl"
    kept = [json.loads(line) for line in fixed.read_text().splitlines()]
    assert kept == [{"prompt": f"q{i}", "answer": str(i), "data_source": "arithmetic"} for i in (1, 2, 3, 5)]
    profiled = json.loads((tmp_path / "out" / "profile.json").read_text())["prompts"]
    assert [p["pass_rate"] for p in profiled] == [0.0, 0.25, 0.5, 0.75, 1.0, 0.25, 0.5, 0.5, 0.75, 0.0]
    for seed, (command, overlay) in enumerate((fit0, fit1)):
        assert (command, overlay["seed_everything"]) == ("fit", seed)
        assert overlay["data"]["train_files"] == [str(fixed)] and overlay["trainer"]["max_steps"] == 12
    out = capsys.readouterr().out.strip().splitlines()
    assert "sanity_check: kept 4 of 10 profiled prompts (pass rate in [0.2, 0.8], mean 0.438)" in out
    # Window 2: seed 0's averages 0.375, 0.625, 0.875 (step 4: past 0.75), ...; seed 1's at most 0.625.
    seed0, seed1 = [line for line in out if line.startswith("seed ")]
    assert seed0 == ("seed 0: accuracy by 2 steps 0.375 0.875 1.000 | best 2-step average 1.000 | reaches 0.75 at "
                     "step 4: PASS")
    assert seed1 == ("seed 1: accuracy by 2 steps 0.250 0.500 0.625 | best 2-step average 0.625 | reaches 0.75 not "
                     "within 6 steps: FAIL")
    machine, last = out[-2:]
    assert machine.startswith("machine: ")
    assert parse_pairs(last) == {"sanity": "FAIL", "first_pass_step": None, "best_moving_average": 0.625,
                                 "bar": 0.75, "window": 2, "steps": 6, "prompts": 4}
    # The record: a row per seed as printed, the last line's values in the summary.
    written = recorded(record, "sanity_check")
    assert written["shared"] == "alone" and written["section"] == "Quickstart"
    rows = written["rows"]
    assert [(r["seed"], r["verdict"], r["first_pass_step"], r["best"]) for r in rows] == [
        (0, "PASS", 4, 1.0), (1, "FAIL", None, 0.625)]
    assert [rows[1][k] for k in ("accuracy_1_2", "accuracy_3_4", "accuracy_5_6")] == [0.25, 0.5, 0.625]
    assert (rows[0]["start"], rows[0]["steps"], rows[0]["prompts"]) == (0.375, 6, 4)
    agrees({**written["summary"], "sanity": "FAIL"}, last)
    assert written["summary"]["passed_seeds"] == 1 and written["summary"]["profile_mean_pass_rate"] == 0.438
    assert "was in [0.2, 0.8] (mean 0.438)" in written["note"] and "Bar 0.8" not in written["note"]  # not the default


def test_main_passes_when_every_seed_passes_and_trains_on_a_given_set(tmp_path, monkeypatch, capsys):
    given = tmp_path / "set.jsonl"
    given.write_text("".join(json.dumps({"prompt": f"q{i}", "answer": "1", "data_source": "x"}) + "\n"
                             for i in range(4)))
    calls = []
    monkeypatch.setattr(tool, "recipe_settings", lambda args: {"batch_size": 2, "updates_per_step": 1})
    monkeypatch.setattr(tool, "run_rllight", _fake_rllight([], {3: [0.5, 1.0, 1.0], 4: [1.0, 1.0, 1.0]}, calls))
    assert tool.main(["--fixed-set", str(given), "--out", str(tmp_path / "out"), "--steps", "3", "--window", "2",
                      "--bar", "0.75", "--seeds", "3", "4"]) == 0
    assert [c[0] for c in calls] == ["fit", "fit"]  # no profile
    assert calls[0][1]["data"]["train_files"] == [str(given)]
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert parse_pairs(last) == {"sanity": "PASS", "first_pass_step": 2, "best_moving_average": 1.0, "bar": 0.75,
                                 "window": 2, "steps": 3, "prompts": 4}  # the latest seed's first pass, the lowest best


def test_too_few_prompts_in_the_band_stop_the_tool_with_one_line(tmp_path, monkeypatch):
    settings = {"rows": [{"prompt": "q", "answer": "1", "data_source": "x"}] * 3, "batch_size": 2,
                "updates_per_step": 2, "sampling": {"temperature": 1.0, "top_p": 1.0, "top_k": 0}}
    monkeypatch.setattr(tool, "recipe_settings", lambda args: settings)
    monkeypatch.setattr(tool, "run_rllight", _fake_rllight([0, 4, 2], {}, []))
    with pytest.raises(SystemExit, match=r"1 of 3 profiled prompts have a pass rate in \[0.2, 0.8\], fewer than one "
                                         r"training batch \(2\)"):
        tool.main(["--out", str(tmp_path), "--samples", "4"])


def test_help_names_the_stages_options():
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "sanity_check.py"), "--help"],
                          capture_output=True, text=True, check=True)
    for option in ("--profile-prompts", "--samples", "--low", "--high", "--prompts", "--fixed-set", "--steps",
                   "--bar", "--window", "--seeds", "--record", "--shared"):
        assert option in proc.stdout
    assert proc.stdout.splitlines()[0].startswith("usage: sanity_check.py")


def test_refuses_a_band_or_window_that_cannot_work(capsys):
    for argv, message in ((["--low", "0.9", "--high", "0.1"], "need 0 <= low <= high <= 1"),
                          (["--steps", "4", "--window", "5"], "--window 5 is longer than --steps 4")):
        with pytest.raises(SystemExit):
            tool.parse_args(argv)
        assert message in capsys.readouterr().err


@pytest.mark.slow  # three `rllight` child processes: the profile, then two steps of training
def test_the_tool_profiles_and_trains_the_tiny_model(tmp_path, tiny_model_dir, capsys):
    """End to end on the tiny model and the sanity test's task (tests/sanity_task.py): every prompt kept (the band is
    [0, 1]), a bar of 0 passed at the first complete window, the record written."""
    from sanity_task import PROMPTS, sanity_overlay

    overlays = [tiny_overrides(tmp_path, tiny_model_dir), sanity_overlay(tmp_path, 1)]
    record = tmp_path / "records" / "t.json"
    code = tool.main([*[a for o in overlays for a in ("--config", o)], "--out", str(tmp_path / "out"),
                      "--profile-prompts", "4", "--samples", "2", "--low", "0", "--high", "1", "--steps", "2",
                      "--window", "2", "--bar", "0", "--record", str(record)])
    assert code == 0
    kept = (tmp_path / "out" / "fixed_set.jsonl").read_text().splitlines()
    assert [json.loads(line)["prompt"] for line in kept] == PROMPTS
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert parse_pairs(last)["sanity"] == "PASS" and parse_pairs(last)["first_pass_step"] == 2
    (row,) = recorded(record, "sanity_check")["rows"]
    assert (row["steps"], row["verdict"]) == (2, "PASS")
