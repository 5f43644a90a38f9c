"""VLLMServerEngine: generation from a vLLM server process addressed by URL (its OpenAI-compatible API), weight
pushes through a shared folder with a version the server reports back, and faults as one line.

The server runs on this machine (``python -m vllm.entrypoints.openai.api_server`` on the tiny model, CPU) and
the tests skip when vLLM is not installed; the option checks need no server."""

import copy
import json
import socket
import time
import urllib.request

import pytest
import torch
from helpers import fit_in_child, free_port, tiny_overrides, vllm_server

from rllight.errors import ComponentError, RecipeError
from rllight.models import HFModel
from rllight.module import RLModule
from rllight.rollout.metrics import logprob_mismatch
from rllight.rollout.remote import VLLMServerEngine
from rllight.serving import Endpoint
from rllight.testing import build_tiny_model

ROWS = [{"messages": [{"role": "user", "content": "What is 1 + 2?" + " 3" * k}], "answer": "3"} for k in range(4)]


def test_bad_options_are_one_line_errors(tmp_path):
    (tmp_path / "file").write_text("x")
    key = r"^model\.rollout\.init_args\."
    for url, kwargs, needle in [("gen-node:8000", {}, key + "server.init_args.url must be the server's URL, starting "
                                                            "with http"),
                                ("http://x", {"sync_every": 0},
                                 r"^VLLMServerEngine\.sync_every must be an integer >= 1, got 0$"),  # declared bound
                                ("http://x", {"weights_dir": str(tmp_path / "file")}, key + "weights_dir")]:
        with pytest.raises(RecipeError, match=needle):
            VLLMServerEngine(Endpoint(url), **kwargs)


def test_a_server_that_does_not_answer_is_one_line_naming_the_url(tiny_model_dir):
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    module = RLModule(HFModel(tiny_model_dir),
                      rollout=VLLMServerEngine(Endpoint(f"http://127.0.0.1:{port}", timeout_seconds=5, retries=0),
                                               weights_dir=None, model="served"))
    module.configure_model()
    with pytest.raises(RecipeError, match="weights_dir is not set"):
        module.producer.sample(ROWS[:1], n=1)
    module.rollout.weights_dir = "unused"
    module.rollout._version = 0  # as if pushed: the first request then is the generation itself
    with pytest.raises(RuntimeError, match=rf"^model\.rollout: no answer from the vLLM server at http://127\.0\.0\.1:"
                                           rf"{port} to /weight_info") as err:
        module.producer.sample(ROWS[:1], n=1)
    assert "\n" not in str(err.value)


# ------------------------------------------------------------------------------ faulty servers (no vLLM)
class FakeServer:
    """A web server on a free local port that answers every route in one faulty way (``mode``): ``html`` (an
    HTML page with status 200), ``500`` (an internal error), ``hang`` (never answers), ``version`` (a vLLM that
    holds weight version 7 and answers the other routes with {})."""

    def __init__(self, mode: str):
        import http.server
        import threading

        release = self.release = threading.Event()

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _answer(self):
                if mode == "hang":
                    release.wait(120)
                    return
                status, kind, body = {
                    "html": (200, "text/html", b"<html><body>Welcome to nginx!</body></html>"),
                    "500": (500, "application/json", b'{"error": "CUDA out of memory"}'),
                    "version": (200, "application/json",
                                b'{"weight_version": "7"}' if self.path == "/weight_info" else b"{}"),
                }[mode]
                self.send_response(status)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_POST = _answer

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.release.set()
        self.httpd.shutdown()
        self.httpd.server_close()


def _remote_module(model_dir, url, timeout_seconds=5.0):
    server = Endpoint(url, timeout_seconds=timeout_seconds, retries=0)
    module = RLModule(HFModel(model_dir), rollout=VLLMServerEngine(server, weights_dir="unused", model="served"))
    module.configure_model()
    module.rollout._version = 0  # as if pushed: the first request then is the generation's
    return module


@pytest.mark.parametrize("mode, message", [
    ("html", "answered /weight_info with something other than a JSON object ('<html><body>Welcome to nginx!"
             "</body></html>'); check the URL (model.rollout.init_args.server.init_args.url)"),
    ("500", 'answered /weight_info with HTTP 500 ({"error": "CUDA out of memory"}); see the server\'s log'),
    ("version", "holds weight version '7' before generating where 0 was pushed (restarted, or pushed to by "
                "another trainer); its samples are not used. Resume from the last checkpoint"),
    ("hang", "to /weight_info within timeout_seconds=2 (timed out); check that it runs and the URL"),
])
def test_a_faulty_server_is_one_line_naming_the_url_and_what_to_do(mode, message, tiny_model_dir):
    server = FakeServer(mode)
    try:
        module = _remote_module(tiny_model_dir, server.url, timeout_seconds=2.0)
        with pytest.raises(ComponentError) as err:  # "hang": the message names the 2 s timeout that ended it
            module.producer.sample(ROWS[:1], n=1)
    finally:
        server.close()
    line = str(err.value)
    assert line.startswith(f"model.rollout: ") and server.url in line and message in line, line
    assert "\n" not in line


def test_a_refused_server_ends_the_cli_with_one_line_and_exit_2(tmp_path, capsys, tiny_model_dir):
    from helpers import one_line_error

    port = free_port()  # nothing listens there
    rollout = {"class_path": "rllight.rollout.remote.VLLMServerEngine",
               "init_args": {"server": {"class_path": "rllight.serving.Endpoint",
                                        "init_args": {"url": f"http://127.0.0.1:{port}", "backoff_seconds": 0.01}},
                             "weights_dir": str(tmp_path / "weights"), "model": "served", "max_new_tokens": 4}}
    err = [one_line_error(tmp_path, tiny_model_dir, capsys, rollout=rollout)]
    assert err[-1].startswith(f"rllight: error: model.rollout: no answer from the vLLM server at "
                              f"http://127.0.0.1:{port} to /collective_rpc within timeout_seconds=600 ("), err[-1]
    assert err[-1].endswith("check that it runs and the URL (model.rollout.init_args.server.init_args.url) "
                            "(after 3 attempts)"), err[-1]


@pytest.mark.slow
def test_sigterm_is_honoured_within_seconds_while_the_server_never_answers(tmp_path, tiny_model_dir):
    """The server accepts the connection and never answers, under the default 600 s timeout: SIGTERM ends the
    run within the 5 s grace (plus the exit), exit code 143."""
    from helpers import start_fit, tiny_overrides
    from test_interrupt import stop_with_sigterm

    server = FakeServer("hang")
    try:
        rollout = {"class_path": "rllight.rollout.remote.VLLMServerEngine",
                   "init_args": {"server": {"class_path": "rllight.serving.Endpoint", "init_args": {"url": server.url}},
                                 "weights_dir": str(tmp_path / "weights"), "model": "served", "max_new_tokens": 4}}
        child = start_fit("grpo.yaml", "--config", tiny_overrides(tmp_path, tiny_model_dir, rollout=rollout))
        deadline = time.monotonic() + 300
        while not (tmp_path / "weights" / "model.safetensors").exists():  # the push, then /collective_rpc hangs
            assert child.poll() is None and time.monotonic() < deadline, child.communicate()
            time.sleep(0.2)
        time.sleep(1)
        _, out, err = stop_with_sigterm(child)  # fails the test where the process outlives 30 s of the 600
    finally:
        server.close()
    assert child.returncode == 143, err[-3000:]
    assert f"rllight: SIGTERM: stopped while waiting for the vLLM server at {server.url} (/collective_rpc)" in out


# ------------------------------------------------------------------------------ with a vLLM server
@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A vLLM OpenAI-compatible server on the tiny model (head size 32, as vLLM's CPU attention needs), float32,
    processed log-probs, the development routes on; its URL and folder."""
    pytest.importorskip("vllm")
    model_dir = build_tiny_model(str(tmp_path_factory.mktemp("tiny_server") / "model"), hidden_size=64)
    with vllm_server(model_dir, str(tmp_path_factory.mktemp("server_log") / "server.log"), "--logprobs-mode",
                     "processed_logprobs", env={"VLLM_SERVER_DEV_MODE": "1"}) as url:
        yield url, model_dir


def _trainer_logprobs(module, rollout, policy=None):
    with torch.no_grad():
        logprobs, _, _ = module.scoring.forward(rollout, policy=policy)
    return logprob_mismatch(logprobs, rollout.sample_logprobs, rollout.response_mask)["rollout/logprob_diff_max"]


@pytest.mark.vllm
def test_the_servers_samples_are_the_trainers_policy_before_and_after_a_push(server, tmp_path):
    url, model_dir = server
    engine = VLLMServerEngine(Endpoint(url), weights_dir=str(tmp_path / "weights"), max_new_tokens=8, temperature=0.7)
    module = RLModule(HFModel(model_dir), rollout=engine)
    module.configure_model()
    rollout = module.producer.sample(ROWS, n=2)
    assert (rollout.prompt_mask == 0).any()  # left-padded prompts of several lengths
    assert engine.last_metrics["rollout/policy_version"] == 0 and engine.last_metrics["rollout/tokens_per_s"] > 0
    # The first generation pushed the trainer's weights; the server's log-probs are the trainer's.
    assert _trainer_logprobs(module, rollout) < 1e-4

    before = copy.deepcopy(module.policy)
    optimizer = torch.optim.AdamW(module.policy.parameters(), lr=1e-2)
    ids = torch.arange(3, 19)[None]
    loss = -module.policy(input_ids=ids).logits.log_softmax(-1)[0, :-1].gather(-1, ids[0, 1:, None]).mean()
    loss.backward()
    optimizer.step()
    assert "rollout/sync_time" in engine.update_weights(module.policy)
    rollout = module.producer.sample(ROWS, n=2)
    assert engine.last_metrics["rollout/policy_version"] == 1 and engine.last_metrics["rollout/staleness"] == 0
    assert _trainer_logprobs(module, rollout) < 1e-4
    assert _trainer_logprobs(module, rollout, policy=before) > 1e-2  # the push really moved the server

    # Another trainer (here: a direct request) changes the server's version: detected, not trusted.
    request = urllib.request.Request(f"{url}/update_weight_version", data=json.dumps({"new_version": "99"}).encode(),
                                     headers={"Content-Type": "application/json"})
    urllib.request.urlopen(request, timeout=30).read()
    with pytest.raises(RuntimeError, match=r"^model\.rollout: the vLLM server at .* holds weight version '99' "
                                           r"before generating where 1 was pushed") as err:
        module.producer.sample(ROWS, n=1)
    assert "\n" not in str(err.value)


def test_raw_log_probs_from_a_server_are_detected(tiny_model_dir):
    """A server started without --logprobs-mode processed_logprobs returns log-probs before temperature: the
    first sampled generation is checked against the trainer's forward pass (here with log-probs computed both
    ways by the trainer itself, as the two kinds of server would send them)."""
    from rllight.rollout.base import Generation

    module = RLModule(HFModel(tiny_model_dir),
                      rollout=VLLMServerEngine(Endpoint("http://127.0.0.1:1"), weights_dir=None, temperature=0.5))
    module.configure_model()
    engine, policy = module.rollout, module.policy
    prompt, response = [1, 5, 6, 7], torch.tensor([9, 12, 4])
    with torch.no_grad():
        logits = policy(input_ids=torch.tensor([prompt + response.tolist()])).logits[0, len(prompt) - 1 : -1]

    def generation(scale: float) -> Generation:
        logprobs = (logits / scale).log_softmax(-1).gather(-1, response[:, None])[:, 0]
        return Generation(torch.tensor([prompt]), torch.ones(1, 4, dtype=torch.long), response[None],
                          torch.ones(1, 3, dtype=torch.long), logprobs[None], torch.tensor([True]))

    with pytest.raises(RuntimeError, match="returns raw log-probs; start it with --logprobs-mode processed_logprobs"):
        engine._check_processed_logprobs(policy, prompt, generation(1.0), 0.5)
    assert not engine._checked_logprobs
    engine._check_processed_logprobs(policy, prompt, generation(0.5), 0.5)
    assert engine._checked_logprobs


@pytest.mark.vllm
def test_asynchronous_generation_from_the_server_is_the_old_policys_and_tagged(server, tmp_path):
    url, model_dir = server
    engine = VLLMServerEngine(Endpoint(url), weights_dir=str(tmp_path / "weights"), max_new_tokens=8,
                              temperature=0.7, max_staleness=1)
    module = RLModule(HFModel(model_dir), rollout=engine)
    module.configure_model()
    module.producer.prefetch(ROWS, 2)  # sent now, with the trainer's weights (pushed first)
    before = copy.deepcopy(module.policy)
    optimizer = torch.optim.AdamW(module.policy.parameters(), lr=1e-2)
    ids = torch.arange(3, 19)[None]
    (-module.policy(input_ids=ids).logits.log_softmax(-1)[0, :-1].gather(-1, ids[0, 1:, None]).mean()).backward()
    optimizer.step()
    assert engine.update_weights(module.policy) == {}  # pushed with the next request
    rollout = module.producer.sample(ROWS, n=2)
    metrics = engine.last_metrics
    assert (metrics["rollout/generated_ahead"], metrics["rollout/policy_version"], metrics["rollout/staleness"]) \
        == (1, 0, 1)
    assert _trainer_logprobs(module, rollout, policy=before) < 1e-4  # the behaviour log-probs are the server's
    rollout = module.producer.sample(ROWS, n=2)  # nothing ahead: the update is pushed, then it generates
    assert (engine.last_metrics["rollout/generated_ahead"], engine.last_metrics["rollout/policy_version"]) == (0, 1)
    assert _trainer_logprobs(module, rollout) < 1e-4


@pytest.mark.slow
@pytest.mark.vllm
def test_two_fsdp_ranks_share_one_server_and_each_samples_its_trainers_policy(server, tmp_path):
    """All ranks share one vLLM server: two FSDP processes each send their own prompts, tagged with their rank. A
    push is made once per update (the ranks gather the weights together, rank 0 writes and loads them), and
    every step each rank's sampled log-probs are its trainer's within the single-process test's tolerance; the
    server ends on the version of the last update and the ranks with the same weights."""
    url, model_dir = server
    engine = {"class_path": "rllight.rollout.remote.VLLMServerEngine",
              "init_args": {"server": {"class_path": "rllight.serving.Endpoint", "init_args": {"url": url}},
                            "weights_dir": str(tmp_path / "weights"), "max_new_tokens": 6, "temperature": 0.7}}
    overlay = tiny_overrides(tmp_path, model_dir, rollout=engine)
    run = fit_in_child("grpo.yaml", "--config", overlay, "--trainer.strategy", "{class_path: rllight.fsdp.FSDP}",
                       "--trainer.devices", "2", "--trainer.callbacks+", "user_strategies.DumpState",
                       "--trainer.max_steps", "3", timeout=900, RLLIGHT_TEST_DUMP=str(tmp_path / "rank{rank}.pt"),
                       RLLIGHT_TEST_LOGPROB_GAP="1")
    assert run.returncode == 0, run.stderr[-4000:]
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in (0, 1))
    for name, p in r0["params"].items():
        torch.testing.assert_close(r1["params"][name], p, rtol=0, atol=0, msg=name)
    assert r0["prompts"] != r1["prompts"]
    for rank, record in enumerate((r0, r1)):
        assert len(record["logprob_gap"]) == 3 and max(record["logprob_gap"]) < 1e-4, record["logprob_gap"]
        assert len(set(record["request_ids"])) == 3, record["request_ids"]
        assert all(tag.startswith(f"cmpl-rllight-rank{rank}-") for tag in record["request_ids"]), record
    with urllib.request.urlopen(f"{url}/weight_info", timeout=30) as answer:
        assert json.loads(answer.read())["weight_version"] == str(r0["final_step"]) != "0"
    # Under FSDP the engine cannot run a forward pass of its own to check the server's log-prob mode: it says so.
    assert run.stderr.count("is not checked for processed log-probs under FSDP") == 2, run.stderr[-4000:]
