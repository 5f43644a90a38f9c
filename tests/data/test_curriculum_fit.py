"""Curricula in a fit on the tiny model: difficulty pools hear every group dynamic sampling generates (the dropped
ones too) at its share of correct responses, their metrics reach the step, a curriculum refuses rollouts generated
ahead, and on 2 DDP processes a run resumed from a checkpoint draws exactly the prompts the uninterrupted run
draws, ending in the same curriculum state: with difficulty pools, and with a rule written here (``HardestFirst``,
named by ``class_path: test_curriculum_fit.HardestFirst`` as a user's own rule would be)."""

import json
import os

import pytest
import torch
import yaml

from helpers import RECIPES, build, fit_in_child, fit_recording_rollouts, tiny_overrides
from rllight.app.cli import main
from rllight.data import Curriculum

CURRICULUM = {"class_path": "rllight.data.DifficultyPools",
              "init_args": {"max_pass_rate": 0.9, "retire_after": 1, "window": 2, "max_draws": 12, "profile": 2,
                            "profile_batch": 8}}
REWARD = {"class_path": "user_strategies.DigitReward", "init_args": {"correct": 0.15}}  # correct now and then


class HardestFirst(Curriculum):
    """A curriculum rule of one's own: each source's prompts by their latest pass rate, the lowest first; the
    prompts not seen yet before any, the lowest row first."""

    def __init__(self, max_draws: int | None = None, seed: int | None = None):
        super().__init__(max_draws=max_draws, seed=seed)
        self.rates: dict[int, float] = {}  # row index -> its latest pass rate

    def choose(self, source, candidates, generator):
        return sorted(candidates, key=lambda i: self.rates.get(i, -1.0))

    def observe(self, pass_rates):
        self.rates.update(pass_rates)

    def rule_state_dict(self):
        return {"rates": dict(self.rates)}

    def load_rule_state_dict(self, state):
        self.rates = {int(i): float(r) for i, r in state["rates"].items()}


def _curriculum_overlay(tmp_path, **init_args):
    path = tmp_path / "curriculum.yaml"
    curriculum = {**CURRICULUM, "init_args": {**CURRICULUM["init_args"], **init_args}}
    path.write_text(yaml.safe_dump({"data": {"batch_size": 4, "curriculum": curriculum}}))
    return str(path)


def test_the_curriculum_hears_every_generated_group_and_logs_its_step(tmp_path, tiny_model_dir):
    sampler = {"class_path": "rllight.strategies.DynamicSampling",
               "init_args": {"group_size": 4, "max_rounds": 3, "metric": "correct"}}
    overlay = tiny_overrides(tmp_path, tiny_model_dir, sampler=sampler, reward=REWARD)
    cli = build(os.path.join(RECIPES, "grpo.yaml"), overlay,
                _curriculum_overlay(tmp_path), "--model.batching.minibatch_size", "null")
    curriculum = cli.datamodule.curriculum
    heard, hear = [], curriculum.hear

    def listen(rows, rates):
        heard.append([(row["prompt"], rate) for row, rate in zip(rows, rates)])
        hear(rows, rates)

    curriculum.hear = listen
    rollouts = fit_recording_rollouts(cli)
    assert cli.model.prompt_stream is curriculum and curriculum.steps == len(rollouts) == 2 and curriculum.profiled
    for rollout in rollouts:
        extras = rollout.extras
        groups = extras["sampling/groups_drawn"]
        assert extras["curriculum/draws"] == groups <= 12  # every prompt drawn was generated: batch and rounds
        assert sum(extras[f"curriculum/arithmetic/pool/{p}"] for p in ("hard", "normal", "easy")) + \
            extras["curriculum/arithmetic/retired"] == 16
        # each kept group's share of correct responses is a rate the curriculum heard
        kept = [rollout.correct[rollout.group_ids == g].mean().item() for g in rollout.group_ids.unique().tolist()]
        assert all(any(abs(k - r) < 1e-6 for step in heard for _, r in step) for k in kept)
    assert sum(len(step) for step in heard) == sum(r.extras["sampling/groups_drawn"] for r in rollouts)
    # what it heard is its state: each prompt's latest rates (the profile's first), and those solved retired
    index = {row["prompt"]: i for i, row in enumerate(curriculum.rows)}
    latest = {}
    for step in heard:
        for prompt, rate in step:
            latest.setdefault(index[prompt], []).append(rate)
    for i, rates in latest.items():
        assert curriculum.history[i][-len(rates[-2:]):] == rates[-2:]
        assert (i in curriculum.retired) == (1.0 in rates or 1.0 in curriculum.history[i])


def test_a_curriculum_with_rollouts_generated_ahead_is_one_line(tmp_path, tiny_model_dir, capsys):
    engine = {"class_path": "rllight.rollout.worker.ProcessEngine",
              "init_args": {"engine": {"class_path": "rllight.rollout.HFEngine"}, "max_new_tokens": 6,
                            "max_staleness": 1}}
    overlay = tiny_overrides(tmp_path, tiny_model_dir, rollout=engine)
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", os.path.join(RECIPES, "grpo.yaml"), "--config", overlay, "--config",
              _curriculum_overlay(tmp_path)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err
    line = err.splitlines()[-1]
    assert "data.curriculum chooses each step's prompts" in line and "max_staleness to 0" in line


def test_a_resume_after_the_training_file_changed_is_refused_or_resets_the_pools(tmp_path, tiny_model_dir, capsys,
                                                                                caplog):
    """The same path, the same row count, two answers swapped: the checkpoint's pass rates would apply to other rows
    by index. The resume is one line naming the source, its file and the option (exit 2); with
    ``reset_on_changed_rows: true`` it resumes, the pools start afresh, and a warning says so."""
    import logging

    data = tmp_path / "train.jsonl"
    lines = [f'{{"prompt": "What is {i} + 1?", "answer": "{i + 1}"}}\n' for i in range(8)]
    data.write_text("".join(lines))
    pools = {"class_path": "rllight.data.DifficultyPools", "init_args": {"retire_after": 1}}
    args = ["fit", "--config", os.path.join(RECIPES, "grpo.yaml"), "--config",
            tiny_overrides(tmp_path, tiny_model_dir, reward=REWARD), "--data.train_files", f"[{data}]",
            "--data.curriculum", json.dumps(pools), "--trainer.enable_checkpointing", "true"]
    main([*args, "--trainer.max_steps", "2"])
    lines[1], lines[2] = lines[1].replace('"2"', '"3"'), lines[2].replace('"3"', '"2"')
    data.write_text("".join(lines))
    with pytest.raises(SystemExit) as exit_info:
        main([*args, "--trainer.max_steps", "3", "--ckpt_path", "last"])
    assert exit_info.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last == ("rllight: error: --ckpt_path: the training rows differ from those the checkpoint's data.curriculum "
                    f"learnt on by row index (data source 'train' from {data}: 8 rows then, 8 now, other text, "
                    "answers or order); resume with the same training rows, or set "
                    "data.curriculum.init_args.reset_on_changed_rows: true to start the curriculum afresh on these")
    with caplog.at_level(logging.WARNING):
        main([*args, "--trainer.max_steps", "3", "--ckpt_path", "last",
              "--data.curriculum.init_args.reset_on_changed_rows", "true"])
    assert any("it starts afresh on them" in r.getMessage() for r in caplog.records)


def _whole_and_resumed(tmp_path, tiny_model_dir, curriculum: dict, *more: str) -> tuple[list, list]:
    """A 4-step fit on 2 DDP processes over two data sources (left: 10 rows, right: 6) with ``curriculum``, and the
    same fit resumed from its checkpoint at step 2: each run's ``DumpState`` record of each rank."""
    rows = tmp_path / "two.jsonl"
    rows.write_text("".join(f'{{"prompt": "What is {i} + {s[0]}?", "answer": "{s}-{i}", "data_source": "{s}"}}\n'
                            for s, n in (("left", 10), ("right", 6)) for i in range(n)))
    overlay = tmp_path / "curriculum.yaml"
    overlay.write_text(yaml.safe_dump({"data": {"batch_size": 4, "curriculum": curriculum}}))
    args = ["--config", tiny_overrides(tmp_path, tiny_model_dir, reward=REWARD), "--config", str(overlay),
            "--data.train_files", f"[{rows}]", *more,
            "--model.batching.minibatch_size", "null", "--trainer.strategy", "ddp", "--trainer.devices", "2",
            "--trainer.accelerator", "cpu", "--trainer.callbacks+", "user_strategies.DumpState",
            "--trainer.enable_checkpointing", "true",
            "--trainer.callbacks+", "lightning.pytorch.callbacks.ModelCheckpoint",
            "--trainer.callbacks.dirpath", str(tmp_path / "ckpt"), "--trainer.callbacks.every_n_train_steps", "2",
            "--trainer.callbacks.save_top_k", "-1"]
    whole = fit_in_child("grpo.yaml", *args, "--trainer.max_steps", "4", timeout=900,
                         RLLIGHT_TEST_DUMP=str(tmp_path / "whole{rank}.pt"))
    assert whole.returncode == 0, whole.stderr[-4000:]
    checkpoint = next((tmp_path / "ckpt").glob("*step=2.ckpt"))
    resumed = fit_in_child("grpo.yaml", *args, "--trainer.max_steps", "4", "--ckpt_path", str(checkpoint),
                           "--trainer.callbacks.dirpath", str(tmp_path / "ckpt2"), timeout=900,
                           RLLIGHT_TEST_DUMP=str(tmp_path / "resumed{rank}.pt"))
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    w, r = ([torch.load(tmp_path / f"{name}{rank}.pt", weights_only=True) for rank in (0, 1)]
            for name in ("whole", "resumed"))
    for rank in (0, 1):
        assert len(w[rank]["step_prompts"]) == 4 and len(r[rank]["step_prompts"]) == 2
        assert r[rank]["step_prompts"] == w[rank]["step_prompts"][2:], rank
        assert r[rank]["prompt_source"] == w[rank]["prompt_source"], rank
    assert w[0]["prompt_source"] == w[1]["prompt_source"]  # one state on both processes
    assert w[0]["step_prompts"] != w[1]["step_prompts"]  # each its own share of the steps' prompts
    return w, r


@pytest.mark.slow
def test_ddp_a_resumed_curriculum_and_mix_draw_what_the_uninterrupted_run_draws(tmp_path, tiny_model_dir):
    """Two data sources mixed 3 : 1 and chosen by difficulty pools, on 2 processes: every step's global batch holds
    3 prompts of one and 1 of the other, and a run resumed from the checkpoint at step 2 draws each process's
    prompts of steps 2 and 3 as the uninterrupted run did, ending in the same curriculum state."""
    curriculum = {**CURRICULUM, "init_args": {**CURRICULUM["init_args"], "max_draws": None}}
    w, _ = _whole_and_resumed(tmp_path, tiny_model_dir, curriculum, "--data.mix",
                              "{class_path: rllight.data.SourceMix, init_args: {weights: {left: 3, right: 1}}}")
    assert len(w[0]["prompt_source"]["history"]) == 16  # profiled: every prompt has a pass rate
    for step in range(4):  # the mix's 3 : 1 in every global batch, the pools choosing within each source
        answers = {a for rank in (0, 1) for a in w[rank]["step_answers"][step]}
        assert sorted(a.split("-")[0] for a in answers) == ["left", "left", "left", "right"], step


@pytest.mark.slow
def test_ddp_a_rule_of_ones_own_resumes_exactly(tmp_path, tiny_model_dir):
    """``HardestFirst``, a rule of this module, on 2 processes without a mix: the base class counts each step's
    sources (the seeded order's), draws alike on both and deals the shares; its state (every prompt's pass rate)
    comes back with the checkpoint, so the resumed steps 2 and 3 take the prompts not seen yet, as the
    uninterrupted run does. 16 rows, 4 steps of 4: each row once."""
    w, _ = _whole_and_resumed(tmp_path, tiny_model_dir, {"class_path": "test_curriculum_fit.HardestFirst"})
    steps = [{a for rank in (0, 1) for a in w[rank]["step_answers"][step]} for step in range(4)]
    assert all(len(prompts) == 4 for prompts in steps) and len(set().union(*steps)) == 16  # every prompt once
    for source, size in (("left", 10), ("right", 6)):  # step by step, the lowest rows not seen yet
        rows = [sorted(int(a.split("-")[1]) for a in prompts if a.startswith(source)) for prompts in steps]
        assert [i for step in rows for i in step] == list(range(size)), rows
    assert len(w[0]["prompt_source"]["rates"]) == 16 and w[0]["prompt_source"]["steps"] == 4
