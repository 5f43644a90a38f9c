"""A model served at a URL: the one place where a server's address, key, timeout, retries, backoff and request limits
are declared, for reward models, judges, a distillation teacher and the vLLM rollout server.

In a recipe::

    placement:
      class_path: rllight.serving.Endpoint
      init_args: {url: http://127.0.0.1:8000, api_key_env: RM_KEY, protocol: {class_path: rllight.serving.VLLMPooling}}

How a batch runs (``answer``):

- The key is read from the environment variable ``api_key_env`` names when the batch starts, sent as a bearer
  token and never kept: not in an attribute, ``repr``, pickle or ``--print_config``. Every ``Failed`` the endpoint
  gives (the transport's reasons, a protocol's ``Malformed`` and errors) has each run of 8 or more characters of the
  key masked as ``[key]``, before any cut to length (``rllight.serving.http.redact``).
- The ``protocol`` (``rllight.serving.protocols``) writes the batch's requests; at most ``max_concurrency`` are in
  flight, at most ``requests_per_second`` start each second. Each attempt lasts at most ``timeout_seconds``, the
  whole of it (``rllight.serving.http``); HTTP 429 and 5xx, timeouts and connection errors are retried ``retries``
  times with a doubling ``backoff_seconds`` (``Retry-After`` honoured), other 4xx and answers that are not JSON are
  not. An answer longer than ``max_answer_bytes`` fails its request, not retried; reading stops at the limit, so a
  server cannot fill the trainer's memory. The protocol reads each answer; one it cannot read fails the inputs of its
  request.
- The whole batch has a time bound (what its requests could take, retries and the rate limit included, plus a few
  seconds) and the trainer waits for it in short slices, so Ctrl-C is honoured within seconds. A request still
  running at the bound fails its inputs; its thread is left to end at its own deadline and the next batch gets
  fresh threads, so a stuck request never delays the next batch's.
- The value of a failed input is a ``Failed`` whose message is one line naming the server, the route and what to
  check; the owner decides what it costs (a judge's sample, a reward model's batch, a teacher's step).
"""

from __future__ import annotations

import math
import os
import re
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from rllight.bounds import NonNegativeFloat, NonNegativeInt, PositiveFiniteFloat, PositiveInt, check_declared
from rllight.errors import RecipeError
from rllight.serving.http import (Failure, JSONClient, attempts, check_key_env, clip, looks_like_key, read_key,
                                  redact)
from rllight.serving.placement import Failed, Placement, Served
from rllight.serving.protocols import Malformed, Protocol, Request
from rllight.stopping import call_stoppable, wait_stoppable

LARGEST_ANSWER = 2 ** 30
"""``max_answer_bytes`` where neither the recipe nor the owner (its ``default_max_answer_bytes``) sets one: 1 GiB,
for answers that grow with the tokens asked for (a teacher's log-probs, a rollout server's completions)."""


class Endpoint(Placement):
    """A server at ``url`` that answers in ``protocol`` (see ``rllight.serving.endpoint``).

    Args:
        url: The server's base URL; the protocol's route is appended (``http://127.0.0.1:8000`` for vLLM's
            ``/pooling`` or ``/v1/completions``; ``http://127.0.0.1:8000/v1`` for chat completions, as OpenAI clients
            take it).
        protocol: The wire protocol (``rllight.serving.VLLMPooling``, ``OpenRLHF``, ``ChatCompletions``,
            ``PromptLogprobs`` or your own); None = the owner's usual one.
        api_key_env: The NAME of the environment variable that holds the API key (sent as a bearer token), read when
            each batch starts; None = no key. The key itself is never a setting.
        timeout_seconds: Longest time one attempt may take, its whole answer included; None = the owner's default.
        retries: Further attempts after HTTP 429 or 5xx, a timeout or a connection error (not after another 4xx).
        backoff_seconds: Wait before the first retry; it doubles with each further one.
        max_concurrency: Requests in flight at once.
        requests_per_second: At most this many requests (retries included) start per second (no bursts); None = no
            limit.
        max_answer_bytes: Longest answer read, in bytes; a longer one fails its request, not retried (counted as the
            owner counts failures). None = the owner's default: 8 MiB for a judge's chat completion, 64 MiB for a
            reward model's batch of scores, else 1 GiB (a teacher's log-probs, a rollout server's completions).
    """

    def __init__(self, url: str, protocol: Protocol | None = None, api_key_env: str | None = None,
                 timeout_seconds: PositiveFiniteFloat | None = None, retries: NonNegativeInt = 2,
                 backoff_seconds: NonNegativeFloat = 1.0, max_concurrency: PositiveInt = 8,
                 requests_per_second: PositiveFiniteFloat | None = None, max_answer_bytes: PositiveInt | None = None):
        self.url = url.rstrip("/") if isinstance(url, str) else url
        self.protocol, self.api_key_env = protocol, api_key_env
        self.timeout_seconds, self.retries, self.backoff_seconds = timeout_seconds, retries, backoff_seconds
        self.max_concurrency, self.requests_per_second = max_concurrency, requests_per_second
        self.max_answer_bytes = max_answer_bytes
        self.what = "the server"
        self._pool: ThreadPoolExecutor | None = None
        self._rate_lock = threading.Lock()
        self._next_start = 0.0  # time.monotonic() before which no request may start (the rate limit)

    def __repr__(self) -> str:  # settings only: the key is not one, nor a key given where its variable's name goes
        name = "'[not a name: hidden]'" if self.api_key_env is not None and looks_like_key(self.api_key_env) \
            else repr(self.api_key_env)
        return (f"Endpoint(url={self.url!r}, protocol={self.protocol!r}, api_key_env={name}, "
                f"timeout_seconds={self.timeout_seconds!r})")

    def __str__(self) -> str:
        return str(self.url)

    def __getstate__(self) -> dict:  # copies (checkpoints, worker processes) carry the settings, not threads or locks
        return {**self.__dict__, "_pool": None, "_rate_lock": None, "_next_start": 0.0}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._rate_lock = threading.Lock()

    def bind(self, where: str, served: Served | None = None, what: str | None = None,
             timeout: float | None = None) -> Endpoint:
        """Check the settings (one ``RecipeError`` line naming ``where``) and take ``served``'s defaults: its
        protocol, its timeout and its name in the protocol's requests. The rollout engine, which speaks its own
        routes, binds without a ``served`` and gives its name (``what``) and default ``timeout`` itself."""
        super().bind(where, served)
        self.what = what or served.what
        if self.timeout_seconds is None:
            self.timeout_seconds = timeout if served is None else served.default_timeout
        if self.max_answer_bytes is None:
            self.max_answer_bytes = getattr(served, "default_max_answer_bytes", None) or LARGEST_ANSWER
        if not isinstance(self.url, str) or not re.match(r"https?://[^/\s]+", self.url):
            raise RecipeError(f"{where}.url must be the server's URL, starting with http:// or https://, got "
                              f"{self.url!r}")
        check_key_env(self.api_key_env, where)
        if served is not None:
            self.protocol = self.protocol or served.default_protocol()
            self.protocol.model = self.protocol.model or served.served_name()
        if self.protocol is not None:
            self.protocol.check(f"{where}.protocol.init_args")
            _check_base(self.url, self.protocol.route, where)
        check_declared(self, where)  # the bounds of __init__'s annotations (timeout_seconds filled in above)
        return self

    def key(self) -> str | None:
        """The API key, read now from ``api_key_env``'s variable (None without one); ``RecipeError`` if unset."""
        return read_key(self.api_key_env, self.where, f"{self.what}'s")

    def check(self, served: Served | None = None) -> None:
        """Before the policy loads: the key's variable is set, and the server answers the protocol's ``probe_route``
        (one ``GET``, no retry) without refusing the key; ``RecipeError`` in one line where it is unreachable, does
        not answer within ``timeout_seconds`` (at most 30 s here) or answers HTTP 401 or 403. Any other answer
        passes: the route may differ on a server of one's own, and its first batch says what is wrong."""
        key = self.key()
        route = self.protocol.probe_route if self.protocol is not None else None
        if route is None:
            return
        client = JSONClient(min(self.timeout_seconds, 30.0), retries=0, max_answer_bytes=self.max_answer_bytes)
        finished, _, error = call_stoppable(lambda: client.once(self.url + route, None, key, empty={}),
                                            min(self.timeout_seconds, 30.0) + 5.0, f"{self.what} at {self.url}")
        if not finished:
            error = Failure("timeout", "timed out")
        if not isinstance(error, Failure) or (error.kind != "timeout" and error.kind != "unreachable"
                                               and error.status not in (401, 403)):
            return
        raise RecipeError(f"{self.where}: {self.redact(self.describe(error, route))} (asked once before the run)")

    def redact(self, text: str) -> str:
        return redact(text, self._secret())

    def _secret(self) -> str | None:
        """The key as the environment holds it now, for masking (None without one; no error where it is unset)."""
        return os.environ.get(self.api_key_env) if self.api_key_env and not looks_like_key(self.api_key_env) else None

    def _masked(self, failed: Failed, key: str | None) -> Failed:
        """``failed`` with ``key`` masked in its reason (``redact``): every ``Failed`` the endpoint gives passes here."""
        return Failed(redact(str(failed), key), failed.failure, failed.route)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None

    # ------------------------------------------------------------------------------------------ a batch
    def answer(self, served: Served, inputs: list) -> list[Any]:
        """One value per input from the server (see ``rllight.serving.endpoint``); a ``Failed`` for each input
        whose request failed."""
        if not inputs:
            return []
        key = self.key()
        try:
            self.protocol.prepare(self.call)
        except Malformed as err:
            return [self._masked(Failed(f"{self.what} at {self.url}: {err}"), key)] * len(inputs)
        except Failed as failed:
            return [self._masked(failed, key)] * len(inputs)
        requests = self.protocol.requests(list(inputs))
        out: list[Any] = [Failed(f"{self.what} at {self.url}: no request covered this input")] * len(inputs)
        for request, values in zip(requests, self._run(requests, key)):
            values = values if isinstance(values, list) else [values] * len(request.index)
            for i, value in zip(request.index, values):
                out[i] = value
        return [self._masked(v, key) if isinstance(v, Failed) else v for v in out]

    def bound(self, requests: int) -> float:
        """Seconds ``requests`` requests may take at most: their waves under ``max_concurrency``, each with its
        retries and backoffs, the rate limit's spacing, and a few seconds."""
        per_request = (self.retries + 1) * self.timeout_seconds + self.backoff_seconds * (2 ** self.retries - 1)
        rate = requests * (self.retries + 1) / self.requests_per_second if self.requests_per_second else 0.0
        return math.ceil(requests / self.max_concurrency) * per_request + rate + 5.0

    def _run(self, requests: list[Request], key: str | None) -> list[list | Failed]:
        """Each request's values, or a ``Failed``, waiting at most the batch's time bound."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.max_concurrency, thread_name_prefix="rllight-endpoint")
        bound = self.bound(len(requests))
        deadline = time.monotonic() + bound
        cancel, done, left, lock = threading.Event(), threading.Event(), [len(requests)], threading.Lock()

        def finished(_: Future) -> None:
            with lock:
                left[0] -= 1
                if not left[0]:
                    done.set()

        futures = []
        for request in requests:
            futures.append(self._pool.submit(self._one, request, key, cancel, deadline))
            futures[-1].add_done_callback(finished)
        try:
            wait_stoppable(done, bound, f"{self.what} at {self.url}")
        finally:
            cancel.set()  # retries and rate-limit waits of what is still running stop now
            for future in futures:
                future.cancel()
            if not done.is_set():  # threads still held by a request: the next batch gets fresh ones
                self._pool.shutdown(wait=False, cancel_futures=True)
                self._pool = None
        late = Failed(f"no answer from {self.what} at {self.url} within the batch's time bound of {bound:.0f} s")
        return [late if not f.done() or f.cancelled() else f.result() for f in futures]

    def _one(self, request: Request, key: str | None, cancel: threading.Event, deadline: float) -> list | Failed:
        route = self.protocol.route
        mask = lambda text: redact(text, key)  # noqa: E731
        try:
            answer = self._post(route, request.body, key, cancel, deadline)
            values = self.protocol.parse(answer, request)
        except Failed as failed:
            return failed
        except Malformed as err:
            return Failed(f"{self.what} at {self.url} answered {route}: {clip(err, 1000, mask)}", route=route)
        except Exception as err:  # noqa: BLE001 - a protocol's bug fails its request's inputs, in one line
            return Failed(clip(f"{self.what} at {self.url} answered {route}: {type(err).__name__}: {err}", 300, mask),
                          route=route)
        if len(values) != len(request.index):
            return Failed(f"{self.what} at {self.url} answered {route} with {len(values)} values for "
                          f"{len(request.index)} inputs", route=route)
        return values

    # ------------------------------------------------------------------------------------- one request
    def call(self, route: str, body: dict | None = None, empty: dict | None = None) -> dict:
        """``GET`` (no body) or ``POST`` a JSON body to ``url + route`` with the retries; the decoded answer
        (``empty`` for an empty one where given), else ``Failed``. On the main thread it is waited for in short
        slices, so that Ctrl-C or SIGTERM stops the run within seconds however long the server takes."""
        key = self.key()
        if threading.current_thread() is not threading.main_thread():
            try:
                return self._post(route, body, key, threading.Event(), time.monotonic() + self.bound(1), empty)
            except Failed as failed:
                raise self._masked(failed, key) from None
        bound = self.bound(1)
        finished, value, error = call_stoppable(
            lambda: self._post(route, body, key, threading.Event(), time.monotonic() + bound, empty), bound,
            f"{self.what} at {self.url} ({route})")
        if isinstance(error, Failed):
            raise self._masked(error, key) from None
        if error is not None:
            raise error
        if not finished:
            raise Failed(f"no answer from {self.what} at {self.url} to {route} within {bound:.0f} s; check that it "
                         f"runs and the URL ({self.where}.url)", route=route)
        return value

    def _post(self, route: str, body: dict | None, key: str | None, cancel: threading.Event, deadline: float,
              empty: dict | None = None) -> dict:
        """One request with its retries, none starting past ``deadline``; ``Failed`` with the reason."""

        def before(attempt: int) -> float:
            self._wait_for_rate(cancel, route)
            left = deadline - time.monotonic()
            if left <= 0:
                raise Failed(f"no answer from {self.what} at {self.url} to {route} within the batch's time bound "
                             f"(attempt {attempt + 1})", route=route)
            return min(self.timeout_seconds, left)

        client = JSONClient(self.timeout_seconds, self.retries, self.backoff_seconds, self.max_answer_bytes)
        try:
            return client.call(self.url + route, body, key, wait=cancel.wait, before=before, empty=empty)
        except Failure as failure:
            raise Failed(self.describe(failure, route, key), failure, route) from None

    def describe(self, failure: Failure, route: str, key: str | None = None) -> str:
        """The one-line reason of a request to ``route`` that failed as ``failure`` says, with what to check; the
        server's words quoted with ``key`` masked before they are cut."""
        at, mask = f"{self.what} at {self.url}", (lambda text: redact(text, key))
        if failure.kind == "not_json":
            line = (f"{at} answered {route} with something other than a JSON object "
                    f"({clip(failure.detail, 80, mask)!r}); check the URL ({self.where}.url)")
        elif failure.kind == "status":
            hint = (f"check {self.where}.api_key_env" if failure.status in (401, 403) else
                    f"check the URL ({self.where}.url) and that the server answers {route}" if failure.status == 404
                    else "see the server's log" if failure.retryable else "see the server's answer")
            line = (f"{at} answered {route} with HTTP {failure.status} "
                    f"({clip(failure.detail, 300, mask) or failure.phrase}); {hint}")
        elif failure.kind == "too_large":
            line = (f"{at} answered {route} with more than max_answer_bytes={self.max_answer_bytes} bytes; check the "
                    f"URL and what the server returns, or raise {self.where}.max_answer_bytes")
        else:
            line = (f"no answer from {at} to {route} within timeout_seconds={self.timeout_seconds:g} "
                    f"({failure.detail}); check that it runs and the URL ({self.where}.url)")
        return line + (f" (after {attempts(failure.attempts)})" if failure.attempts > 1 else "")

    def _wait_for_rate(self, cancel: threading.Event, route: str) -> None:
        if not self.requests_per_second:
            return
        with self._rate_lock:
            now = time.monotonic()
            start = max(now, self._next_start)
            self._next_start = start + 1.0 / self.requests_per_second
        if start > now and cancel.wait(start - now):
            raise Failed(f"{self.what} at {self.url}: given up before its turn under requests_per_second", route=route)


def _check_base(url: str, route: str, where: str) -> None:
    """``RecipeError`` for a URL that already ends with the route, or with its first part (``/v1`` of
    ``/v1/completions``): the URL pasted whole, which would ask ``.../v1/v1/completions``."""
    for tail in (route, route.rsplit("/", 1)[0]):
        if tail and url.endswith(tail):
            raise RecipeError(f"{where}.url is the server's base URL: drop {tail} from {url!r}, the protocol "
                              f"appends {route}")


__all__ = ["Endpoint"]
