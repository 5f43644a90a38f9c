"""Wire protocols: how an ``Endpoint`` asks a server for what a model computes, and reads the answers.

A protocol is an object with two methods: ``requests(inputs)`` builds the request bodies of a batch (each request
names the inputs it covers) and ``parse(answer, request)`` reads one value per input from a JSON answer, raising
``Malformed`` where the answer does not hold them. Its ``route`` is appended to the endpoint's URL. A new protocol
is a subclass in the user's own module, named by ``class_path`` under ``Endpoint.protocol``.

- ``VLLMPooling`` and ``OpenRLHF``: a reward model's score of each rendered text (``ScoredText`` in, a float out).
- ``ChatCompletions``: an OpenAI chat completion for each request body (a judge's), the answer itself out.
- ``PromptLogprobs``: vLLM's log-prob of each response token given the tokens before it (a teacher's).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from rllight.bounds import PositiveInt, check_declared
from rllight.errors import RecipeError
from rllight.serving.http import snippet


class Malformed(Exception):
    """An answer that does not hold what was asked for; the message says what is missing, in one line."""


class Request(NamedTuple):
    """One request of a batch: the inputs it covers (their indices in the batch, in the order ``parse`` returns
    their values), its JSON body, and what the protocol keeps to read the answer (``context``, not sent)."""

    index: list[int]
    body: dict
    context: Any = None


class ScoredText(NamedTuple):
    """What a reward model scores: the rendered ``text``, whether the chat template wrote it (its special tokens
    are in it: ``templated``), and the row's ``prompt`` and reference ``answer`` (OpenRLHF sends them)."""

    text: str
    templated: bool
    prompt: str = ""
    answer: str = ""


class Protocol(ABC):
    """How requests to a server are written and its answers read (see ``rllight.serving.protocols``).

    Args:
        route: Appended to the endpoint's URL; None = the protocol's usual one (``default_route``).
        model: The served model's name in the requests; None = the model the owner names (its ``model``).
    """

    default_route = ""
    probe_route: str | None = None
    """A route that answers a ``GET`` and checks the API key (OpenAI-compatible servers' model list), asked once
    before the run (``Endpoint.check``); None = the server is not asked before its first batch."""

    def __init__(self, route: str | None = None, model: str | None = None):
        self.route = self.default_route if route is None else route
        self.model = model

    def __repr__(self) -> str:
        return f"{type(self).__name__}(route={self.route!r}, model={self.model!r})"

    def check(self, where: str) -> None:
        """``RecipeError`` in one line, naming ``where`` (this protocol's key), for settings that cannot work (the
        bounds its ``__init__`` declares included)."""
        if self.route and not self.route.startswith("/"):
            raise RecipeError(f"{where}.route must start with /, got {self.route!r}")
        check_declared(self, where)

    def prepare(self, get: Callable[[str], dict]) -> None:
        """Before a batch's requests: what the protocol must ask the server first, with ``get(route)`` (the
        decoded answer of a ``GET``); nothing by default."""

    @abstractmethod
    def requests(self, inputs: Sequence[Any]) -> list[Request]:
        """The requests that cover ``inputs``."""

    @abstractmethod
    def parse(self, answer: dict, request: Request) -> list[Any]:
        """One value per input of ``request`` (in ``request.index``'s order) from the server's JSON ``answer``;
        ``Malformed`` when it does not hold them."""


def finite(value, what: str = "the server") -> float:
    """``value`` as a float; ``Malformed`` where it is not a finite number."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise Malformed(f"{what} returned {snippet(value)}, not a finite number")
    return float(value)


class VLLMPooling(Protocol):
    """vLLM's Pooling API (``vllm serve <reward model> --runner pooling``; ``--task reward`` on older versions;
    ``vllm/entrypoints/pooling/pooling/protocol.py``, ``PoolingCompletionRequest`` / ``PoolingResponse``).

    ``POST <url>/pooling`` with ``{"model": ..., "input": [text, ...], "add_special_tokens": ...,
    "use_activation": false}``; the answer is ``{"data": [{"index": i, "data": ...}, ...]}`` where each ``data`` is
    the score, ``[score]``, or one ``[score]`` per token (the reward pooler's ``ALL``: the last token's is the
    classifier's score). Texts the chat template wrote and plain texts go in separate requests,
    ``add_special_tokens`` false and true, as the trainer's tokenizer would read them; ``use_activation: false``
    asks for the logit, not its sigmoid.
    """

    default_route = "/pooling"
    probe_route = "/v1/models"

    def requests(self, inputs: Sequence[ScoredText]) -> list[Request]:
        out = []
        for templated in (True, False):
            index = [i for i, t in enumerate(inputs) if t.templated == templated]
            if index:
                out.append(Request(index, {"model": self.model, "input": [inputs[i].text for i in index],
                                           "add_special_tokens": not templated, "use_activation": False}))
        return out

    def parse(self, answer: dict, request: Request) -> list[float]:
        data, count = answer.get("data"), len(request.index)
        if not isinstance(data, list) or len(data) != count or not all(isinstance(d, dict) for d in data):
            raise Malformed(f"the answer has no list of {count} 'data' items: {snippet(answer)}")
        return [_pooled_score(d.get("data")) for d in sorted(data, key=lambda d: d.get("index", 0))]


class OpenRLHF(Protocol):
    """OpenRLHF's remote reward model (``openrlhf.cli.serve_rm``; ``--remote_rm_url``): ``POST <url>/get_reward``
    with ``{"query": [text, ...], "prompts": [...], "labels": [...]}`` (the whole batch in one request: the
    rendered texts, the rows' prompts and reference answers); the answer is ``{"rewards": [score, ...]}``."""

    default_route = "/get_reward"

    def requests(self, inputs: Sequence[ScoredText]) -> list[Request]:
        return [Request(list(range(len(inputs))), {"query": [t.text for t in inputs],
                                                   "prompts": [t.prompt for t in inputs],
                                                   "labels": [t.answer for t in inputs]})]

    def parse(self, answer: dict, request: Request) -> list[float]:
        values = answer.get("rewards")
        if not isinstance(values, list) or len(values) != len(request.index):
            raise Malformed(f"the answer has no list of {len(request.index)} 'rewards': {snippet(answer)}")
        return [finite(v, "the reward model") for v in values]


class ChatCompletions(Protocol):
    """OpenAI's chat completions (vLLM, SGLang, llama.cpp's server, OpenAI, a gateway): ``POST
    <url>/chat/completions`` (``url`` as OpenAI clients take it, ``http://127.0.0.1:8000/v1``), one request per
    input, each input a request body (``messages``, ``max_tokens``...); the value is the answer itself, once it
    holds ``choices[0].message.content``. ``model`` is set in each body that names none."""

    default_route = "/chat/completions"
    probe_route = "/models"

    def requests(self, inputs: Sequence[dict]) -> list[Request]:
        return [Request([i], {"model": self.model, **body} if body.get("model") is None else body)
                for i, body in enumerate(inputs)]

    def parse(self, answer: dict, request: Request) -> list[dict]:
        try:
            answer["choices"][0]["message"]["content"]
        except (KeyError, IndexError, TypeError):
            raise Malformed(f"the answer has no choices[0].message.content: {snippet(answer)}") from None
        return [answer]


class PromptLogprobs(Protocol):
    """vLLM's log-probs of prompt tokens (vLLM 0.32, ``vllm/entrypoints/openai/completion/protocol.py``,
    ``CompletionRequest``): ``POST <url>/v1/completions`` with ``prompt`` a list of token-id lists (one per input:
    its prompt tokens, then its response tokens), ``prompt_logprobs: 0`` (vLLM's extra parameter, passed to
    ``SamplingParams.prompt_logprobs``) and ``max_tokens: 1`` (one token is generated and not read;
    ``SamplingParams`` refuses fewer). No ``echo``: it would add text that is not needed.

    The answer (``completion/serving.py``, ``request_output_to_completion_response``): one choice per prompt
    (``index``), each with ``prompt_logprobs``, a list as long as the prompt, ``None`` first (the first token has
    no context), then per position k ``{"<token id>": {"logprob": ..., ...}}`` holding the prompt's own token k; a
    log-prob of -inf comes as -9999.0. A request with ``prompt_logprobs`` does not read the prefix cache
    (``skip_reading_prefix_cache``), so every position is scored. vLLM computes prompt log-probs from the raw logits
    whatever ``--logprobs-mode`` says (``gpu_model_runner.py``, ``_get_prompt_logprobs_dict``): temperature 1.

    Each input is ``(prompt_ids, response_ids)``; its value is the log-prob of each response token. Without a
    ``model``, the first of the server's ``GET /v1/models`` is asked for, once.

    Args:
        rows_per_request: Inputs sent together in one request.
    """

    default_route = "/v1/completions"
    probe_route = "/v1/models"
    temperature = 1.0
    """The temperature of the log-probs it returns (vLLM applies none to prompt tokens)."""

    def __init__(self, route: str | None = None, model: str | None = None, rows_per_request: PositiveInt = 8):
        super().__init__(route, model)
        self.rows_per_request = rows_per_request

    def requests(self, inputs: Sequence[tuple[list[int], list[int]]]) -> list[Request]:
        out = []
        for start in range(0, len(inputs), self.rows_per_request):
            rows = inputs[start:start + self.rows_per_request]
            body = {"model": self.model, "prompt": [list(p) + list(r) for p, r in rows], "max_tokens": 1,
                    "prompt_logprobs": 0, "temperature": 0.0}
            out.append(Request(list(range(start, start + len(rows))), body, [len(p) for p, _ in rows]))
        return out

    def prepare(self, get: Callable[[str], dict]) -> None:
        if self.model is None:
            models = get("/v1/models").get("data") or []
            if not models:
                raise Malformed("the server serves no model; start it with the teacher's folder (vllm serve <folder>)")
            self.model = str(models[0].get("id")) if isinstance(models[0], dict) else str(models[0])

    def parse(self, answer: dict, request: Request) -> list[list[float]]:
        choices, prompts = answer.get("choices"), request.body["prompt"]
        if not isinstance(choices, list) or len(choices) != len(prompts):
            raise Malformed(f"the answer has {len(choices) if isinstance(choices, list) else 'no'} choices for {len(prompts)} "
                            "prompts; it needs an OpenAI-compatible vLLM server (vllm serve)")
        choices = sorted(choices, key=lambda c: c.get("index", 0) if isinstance(c, dict) else 0)
        return [_prompt_logprobs(ids, choice.get("prompt_logprobs") if isinstance(choice, dict) else None)[max(p, 1) - 1:]
                for ids, p, choice in zip(prompts, request.context, choices)]


_VLLM_MINUS_INF = -9999.0  # how vLLM writes a log-prob of -inf in JSON


def _prompt_logprobs(ids: list[int], entries) -> list[float]:
    """The log-prob of each token of ``ids`` after the first, read from vLLM's ``prompt_logprobs``."""
    if not isinstance(entries, list) or len(entries) != len(ids):
        raise Malformed(f"the answer has no prompt_logprobs for each of the {len(ids)} prompt tokens; it needs a vLLM server "
                        "(prompt_logprobs is vLLM's extra parameter)")
    values = []
    for token, entry in zip(ids[1:], entries[1:]):
        found = entry.get(str(token)) if isinstance(entry, dict) else None
        if not isinstance(found, dict) or not isinstance(found.get("logprob"), (int, float)):
            raise Malformed(f"the answer has no log-prob of prompt token {token}; check that it serves the teacher's folder")
        value = float(found["logprob"])
        values.append(-math.inf if value <= _VLLM_MINUS_INF else value)  # the teacher's check then sees it
    return values


def _pooled_score(value) -> float:
    """The score in one pooling output: a number, ``[number]``, or per token ``[[number], ...]`` (the last)."""
    while isinstance(value, list) and value and isinstance(value[-1], list):
        value = value[-1]  # per-token outputs: the last token's is the sequence's score
    if isinstance(value, list) and len(value) == 1:
        value = value[0]
    if isinstance(value, list):
        raise Malformed(f"a pooling output of {len(value)} numbers, not one score: serve a reward model or sequence "
                        "classifier with one label")
    return finite(value, "the reward model")


__all__ = ["ChatCompletions", "Malformed", "OpenRLHF", "PromptLogprobs", "Protocol", "Request", "ScoredText",
           "VLLMPooling", "finite"]
