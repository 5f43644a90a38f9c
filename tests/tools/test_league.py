"""tools/league.py and tools/league_report.py: a smoke league of two methods over two seeds on the tiny model writes
each run's results, the table and the record; a rerun launches only what did not finish (a run folder without a
complete ``run.json`` starts again from nothing) and the table names what is missing; the gain's paired standard
error and the flag against GRPO, on per-problem numbers worked out by hand."""

import json
import math

import pytest
import yaml
from helpers import load_tool

from rllight.app.records import load_records, make_record

SMOKE = ["--steps", "1", "--batch-size", "1", "--group-size", "2", "--val-size", "4", "--max-new-tokens", "8",
         "--precision", "32-true", "--jobs", "2"]


@pytest.fixture
def tiny_overlay(tmp_path, tiny_model_dir) -> str:
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump({"model": {
        "model": {"class_path": "rllight.models.HFModel", "init_args": {"path": tiny_model_dir}},
        "reward_preflight": 0, "reward_runner": None}}))  # scored in the training process: no reward workers
    return str(path)


def _summaries(out) -> dict:
    return {(m, s): out / m / f"seed{s}" / "run.json" for m in ("grpo", "rloo") for s in (0, 1)}


@pytest.mark.slow  # five `rllight fit` child processes (and their configurations)
def test_a_smoke_league_records_every_run_and_a_rerun_launches_only_what_did_not_finish(tmp_path, tiny_overlay,
                                                                                        monkeypatch, capsys):
    league = load_tool("league")
    real, launched, pages = league.launch, [], []

    def counting(cmd, log_path):
        launched.append(log_path)
        return real(cmd, log_path)

    monkeypatch.setattr(league, "launch", counting)
    out = tmp_path / "league"
    argv = ["--methods", "grpo", "rloo", "--seeds", "0", "1", "--baseline-seeds", "0", "1", *SMOKE,
            "--config", tiny_overlay, "--out", str(out)]
    assert league.main(argv + ["--record", str(tmp_path / "records" / "league.json")]) == 0
    assert len(launched) == 4
    summaries = _summaries(out)
    for (method, seed), path in summaries.items():
        run = json.loads(path.read_text())
        assert run["complete"] and run["seed"] == seed and run["returncode"] == 0
        assert run["lr"] == {"grpo": 1e-5, "rloo": 2e-6}[method]  # each recipe's own
        assert run["temperature"] == 0.7  # the quickstart's for every method (recipes/grpo.yaml samples at 1.0)
        assert run["settings"]["rollouts"] == 1 and run["settings"]["precision"] == "32-true"
        assert set(run["metrics"]) == set(run["per_problem"]) == {"greedy", "avg4", "pass4"}
        for metric in run["per_problem"].values():
            assert len(metric["before"]) == len(metric["after"]) == 4  # every held-out problem, to pair
    (record,) = load_records(str(tmp_path / "records"))
    assert record["id"] == "league" and [r["method"] for r in record["rows"]] == ["grpo", "rloo"]
    assert all(r["seeds"] == "0, 1" and r["missing"] is None for r in record["rows"])
    grpo_runs = [json.loads(summaries["grpo", s].read_text()) for s in (0, 1)]
    before = sum(r["metrics"]["avg4"]["before"] for r in grpo_runs) / 2
    assert record["rows"][0]["avg4_before"] == float(f"{before:.3f}")
    page = (out / "league.md").read_text()
    assert "| grpo | 0, 1 |" in page and "| rloo | 0, 1 |" in page and "No run is missing." in page
    # The page is the record's: made again from the record alone, it is the same.
    again = tmp_path / "again" / "league.md"
    assert league.main(["--page-of", str(tmp_path / "records" / "league.json"), "--page", str(again)]) == 0
    assert again.read_text() == page

    # A run folder without a complete run.json (a run killed midway) starts again from nothing; nothing else runs.
    kept = {key: (path.stat().st_mtime_ns, path.read_text()) for key, path in summaries.items() if key != ("rloo", 1)}
    folder = out / "rloo" / "seed1"
    (folder / "run.json").unlink()
    (folder / "left-over").write_text("from the run that was killed")
    launched.clear()

    def failing(cmd, log_path):  # this time the run fails: it is listed as missing, with why
        launched.append(log_path)
        pages.append((out / "league.md").read_text())
        return 1

    monkeypatch.setattr(league, "launch", failing)
    assert league.main(argv) == 1
    assert launched == [str(folder / "stdout.log")] and not (folder / "left-over").exists()
    assert "Missing: rloo seed 1: not run yet." in pages[0]  # the table written before the runs start
    assert json.loads((folder / "run.json").read_text())["complete"] is False
    page = (out / "league.md").read_text()
    assert "Missing: rloo seed 1: failed (exit 1)." in page and "| rloo | 0 | 1 |" in page
    assert json.loads((out / "league.json").read_text())["missing"] == ["rloo seed 1: failed (exit 1)"]
    # Once more: the failed run runs again and finishes; the finished ones are not touched.
    monkeypatch.setattr(league, "launch", counting)
    launched.clear()
    assert league.main(argv) == 0
    assert launched == [str(folder / "stdout.log")] and json.loads((folder / "run.json").read_text())["complete"]
    assert {key: (summaries[key].stat().st_mtime_ns, summaries[key].read_text()) for key in kept} == kept
    assert "No run is missing." in (out / "league.md").read_text()
    # Finished runs of other settings are refused before anything runs.
    other = list(argv)
    other[other.index("--steps") + 1] = "2"
    with pytest.raises(SystemExit, match="other settings"):
        league.main(other)
    assert len(launched) == 1


def _run(seed: int, before: dict, after: dict) -> dict:
    """A finished run with only greedy per-problem values (what the statistics read)."""
    return {"method": "m", "seed": seed, "per_problem": {"greedy": {"before": before, "after": after}},
            "signals": {}, "prompts": 4, "group_size": 8, "lr": 1e-5}


BEFORE = {"a": 0.0, "b": 0.0, "c": 1.0}
GRPO = [_run(0, BEFORE, {"a": 1.0, "b": 1.0, "c": 1.0}), _run(1, BEFORE, {"a": 1.0, "b": 0.0, "c": 1.0})]
WORSE = [_run(0, BEFORE, {"a": 0.0, "b": 0.0, "c": 0.0}), _run(1, BEFORE, {"a": 0.0, "b": 0.0, "c": 1.0})]
CLOSE = [_run(0, BEFORE, {"a": 1.0, "b": 0.0, "c": 1.0}), _run(1, BEFORE, {"a": 1.0, "b": 0.0, "c": 1.0})]


def test_the_gain_its_paired_standard_error_and_the_flag_against_grpo_by_hand():
    report = load_tool("league_report")
    # GRPO: per-problem gains (a, b, c) are seed 0 (1, 1, 0) and seed 1 (1, 0, 0); averaged over seeds (1, 0.5, 0).
    # Gain 0.5; sd over problems: deviations (0.5, 0, -0.5), variance (0.25 + 0 + 0.25) / 2 = 0.25, sd 0.5, so
    # se = 0.5 / sqrt(3) = 0.288675. Seed-level gains 2/3 and 1/3. Before (0 + 0 + 1) / 3, after (1 + 0.5 + 1) / 3.
    assert report.gain(GRPO, "greedy") == pytest.approx({"before": 1 / 3, "after": 2.5 / 3, "gain": 0.5,
                                                         "se": 0.5 / math.sqrt(3), "seed_min": 1 / 3,
                                                         "seed_max": 2 / 3})
    # WORSE: seed gains (0, 0, -1) and (0, 0, 0), averaged (0, 0, -0.5): gain -1/6; deviations (1/6, 1/6, -1/3),
    # squares sum 1/36 + 1/36 + 4/36 = 1/6, variance 1/12, sd 0.288675, se 0.288675 / sqrt(3) = 1/6.
    assert report.gain(WORSE, "greedy") == pytest.approx({"before": 1 / 3, "after": 1 / 6, "gain": -1 / 6,
                                                          "se": 1 / 6, "seed_min": -1 / 3, "seed_max": 0.0})
    # Against GRPO, problem by problem: (0 - 1, 0 - 0.5, -0.5 - 0) = (-1, -0.5, -0.5), mean -2/3; deviations
    # (-1/3, 1/6, 1/6), squares sum 1/6, variance 1/12, se 1/6: -2/3 < -2 x 1/6, flagged.
    assert report.versus(WORSE, GRPO, "greedy") == pytest.approx({"diff": -2 / 3, "se": 1 / 6, "below": True})
    # CLOSE: (1, 0, 0) in both seeds; against GRPO (0, -0.5, 0), mean -1/6, se 1/6 as above: -1/6 > -1/3, not flagged.
    assert report.versus(CLOSE, GRPO, "greedy") == pytest.approx({"diff": -1 / 6, "se": 1 / 6, "below": False})
    # Near the threshold, one seed each: differences against GRPO of the form (m + 0.1, m + 0.1, m - 0.2) have mean m,
    # deviations (0.1, 0.1, -0.2), squares sum 0.06, variance 0.03, sd sqrt(0.03), se sqrt(0.03) / sqrt(3) = 0.1.
    # m = -0.25 (gains 1 - 0.15, 0.5 - 0.15, 0 - 0.45) is 2.5 se below: flagged; m = -0.15 is 1.5 se below: not.
    for m, flagged in ((-0.25, True), (-0.15, False)):
        after = {"a": 1 + m + 0.1, "b": 0.5 + m + 0.1, "c": 1 + 0 + m - 0.2}  # before (0, 0, 1) + GRPO's gain + e
        assert report.versus([_run(0, BEFORE, after)], GRPO, "greedy") == pytest.approx(
            {"diff": m, "se": 0.1, "below": flagged})
    metrics = {"greedy": ("val/greedy/avg@1", "greedy accuracy")}
    rows = {name: report.method_row(name, f"recipes/{name}.yaml", [0, 1], runs, GRPO, metrics)
            for name, runs in (("grpo", GRPO), ("worse", WORSE), ("close", CLOSE))}
    assert (rows["worse"]["vs_grpo"], rows["worse"]["vs_grpo_se"], rows["worse"]["below_grpo"]) == (-0.667, 0.167,
                                                                                                   "yes")
    assert rows["close"]["below_grpo"] == "no" and "below_grpo" not in rows["grpo"]
    assert (rows["grpo"]["greedy_gain"], rows["grpo"]["greedy_se"]) == (0.5, 0.289)


def test_the_table_names_the_missing_runs_and_the_page_shows_what_was_measured(tmp_path):
    report = load_tool("league_report")
    spent = {"rollouts": 40, "prompts": 4, "responses": 8, "max_new_tokens": 24, "val_size": 3,
             "precision": "32-true", "k": 4}
    runs = [{"method": m, "recipe": f"recipes/{m}.yaml", "seed": s} for s in (0, 1) for m in ("grpo", "worse")]
    done = {("grpo", 0): GRPO[0], ("grpo", 1): GRPO[1], ("worse", 0): WORSE[0]}
    fields = report.league_fields(spent, {"greedy": ("val/greedy/avg@1", "greedy accuracy")}, runs, done,
                                  {("worse", 1): {"returncode": 1}})
    assert fields["note"].endswith("Missing: worse seed 1: failed (exit 1).")
    worse = fields["rows"][1]
    assert (worse["seeds"], worse["missing"]) == ("0", "1")
    assert worse["greedy_gain"] == -0.333 and worse["greedy_seed_min"] == worse["greedy_seed_max"] == -0.333
    fields.pop("headline")
    text = report.write_page(make_record(**fields, command="tools/league.py"), str(tmp_path / "league.md"))
    assert "| worse | 0 | 1 |" in text and "Missing: worse seed 1" in text
    drawn = (tmp_path / "league.png").is_file()
    assert drawn != ("No figure: matplotlib is not installed." in text)
