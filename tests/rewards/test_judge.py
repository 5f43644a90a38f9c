"""The LLM judge against a fake OpenAI-compatible server on 127.0.0.1: verdicts parsed and scaled; a judge that
hangs, errors, answers garbage, too much, impossible log-probs or is slow (a byte a second) costs counted failures
within its time bound, never a hung run or a reward it did not give; the concurrency and rate limits hold; the API key
travels in the Authorization header and no 8 characters of it anywhere else, whatever the server echoes."""

from __future__ import annotations

import json
import logging
import math
import pickle
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from conftest import RECIPES

from rllight import stopping
from rllight.errors import RecipeError
from rllight.rewards import Reward, Sample, checked
from rllight.rewards.judge import LLMJudge, default_template, parse_labels, parse_scores, yes_probability
from rllight.rollout.scoring import score_samples
from rllight.serving import Endpoint

SECRET = "sk-test-J7x9-never-print-me"  # the key: asserted absent from every output
ENV = "RLLIGHT_TEST_JUDGE_KEY"


class FakeJudge:
    """A chat-completions server whose behaviour the test switches: ``reply(body, n)`` returns ``(status, text,
    headers)`` or None to hang (until the server stops); ``n`` counts requests from 1; ``drip(body)``, seconds
    between the bytes of the answer's body (0: sent at once). It records each request's arrival time, body and
    Authorization header, and the most requests in flight at once."""

    def __init__(self):
        self.reply = lambda body, n: (200, chat("Score: 7"), {})
        self.drip = lambda body: 0.0
        self.delay = 0.0
        self.arrivals, self.bodies, self.auth = [], [], []
        self.in_flight = self.max_in_flight = 0
        self.lock, self.stop = threading.Lock(), threading.Event()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with fake.lock:
                    fake.arrivals.append(time.monotonic())
                    fake.bodies.append(body)
                    fake.auth.append(self.headers.get("Authorization"))
                    fake.in_flight += 1
                    fake.max_in_flight = max(fake.max_in_flight, fake.in_flight)
                    n = len(fake.arrivals)
                held = [True]

                def release():
                    with fake.lock:
                        if held[0]:
                            fake.in_flight -= 1
                            held[0] = False

                try:
                    fake.stop.wait(fake.delay)
                    out = fake.reply(body, n)
                    if out is None:  # hang: longer than any timeout here
                        fake.stop.wait(60)
                        return
                    status, text, headers = out
                    data = text.encode()
                    release()  # answered: the client may start its next request before this thread ends
                    self.send_response(status)
                    for k, v in {"Content-Type": "application/json", **headers}.items():
                        self.send_header(k, v)
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    pause = fake.drip(body)
                    for i in range(0, len(data), 1 if pause else len(data) or 1):
                        self.wfile.write(data[i:i + 1] if pause else data)
                        self.wfile.flush()
                        if pause and fake.stop.wait(pause):
                            return
                except (BrokenPipeError, ConnectionResetError):
                    pass
                finally:
                    release()

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.stop.set()
        self.server.shutdown()
        self.server.server_close()


def leaks(text: str, secret: str = SECRET) -> list[str]:
    """The runs of 8 consecutive characters of ``secret`` that ``text`` holds."""
    return [secret[i:i + 8] for i in range(len(secret) - 7) if secret[i:i + 8] in text]


def chat(content: str, logprobs: dict | None = None) -> str:
    choice = {"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop"}
    if logprobs is not None:
        choice["logprobs"] = logprobs
    return json.dumps({"id": "chatcmpl-1", "object": "chat.completion", "choices": [choice]})


def samples(n: int, group_size: int = 1, answer: str = "42") -> list[Sample]:
    return [Sample(prompt=f"<user>What is 6*7? ({i // group_size})</user>", messages=None, response=f"resp-{i}",
                   response_ids=[1, 2], answer=answer, row={"answer": answer}, group=i // group_size)
            for i in range(n)]


@pytest.fixture
def fake():
    server = FakeJudge()
    yield server
    server.close()


@pytest.fixture
def key(monkeypatch):
    monkeypatch.setenv(ENV, SECRET)
    return SECRET


ENDPOINT = ("url", "api_key_env", "timeout_seconds", "retries", "backoff_seconds", "max_concurrency",
            "requests_per_second", "max_answer_bytes")
"""The settings of the judge's ``Endpoint``; the others are ``LLMJudge``'s."""


def judge(fake, **kwargs) -> LLMJudge:
    endpoint = {"url": fake.url, "api_key_env": ENV, "timeout_seconds": 5.0, "backoff_seconds": 0.05,
                **{k: v for k, v in kwargs.items() if k in ENDPOINT}}
    return LLMJudge(**{"model": "judge-model", **{k: v for k, v in kwargs.items() if k not in ENDPOINT}},
                    placement=Endpoint(**endpoint))


def test_scores_are_parsed_scaled_and_sent_with_the_key(fake, key):
    answers = {"resp-0": "Good.\nScore: 7", "resp-1": "**Score:** 10/10", "resp-2": "3"}
    fake.reply = lambda body, n: (200, chat(next(v for k, v in answers.items() if k in
                                                 body["messages"][0]["content"])), {})
    j = judge(fake)
    out = j.score(samples(3))
    assert out.values == [0.7, 1.0, 0.3] and out.failed == {}
    read = checked(j, samples(3), out)
    assert read.solved == [True, True, False]  # solved_at = 0.5 by default
    assert fake.auth == [f"Bearer {SECRET}"] * 3
    body = fake.bodies[0]
    assert body["model"] == "judge-model" and body["temperature"] == 0.0 and body["max_tokens"] == 512
    prompt = body["messages"][0]["content"]  # the question, the reference answer and the response are filled in
    assert "What is 6*7?" in prompt and "42" in prompt and "Score: N" in prompt
    j.close()


def test_the_question_is_the_rows_last_user_message(fake, key):
    s = Sample(prompt="<chat template>...", messages=[{"role": "system", "content": "sys"},
                                                      {"role": "user", "content": "How many legs has a spider?"}],
               response="8", response_ids=[1], answer="8", row={}, group=0)
    j = judge(fake, template="Q={question} R={response} A={answer}")
    assert j.score([s]).values == [0.7]
    assert fake.bodies[0]["messages"][0]["content"] == "Q=How many legs has a spider? R=8 A=8"


def test_a_hanging_judge_fails_its_samples_within_the_time_bound(fake, key):
    fake.reply = lambda body, n: None if "resp-1" in body["messages"][0]["content"] else (200, chat("Score: 5"), {})
    j = judge(fake, timeout_seconds=0.5, retries=1)
    out = j.score(samples(3))  # the hanging request: its timeout x (retries + 1), as its reason says
    assert out.values == [0.5, 0.0, 0.5] and list(out.failed) == [1]
    assert out.failed[1] == (f"no answer from the judge at {fake.url} to /chat/completions within timeout_seconds=0.5 "
                             f"(timed out); check that it runs and the URL "
                             f"(model.reward.init_args.placement.init_args.url) (after 2 attempts)")
    assert len([b for b in fake.bodies if "resp-1" in b["messages"][0]["content"]]) == 2
    # the next batch is scored (the pool is not left stuck)
    fake.reply = lambda body, n: (200, chat("Score: 9"), {})
    assert j.score(samples(2)).values == [0.9, 0.9]


def test_a_judge_that_drips_its_answer_fails_within_the_bound_and_its_threads_end_after_close(fake, key,
                                                                                                monkeypatch):
    fake.drip = lambda body: 1.0  # one byte a second: every read is quick, a whole answer would take minutes
    j = judge(fake, timeout_seconds=1.0, retries=0, max_concurrency=2)
    out = j.score(samples(3))  # each attempt cut at its 1 s, as the reasons say, not after the minutes of the drip
    assert out.values == [0.0] * 3 and sorted(out.failed) == [0, 1, 2]
    assert "within timeout_seconds=1 (timed out)" in out.failed[2]
    fake.drip, sent = (lambda body: 0.0), len(fake.bodies)
    assert j.score(samples(2)).values == [0.7, 0.7] and len(fake.bodies) == sent + 2  # the next batch is sent
    j.close()
    # Stopped (Ctrl-C) while its requests drip: the batch gives up at once, and after close() no thread it started
    # outlives the attempt's own deadline.
    fake.drip = lambda body: 1.0
    before = set(threading.enumerate())
    monkeypatch.setitem(stopping._stop, "Ctrl-C", time.monotonic() - stopping.STOP_GRACE_SECONDS)
    j = judge(fake, timeout_seconds=2.0, retries=0)
    with pytest.raises(stopping.Interrupted):
        j.score(samples(2))
    stopping._stop.pop("Ctrl-C")
    j.close()
    closed = time.monotonic()
    started = [t for t in set(threading.enumerate()) - before
               if t.name.startswith("rllight-endpoint") or isinstance(t, threading.Timer)]
    assert any(t.name.startswith("rllight-endpoint") for t in started)  # they were held by the dripping answers
    for t in started:
        t.join(timeout=10)
    assert not [t for t in started if t.is_alive()] and time.monotonic() - closed < 2.0 + 1.0


def test_a_stop_asked_while_the_judge_hangs_ends_the_wait_within_seconds(fake, key, monkeypatch):
    fake.reply = lambda body, n: None
    # Ctrl-C asked STOP_GRACE_SECONDS ago: the wait gives up at its next slice, not after timeout_seconds.
    monkeypatch.setitem(stopping._stop, "Ctrl-C", time.monotonic() - stopping.STOP_GRACE_SECONDS)
    with pytest.raises(stopping.Interrupted):  # not a failed sample after the 30 s timeout
        judge(fake, timeout_seconds=30.0).score(samples(2))


def test_a_server_error_is_retried_and_then_scored(fake, key):
    fake.reply = lambda body, n: (500, '{"error": "overloaded"}', {}) if n == 1 else (200, chat("Score: 8"), {})
    out = judge(fake, retries=2).score(samples(1))
    assert out.values == [0.8] and out.failed == {} and len(fake.bodies) == 2


def test_a_server_error_without_retries_is_a_counted_failure(fake, key):
    fake.reply = lambda body, n: (500, '{"error": "overloaded"}', {})
    out = judge(fake, retries=0).score(samples(1))
    assert out.values == [0.0] and len(fake.bodies) == 1
    assert out.failed[0].startswith(f"the judge at {fake.url} answered /chat/completions with HTTP 500"), out.failed


def test_429_waits_and_retries_but_another_4xx_does_not(fake, key):
    fake.reply = lambda body, n: (429, '{"error": "rate"}', {"Retry-After": "0"}) if n == 1 else (
        200, chat("Score: 6"), {})
    assert judge(fake).score(samples(1)).values == [0.6] and len(fake.bodies) == 2
    fake.bodies.clear()
    fake.reply = lambda body, n: (400, '{"error": "bad request"}', {})
    out = judge(fake, retries=3).score(samples(1))
    assert "HTTP 400" in out.failed[0] and len(fake.bodies) == 1


@pytest.mark.parametrize("text,reason", [
    (chat("I think it is fine."), "no 'Score: N' in the judge's answer"),
    ("<html>Bad gateway</html>", "answered /chat/completions with something other than a JSON object"),
    ('{"choices": []}', "has no choices[0].message.content"),
    (chat("Score: 75"), "outside 0..10"),
    (chat("Score: 1e308"), "score 1e+308 is outside 0..10"),
    (chat("Score: -2"), "outside 0..10"),
])
def test_garbage_is_a_counted_failure_with_a_reason(fake, key, text, reason):
    fake.reply = lambda body, n: (200, text, {})
    j = judge(fake)
    out = j.score(samples(2))
    assert out.values == [0.0, 0.0] and sorted(out.failed) == [0, 1] and reason in out.failed[0]
    assert len(fake.bodies) == 2  # an answer that cannot be read is not asked again
    read = checked(j, samples(2), out)
    assert read.solved == [False, False] and read.failed == out.failed


def test_a_slow_judge_within_the_timeout_is_scored(fake, key):
    fake.delay = 0.4
    out = judge(fake, timeout_seconds=3.0, retries=0).score(samples(2))
    assert out.values == [0.7, 0.7] and out.failed == {}


def test_the_concurrency_limit_holds(fake, key):
    fake.delay = 0.2
    out = judge(fake, max_concurrency=2).score(samples(8))
    assert out.values == [0.7] * 8
    assert fake.max_in_flight == 2  # parallel, and never more than the limit


def test_the_rate_limit_holds(fake, key):
    start = time.monotonic()
    out = judge(fake, max_concurrency=6, requests_per_second=10.0).score(samples(6))
    assert out.values == [0.7] * 6
    # One start per 0.1 s: only k requests may start in the first k x 0.1 s, so the k-th to reach the server
    # (from 0) came no sooner than that, however the machine delayed each on its way.
    arrivals = sorted(fake.arrivals)
    assert all(t - start >= k * 0.1 - 1e-3 for k, t in enumerate(arrivals)), [t - start for t in arrivals]
    assert arrivals[-1] - start < 0.5 + 2.0  # and not much later either


def test_group_mode_one_request_per_group_in_order(fake, key):
    def reply(body, n):
        text = body["messages"][0]["content"]
        assert "Response 1:\nresp-" in text and "Response 3:" in text and "Response 4:" not in text
        first = int(re.search(r"resp-(\d+)", text).group(1))
        if first == 0:
            return 200, chat("Reasoning...\nResponse 1: Score: 2\nResponse 2: Score: 10\nResponse 3: Score: 5"), {}
        if first == 3:
            return 200, chat("Scores: [4, 6, 8]"), {}
        return 200, chat("Response 1: Score: 2\nResponse 2: Score: 3"), {}  # one short: the group fails
    fake.reply = reply
    j = judge(fake, mode="group")
    out = j.score(samples(9, group_size=3))
    assert len(fake.bodies) == 3
    assert out.values[:6] == [0.2, 1.0, 0.5, 0.4, 0.6, 0.8] and out.values[6:] == [0.0] * 3
    assert sorted(out.failed) == [6, 7, 8] and "gives 2 scores for 3 responses" in out.failed[6]


def test_label_verdicts(fake, key):
    answers = {"resp-0": "It matches. Verdict: correct", "resp-1": "Not right; the answer is INCORRECT.",
               "resp-2": "Hmm, partially."}
    fake.reply = lambda body, n: (200, chat(next(v for k, v in answers.items() if k in
                                                 body["messages"][0]["content"])), {})
    out = judge(fake, verdict="label").score(samples(3))
    assert out.values == [1.0, 0.0, 0.0] and list(out.failed) == [2] and "none of the labels" in out.failed[2]
    assert "correct, incorrect" in fake.bodies[0]["messages"][0]["content"]


def test_yes_logprob_scores_p_yes_over_yes_and_no(fake, key):
    top = [{"token": "Yes", "logprob": math.log(0.6)}, {"token": " yes", "logprob": math.log(0.1)},
           {"token": "No", "logprob": math.log(0.2)}, {"token": "Maybe", "logprob": math.log(0.1)}]
    fake.reply = lambda body, n: (200, chat("Yes", {"content": [{"token": "Yes", "logprob": math.log(0.6),
                                                                  "top_logprobs": top}]}), {})
    out = judge(fake, verdict="yes_logprob").score(samples(1))
    assert out.values == [pytest.approx((0.6 + 0.1) / (0.6 + 0.1 + 0.2))]
    body = fake.bodies[0]
    assert body["logprobs"] is True and body["top_logprobs"] == 20 and body["max_tokens"] == 1
    fake.reply = lambda body, n: (200, chat("Yes"), {})  # a server without log-probs
    assert "no log-probs" in judge(fake, verdict="yes_logprob").score(samples(1)).failed[0]


def logprobs(top, first: dict | None = None) -> dict:
    return {"content": [{"token": "Yes", "logprob": -0.1, **(first or {}),
                         **({} if top is ... else {"top_logprobs": top})}]}


@pytest.mark.parametrize(("answer", "reason"), [
    (logprobs(...), "no list of top log-probs for its first token"),  # P(yes) = 1 from the sampled token alone
    (logprobs([]), "no list of top log-probs"),
    (logprobs("Yes: -0.1"), "no list of top log-probs"),
    (logprobs([{"token": "Yes", "logprob": "-0.1"}]), "not a token with a log-prob <= 0"),
    (logprobs([{"token": "No"}]), "not a token with a log-prob <= 0"),
    (logprobs(["Yes", -0.1]), "not a token with a log-prob <= 0"),
    (logprobs([{"token": "Yes", "logprob": 3.0}, {"token": "No", "logprob": 2.0}], {"logprob": 3.0}),
     "not a token with a log-prob <= 0"),
    (logprobs([{"token": "No", "logprob": -1.0}], {"logprob": float("nan")}), "not a token with a log-prob <= 0"),
    (logprobs([{"token": "Yes", "logprob": -0.1}, {"token": " yes", "logprob": -0.5},
               {"token": "No", "logprob": -0.7}]),  # e^-0.1 + e^-0.5 + e^-0.7 = 0.905 + 0.607 + 0.497
     "yes and no a probability of 2.01 together, more than 1"),
    (logprobs([{"token": "Yes", "logprob": math.log(0.6)}, {"token": "Maybe", "logprob": math.log(0.5)}]),
     "its listed tokens a probability of 1.1 together, more than 1"),  # the bound of an absent no would be < 0
    (logprobs([{"token": "Maybe", "logprob": -0.1}], {"token": "Maybe"}), "neither yes nor no"),
])
def test_yes_logprob_without_the_log_probs_it_needs_or_with_impossible_ones_fails_the_sample(fake, key, answer,
                                                                                              reason):
    fake.reply = lambda body, n: (200, chat("Yes", answer), {})
    j = judge(fake, verdict="yes_logprob")
    out = j.score(samples(2))
    assert out.values == [0.0, 0.0] and sorted(out.failed) == [0, 1] and reason in out.failed[0], out.failed
    read = checked(j, samples(2), out)
    assert read.solved == [False, False] and len(read.failed) == 2


def test_yes_logprob_takes_a_probability_of_zero_and_the_rounding_of_log_probs():
    top = [{"token": "Yes", "logprob": 0.0001}, {"token": "No", "logprob": float("-inf")}]  # 1.0001: rounding
    assert yes_probability({"logprobs": {"content": [{**top[0], "top_logprobs": top}]}}) == 1.0


def test_parsers():
    assert parse_scores("Score: 3\nOn reflection, Score = 4.5") == [4.5]
    assert parse_scores("Score: 1e308") == [1e308] and parse_scores("Score: 7e-1") == [0.7]  # not 1 and 7
    assert parse_scores("[1, 2]", 2) == [1.0, 2.0]
    assert parse_scores("Response 2: 9\nResponse 1: 1", 2) == [1.0, 9.0]
    assert parse_labels("Verdict: **incorrect** (not correct)", ["correct", "incorrect"]) == ["incorrect"]
    assert parse_labels('["Correct", "incorrect"]', ["correct", "incorrect"], 2) == ["correct", "incorrect"]
    assert default_template("group", "number").format(question="q", response="r", answer="a", count=3).startswith(
        "Grade 3 responses")


def test_the_key_appears_in_no_output(fake, key, caplog, capsys, tmp_path, monkeypatch):
    # An auth error whose body echoes the Authorization header (as some gateways do) fails the sample, redacted.
    # The key starts inside the 80 characters a reason quotes and ends past them: no prefix of it may show.
    fake.reply = lambda body, n: (401, json.dumps({"error": f"{'x' * 50} bad key {fake.auth[-1]}"}), {})
    j = judge(fake, retries=0)
    with caplog.at_level(logging.DEBUG):
        out = j.score(samples(2))
        fake.reply = lambda body, n: None  # and a hang, logged at debug
        judge(fake, retries=0, timeout_seconds=0.3).score(samples(1))
    assert sorted(out.failed) == [0, 1] and "HTTP 401" in out.failed[0] and "Bearer [ke" in out.failed[0]
    assert "LLM judge at" in caplog.text
    for text in [*out.failed.values(), caplog.text, repr(j), str(vars(j))]:
        assert not leaks(text), text
    assert SECRET.encode() not in pickle.dumps(j)
    copy = pickle.loads(pickle.dumps(j))
    assert copy.placement.api_key_env == ENV and copy.placement._pool is None
    # --print_config of a recipe using it: only the variable's name is a setting.
    from rllight.app.cli import main
    overlay = tmp_path / "judge.yaml"
    overlay.write_text(f"model:\n  reward:\n    class_path: rllight.rewards.judge.LLMJudge\n    init_args:\n"
                       f"      model: judge-model\n      placement:\n        class_path: rllight.serving.Endpoint\n"
                       f"        init_args: {{url: '{fake.url}', api_key_env: {ENV}}}\n")
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        main(["fit", "--config", f"{RECIPES}/quickstart.yaml", "--config", str(overlay), "--print_config"])
    printed = capsys.readouterr()
    assert exc.value.code in (0, None), printed.err
    assert "rllight.rewards.judge.LLMJudge" in printed.out and ENV in printed.out
    assert SECRET not in printed.out + printed.err


def escaped(text: str) -> str:
    return "".join(f"\\u{ord(c):04x}" for c in text)


@pytest.mark.parametrize(("verdict", "reply"), [
    # The key's first 13 characters inside the 80 a reason quotes: a cut before the mask would leave them.
    ("number", lambda auth: chat("x" * 60 + auth)),  # the judge's own words
    ("number", lambda auth: json.dumps({"choices": [], "error": "x" * 30 + auth})),  # a protocol's Malformed
    ("number", lambda auth: "<html>" + "x" * 60 + auth),  # not JSON: the transport's reason
    ("number", lambda auth: '{"choices": [], "error": "x' + escaped(auth) + '"}'),  # escaped, decoded by JSON
    ("yes_logprob", lambda auth: chat("Yes", {"content": [{"token": auth, "logprob": -0.1,
                                                           "top_logprobs": [{"token": auth, "logprob": -0.1}]}]})),
])
def test_a_200_answer_that_echoes_the_key_shows_no_8_characters_of_it(fake, key, caplog, verdict, reply):
    fake.reply = lambda body, n: (200, reply(fake.auth[-1]), {})
    j = judge(fake, verdict=verdict, retries=0)
    with caplog.at_level(logging.DEBUG):
        out = score_samples(j, samples(2))
    assert out.values == [0.0, 0.0] and sorted(out.failed) == [0, 1]
    assert "[key]" in out.failed[0] and "could not score 2 of 2 samples" in caplog.text
    for text in [*out.failed.values(), caplog.text]:
        assert not leaks(text), text


def test_an_answer_longer_than_max_answer_bytes_fails_its_sample(fake, key):
    answer = chat("Score: 7")
    fake.reply = lambda body, n: (200, answer, {})
    assert judge(fake).placement.max_answer_bytes == 8 * 2 ** 20  # the judge's default
    assert judge(fake, max_answer_bytes=len(answer)).score(samples(1)).values == [0.7]
    sent = len(fake.bodies)
    out = judge(fake, max_answer_bytes=len(answer) - 1, retries=2).score(samples(2))
    assert out.values == [0.0, 0.0] and sorted(out.failed) == [0, 1]
    assert f"answered /chat/completions with more than max_answer_bytes={len(answer) - 1} bytes" in out.failed[0]
    assert len(fake.bodies) == sent + 2  # not retried: the same answer would come again


def test_a_missing_key_variable_is_one_line_naming_it(fake, monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    j = judge(fake)  # the key is read at the first call, not when the recipe is parsed
    with pytest.raises(RecipeError, match=f"model.reward.init_args.placement.init_args.api_key_env: the environment "
                                          f"variable {ENV} is not set") as err:
        j.score(samples(1))
    assert "\n" not in str(err.value) and fake.bodies == []


@pytest.mark.parametrize("kwargs,field", [
    ({"url": "127.0.0.1:8000/v1"}, "placement.init_args.url"),
    ({"url": "http://x/v1/chat/completions"}, "placement.init_args.url"),
    ({"api_key_env": "sk-abc key"}, "placement.init_args.api_key_env"),
    ({"api_key_env": "hf_AbCdEfGhIjKlMnOpQrStUvWxYz012345"}, "placement.init_args.api_key_env"),
    ({"verdict": "stars"}, "verdict"),
    ({"mode": "group", "verdict": "yes_logprob"}, "verdict"),
    ({"labels": {"good": 1.0}}, "labels"),
    ({"verdict": "label", "labels": {}}, "labels"),
    ({"max_concurrency": 0}, "placement.init_args.max_concurrency"),
    ({"requests_per_second": 0}, "placement.init_args.requests_per_second"),
    ({"timeout_seconds": 0}, "placement.init_args.timeout_seconds"),
    ({"retries": -1}, "placement.init_args.retries"),
    ({"template": "Rate {response} with {score}"}, "template"),
    ({"template": "Rate the question {question}"}, "template"),
])
def test_bad_settings_are_one_line_naming_the_field(kwargs, field):
    endpoint = {"url": "http://127.0.0.1:1/v1", **{k: v for k, v in kwargs.items() if k in ENDPOINT}}
    with pytest.raises(RecipeError, match=rf"model\.reward\.init_args\.{re.escape(field)}") as err:
        LLMJudge(model="m", placement=Endpoint(**endpoint), **{k: v for k, v in kwargs.items() if k not in ENDPOINT})
    assert "\n" not in str(err.value)
    assert str(kwargs.get("api_key_env", "\n"))[:8] not in str(err.value)  # a key is not printed back


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"scale": 0}, "LLMJudge.scale must be a finite number > 0, got 0"),
    ({"scale": float("inf")}, "LLMJudge.scale must be a finite number > 0, got inf"),
    ({"temperature": -0.5}, "LLMJudge.temperature must be a number >= 0, got -0.5"),
    ({"max_tokens": 0}, "LLMJudge.max_tokens must be an integer >= 1, got 0"),
    ({"batch_size": True}, "LLMJudge.batch_size must be an integer >= 1, got True"),
    ({"top_logprobs": 0}, "LLMJudge.top_logprobs must be an integer >= 1, got 0"),
    ({"min_mass": 1.5}, "LLMJudge.min_mass must be a number in [0, 1], got 1.5"),
])
def test_settings_out_of_their_declared_bounds_are_one_line_naming_them(kwargs, message):
    with pytest.raises(RecipeError) as err:
        LLMJudge(model="m", placement=Endpoint("http://127.0.0.1:1/v1"), **kwargs)
    assert str(err.value) == message


def test_it_is_a_batch_reward():
    assert isinstance(LLMJudge(model="m", placement=Endpoint("http://127.0.0.1:1/v1")), Reward)
