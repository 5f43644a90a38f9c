"""``rllight.serving.http``, the one client of judges, reward-model servers, a teacher's and a rollout's vLLM server:
against a scripted server on 127.0.0.1, what is retried and what is not, the backoff and ``Retry-After``, the key
sent as a bearer token and no 8 characters of it in any quoted text, the answers' size limit (read no further than
it), and the one-line key errors that never print a key given where a variable's name goes."""

import json
import threading
import tracemalloc
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from helpers import free_port

from rllight.errors import RecipeError
from rllight.serving import Endpoint
from rllight.serving.http import Failure, JSONClient, check_key_env, clip, looks_like_key, read_key, redact

KEY = "sk-test-0123456789"


class _Served:
    """A test server on 127.0.0.1 (``url``: its ``/route``) whose handler ``start`` is given; ``close`` ends a
    request held on ``stop``, then the server."""

    def start(self, handler) -> None:
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/route"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.stop.set()
        self.server.shutdown()
        self.server.server_close()


class Scripted(_Served):
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

        self.start(Handler)


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


def leaks(text: str, secret: str = KEY) -> list[str]:
    """The runs of 8 consecutive characters of ``secret`` that ``text`` holds."""
    return [secret[i:i + 8] for i in range(len(secret) - 7) if secret[i:i + 8] in text]


def test_redact_masks_every_run_of_8_characters_of_the_key_and_clip_masks_before_it_cuts():
    # KEY = "sk-test-0123456789": its 8-character runs masked wherever they stand; 7 characters are not a run.
    assert redact(f"a {KEY} b", KEY) == "a [key] b"
    assert redact(f"prefix {KEY[:9]}| suffix |{KEY[-8:]} middle |{KEY[4:13]}|", KEY) \
        == "prefix [key]| suffix |[key] middle |[key]|"
    assert redact(f"{KEY[:7]} {KEY[-7:]}", KEY) == f"{KEY[:7]} {KEY[-7:]}"
    assert redact(KEY + KEY + "x", KEY) == "[key]x"  # touching runs are one
    assert redact("abc abc", "abc") == "[key] [key]" and redact("text", None) == "text"
    # A cut at 80 characters through the key: masked first, so neither the key nor a prefix of it shows.
    text = "x" * 70 + " " + KEY + " and more words " * 20
    assert clip(text, 80, lambda t: redact(t, KEY)) == "x" * 70 + " [key] and..."
    assert not leaks(clip(text, 80, lambda t: redact(t, KEY)))


@pytest.mark.parametrize("value", [
    "sk-proj-ABCDEFGHabcdefgh12345678",  # not a name at all
    "hf_AbCdEfGhIjKlMnOpQrStUvWxYz012345",  # a known prefix, then a random tail
    "ghp_abcdefghijklmnopqrstuvwxyz0123456789",
    "AKIAIOSFODNN7EXAMPLE",
    "a1b2c3d4e5f6a7b8c9d0e1f2",  # 20 or more letters and digits, no underscore
    "Abcdefghij_klmnopqrstuvwxyz_0123456789",  # 32 or more mixing lower, upper and digits
])
def test_a_key_given_where_a_variables_name_goes_is_refused_without_printing_it(value, monkeypatch):
    assert looks_like_key(value)
    with pytest.raises(RecipeError) as err:
        check_key_env(value, "x.placement.init_args")
    assert str(err.value).startswith("x.placement.init_args.api_key_env must be the NAME of an environment variable")
    if value.isidentifier():  # set or not, the variable is not read: a message about it would name it
        monkeypatch.setenv(value, "k")
    with pytest.raises(RecipeError) as read:
        read_key(value, "x.placement.init_args", "the judge's")
    endpoint = Endpoint("http://127.0.0.1:1", api_key_env=value)
    for text in (str(err.value), str(read.value), repr(endpoint)):
        assert "\n" not in text and not leaks(text, value), text


@pytest.mark.parametrize("name", ["JUDGE_API_KEY", "HF_TOKEN", "hf_token", "hf_token_for_the_judge", "OPENAI_API_KEY_2",
                                  "MyJudgeKey", "RLLIGHT_TEST_JUDGE_KEY_NUMBER_2"])
def test_variable_names_are_taken(name):
    assert not looks_like_key(name)
    check_key_env(name, "x")
    assert f"api_key_env={name!r}" in repr(Endpoint("http://127.0.0.1:1", api_key_env=name))


class Endless(_Served):
    """A server whose 200 answer has no Content-Length: 16 MiB in 64 KiB pieces, then it holds the connection open
    until the test ends (the body never ends)."""

    def __init__(self):
        self.stop = threading.Event()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                self.send_response(200)
                self.end_headers()
                try:
                    for _ in range(256):
                        self.wfile.write(b" " * 65536)
                    fake.stop.wait(30)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client gave up

            def log_message(self, *args):
                pass

        self.start(Handler)


def test_an_answer_over_max_answer_bytes_is_given_up_at_the_limit_and_not_retried(serve):
    fake = serve((200, json.dumps({"text": "x" * 5000}), {}))  # it says its length: not read at all
    with pytest.raises(Failure) as caught:
        JSONClient(5, retries=2, max_answer_bytes=1000).call(fake.url, {}, wait=lambda s: None)
    assert (caught.value.kind, caught.value.retryable, caught.value.attempts) == ("too_large", False, 1)
    assert caught.value.detail == "longer than max_answer_bytes=1000" and len(fake.bodies) == 1
    assert JSONClient(5, max_answer_bytes=5014).once(fake.url, {}) == {"text": "x" * 5000}  # exactly the limit
    endless = Endless()  # no length said, and no end: reading stops at the limit, in memory and in time
    try:
        tracemalloc.start()
        with pytest.raises(Failure) as caught:
            JSONClient(10, max_answer_bytes=2 ** 20).once(endless.url, {})
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
        endless.close()
    assert caught.value.kind == "too_large" and peak < 8 * 2 ** 20, peak  # not the 16 MiB it sends


def test_an_error_answer_is_quoted_from_its_start_with_the_key_masked_and_keeps_its_status(serve):
    fake = serve((503, "x" * 990 + f" {KEY} " + "y" * 200_000, {}))
    with pytest.raises(Failure) as caught:
        JSONClient(5, retries=0, max_answer_bytes=100).once(fake.url, {}, KEY)
    failure = caught.value
    assert (failure.kind, failure.status, failure.retryable) == ("status", 503, True)  # the size limit is for 2xx
    assert failure.detail == "x" * 990 + " [key] yyy..." and not leaks(str(failure))
