"""A tiny in-process model trains end to end through the CLI path: every trainable parameter changes."""

import os

import pytest
import torch
from transformers import AutoModelForCausalLM

from conftest import RECIPES
from helpers import build, tiny_overrides


def _fit_and_compare(recipe, tmp_path, model_dir, *extra, **overrides):
    cli = build(os.path.join(RECIPES, recipe), tiny_overrides(tmp_path, model_dir, **overrides), *extra)
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    before = AutoModelForCausalLM.from_pretrained(model_dir).state_dict()
    module = cli.model
    unchanged = [name for name, p in module.policy.named_parameters()
                 if p.requires_grad and torch.equal(p.detach(), before[name])]
    return cli, unchanged


@pytest.mark.parametrize("recipe", ["grpo.yaml", "ppo.yaml", "quickstart.yaml"])
def test_two_steps_change_every_trainable_parameter(recipe, tmp_path, tiny_model_dir):
    cli, unchanged = _fit_and_compare(recipe, tmp_path, tiny_model_dir)
    assert cli.trainer.global_step >= 2
    assert unchanged == []
    if cli.model.critic is not None:
        for name, p in cli.model.critic.named_parameters():
            assert p.abs().sum() > 0, f"value head {name} still at its zero init"


def test_ppo_takes_several_minibatch_updates_with_old_logprobs(tmp_path, tiny_model_dir):
    # 2 prompts x 1 sample, minibatch 1, 2 epochs: 4 optimizer steps per RL step.
    cli, _ = _fit_and_compare("ppo.yaml", tmp_path, tiny_model_dir, "--trainer.max_steps", "4",
                              batching={"minibatch_size": 1, "ppo_epochs": 2})
    assert cli.trainer.global_step == 4
    assert cli.trainer.fit_loop.epoch_loop.batch_progress.total.completed == 1


def test_user_strategy_from_own_module(tmp_path, tiny_model_dir):
    from user_strategies import RawReward

    RawReward.calls = 0
    cli, unchanged = _fit_and_compare(
        "grpo.yaml", tmp_path, tiny_model_dir,
        advantage={"class_path": "user_strategies.RawReward", "init_args": {"scale": 2.0}},
    )
    assert type(cli.model.advantage).__name__.endswith("RawReward")
    assert RawReward.calls == 2
    assert unchanged == []


def test_failing_reward_gives_zero_and_is_counted(tmp_path, tiny_model_dir):
    cli = build(os.path.join(RECIPES, "grpo.yaml"), tiny_overrides(tmp_path, tiny_model_dir,
                reward={"class_path": "user_strategies.FlakyReward"}))
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    # 2 steps x 2 prompts x 8 samples = 32 scored; every 4th raises and every 4th is NaN.
    assert cli.model.producer.reward_failures == 16
    assert cli.trainer.global_step == 2


def test_export_reloads_and_generates(tmp_path, tiny_model_dir):
    out = tmp_path / "export"
    cli = build(os.path.join(RECIPES, "grpo.yaml"), tiny_overrides(tmp_path, tiny_model_dir, export_dir=str(out)))
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    reloaded = AutoModelForCausalLM.from_pretrained(out)
    for name, p in cli.model.policy.state_dict().items():
        torch.testing.assert_close(reloaded.state_dict()[name], p)
    ids = torch.tensor([[1, 5, 6]])
    assert reloaded.generate(ids, max_new_tokens=3, do_sample=False).shape[1] >= 4


def test_validation_accuracy_is_the_share_of_correct_answers(tmp_path, tiny_model_dir):
    overlay = tiny_overrides(tmp_path, tiny_model_dir, reward={"class_path": "user_strategies.EvenAnswer"})
    cli = build(os.path.join(RECIPES, "grpo.yaml"), overlay, "--trainer.limit_val_batches", "1.0",
                "--data.task.init_args.num_val", "20", "--data.val_size", "20", "--data.val_batch_size", "8")
    results = cli.trainer.validate(cli.model, datamodule=cli.datamodule, verbose=False)
    rows = cli.datamodule.val_rows
    expected = sum(int(r["answer"]) % 2 == 0 for r in rows) / len(rows)
    assert len(rows) == 20 and 0 < expected < 1
    assert results[0]["val/accuracy"] == pytest.approx(expected)
    assert results[0]["val/response_length"] > 0


def test_evaluate_before_after_with_validation_during_fit(tmp_path, tiny_model_dir, capsys):
    """Validation before fit, during fit (every step) and after fit share the metrics' state; with sampled
    evaluation and ``also_greedy`` the printed table has the greedy accuracy, avg@k and pass@k."""
    import json

    from rllight.app.cli import main

    overlay = tiny_overrides(tmp_path, tiny_model_dir)
    main(["fit", "--config", os.path.join(RECIPES, "grpo.yaml"), "--config", overlay, "--evaluate_before_after",
          "true", "--trainer.limit_val_batches", "1.0", "--trainer.val_check_interval", "1",
          "--model.evaluation.n", "2", "--model.evaluation.temperature", "1.0", "--model.evaluation.also_greedy",
          "true", "--trainer.logger", "lightning.pytorch.loggers.CSVLogger", "--trainer.logger.save_dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert "accuracy_before=" in out and "accuracy_after=" in out
    summary = json.loads(next(tmp_path.rglob("eval_summary.json")).read_text())
    assert summary["num_val"] == 4 and 0.0 <= summary["accuracy_after"] <= 1.0
    table = summary["metrics"]
    assert set(table) >= {"greedy accuracy", "avg@1", "avg@2", "pass@2", "response_length"}
    assert table["greedy accuracy"]["after"] == summary["accuracy_after"]  # val/accuracy is the greedy one
    assert "greedy accuracy" in out and "pass@2" in out
    assert "paired over the same prompts" in out  # both evaluations asked the same rows
    assert all(table[label]["paired"] for label in ("greedy accuracy", "avg@2", "pass@2"))
    logged = (next(tmp_path.rglob("metrics.csv"))).read_text()
    assert logged.count("val/accuracy") >= 1


def test_evaluate_before_after_with_validation_off_says_so_plainly(tmp_path, tiny_model_dir, capsys):
    """The tiny overlay turns validation off (``trainer.limit_val_batches: 0``): no accuracies of None, no
    count of prompts that were never asked, no summary file; one line that says why."""
    from rllight.app.cli import main

    overlay = tiny_overrides(tmp_path, tiny_model_dir)
    main(["fit", "--config", os.path.join(RECIPES, "grpo.yaml"), "--config", overlay, "--evaluate_before_after",
          "true"])
    out = capsys.readouterr().out
    assert "accuracy_before=" not in out and "num_val=" not in out and "held-out prompts" not in out
    assert ("rllight: evaluate_before_after: no validation ran (trainer.limit_val_batches is 0), so there is nothing "
            "to compare") in out
    assert list(tmp_path.rglob("eval_summary.json")) == []


def test_profile_step_names_the_phases_and_padding_is_logged(tmp_path, tiny_model_dir):
    """``rllight.profiling.ProfileStep`` profiles one step: every phase of a GRPO step with the HF engine is
    found (the markers exist on the code path), the update's phases fit in the step, and the share of padded
    positions in the update is logged and within [0, 1)."""
    from rllight.profiling import ProfileStep

    cli = build(os.path.join(RECIPES, "grpo.yaml"), tiny_overrides(tmp_path, tiny_model_dir), "--trainer.max_steps", "4",
                "--model.batching.minibatch_size", "null")
    profiler = ProfileStep(step=1, out=str(tmp_path / "profile"))
    cli.trainer.callbacks.append(profiler)
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    phases = profiler.summary["phases"]
    expected = {"rllight.rollout", "rllight.generate.prefill", "rllight.generate.token", "rllight.update.forward",
                "rllight.update.backward", "rllight.update.optimizer"}
    assert expected <= set(phases)  # one update per rollout: no separate scoring pass
    assert phases["rllight.generate.prefill"]["calls"] == 1
    inside = sum(phases[k]["seconds"] for k in ("rllight.rollout", "rllight.update.forward",
                                                "rllight.update.backward", "rllight.update.optimizer"))
    assert inside <= profiler.summary["step_seconds"] * 1.05
    assert (tmp_path / "profile" / "profile.md").read_text().count("| rllight.") == len(phases)
    assert 0.0 <= float(cli.trainer.callback_metrics["train/perf/padding_share"]) < 1.0
