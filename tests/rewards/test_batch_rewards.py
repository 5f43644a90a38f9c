"""Rewards that read the batch (``rllight.rewards.Reward.score``) and the reward model (``rllight.rewards.reward_model``).

- The producer gives a reward one ``Sample`` per response (prompt as the policy saw it, messages,
  response text and ids, answer, row, group) in one call; a call that raises fails the batch (every sample 0,
  counted, one warning); a wrong number of scores is one ``RecipeError`` line.
- ``RewardModel`` on a tiny ``LlamaForSequenceClassification`` built here: its scores are the classifier's own
  forward pass on the same texts; whitening gives mean 0 and std 1; a clip binds; a folder that is not a
  one-label classifier is one line; the constructor loads nothing (a recipe parses without the weights).
- Through the CLI: a 2-step fit whose ``model.reward`` is a ``RewardModel`` logs the classifier's scores as its
  rewards, and a classifier with the opposite head changes the run (rewards and advantages negated).
"""

import importlib
import logging
import os
import re
import sys

import lightning as L
import pytest
import torch
from conftest import RECIPES
from helpers import build, tiny_overrides
from reward_model_fixtures import make_classifier
from transformers import AutoTokenizer, LlamaForSequenceClassification

from rllight.errors import RecipeError
from rllight.models import HFModel
from rllight.rewards import (IntegerMatch, PerSource, Reward, RewardModel, RewardRunner, Sample, Scores, Weighted,
                             check_rows, preflight)
from rllight.rollout import HFEngine
from rllight.rollout.producer import RolloutProducer, encode_chat
from rllight.serving import Worker

QUESTIONS = ["What is 2 + 3?", "What is 7 - 4?"]
ROWS = [{"messages": [{"role": "user", "content": q}], "answer": a, "data_source": "arith", "source": f"t row {i + 1}"}
        for i, (q, a) in enumerate(zip(QUESTIONS, ["5", "3"]))]


@pytest.fixture(scope="module")
def classifier_dir(tiny_model_dir, tmp_path_factory) -> str:
    return make_classifier(tmp_path_factory.mktemp("rm") / "classifier", tiny_model_dir)


def by_hand(folder: str, texts: list[tuple[str, bool]]) -> list[float]:
    """The classifier's score of each ``(text, templated)`` alone (no padding): a templated text's special tokens are
    in it, a plain one gets the tokenizer's."""
    tokenizer = AutoTokenizer.from_pretrained(folder)
    return forward(folder, [tokenizer(t, add_special_tokens=not templated)["input_ids"] for t, templated in texts])


def forward(folder: str, ids: list[list[int]]) -> list[float]:
    """The classifier's logit for each token sequence, one forward pass each."""
    model = LlamaForSequenceClassification.from_pretrained(folder).eval()
    with torch.no_grad():
        return [model(input_ids=torch.tensor([seq])).logits[0, 0].item() for seq in ids]


def sample(prompt="Q: 2 + 3?\nA: ", response="5", messages=None, group=0) -> Sample:
    return Sample(prompt=prompt, messages=messages, response=response, response_ids=[1, 2], answer="5", row={},
                  group=group)


class Recording(Reward):
    """Scores each sample by its response's length and keeps every batch it was given."""

    solved_at = 3.0

    def __init__(self):
        self.calls: list[list[Sample]] = []

    def score(self, samples):
        self.calls.append(list(samples))
        return [float(len(s.response)) for s in samples]


class Raises(Reward):
    def score(self, samples):
        raise ConnectionError("the judge is down")


class TooFew(Reward):
    def score(self, samples):
        return Scores(values=[1.0])


@pytest.fixture(scope="module")
def policy(tiny_model_dir):
    return HFModel(tiny_model_dir).load()


def producer_for(reward, policy) -> RolloutProducer:
    torch.manual_seed(0)
    producer = RolloutProducer(HFEngine(max_new_tokens=5), reward)
    producer.bind(*policy)
    return producer


# ------------------------------------------------------------------------------------------------- the producer
def test_a_batch_reward_gets_one_sample_per_response_in_one_call(policy):
    reward = Recording()
    producer = producer_for(reward, policy)
    rollout = producer.sample(ROWS, 2)
    assert len(reward.calls) == 1
    samples, tokenizer = reward.calls[0], policy[1]
    assert [s.group for s in samples] == [0, 0, 1, 1]
    for i, s in enumerate(samples):
        row = ROWS[i // 2]
        assert s.prompt == tokenizer.decode(encode_chat(tokenizer, row["messages"]))  # the template applied
        assert s.messages == row["messages"] and s.row == row and s.answer == row["answer"]
        assert s.response == rollout.texts[i]
        assert s.response_ids == rollout.response_ids[i][rollout.response_mask[i].bool()].tolist()
        assert s.truncated == bool(rollout.truncated[i])
    assert rollout.rewards.tolist() == [float(len(t)) for t in rollout.texts]
    assert rollout.correct.tolist() == [float(len(t) >= 3) for t in rollout.texts]  # solved from reward.solved_at
    assert rollout.extras["reward/failures"] == 0.0


def test_per_source_scores_each_source_with_its_own_kind_of_reward(policy):
    recording = Recording()
    rows = [ROWS[0], {**ROWS[1], "data_source": "other"}]
    producer = producer_for(PerSource(rewards={"arith": recording}, default=IntegerMatch()), policy)
    rollout = producer.sample(rows, 2)
    assert [s.group for s in recording.calls[0]] == [0, 0]  # the batch reward saw its source's responses only
    assert rollout.rewards[:2].tolist() == [float(len(t)) for t in rollout.texts[:2]]
    assert rollout.rewards[2:].tolist() == [float(IntegerMatch()(t, "3")) for t in rollout.texts[2:]]


def test_a_batch_reward_that_raises_fails_the_whole_batch_counted(policy, caplog):
    producer = producer_for(Raises(), policy)
    with caplog.at_level(logging.WARNING, logger="rllight.rollout"):
        rollout = producer.sample(ROWS, 2)
    assert rollout.rewards.tolist() == [0.0] * 4 and rollout.correct.tolist() == [0.0] * 4
    assert rollout.extras["reward/failures"] == 4.0 and producer.reward_failures == 4
    assert producer.failed_reward_steps == 1  # counts towards model.guards.max_failed_reward_steps
    failed = [r.getMessage() for r in caplog.records if "could not score" in r.getMessage()]
    assert len(failed) == 1 and "Raises could not score 4 of 4" in failed[0]
    assert "ConnectionError: the judge is down" in failed[0]


class PartlyFails(Reward):
    def score(self, samples):
        return Scores(values=[1.0, float("nan"), 1.0, 1.0], failed={2: "no verdict in the judge's answer"})


def test_samples_a_batch_reward_could_not_score_get_0_and_count(policy, caplog):
    producer = producer_for(PartlyFails(), policy)
    with caplog.at_level(logging.WARNING, logger="rllight.rollout"):
        rollout = producer.sample(ROWS, 2)
    assert rollout.rewards.tolist() == [1.0, 0.0, 0.0, 1.0] and rollout.correct.tolist() == [1.0, 0.0, 0.0, 1.0]
    assert rollout.extras["reward/failures"] == 2.0 and producer.failed_reward_steps == 0
    [line] = [r.getMessage() for r in caplog.records]
    assert "could not score 2 of 4 samples" in line and "sample 1: score nan is not finite" in line


def test_a_wrong_number_of_scores_is_one_recipe_error_line(policy):
    producer = producer_for(TooFew(), policy)
    with pytest.raises(RecipeError) as err:
        producer.sample(ROWS, 2)
    assert "\n" not in str(err.value)
    assert str(err.value).startswith("model.reward: TooFew.score returned 1 scores for 4 samples")



# ------------------------------------------------------------------------- a batch reward mixed with a verifier
def test_weighted_is_the_weighted_sum_correct_from_the_verifier():
    recording = Recording()
    mix = Weighted({"correctness": IntegerMatch(), "judge": recording}, weights={"correctness": 1.0, "judge": 0.5})
    out = mix.score([sample(response="5"), sample(response="it is 5"), sample(response="it is 4")])
    # correctness 1, 1, 0; judge = len(response) 1, 7, 7; total = correctness + 0.5 * judge
    assert out.values == [1.0 + 0.5 * 1, 1.0 + 0.5 * 7, 0.0 + 0.5 * 7]
    assert out.solved == [True, True, False]  # from IntegerMatch, whatever the judge's solved_at (3) says
    assert out.components == {"correctness": [1.0, 1.0, 0.0], "judge": [1.0, 7.0, 7.0]} and not out.failed
    assert len(recording.calls) == 1  # the batch reward scored the batch once
    assert mix.parts()[1] is recording  # the trainer's close() reaches the judge
    assert PerSource(rewards={"a": mix, "b": recording, "c": mix}).parts() == [mix, recording]  # each once


def test_weighted_through_the_producer_logs_each_component(policy):
    mix = Weighted({"correctness": IntegerMatch(), "judge": Recording()}, weights={"correctness": 1.0, "judge": 0.5})
    rollout = producer_for(mix, policy).sample(ROWS, 2)
    answers = [r["answer"] for r in ROWS for _ in range(2)]
    verdicts = [float(IntegerMatch()(t, a)) for t, a in zip(rollout.texts, answers)]
    assert rollout.rewards.tolist() == pytest.approx([v + 0.5 * len(t) for v, t in zip(verdicts, rollout.texts)])
    assert rollout.correct.tolist() == verdicts
    assert rollout.extras["reward/correctness"] == pytest.approx(sum(verdicts) / 4)
    assert rollout.extras["reward/judge"] == pytest.approx(sum(len(t) for t in rollout.texts) / 4)
    assert rollout.extras["reward/failures"] == 0.0


def test_a_component_that_fails_on_a_sample_fails_that_sample_counted(policy, caplog):
    mix = Weighted({"correctness": IntegerMatch(), "judge": PartlyFails()}, weights={"correctness": 1.0,
                                                                                          "judge": 0.5})
    producer = producer_for(mix, policy)
    with caplog.at_level(logging.WARNING, logger="rllight.rollout"):
        rollout = producer.sample(ROWS, 2)
    answers = [r["answer"] for r in ROWS for _ in range(2)]
    verdicts = [float(IntegerMatch()(t, a)) for t, a in zip(rollout.texts, answers)]
    # PartlyFails: 1.0 each, but sample 1 is nan and sample 2 it could not score
    assert rollout.rewards.tolist() == [verdicts[0] + 0.5, 0.0, 0.0, verdicts[3] + 0.5]
    assert rollout.extras["reward/failures"] == 2.0 and producer.reward_failures == 2
    assert rollout.extras["reward/judge"] == 0.5  # (1 + 0 + 0 + 1) / 4: a failed sample's component is 0
    [line] = [r.getMessage() for r in caplog.records]
    assert "could not score 2 of 4 samples" in line and "sample 1: judge: score nan is not finite" in line


@pytest.mark.parametrize(("kwargs", "start"), [
    ({"weights": {"correctness": 1.0}}, "Weighted.weights has no weight for 'judge'"),
    ({"weights": {"correctness": 1.0, "judge": float("inf")}}, "Weighted.weights.judge is inf"),
    ({"correct_from": "style"}, "Weighted.correct_from 'style' is not a reward"),
])
def test_weighted_bad_weights_are_one_recipe_error_line(kwargs, start):
    with pytest.raises(RecipeError) as err:
        Weighted({"correctness": IntegerMatch(), "judge": Recording()}, **kwargs)
    assert str(err.value).startswith(start) and "\n" not in str(err.value)

@pytest.mark.parametrize(("make", "message"), [
    (lambda: RewardModel("rm", batch_size=0), "RewardModel.batch_size must be an integer >= 1, got 0"),
    (lambda: RewardModel("rm", max_length=True), "RewardModel.max_length must be an integer >= 1 or null, got True"),
    (lambda: RewardModel("rm", clip=float("inf")), "RewardModel.clip must be a finite number > 0 or null, got inf"),
    (lambda: RewardModel("rm", placement=Worker(load_timeout_seconds=0)),  # at bind: the placement's key
     "model.reward.init_args.placement.init_args.load_timeout_seconds must be a finite number > 0, got 0"),
])
def test_a_reward_models_settings_out_of_their_declared_bounds_are_one_line(make, message):
    with pytest.raises(RecipeError) as err:
        make()
    assert str(err.value) == message


def test_the_checks_before_training_skip_a_batch_reward(caplog):
    reward = RewardModel("/no/such/folder")  # never loaded: the checks must not need the weights
    check_rows(reward, ROWS)
    with caplog.at_level(logging.INFO, logger="rllight.rewards"):
        preflight(reward.guarded(RewardRunner(workers=0)), ROWS)
    assert sum("no reward pre-flight" in r.getMessage() for r in caplog.records) == 1
    assert reward.guarded(RewardRunner(workers=0)) is reward  # only verifiers go to the reward workers


def test_the_guides_example_ranks_each_group(policy, tmp_path, monkeypatch):
    """docs/guides/rewards.md's ``ShortestInGroup``, as written, in a producer."""
    with open(os.path.join(os.path.dirname(RECIPES), "docs", "guides", "rewards.md")) as f:
        page = f.read()
    [code] = [b for b in re.findall(r"```python\n(.*?)```", page, re.DOTALL) if "class ShortestInGroup" in b]
    (tmp_path / "guide_example.py").write_text(code)
    monkeypatch.syspath_prepend(str(tmp_path))
    example = importlib.import_module("guide_example")
    monkeypatch.delitem(sys.modules, "guide_example")
    rollout = producer_for(example.ShortestInGroup(), policy).sample(ROWS, 3)
    lengths = rollout.response_mask.sum(-1).view(2, 3)
    assert rollout.rewards.view(2, 3).tolist() == (lengths == lengths.min(-1, keepdim=True).values).float().tolist()


# ------------------------------------------------------------------------------------------------- the reward model
def test_reward_model_scores_are_the_classifiers_forward_pass(classifier_dir):
    tokenizer = AutoTokenizer.from_pretrained(classifier_dir)
    chats = [sample(messages=[{"role": "user", "content": q}], response=r, group=i)
             for i, (q, r) in enumerate([(QUESTIONS[0], "5"), (QUESTIONS[1], "it is three, 3"), (QUESTIONS[0], "")])]
    plain = [sample(prompt="Q: 1 + 1?\nA: ", response="2 and some more words")]  # no messages: prompt + response
    reward = RewardModel(classifier_dir, batch_size=2)  # 4 texts of different lengths: padded batches
    scores = reward.score(chats + plain)
    texts = [(tokenizer.apply_chat_template([*s.messages, {"role": "assistant", "content": s.response}],
                                            tokenize=False), True) for s in chats]
    texts.append(("Q: 1 + 1?\nA: 2 and some more words", False))
    assert [reward.text(s) for s in chats + plain] == texts
    assert scores == pytest.approx(by_hand(classifier_dir, texts), abs=1e-5)
    assert max(scores) - min(scores) > 0.1  # the texts are told apart


def test_max_length_cuts_the_start_of_the_prompt(classifier_dir):
    long = sample(prompt="a long preamble " * 20, response="5")
    cut = RewardModel(classifier_dir, max_length=8)
    cut.load()
    ids = cut._tokenizer("a long preamble " * 20 + "5")["input_ids"]
    assert cut._ids(long) == ids[-8:]  # the response's end is kept
    assert cut.score([long]) == pytest.approx(forward(classifier_dir, [ids[-8:]]), abs=1e-5)


def test_whitening_gives_mean_0_std_1_and_a_clip_binds(classifier_dir):
    samples = [sample(response=r, group=i) for i, r in enumerate(["5", "55", "five", "the answer is 5", "x"])]
    raw = RewardModel(classifier_dir).score(samples)
    white = torch.tensor(RewardModel(classifier_dir, normalize="whiten").score(samples), dtype=torch.float64)
    assert white.mean().item() == pytest.approx(0.0, abs=1e-9)
    assert white.std(unbiased=False).item() == pytest.approx(1.0, abs=1e-5)
    expected = (torch.tensor(raw, dtype=torch.float64) - torch.tensor(raw).double().mean()) / torch.tensor(
        raw, dtype=torch.float64).std(unbiased=False)
    assert white.tolist() == pytest.approx(expected.tolist(), abs=1e-5)
    clipped = RewardModel(classifier_dir, normalize="whiten", clip=0.5).score(samples)
    assert max(abs(c) for c in clipped) == pytest.approx(0.5)  # some |z| >= 1 with a population std of 1
    assert clipped == pytest.approx(white.clamp(-0.5, 0.5).tolist())


def test_dtype_auto_follows_the_trainers_mixed_precision(classifier_dir):
    """Under ``bf16-mixed`` Lightning runs the step under a bfloat16 autocast: ``dtype: auto`` loads the classifier
    in bfloat16 there (in float32 without one), and scores with autocast off in that dtype."""
    samples = [sample(response=r, group=i) for i, r in enumerate(["5", "the answer is 5"])]
    full = RewardModel(classifier_dir)
    exact = full.score(samples)
    assert full._net.dtype == torch.float32
    half = RewardModel(classifier_dir)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low = half.score(samples)
    assert half._net.dtype == torch.bfloat16
    assert low == pytest.approx(exact, abs=0.1) and low != exact


def test_a_folder_that_is_not_a_one_label_classifier_is_one_line(tiny_model_dir, tmp_path):
    two = make_classifier(tmp_path / "two", tiny_model_dir, num_labels=2)
    for folder, words in ((tiny_model_dir, "is a LlamaForCausalLM, not a sequence classifier"),
                          (two, "with 2 labels"), (str(tmp_path / "missing"), "does not exist"),
                          (str(tmp_path), "cannot be read")):
        with pytest.raises(RecipeError) as err:
            RewardModel(folder).score([sample()])
        assert words in str(err.value) and "\n" not in str(err.value), str(err.value)
    with pytest.raises(RecipeError, match="normalize"):
        RewardModel(tiny_model_dir, normalize="zscore")


def test_a_recipe_names_a_reward_model_and_parses_without_loading_it(tmp_path, tiny_model_dir, classifier_dir):
    cli = build(f"{RECIPES}/grpo.yaml", tiny_overrides(tmp_path, tiny_model_dir, reward={
        "class_path": "rllight.rewards.RewardModel", "init_args": {"model": classifier_dir, "normalize": "whiten"}}))
    reward = cli.model.reward
    assert isinstance(reward, RewardModel) and reward.normalize == "whiten" and reward._net is None
    assert cli.model.producer.reward is reward


# ------------------------------------------------------------------------------------------------- a run
class _Steps(L.Callback):
    def __init__(self):
        self.metrics: list[dict[str, float]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.metrics.append({k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("train/")})


def _fit(tmp_path, tiny_model_dir, folder, monkeypatch) -> dict:
    """A 2-step GRPO fit whose reward is the classifier in ``folder`` (pre-flight on: it skips a reward model):
    each step's rows, texts, rewards and advantages, its logged metrics, and the trained policy."""
    tmp_path.mkdir()
    cli = build(f"{RECIPES}/grpo.yaml", tiny_overrides(tmp_path, tiny_model_dir, reward_preflight=4, reward={
        "class_path": "rllight.rewards.RewardModel", "init_args": {"model": folder}}))
    module, seen, steps = cli.model, {"rows": [], "rollouts": [], "advantages": []}, _Steps()
    sample_, estimate = module.producer.sample, module.estimate_advantages

    def recorded_sample(rows, n, *args, **kwargs):
        rollout = sample_(rows, n, *args, **kwargs)
        seen["rows"].append([rows[k] for k in rollout.extras["kept_rows"]])
        seen["rollouts"].append((list(rollout.texts), rollout.rewards.clone(), n))
        return rollout

    def recorded_estimate(rollout):
        estimate(rollout)
        seen["advantages"].append(rollout.advantages.clone())

    monkeypatch.setattr(module.producer, "sample", recorded_sample)
    monkeypatch.setattr(module, "estimate_advantages", recorded_estimate)
    cli.trainer.callbacks.append(steps)
    cli.trainer.fit(module, datamodule=cli.datamodule)
    assert cli.trainer.global_step == 2 and module.reward._net is None  # closed at the end of fit
    return {**seen, "metrics": steps.metrics, "policy": module.policy}


def test_a_reward_model_scores_the_run_and_its_head_changes_it(tmp_path, tiny_model_dir, classifier_dir, monkeypatch):
    run = _fit(tmp_path / "a", tiny_model_dir, classifier_dir, monkeypatch)
    tokenizer = AutoTokenizer.from_pretrained(classifier_dir)
    for step, (rows, (texts, rewards, n)) in enumerate(zip(run["rows"], run["rollouts"])):
        chats = [(tokenizer.apply_chat_template([*rows[i // n]["messages"], {"role": "assistant", "content": t}],
                                                tokenize=False), True) for i, t in enumerate(texts)]
        expected = by_hand(classifier_dir, chats)
        assert rewards.tolist() == pytest.approx(expected, abs=1e-5)
        assert run["metrics"][step]["train/reward/mean"] == pytest.approx(sum(expected) / len(expected), abs=1e-5)
    # The same run with the head negated: the same first rollout (same seed, same policy), opposite rewards and
    # advantages, and so other weights after the updates.
    opposite = make_classifier(tmp_path / "opposite", tiny_model_dir, head_sign=-1.0)
    other = _fit(tmp_path / "b", tiny_model_dir, opposite, monkeypatch)
    assert other["rollouts"][0][0] == run["rollouts"][0][0]
    assert other["rollouts"][0][1].tolist() == pytest.approx((-run["rollouts"][0][1]).tolist(), abs=1e-5)
    assert not torch.allclose(other["advantages"][0], run["advantages"][0])
    assert torch.allclose(other["advantages"][0], -run["advantages"][0], atol=1e-4)
    assert any(not torch.equal(p, q) for p, q in zip(run["policy"].parameters(), other["policy"].parameters()))
