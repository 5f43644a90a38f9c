"""The distillation teacher at a server (``TeacherLogprobs(placement=Endpoint(...))``): its log-probs equal the
in-process teacher's
on the same rollout (a fake OpenAI-compatible server that computes them with the same tiny teacher, and a real vLLM
server), a 5xx is retried, a server that stays down or refuses stops the step in one line naming the URL, no
weights load in the trainer, a temperature other than 1 is refused in one line, and log-probs it answers that cannot
be trained on (above 0, NaN, -inf) cost their samples, counted, or end the run in one line naming the URL, saved."""

from __future__ import annotations

import http.server
import json
import logging
import math
import os
import threading
from types import SimpleNamespace

import pytest
import torch
import yaml
from conftest import RECIPES
from helpers import free_port, tiny_overrides, vllm_server
from transformers import AutoModelForCausalLM, AutoTokenizer

from rllight.app.cli import main
from rllight.callbacks import RolloutContext, TeacherLogprobs
from rllight.callbacks.distillation import TEACHER_LOGPROBS
from rllight.errors import ComponentError, RecipeError
from rllight.models import HFModel
from rllight.serving import Endpoint, PromptLogprobs
from rllight.stopping import clear_stop, ending
from rllight.testing import build_tiny_model
from rllight.types import Rollout

_TRAINER = SimpleNamespace(strategy=SimpleNamespace(root_device=torch.device("cpu")))


def _module_without_source() -> SimpleNamespace:
    """An RLModule as ``check_before_fit`` reads it, with no policy to compare tokenizers with."""
    return SimpleNamespace(source=None, rollout=SimpleNamespace(temperature=1.0))


def _module(policy_dir: str, temperature: float = 1.0) -> SimpleNamespace:
    """What ``setup`` reads of the RLModule: the policy's source and the engine's temperature."""
    return SimpleNamespace(source=HFModel(policy_dir), rollout=SimpleNamespace(temperature=temperature))


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory) -> str:
    """A second tiny model of the policy's tokenizer (the BPE is trained on the same corpus), other weights."""
    return build_tiny_model(str(tmp_path_factory.mktemp("url_teacher") / "model"), seed=1)


def _rollout(policy_dir: str) -> Rollout:
    """Four rows: prompts of several lengths (left-padded), responses of several lengths (right-padded), one of
    them masked out before its end (as a loss mask leaves it), one wholly masked (as the overlong filter does)."""
    tokenizer = AutoTokenizer.from_pretrained(policy_dir)
    prompts = [tokenizer("What is 3 + 4?")["input_ids"], tokenizer("1 + 2")["input_ids"],
               tokenizer("What is 12 + 9?")["input_ids"], tokenizer("7")["input_ids"]]
    responses = [tokenizer(" 7")["input_ids"] + [tokenizer.eos_token_id], tokenizer("The answer is 3")["input_ids"],
                 tokenizer("21")["input_ids"], tokenizer("8 8 8")["input_ids"]]
    pad, p, t = tokenizer.pad_token_id, max(map(len, prompts)), max(map(len, responses))
    response_mask = torch.tensor([[1] * len(x) + [0] * (t - len(x)) for x in responses])
    response_mask[1, len(responses[1]) - 2 :] = 0  # its last two tokens
    response_mask[3] = 0
    n = len(prompts)
    return Rollout(prompt_ids=torch.tensor([[pad] * (p - len(x)) + x for x in prompts]),
                   prompt_mask=torch.tensor([[0] * (p - len(x)) + [1] * len(x) for x in prompts]),
                   response_ids=torch.tensor([x + [pad] * (t - len(x)) for x in responses]),
                   response_mask=response_mask, sample_logprobs=torch.zeros(n, t),
                   truncated=torch.zeros(n, dtype=torch.bool), group_ids=torch.arange(n) // 2, answers=[""] * n,
                   texts=[""] * n)


def _in_process(teacher_dir: str, policy_dir: str, rollout: Rollout) -> torch.Tensor:
    callback = TeacherLogprobs(HFModel(teacher_dir), micro_batch_size=2)
    callback.setup(_TRAINER, _module(policy_dir), "fit")
    return callback.on_rollout(None, RolloutContext(), rollout).extras[TEACHER_LOGPROBS]


class FakeTeacherServer:
    """An OpenAI-compatible server on 127.0.0.1 that answers ``POST /v1/completions`` with ``prompt_logprobs`` in
    vLLM's form (``None`` first, then ``{"<id>": {"logprob", "rank", "decoded_token"}}``), computed by ``model``
    one sequence at a time, and ``GET /v1/models``. ``fail`` = the HTTP statuses of the first answers (then OK);
    ``poison`` = a log-prob answered instead of the model's at every token of each request's inputs of these
    indices (``{index: value}``; NaN and infinities are sent as Python's ``json`` writes them).
    ``requests`` records each request's route, body and Authorization header."""

    def __init__(self, model: torch.nn.Module, fail: tuple[int, ...] = (), poison: dict[int, float] | None = None):
        failures, requests = list(fail), []
        self.requests = requests

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _send(self, status: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                requests.append((self.path, None, self.headers.get("Authorization")))
                self._send(200, {"object": "list", "data": [{"id": "teacher", "object": "model"}]})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                requests.append((self.path, body, self.headers.get("Authorization")))
                if failures:
                    self._send(failures.pop(0), {"error": {"message": "busy"}})
                    return
                choices = []
                for index, ids in enumerate(body["prompt"]):
                    with torch.no_grad():
                        logprobs = model(torch.tensor([ids])).logits[0].float().log_softmax(-1)
                    bad = (poison or {}).get(index)
                    values = [float(logprobs[k - 1, token]) if bad is None else bad for k, token in enumerate(ids) if k]
                    entries = [None] + [{str(token): {"logprob": value, "rank": 1, "decoded_token": ""}}
                                        for token, value in zip(ids[1:], values)]
                    choices.append({"index": index, "text": "", "prompt_logprobs": entries, "finish_reason": "length"})
                self._send(200, {"id": "cmpl-1", "object": "text_completion", "model": body["model"],
                                 "choices": choices})

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def fake(teacher_dir, request):
    param = getattr(request, "param", ())
    fail, poison = (param, None) if isinstance(param, tuple) else ((), param)  # statuses, or {index: log-prob}
    server = FakeTeacherServer(AutoModelForCausalLM.from_pretrained(teacher_dir).eval(), fail=fail, poison=poison)
    yield server
    server.close()


def test_the_url_teachers_logprobs_are_the_in_process_teachers(tiny_model_dir, teacher_dir, fake, monkeypatch):
    rollout = _rollout(tiny_model_dir)
    expected = _in_process(teacher_dir, tiny_model_dir, rollout)

    def no_weights(*args, **kwargs):
        raise AssertionError("a URL teacher loaded weights in the trainer")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", no_weights)
    monkeypatch.setenv("TEACHER_KEY", "sk-secret")
    callback = TeacherLogprobs(HFModel(teacher_dir), micro_batch_size=2,
                               placement=Endpoint(fake.url, api_key_env="TEACHER_KEY", max_concurrency=1))
    callback.setup(_TRAINER, _module(tiny_model_dir), "fit")
    got = callback.on_rollout(None, RolloutContext(), rollout).extras[TEACHER_LOGPROBS]
    assert got.shape == rollout.response_ids.shape and got.dtype == torch.float32
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert torch.all(got[rollout.response_mask == 0] == 0) and got[0, 0] != 0
    # The served model is asked for once; 3 rows with a response token in the mask, 2 a request: 2 requests, each
    # row its unpadded prompt then its response up to its last masked-in token (row 3, wholly masked, is not sent).
    # Before that, setup's check asks the model list once (the server answers and takes the key).
    routes = [route for route, _, _ in fake.requests]
    assert routes == ["/v1/models", "/v1/models", "/v1/completions", "/v1/completions"], routes
    bodies = [body for _, body, _ in fake.requests[2:]]
    assert all(b["prompt_logprobs"] == 0 and b["max_tokens"] == 1 and b["model"] == "teacher" for b in bodies)
    prompt_1 = rollout.prompt_ids[1][rollout.prompt_mask[1].bool()].tolist()
    assert bodies[0]["prompt"][1] == prompt_1 + rollout.response_ids[1, : int(rollout.response_mask[1].sum())].tolist()
    assert [len(b["prompt"]) for b in bodies] == [2, 1]
    assert {auth for _, _, auth in fake.requests} == {"Bearer sk-secret"}
    assert "sk-secret" not in repr(callback.placement) and "sk-secret" not in repr(vars(callback.placement))


@pytest.mark.parametrize("fake", [(500, 503)], indirect=True)
def test_a_server_error_is_retried(tiny_model_dir, teacher_dir, fake):
    rollout = _rollout(tiny_model_dir)
    callback = TeacherLogprobs(HFModel(teacher_dir), micro_batch_size=8, placement=Endpoint(
        fake.url, protocol=PromptLogprobs(model="teacher"), backoff_seconds=0.01))
    got = callback.on_rollout(None, RolloutContext(), rollout).extras[TEACHER_LOGPROBS]
    torch.testing.assert_close(got, _in_process(teacher_dir, tiny_model_dir, rollout), atol=1e-5, rtol=1e-5)
    assert [route for route, _, _ in fake.requests] == ["/v1/completions"] * 3  # 500, 503, then the answer


@pytest.mark.parametrize("fake", [(500, 500, 500)], indirect=True)
def test_a_server_that_keeps_failing_stops_the_step_in_one_line(tiny_model_dir, teacher_dir, fake):
    callback = TeacherLogprobs(HFModel(teacher_dir), placement=Endpoint(
        fake.url, protocol=PromptLogprobs(model="teacher"), retries=2, backoff_seconds=0.01))
    with pytest.raises(ComponentError) as err:
        callback.on_rollout(None, RolloutContext(), _rollout(tiny_model_dir))
    line = str(err.value)
    assert "\n" not in line and line.startswith("trainer.callbacks: TeacherLogprobs: the teacher at "
                                                f"{fake.url} answered /v1/completions with HTTP 500"), line
    assert line.endswith("(after 3 attempts)") and len(fake.requests) == 3


@pytest.mark.parametrize("fake", [(400,)], indirect=True)
def test_a_client_error_is_not_retried(tiny_model_dir, teacher_dir, fake):
    callback = TeacherLogprobs(HFModel(teacher_dir), placement=Endpoint(
        fake.url, protocol=PromptLogprobs(model="teacher"), backoff_seconds=0.01))
    with pytest.raises(ComponentError, match=f"at {fake.url} answered /v1/completions with HTTP 400"):
        callback.on_rollout(None, RolloutContext(), _rollout(tiny_model_dir))
    assert len(fake.requests) == 1


def test_a_server_that_is_down_is_one_line_naming_the_url(tiny_model_dir, teacher_dir):
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    callback = TeacherLogprobs(HFModel(teacher_dir), placement=Endpoint(
        url, protocol=PromptLogprobs(model="teacher"), retries=1, backoff_seconds=0.01, timeout_seconds=5))
    with pytest.raises(ComponentError) as err:
        callback.on_rollout(None, RolloutContext(), _rollout(tiny_model_dir))
    line = str(err.value)
    assert line.startswith(f"trainer.callbacks: TeacherLogprobs: no answer from the teacher at {url} "
                           "to /v1/completions within timeout_seconds=5 ("), line
    assert line.endswith("check that it runs and the URL (trainer.callbacks: TeacherLogprobs.placement.init_args.url) "
                         "(after 2 attempts)"), line
    assert "\n" not in line


def test_a_temperature_other_than_1_is_refused_in_one_line(tiny_model_dir, teacher_dir, fake):
    url = "http://127.0.0.1:1"
    with pytest.raises(RecipeError, match=r"^trainer.callbacks: TeacherLogprobs.placement: the server's log-probs "
                                          r"are at temperature 1 \(PromptLogprobs .* not at the temperature 0.7; set"):
        TeacherLogprobs(HFModel(teacher_dir), placement=Endpoint(url), temperature=0.7)
    callback = TeacherLogprobs(HFModel(teacher_dir), placement=Endpoint(url))
    with pytest.raises(RecipeError, match="not at the engine's sampling temperature 0.7; set TeacherLogprobs"):
        callback.setup(_TRAINER, _module(tiny_model_dir, temperature=0.7), "fit")
    # Distilling at temperature 1 from an engine that samples at 0.7 is a choice the recipe states (at a server that
    # answers: setup asks it once):
    TeacherLogprobs(HFModel(teacher_dir), placement=Endpoint(fake.url), temperature=1.0).setup(
        _TRAINER, _module(tiny_model_dir, 0.7), "fit")


def test_bad_url_settings_are_one_line_errors(teacher_dir):
    key = r"^trainer\.callbacks: TeacherLogprobs\.placement\.init_args\."
    for kwargs, needle in [({"url": "teacher-node:8000"}, "url must be the server's URL, starting with http"),
                           ({"url": "http://x:8000/v1"}, r"url is the server's base URL: drop /v1"),
                           ({"url": "http://x", "api_key_env": "sk-123"}, "api_key_env must be the NAME of an "
                                                                          "environment variable"),
                           ({"url": "http://x", "timeout_seconds": 0}, "timeout_seconds"),
                           ({"url": "http://x", "retries": -1}, "retries")]:
        with pytest.raises(RecipeError, match=key + needle):
            TeacherLogprobs(HFModel(teacher_dir), placement=Endpoint(**kwargs))
    callback = TeacherLogprobs(HFModel(teacher_dir), placement=Endpoint("http://x", api_key_env="NO_SUCH_TEACHER_KEY"))
    with pytest.raises(RecipeError, match="environment variable NO_SUCH_TEACHER_KEY is not set"):
        callback.check_before_fit(_module_without_source())


# ------------------------------------------------------------------------------------------- bad log-probs
@pytest.mark.parametrize("fake,says", [({1: math.nan}, "log-probs that are not finite (NaN or infinite)"),
                                       ({1: -math.inf}, "log-probs that are not finite (NaN or infinite)"),
                                       ({1: -9999.0}, "log-probs that are not finite (NaN or infinite)"),
                                       ({1: 5.0}, "log-probs above 0 (largest 5)")], indirect=["fake"],
                         ids=["nan", "minus_inf", "vllm_minus_inf", "plus5"])
def test_a_sample_the_server_scores_badly_leaves_the_loss_counted_with_one_warning(tiny_model_dir, teacher_dir, fake,
                                                                                  says, caplog):
    rollout = _rollout(tiny_model_dir)
    expected = _in_process(teacher_dir, tiny_model_dir, rollout)
    callback = TeacherLogprobs(HFModel(teacher_dir),
                               placement=Endpoint(fake.url, protocol=PromptLogprobs(model="teacher")))
    try:
        with caplog.at_level(logging.WARNING):
            out = callback.on_rollout(None, RolloutContext(), _rollout(tiny_model_dir))
        assert ending() is None
    finally:
        clear_stop()
    got = out.extras[TEACHER_LOGPROBS]
    assert out.response_mask[1].sum() == 0 and torch.all(got[1] == 0)  # input 1 of the request: rollout row 1
    torch.testing.assert_close(got[[0, 2]], expected[[0, 2]], atol=1e-5, rtol=1e-5)
    assert out.extras["distill/bad_teacher_samples"] == 1.0
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and warned[0].startswith(
        f"trainer.callbacks: TeacherLogprobs: the teacher {teacher_dir} at {fake.url} gave log-probs that cannot be "
        "trained on for 1 of 3 samples (first: sample 1: "), warned
    assert says in warned[0]


@pytest.mark.parametrize("fake", [{i: 5.0 for i in range(64)}], indirect=True)
def test_a_server_whose_every_logprob_is_bad_ends_the_run_in_one_line_naming_it_saved(tiny_model_dir, teacher_dir,
                                                                                     fake, tmp_path, capsys):
    """The server answers +5.0 for every token (a log-prob is at most 0): the run does not train on it but ends after
    its first step with one line naming the teacher's URL, and the step is saved to resume from."""
    callbacks = tmp_path / "teacher.yaml"
    callbacks.write_text(yaml.safe_dump({"trainer": {"enable_checkpointing": True, "callbacks": [
        {"class_path": "rllight.callbacks.TeacherLogprobs", "init_args": {
            "model": {"class_path": "rllight.models.HFModel", "init_args": {"path": teacher_dir}},
            "temperature": 1.0, "placement": {"class_path": "rllight.serving.Endpoint", "init_args": {
                "url": fake.url}}}}]}}))
    with pytest.raises(SystemExit) as exc:
        main(["fit", "--config", os.path.join(RECIPES, "distill-quickstart.yaml"), "--config",
              tiny_overrides(tmp_path, tiny_model_dir), "--config", str(callbacks)])
    assert exc.value.code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("rllight: error:")]
    assert len(errors) == 1, errors
    assert errors[0].startswith(f"rllight: error: trainer.callbacks: TeacherLogprobs: the teacher {teacher_dir} at "
                                f"{fake.url} gave no usable log-probs for any of the step's 16 samples (first: "
                                "sample 0: log-probs above 0 (largest 5)"), errors[0]
    path = errors[0].rsplit("--ckpt_path ", 1)[1]
    assert path == str(tmp_path / "checkpoints" / "stopped-step=1.ckpt") and os.path.isfile(path)
    assert torch.load(path, weights_only=True)["global_step"] == 0  # nothing trained on the bad log-probs


# ------------------------------------------------------------------------------------------- a vLLM server
@pytest.fixture(scope="module")
def vllm_teacher(tmp_path_factory):
    """A vLLM OpenAI-compatible server on a tiny teacher (head size 32, as vLLM's CPU attention needs), float32; its
    URL and folder."""
    pytest.importorskip("vllm")
    model_dir = build_tiny_model(str(tmp_path_factory.mktemp("vllm_teacher") / "model"), hidden_size=64, seed=1)
    with vllm_server(model_dir, str(tmp_path_factory.mktemp("teacher_log") / "server.log")) as url:
        yield url, model_dir


@pytest.mark.vllm
def test_a_vllm_servers_prompt_logprobs_are_the_in_process_teachers(tiny_model_dir, vllm_teacher):
    url, teacher_dir = vllm_teacher
    rollout = _rollout(tiny_model_dir)
    callback = TeacherLogprobs(HFModel(teacher_dir), micro_batch_size=2, placement=Endpoint(url))
    callback.setup(_TRAINER, _module(tiny_model_dir), "fit")  # the tokenizers compared, the served name asked
    got = callback.on_rollout(None, RolloutContext(), rollout).extras[TEACHER_LOGPROBS]
    # Tolerance 1e-4 (absolute): both sides are float32, but vLLM's CPU kernels (its attention, its fused RMSNorm,
    # its matmul order) sum in another order than the trainer's eager forward: about 5e-7 on this machine, and
    # other CPUs pick other kernels, so the bound is the one the policy's sampled log-probs meet against the trainer
    # in tests/rollout/test_remote.py; a wrong position or temperature is off by 1e-1 or more.
    torch.testing.assert_close(got, _in_process(teacher_dir, tiny_model_dir, rollout), atol=1e-4, rtol=0)
    assert torch.all(got[rollout.response_mask == 0] == 0)
