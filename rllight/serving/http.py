"""The one JSON-over-HTTP client of the servers a run talks to (``rllight.serving.Endpoint`` is its only user).

- **The API key** is read from the environment variable a recipe names (``api_key_env``), when a batch starts,
  and sent as ``Authorization: Bearer <key>``; it is never kept in an attribute, so ``repr``, pickles and
  ``--print_config`` cannot hold it. Every text a failure quotes has each run of 8 or more consecutive characters of
  the key replaced by ``[key]`` (``redact``), masked before the text is cut to its length (``clip``), so neither an
  echoed key, nor a prefix left by a cut, nor a key split by a server's escapes shows 8 characters of it. A recipe
  value of ``api_key_env`` that looks like a key is refused without being printed (``check_key_env``).
- **One attempt** (``JSONClient.once``) lasts at most its timeout, the whole of it: connecting, sending, the
  headers and the body together. A watchdog shuts the socket at the deadline, so a server that sends a byte a
  second cannot hold an attempt past it (a socket timeout alone bounds each read, not their sum). It returns the
  decoded JSON object, or raises ``Failure``: a status other than 2xx, a timeout, a refused or broken connection,
  an answer that is not a JSON object, or a 2xx answer longer than ``max_answer_bytes`` (read in slices and given up
  at the limit, so memory stays bounded whatever the server sends; an error's answer is read up to 64 KiB, for its
  words), each with the server's words (or the cause) in ``detail``.
- **Retries** (``JSONClient.call``): after HTTP 429 and 5xx, timeouts and connection errors, ``retries`` more
  attempts, waiting ``backoff_seconds`` doubled after each; a ``Retry-After`` header is honoured up to twice the
  backoff it replaces. Other 4xx, answers that are not JSON and answers over the size limit are not retried: a second
  attempt would get the same.
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
KEY_PREFIXES = ("hf_", "ghp_", "gho_", "ghu_", "ghs_", "ghr_", "github_pat_", "gsk_", "sk_", "pk_", "rk_", "AKIA",
                "ASIA", "AIza", "r8_")
"""How the keys of common services begin when they are made of letters, digits and underscores only (Hugging Face,
GitHub, Groq, Stripe, AWS, Google, Replicate); keys with a hyphen (``sk-``, ``sk-ant-``, ``xoxb-``...) are no
variable's name at all."""
RUN = 8
"""``redact`` masks every run of this many consecutive characters of a key, or more."""
_DETAIL = 1000  # characters of a server's answer a Failure keeps
_ERROR_BYTES = 64 * 1024  # bytes of an error's answer read: only its first words are quoted


def looks_like_key(name: str) -> bool:
    """Whether ``name``, given where an environment variable's name goes, is no name or looks like a key:

    - it is not a name (letters, digits and underscores, not starting with a digit): ``sk-proj-...``, ``xoxb-...``;
    - it starts with one of ``KEY_PREFIXES`` (case as written) and the 12 or more characters after it mix letters
      with digits or lower with upper case: ``hf_AbCd...``, ``AKIAIOSFODNN7EXAMPLE`` (``hf_token`` and ``HF_TOKEN``
      are names);
    - it has 20 characters or more, no underscore, and both letters and digits (a long name joins its words with
      underscores);
    - it has 32 characters or more with lower-case letters, upper-case letters and digits all in it."""
    name = str(name)
    if not _KEY_ENV.fullmatch(name):
        return True
    for prefix in KEY_PREFIXES:
        tail = name[len(prefix):]
        if name.startswith(prefix) and len(tail) >= 12 and len(_classes(tail) - {"_"}) >= 2:
            return True
    classes = _classes(name)
    if len(name) >= 20 and "_" not in classes and "digit" in classes and len(classes) >= 2:
        return True
    return len(name) >= 32 and {"lower", "upper", "digit"} <= classes


def _classes(text: str) -> set[str]:
    """The kinds of character in ``text``: ``lower``, ``upper``, ``digit``, ``_``."""
    return {"lower" if c.islower() else "upper" if c.isupper() else "digit" if c.isdigit() else "_" for c in text}


def check_key_env(name: str | None, where: str) -> None:
    """``RecipeError`` in one line where ``name`` (a recipe's ``api_key_env``, at ``where``) is no environment
    variable's name or looks like a key pasted in its place (``looks_like_key``); the value is not printed."""
    if name is not None and looks_like_key(name):
        raise RecipeError(f"{where}.api_key_env must be the NAME of an environment variable (letters, digits, "
                          "underscores, e.g. JUDGE_API_KEY), not the key itself; the value given looks like a key "
                          "and is not printed: export the key in a variable and name the variable here")


def read_key(name: str | None, where: str, whose: str) -> str | None:
    """The value of the environment variable ``name`` (None where no key is configured); ``RecipeError`` naming
    ``where`` when it is unset or empty. ``whose`` says whose key it is (``the judge's``)."""
    if name is None:
        return None
    check_key_env(name, where)  # a key in the name's place is not printed by the message below
    key = os.environ.get(name)
    if not key:
        raise RecipeError(f"{where}.api_key_env: the environment variable {name} is not set (or empty); export it "
                          f"with {whose} API key before the run")
    return key


def redact(text: str, key: str | None) -> str:
    """``text`` with every run of ``RUN`` (8) or more consecutive characters of ``key`` replaced by ``[key]`` (the
    whole key where it is shorter): the key, a prefix a cut left or a piece between a server's escapes."""
    if not key or not text:
        return text
    n = min(RUN, len(key))
    spans = []
    for gram in {key[i:i + n] for i in range(len(key) - n + 1)}:
        at = text.find(gram)
        while at != -1:
            spans.append((at, at + n))
            at = text.find(gram, at + 1)
    if not spans:
        return text
    out, done = [], 0  # the text up to ``done`` is written
    spans.sort()
    start, end = spans[0]
    for s, e in spans[1:] + [(len(text) + 1, len(text) + 1)]:
        if s <= end:  # overlapping or touching: one run
            end = max(end, e)
            continue
        out += [text[done:start], "[key]"]
        done, (start, end) = end, (s, e)
    return "".join(out) + text[done:]


def clip(text, n: int, mask: Callable[[str], str] | None = None) -> str:
    """``text`` on one line, ``mask`` applied (a redaction: ``Placement.redact``), at most ``n`` characters
    (``...`` marks a cut). The mask runs before the cut, on a little more than ``n`` characters, so that a key the
    cut goes through is masked whole rather than leaving a prefix."""
    text = " ".join(str(text)[:64 * (n + 64)].split())
    head = text[:n + 64]
    head = mask(head) if mask is not None else head
    return head[:n] + ("..." if len(head) > n or len(text) > n + 64 else "")


def snippet(value, n: int = 80, mask: Callable[[str], str] | None = None) -> str:
    """``value``'s text on one line, ``mask`` applied before the cut (``clip``), at most ``n`` characters (``...``
    marks a cut), quoted."""
    return repr(clip(value, n, mask))


def attempts(n: int) -> str:
    """``1 attempt``, ``3 attempts``."""
    return f"{n} attempt{'s' if n != 1 else ''}"


class Failure(Exception):
    """An attempt that failed, and how.

    Attributes:
        kind: ``status`` (the server answered with an HTTP error), ``timeout``, ``unreachable`` (refused, reset or
            broken connection), ``not_json`` (an answer that is not a JSON object) or ``too_large`` (a 2xx answer
            longer than ``max_answer_bytes``).
        detail: The server's answer (``status``, ``not_json``: its first 1000 characters), the limit (``too_large``)
            or the cause (``timeout``, ``unreachable``), on one line, the key redacted.
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
        max_answer_bytes: Longest 2xx answer read, in bytes; a longer one is a ``too_large`` failure. None: no limit.
    """

    def __init__(self, timeout_seconds: float, retries: int = 0, backoff_seconds: float = 1.0,
                 max_answer_bytes: int | None = None):
        self.timeout_seconds, self.retries, self.backoff_seconds = float(timeout_seconds), retries, backoff_seconds
        self.max_answer_bytes = max_answer_bytes

    def once(self, url: str, body: dict | None = None, key: str | None = None, timeout: float | None = None,
             empty: dict | None = None) -> dict:
        """``POST`` ``body`` as JSON (``GET`` where None) to ``url``; the answer's JSON object, ``empty`` where the
        answer is empty and ``empty`` is given; else ``Failure``."""
        data = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json"} if data is not None else {}
        if key:
            headers["Authorization"] = f"Bearer {key}"
        status, phrase, retry_after, text = _exchange(url, data, headers,
                                                      self.timeout_seconds if timeout is None else timeout, key,
                                                      self.max_answer_bytes)
        quoted = lambda: clip(text, _DETAIL, lambda t: redact(t, key))  # noqa: E731
        if not 200 <= status < 300:
            raise Failure("status", quoted(), status=status, phrase=phrase, retry_after=_seconds(retry_after))
        if text is None:
            raise Failure("too_large", f"longer than max_answer_bytes={self.max_answer_bytes}")
        if empty is not None and not text.strip():
            return empty
        try:
            answer = json.loads(text)
        except (ValueError, RecursionError):
            answer = None
        if not isinstance(answer, dict):
            raise Failure("not_json", quoted())
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


def _exchange(url: str, data: bytes | None, headers: dict, timeout: float, key: str | None,
              limit: int | None = None) -> tuple[int, str, str | None, str | None]:
    """``(status, reason phrase, Retry-After, text)`` of one request, all of it within ``timeout`` seconds; the text
    is None for a 2xx answer longer than ``limit`` bytes, and an error's is its first 64 KiB. ``Failure``
    (``timeout`` or ``unreachable``) when there is no whole answer."""
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
        body = _read(response, limit if 200 <= response.status < 300 else _ERROR_BYTES)
        text = None if body is None else body.decode(errors="replace")
        if expired.is_set():  # cut while the last bytes came: not a whole answer
            raise TimeoutError("timed out")
        return response.status, str(response.reason or ""), response.getheader("Retry-After"), text
    except (OSError, http.client.HTTPException) as err:
        if expired.is_set() or isinstance(err, TimeoutError) or "timed out" in str(err):
            raise Failure("timeout", "timed out") from None
        raise Failure("unreachable", clip(str(err) or type(err).__name__, _DETAIL, lambda t: redact(t, key))) \
            from None
    finally:
        watchdog.cancel()
        connection.close()


def _read(response: http.client.HTTPResponse, limit: int | None, piece: int = 1 << 20) -> bytes | None:
    """The answer's body, read in slices of ``piece`` bytes; None once it is longer than ``limit`` (a 2xx answer:
    reading stops there), or its first ``limit`` bytes (an error's answer, ``limit`` being ``_ERROR_BYTES``)."""
    declared = response.getheader("Content-Length")
    if limit is not None and 200 <= response.status < 300 and declared and declared.strip().isdigit() \
            and int(declared) > limit:
        return None  # said too long: not read at all
    parts, size = [], 0
    while limit is None or size <= limit:
        part = response.read(piece if limit is None else min(piece, limit + 1 - size))
        if not part:
            if response.length:  # the connection ended before the length it declared
                raise http.client.IncompleteRead(b"".join(parts), response.length)
            return b"".join(parts)
        parts.append(part)
        size += len(part)
    return None if 200 <= response.status < 300 else b"".join(parts)[:limit]


def _seconds(value: str | None) -> float | None:
    try:
        return max(0.0, float(value)) if value is not None else None
    except ValueError:
        return None  # an HTTP date: the exponential backoff instead


__all__ = ["KEY_PREFIXES", "RUN", "Failure", "JSONClient", "attempts", "check_key_env", "clip", "looks_like_key",
           "read_key", "redact", "snippet"]
