"""An LLM judge: another model reads each response and gives the reward. It is served at any OpenAI-compatible
``/v1/chat/completions`` endpoint (vLLM, SGLang, llama.cpp's server, OpenAI, a gateway: ``placement: url``, the
default), or it is a local Hugging Face causal LM that answers in the trainer's process (``placement: process``) or in
a supervised worker process (``placement: worker``; ``rllight.rewards.judge_local``). Every placement reads the same
verdicts from answers of the same form (``rllight.rewards.judge_verdicts``).

Select it in a recipe::

    model:
      reward:
        class_path: rllight.rewards.judge.LLMJudge
        init_args: {url: "http://127.0.0.1:8000/v1", model: Qwen/Qwen2.5-7B-Instruct, api_key_env: JUDGE_API_KEY}

How it runs:
- **One request per response** (``mode: pointwise``), or **one per group** (``mode: group``: the responses to one
  prompt listed as ``Response 1``, ``Response 2``, ..., the judge answers one score per response, in order). The
  prompt is ``template`` filled with ``{question}`` (the row's last user message, else the prompt as the policy
  saw it), ``{response}`` (in group mode the numbered list) and ``{answer}`` (the reference answer); ``{count}``
  is the number of responses.
- **The verdict** is parsed from the judge's answer: ``number`` (the last ``Score: N``, or an answer that is only
  a number; divided by ``scale``), ``label`` (the label after the last ``Verdict:``, else the last one named,
  mapped through ``labels``) or ``yes_logprob`` (P(yes) from the first token's top log-probs, normalised over the
  yes and no variants: ``yes``, `` Yes``, ``YES``...).
- **Faults cost a counted failure, never a hung run**: every attempt waits at most ``timeout_seconds``; HTTP 429
  and 5xx and connection errors are retried ``retries`` times with exponential backoff (``Retry-After`` honoured
  up to the next backoff's double), other 4xx are not; the whole batch has a time bound (what its requests could
  take, retries and rate limit included, plus a few seconds) and the trainer waits for it in short slices, so
  Ctrl-C is honoured within seconds. A response whose request failed, or whose verdict cannot be parsed, gets
  reward 0 and a one-line reason (``BatchScores.failed``); a batch where every response failed counts towards
  ``model.max_failed_reward_steps``, which ends the run in one line.
- **The API key** is read from the environment variable ``api_key_env`` names, at each batch, and sent as
  ``Authorization: Bearer <key>``. It is never an attribute, so ``repr``, pickles (checkpoints, worker copies),
  ``--print_config`` and exports cannot hold it; failure reasons and log lines have it replaced by ``[key]``.
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Literal

from rllight.errors import RecipeError, one_line
from rllight.http_client import Failure, JSONClient, attempts, check_key_env, read_key, redact, snippet
from rllight.rewards.batch import BatchReward, BatchScores, Sample
from rllight.rewards.judge_local import LocalChat
from rllight.rewards.judge_verdicts import JudgeFailed, parse_labels, parse_scores, yes_probability
from rllight.rewards.reward_model_worker import ClassifierWorker
from rllight.stopping import wait_stoppable

log = logging.getLogger(__name__)

KEY = "model.reward.init_args"
ROUTE = "/chat/completions"
PLACEMENTS = ("url", "process", "worker")
"""The values of ``LLMJudge.placement``."""
WORKER_TARGET = "rllight.rewards.judge_local:serve_worker"

_HEAD = "Grade {what} to a question, using the reference answer.\n\nQuestion:\n{{question}}\n\nReference answer:\n{{answer}}\n\n"
_ASK = {
    ("pointwise", "number"): "Response:\n{response}\n\nHow correct is the response? Reason briefly, then end with a "
                             "line `Score: N`, N an integer from 0 (wrong) to 10 (fully correct).",
    ("pointwise", "label"): "Response:\n{response}\n\nIs the response correct? Reason briefly, then end with a line "
                            "`Verdict: L`, L one of: {labels}.",
    ("pointwise", "yes_logprob"): "Response:\n{response}\n\nIs the response correct? Answer with one word: yes or no.",
    ("group", "number"): "{response}\n\nHow correct is each response? Reason briefly, then end with one line per "
                         "response, in order: `Response K: Score: N`, N an integer from 0 (wrong) to 10 (fully correct).",
    ("group", "label"): "{response}\n\nIs each response correct? Reason briefly, then end with one line per response, "
                        "in order: `Response K: Verdict: L`, L one of: {labels}.",
}


def default_template(mode: str, verdict: str, labels: Sequence[str] = ()) -> str:
    """The prompt the judge gets when the recipe sets no ``template``, for ``mode`` and ``verdict``."""
    what = "a response" if mode == "pointwise" else "{count} responses"
    names = ", ".join(n.replace("{", "{{").replace("}", "}}") for n in labels)
    ask = _ASK[(mode, verdict)].replace("{response}", "{{response}}").format(labels=names)
    return _HEAD.format(what=what) + ask


_Failed = JudgeFailed  # a request or a verdict that gives its samples a counted failure; the message is why


class LLMJudge(BatchReward):
    """Rewards from an LLM judge at an OpenAI-compatible chat-completions endpoint (see ``rllight.rewards.judge``).

    Args:
        url: ``placement: url``: the endpoint's base URL, as OpenAI clients take it: ``http://127.0.0.1:8000/v1``,
            ``https://api.openai.com/v1``. ``/chat/completions`` is appended.
        model: ``url``: the served model's name (the request's ``model``); ``process`` and ``worker``: the judge
            model's folder or hub id (a causal LM, its own chat template).
        api_key_env: The NAME of the environment variable that holds the API key (sent as a bearer token), read
            at each batch; None = no key. The key itself is never a setting.
        template: The judge's prompt, with ``{question}``, ``{response}`` and ``{answer}`` (and optionally
            ``{count}``) placeholders; literal braces doubled. None = a default for ``mode`` and ``verdict``
            (``default_template``).
        verdict: How the reward is read from the answer: ``number`` (the last ``Score: N``, divided by ``scale``;
            outside 0..scale fails), ``label`` (mapped through ``labels``) or ``yes_logprob`` (P(yes) from the first
            token's top log-probs; pointwise only, the server must return ``logprobs``, and one token is asked
            for whatever ``max_tokens`` says).
        labels: Label mode: each label's reward (case-insensitive). None = ``{correct: 1.0, incorrect: 0.0}``.
        scale: Number mode: the judge's top score, which becomes reward 1.
        mode: ``pointwise`` (one request per response) or ``group`` (one request per prompt, listing its responses;
            an answer with the wrong number of verdicts fails the group's samples).
        max_concurrency: Requests in flight at once.
        requests_per_second: At most this many requests (retries included) start per second (a token bucket of
            one: no bursts); None = no limit.
        timeout_seconds: Longest wait for one attempt's answer.
        retries: Further attempts after an HTTP 429 or 5xx, a timeout or a connection error (not after another 4xx).
        backoff_seconds: Wait before the first retry; it doubles with each further one.
        temperature: Sampling temperature of the judge (0: the same answer to the same prompt, on most servers).
        max_tokens: Longest judge answer, in tokens.
        correct: A response whose reward is at least this counts as solved in ``reward/accuracy``.
        placement: ``url`` (a server), ``process`` (a local judge model in the trainer's process) or ``worker`` (in
            a supervised child process, each batch within ``timeout_seconds``). ``max_concurrency``,
            ``requests_per_second``, ``retries`` and ``backoff_seconds`` are read by ``url`` only.
        batch_size: ``process`` and ``worker``: prompts the judge model answers together.
        dtype: ``process`` and ``worker``: the judge's weights, ``auto`` (the trainer's mixed-precision dtype, else
            float32), ``float32``, ``bfloat16`` or ``float16``.
        device: ``process`` and ``worker``: ``auto`` (this process's CUDA device, else the CPU) or a torch device.
    """

    _worker_target = WORKER_TARGET
    """The worker placement's child function (tests name one that misbehaves)."""

    def __init__(self, url: str | None = None, model: str | None = None, api_key_env: str | None = None,
                 template: str | None = None,
                 verdict: Literal["number", "label", "yes_logprob"] = "number", labels: dict[str, float] | None = None,
                 scale: float = 10.0, mode: Literal["pointwise", "group"] = "pointwise", max_concurrency: int = 8,
                 requests_per_second: float | None = None, timeout_seconds: float = 60.0, retries: int = 2,
                 backoff_seconds: float = 1.0, temperature: float = 0.0, max_tokens: int = 512, correct: float = 0.5,
                 placement: Literal["url", "process", "worker"] = "url", batch_size: int = 8, dtype: str = "auto",
                 device: str = "auto"):
        super().__init__(correct=correct)
        _check_placement(placement, url, model, api_key_env, batch_size, dtype)
        check_key_env(api_key_env, KEY)
        if verdict not in ("number", "label", "yes_logprob"):
            raise RecipeError(f"{KEY}.verdict must be number, label or yes_logprob, got {verdict!r}")
        if mode not in ("pointwise", "group"):
            raise RecipeError(f"{KEY}.mode must be pointwise or group, got {mode!r}")
        if mode == "group" and verdict == "yes_logprob":
            raise RecipeError(f"{KEY}.verdict yes_logprob reads one verdict per answer: use it with mode pointwise")
        if labels is not None and verdict != "label":
            raise RecipeError(f"{KEY}.labels is read by verdict label only; set verdict: label or drop labels")
        labels = {"correct": 1.0, "incorrect": 0.0} if labels is None and verdict == "label" else labels
        if labels is not None:
            names = [str(n).strip().lower() for n in labels]
            if not names or not all(names) or len(set(names)) != len(names):
                raise RecipeError(f"{KEY}.labels must map distinct, non-empty labels to rewards, got {labels!r}")
            if not all(isinstance(v, (int, float)) and math.isfinite(v) for v in labels.values()):
                raise RecipeError(f"{KEY}.labels' rewards must be finite numbers, got {labels!r}")
            labels = {str(n).strip(): float(v) for n, v in labels.items()}
        if not (isinstance(scale, (int, float)) and scale > 0 and math.isfinite(scale)):
            raise RecipeError(f"{KEY}.scale must be a number > 0 (the judge's top score), got {scale!r}")
        if max_concurrency < 1:
            raise RecipeError(f"{KEY}.max_concurrency must be >= 1, got {max_concurrency}")
        if requests_per_second is not None and not requests_per_second > 0:
            raise RecipeError(f"{KEY}.requests_per_second must be > 0 or null (no limit), got {requests_per_second}")
        if not timeout_seconds > 0:
            raise RecipeError(f"{KEY}.timeout_seconds must be > 0, got {timeout_seconds}")
        if retries < 0 or backoff_seconds < 0:
            raise RecipeError(f"{KEY}.retries and backoff_seconds must be >= 0, got {retries} and {backoff_seconds}")
        if temperature < 0 or max_tokens < 1:
            raise RecipeError(f"{KEY}.temperature must be >= 0 and max_tokens >= 1, got {temperature} and {max_tokens}")
        template = default_template(mode, verdict, list(labels or ())) if template is None else template
        try:
            template.format(question="", response="", answer="", count=0)
        except (KeyError, IndexError, ValueError) as err:
            raise RecipeError(f"{KEY}.template: only {{question}}, {{response}}, {{answer}} and {{count}} may be "
                              f"placeholders, literal braces doubled ({type(err).__name__}: {err})") from None
        if "{response}" not in template:
            raise RecipeError(f"{KEY}.template has no {{response}} placeholder: the judge would not see the response")
        self.url = url.rstrip("/") if url else None
        self.model, self.api_key_env, self.template = model, api_key_env, template
        self.placement, self.batch_size, self.dtype, self.device = placement, batch_size, dtype, device
        self._local: LocalChat | None = None
        self._worker: ClassifierWorker | None = None
        self.verdict, self.labels, self.scale, self.mode = verdict, labels, float(scale), mode
        self.max_concurrency, self.requests_per_second = max_concurrency, requests_per_second
        self.timeout_seconds, self.retries, self.backoff_seconds = float(timeout_seconds), retries, float(backoff_seconds)
        self.temperature, self.max_tokens = temperature, max_tokens
        self._pool: ThreadPoolExecutor | None = None
        self._rate_lock = threading.Lock()
        self._next_start = 0.0  # time.monotonic() before which no request may start (the rate limit)

    def __repr__(self) -> str:  # settings only: the key is not one
        where = f"url={self.url!r}" if self.placement == "url" else f"placement={self.placement!r}"
        return (f"LLMJudge({where}, model={self.model!r}, api_key_env={self.api_key_env!r}, "
                f"verdict={self.verdict!r}, mode={self.mode!r})")

    def __getstate__(self) -> dict:  # copies (checkpoints, worker processes) carry the settings, not threads or locks
        state = dict(self.__dict__)
        state.update(_pool=None, _rate_lock=None, _next_start=0.0, _local=None, _worker=None)
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._rate_lock = threading.Lock()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
        if self._worker is not None:
            self._worker.close()
        self._local = self._worker = None

    def check(self) -> None:
        """Before the policy loads: the key's environment variable is set (``url``), or the judge model is a causal
        LM whose tokenizer loads (``process``, ``worker``); ``RecipeError`` in one line."""
        if self.placement == "url":
            self._api_key()
        else:
            self._chat().load_tokenizer()

    def _chat(self) -> LocalChat:
        if self._local is None:
            self._local = LocalChat(self.model, self.batch_size, self.dtype, self.device, where=f"{KEY}.model")
        return self._local

    # ------------------------------------------------------------------------------ scoring
    def score(self, samples: Sequence[Sample]) -> BatchScores:
        """One reward per sample, in order; a sample whose request failed or whose verdict could not be read gets
        0 and its reason in ``failed``."""
        key = self._api_key() if self.placement == "url" else None
        if self.mode == "pointwise":
            jobs = [([i], self._prompt(s, s.response, 1)) for i, s in enumerate(samples)]  # (indices, prompt)
        else:
            groups: dict[int, list[int]] = {}
            for i, s in enumerate(samples):
                groups.setdefault(s.group, []).append(i)
            jobs = [(index, self._prompt(samples[index[0]], "\n\n".join(
                f"Response {k + 1}:\n{samples[i].response}" for k, i in enumerate(index)), len(index)))
                for index in groups.values()]
        scores, failed = [0.0] * len(samples), {}
        run = self._run if self.placement == "url" else self._run_local
        for (index, _), outcome in zip(jobs, run([(prompt, len(index)) for index, prompt in jobs], key)):
            if isinstance(outcome, str):
                failed.update({i: outcome for i in index})
            else:
                for i, value in zip(index, outcome):
                    scores[i] = value
        failed = {i: redact(reason, key) for i, reason in failed.items()}
        if failed:  # the trainer warns once per batch (``score_samples``); the details for a debug log
            log.debug("LLM judge at %s: %d of %d samples failed (first: %s)", self.url, len(failed), len(samples),
                      failed[min(failed)])
        return BatchScores(scores=scores, failed=failed)

    def _api_key(self) -> str | None:
        return read_key(self.api_key_env, KEY, "the judge's")

    def _prompt(self, sample: Sample, response: str, count: int) -> str:
        users = [m.get("content") for m in sample.messages or [] if isinstance(m, dict) and m.get("role") == "user"]
        question = users[-1] if users and isinstance(users[-1], str) else sample.prompt
        return self.template.format(question=question, response=response, answer=sample.answer, count=count)

    def _run(self, prompts: list[tuple[str, int]], key: str | None) -> list[list[float] | str]:
        """Each ``(prompt, number of responses in it)``'s verdicts (a list of rewards) or the reason it failed,
        waiting at most the batch's time bound."""
        if not prompts:
            return []
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.max_concurrency, thread_name_prefix="rllight-judge")
        attempts = self.retries + 1
        per_request = attempts * self.timeout_seconds + self.backoff_seconds * (2 ** self.retries - 1)
        waves = math.ceil(len(prompts) / self.max_concurrency)
        rate = len(prompts) * attempts / self.requests_per_second if self.requests_per_second else 0.0
        bound = waves * per_request + rate + 5.0
        deadline = time.monotonic() + bound
        cancel, done, left = threading.Event(), threading.Event(), [len(prompts)]
        lock = threading.Lock()

        def finished(_: Future) -> None:
            with lock:
                left[0] -= 1
                if not left[0]:
                    done.set()

        futures = []
        for prompt, count in prompts:
            future = self._pool.submit(self._judge, prompt, count, key, cancel, deadline)
            future.add_done_callback(finished)
            futures.append(future)
        try:
            wait_stoppable(done, bound, f"the LLM judge at {self.url}")
        finally:
            cancel.set()  # retries and rate-limit waits of what is still running stop now
            for future in futures:
                future.cancel()
        out: list[list[float] | str] = []
        for future in futures:
            if not future.done() or future.cancelled():
                out.append(f"no verdict within the batch's time bound of {bound:.0f} s")
            elif isinstance(future.exception(), _Failed):
                out.append(str(future.exception()))
            elif future.exception() is not None:
                err = future.exception()
                out.append(f"{type(err).__name__}: {err}"[:200])
            else:
                out.append(future.result())
        return out

    def _run_local(self, prompts: list[tuple[str, int]], key: None = None) -> list[list[float] | str]:
        """``_run`` for a local judge model: every prompt answered in one pass (in this process, or the worker's),
        then each answer's verdicts read as a server's would be. A pass that fails fails every prompt of it."""
        if not prompts:
            return []
        bodies = [self._body(prompt) for prompt, _ in prompts]
        try:
            if self.placement == "process":
                answers = self._chat().complete(bodies)
            else:
                if self._worker is None:
                    self._worker = ClassifierWorker(self._worker_target, self._chat().settings(), self.timeout_seconds,
                                                    name="the judge's worker process", loads="the judge model")
                answers = self._worker.score(bodies)
        except RecipeError:  # the recipe's fault, not the batch's (Ctrl-C is no Exception: it passes too)
            raise
        except Exception as err:  # noqa: BLE001 - a failed pass is counted, as a server's failure is
            return [one_line(err, 300)] * len(prompts)
        out: list[list[float] | str] = []
        for answer, (_, count) in zip(answers, prompts):
            try:
                out.append(self._verdicts(answer, count))
            except _Failed as err:
                out.append(str(err))
        return out

    def _body(self, prompt: str) -> dict:
        body = {"model": self.model, "messages": [{"role": "user", "content": prompt}],
                "temperature": self.temperature, "max_tokens": self.max_tokens}
        if self.verdict == "yes_logprob":
            body.update(logprobs=True, top_logprobs=5, max_tokens=1)
        return body

    def _judge(self, prompt: str, count: int, key: str | None, cancel: threading.Event,
               deadline: float) -> list[float]:
        return self._verdicts(self._post(self._body(prompt), key, cancel, deadline), count)

    def _verdicts(self, answer: dict, count: int) -> list[float]:
        """The rewards an OpenAI chat completion ``answer`` gives its ``count`` responses; ``_Failed`` with why."""
        try:
            choice = answer["choices"][0]
            text = choice["message"]["content"] or ""
        except (KeyError, IndexError, TypeError):
            raise _Failed(f"the judge's answer has no choices[0].message.content: {snippet(json.dumps(answer))}") \
                from None
        if self.verdict == "yes_logprob":
            return [yes_probability(choice)]
        if self.verdict == "number":
            values = parse_scores(text, count)
            for v in values:
                if not 0 <= v <= self.scale:
                    raise _Failed(f"score {v:g} is outside 0..{self.scale:g} (scale): {snippet(text)}")
            return [v / self.scale for v in values]
        return [self.labels[name] for name in parse_labels(text, list(self.labels), count)]

    # --------------------------------------------------------------------------------- HTTP
    def _post(self, body: dict, key: str | None, cancel: threading.Event, deadline: float) -> dict:
        """``POST`` ``body`` to the endpoint with retries; the decoded JSON object, or ``_Failed`` with why."""

        def before(attempt: int) -> float:
            self._wait_for_rate(cancel)
            left = deadline - time.monotonic()
            if left <= 0:
                raise _Failed(f"no verdict within the batch's time bound (attempt {attempt + 1})")
            return min(self.timeout_seconds, left)

        client = JSONClient(self.timeout_seconds, self.retries, self.backoff_seconds)
        try:
            return client.call(self.url + ROUTE, body, key, wait=cancel.wait, before=before)
        except Failure as failure:
            if failure.kind == "not_json":
                raise _Failed(f"the judge's answer is not a JSON object: {snippet(failure.detail)}") from None
            if failure.kind == "status":
                detail = snippet(failure.detail) if failure.detail else failure.phrase
                reason = f"HTTP {failure.status} from the judge ({detail})"
                if not failure.retryable:
                    raise _Failed(reason) from None
            elif failure.kind == "timeout":
                reason = f"no answer within timeout_seconds={self.timeout_seconds:g}"
            else:
                reason = f"cannot reach the judge ({snippet(failure.detail)})"
            raise _Failed(f"{reason}, after {attempts(failure.attempts)}") from None

    def _wait_for_rate(self, cancel: threading.Event) -> None:
        if not self.requests_per_second:
            return
        with self._rate_lock:
            now = time.monotonic()
            start = max(now, self._next_start)
            self._next_start = start + 1.0 / self.requests_per_second
        if start > now and cancel.wait(start - now):
            raise _Failed("given up before its turn under requests_per_second")


def _check_placement(placement, url, model, api_key_env, batch_size, dtype) -> None:
    """One ``RecipeError`` line, naming the setting, for where-the-judge-runs settings that cannot work."""
    if placement not in PLACEMENTS:
        raise RecipeError(f"{KEY}.placement: {placement!r} is not one of {', '.join(PLACEMENTS)}")
    if placement == "url":
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise RecipeError(f"{KEY}.url must start with http:// or https://, got {url!r}")
        if url.rstrip("/").endswith(ROUTE):
            raise RecipeError(f"{KEY}.url is the base URL (e.g. http://127.0.0.1:8000/v1): drop {ROUTE}, the "
                              "judge appends it")
        if not model:
            raise RecipeError(f"{KEY}.model must name the served model (the request's 'model')")
    else:
        if url is not None or api_key_env is not None:
            raise RecipeError(f"{KEY}.url and api_key_env are read by placement url only (placement is "
                              f"{placement!r}, a local judge model); drop them or set placement: url")
        if not model:
            raise RecipeError(f"{KEY}.model must be the folder or hub id of the judge model (placement "
                              f"{placement!r})")
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise RecipeError(f"{KEY}.batch_size must be an integer >= 1, got {batch_size!r}")
        if dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise RecipeError(f"{KEY}.dtype: {dtype!r} is not one of auto, float32, bfloat16, float16")


__all__ = ["LLMJudge", "default_template", "parse_labels", "parse_scores", "yes_probability"]
