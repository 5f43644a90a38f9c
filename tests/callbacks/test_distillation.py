"""On-policy distillation: ``OnPolicyDistillation``'s advantage is the teacher's minus the student's log-prob of each
sampled token (by hand), ``TeacherLogprobs`` computes the teacher's log-probs as a plain forward pass does, a teacher
of another tokenizer is refused in one line before its weights load, a few steps bring the student's log-probs
towards the teacher's on held-out responses, and the teacher's log-probs are checked as the engine's are: a sample
with bad ones leaves the loss, counted, and a step with no usable one ends the run in one line, saved."""

from __future__ import annotations

import logging
import math
import os
import shutil
from types import SimpleNamespace

import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM, AutoTokenizer

from conftest import RECIPES
from helpers import build, tiny_overrides
from distillation_fixtures import held_out
from rllight.callbacks import RolloutContext, TeacherLogprobs
from rllight.callbacks.distillation import TEACHER_LOGPROBS, tokenizer_difference, unusable_logprobs
from rllight.app.cli import main
from rllight.stopping import clear_stop, ending
from rllight.errors import RecipeError
from rllight.models import HFModel
from rllight.strategies import GroupRelative, OnPolicyDistillation
from rllight.testing import build_tiny_model, warm_up
from rllight.types import Rollout

KEY = "trainer.callbacks: TeacherLogprobs.model"


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory) -> str:
    """A second tiny model with the same tokenizer (the BPE is trained on the same corpus), other weights (seed 1),
    fine-tuned a little on the arithmetic task's answers: a teacher whose distribution differs from the student's
    in a learnable way (short numbers, then the end of the turn)."""
    path = build_tiny_model(str(tmp_path_factory.mktemp("teacher") / "model"), seed=1)
    warm_up(path, steps=20)
    return path


def _rollout(prompts: list[list[int]], responses: list[list[int]], pad: int = 0) -> Rollout:
    """Prompts left-padded, responses right-padded, with their masks; two rows per group."""
    p, t = max(map(len, prompts)), max(map(len, responses))
    prompt_ids = torch.tensor([[pad] * (p - len(x)) + x for x in prompts])
    prompt_mask = torch.tensor([[0] * (p - len(x)) + [1] * len(x) for x in prompts])
    response_ids = torch.tensor([x + [pad] * (t - len(x)) for x in responses])
    response_mask = torch.tensor([[1] * len(x) + [0] * (t - len(x)) for x in responses])
    n = len(prompts)
    return Rollout(prompt_ids=prompt_ids, prompt_mask=prompt_mask, response_ids=response_ids,
                   response_mask=response_mask, sample_logprobs=torch.zeros(n, t), truncated=torch.zeros(n, dtype=bool),
                   group_ids=torch.arange(n) // 2, answers=[""] * n, texts=[""] * n)


# ------------------------------------------------------------------------------------------- the advantage
def _hand_rollout() -> Rollout:
    rollout = _rollout([[5, 6], [5, 6]], [[7, 8, 9], [7, 8]])  # row 1 has 2 response tokens, its third is padding
    rollout.sample_logprobs = torch.tensor([[-1.0, -2.0, -0.5], [-3.0, -1.0, 0.0]])
    rollout.extras[TEACHER_LOGPROBS] = torch.tensor([[-0.5, -2.5, -0.5], [-1.0, -4.0, 0.0]])
    rollout.rewards = torch.tensor([1.0, 0.0])
    return rollout


def test_the_advantage_is_the_teachers_minus_the_students_logprob_of_each_sampled_token():
    rollout = _hand_rollout()
    advantages, returns = OnPolicyDistillation()(rollout)
    # teacher - student: row 0: -0.5 - -1.0 = 0.5, -2.5 - -2.0 = -0.5, -0.5 - -0.5 = 0.0;
    #                    row 1: -1.0 - -3.0 = 2.0, -4.0 - -1.0 = -3.0, and 0 on the padding
    assert torch.equal(advantages, torch.tensor([[0.5, -0.5, 0.0], [2.0, -3.0, 0.0]]))
    assert returns is None
    # coef scales it: 2 x the above
    assert torch.equal(OnPolicyDistillation(coef=2.0)(rollout)[0], torch.tensor([[1.0, -1.0, 0.0], [4.0, -6.0, 0.0]]))


def test_the_students_logprobs_are_the_old_ones_when_the_step_computed_them():
    rollout = _hand_rollout()
    rollout.old_logprobs = torch.tensor([[-0.5, -2.5, -1.5], [-1.0, -4.0, -9.0]])  # = the teacher's, except one
    # teacher - old: 0, 0, -0.5 - -1.5 = 1.0; 0, 0, and the padding (-9 there) stays 0
    assert torch.equal(OnPolicyDistillation()(rollout)[0], torch.tensor([[0.0, 0.0, 1.0], [0.0, 0.0, 0.0]]))


def test_a_task_advantage_is_added_with_its_weight_and_its_needs_pass_through():
    rollout = _hand_rollout()
    # GroupRelative on rewards (1, 0) in one group: mean 0.5, unbiased std sqrt(0.5) = 0.7071: A = +-0.7071
    task = GroupRelative(eps=0.0)
    advantages, _ = OnPolicyDistillation(task=task, task_weight=0.5)(rollout)
    a = 0.5 ** 0.5
    expected = torch.tensor([[0.5 + 0.5 * a, -0.5 + 0.5 * a, 0.0 + 0.5 * a], [2.0 - 0.5 * a, -3.0 - 0.5 * a, 0.0]])
    torch.testing.assert_close(advantages, expected)
    assert torch.equal(OnPolicyDistillation(task=task, task_weight=0.0)(rollout)[0],
                       OnPolicyDistillation()(rollout)[0])
    assert OnPolicyDistillation(task=task).min_group_size == 2 and OnPolicyDistillation().min_group_size == 1
    assert not OnPolicyDistillation(task=task).needs_values


def test_without_the_teachers_logprobs_the_error_names_the_callback():
    rollout = _hand_rollout()
    del rollout.extras[TEACHER_LOGPROBS]
    with pytest.raises(RecipeError, match="rllight.callbacks.TeacherLogprobs") as err:
        OnPolicyDistillation()(rollout)
    assert "\n" not in str(err.value)


# ------------------------------------------------------------------------------------------- the callback
def _module(policy_dir: str, temperature: float = 1.0) -> SimpleNamespace:
    """What ``setup`` reads of the RLModule: the policy's source and the engine's temperature."""
    return SimpleNamespace(source=HFModel(policy_dir), rollout=SimpleNamespace(temperature=temperature))


_TRAINER = SimpleNamespace(strategy=SimpleNamespace(root_device=torch.device("cpu")))


def test_the_teachers_logprobs_are_a_plain_forward_pass_over_prompt_and_response(tiny_model_dir, teacher_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    prompts = [tokenizer("What is 3 + 4?")["input_ids"], tokenizer("1 + 2")["input_ids"],
               tokenizer("What is 12 + 9?")["input_ids"]]
    responses = [tokenizer(" 7")["input_ids"] + [tokenizer.eos_token_id], tokenizer("The answer is 3")["input_ids"],
                 tokenizer("21")["input_ids"]]
    rollout = _rollout(prompts, responses, pad=tokenizer.pad_token_id)
    callback = TeacherLogprobs(HFModel(teacher_dir), micro_batch_size=2)  # 3 rows: micro-batches of 2 and 1
    callback.setup(_TRAINER, _module(tiny_model_dir, temperature=0.7), "fit")
    assert callback.used_temperature == 0.7  # the engine's
    out = callback.on_rollout(None, RolloutContext(), rollout)  # the teacher loads at its first rollout
    assert not any(p.requires_grad for p in callback.teacher.parameters()) and not callback.teacher.training
    got = out.extras[TEACHER_LOGPROBS]
    assert got.shape == rollout.response_ids.shape
    teacher = AutoModelForCausalLM.from_pretrained(teacher_dir)
    for i, (prompt, response) in enumerate(zip(prompts, responses)):  # each row alone: no padding at all
        ids = torch.tensor([prompt + response])
        with torch.no_grad():
            logits = teacher(ids).logits[0, len(prompt) - 1 : -1] / 0.7  # position k predicts token k + 1
        expected = torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(response)[:, None])[:, 0]
        torch.testing.assert_close(got[i, : len(response)], expected, atol=1e-5, rtol=1e-5)
        assert torch.all(got[i, len(response):] == 0)  # zero outside the response mask


def _copy_with_tokenizer(src: str, dst: str, edit) -> str:
    shutil.copytree(src, dst)
    tokenizer = edit(AutoTokenizer.from_pretrained(src))
    tokenizer.save_pretrained(dst)
    return dst


def _with_extra_token(tokenizer):
    tokenizer.add_tokens(["<|tool|>"])
    return tokenizer


def _with_other_eos(tokenizer):
    tokenizer.eos_token = "<|im_start|>"
    return tokenizer


@pytest.mark.parametrize("edit,says", [(_with_extra_token, "vocabulary size 301 (teacher) vs 300 (policy)"),
                                       (_with_other_eos, "eos_token '<|im_start|>' (teacher) vs '<|im_end|>'")])
def test_a_teacher_of_another_tokenizer_is_refused_in_one_line_before_its_weights_load(
        tiny_model_dir, tmp_path, monkeypatch, edit, says):
    teacher = _copy_with_tokenizer(tiny_model_dir, str(tmp_path / "teacher"), edit)

    def no_weights(*args, **kwargs):
        raise AssertionError("the teacher's weights loaded before its tokenizer was checked")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", no_weights)
    callback = TeacherLogprobs(HFModel(teacher))
    with pytest.raises(RecipeError) as err:
        callback.setup(_TRAINER, _module(tiny_model_dir), "fit")
    message = str(err.value)
    assert "\n" not in message and message.startswith(KEY) and says in message, message
    assert callback.teacher is None


def test_the_command_line_refuses_it_in_one_line_before_any_model_loads(tiny_model_dir, tmp_path, monkeypatch, capsys):
    teacher = _copy_with_tokenizer(tiny_model_dir, str(tmp_path / "teacher"), _with_extra_token)

    def no_weights(*args, **kwargs):
        raise AssertionError("a model loaded before the teacher's tokenizer was checked")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", no_weights)
    callbacks = tmp_path / "teacher.yaml"
    callbacks.write_text(yaml.safe_dump({"trainer": {"callbacks": [
        {"class_path": "rllight.callbacks.TeacherLogprobs", "init_args": {
            "model": {"class_path": "rllight.models.HFModel", "init_args": {"path": teacher}}}}]}}))
    with pytest.raises(SystemExit) as exc:
        main(["fit", "--config", os.path.join(RECIPES, "distill-quickstart.yaml"), "--config",
              tiny_overrides(tmp_path, tiny_model_dir), "--config", str(callbacks)])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and KEY in err and "vocabulary size 301 (teacher) vs 300 (policy)" in err, err


def test_the_same_tokenizer_passes_and_a_missing_teacher_folder_names_the_callbacks_key(tiny_model_dir, teacher_dir):
    same = tokenizer_difference(AutoTokenizer.from_pretrained(tiny_model_dir), AutoTokenizer.from_pretrained(teacher_dir))
    assert same is None
    with pytest.raises(RecipeError, match=f"^{KEY}.init_args.path: folder 'no/such/folder/x'"):
        TeacherLogprobs(HFModel("no/such/folder/x")).check_tokenizer(HFModel(tiny_model_dir))


def test_the_constructor_is_cheap_and_checks_its_settings():
    TeacherLogprobs(HFModel("runs/not-made-yet/model"))  # nothing loads: a recipe parses before the teacher exists
    with pytest.raises(RecipeError, match=r"^TeacherLogprobs\.micro_batch_size must be an integer >= 1, got 0$"):
        TeacherLogprobs(HFModel("x"), micro_batch_size=0)
    with pytest.raises(RecipeError, match=r"^TeacherLogprobs\.temperature must be a number > 0 or null, got 0\.0$"):
        TeacherLogprobs(HFModel("x"), temperature=0.0)


# ------------------------------------------------------------------------------------------- a few steps
@torch.no_grad()
def _logprobs(model: torch.nn.Module, rows: list[tuple[list[int], list[int]]]) -> torch.Tensor:
    """The log-probs of every response token of ``rows``, concatenated: one forward pass per row, no padding."""
    out = []
    for prompt, response in rows:
        logits = model(torch.tensor([prompt + response])).logits[0, len(prompt) - 1 : -1].float()
        out.append(torch.log_softmax(logits, -1).gather(-1, torch.tensor(response)[:, None])[:, 0])
    return torch.cat(out)


def test_a_few_steps_bring_the_students_logprobs_towards_the_teachers(tiny_model_dir, teacher_dir, tmp_path):
    rows = held_out(tiny_model_dir)
    teacher = _logprobs(AutoModelForCausalLM.from_pretrained(teacher_dir), rows)
    gap_before = (teacher - _logprobs(AutoModelForCausalLM.from_pretrained(tiny_model_dir), rows)).abs().mean()
    # The recipe on the tiny models: 2 prompts x 8 responses a step, one update each (so the student's log-probs are
    # the engine's), 10 steps at lr 3e-2 (the policy gradient's steps are small: at 1e-2 the gap closes slowly).
    overlay = tiny_overrides(tmp_path, tiny_model_dir, optimizer={"class_path": "torch.optim.AdamW",
                                                                  "init_args": {"lr": 3e-2, "weight_decay": 0.0}})
    callbacks = tmp_path / "teacher.yaml"
    callbacks.write_text(yaml.safe_dump({"trainer": {"max_steps": 10, "callbacks": [
        {"class_path": "rllight.callbacks.TeacherLogprobs", "init_args": {
            "model": {"class_path": "rllight.models.HFModel", "init_args": {"path": teacher_dir}}}}]}}))
    cli = build(os.path.join(RECIPES, "distill-quickstart.yaml"), overlay, str(callbacks))
    assert cli.model.advantage.task_weight == 0.0  # pure distillation: the reward does not steer it
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    assert cli.trainer.global_step == 10
    assert "train/distill/reverse_kl" in cli.trainer.callback_metrics  # the gap, logged each step
    gap_after = (teacher - _logprobs(cli.model.policy.eval(), rows)).abs().mean()
    # Mean |teacher - student| over the held-out tokens: it must shrink by a fifth at least (the student moving
    # away from the teacher, or not at all, fails).
    assert gap_after < 0.8 * gap_before, (float(gap_before), float(gap_after))


def test_a_missing_teacher_is_one_line_before_the_evaluation_that_opens_a_run(tiny_model_dir, tmp_path, monkeypatch,
                                                                              capsys):
    """``evaluate_before_after`` evaluates the policy before training (minutes on a real model): the teacher's folder
    is checked before it (``check_before_fit``), and before any model loads."""

    def no_weights(*args, **kwargs):
        raise AssertionError("a model loaded before the teacher's folder was checked")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", no_weights)
    missing = tmp_path / "teacher.yaml"
    missing.write_text(yaml.safe_dump({"evaluate_before_after": True, "trainer": {"limit_val_batches": 1, "callbacks": [
        {"class_path": "rllight.callbacks.TeacherLogprobs", "init_args": {
            "model": {"class_path": "rllight.models.HFModel", "init_args": {"path": str(tmp_path / "none")}}}}]}}))
    with pytest.raises(SystemExit) as exc:
        main(["fit", "--config", os.path.join(RECIPES, "distill-quickstart.yaml"), "--config",
              tiny_overrides(tmp_path, tiny_model_dir), "--config", str(missing)])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"{KEY}.init_args.path: folder" in err and "does not exist" in err, err


def test_the_teacher_student_gap_is_logged_per_response_token():
    """``distill/reverse_kl`` is the mean over response tokens of the sampler's minus the teacher's log-prob, and
    ``distill/teacher_logprob`` the teacher's mean: padding and prompt positions do not count."""
    from rllight.callbacks.distillation import gap_metrics

    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    rollout = SimpleNamespace(response_mask=mask, sample_logprobs=torch.tensor([[-1.0, -2.0, -9.0], [-0.5, -9.0, -9.0]]))
    teacher = torch.tensor([[-0.5, -1.0, 0.0], [-1.5, 0.0, 0.0]])
    out = gap_metrics(teacher, rollout)
    assert out["distill/teacher_logprob"] == pytest.approx((-0.5 - 1.0 - 1.5) / 3)
    assert out["distill/reverse_kl"] == pytest.approx(((-1.0 + 0.5) + (-2.0 + 1.0) + (-0.5 + 1.5)) / 3)


# ------------------------------------------------------------------------------------------- bad teacher log-probs
def test_unusable_logprobs_says_what_is_wrong_as_the_engine_check_does():
    every = torch.ones(3, dtype=torch.bool)
    assert unusable_logprobs([-0.5, -1.0, -2.0], every) is None
    assert unusable_logprobs([-0.5, 5e-5, -2.0], every) is None  # float32 rounding above 0: under the slack, 1e-4
    assert unusable_logprobs([-0.5, 5.0, -2.0], every) == ("log-probs above 0 (largest 5): a log-probability is "
                                                           "at most 0")
    assert unusable_logprobs([-0.5, math.nan, -math.inf], every) == ("2 log-probs that are not finite (NaN or "
                                                                     "infinite)")
    assert unusable_logprobs([-0.5, -1.0], every) == "2 log-probs for 3 response tokens"
    assert unusable_logprobs([[-0.5], [-1.0], [-2.0]], every) == "3 log-probs for 3 response tokens"
    assert unusable_logprobs([-0.5, None, -2.0], every).startswith("not a list of numbers")
    # A token out of the response mask (a loss mask's) is not read, as the engine check does not read padding:
    assert unusable_logprobs([-0.5, math.nan, 7.0], torch.tensor([True, False, False])) is None


def _poisoned(forward, value: float | str, rows: set[int] | None = None):
    """``forward`` (the teacher's ``forward``: its log-probs of each row) answering ``value`` at every token of
    ``rows`` (None: of every row), or with ``value`` "short" one log-prob short."""
    def answer(*args):
        out = forward(*args)
        return [(v[:-1] if value == "short" else [value] * len(v)) if rows is None or k in rows else v
                for k, v in enumerate(out)]
    return answer


BAD = [(5.0, "log-probs above 0 (largest 5)"), (math.nan, "log-probs that are not finite (NaN or infinite)"),
       (-math.inf, "log-probs that are not finite (NaN or infinite)"), ("short", "2 log-probs for 3 response tokens")]


@pytest.mark.parametrize("value,says", BAD, ids=["plus5", "nan", "minus_inf", "short"])
def test_a_sample_with_bad_teacher_logprobs_leaves_the_loss_counted_with_one_warning(tiny_model_dir, teacher_dir,
                                                                                    value, says, caplog):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    prompts = [tokenizer("What is 3 + 4?")["input_ids"], tokenizer("1 + 2")["input_ids"],
               tokenizer("What is 12 + 9?")["input_ids"]]
    responses = [tokenizer(" 7")["input_ids"] + [tokenizer.eos_token_id], tokenizer("8 8")["input_ids"],
                 tokenizer("21")["input_ids"]]
    assert len(responses[1]) == 3  # the poisoned row: "3 log-probs" below
    callback = TeacherLogprobs(HFModel(teacher_dir))
    callback.setup(_TRAINER, _module(tiny_model_dir), "fit")
    clean = callback.on_rollout(None, RolloutContext(), _rollout(prompts, responses, pad=tokenizer.pad_token_id))
    callback.forward = _poisoned(callback.forward, value, rows={1})
    try:
        with caplog.at_level(logging.WARNING):
            out = callback.on_rollout(None, RolloutContext(), _rollout(prompts, responses, pad=tokenizer.pad_token_id))
        assert ending() is None  # two samples of three are usable: the run goes on
    finally:
        clear_stop()
    assert out.response_mask[1].sum() == 0 and torch.equal(out.response_mask[[0, 2]], clean.response_mask[[0, 2]])
    got = out.extras[TEACHER_LOGPROBS]
    assert torch.all(got[1] == 0) and torch.equal(got[[0, 2]], clean.extras[TEACHER_LOGPROBS][[0, 2]])
    assert out.extras["distill/bad_teacher_samples"] == 1.0 and clean.extras["distill/bad_teacher_samples"] == 0.0
    # The gap is measured on the usable samples only (a NaN there would make it NaN)
    assert math.isfinite(out.extras["distill/reverse_kl"]) and out.extras["distill/teacher_logprob"] <= 0
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and "\n" not in warned[0], warned
    assert warned[0].startswith(f"trainer.callbacks: TeacherLogprobs: the teacher {teacher_dir} gave log-probs that "
                                "cannot be trained on for 1 of 3 samples (first: sample 1: "), warned[0]
    assert says in warned[0] and "train/distill/bad_teacher_samples" in warned[0]


def test_a_bad_value_out_of_the_response_mask_is_not_read_nor_kept():
    """A token a loss mask took out of the response (not its last) is still sent and scored; what the teacher says of
    it is not checked and not kept (a NaN there must not reach the advantage as NaN x 0)."""
    rollout = _rollout([[5, 6], [5, 6]], [[7, 8, 9], [7, 8, 9]])
    rollout.response_mask[0, 1] = 0
    callback = TeacherLogprobs(HFModel("not/loaded"))
    callback.forward = lambda rows: [[-1.0, math.nan, -2.0], [-1.0, -0.5, -2.0]]  # as a teacher's forward answers
    out = callback.on_rollout(None, RolloutContext(), rollout)
    assert torch.equal(out.extras[TEACHER_LOGPROBS], torch.tensor([[-1.0, 0.0, -2.0], [-1.0, -0.5, -2.0]]))
    assert out.extras["distill/bad_teacher_samples"] == 0.0 and out.response_mask[0].tolist() == [1, 0, 1]


def test_answers_for_fewer_samples_than_asked_leave_none_usable_and_end_the_run_after_the_step():
    rollout = _rollout([[5, 6], [5, 6]], [[7, 8, 9], [7, 8]])
    callback = TeacherLogprobs(HFModel("teachers/t1"))
    callback.forward = lambda rows: [[-1.0, -0.5, -2.0]]  # one answer for two samples
    try:
        out = callback.on_rollout(None, RolloutContext(), rollout)
        reason = ending()
    finally:
        clear_stop()
    assert out.response_mask.sum() == 0 and out.extras["distill/bad_teacher_samples"] == 2.0
    assert reason == ("trainer.callbacks: TeacherLogprobs: the teacher teachers/t1 gave no usable log-probs for any of "
                      "the step's 2 samples (first: sample 0: 1 answer(s) for 2 samples); check the teacher's weights "
                      "and, at a server, that it serves the teacher and answers log-probs (its placement's protocol)")


def _fit(*configs: str, ckpt_path: str | None = None):
    args = ["fit"] + [arg for config in configs for arg in ("--config", config)]
    main(args + (["--ckpt_path", ckpt_path] if ckpt_path else []))


@pytest.mark.parametrize("value,says", BAD[:3], ids=["plus5", "nan", "minus_inf"])
def test_a_teacher_with_no_usable_logprob_ends_the_run_in_one_line_saved_and_resumable(
        tiny_model_dir, teacher_dir, tmp_path, monkeypatch, capsys, value, says):
    """Every sample's teacher log-probs bad (a broken teacher, not an unlucky sample): the step trains on nothing,
    the run ends after it with one line naming the teacher, saved; the same command with the checkpoint resumes it
    once the teacher is mended."""
    monkeypatch.setattr(TeacherLogprobs, "forward", _poisoned(TeacherLogprobs.forward, value))
    callbacks = tmp_path / "teacher.yaml"
    callbacks.write_text(yaml.safe_dump({"trainer": {"enable_checkpointing": True, "callbacks": [
        {"class_path": "rllight.callbacks.TeacherLogprobs", "init_args": {
            "model": {"class_path": "rllight.models.HFModel", "init_args": {"path": teacher_dir}}}}]}}))
    configs = (os.path.join(RECIPES, "distill-quickstart.yaml"), tiny_overrides(tmp_path, tiny_model_dir),
               str(callbacks))
    with pytest.raises(SystemExit) as exc:
        _fit(*configs)
    assert exc.value.code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("rllight: error:")]
    assert len(errors) == 1, errors
    assert errors[0].startswith(f"rllight: error: trainer.callbacks: TeacherLogprobs: the teacher {teacher_dir} gave "
                                "no usable log-probs for any of the step's 16 samples (first: sample 0: "), errors[0]
    assert says in errors[0] and "; RL step 1 (0 optimizer updates) is saved: resume with: " in errors[0]
    path = errors[0].rsplit("--ckpt_path ", 1)[1]
    assert path == str(tmp_path / "checkpoints" / "stopped-step=1.ckpt")
    monkeypatch.undo()  # the teacher mended: the run resumes from the checkpoint and trains
    _fit(*configs, ckpt_path=path)
    state = torch.load(str(tmp_path / "checkpoints" / "last.ckpt"), weights_only=True)
    assert state["global_step"] == 2 and state["RLDataModule"] == {"batches_trained": 3}
