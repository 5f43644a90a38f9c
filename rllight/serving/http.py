"""The one JSON-over-HTTP client of the servers a run talks to (``rllight.serving.Endpoint`` is its only user).

- **The API key** is read from the environment variable a recipe names (``api_key_env``), when a batch starts,
  and sent as ``Authorization: Bearer <key>``; it is never kept in an attribute, so ``repr``, pickles and
  ``--print_config`` cannot hold it, and every text a failure quotes has it replaced by ``[key]`` (``redact``).
- **One attempt** (``JSONClient.once``) lasts at most its timeout, the whole of it: connecting, sending, the
  headers and the body together. A watchdog shuts the socket at the deadline, so a server that sends a byte a
  second cannot hold an attempt past it (a socket timeout alone bounds each read, not their sum). It returns the
  decoded JSON object, or raises ``Failure``: a status other than 2xx, a timeout, a refused or broken connection,
  or an answer that is not a JSON object, each with the server's words (or the cause) in ``detail``.
- **Retries** (``JSONClient.call``): after HTTP 429 and 5xx, timeouts and connection errors, ``retries`` more
  attempts, waiting ``backoff_seconds`` doubled after each; a ``Retry-After`` header is honoured up to twice the
  backoff it replaces. Other 4xx and answers that are not JSON are not retried: a second attempt would get the same.
  The waits go through a callable, so a caller can cut them short (a batch that hit its time bound).

The proxies of the environment (``http_proxy``, ``https_proxy``, ``no_proxy``) are used as ``urllib`` would.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import socket
import threading
import time
import urllib.parse
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


def attempts(n: int) -> str:
    """``1 attempt``, ``3 attempts``."""
    return f"{n} attempt{'s' if n != 1 else ''}"


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
    """JSON requests with a deadline per attempt and retries (see the module's docstring).

    Args:
        timeout_seconds: Longest time one attempt may take, from connecting to the answer's last byte.
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
        status, phrase, retry_after, text = _exchange(url, data, headers,
                                                      self.timeout_seconds if timeout is None else timeout, key)
        if not 200 <= status < 300:
            raise Failure("status", redact(" ".join(text.split()), key), status=status, phrase=phrase,
                          retry_after=_seconds(retry_after))
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
             before: Callable[[int], float | None] | None = None, empty: dict | None = None) -> dict:
        """``once`` with the retries. ``wait(seconds)`` sleeps between attempts and returns True to give up;
        ``before(attempt)`` runs before each (from 0) and returns that attempt's timeout (None: the client's),
        or raises to give up. The last ``Failure`` is raised with ``attempts`` set."""
        for attempt in range(self.retries + 1):
            timeout = before(attempt) if before is not None else None
            try:
                return self.once(url, body, key, timeout, empty)
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


def _connection(url: str, timeout: float) -> tuple[http.client.HTTPConnection, str]:
    """A connection to ``url``'s server (through the environment's proxy where one applies) and the request target."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise Failure("unreachable", f"not an http(s) URL: {url!r}")
    secure = parts.scheme == "https"
    kind = http.client.HTTPSConnection if secure else http.client.HTTPConnection
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    proxy = urllib.request.getproxies().get(parts.scheme)
    if not proxy or urllib.request.proxy_bypass(parts.hostname):
        return kind(parts.hostname, parts.port, timeout=timeout), target
    via = urllib.parse.urlsplit(proxy if "://" in proxy else f"http://{proxy}")
    if not secure:  # a plain proxy takes the whole URL as the target
        return http.client.HTTPConnection(via.hostname, via.port, timeout=timeout), url
    connection = kind(via.hostname, via.port, timeout=timeout)
    connection.set_tunnel(parts.hostname, parts.port)
    return connection, target


def _exchange(url: str, data: bytes | None, headers: dict, timeout: float,
              key: str | None) -> tuple[int, str, str | None, str]:
    """``(status, reason phrase, Retry-After, text)`` of one request, all of it within ``timeout`` seconds;
    ``Failure`` (``timeout`` or ``unreachable``) when there is no whole answer."""
    connection, target = _connection(url, timeout)
    expired, held = threading.Event(), []  # held: the socket, kept here (a response that closes takes it over)

    def cut() -> None:  # the deadline: a read blocked on the socket returns at once
        expired.set()
        for sock in held:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    watchdog = threading.Timer(timeout, cut)
    watchdog.daemon = True
    watchdog.start()
    try:
        connection.connect()  # within ``timeout`` too: the connection's own
        held.append(connection.sock)
        if expired.is_set():
            cut()
        connection.request("GET" if data is None else "POST", target, body=data, headers=headers)
        response = connection.getresponse()
        text = response.read().decode(errors="replace")
        if expired.is_set():  # cut while the last bytes came: not a whole answer
            raise TimeoutError("timed out")
        return response.status, str(response.reason or ""), response.getheader("Retry-After"), text
    except (OSError, http.client.HTTPException) as err:
        if expired.is_set() or isinstance(err, TimeoutError) or "timed out" in str(err):
            raise Failure("timeout", "timed out") from None
        raise Failure("unreachable", redact(" ".join(str(err).split()) or type(err).__name__, key)) from None
    finally:
        watchdog.cancel()
        connection.close()


def _seconds(value: str | None) -> float | None:
    try:
        return max(0.0, float(value)) if value is not None else None
    except ValueError:
        return None  # an HTTP date: the exponential backoff instead


__all__ = ["Failure", "JSONClient", "attempts", "check_key_env", "read_key", "redact", "snippet"]
