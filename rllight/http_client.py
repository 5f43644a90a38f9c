"""The one JSON-over-HTTP client of the servers a run talks to: LLM judges, reward-model servers, a distillation
teacher's vLLM server and a vLLM rollout server.

- **The API key** is read from the environment variable a recipe names (``api_key_env``), when a batch starts,
  and sent as ``Authorization: Bearer <key>``; it is never kept in an attribute, so ``repr``, pickles and
  ``--print_config`` cannot hold it, and every text a failure quotes has it replaced by ``[key]`` (``redact``).
- **One attempt** (``JSONClient.once``) waits at most its timeout and returns the decoded JSON object, or raises
  ``Failure``: a status other than 2xx, a timeout, a refused or broken connection, or an answer that is not a
  JSON object, each with the server's words (or the cause) in ``detail``.
- **Retries** (``JSONClient.call``): after HTTP 429 and 5xx, timeouts and connection errors, ``retries`` more
  attempts, waiting ``backoff_seconds`` doubled after each; a ``Retry-After`` header is honoured up to twice the
  backoff it replaces. Other 4xx and answers that are not JSON are not retried: a second attempt would get the same.
  The waits go through a callable, so a caller can cut them short (a judge's batch that hit its time bound).

Each caller words its own one-line messages from ``Failure``'s fields: the caller knows what the server is to the
user (the judge, the reward model at ..., the teacher's vLLM server at ...) and which setting to check.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import time
import urllib.error
import urllib.request
from collections.abc import Callable

from rllight.errors import RecipeError

_KEY_ENV = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def check_key_env(name: str | None, where: str) -> None:
    """``RecipeError`` where ``name`` (a recipe's ``api_key_env``, at ``where``) cannot be an environment variable's
    name, which is what a key pasted in its place looks like."""
    if name is not None and not _KEY_ENV.fullmatch(str(name)):
        raise RecipeError(f"{where}.api_key_env must be the NAME of an environment variable (letters, digits, "
                          "underscores), not the key itself")


def read_key(name: str | None, where: str, whose: str) -> str | None:
    """The value of the environment variable ``name`` (None where no key is configured); ``RecipeError`` naming
    ``where`` when it is unset or empty. ``whose`` says whose key it is (``the judge's``)."""
    if name is None:
        return None
    key = os.environ.get(name)
    if not key:
        raise RecipeError(f"{where}.api_key_env: the environment variable {name} is not set (or empty); export it "
                          f"with {whose} API key before the run")
    return key


def redact(text: str, key: str | None) -> str:
    """``text`` with ``key`` replaced by ``[key]``."""
    return text.replace(key, "[key]") if key else text


def snippet(value, n: int = 80) -> str:
    """``value``'s text on one line, at most ``n`` characters (``...`` marks a cut), quoted."""
    text = " ".join(str(value).split())
    return repr(text[:n] + ("..." if len(text) > n else ""))


class Failure(Exception):
    """An attempt that failed, and how.

    Attributes:
        kind: ``status`` (the server answered with an HTTP error), ``timeout``, ``unreachable`` (refused, reset or
            broken connection) or ``not_json`` (an answer that is not a JSON object).
        detail: The server's answer (``status``, ``not_json``) or the cause (``timeout``, ``unreachable``), on one
            line, the key redacted.
        status: The HTTP status (``status`` only).
        phrase: The HTTP reason phrase (``status`` only), for a server whose answer is empty.
        retry_after: Seconds from a ``Retry-After`` header, where there was one.
        attempts: Attempts made when ``JSONClient.call`` gave up.
    """

    def __init__(self, kind: str, detail: str, status: int | None = None, phrase: str = "",
                 retry_after: float | None = None):
        super().__init__(f"{kind}: {f'HTTP {status} ' if status else ''}{detail}")
        self.kind, self.detail, self.status, self.phrase, self.retry_after = kind, detail, status, phrase, retry_after
        self.attempts = 1

    @property
    def retryable(self) -> bool:
        """Whether another attempt may mend it: HTTP 429 or 5xx, a timeout, a connection error."""
        return self.kind in ("timeout", "unreachable") or (self.kind == "status" and (self.status == 429
                                                                                        or self.status >= 500))


class JSONClient:
    """JSON requests with a timeout per attempt and retries (see the module's docstring).

    Args:
        timeout_seconds: Longest wait for one attempt's answer.
        retries: Further attempts after a retryable failure.
        backoff_seconds: Wait before the first retry; it doubles with each further one.
    """

    def __init__(self, timeout_seconds: float, retries: int = 0, backoff_seconds: float = 1.0):
        self.timeout_seconds, self.retries, self.backoff_seconds = float(timeout_seconds), retries, backoff_seconds

    def once(self, url: str, body: dict | None = None, key: str | None = None, timeout: float | None = None,
             empty: dict | None = None) -> dict:
        """``POST`` ``body`` as JSON (``GET`` where None) to ``url``; the answer's JSON object, ``empty`` where the
        answer is empty and ``empty`` is given; else ``Failure``."""
        data = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json"} if data is not None else {}
        if key:
            headers["Authorization"] = f"Bearer {key}"
        request = urllib.request.Request(url, data=data, headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_seconds if timeout is None else timeout) as r:
                text = r.read().decode(errors="replace")
        except urllib.error.HTTPError as err:
            detail = redact(" ".join(err.read().decode(errors="replace").split()), key)
            retry_after = _seconds(err.headers.get("Retry-After") if err.headers else None)
            raise Failure("status", detail, status=err.code, phrase=str(err.reason or ""),
                          retry_after=retry_after) from None
        except (urllib.error.URLError, TimeoutError, OSError, http.client.HTTPException) as err:
            cause = getattr(err, "reason", err)
            timed_out = isinstance(cause, TimeoutError) or "timed out" in str(cause)
            raise Failure("timeout" if timed_out else "unreachable", redact(str(cause), key)) from None
        if empty is not None and not text.strip():
            return empty
        try:
            answer = json.loads(text)
        except ValueError:
            answer = None
        if not isinstance(answer, dict):
            raise Failure("not_json", redact(" ".join(text.split()), key))
        return answer

    def call(self, url: str, body: dict | None = None, key: str | None = None, *,
             wait: Callable[[float], bool | None] = time.sleep,
             before: Callable[[int], float | None] | None = None) -> dict:
        """``once`` with the retries. ``wait(seconds)`` sleeps between attempts and returns True to give up;
        ``before(attempt)`` runs before each (from 0) and returns that attempt's timeout (None: the client's),
        or raises to give up. The last ``Failure`` is raised with ``attempts`` set."""
        for attempt in range(self.retries + 1):
            timeout = before(attempt) if before is not None else None
            try:
                return self.once(url, body, key, timeout)
            except Failure as failure:
                failure.attempts = attempt + 1
                if not failure.retryable or attempt == self.retries:
                    raise
                delay = self.backoff_seconds * 2 ** attempt
                if failure.retry_after is not None:
                    delay = min(failure.retry_after, 2 * delay)
                if wait(delay):
                    raise
        raise AssertionError("unreachable")


def attempts(n: int) -> str:
    """``1 attempt``, ``3 attempts``."""
    return f"{n} attempt{'s' if n != 1 else ''}"


def _seconds(value: str | None) -> float | None:
    try:
        return max(0.0, float(value)) if value is not None else None
    except ValueError:
        return None  # an HTTP date: the exponential backoff instead


__all__ = ["Failure", "JSONClient", "attempts", "check_key_env", "read_key", "redact", "snippet"]
