"""``rllight.serving.http``, the one client of judges, reward-model servers, a teacher's and a rollout's vLLM server:
against a scripted server on 127.0.0.1, what is retried and what is not, the backoff and ``Retry-After``, the key
sent as a bearer token and redacted from every quoted text, and the one-line key errors."""

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from helpers import free_port

from rllight.errors import RecipeError
from rllight.serving.http import Failure, JSONClient, check_key_env, read_key

KEY = "sk-test-0123456789"


class Scripted:
    """Answers each request with the next ``(status, text, headers)`` of ``script`` (the last one repeats); ``None``
    hangs until the test ends."""

    def __init__(self, script):
        self.script, self.auth, self.bodies, self.stop = list(script), [], [], threading.Event()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def _answer(self):
                length = int(self.headers.get("Content-Length") or 0)
                fake.bodies.append(json.loads(self.rfile.read(length)) if length else None)
                fake.auth.append(self.headers.get("Authorization"))
                step = fake.script.pop(0) if len(fake.script) > 1 else fake.script[0]
                if step is None:
                    fake.stop.wait(30)
                    return
                status, text, headers = step
                data = text.encode()
                self.send_response(status)
                for k, v in headers.items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = _answer

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/route"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.stop.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def serve():
    servers = []

    def start(*script):
        servers.append(Scripted(script))
        return servers[-1]

    yield start
    for s in servers:
        s.close()


def test_server_errors_are_retried_with_a_doubling_backoff_and_the_key_as_bearer(serve):
    fake = serve((503, "busy", {}), (500, "", {}), (200, '{"ok": 1}', {}))
    waits = []
    answer = JSONClient(5, retries=2, backoff_seconds=0.5).call(fake.url, {"x": 1}, KEY, wait=waits.append)
    assert answer == {"ok": 1}
    assert waits == [0.5, 1.0]
    assert fake.auth == [f"Bearer {KEY}"] * 3 and fake.bodies == [{"x": 1}] * 3


def test_a_client_error_is_not_retried_and_its_text_has_the_key_redacted(serve):
    fake = serve((401, f"bad key {KEY} for this route", {}))
    with pytest.raises(Failure) as caught:
        JSONClient(5, retries=3, backoff_seconds=0).call(fake.url, {}, KEY, wait=lambda s: None)
    failure = caught.value
    assert (failure.kind, failure.status, failure.attempts, failure.retryable) == ("status", 401, 1, False)
    assert failure.detail == "bad key [key] for this route" and KEY not in str(failure)
    assert len(fake.auth) == 1


def test_retry_after_is_honoured_up_to_twice_the_backoff(serve):
    fake = serve((429, "", {"Retry-After": "0.25"}), (429, "", {"Retry-After": "100"}), (200, "{}", {}))
    waits = []
    JSONClient(5, retries=2, backoff_seconds=1.0).call(fake.url, {}, wait=waits.append)
    assert waits == [0.25, 4.0]  # the server's 0.25 s; then 100 s capped at twice the backoff of 2 s


def test_an_answer_that_is_not_a_json_object_is_not_retried(serve):
    fake = serve((200, "<html>hello</html>", {}))
    with pytest.raises(Failure) as caught:
        JSONClient(5, retries=2, backoff_seconds=0).call(fake.url, {}, wait=lambda s: None)
    assert (caught.value.kind, caught.value.detail, caught.value.attempts) == ("not_json", "<html>hello</html>", 1)
    assert len(fake.bodies) == 1


def test_a_hung_server_times_out_each_attempt_and_a_refused_one_is_unreachable(serve):
    fake = serve(None)
    with pytest.raises(Failure) as caught:
        JSONClient(0.3, retries=1, backoff_seconds=0).call(fake.url, {}, wait=lambda s: None)
    assert (caught.value.kind, caught.value.attempts) == ("timeout", 2)
    with pytest.raises(Failure) as caught:
        JSONClient(2).once(f"http://127.0.0.1:{free_port()}/route", {})
    assert caught.value.kind == "unreachable" and caught.value.retryable


def test_a_wait_that_says_stop_and_a_before_that_raises_end_the_retries(serve):
    fake = serve((503, "busy", {}))
    with pytest.raises(Failure) as caught:
        JSONClient(5, retries=5, backoff_seconds=0).call(fake.url, {}, wait=lambda s: True)
    assert caught.value.attempts == 1 and len(fake.bodies) == 1

    def before(attempt):
        if attempt == 2:
            raise TimeoutError("the batch's bound")
        return 5.0

    with pytest.raises(TimeoutError):
        JSONClient(5, retries=5, backoff_seconds=0).call(fake.url, {}, wait=lambda s: None, before=before)
    assert len(fake.bodies) == 3


def test_get_without_a_body_and_an_empty_answer_where_it_is_allowed(serve):
    fake = serve((200, "", {}))
    assert JSONClient(5).once(fake.url, empty={}) == {}
    assert fake.bodies == [None] and fake.auth == [None]
    with pytest.raises(Failure) as caught:
        JSONClient(5).once(fake.url)
    assert caught.value.kind == "not_json"


def test_key_settings_are_one_line_errors(monkeypatch):
    monkeypatch.delenv("RLLIGHT_TEST_KEY", raising=False)
    with pytest.raises(RecipeError, match=r"^model.reward.init_args.api_key_env: the environment variable "
                                          r"RLLIGHT_TEST_KEY is not set \(or empty\); export it with the judge's API "
                                          r"key before the run$"):
        read_key("RLLIGHT_TEST_KEY", "model.reward.init_args", "the judge's")
    monkeypatch.setenv("RLLIGHT_TEST_KEY", KEY)
    assert read_key("RLLIGHT_TEST_KEY", "x", "the judge's") == KEY and read_key(None, "x", "y") is None
    with pytest.raises(RecipeError, match="must be the NAME of an environment variable"):
        check_key_env(KEY, "model.reward.init_args")
    check_key_env("JUDGE_API_KEY", "x")
