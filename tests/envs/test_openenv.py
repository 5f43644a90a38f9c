"""The OpenEnv adapter: episodes play a real OpenEnv server (the guessing game of ``openenv_fixtures``) through
openenv's client, token in and token out; every episode has a session of its own; a server that refuses, hangs,
dies or answers garbage costs counted episodes within a bounded time, and the run goes on; a server that cannot
start, a missing package and bad settings are one line."""

import contextlib
import copy
import gc
import http.server
import os
import pickle
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

pytest.importorskip("openenv")  # the dev extra installs it; without it only this file is skipped

import openenv_fixtures
import uvicorn
from test_environments import QUESTION, ScriptedEngine

from rllight.envs.openenv import INSTALL, OpenEnv, observation_text
from rllight.errors import RecipeError
from rllight.models import HFModel
from rllight.rewards import IntegerMatch
from rllight.rollout.episodes import ChatTurns
from rllight.rollout.producer import RolloutProducer, encode_chat, with_first_observation

SECRET_7 = {"messages": QUESTION, "answer": "-1", "seed": 7}  # the answer is not used: the server scores
RESET = "Guess my number from 0 to 9."


class HookedEngine(ScriptedEngine):
    """A ``ScriptedEngine`` that runs ``before[c]()`` before answering call c (between two turns)."""

    def __init__(self, script, eos, before):
        super().__init__(script, eos)
        self.before = before

    def generate(self, model, tokenizer, prompts, sampling):
        if len(self.calls) in self.before:
            self.before[len(self.calls)]()
        return super().generate(model, tokenizer, prompts, sampling)


def _ids(tok, text):
    return tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]


def _gone(pid):
    try:
        os.killpg(pid, 0)
    except ProcessLookupError:
        return True
    return False


def _kill(pid):
    if not _gone(pid):
        os.killpg(pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def game_url():
    """One game server for the module, started by the test (for ``url``)."""
    process, url = openenv_fixtures.start_server()
    yield url
    _kill(process.pid)
    process.wait()


@pytest.fixture(scope="module")
def served():
    """One game the adapter serves (``server``), for the module; closed at its end."""
    env = OpenEnv(server="openenv_fixtures:app", reset_from_row={"seed": "seed"}, max_turns=3, timeout_seconds=10)
    yield env
    env.close()


@contextlib.contextmanager
def _serving_here(app):
    """``app`` served by uvicorn on a thread of this process, on a free loopback port; yields its URL."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    """The tiny policy and its tokenizer, loaded once."""
    return HFModel(tiny_model_dir).load()


def _sample(env, script, tiny, rows, n, before=None):
    """``n`` episodes per row of ``env``, the model's turns being ``script`` (texts; each ends with the end
    token): ``(rollout, seconds, engine, producer, tokenizer)``."""
    policy, tok = tiny
    engine = HookedEngine([_ids(tok, text) for text in script], tok.eos_token_id, before or {})
    producer = RolloutProducer(engine, IntegerMatch(), environment=env)
    producer.bind(policy, tok)
    start = time.monotonic()
    rollout = producer.sample(rows, n)
    return rollout, time.monotonic() - start, engine, producer, tok


# ------------------------------------------------------------------------------ playing
def test_a_scripted_policy_plays_a_served_game_token_in_token_out(served, tiny):
    """``server``: the adapter serves the app. Turn 1 guesses 5 (wrong: the server's hint is the next user turn),
    turn 2 guesses 7 (right: reward 1 and done, from the server)."""
    rollout, _, engine, _, tok = _sample(served, ["5", "7"], tiny, [SECRET_7], 2)
    five, seven = _ids(tok, "5"), _ids(tok, "7")
    prompt = encode_chat(tok, with_first_observation(QUESTION, RESET))  # the reset observation joins the prompt
    hint = ChatTurns(tok).between(five, "No, higher than 5 (guess 1).")
    assert engine.calls == [[prompt] * 2, [prompt + five + hint] * 2]  # the server's observation, as rendered
    n = len(five) + len(hint) + len(seven)
    for i in range(2):
        assert rollout.response_ids[i, :n].tolist() == five + hint + seven
        assert rollout.response_mask[i, :n].tolist() == [1] * len(five) + [0] * len(hint) + [1] * len(seven)
    assert rollout.sample_logprobs[rollout.response_mask.bool()].eq(-0.5).all()  # the sampled tokens train
    assert rollout.rewards.tolist() == [1.0, 1.0] and rollout.correct.tolist() == [1.0, 1.0]
    assert rollout.truncated.tolist() == [False, False] and rollout.extras["episode/failures"] == 0.0


@pytest.mark.parametrize("correct_field, correct", [(None, [1.0] * 4 + [0.0] * 2),  # a positive final reward
                                                    ("guesses", [1.0] * 6)])  # the field, as a boolean
def test_episodes_at_once_have_sessions_of_their_own(correct_field, correct, game_url, tiny):
    """``url`` of a server the test started; six episodes, four stepped at once. The observation shown is the
    session's game number: one per episode, in every turn of it, six in all; each row's episodes get the reward
    of their own number (3: right at once; 7: at the second guess; 9: three wrong guesses end it, reward 0)."""
    env = OpenEnv(url=game_url, observation_field="game", reset_from_row={"seed": "seed"}, max_concurrency=4,
                  correct_field=correct_field, timeout_seconds=10)
    rows = [{"messages": QUESTION, "answer": "-1", "seed": seed} for seed in (3, 7, 9)]
    rollout, _, _, _, tok = _sample(env, ["3", "7", "5"], tiny, rows, 2)
    assert rollout.rewards.tolist() == [1.0, 1.0, 1.0, 1.0, 0.0, 0.0] and rollout.correct.tolist() == correct
    assert rollout.truncated.tolist() == [False] * 6 and rollout.extras["episode/turns"].tolist() == [1, 1, 2, 2, 3, 3]
    games = []
    for i in range(6):
        prompt = rollout.prompt_ids[i][rollout.prompt_mask[i].bool()].tolist()
        context = rollout.response_ids[i][rollout.context_mask[i].bool()].tolist()
        seen = re.findall(r"(?:\?\n|user\n)(\d+)<\|im_end\|>", tok.decode(prompt + context))
        assert len(seen) == rollout.extras["episode/turns"][i] and len(set(seen)) == 1, seen
        games.append(seen[0])
    assert len(set(games)) == 6
    env.close()


def test_a_session_refused_for_capacity_costs_its_episode_and_says_what_to_raise(game_url, tiny, caplog):
    """Under ``/one`` the server allows one session at a time: of a row's two episodes (reset at once, so either
    may come first), one plays and the other fails."""
    env = OpenEnv(url=f"{game_url}/one", timeout_seconds=10)
    rollout, *_ = _sample(env, ["7"], tiny, [SECRET_7], 2)
    assert sorted(rollout.rewards.tolist()) == [0.0, 1.0] and rollout.extras["episode/failures"] == 1.0
    assert "(code: CAPACITY_REACHED); each episode holds a session" in _warning(caplog)
    assert "raise max_concurrent_envs" in _warning(caplog)
    env.close()


# ------------------------------------------------------------------------------ faults
def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _warning(caplog):
    lines = [r.getMessage() for r in caplog.records if "episode(s), each ended with reward 0" in r.getMessage()]
    assert len(lines) == 1 and "\n" not in lines[0]
    return lines[0]


@pytest.mark.parametrize("timeout", [5, None])  # None: calls in the trainer's thread
def test_a_refused_connection_costs_the_episodes_at_once(timeout, tiny, caplog):
    url = f"http://127.0.0.1:{_free_port()}"  # nothing listens there
    rollout, *_ = _sample(OpenEnv(url=url, timeout_seconds=timeout), ["7"], tiny, [SECRET_7], 4)
    assert rollout.rewards.tolist() == [0.0] * 4 and rollout.extras["episode/failures"] == 4.0
    assert rollout.extras["episode/timeouts"] == 0.0  # failed at once, not at a timeout
    line = _warning(caplog)
    assert f"the OpenEnv server at {url}: reset failed: cannot open a session: ConnectionRefusedError" in line


def test_a_server_that_never_answers_costs_its_episodes_in_about_one_timeout(tiny):
    """A socket that accepts connections and never answers: the batch's four resets time out (0.5 s each),
    counted. (That the guard calls them at once is tests/envs/test_environments.py's
    test_episodes_step_at_once_up_to_the_environments_limit.)"""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(16)
        env = OpenEnv(url=f"http://127.0.0.1:{sock.getsockname()[1]}", timeout_seconds=0.5)
        rollout, *_ = _sample(env, ["7"], tiny, [SECRET_7], 4)
    assert rollout.rewards.tolist() == [0.0] * 4 and rollout.extras["episode/failures"] == 4.0
    assert rollout.extras["episode/timeouts"] == 4.0


def test_steps_that_hang_time_out_together(game_url, tiny):
    """Four episodes whose steps hang on the server (it sleeps a minute), four at once: each times out, counted,
    and the next batch on the same server plays."""
    env = OpenEnv(url=game_url, reset_from_row={"seed": "seed"}, timeout_seconds=1.0, max_concurrency=4)
    rollout, *_ = _sample(env, ["sleep"], tiny, [SECRET_7], 4)
    assert rollout.rewards.tolist() == [0.0] * 4
    assert rollout.extras["episode/failures"] == 4.0 and rollout.extras["episode/timeouts"] == 4.0
    rollout, *_ = _sample(env, ["7"], tiny, [SECRET_7], 2)
    assert rollout.rewards.tolist() == [1.0, 1.0]
    env.close()


def test_a_served_server_that_dies_between_turns_costs_its_episodes_and_starts_again(served, tiny, caplog):
    """The server process is killed after turn 1's step: turn 2's steps fail at once (the connection closed);
    the next batch's first ``spawn`` starts the server again, and ``close`` stops its process group."""
    old = served._runtime.box.get("process")  # None when this test runs alone

    def kill():  # and wait until it is dead, not dying: a process whose sockets closed may not have exited yet
        _kill(served._runtime.box["process"].pid)
        assert served._runtime.box["process"].exit_code(wait_seconds=10) == -signal.SIGKILL

    kill = {1: kill}
    rollout, *_ = _sample(served, ["5", "7"], tiny, [SECRET_7], 2, before=kill)
    assert rollout.rewards.tolist() == [0.0, 0.0] and rollout.extras["episode/failures"] == 2.0
    assert rollout.extras["episode/timeouts"] == 0.0  # the closed connection failed them at once
    assert "step failed: the connection closed" in _warning(caplog)
    rollout, *_ = _sample(served, ["5", "7"], tiny, [SECRET_7], 2)
    assert rollout.rewards.tolist() == [1.0, 1.0]
    restarted = re.search(r"exited \(exit code -9; it printed last: .*, its output: (\S+)\); starting it again",
                          caplog.text)
    os.remove(restarted.group(1))  # the dead server's output is kept for the user to read
    pid = served._runtime.box["process"].pid
    served.close()
    assert _gone(pid) and "process" not in served._runtime.box


class _NotWebSocket(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b"hello, this is not a WebSocket")

    def log_message(self, *args):
        pass


@pytest.mark.parametrize("garbage, message", [
    ("http", "reset failed: cannot open a session: InvalidMessage: did not receive a valid HTTP response"),
    ("not-json", "reset failed: it answered something that is not JSON"),
    ("wrong-shape", "reset failed: it answered an observation that is str, not a JSON object"),
])
def test_a_server_that_answers_garbage_costs_the_episodes(garbage, message, tiny, caplog):
    with contextlib.ExitStack() as stack:
        if garbage == "http":  # a plain HTTP server
            server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _NotWebSocket)
            threading.Thread(target=server.serve_forever, daemon=True).start()
            stack.callback(server.shutdown)
            url = f"http://127.0.0.1:{server.server_address[1]}"
        else:  # a WebSocket server
            url = f"{stack.enter_context(_serving_here(openenv_fixtures.garbage_app))}/{garbage}"
        env = OpenEnv(url=url, timeout_seconds=5)
        rollout, *_ = _sample(env, ["7"], tiny, [SECRET_7], 2)
        env.close()
    assert rollout.rewards.tolist() == [0.0, 0.0] and rollout.extras["episode/failures"] == 2.0
    assert message in _warning(caplog) and rollout.extras["episode/timeouts"] == 0.0  # not a 5 s timeout


@pytest.mark.parametrize("app, reason", [
    ("openenv_fixtures:no_such_app", "AttributeError: module 'openenv_fixtures' has no attribute 'no_such_app'"),
    ("openenv_fixtures:failing_app", "RuntimeError: the game board is missing"),
    ("openenv_fixtures:hanging_app", "it did not accept connections within 2 s"),
])
def test_a_server_that_cannot_start_is_one_line_naming_it(app, reason):
    # 2 s for the app that never listens; the others fail by themselves, however long a busy machine takes to start
    env = OpenEnv(server=app, startup_timeout_seconds=2 if "hanging" in app else 120)
    with pytest.raises(RecipeError) as err:
        env.spawn()
    line = str(err.value)
    assert line.startswith(f"model.environment.init_args.server={app!r}: the OpenEnv server did not start")
    assert reason in line and "\n" not in line
    assert "process" not in env._runtime.box
    log_path = line.rsplit("(its output: ", 1)[1].rstrip(")")
    os.remove(log_path)  # kept for the user to read
    env.close()


def test_the_server_stops_when_its_object_is_collected_or_the_process_exits():
    env = OpenEnv(server="openenv_fixtures:garbage_app")
    env.spawn()
    pid = env._runtime.box["process"].pid
    del env
    gc.collect()
    assert _gone(pid)
    code = ("from rllight.envs.openenv import OpenEnv; env = OpenEnv(server='openenv_fixtures:garbage_app'); "
            "env.spawn(); print(env._runtime.box['process'].pid)")  # and exit without close()
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert _gone(int(done.stdout.split()[-1]))


# ------------------------------------------------------------------------------ settings
def test_a_missing_package_is_one_line_with_the_install_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "openenv", None)
    with pytest.raises(RecipeError) as err:
        OpenEnv(url="http://127.0.0.1:8000")
    assert str(err.value) == f"model.environment.init_args needs OpenEnv, which is not installed: {INSTALL}"
    assert "bash tools/install.sh openenv (in the rllight clone" in str(err.value)


@pytest.mark.parametrize("kwargs, key", [
    ({}, "url and model.environment.init_args.server are both unset: set exactly one"),
    ({"url": "http://h:1", "server": "m:app"}, "url and model.environment.init_args.server are both set"),
    ({"url": "localhost:8000"}, "url must be the http:// or https:// URL"),
    ({"url": "ftp://host/x"}, "url must be the http:// or https:// URL"),
    ({"server": "module_without_app"}, "server must be the import path"),
    ({"url": "http://h:1", "action_field": ""}, "action_field must be a field name"),
    ({"url": "http://h:1", "observation_field": 3}, "observation_field must be a field name"),
    ({"url": "http://h:1", "action_args": {"message": "x"}}, "action_args sets 'message'"),
    ({"url": "http://h:1", "reset_args": [1]}, "reset_args must be a mapping"),
    ({"url": "http://h:1", "reset_from_row": {"seed": 1}}, "reset_from_row maps"),
])
def test_bad_settings_are_one_line_naming_the_key(kwargs, key):
    with pytest.raises(RecipeError) as err:
        OpenEnv(**kwargs)
    assert str(err.value).startswith(f"model.environment.init_args.{key}") and "\n" not in str(err.value)


@pytest.mark.parametrize("kwargs, message", [
    ({"startup_timeout_seconds": 0}, "OpenEnv.startup_timeout_seconds must be a number > 0, got 0"),
    ({"max_concurrency": 0}, "OpenEnv.max_concurrency must be an integer >= 1, got 0"),
    ({"timeout_seconds": float("inf")}, "OpenEnv.timeout_seconds must be a finite number > 0 or null, got inf"),
])
def test_settings_out_of_their_declared_bounds_are_one_line_naming_the_parameter(kwargs, message):
    with pytest.raises(RecipeError) as err:
        OpenEnv(url="http://h:1", **kwargs)
    assert str(err.value) == message


def test_constructors_start_nothing_and_copies_carry_the_settings_only():
    served = OpenEnv(server="openenv_fixtures:app")
    assert served._runtime.loop is None and served._runtime.box == {} and served._runtime.url is None
    env = OpenEnv(url="http://127.0.0.1:1", action_args={"tool": "guess"}, timeout_seconds=1)
    env.spawn()  # starts the loop thread, which neither a copy nor a pickle carries
    for other in (copy.deepcopy(env), pickle.loads(pickle.dumps(env))):
        assert other.action_args == {"tool": "guess"} and other._runtime is not env._runtime
        assert other._runtime.loop is None
    env.close()


def test_observation_text_reads_the_field_or_the_text_or_the_json():
    assert observation_text({"prompt": "p", "text": "t"}) == "p"
    assert observation_text({"echoed_message": "hi", "length": 2}) == "hi"  # the only text field
    assert observation_text({"board": [1, 2], "turn": 3}) == '{"board": [1, 2], "turn": 3}'
    assert observation_text({"a": {"b": 4}}, "a.b") == "4"
    with pytest.raises(ValueError, match=r"no field 'x' \(observation_field\), only \['a'\]"):
        observation_text({"a": 1}, "x")
