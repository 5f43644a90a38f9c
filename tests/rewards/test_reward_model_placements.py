"""The reward model's placements (``rllight.rewards.reward_model``, ``rllight.serving``): in the trainer's process,
in a worker process, at a URL.

- One tiny ``LlamaForSequenceClassification`` and the same samples give equal scores (to 1e-5) in every placement:
  ``InProcess``, ``Worker``, and ``Endpoint`` against a fake server in this process that scores with the same
  classifier, for each protocol (vLLM's Pooling API, OpenRLHF's remote reward model), with the request fields each
  documents.
- A worker killed mid-batch is restarted once and the batch still scored; killed again, the batch fails, counted
  (``score_samples``: every sample 0). A worker that hangs fails its batch within about its ``timeout_seconds``, and the
  next batch is scored by a new one. ``close`` stops the worker; a pickle carries the settings only.
- A server that answers 500 is retried, then the batch fails, counted; a 200 answer that echoes the API key, or
  one longer than ``max_answer_bytes``, fails the batch, counted, and the trainer's warning shows no 8 characters of
  the key; a bad placement setting or URL is one ``RecipeError`` line naming
  ``model.reward.init_args.placement.init_args.<field>``.
"""

import logging
import pickle

import pytest
from json_server import JSONServer
from reward_model_fixtures import DIE_MARKER, make_classifier

from rllight.errors import RecipeError
from rllight.rewards import RewardModel
from rllight.rewards import Sample
from rllight.rollout.scoring import score_samples
from rllight.serving import Endpoint, OpenRLHF, PromptLogprobs, VLLMPooling, Worker

QUESTIONS = ["What is 2 + 3?", "What is 7 - 4?", "Name a prime."]


def sample(response: str, question: str | None = None, group: int = 0) -> Sample:
    messages = [{"role": "user", "content": question}] if question is not None else None
    return Sample(prompt=f"Q: {question or '1 + 1?'}\nA: ", messages=messages, response=response, response_ids=[1],
                  answer="5", row={}, group=group)


def counted(reward, samples: list[Sample]) -> tuple[list[float], list[bool] | None, int]:
    """``(values, solved, failures)`` of the trainer's checked scores of ``samples`` (``score_samples``)."""
    scores = score_samples(reward, samples)
    return scores.values, scores.solved, len(scores.failed)


CHATS = [sample(r, q, i) for i, (q, r) in enumerate(zip(QUESTIONS, ["5", "it is three, 3", "seven is one"]))]
PLAIN = [sample("2 and some more words")]  # no messages: the prompt as the policy saw it, then the response


@pytest.fixture(scope="module")
def classifier_dir(tiny_model_dir, tmp_path_factory) -> str:
    return make_classifier(tmp_path_factory.mktemp("rm") / "classifier", tiny_model_dir)


class Misbehaving(RewardModel):
    """A reward model whose worker hangs on a ``HANG`` text and dies on a ``DIE`` one (``serve_misbehaving``)."""

    worker_target = "reward_model_fixtures:serve_misbehaving"


# ------------------------------------------------------------------------------------------------- a fake server
class FakeServer(JSONServer):
    """A reward-model server on 127.0.0.1 that scores with the tiny classifier in this process, at ``/pooling``
    (vLLM) and ``/get_reward`` (OpenRLHF); ``fail`` makes it answer HTTP 500, ``echo(path, auth)`` (where set)
    answers 200 with what it returns. It keeps every request."""

    def __init__(self, folder: str):
        self.scorer, self.fail, self.echo = RewardModel(folder), False, None
        super().__init__()

    def answer(self, path: str, body: dict) -> tuple[int, dict]:
        if self.fail:
            return 500, {"error": "busy"}
        if self.echo is not None:
            return 200, self.echo(path, self.requests[-1][2])
        if path == "/get_reward":  # OpenRLHF: full texts in, {"rewards": [...]} out; these are templated texts
            return 200, {"rewards": self.scorer.forward([(q, True) for q in body["query"]])}
        scores = self.scorer.forward([(t, not body["add_special_tokens"]) for t in body["input"]])
        data = [{"index": i, "object": "pooling", "data": [s]} for i, s in enumerate(scores)]
        return 200, {"object": "list", "model": body["model"], "data": data[::-1]}  # any order: "index" says which


@pytest.fixture(scope="module")
def server(classifier_dir):
    fake = FakeServer(classifier_dir)
    yield fake
    fake.close()


# ------------------------------------------------------------------------------------------------- equal scores
def test_every_placement_gives_the_same_scores(classifier_dir, server):
    expected = RewardModel(classifier_dir).score(CHATS + PLAIN)
    assert max(expected) - min(expected) > 0.1  # the texts are told apart
    worker = RewardModel(classifier_dir, placement=Worker())
    try:
        assert worker.score(CHATS + PLAIN) == pytest.approx(expected, abs=1e-5)
        copy = pickle.loads(pickle.dumps(worker))  # settings only, no process
        assert copy.placement.child is None and isinstance(copy.placement, Worker)
        child = worker.placement.child
        assert child is not None
    finally:
        worker.close()
    assert child.exit_code(wait_seconds=5.0) is not None and worker.placement.child is None  # close stops it
    # One request at a time, so that they reach the server in the order the protocol writes them.
    vllm = RewardModel(classifier_dir, placement=Endpoint(server.url, protocol=VLLMPooling(), max_concurrency=1))
    server.requests.clear()
    assert vllm.score(CHATS + PLAIN) == pytest.approx(expected, abs=1e-5)
    # Templated and plain texts go in two requests, each saying whether the server adds special tokens.
    assert [(path, body["model"], body["add_special_tokens"], len(body["input"])) for path, body, _ in server.requests] \
        == [("/pooling", classifier_dir, False, 3), ("/pooling", classifier_dir, True, 1)]
    assert server.requests[0][1]["input"] == [vllm.text(s)[0] for s in CHATS]
    openrlhf = RewardModel(classifier_dir, placement=Endpoint(server.url, protocol=OpenRLHF()))
    server.requests.clear()
    assert openrlhf.score(CHATS) == pytest.approx(expected[:3], abs=1e-5)
    [(_, body, _)] = server.requests
    assert body == {"query": [openrlhf.text(s)[0] for s in CHATS], "prompts": [s.prompt for s in CHATS],
                    "labels": ["5"] * 3}


# ------------------------------------------------------------------------------------------------- the worker
def test_a_worker_killed_mid_batch_is_restarted_once(classifier_dir, tmp_path, monkeypatch):
    monkeypatch.setenv(DIE_MARKER, str(tmp_path / "died-once"))
    reward = Misbehaving(classifier_dir, placement=Worker())
    dying = [*CHATS[:2], sample("DIE now", QUESTIONS[2], 2)]
    try:
        scores = reward.score(dying)  # the first child SIGKILLs itself; the restart scores the batch
        assert (tmp_path / "died-once").exists()
        assert scores == pytest.approx(RewardModel(classifier_dir).score(dying), abs=1e-5)
        # Now the running child dies on it (its marker gone) and so does its restart (no marker): the batch fails.
        (tmp_path / "died-once").unlink()
        monkeypatch.delenv(DIE_MARKER)
        values, correct, failures = counted(reward, dying)
        assert values == [0.0] * 3 and correct == [False] * 3 and failures == 3
    finally:
        reward.close()


def test_a_worker_that_hangs_fails_its_batch_within_the_timeout(classifier_dir, caplog):
    reward = Misbehaving(classifier_dir, placement=Worker(timeout_seconds=3))
    try:
        reward.score(CHATS[:1])  # started and loaded: the timeout is the batch's alone
        with caplog.at_level(logging.WARNING):
            values, _, failures = counted(reward, [sample("HANG", QUESTIONS[0])] + CHATS[1:])
        assert failures == 3 and values == [0.0] * 3
        assert any("the reward model's worker process did not answer a batch of 3 within 3 s" in r.getMessage()
                   for r in caplog.records)
        assert reward.placement.child is None  # killed
        assert reward.score(CHATS) == pytest.approx(RewardModel(classifier_dir).score(CHATS), abs=1e-5)
    finally:
        reward.close()


# ------------------------------------------------------------------------------------------------- the server
def test_a_server_that_answers_500_is_retried_then_the_batch_fails(classifier_dir, server, caplog):
    reward = RewardModel(classifier_dir, placement=Endpoint(server.url, retries=2, backoff_seconds=0.01,
                                                            timeout_seconds=5))
    server.requests.clear()
    server.fail = True
    try:
        with caplog.at_level(logging.WARNING):
            values, _, failures = counted(reward, CHATS)
    finally:
        server.fail = False
    assert values == [0.0] * 3 and failures == 3 and len(server.requests) == 3  # one request and two retries
    [line] = [r.getMessage() for r in caplog.records if "could not score 3 of 3 samples" in r.getMessage()]
    assert f"the reward model at {server.url} answered /pooling with HTTP 500" in line, line
    assert line.endswith("(after 3 attempts)"), line
    assert reward.score(CHATS) == pytest.approx(RewardModel(classifier_dir).score(CHATS), abs=1e-5)  # back up


SECRET = "sk-rm-Q4z8-never-print-me"


@pytest.mark.parametrize("echo", [
    lambda path, auth: {"data": "x" * 40 + auth},  # no list of scores: the answer is quoted
    lambda path, auth: {"data": [{"index": i, "data": auth} for i in range(3)]},  # a score that is no number
])
def test_an_answer_that_echoes_the_key_fails_the_batch_and_its_warning_shows_none_of_it(classifier_dir, server,
                                                                                       caplog, monkeypatch, echo):
    monkeypatch.setenv("RLLIGHT_TEST_RM_KEY", SECRET)
    reward = RewardModel(classifier_dir, placement=Endpoint(server.url, api_key_env="RLLIGHT_TEST_RM_KEY",
                                                            retries=0, timeout_seconds=5))
    server.echo = echo
    try:
        with caplog.at_level(logging.WARNING):
            values, _, failures = counted(reward, CHATS)
    finally:
        server.echo = None
    assert values == [0.0] * 3 and failures == 3 and server.requests[-1][2] == f"Bearer {SECRET}"
    [line] = [r.getMessage() for r in caplog.records if "could not score 3 of 3 samples" in r.getMessage()]
    assert "[key]" in line, line
    assert not [SECRET[i:i + 8] for i in range(len(SECRET) - 7) if SECRET[i:i + 8] in caplog.text], line


def test_an_answer_longer_than_max_answer_bytes_fails_the_batch(classifier_dir, server, caplog):
    reward = RewardModel(classifier_dir, placement=Endpoint(server.url, max_answer_bytes=50, retries=2))
    assert RewardModel(classifier_dir, placement=Endpoint(server.url)).placement.max_answer_bytes == 64 * 2 ** 20
    server.requests.clear()
    with caplog.at_level(logging.WARNING):
        values, _, failures = counted(reward, CHATS)
    assert values == [0.0] * 3 and failures == 3 and len(server.requests) == 1  # not retried
    assert "answered /pooling with more than max_answer_bytes=50 bytes" in caplog.text


@pytest.mark.parametrize(("placement", "field"), [
    (lambda: Endpoint("http://127.0.0.1:1", protocol=PromptLogprobs(rows_per_request=0)),
     "protocol.init_args.rows_per_request"),
    (lambda: Endpoint("127.0.0.1:8000"), "url"),
    (lambda: Endpoint(None), "url"),
    (lambda: Endpoint("http://127.0.0.1:8000/pooling"), "url"),  # the base URL: the protocol appends /pooling
    (lambda: Endpoint("http://h", api_key_env="sk-secret value"), "api_key_env"),
    (lambda: Endpoint("http://h", retries=-1), "retries"),
    (lambda: Worker(timeout_seconds=0), "timeout_seconds"),
])
def test_a_bad_placement_setting_is_one_line_naming_it(placement, field):
    with pytest.raises(RecipeError) as err:
        RewardModel("any/model", placement=placement())
    assert str(err.value).startswith(f"model.reward.init_args.placement.init_args.{field}") \
        and "\n" not in str(err.value), str(err.value)


# ------------------------------------------------------------------------------------------------- the recipe
def test_the_reward_model_recipe_trains_on_the_classifiers_score_and_counts_the_exact_match(tmp_path, tiny_model_dir,
                                                                                          classifier_dir):
    """recipes/reward-model-quickstart.yaml on the tiny model, its reward model the tiny classifier: two steps whose
    logged reward is the classifier's score (weight 1) and whose accuracy is the exact match's (weight 0)."""
    import os

    import yaml
    from conftest import RECIPES
    from helpers import build, tiny_overrides

    recipe = yaml.safe_load(open(os.path.join(RECIPES, "reward-model-quickstart.yaml")))
    reward = recipe["model"]["reward"]
    reward["init_args"]["rewards"]["rm"]["init_args"].update(model=classifier_dir, dtype="float32")
    overlay = tmp_path / "rm.yaml"
    overlay.write_text(yaml.safe_dump({"model": {"reward": reward}}))
    cli = build(os.path.join(RECIPES, "reward-model-quickstart.yaml"), tiny_overrides(tmp_path, tiny_model_dir),
                str(overlay))
    assert cli.model.reward.weights == {"rm": 1.0, "exact": 0.0}
    cli.trainer.fit(cli.model, cli.datamodule)
    logged = {k: float(v) for k, v in cli.trainer.callback_metrics.items()}
    assert logged["train/reward/mean"] == pytest.approx(logged["train/reward/rm"], abs=1e-5)
    assert logged["train/reward/rm"] != 0.0  # the classifier's logits, not a verifier's 0/1
    assert logged["train/reward/accuracy"] == pytest.approx(logged["train/reward/exact"], abs=1e-5)
