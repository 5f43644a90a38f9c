"""tools/env_measure.py on the tiny model: it trains the recipe, plays the same held-out games with the base and the
trained model, and records what it printed; the same model measured twice measures the same."""

import pytest
import yaml
from helpers import load_tool
from test_tools import agrees, recorded

from rllight.app.records import headline_value

pytest.importorskip("textarena")


def _overlay(tmp_path, model_dir: str) -> str:
    """The recipe on the tiny model: one RL step of one game x 2 episodes; room in the context for the game's
    opening, which the tiny tokenizer spends ~490 of its 512 positions on."""
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump({
        "evaluate_before_after": False,
        "trainer": {"max_steps": 1, "accelerator": "cpu", "precision": "32-true", "logger": False,
                    "enable_progress_bar": False},
        "model": {"model": {"class_path": "rllight.models.HFModel", "init_args": {"path": model_dir}},
                  "environment": {"init_args": {"max_total_tokens": 512}},
                  "rollout": {"init_args": {"max_new_tokens": 4}}, "sampler": {"init_args": {"group_size": 2}},
                  "batching": {"minibatch_size": None, "micro_batch_size": 4}, "reward_runner": None},
        "data": {"batch_size": 1, "task": {"init_args": {"train_size": 8, "val_size": 2}}}}))
    return str(path)


def test_env_measure_trains_then_records_both_models_on_the_same_games(tmp_path, tiny_model_dir, capsys):
    out, record = tmp_path / "measure", tmp_path / "records" / "env-textarena-guess.json"
    code = load_tool("env_measure").main(["--train", "--seed", "3", "--games", "3", "--examples", "2", "--config",
                                          _overlay(tmp_path, tiny_model_dir), "--out", str(out), "--record",
                                          str(record), "--headline", "Guess The Number (tiny model)"])
    assert code == 0
    machine, last = capsys.readouterr().out.strip().splitlines()[-2:]
    assert machine.startswith("machine: ")
    saved = yaml.safe_load(next((out / "train").rglob("config.yaml")).read_text())
    assert saved["seed_everything"] == 3 and (out / "train" / "model" / "config.json").is_file()

    written = recorded(record, "env_measure")
    rows = written["rows"]
    assert [r["model"] for r in rows] == ["base", "base", "trained", "trained"]  # metrics + a second example each
    base, trained = rows[0], rows[2]
    assert base["games"] == trained["games"] == 3 and base["train_wall_s"] is None and trained["train_wall_s"] > 0
    for row in (base, trained):
        assert 0 <= row["win_rate"] <= 1 and 0 <= row["invalid_share"] <= 1 and row["turns_mean"] >= 1
    # The same held-out games, the first held-out seeds, move by move.
    assert [r["game"].split()[0] for r in rows] == ["(1000000)", "(1000001)"] * 2
    assert written["summary"]["win_rate_after"] == trained["win_rate"]
    agrees(written["summary"], last)
    assert headline_value(written).startswith(f"win rate {base['win_rate']:.3f} → {trained['win_rate']:.3f}")
    assert "## Transcripts" in (out / "env_measure.md").read_text()


@pytest.mark.parametrize("temperature", ["0", "1.0"])
def test_the_same_model_measured_twice_measures_the_same(tmp_path, tiny_model_dir, capsys, temperature):
    """--model names the trained folder; here the base model itself: greedy play, or sampling with the fixed seed,
    plays the same moves, so both rows agree."""
    code = load_tool("env_measure").main(["--model", tiny_model_dir, "--games", "2", "--examples", "1", "--config",
                                          _overlay(tmp_path, tiny_model_dir), "--out", str(tmp_path / "m"),
                                          "--temperature", temperature])
    assert code == 0
    pairs = dict(w.split("=") for w in capsys.readouterr().out.strip().splitlines()[-1].split())
    for name in ("win_rate", "reward_mean", "turns_mean", "invalid_share", "cut_share"):
        assert pairs[f"{name}_before"] == pairs[f"{name}_after"]


def test_env_measure_refuses_two_trained_models():
    with pytest.raises(SystemExit):
        load_tool("env_measure").parse_args(["--train", "--model", "x"])
