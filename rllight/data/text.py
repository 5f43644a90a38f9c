"""How rllight reads text: one decoding policy for every reader, and a bound on the size of a row.

**Decoding** (``data.decode_errors``). Every reader uses this module: data files (JSONL, JSON, parquet,
``datasets`` folders, an embedded task's rows), ``rllight generate``'s ``--prompts`` files and ``--prompt``
text, and ``rllight chat``'s input. Bytes are decoded as UTF-8 with ``surrogateescape`` (``decode``): a byte
that is not UTF-8 becomes a lone surrogate (U+DC80..U+DCFF) instead of an exception, as an escaped lone
surrogate in JSON (``"\\ud800"``) already is. Such text cannot be encoded as UTF-8, so no tokenizer takes it
(it raises), nor can it be written to a log or a JSON file. ``TextPolicy.clean`` then deals with each row that
holds some:

- ``replace`` (the default): each bad character becomes U+FFFD, the replacement character (one per byte that
  is not UTF-8), and the row is kept;
- ``skip``: the row is left out;
- ``error``: one line naming the row and the field.

Rows replaced or left out are counted in one warning per file, which names the first. Nothing is changed
silently, and nothing crashes later: rows are cleaned when the file is read, so a run resumed from a checkpoint
reads the same clean rows.

**Size** (``data.max_row_bytes``). Files are read a row at a time, never whole: a JSONL line (or a ``.txt``
line, or a line of chat input) longer than the bound is one error naming its line and the setting, raised
before the line is read whole, so a 1 GB line costs at most the bound in memory. Rows that a library reads
(parquet, ``datasets`` folders) or that a task makes are measured after they are read (their text in
characters), with the same error: pyarrow itself reads a whole row group, whatever its size.
"""

from __future__ import annotations

import itertools
import logging
import re
from collections.abc import Callable, Iterator

from rllight.bounds import PositiveInt, bounded
from rllight.errors import RecipeError

log = logging.getLogger(__name__)

DECODE_ERRORS = ("replace", "skip", "error")
"""What is done with a row whose text is not UTF-8: see the module's docstring."""

MAX_ROW_BYTES = 16 * 2**20
"""The default bound on a row's size: 16 MiB, millions of tokens, above any prompt a model's context takes."""

_BAD = re.compile(r"[\ud800-\udfff]")  # lone surrogates: what cannot be encoded as UTF-8
BOM = b"\xef\xbb\xbf"


def decode(data: bytes) -> str:
    """UTF-8 text; a byte that is not UTF-8 becomes a lone surrogate, for ``TextPolicy.clean`` to find."""
    return data.decode("utf-8", "surrogateescape")


def bad_field(value: object, path: str = "") -> str | None:
    """Where in ``value`` (a string, or dicts and lists of them, keys included) the first text that cannot be
    encoded as UTF-8 is: a path such as ``prompt[1].content`` ("" for ``value`` itself); None when there is none."""
    if isinstance(value, str):
        return path if not value.isascii() and _BAD.search(value) else None
    if isinstance(value, dict):
        for key, item in value.items():
            inner = f"{path}.{key}" if path else str(key)
            found = bad_field(key, inner) if isinstance(key, str) else None
            if found is None:
                found = bad_field(item, inner)
            if found is not None:
                return found
    elif isinstance(value, list):
        for i, item in enumerate(value):
            found = bad_field(item, f"{path}[{i}]")
            if found is not None:
                return found
    return None


def repaired(value: object) -> object:
    """``value`` with every lone surrogate in its strings (keys included) replaced by U+FFFD."""
    if isinstance(value, str):
        return _BAD.sub("\ufffd", value) if not value.isascii() and _BAD.search(value) else value
    if isinstance(value, dict):
        return {repaired(key): repaired(item) for key, item in value.items()}
    if isinstance(value, list):
        return [repaired(item) for item in value]
    return value


def text_size(value: object) -> int:
    """The characters of text in ``value`` (strings, and dicts and lists of them, keys included)."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, dict):
        return sum(text_size(key) + text_size(item) for key, item in value.items())
    if isinstance(value, list):
        return sum(text_size(item) for item in value)
    return 0


class TextPolicy:
    """A recipe's decoding policy and bound on a row's size (``data.decode_errors``, ``data.max_row_bytes``).

    Args:
        decode_errors: ``replace``, ``skip`` or ``error`` (see the module's docstring).
        max_row_bytes: The largest row, in bytes of its line (characters of its text where a library reads it).
    """

    @bounded
    def __init__(self, decode_errors: str = "replace", max_row_bytes: PositiveInt = MAX_ROW_BYTES):
        if decode_errors not in DECODE_ERRORS:
            raise RecipeError(f"data.decode_errors is {decode_errors!r}; use replace (bad characters become U+FFFD), "
                              "skip (such rows are left out) or error (such a row stops the run)")
        self.decode_errors = decode_errors
        self.max_row_bytes = max_row_bytes

    def too_long(self, where: str) -> RecipeError:
        """The error for a row (``where``: ``"'f.jsonl' line 7"``) over the bound."""
        return RecipeError(f"{where} is longer than data.max_row_bytes ({self.max_row_bytes} bytes); shorten or "
                           "split that row, or raise data.max_row_bytes")

    def clean(self, items: list[tuple[str, object]], name: str, measure: bool = False) -> list[tuple[str, object]]:
        """``items`` (``(where, value)``, e.g. the rows of the file ``name``) under the policy: a value holding text
        that is not UTF-8 is repaired, left out or refused; one warning counts those repaired or left out and
        names the first. ``measure``: also refuse a value whose text is over ``max_row_bytes`` (rows no reader
        of this module has bounded while reading)."""
        kept, changed, first = [], 0, None
        for where, value in items:
            if measure and text_size(value) > self.max_row_bytes:
                raise self.too_long(where)
            field = bad_field(value)
            if field is None:
                kept.append((where, value))
                continue
            shown = f"{where} '{field}'" if field else where
            if self.decode_errors == "error":
                raise RecipeError(f"{shown}: text that is not UTF-8 (a byte that is not UTF-8, or a lone surrogate "
                                  "such as \\ud800); fix the text, or set data.decode_errors to replace (U+FFFD) or "
                                  "skip (leave such rows out)")
            changed, first = changed + 1, first or shown
            if self.decode_errors == "replace":
                kept.append((where, repaired(value)))
        if changed and self.decode_errors == "replace":
            log.warning("%s: %d row(s) with text that is not UTF-8: the bad characters were replaced with U+FFFD "
                        "(first: %s); data.decode_errors skip leaves such rows out, error stops", name, changed, first)
        elif changed:
            log.warning("%s: %d row(s) with text that is not UTF-8 left out (first: %s); data.decode_errors replace "
                        "keeps them with U+FFFD", name, changed, first)
        return kept

    def lines(self, f, where: Callable[[int], str]) -> Iterator[tuple[int, bytes]]:
        """The lines of the binary file ``f``, numbered from 1, without their line end (nor a leading byte-order
        mark), read one at a time: a line over ``max_row_bytes`` is ``too_long(where(number))``, raised before the
        line is read whole."""
        for number in itertools.count(1):
            # Room for "\r\n" after a line of exactly the bound (and for the first line's byte-order mark).
            line = f.readline(self.max_row_bytes + (5 if number == 1 else 2))
            if not line:
                return
            if number == 1 and line.startswith(BOM):
                line = line[len(BOM):]
            if line.endswith(b"\n"):
                line = line[:-1]
            if line.endswith(b"\r"):
                line = line[:-1]
            if len(line) > self.max_row_bytes:
                raise self.too_long(where(number))
            yield number, line
