"""The reward model's ``placement: url``: a reward-model server scores the texts the trainer rendered.

Two documented protocols (``protocol``):

- ``openrlhf``: OpenRLHF's remote reward model (its ``--remote_rm_url``; ``openrlhf/utils/remote_rm_utils.py``
  ``remote_rm_fn``, served by ``openrlhf/cli/serve_rm.py`` at ``/get_reward``). ``POST <url>`` with the JSON
  ``{"query": [text, ...], "prompts": [prompt, ...], "labels": [answer, ...]}``: each full text (prompt and
  response, in the reward model's template), the prompt as the policy saw it, the row's reference answer. The answer
  is ``{"rewards": [score, ...]}``, one per query, in order.
- ``vllm_pooling``: vLLM's Pooling API (``vllm serve <reward model> --runner pooling``, ``--task reward`` on older
  versions; ``vllm/entrypoints/pooling/pooling/protocol.py``, ``PoolingCompletionRequest`` / ``PoolingResponse``,
  and ``examples/pooling/pooling/openai_pooling_client.py``). ``POST <server>/pooling`` with
  ``{"model": ..., "input": [text, ...], "add_special_tokens": ..., "use_activation": false}``; the answer is
  ``{"data": [{"index": i, "data": ...}, ...]}`` where each ``data`` is the score, ``[score]``, or one ``[score]``
  per token (the reward pooler's ``ALL``: the last token's is the classifier's score). Texts the chat template wrote
  (its special tokens in them) and plain texts go in separate requests, ``add_special_tokens`` false and true, as the
  trainer's tokenizer would read them; ``use_activation: false`` asks for the logit, not its sigmoid.

Faults cost a counted batch, never a hung run: each attempt waits at most ``timeout_seconds``; HTTP 429 and 5xx and
connection errors are retried ``retries`` times with exponential backoff (``rllight.http_client``, ``Retry-After``
honoured), other 4xx are not; the whole batch has a
time bound and the trainer waits for it in short slices (``rllight.stopping.call_stoppable``), so Ctrl-C is
honoured within seconds. A failed batch raises a plain exception, which the rollout producer counts (every sample 0).
The API key is read at each batch from the environment variable ``api_key_env`` names, sent as a bearer token, and
never kept, logged or pickled (``[key]`` in messages).
"""

from __future__ import annotations

import math

from rllight.http_client import Failure, JSONClient, attempts, read_key, snippet
from rllight.stopping import call_stoppable

PROTOCOLS = ("openrlhf", "vllm_pooling")
"""The values of ``RewardModel.protocol``."""


class RemoteFailed(RuntimeError):
    """A request or an answer that fails the batch (a plain exception: the producer counts it); the message is why."""


class RemoteClassifier:
    """Scores rendered texts at a reward-model server (see ``rllight.rewards.reward_model_remote``).

    Args:
        url: The endpoint: OpenRLHF's ``http://host:5000/get_reward``, vLLM's ``http://host:8000/pooling``.
        protocol: ``openrlhf`` or ``vllm_pooling``.
        model: The served model's name (vLLM's request ``model``).
        api_key_env: The NAME of the environment variable holding the API key; None = no key.
        timeout_seconds: Longest wait for one attempt's answer.
        retries: Further attempts after HTTP 429 or 5xx, a timeout or a connection error.
        backoff_seconds: Wait before the first retry; it doubles with each further one.
        where: The settings' prefix in messages (``model.reward.init_args``).
    """

    def __init__(self, url: str, protocol: str, model: str, api_key_env: str | None, timeout_seconds: float,
                 retries: int, backoff_seconds: float, where: str = "model.reward.init_args"):
        self.url, self.protocol, self.model, self.api_key_env = url, protocol, model, api_key_env
        self.timeout_seconds, self.retries, self.backoff_seconds = timeout_seconds, retries, backoff_seconds
        self.where = where

    def score(self, texts: list[tuple[str, bool]], prompts: list[str], labels: list[str]) -> list[float]:
        """The server's score of each ``(text, templated)``; raises (a plain exception) when a request fails."""
        key = self._api_key()
        requests = self._requests(texts, prompts, labels)
        per_request = (self.retries + 1) * self.timeout_seconds + self.backoff_seconds * (2 ** self.retries - 1)
        bound = len(requests) * per_request + 5.0

        def post_all() -> list[float]:
            out = [0.0] * len(texts)
            for index, body in requests:
                for i, value in zip(index, self._parse(self._post(body, key), len(index))):
                    out[i] = value
            return out

        finished, scores, error = call_stoppable(post_all, bound, f"the reward model at {self.url}")
        if not finished:
            raise TimeoutError(f"the reward model at {self.url} gave no scores within the batch's time bound of "
                               f"{bound:.0f} s")
        if error is not None:
            raise error
        return scores

    def _api_key(self) -> str | None:
        return read_key(self.api_key_env, self.where, "the server's")

    def _requests(self, texts: list[tuple[str, bool]], prompts: list[str],
                  labels: list[str]) -> list[tuple[list[int], dict]]:
        """``(indices, body)`` of each request the batch takes."""
        if self.protocol == "openrlhf":
            return [(list(range(len(texts))), {"query": [t for t, _ in texts], "prompts": list(prompts),
                                               "labels": list(labels)})]
        out = []
        for templated in (True, False):
            index = [i for i, (_, t) in enumerate(texts) if t == templated]
            if index:
                out.append((index, {"model": self.model, "input": [texts[i][0] for i in index],
                                    "add_special_tokens": not templated, "use_activation": False}))
        return out

    def _parse(self, answer: dict, count: int) -> list[float]:
        """One score per text from the server's JSON answer; ``RemoteFailed`` when it does not hold ``count``."""
        if self.protocol == "openrlhf":
            values = answer.get("rewards")
            if not isinstance(values, list) or len(values) != count:
                raise RemoteFailed(f"the reward model's answer has no list of {count} 'rewards': {snippet(answer)}")
            return [_number(v) for v in values]
        data = answer.get("data")
        if not isinstance(data, list) or len(data) != count or not all(isinstance(d, dict) for d in data):
            raise RemoteFailed(f"the pooling answer has no list of {count} 'data' items: {snippet(answer)}")
        data = sorted(data, key=lambda d: d.get("index", 0))
        return [_pooled_score(d.get("data")) for d in data]

    def _post(self, body: dict, key: str | None) -> dict:
        """``POST`` ``body`` with retries; the decoded JSON object, else ``RemoteFailed`` saying why."""
        client = JSONClient(self.timeout_seconds, self.retries, self.backoff_seconds)
        try:
            return client.call(self.url, body, key)
        except Failure as failure:
            if failure.kind == "not_json":
                raise RemoteFailed(f"the reward model's answer is not a JSON object: {snippet(failure.detail)}") \
                    from None
            if failure.kind == "status":
                reason = (f"HTTP {failure.status} from the reward model at {self.url} "
                          f"({snippet(failure.detail) if failure.detail else failure.phrase})")
                if not failure.retryable:
                    raise RemoteFailed(reason) from None
            elif failure.kind == "timeout":
                reason = (f"no answer from the reward model at {self.url} within "
                          f"timeout_seconds={self.timeout_seconds:g}")
            else:
                reason = f"cannot reach the reward model at {self.url} ({snippet(failure.detail)})"
            raise RemoteFailed(f"{reason}, after {attempts(failure.attempts)}") from None


def _pooled_score(value) -> float:
    """The score in one pooling output: a number, ``[number]``, or per token ``[[number], ...]`` (the last)."""
    while isinstance(value, list) and value and isinstance(value[-1], list):
        value = value[-1]  # per-token outputs: the last token's is the sequence's score
    if isinstance(value, list) and len(value) == 1:
        value = value[0]
    if isinstance(value, list):
        raise RemoteFailed(f"a pooling output of {len(value)} numbers, not one score: serve a reward model or "
                         "sequence classifier with one label")
    return _number(value)


def _number(value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise RemoteFailed(f"the reward model returned {snippet(value)}, not a finite number")
    return float(value)


__all__ = ["PROTOCOLS", "RemoteClassifier", "RemoteFailed"]
