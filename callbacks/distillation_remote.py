"""On-policy distillation's teacher behind a URL: a vLLM server (``vllm serve <teacher folder>``) that returns the
log-probs of the student's prompt and response tokens, for ``rllight.callbacks.TeacherLogprobs(url=...)``.

The request (vLLM 0.32, ``vllm/entrypoints/openai/completion/protocol.py``, ``CompletionRequest``): the OpenAI-
compatible ``POST /v1/completions`` with ``prompt`` a list of token-id lists (one per rollout row: its prompt tokens
without padding, then its response tokens), ``prompt_logprobs: 0`` (vLLM's extra parameter, passed to
``SamplingParams.prompt_logprobs`` by ``to_sampling_params``) and ``max_tokens: 1`` (the server generates one token,
which is not read; ``SamplingParams`` refuses ``max_tokens`` below 1, and ``max_tokens: 0`` with ``echo`` becomes
1 as well: ``echo_without_generation``). No ``echo``: it would add the prompt's text and log-probs in OpenAI's string-keyed
form, which are not needed.

The answer (``completion/serving.py``, ``request_output_to_completion_response``, and ``CompletionResponseChoice``):
one choice per prompt, in order (``index``), each with ``prompt_logprobs``: a list as long as the prompt, ``None``
first (the first token has no context), then per position k a dict ``{"<token id>": {"logprob": ..., "rank": ...,
"decoded_token": ...}}`` that holds the prompt's own token k (``prompt_logprobs: 0`` asks for no other); a
log-prob of -inf comes as -9999.0 (``clamp_prompt_logprobs``). A request with ``prompt_logprobs`` does not read
the server's prefix cache (``vllm/sampling_params.py``, ``skip_reading_prefix_cache``), so every position is scored.

Temperature: vLLM computes prompt log-probs from the raw logits, whatever ``--logprobs-mode`` says
(``vllm/v1/worker/gpu_model_runner.py``, ``_get_prompt_logprobs_dict``: "prompt tokens skip sampling processors,
so processed_* and raw_* yield the same scores here"), so the server's log-probs are the teacher's at temperature
1; ``TeacherLogprobs`` refuses any other temperature with a URL.
"""

from __future__ import annotations

import torch
from torch import Tensor

from rllight.errors import ComponentError, RecipeError
from rllight.http_client import Failure, JSONClient, attempts, check_key_env, read_key
from rllight.stopping import call_stoppable
from rllight.types import Rollout

__all__ = ["TeacherServer"]

KEY = "trainer.callbacks: TeacherLogprobs"
ROUTE = "/v1/completions"


class TeacherServer:
    """The HTTP side of a URL teacher: requests of ``rows_per_request`` rows, each attempt within
    ``timeout_seconds``, ``retries`` further attempts after an HTTP 429 or 5xx, a timeout or a connection error
    (waiting ``backoff_seconds``, doubled each time), none after another 4xx. A request that still fails stops the
    step with one line naming the URL and the route: the teacher's signal is never replaced by zeros.

    The settings are ``TeacherLogprobs``' of the same names (``url``, ``served_model``, ``api_key_env``,
    ``timeout_seconds``, ``retries``, ``backoff_seconds``); ``rows_per_request`` is its ``micro_batch_size``.
    """

    def __init__(self, url: str, served_model: str | None = None, api_key_env: str | None = None,
                 rows_per_request: int = 8, timeout_seconds: float = 600.0, retries: int = 2,
                 backoff_seconds: float = 1.0):
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise RecipeError(f"{KEY}.url must start with http:// or https://, got {url!r}")
        if url.rstrip("/").endswith(("/v1", ROUTE)):
            raise RecipeError(f"{KEY}.url is the server's base URL (e.g. http://teacher-node:8000), without /v1: "
                              f"the teacher appends {ROUTE}")
        check_key_env(api_key_env, KEY)
        if not timeout_seconds > 0:
            raise RecipeError(f"{KEY}.timeout_seconds must be > 0, got {timeout_seconds}")
        if retries < 0 or backoff_seconds < 0:
            raise RecipeError(f"{KEY}.retries and backoff_seconds must be >= 0, got {retries} and {backoff_seconds}")
        self.url, self.served_model, self.api_key_env = url.rstrip("/"), served_model, api_key_env
        self.rows_per_request, self.timeout_seconds = rows_per_request, float(timeout_seconds)
        self.retries, self.backoff_seconds = retries, float(backoff_seconds)

    def __repr__(self) -> str:  # settings only: the key is not one
        return f"TeacherServer(url={self.url!r}, served_model={self.served_model!r}, api_key_env={self.api_key_env!r})"

    # ------------------------------------------------------------------------------------------ HTTP
    def _api_key(self) -> str | None:
        return read_key(self.api_key_env, KEY, "the teacher server's")

    def _with_retries(self, route: str, body: dict | None, key: str | None) -> dict:
        client = JSONClient(self.timeout_seconds, self.retries, self.backoff_seconds)
        try:
            return client.call(f"{self.url}{route}", body, key)
        except Failure as failure:
            if failure.kind == "not_json":
                raise ComponentError(f"{KEY}: the teacher's vLLM server at {self.url} answered {route} with something "
                                     f"other than a JSON object ({failure.detail[:80]!r}); check that the URL "
                                     "(TeacherLogprobs.url) is a vLLM server (vllm serve)") from None
            if failure.kind == "status":
                line = (f"{KEY}: the teacher's vLLM server at {self.url} answered {route} with HTTP {failure.status} "
                        f"({failure.detail[:300] or failure.phrase})")
                if failure.retryable:
                    line += "; see the server's log"
                else:
                    code = failure.status
                    line += "; " + ("check api_key_env" if code in (401, 403) else
                                    "check that the URL is a vLLM server (vllm serve) of a version >= 0.10"
                                    if code == 404 else "check served_model and that the server is vLLM "
                                    "(prompt_logprobs)")
            else:
                line = (f"{KEY}: no answer from the teacher's vLLM server at {self.url} to {route} within "
                        f"timeout_seconds={self.timeout_seconds:g} ({failure.detail}); check that it runs and the "
                        "URL (TeacherLogprobs.url)")
            suffix = f" (after {attempts(failure.attempts)})" if failure.retryable and failure.attempts > 1 else ""
            raise ComponentError(line + suffix) from None

    def request(self, route: str, body: dict | None = None) -> dict:
        """``GET`` (no body) or ``POST`` a JSON body, with the retries; the decoded JSON answer. Waited for in short
        slices on the main thread, so that Ctrl-C or SIGTERM stops the run within seconds (``call_stoppable``)."""
        key = self._api_key()
        bound = (self.retries + 1) * (self.timeout_seconds + 1.0) + self.backoff_seconds * (2 ** self.retries) + 5.0
        finished, value, error = call_stoppable(lambda: self._with_retries(route, body, key), bound,
                                                f"the teacher's vLLM server at {self.url} ({route})")
        if error is not None:
            raise error
        if not finished:  # a server that trickles its answer past the socket's per-read timeout
            raise ComponentError(f"{KEY}: no answer from the teacher's vLLM server at {self.url} to {route} within "
                                 f"{bound:.0f} s; check that it runs and the URL (TeacherLogprobs.url)")
        return value

    def model_name(self) -> str:
        """``served_model``, else the first model of ``GET /v1/models`` (asked once)."""
        if self.served_model is None:
            models = self.request("/v1/models").get("data") or []
            if not models:
                raise ComponentError(f"{KEY}: the teacher's vLLM server at {self.url} serves no model; start it with "
                                     "the teacher's folder (vllm serve <folder>)")
            self.served_model = str(models[0].get("id")) if isinstance(models[0], dict) else str(models[0])
        return self.served_model

    # -------------------------------------------------------------------------------------- log-probs
    def prompt_logprobs(self, sequences: list[list[int]]) -> list[list[float]]:
        """The server's log-prob of each token of each sequence given the tokens before it (position 0 gets 0.0:
        it has no context), one request per ``rows_per_request`` sequences."""
        out: list[list[float]] = []
        for start in range(0, len(sequences), self.rows_per_request):
            batch = sequences[start : start + self.rows_per_request]
            answer = self.request(ROUTE, {"model": self.model_name(), "prompt": batch, "max_tokens": 1,
                                          "prompt_logprobs": 0, "temperature": 0.0})
            choices = answer.get("choices")
            if not isinstance(choices, list) or len(choices) != len(batch):
                raise ComponentError(f"{KEY}: the teacher's vLLM server at {self.url} answered {ROUTE} with "
                                     f"{len(choices) if isinstance(choices, list) else 'no'} choices for "
                                     f"{len(batch)} prompts; it needs an OpenAI-compatible vLLM server (vllm serve)")
            for ids, choice in zip(batch, sorted(choices, key=lambda c: c.get("index", 0))):
                out.append(self._read(ids, choice.get("prompt_logprobs")))
        return out

    def _read(self, ids: list[int], entries) -> list[float]:
        if not isinstance(entries, list) or len(entries) != len(ids):
            raise ComponentError(f"{KEY}: the teacher's vLLM server at {self.url} answered {ROUTE} without "
                                 f"prompt_logprobs for each of the {len(ids)} prompt tokens; it needs a vLLM server "
                                 "(prompt_logprobs is vLLM's extra parameter)")
        values = [0.0]
        for token, entry in zip(ids[1:], entries[1:]):
            found = entry.get(str(token)) if isinstance(entry, dict) else None
            if not isinstance(found, dict) or not isinstance(found.get("logprob"), (int, float)):
                raise ComponentError(f"{KEY}: the teacher's vLLM server at {self.url} answered {ROUTE} without the "
                                     f"log-prob of prompt token {token}; check that it serves the teacher's folder")
            values.append(float(found["logprob"]))
        return values

    def logprobs(self, rollout: Rollout) -> Tensor:
        """The server's log-probs of ``rollout``'s response tokens given their prompts and the responses before
        them: each row sent as its prompt tokens (``prompt_mask``) then its response tokens up to the last one in
        ``response_mask`` (a row with none is not sent).

        Returns:
            Shape (B, T), float32, zero outside ``rollout.response_mask``.
        """
        mask = rollout.response_mask.to(torch.float32)
        out = torch.zeros_like(mask)
        rows, sequences, prompt_lengths = [], [], []
        for i in range(mask.shape[0]):
            kept = mask[i].nonzero()
            if len(kept) == 0:
                continue
            prompt = rollout.prompt_ids[i][rollout.prompt_mask[i].bool()].tolist()
            response = rollout.response_ids[i, : int(kept[-1]) + 1].tolist()
            rows.append(i)
            sequences.append(prompt + response)
            prompt_lengths.append(len(prompt))
        for i, p, values in zip(rows, prompt_lengths, self.prompt_logprobs(sequences)):
            response = torch.tensor(values[p:], dtype=torch.float32)
            out[i, : len(response)] = response.to(out.device)
        return out * mask
