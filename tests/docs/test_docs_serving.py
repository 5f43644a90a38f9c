"""docs/extending/serving.md runs as written: its ``my_lab.py`` (a wire protocol and a placement) is the module
``my_lab``, and its recipe lines, parsed by the command line's parser with the URL pointed at a server started here
on 127.0.0.1 (and the reward model at a tiny classifier), build owners that speak through the page's classes.

- ``ScoreServer`` under a ``RewardModel`` at an ``Endpoint``: the batch goes out in requests of
  ``texts_per_request`` texts, on the route and in the JSON the page documents, with the key as a bearer token; the
  scores come back in order; an answer without the scores fails the batch with the page's one-line reason.
- ``Cached`` under an ``LLMJudge``, wrapping an ``Endpoint``: a prompt already answered is not asked again, one that
  failed is; ``close`` and ``redact`` reach the wrapped endpoint.
- Each class's bad setting, and an unset key's variable, is one line naming its recipe key.

(The page's classes are not a 2-step run, so ``test_docs_examples.py`` leaves this page to this file.)"""

import copy
import json

import pytest
import yaml
from conftest import RECIPES
from helpers import build, one_line_error, tiny_overrides
from json_server import JSONServer
from reward_model_fixtures import make_classifier
from test_docs_examples import install_my_lab, my_lab_overlays

from rllight.errors import RecipeError
from rllight.rewards import LLMJudge, Sample
from rllight.serving import Endpoint, Failed

PAGE = "extending/serving.md"
KEY = "sk-test-0123456789"
WHERE = "model.reward.init_args.placement.init_args"


class Server(JSONServer):
    """A server on 127.0.0.1 that keeps each request's path, body and Authorization header. ``/v1/score`` answers
    ``{"results": [{"score": len(text)}, ...]}``; ``/chat/completions`` answers ``Score: 7``. ``broken`` set: the
    scores answer lacks ``results``, the chat answer is HTTP 500."""

    def __init__(self):
        self.broken = False
        super().__init__()

    def answer(self, path: str, body: dict) -> tuple[int, dict]:
        if path == "/v1/score":
            return 200, ({"oops": 1} if self.broken else {"results": [{"score": float(len(t))} for t in body["texts"]]})
        if path == "/chat/completions":
            return (500, {"error": "busy"}) if self.broken else (200, {"choices": [
                {"index": 0, "message": {"role": "assistant", "content": "Fine.\nScore: 7"}}]})
        return 404, {"error": "no such route"}


@pytest.fixture
def server():
    started = Server()
    yield started
    started.close()


@pytest.fixture
def my_lab(tmp_path, monkeypatch):
    install_my_lab(PAGE, tmp_path / "user", monkeypatch)
    import my_lab

    return my_lab


def overlay(name: str) -> dict:
    """The page's recipe lines that name ``my_lab.<name>``."""
    [text] = [o for o in my_lab_overlays(PAGE) if f"my_lab.{name}" in o]
    return yaml.safe_load(text)


def reward_from_recipe(tmp_path, tiny_model_dir, lines: dict):
    """``recipes/grpo.yaml`` on the tiny model with ``lines`` (the page's recipe lines, edited) as an overlay, built
    by the command line's parser: its reward."""
    page = tmp_path / "page.yaml"
    page.write_text(yaml.safe_dump(lines))
    return build(f"{RECIPES}/grpo.yaml", tiny_overrides(tmp_path, tiny_model_dir), str(page)).model.reward


def samples(*responses: str, question: str = "What is 2 + 3?") -> list[Sample]:
    return [Sample(prompt=f"Q: {question}\nA: ", messages=[{"role": "user", "content": question}], response=r,
                   response_ids=[1], answer="5", row={}, group=0) for r in responses]


# ----------------------------------------------------------------------------------------------- the protocol
def test_the_pages_protocol_scores_a_reward_models_batch(my_lab, server, tmp_path, tiny_model_dir, monkeypatch):
    lines = overlay("ScoreServer")
    placement = lines["model"]["reward"]["init_args"]["placement"]["init_args"]
    assert placement["protocol"]["class_path"] == "my_lab.ScoreServer" and placement["api_key_env"] == "RM_API_KEY"
    classifier = make_classifier(tmp_path / "rm", tiny_model_dir)
    lines["model"]["reward"]["init_args"]["model"] = classifier
    placement["url"], placement["protocol"]["init_args"]["texts_per_request"] = server.url, 2
    monkeypatch.setenv("RM_API_KEY", KEY)
    reward = reward_from_recipe(tmp_path, tiny_model_dir, lines)
    assert type(reward.placement.protocol) is my_lab.ScoreServer and reward.placement.protocol.route == "/v1/score"
    reward.check()  # before the policy loads: the classifier's tokenizer, the key's variable

    batch = samples("5", "it is five", "six")
    texts = [reward.text(s) for s in batch]
    assert reward.score(batch) == [float(len(text)) for text, _ in texts]  # the server's scores, in order
    # The requests run concurrently: they may arrive in either order.
    assert sorted((path, len(body["texts"]), auth) for path, body, auth in server.requests) == [
        ("/v1/score", 1, f"Bearer {KEY}"), ("/v1/score", 2, f"Bearer {KEY}")]
    [first] = [body for _, body, _ in server.requests if len(body["texts"]) == 2]
    assert first == {"model": classifier, "texts": [t for t, _ in texts[:2]],
                     "add_special_tokens": [not templated for _, templated in texts[:2]]}
    assert KEY not in repr(reward.placement) and KEY not in json.dumps(first)

    server.broken = True  # an answer without the scores: the batch fails, in one line, not retried
    with pytest.raises(Failed) as failed:
        reward.score(batch)
    assert str(failed.value).startswith(f"the reward model at {server.url} answered /v1/score: the answer has no "
                                        "list of 2 'results'"), failed.value
    assert "\n" not in str(failed.value) and len(server.requests) == 4  # 2 + 2 requests, no retry


def test_the_pages_protocol_refuses_a_bad_setting_in_one_line(my_lab, tmp_path, tiny_model_dir, capsys):
    line = one_line_error(tmp_path, tiny_model_dir, capsys, reward={
        "class_path": "rllight.rewards.RewardModel", "init_args": {"model": "any/model", "placement": {
            "class_path": "rllight.serving.Endpoint", "init_args": {
                "url": "http://127.0.0.1:9", "protocol": {"class_path": "my_lab.ScoreServer",
                                                          "init_args": {"texts_per_request": 0}}}}}})
    assert line.endswith(f"{WHERE}.protocol.init_args.texts_per_request must be an integer >= 1, got 0"), line


# ----------------------------------------------------------------------------------------------- the placement
def test_the_pages_placement_answers_a_judges_repeats_from_memory(my_lab, server, tmp_path, tiny_model_dir,
                                                                   monkeypatch):
    lines = overlay("Cached")
    inner = lines["model"]["reward"]["init_args"]["placement"]["init_args"]["inner"]
    assert inner["class_path"] == "rllight.serving.Endpoint" and inner["init_args"]["api_key_env"] == "JUDGE_API_KEY"
    inner["init_args"]["url"], inner["init_args"]["retries"] = server.url, 0
    monkeypatch.delenv("JUDGE_API_KEY", raising=False)
    judge = reward_from_recipe(tmp_path, tiny_model_dir, lines)
    assert type(judge) is LLMJudge and type(judge.placement) is my_lab.Cached
    assert type(judge.placement.inner) is Endpoint and judge.placement.inner.where == f"{WHERE}.inner.init_args"
    with pytest.raises(RecipeError) as unset:  # before the policy loads
        judge.check()
    assert str(unset.value).startswith(f"{WHERE}.inner.init_args.api_key_env: the environment variable "
                                       "JUDGE_API_KEY is not set"), unset.value
    monkeypatch.setenv("JUDGE_API_KEY", KEY)
    judge.check()  # asks the server's model list once
    assert [path for path, _, _ in server.requests] == ["/models"]
    server.requests.clear()

    assert judge.score(samples("5", "six", "5")).values == [0.7, 0.7, 0.7]
    assert len(server.requests) == 2  # "5" asked once
    assert judge.score(samples("six", "5")).values == [0.7, 0.7] and len(server.requests) == 2  # all remembered
    assert {auth for _, _, auth in server.requests} == {f"Bearer {KEY}"}

    server.broken = True  # a failure is not remembered: the prompt is asked again once the server is back
    failed = judge.score(samples("seven"))
    assert failed.values == [0.0] and "HTTP 500" in failed.failed[0] and len(server.requests) == 3
    server.broken = False
    assert judge.score(samples("seven", "5")).values == [0.7, 0.7] and len(server.requests) == 4

    assert KEY not in str(judge.placement.redact(f"echoed {KEY}"))  # the wrapped endpoint's key is redacted
    copied = copy.deepcopy(judge.placement)  # a copy carries the settings, not the answers
    assert copied._memory == {} and judge.placement._memory
    judge.close()


def test_the_pages_placement_refuses_a_bad_setting_in_one_line(my_lab):
    with pytest.raises(RecipeError) as err:
        LLMJudge(model="judge", placement=my_lab.Cached(max_entries=0))
    assert str(err.value) == f"{WHERE}.max_entries must be an integer >= 1, got 0"
    with pytest.raises(RecipeError) as err:  # the wrapped placement's settings, under its own key
        LLMJudge(model="judge", placement=my_lab.Cached(inner=Endpoint("127.0.0.1:8000")))
    assert str(err.value).startswith(f"{WHERE}.inner.init_args.url must be the server's URL"), err.value
