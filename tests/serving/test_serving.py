"""``rllight.serving``: a wire protocol and a placement written in this module (no library file knows them) are
named by ``class_path`` in a recipe and used by a judge; an endpoint's attempt ends at its timeout however slowly
a server sends its answer, and a request stuck on such a server does not hold up the next batch's."""

from __future__ import annotations

import json
import threading
from types import SimpleNamespace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from conftest import RECIPES
from helpers import build, tiny_overrides
from json_server import JSONServer

from rllight.errors import RecipeError
from rllight.rewards import Sample
from rllight.serving import (Endpoint, Malformed, Placement, PromptLogprobs, Protocol, Request, ScoredText,
                             VLLMPooling)
from rllight.serving.http import Failure, JSONClient


# --------------------------------------------------------------------------------------- a user's protocol
class OllamaChat(Protocol):
    """Ollama's chat API (``POST /api/chat``, ``"stream": false``): one request per chat body, the answer's
    ``message`` turned into an OpenAI chat completion, the form a judge reads."""

    default_route = "/api/chat"

    def requests(self, inputs):
        return [Request([i], {"model": self.model, "messages": body["messages"], "stream": False,
                              "options": {"temperature": body.get("temperature", 0.0)}})
                for i, body in enumerate(inputs)]

    def parse(self, answer, request):
        content = (answer.get("message") or {}).get("content")
        if not isinstance(content, str):
            raise Malformed(f"the answer has no message.content: {answer!r}")
        return [{"choices": [{"index": 0, "message": {"role": "assistant", "content": content}}]}]


# --------------------------------------------------------------------------------------- a user's placement
class Canned(Placement):
    """Answers every chat body with ``Score: <score>``, no model anywhere (a dry run of a judge's wiring); keeps
    the bodies it was given."""

    asked: list[dict] = []

    def __init__(self, score: int = 3):
        self.score = score

    def answer(self, served, inputs):
        Canned.asked.extend(inputs)
        return [{"choices": [{"message": {"content": f"Score: {self.score}"}}]} for _ in inputs]


class Ollama(JSONServer):
    """A fake Ollama on 127.0.0.1: ``/api/chat`` answers ``Score: 8``; it keeps each request's path and body."""

    def answer(self, path: str, body: dict) -> tuple[int, dict]:
        return 200 if path == "/api/chat" else 404, {"model": "judge", "message": {"role": "assistant",
                                                                              "content": "Score: 8"}, "done": True}


SAMPLES = [Sample(prompt="What is 2 + 3?", messages=None, response=r, response_ids=[1], answer="5", row={},
                  group=0) for r in ("5", "six")]


def judge_from_recipe(tmp_path, tiny_model_dir, placement: dict):
    """The reward of ``recipes/grpo.yaml`` on the tiny model with an ``LLMJudge`` placed as ``placement`` says,
    built by the command line's parser."""
    reward = {"class_path": "rllight.rewards.LLMJudge", "init_args": {"model": "judge", "placement": placement}}
    return build(f"{RECIPES}/grpo.yaml", tiny_overrides(tmp_path, tiny_model_dir, reward=reward)).model.reward


def test_a_protocol_of_the_users_module_is_named_in_a_recipe_and_spoken(tmp_path, tiny_model_dir):
    server = Ollama()
    try:
        judge = judge_from_recipe(tmp_path, tiny_model_dir, {
            "class_path": "rllight.serving.Endpoint",
            "init_args": {"url": server.url, "max_concurrency": 1, "protocol": {"class_path": "test_serving.OllamaChat"}}})
        assert type(judge.placement.protocol) is OllamaChat
        out = judge.score(SAMPLES)
    finally:
        server.close()
    assert out.values == [0.8, 0.8] and not out.failed
    assert [path for path, *_ in server.requests] == ["/api/chat", "/api/chat"]
    body = server.requests[1][1]  # the judge's prompt in Ollama's form, the served name filled in
    assert body["model"] == "judge" and body["stream"] is False and "six" in body["messages"][0]["content"]


def test_a_placement_of_the_users_module_is_named_in_a_recipe_and_used(tmp_path, tiny_model_dir):
    Canned.asked.clear()
    judge = judge_from_recipe(tmp_path, tiny_model_dir, {"class_path": "test_serving.Canned",
                                                         "init_args": {"score": 4}})
    assert type(judge.placement) is Canned and judge.placement.where == "model.reward.init_args.placement.init_args"
    assert judge.score(SAMPLES).values == [0.4, 0.4]
    assert [b["messages"][0]["content"].count("six") for b in Canned.asked] == [0, 1]  # each sample's own prompt


def test_a_protocol_that_cannot_read_an_answer_fails_its_inputs_in_one_line():
    server = Ollama()
    try:  # vLLM's pooling protocol against Ollama: a 404 answer, then nothing is read
        endpoint = Endpoint(server.url, protocol=VLLMPooling(model="rm"), retries=0, timeout_seconds=5)
        endpoint.bind("model.reward.init_args.placement.init_args", what="the reward model")
        [failed] = endpoint.answer(None, [ScoredText("text", False)])
    finally:
        server.close()
    assert str(failed).startswith(f"the reward model at {server.url} answered /pooling with HTTP 404"), failed
    assert "\n" not in str(failed)


# ------------------------------------------------------------------------------------------- slow servers
class Trickle:
    """A server that sends its 200 answer's headers at once, then its JSON body one byte every ``pause``
    seconds (``{"ok": 1}`` padded with spaces to ``size`` bytes); to ``/fast`` or a body ``{"fast": true}`` it
    answers at once."""

    def __init__(self, size: int = 100, pause: float = 0.2):
        self.stop = threading.Event()

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                asked = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
                fast = self.path == "/fast" or asked.get("fast")
                body = b'{"ok": 1}'.ljust(0 if fast else size)
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                try:
                    for i in range(len(body)):
                        self.wfile.write(body[i:i + 1])
                        self.wfile.flush()
                        if not fast and server.stop.wait(pause):
                            return
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client gave up

            def log_message(self, *args):
                pass

        server = self
        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.http.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.http.server_address[1]}"
        threading.Thread(target=self.http.serve_forever, daemon=True).start()

    def close(self):
        self.stop.set()
        self.http.shutdown()
        self.http.server_close()


def test_an_attempt_ends_at_its_timeout_however_slowly_the_answer_comes():
    server = Trickle()  # 100 bytes, 0.2 s apart: each read is quick, the whole answer takes 20 s
    try:
        with pytest.raises(Failure) as caught:
            JSONClient(1.0).once(server.url + "/slow", {})
        assert JSONClient(1.0).once(server.url + "/fast", {}) == {"ok": 1}  # the same server, answered whole
    finally:
        server.close()
    # A socket timeout of 1 s alone would never fire (a byte comes every 0.2 s): the answer would be read whole.
    assert (caught.value.kind, caught.value.detail, caught.value.retryable) == ("timeout", "timed out", True)


class Flagged(Protocol):
    """Each input is whether the server should answer it at once; its value is the server's JSON answer."""

    default_route = "/answer"

    def requests(self, inputs):
        return [Request([i], {"fast": fast}) for i, fast in enumerate(inputs)]

    def parse(self, answer, request):
        return [answer]


def test_a_request_stuck_on_a_slow_server_does_not_hold_up_the_next_batch():
    server = Trickle(size=200)  # a slow answer would take 40 s, past any bound below
    try:
        endpoint = Endpoint(server.url, protocol=Flagged(), timeout_seconds=1.0, retries=0, max_concurrency=1)
        endpoint.bind("x.placement.init_args", what="the server")
        [stuck] = endpoint.answer(None, [False])
        # One thread: had the stuck request kept it past the next batch's bound (1 s + 5 s), these would fail.
        assert endpoint.answer(None, [True, True]) == [{"ok": 1}, {"ok": 1}]
    finally:
        server.close()
    assert f"no answer from the server at {server.url} to /answer within timeout_seconds=1 (timed out)" in str(stuck)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"retries": -1}, "x.placement.init_args.retries must be an integer >= 0, got -1"),
    ({"backoff_seconds": -1.0}, "x.placement.init_args.backoff_seconds must be a number >= 0, got -1.0"),
    ({"max_concurrency": 0}, "x.placement.init_args.max_concurrency must be an integer >= 1, got 0"),
    ({"timeout_seconds": float("inf")},
     "x.placement.init_args.timeout_seconds must be a finite number > 0 or null, got inf"),
    ({"requests_per_second": 0},
     "x.placement.init_args.requests_per_second must be a finite number > 0 or null, got 0"),
    ({"max_answer_bytes": 0}, "x.placement.init_args.max_answer_bytes must be an integer >= 1 or null, got 0"),
    ({"protocol": PromptLogprobs(rows_per_request=0)},
     "x.placement.init_args.protocol.init_args.rows_per_request must be an integer >= 1, got 0"),
])
def test_an_endpoints_declared_bounds_are_checked_when_bound_naming_its_key(kwargs, message):
    """An endpoint's key is known when its owner binds it: the bounds its annotations declare name that key."""
    with pytest.raises(RecipeError) as err:
        Endpoint("http://127.0.0.1:1", **kwargs).bind("x.placement.init_args", what="the server")
    assert str(err.value) == message


class Echoing(Protocol):
    """Each input is a request; reading an answer fails with a message that quotes the Authorization header the
    server saw, across the 300th character, where a reason is cut (a protocol's bug that prints what it was given)."""

    default_route = "/echo"

    def requests(self, inputs):
        return [Request([i], {"n": i}) for i, _ in enumerate(inputs)]

    def parse(self, answer, request):
        raise ValueError(f"{'x' * 200} {answer['auth']} {'y' * 100}")


class Echo(JSONServer):
    def answer(self, path: str, body: dict) -> tuple[int, dict]:
        return 200, {"auth": self.requests[-1][2]}


def test_every_failed_reason_has_the_key_masked_before_it_is_cut(monkeypatch):
    secret = "sk-serve-8Hq2-never-print-me"
    monkeypatch.setenv("RLLIGHT_TEST_SERVE_KEY", secret)
    server = Echo()
    try:
        endpoint = Endpoint(server.url, protocol=Echoing(), api_key_env="RLLIGHT_TEST_SERVE_KEY", retries=0,
                            timeout_seconds=5)
        endpoint.bind("x.placement.init_args", what="the server")
        failed = endpoint.answer(None, [1, 2])
    finally:
        server.close()
    assert [len(str(f)) <= 303 and "ValueError: xxx" in str(f) and "[key]" in str(f) for f in failed] == [True] * 2
    assert not [secret[i:i + 8] for i in range(len(secret) - 7) if any(secret[i:i + 8] in str(f) for f in failed)]


def test_the_answer_limit_is_the_recipes_else_the_owners_else_1_gib():
    assert Endpoint("http://127.0.0.1:1").bind("x", what="the server").max_answer_bytes == 2 ** 30
    assert Endpoint("http://127.0.0.1:1", max_answer_bytes=10).bind("x", what="the server").max_answer_bytes == 10
    owner = SimpleNamespace(what="the owner", default_timeout=5.0, default_protocol=Flagged, served_name=lambda: None)
    assert Endpoint("http://127.0.0.1:1").bind("x", owner).max_answer_bytes == 2 ** 30  # it says none
    owner.default_max_answer_bytes = 1000
    assert Endpoint("http://127.0.0.1:1").bind("x", owner).max_answer_bytes == 1000


# ------------------------------------------------------------------------------- asked once before the run
class ModelList(JSONServer):
    """An OpenAI-compatible server's model list, which takes only the key ``good``."""

    def get(self, path, authorization):
        if authorization != "Bearer good":
            return 401, {"error": {"message": "Incorrect API key provided"}}
        return 200, {"data": [{"id": "judge"}]}

    def answer(self, path, body):
        return 500, {"error": "not asked in these tests"}


@pytest.mark.parametrize("key, refused", [("good", False), ("wrong", True)])
def test_a_served_models_key_is_checked_before_the_run_in_one_request(key, refused, monkeypatch):
    from rllight.rewards import LLMJudge

    monkeypatch.setenv("JUDGE_KEY", key)
    server = ModelList()
    try:
        judge = LLMJudge(model="judge", placement=Endpoint(server.url + "/v1", api_key_env="JUDGE_KEY"))
        if refused:
            with pytest.raises(RecipeError) as err:
                judge.check()
            line = str(err.value)
            assert "\n" not in line and line.startswith(f"model.reward.init_args.placement.init_args: the judge at "
                                                        f"{server.url}/v1 answered /models with HTTP 401"), line
            assert "check model.reward.init_args.placement.init_args.api_key_env" in line, line
        else:
            judge.check()
    finally:
        server.close()
    assert [(path, body) for path, body, _ in server.requests] == [("/v1/models", None)]  # one GET, no retry


def test_a_served_model_nothing_answers_at_is_one_line_before_the_run():
    from helpers import free_port
    from rllight.rewards import RewardModel

    url = f"http://127.0.0.1:{free_port()}"
    model = RewardModel(model="rm", placement=Endpoint(url))
    with pytest.raises(RecipeError, match=rf"^model\.reward\.init_args\.placement\.init_args: no answer from the reward "
                                          rf"model at {url} to /v1/models .*check that it runs and the URL"):
        model.placement.check(model)


def test_a_server_without_the_model_list_passes_the_check_and_its_first_batch_speaks():
    class NoList(JSONServer):  # answers POSTs only: GET /v1/models is a 404
        def answer(self, path, body):
            return 200, {"data": []}

    server = NoList()
    try:
        Endpoint(server.url, protocol=PromptLogprobs(model="t")).bind("x", None, what="the teacher", timeout=5).check()
    finally:
        server.close()
    assert [path for path, _, _ in server.requests] == ["/v1/models"]
