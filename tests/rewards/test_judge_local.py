"""``LLMJudge`` with a local judge model (placed ``InProcess`` and in a ``Worker``, ``rllight.rewards.judge_local``) on
tiny models built here: P(yes), and the share of the first token's probability its yes and no hold (the mass), equal
the ones computed by hand from the judge's logits over the whole vocabulary, a mass below ``min_mass`` fails each
sample (counted), the request's ``top_logprobs`` are listed, both placements give the same rewards and the same failure
reasons, a judge trained to answer ``Score: 7`` gives 0.7 by the number verdict, a worker that hangs costs its batch
(counted) and the next batch is judged, and wrong settings are one line before anything loads."""

import math
import os

import pytest
import torch
import yaml
from conftest import RECIPES
from helpers import build, tiny_overrides
from reward_model_fixtures import make_classifier
from transformers import AutoModelForCausalLM, AutoTokenizer

from rllight.app.cli import main
from rllight.errors import RecipeError
from rllight.rewards import LLMJudge, Sample
from rllight.rollout.producer import encode_chat
from rllight.rollout.scoring import reward_metrics, score_samples
from rllight.serving import Endpoint, InProcess, Worker
from rllight.testing import build_tiny_model

QUESTIONS = ["What is 2 + 3?", "What is 7 - 4?", "Name a prime.", "What is 6 * 7?"]
RESPONSES = ["5", "it is three", "seven", "42, surely"]


def sample(question: str, response: str, group: int = 0) -> Sample:
    return Sample(prompt=f"Q: {question}\nA: ", messages=[{"role": "user", "content": question}], response=response,
                  response_ids=[1], answer="5", row={}, group=group)


SAMPLES = [sample(q, r, i) for i, (q, r) in enumerate(zip(QUESTIONS, RESPONSES))]


@pytest.fixture(scope="module")
def judge_dir(tmp_path_factory) -> str:
    """The tiny model with ``yes`` and ``no`` as tokens of their own (its 300-token BPE has neither)."""
    path = build_tiny_model(str(tmp_path_factory.mktemp("judge") / "model"), hidden_size=32, seed=3)
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.add_tokens(["yes", "no", " Yes"])
    model = AutoModelForCausalLM.from_pretrained(path)
    model.resize_token_embeddings(len(tokenizer))
    with torch.no_grad():  # logits of the size of the others: P(yes) varies with the prompt
        torch.manual_seed(0)
        model.get_output_embeddings().weight[-3:].copy_(torch.randn(3, model.config.hidden_size) * 0.3)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def score7_dir(tmp_path_factory) -> str:
    """A tiny judge fine-tuned to answer every prompt with ``Score: 7``."""
    path = build_tiny_model(str(tmp_path_factory.mktemp("score7") / "model"), hidden_size=32, seed=4)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    target = tokenizer("Score: 7", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    prompts = [encode_chat(tokenizer, [{"role": "user", "content": f"Grade response {i}: {'x' * (i % 7)}"}])
               for i in range(16)]
    width = max(len(p) for p in prompts) + len(target)
    ids = torch.full((len(prompts), width), tokenizer.pad_token_id)
    labels, mask = torch.full_like(ids, -100), torch.zeros_like(ids)
    for j, p in enumerate(prompts):
        ids[j, : len(p) + len(target)] = torch.tensor(p + target)
        labels[j, len(p) : len(p) + len(target)] = torch.tensor(target)  # the loss on the answer only
        mask[j, : len(p) + len(target)] = 1
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(60):
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.save_pretrained(path)
    return path


def hand_yes_no(judge_dir: str, judge: LLMJudge, s: Sample) -> tuple[float, float]:
    """``(P(yes) / (P(yes) + P(no)), P(yes) + P(no))`` over every token that reads yes or no, from one forward pass of
    the judge's templated prompt."""
    tokenizer = AutoTokenizer.from_pretrained(judge_dir)
    model = AutoModelForCausalLM.from_pretrained(judge_dir, dtype=torch.float32).eval()
    text = tokenizer.apply_chat_template([{"role": "user", "content": judge._prompt(s, s.response, 1)}],
                                         tokenize=False, add_generation_prompt=True)
    ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        probs = model(input_ids=ids).logits[0, -1].float().softmax(-1)
    words = {i: tokenizer.decode([i]).strip().lower() for i in range(len(tokenizer))}
    yes = sum(float(probs[i]) for i, w in words.items() if w == "yes")
    no = sum(float(probs[i]) for i, w in words.items() if w == "no")
    return yes / (yes + no), yes + no


def test_p_yes_and_its_mass_are_the_judges_own_over_every_yes_and_no_token_in_both_placements(judge_dir):
    # min_mass 0: this random judge's yes and no hold about a third of its first token (below the default 0.5).
    process = LLMJudge(model=judge_dir, placement=InProcess(), verdict="yes_logprob", batch_size=3, dtype="float32",
                       min_mass=0.0)
    out = process.score(SAMPLES)
    assert not out.failed
    expected, masses = zip(*[hand_yes_no(judge_dir, process, s) for s in SAMPLES])
    assert out.values == pytest.approx(expected, abs=1e-5)
    assert max(expected) - min(expected) > 1e-4  # the reward depends on the response (a judge blind to it: 1e-15)
    assert out.metrics["judge/mass_sum"] == pytest.approx(sum(masses), abs=1e-5)
    assert out.metrics["judge/mass_count"] == 4.0 and out.metrics["judge/bounded"] == 0.0  # the vocabulary: exact
    worker = LLMJudge(model=judge_dir, placement=Worker(), verdict="yes_logprob", batch_size=2, dtype="float32",
                      min_mass=0.0)
    try:
        in_worker = worker.score(SAMPLES)
    finally:
        worker.close()
    assert in_worker.values == pytest.approx(expected, abs=1e-5)
    assert in_worker.metrics["judge/mass_sum"] == pytest.approx(sum(masses), abs=1e-5)
    # Under the default min_mass (0.5) each verdict fails, counted, with the hand-computed mass in its reason.
    assert max(masses) < 0.5
    scores = score_samples(LLMJudge(model=judge_dir, placement=InProcess(), verdict="yes_logprob", dtype="float32"),
                           SAMPLES)
    assert scores.values == [0.0] * 4 and sorted(scores.failed) == [0, 1, 2, 3]
    assert scores.failed[0].startswith(f"yes and no hold {masses[0]:.3g} of the judge's first-token probability, "
                                       "below min_mass=0.5")
    assert reward_metrics(scores)["reward/judge/low_mass"] == 4.0


def test_a_local_judge_lists_the_requests_top_logprobs_and_every_yes_and_no_token(judge_dir):
    chat = LLMJudge(model=judge_dir, placement=InProcess(), dtype="float32")._chat()
    body = {"messages": [{"role": "user", "content": "Is 2 + 3 = 5?"}], "max_tokens": 1, "temperature": 0.0,
            "logprobs": True}
    for top in (2, 12):
        first = chat.complete([{**body, "top_logprobs": top}])[0]["choices"][0]["logprobs"]["content"][0]
        listed = [t["token"] for t in first["top_logprobs"]]  # by id: several byte tokens decode to the same text
        assert {"yes", "no", " Yes"} <= set(listed) and top <= len(listed) <= top + 3  # the judge's 3 yes/no tokens


def test_generated_verdicts_and_their_failures_are_the_same_in_both_placements(judge_dir, score7_dir):
    trained = LLMJudge(model=score7_dir, placement=InProcess(), max_tokens=8, dtype="float32")
    out = trained.score(SAMPLES)
    assert out.values == [0.7] * 4 and not out.failed
    # The untrained judge answers noise: each sample fails with the same reason in both placements.
    process = LLMJudge(model=judge_dir, placement=InProcess(), max_tokens=6, dtype="float32").score(SAMPLES)
    worker = LLMJudge(model=judge_dir, placement=Worker(), max_tokens=6, dtype="float32")
    try:
        in_worker = worker.score(SAMPLES)
    finally:
        worker.close()
    assert sorted(process.failed) == [0, 1, 2, 3] and in_worker.failed == process.failed
    assert all("no score" in reason or "Score" in reason or "score" in reason for reason in process.failed.values())


def test_sampling_judge_leaves_the_training_runs_random_stream_alone(score7_dir):
    judge = LLMJudge(model=score7_dir, placement=InProcess(), max_tokens=8, temperature=1.0, dtype="float32")
    torch.manual_seed(123)
    judge.score(SAMPLES)
    after_judge = torch.rand(3)
    torch.manual_seed(123)
    assert torch.equal(torch.rand(3), after_judge)


class Hanging(LLMJudge):
    worker_target = "judge_local_fixtures:serve_hanging"


def test_a_judge_worker_that_hangs_costs_its_batch_and_the_next_is_judged(judge_dir):
    judge = Hanging(model=judge_dir, placement=Worker(timeout_seconds=3), verdict="yes_logprob", dtype="float32",
                    min_mass=0.0)
    try:
        judge.score(SAMPLES[:1])  # started and loaded: the timeout is the batch's alone
        scores = score_samples(judge, [sample("HANG", "x")] + SAMPLES[1:])
        assert len(scores.failed) == 4 and scores.values == [0.0] * 4
        assert "the judge's worker process did not answer a batch of 4 within 3 s" in scores.failed[0]
        assert judge.placement.child is None  # killed
        out = judge.score(SAMPLES)
        assert not out.failed and all(0 < v < 1 for v in out.values)
    finally:
        judge.close()


def test_wrong_local_judge_settings_are_one_line_before_anything_loads(tmp_path, judge_dir, monkeypatch):
    with pytest.raises(RecipeError, match=r"^model.reward.init_args.model must be the folder or hub id"):
        LLMJudge(placement=Worker())
    classifier = make_classifier(tmp_path / "classifier", judge_dir)
    with pytest.raises(RecipeError, match=r"is a LlamaForSequenceClassification, not a causal LM"):
        LLMJudge(model=classifier, placement=InProcess()).check()
    with pytest.raises(RecipeError, match=r"^model.reward.init_args.model: folder '.*missing' does not exist"):
        LLMJudge(model=str(tmp_path / "missing"), placement=Worker()).check()
    (tmp_path / "empty").mkdir()
    with pytest.raises(RecipeError, match=r"cannot be read as a Hugging Face model"):
        LLMJudge(model=str(tmp_path / "empty"), placement=Worker()).check()
    monkeypatch.delenv("RLLIGHT_NO_SUCH_KEY", raising=False)
    with pytest.raises(RecipeError, match="RLLIGHT_NO_SUCH_KEY is not set"):
        LLMJudge(model="m", placement=Endpoint("http://127.0.0.1:8000/v1", api_key_env="RLLIGHT_NO_SUCH_KEY")).check()
    LLMJudge(model=judge_dir, placement=InProcess()).check()  # a causal LM: no error
    assert math.isfinite(LLMJudge(model=judge_dir, placement=InProcess(), verdict="yes_logprob").score(SAMPLES[:1])
                         .values[0])


def test_a_judge_that_is_not_a_causal_lm_is_one_line_before_any_model_loads(tmp_path, tiny_model_dir, judge_dir,
                                                                            monkeypatch, capsys):
    def no_weights(*args, **kwargs):
        raise AssertionError("a model loaded before the judge's folder was checked")

    classifier = make_classifier(tmp_path / "classifier", judge_dir)
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", no_weights)
    overlay = tiny_overrides(tmp_path, tiny_model_dir, reward={
        "class_path": "rllight.rewards.LLMJudge",
        "init_args": {"model": classifier, "placement": {"class_path": "rllight.serving.InProcess"}}})
    with pytest.raises(SystemExit) as exc:
        main(["fit", "--config", os.path.join(RECIPES, "grpo.yaml"), "--config", overlay])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and err.count("rllight: error") == 1, err
    assert err.splitlines()[-1].endswith(f"model.reward.init_args.model: '{classifier}' is a "
                                         "LlamaForSequenceClassification, not a causal LM: a local judge generates "
                                         "its verdict (AutoModelForCausalLM)"), err


def test_the_judge_recipe_trains_on_the_judges_reward_and_counts_the_exact_match(tmp_path, tiny_model_dir, judge_dir):
    """recipes/judge-quickstart.yaml on the tiny model, its judge the tiny judge: two steps whose logged reward is
    the judge's P(yes) (weight 1) and whose accuracy is the exact match's (weight 0, correct_from)."""
    recipe = yaml.safe_load(open(os.path.join(RECIPES, "judge-quickstart.yaml")))
    reward = recipe["model"]["reward"]
    # min_mass 0: the tiny judge's yes and no hold about a third of its first token (below the default 0.5)
    reward["init_args"]["rewards"]["judge"]["init_args"].update(model=judge_dir, dtype="float32", min_mass=0.0)
    overlay = tmp_path / "judge.yaml"
    overlay.write_text(yaml.safe_dump({"model": {"reward": reward}}))
    cli = build(os.path.join(RECIPES, "judge-quickstart.yaml"), tiny_overrides(tmp_path, tiny_model_dir), str(overlay))
    assert cli.model.reward.weights == {"judge": 1.0, "exact": 0.0}
    cli.trainer.fit(cli.model, cli.datamodule)
    logged = {k: float(v) for k, v in cli.trainer.callback_metrics.items()}
    assert 0.0 < logged["train/reward/judge"] < 1.0
    assert logged["train/reward/mean"] == pytest.approx(logged["train/reward/judge"], abs=1e-5)
    assert logged["train/reward/accuracy"] == pytest.approx(logged["train/reward/exact"], abs=1e-5)
    # The judge's mass reaches the log through Weighted: one verdict per response.
    assert logged["train/reward/judge/mass_count"] >= 1
    assert 0 < logged["train/reward/judge/mass_sum"] / logged["train/reward/judge/mass_count"] < 1
