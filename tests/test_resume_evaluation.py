"""A resume of a run with ``evaluate_before_after`` compares with the evaluation before training that its checkpoint
keeps (``rllight.app.before_after``) rather than evaluate the untrained model again; it evaluates again when asked
(``--evaluate_before_again true``) or when what the evaluation measures changed; the commands it prints after are
clean."""

import json
import os
import re

import pytest

from conftest import RECIPES
from helpers import tiny_overrides
from rllight.app.before_after import BeforeTraining, measured
from rllight.app.cli import main

EVALUATED_BEFORE = "rllight: evaluation before training: 1 batch (4 prompts)"
REUSED = re.compile(r"^rllight: evaluation before training: the checkpoint's \(accuracy [\d.]+\); "
                    r"--evaluate_before_again true evaluates the untrained model again$", re.M)


@pytest.fixture
def fit(tmp_path, tiny_model_dir, capsys):
    """``fit(*extra)``: ``rllight fit`` of GRPO on the tiny model with ``evaluate_before_after``, the default logger
    and checkpoints (as the quickstart: <root>/lightning_logs/version_N), 2 updates, then ``extra``; its output."""
    overlay = tiny_overrides(tmp_path, tiny_model_dir)
    root = tmp_path / "run"

    def run(*extra: str) -> str:
        main(["fit", "--config", os.path.join(RECIPES, "grpo.yaml"), "--config", overlay, "--evaluate_before_after",
              "true", "--trainer.limit_val_batches", "1.0", "--trainer.logger", "true", "--trainer.enable_checkpointing",
              "true", "--trainer.default_root_dir", str(root), "--trainer.max_steps", "2", *extra])
        return capsys.readouterr().out

    run.root = root
    return run


def _summary(root, version: int) -> dict:
    with open(root / "lightning_logs" / f"version_{version}" / "eval_summary.json") as f:
        return json.load(f)


def _before(summary: dict) -> dict:
    return {label: row["before"] for label, row in summary["metrics"].items()}


def test_a_resume_compares_with_the_checkpoints_evaluation_before_training(fit):
    first = fit()
    assert first.count(EVALUATED_BEFORE) == 1 and not REUSED.search(first)
    resumed = fit("--ckpt_path", "last", "--trainer.max_steps", "4")
    # No evaluation of the untrained model: one line says whose numbers the table's "before" column holds.
    assert EVALUATED_BEFORE not in resumed and len(REUSED.findall(resumed)) == 1, resumed
    assert "rllight: evaluation after 4 updates: 1 batch (4 prompts)" in resumed
    before, after = _summary(fit.root, 0), _summary(fit.root, 1)
    assert _before(after) == _before(before) and after["accuracy_before"] == before["accuracy_before"]
    assert all(row["paired"] for label, row in after["metrics"].items() if "difference_se" in row)
    # ... and its checkpoint keeps them for the next resume.
    resumed_again = fit("--ckpt_path", "last", "--trainer.max_steps", "6")
    assert EVALUATED_BEFORE not in resumed_again and REUSED.search(resumed_again)
    assert _before(_summary(fit.root, 2)) == _before(before)


def test_a_resume_evaluates_again_when_asked_or_when_the_evaluation_changed(fit, caplog):
    fit()
    caplog.clear()
    again = fit("--ckpt_path", "last", "--trainer.max_steps", "4", "--evaluate_before_again", "true")
    assert again.count(EVALUATED_BEFORE) == 1 and not REUSED.search(again)
    assert ("rllight: evaluation before training: evaluating the untrained model again (asked with "
            "--evaluate_before_again)") in again
    assert "recipe changes" not in caplog.text  # the option says what to do now, not what the run is
    # Another evaluation setting: the checkpoint's numbers measured something else.
    changed = fit("--ckpt_path", "last", "--trainer.max_steps", "6", "--model.evaluation.temperature", "0.5")
    assert changed.count(EVALUATED_BEFORE) == 1 and not REUSED.search(changed)
    assert "the checkpoint's was of another model, engine, reward, model.evaluation or held-out prompts" in changed


def test_a_checkpoint_without_an_evaluation_before_training_is_evaluated_again(fit):
    fit("--evaluate_before_after", "false")
    resumed = fit("--ckpt_path", "last", "--trainer.max_steps", "4")
    assert resumed.count(EVALUATED_BEFORE) == 1
    assert "evaluating the untrained model again (the checkpoint keeps none)" in resumed
    assert "accuracy_before=" in resumed


def test_the_commands_a_resumed_run_prints_are_clean(fit):
    """The evaluate command has no option that acts on training alone (the resume's --trainer.max_steps,
    --evaluate_before_after), the train further command one --trainer.max_steps, twice the updates made."""
    fit()
    out = fit("--ckpt_path", "last", "--trainer.max_steps", "4")
    evaluate = re.findall(r"^    evaluate: (rllight validate .*)$", out, re.M)
    further = re.findall(r"^    train further: (rllight fit .*)$", out, re.M)
    assert len(evaluate) == 1 and len(further) == 1, out[-3000:]
    for option in ("--trainer.max_steps", "--evaluate_before_after"):
        assert option not in evaluate[0], evaluate[0]
    assert further[0].count("--trainer.max_steps") == 1 and further[0].endswith("--trainer.max_steps 8")
    assert further[0].count("--ckpt_path") == 1 and "version_1" in further[0]


def test_the_callback_keeps_what_this_run_measured_when_lightning_restores_the_checkpoint():
    """A resume that evaluated again (asked, or settings changed) keeps its own numbers when Lightning restores the
    checkpoint's state into the callback; an empty one takes the checkpoint's."""
    ours = BeforeTraining()
    ours.metrics, ours.per_prompt, ours.measured = {"val/accuracy": 0.5}, {"val/avg@1": {"a": 1.0}}, "new"
    ours.load_state_dict({"metrics": {"val/accuracy": 0.25}, "per_prompt": {}, "measured": "old"})
    assert ours.state_dict() == {"metrics": {"val/accuracy": 0.5}, "per_prompt": {"val/avg@1": {"a": 1.0}},
                                 "measured": "new"}
    empty = BeforeTraining()
    assert empty.state_dict() == {}  # nothing in a checkpoint of a run without evaluate_before_after
    empty.load_state_dict({"metrics": {"val/accuracy": 0.25}, "per_prompt": {}, "measured": "old"})
    assert empty.metrics == {"val/accuracy": 0.25} and empty.measured == "old"


def test_what_an_evaluation_measures_includes_how_long_prompts_are_treated():
    """A cut prompt is another question: ``model.prompt_truncation`` changes the digest, as ``max_prompt_tokens`` does."""
    rows = [{"prompt": "What is 1 + 1?", "answer": "2"}]
    recipe = {"model": {"max_prompt_tokens": 8, "prompt_truncation": "drop"}}
    assert measured(recipe, rows) == measured({"model": dict(recipe["model"])}, rows)
    assert measured(recipe, rows) != measured({"model": {**recipe["model"], "prompt_truncation": "left"}}, rows)
    assert measured(recipe, rows) != measured({"model": {**recipe["model"], "max_prompt_tokens": 9}}, rows)
