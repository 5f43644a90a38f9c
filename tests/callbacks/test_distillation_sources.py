"""Teachers by data source: ``TeacherLogprobs(teachers={source: Teacher(...)})`` scores each response with the teacher
of its row's ``data_source`` (its log-probs and its top-k distribution equal that teacher's, computed directly), the
default ``model`` takes the other sources, a source without a teacher and a rollout that carries no sources are one
line, a bad answer names its teacher, and a recipe with teachers parses."""

from __future__ import annotations

import logging
import math
import os
from types import SimpleNamespace

import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM, AutoTokenizer

from conftest import RECIPES
from helpers import build, tiny_overrides
from rllight.callbacks import RolloutContext, TeacherLogprobs
from rllight.callbacks.distillation import (DATA_SOURCE, TEACHER_LOGPROBS, TEACHER_TOP_IDS, TEACHER_TOP_LOGPROBS,
                                            Teacher)
from rllight.errors import RecipeError
from rllight.models import HFModel
from rllight.stopping import clear_stop, ending
from rllight.terms import TeacherDivergence
from rllight.testing import build_tiny_model
from rllight.types import Rollout

_TRAINER = SimpleNamespace(strategy=SimpleNamespace(root_device=torch.device("cpu")))
SOURCES = ["gsm8k", "math", "gsm8k", "other"]


@pytest.fixture(scope="module")
def teachers(tmp_path_factory) -> dict[str, str]:
    """Two tiny teachers of the student's tokenizer with other weights (seeds 1 and 2)."""
    root = tmp_path_factory.mktemp("source_teachers")
    return {"gsm8k": build_tiny_model(str(root / "gsm8k"), seed=1),
            "math": build_tiny_model(str(root / "math"), seed=2)}


def _module(policy_dir: str, top_k: int | None) -> SimpleNamespace:
    """What ``setup`` reads of the RLModule (with ``top_k``, a ``TeacherDivergence`` in the loss terms)."""
    return SimpleNamespace(source=HFModel(policy_dir), rollout=SimpleNamespace(temperature=1.0),
                           loss_terms=[TeacherDivergence()] if top_k is not None else [], scoring=SimpleNamespace())


def _rollout(policy_dir: str, sources: list | None = SOURCES) -> tuple[Rollout, list, list]:
    """Four rows (prompts left-padded, responses right-padded), each of the data source ``sources`` says."""
    tokenizer = AutoTokenizer.from_pretrained(policy_dir)
    prompts = [tokenizer(text)["input_ids"] for text in ("What is 3 + 4?", "1 + 2", "What is 12 + 9?", "7 + 1")]
    responses = [tokenizer(text)["input_ids"] for text in (" 7", "The answer is 3", "21", "8 8")]
    pad, p, t, n = tokenizer.pad_token_id, max(map(len, prompts)), max(map(len, responses)), len(prompts)
    rollout = Rollout(prompt_ids=torch.tensor([[pad] * (p - len(x)) + x for x in prompts]),
                      prompt_mask=torch.tensor([[0] * (p - len(x)) + [1] * len(x) for x in prompts]),
                      response_ids=torch.tensor([x + [pad] * (t - len(x)) for x in responses]),
                      response_mask=torch.tensor([[1] * len(x) + [0] * (t - len(x)) for x in responses]),
                      sample_logprobs=torch.zeros(n, t), truncated=torch.zeros(n, dtype=torch.bool),
                      group_ids=torch.arange(n), answers=[""] * n, texts=[""] * n)
    if sources is not None:
        rollout.extras[DATA_SOURCE] = list(sources)
    return rollout, prompts, responses


@torch.no_grad()
def _direct(model_dir: str, prompt: list[int], response: list[int]) -> torch.Tensor:
    """A teacher's log-softmax at each response position of one unpadded row, at temperature 1: shape (n, V)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    return torch.log_softmax(model(torch.tensor([prompt + response])).logits[0, len(prompt) - 1 : -1].float(), -1)


def _callback(tiny_model_dir: str, teachers: dict[str, str], default: str | None, top_k: int | None = None):
    callback = TeacherLogprobs(None if default is None else HFModel(default), micro_batch_size=2, top_k=top_k,
                               teachers={s: Teacher(HFModel(path)) for s, path in teachers.items()})
    callback.setup(_TRAINER, _module(tiny_model_dir, top_k), "fit")
    return callback


@pytest.mark.parametrize("top_k", [None, 4])
def test_each_row_is_scored_by_the_teacher_of_its_data_source(tiny_model_dir, teachers, top_k):
    # gsm8k's and math's rows by their own teachers, "other" (no teacher of its own) by the default: math's model
    callback = _callback(tiny_model_dir, teachers, default=teachers["math"], top_k=top_k)
    rollout, prompts, responses = _rollout(tiny_model_dir)
    out = callback.on_rollout(None, RolloutContext(), rollout)
    got = out.extras[TEACHER_LOGPROBS]
    whose = [teachers["gsm8k"], teachers["math"], teachers["gsm8k"], teachers["math"]]
    for i, (prompt, response) in enumerate(zip(prompts, responses)):
        n = len(response)
        full = _direct(whose[i], prompt, response)
        other = _direct(teachers["math" if whose[i] == teachers["gsm8k"] else "gsm8k"], prompt, response)
        own = full.gather(-1, torch.tensor(response)[:, None])[:, 0]
        torch.testing.assert_close(got[i, :n], own, atol=1e-5, rtol=1e-5)
        assert (got[i, :n] - other.gather(-1, torch.tensor(response)[:, None])[:, 0]).abs().max() > 1e-2
        assert torch.all(got[i, n:] == 0)
        if top_k:
            top = full.topk(top_k, -1)
            assert torch.equal(out.extras[TEACHER_TOP_IDS][i, :n].long(), top.indices)
            torch.testing.assert_close(out.extras[TEACHER_TOP_LOGPROBS][i, :n], top.values, atol=1e-5, rtol=1e-5)
    assert (TEACHER_TOP_LOGPROBS in out.extras) == (top_k is not None)
    assert out.extras["distill/bad_teacher_samples"] == 0.0


def test_a_source_without_a_teacher_and_a_rollout_without_sources_are_one_line(tiny_model_dir, teachers):
    callback = _callback(tiny_model_dir, teachers, default=None)  # no default teacher: "other" has none
    with pytest.raises(RecipeError) as err:
        callback.on_rollout(None, RolloutContext(), _rollout(tiny_model_dir)[0])
    assert str(err.value) == ("trainer.callbacks: TeacherLogprobs: no teacher for data_source 'other' (teachers has "
                              "'gsm8k', 'math'); add it under trainer.callbacks: TeacherLogprobs.teachers or give the "
                              "default teacher (model)")
    with pytest.raises(RecipeError, match=r"^trainer.callbacks: TeacherLogprobs.teachers: the rollout carries no "
                                          r"data_source per response"):
        callback.on_rollout(None, RolloutContext(), _rollout(tiny_model_dir, sources=None)[0])
    empty = callback.on_rollout(None, RolloutContext(), _rollout(tiny_model_dir, sources=None)[0].select([]))
    assert empty.extras[TEACHER_LOGPROBS].shape[0] == 0  # an empty rollout (no sources, no rows) is no error
    with pytest.raises(RecipeError, match=r"^trainer.callbacks: TeacherLogprobs: give the teacher \(model\) or a "
                                          r"teacher per data source \(teachers\)$"):
        TeacherLogprobs()


def test_a_bad_answer_names_the_teacher_of_its_row(tiny_model_dir, teachers, caplog):
    callback = _callback(tiny_model_dir, teachers, default=teachers["math"])
    math_teacher = callback.teachers["math"]
    math_teacher.forward = lambda rows: [[math.nan] * len(r) for _, r in rows]  # math's teacher: NaN everywhere
    try:
        with caplog.at_level(logging.WARNING):
            rollout, _, responses = _rollout(tiny_model_dir)
            out = callback.on_rollout(None, RolloutContext(), rollout)
        assert ending() is None  # the other rows are usable (row 3, "other", is the default's: the callback's own)
    finally:
        clear_stop()
    assert out.response_mask[1].sum() == 0 and out.response_mask[[0, 2, 3]].sum(-1).min() > 0
    (warned,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert (f"the teachers gave log-probs that cannot be trained on for 1 of 4 samples (first: sample 1: the teacher "
            f"{teachers['math']}: {len(responses[1])} log-probs that are not finite") in warned, warned


def test_a_recipe_with_teachers_by_source_parses_and_checks_each_teachers_tokenizer(tiny_model_dir, teachers,
                                                                                   tmp_path):
    teacher = {"class_path": "rllight.callbacks.distillation.Teacher"}
    callbacks = tmp_path / "teachers.yaml"
    callbacks.write_text(yaml.safe_dump({"trainer": {"callbacks": [
        {"class_path": "rllight.callbacks.TeacherLogprobs", "init_args": {"model": None, "teachers": {
            source: {**teacher, "init_args": {"model": {"class_path": "rllight.models.HFModel",
                                                        "init_args": {"path": path}}}}
            for source, path in teachers.items()} | {"missing": {**teacher, "init_args": {"model": {
                "class_path": "rllight.models.HFModel", "init_args": {"path": str(tmp_path / "none")}}}}}}}]}}))
    cli = build(os.path.join(RECIPES, "distill-quickstart.yaml"), tiny_overrides(tmp_path, tiny_model_dir),
                str(callbacks))
    (callback,) = [c for c in cli.trainer.callbacks if isinstance(c, TeacherLogprobs)]
    assert callback.model is None and sorted(callback.teachers) == ["gsm8k", "math", "missing"]
    assert all(isinstance(t, Teacher) for t in callback.teachers.values())
    with pytest.raises(RecipeError, match=r"^trainer.callbacks: TeacherLogprobs.teachers.missing.init_args.model."
                                          r"init_args.path: folder"):
        callback.check_before_fit(cli.model)
