"""Reading the rows of a file: JSON Lines and JSON arrays streamed a row at a time with the ``json`` module, parquet
files and JSON object documents through ``datasets``, and folders saved by ``datasets.Dataset.save_to_disk``; each
row comes with where it is (``"train.jsonl row 7"``) and is cleaned by the text policy (``rllight.data.text``).
What a row must hold is ``rllight.data.rows``'s."""

from __future__ import annotations

import codecs
import json
import os

from rllight.data.text import BOM, TextPolicy, decode
from rllight.errors import RecipeError


def _one_line(err: BaseException) -> str:
    """The innermost non-empty message of an exception chain, on one line: ``datasets`` wraps the
    parser's error in a generic one ("An error occurred while generating the dataset")."""
    message, seen, current = type(err).__name__, set(), err
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        text = " ".join(str(current).split())
        if text:
            message = text
        current = current.__cause__ or current.__context__
    return message


class JsonNumber(str):
    """A JSON number, kept as the text the file has ("4", "2.50", "12345678901234567890")."""


def json_type(value: object) -> str:
    """The JSON name of a parsed value's type ("number", "array", "string", ...), for messages."""
    if isinstance(value, JsonNumber):
        return "number"
    return {list: "array", str: "string", bool: "boolean", type(None): "null"}.get(type(value), type(value).__name__)


_CHUNK = 1 << 20  # bytes read at a time


class _TextStream:
    """A binary file's text, decoded as it is read (``rllight.data.text.decode``: a byte that is not UTF-8 becomes a
    lone surrogate), held from the start of the line being parsed on, so that a JSON error's line in ``text``
    plus ``line0`` is the file's and its column is the line's."""

    def __init__(self, f):
        self.f, self.decoder = f, codecs.getincrementaldecoder("utf-8")("surrogateescape")
        self.text, self.line0, self.eof = "", 0, False

    def more(self) -> bool:
        """Read on; False at the end of the file."""
        if self.eof:
            return False
        data = self.f.read(_CHUNK)
        self.eof = not data
        self.text += self.decoder.decode(data, final=self.eof)
        return not self.eof

    def skip(self, pos: int) -> int:
        """The first position at or after ``pos`` that is not white space (``len(text)`` at the end of the file)."""
        while True:
            while pos < len(self.text) and self.text[pos] in " \t\r\n\ufeff":  # and the byte-order mark
                pos += 1
            if pos < len(self.text) or not self.more():
                return pos

    def forget(self, pos: int) -> int:
        """Drop the text before the line holding ``pos`` (once there is a chunk's worth: each drop copies what is
        kept); returns ``pos`` in the text kept."""
        if pos < _CHUNK:
            return pos
        cut = self.text.rfind("\n", 0, pos) + 1
        self.line0 += self.text.count("\n", 0, cut)
        self.text = self.text[cut:]
        return pos - cut

    def value(self, pos: int, parser: json.JSONDecoder, bound: int) -> tuple[object, int]:
        """The JSON value at ``pos`` and the position after it, reading on until it is whole. Raises
        ``json.JSONDecodeError`` where the text is not JSON and ``OverflowError`` for a value longer than ``bound``
        characters."""
        while True:
            try:
                value, end = parser.raw_decode(self.text, pos)
            except json.JSONDecodeError as err:
                # Text that ends mid-value fails at its last token (12 characters at most: the two escapes of a
                # surrogate pair), or at the start of a string not closed yet; any other error is in the file.
                cut = err.pos >= len(self.text) - 12 or err.msg.startswith("Unterminated string")
                if not cut:
                    raise
                if len(self.text) - pos > bound:
                    raise OverflowError from err
                if not self.more():
                    raise
                continue
            if end - pos > bound:
                raise OverflowError
            return value, end


def _first_byte(f) -> bytes:
    """The first byte of the binary file ``f`` that is not white space or a byte-order mark (b"" when none)."""
    if f.read(len(BOM)) != BOM:
        f.seek(0)
    while chunk := f.read(1 << 16):
        chunk = chunk.lstrip(b" \t\r\n")
        if chunk:
            return chunk[:1]
    return b""


def _read_array(f, path: str, field: str, help: str, text: TextPolicy) -> list[tuple[str, dict]]:
    """The rows of a binary file holding one JSON array, parsed an item at a time: the file is never held whole,
    and an item longer than ``text.max_row_bytes`` characters is refused before it is read whole."""
    stream, parser = _TextStream(f), json.JSONDecoder(parse_int=JsonNumber, parse_float=JsonNumber)
    pos = stream.skip(0) + 1  # after the "["
    rows: list[tuple[str, dict]] = []
    try:
        while True:
            pos = stream.skip(pos)
            if not rows and stream.text[pos : pos + 1] == "]":
                raise RecipeError(f"{field}: '{path}' holds an empty JSON array; {help}")
            where = f"{path} row {len(rows) + 1}"
            try:
                item, pos = stream.value(pos, parser, text.max_row_bytes)
            except OverflowError:
                raise text.too_long(where) from None
            if not isinstance(item, dict):
                raise RecipeError(f"{where}: a JSON {json_type(item)}, not an object; {help}")
            rows.append((where, item))
            pos = stream.skip(pos)
            if stream.text[pos : pos + 1] == "]":
                pos = stream.skip(pos + 1)
                if pos < len(stream.text):
                    raise json.JSONDecodeError("Extra data", stream.text, pos)
                return rows
            if stream.text[pos : pos + 1] != ",":
                raise json.JSONDecodeError("Expecting ',' delimiter", stream.text, pos)
            pos = stream.forget(pos + 1)
    except json.JSONDecodeError as err:
        raise RecipeError(f"{field}: '{path}' line {stream.line0 + err.lineno} is not valid JSON ({err.msg} at "
                          f"column {err.colno}); fix that line") from err


def _one_object(path: str, bound: int) -> bool:
    """Whether a file whose first line is not JSON is one JSON object (left to ``datasets``, which reads column
    layouts) rather than JSON Lines with a bad line. Parsed whole when it is at most ``bound`` bytes; a larger one
    is taken for an object when its first line is a lone ``{``, as ``json.dump(..., indent=2)`` writes it."""
    with open(path, "rb") as f:
        if os.path.getsize(path) > bound:
            return f.readline(64).removeprefix(BOM).strip() == b"{"
        raw = f.read()
    try:
        return isinstance(json.loads(decode(raw).removeprefix("\ufeff")), dict)
    except json.JSONDecodeError:
        return False


def _read_lines(f, path: str, field: str, help: str, text: TextPolicy) -> list[tuple[str, dict]] | None:
    """The rows of a binary JSON Lines file, a line at a time (``TextPolicy.lines``: a line over the bound is
    refused before it is read whole); None for a file that is one pretty-printed JSON object."""
    parse = {"parse_int": JsonNumber, "parse_float": JsonNumber}
    rows: list[tuple[str, dict]] = []
    # Lines end at "\n" only, not at what str.splitlines() takes: U+2028 and friends may stand unescaped in JSON.
    for number, raw in text.lines(f, lambda n: f"{field}: '{path}' line {n}"):
        if not raw.strip():
            continue
        try:
            item = json.loads(decode(raw), **parse)
        except json.JSONDecodeError as err:
            if not rows and _one_object(path, text.max_row_bytes):
                return None
            raise RecipeError(f"{field}: '{path}' line {number} is not valid JSON ({err.msg} at column "
                              f"{err.colno}); each line must be one JSON object") from err
        if not isinstance(item, dict):
            raise RecipeError(f"{path} line {number}: a JSON {json_type(item)}, not an object; {help}")
        where = f"{path} row {len(rows) + 1}" + ("" if number == len(rows) + 1 else f" (line {number})")
        rows.append((where, item))
    if not rows:
        raise RecipeError(f"{field}: '{path}' is empty; write one JSON object per line, {help}")
    return rows


def _read_json(path: str, field: str, help: str, text: TextPolicy) -> list[tuple[str, dict]] | None:
    """The rows of a JSON Lines file or of a JSON array, each with where it is (``"f.jsonl row 2"``, and
    ``" (line 3)"`` when blank lines put it elsewhere); None for a file that is one JSON object (left to
    ``datasets``, which reads column layouts).

    Read with the ``json`` module, not ``datasets``: a bad line is reported by its 1-based number, and values
    keep their text. ``datasets`` gives a column one type, falling back to pandas when the rows disagree,
    which turns the string "12" into the integer 12, an answer 4 next to 2.5 into "4.0" and a 20-digit
    integer into a float with 17 digits. Numbers are read as their text (``JsonNumber``).

    Streamed, a row at a time, with ``text.max_row_bytes`` as the bound on a row; bytes that are not UTF-8 are
    kept as lone surrogates for ``text.clean`` to deal with (``rllight.data.text``)."""
    with open(path, "rb") as f:
        first = _first_byte(f)
        f.seek(0)
        if first == b"[":  # one JSON array of rows
            return _read_array(f, path, field, help, text)
        return _read_lines(f, path, field, help, text)


def _read_with_datasets(builder: str, path: str, field: str, help: str) -> list[tuple[str, dict]]:
    """The rows of a parquet file (or of a JSON object document) through ``datasets``."""
    if builder == "parquet":
        import pyarrow.parquet as pq

        if os.path.getsize(path) == 0:
            raise RecipeError(f"{field}: '{path}' is empty (0 bytes); write the rows as a parquet table, {help}")
        try:
            num_rows = pq.ParquetFile(path).metadata.num_rows
        except Exception as err:
            raise RecipeError(f"{field}: cannot read '{path}' as parquet: {_one_line(err)}") from err
        if num_rows == 0:
            raise RecipeError(f"{field}: '{path}' holds no rows; {help}")
    import datasets

    datasets.disable_progress_bars()
    try:
        ds = datasets.load_dataset(builder, data_files=path, split="train")
    except Exception as err:  # surface the file name and the cause; datasets' own message omits both
        raise RecipeError(f"{field}: cannot read '{path}': {_one_line(err)}") from err
    if not len(ds):
        raise RecipeError(f"{field}: '{path}' holds no rows; {help}")
    return [(f"{path} row {i + 1}", row) for i, row in enumerate(ds)]


def _read_saved_dataset(path: str, field: str, help: str) -> list[tuple[str, dict]]:
    """The rows of a folder written by ``datasets.Dataset.save_to_disk`` (or of a ``DatasetDict`` with one
    split; with several, the folder of one split must be named)."""
    import datasets

    datasets.disable_progress_bars()
    try:
        ds = datasets.load_from_disk(path)
    except Exception as err:
        raise RecipeError(f"{field}: '{path}' is a folder but not one saved by datasets' save_to_disk "
                          f"({_one_line(err)}); give a JSONL, JSON or parquet file or such a folder") from err
    if isinstance(ds, datasets.DatasetDict):
        splits = list(ds)
        if len(splits) != 1:
            example = os.path.join(path, "train" if "train" in splits else splits[0])
            raise RecipeError(f"{field}: '{path}' holds the splits {', '.join(splits)}; give the folder of one "
                              f"split, e.g. '{example}'")
        ds = ds[splits[0]]
    if not len(ds):
        raise RecipeError(f"{field}: '{path}' holds no rows; {help}")
    return [(f"{path} row {i + 1}", row) for i, row in enumerate(ds)]


def file_records(path: str, field: str, help: str, text: TextPolicy | None = None) -> list[tuple[str, dict]]:
    """The raw rows of one JSONL / JSON / parquet file or saved ``datasets`` folder, each with where it is,
    cleaned by ``text`` (``rllight.data.text``: text that is not UTF-8 replaced, or the row skipped or refused;
    rows over ``text.max_row_bytes`` refused)."""
    text = text or TextPolicy()
    streamed = None
    if os.path.isdir(path):
        records = _read_saved_dataset(path, field, help)
    elif not os.path.isfile(path):
        raise RecipeError(f"{field}: file '{path}' does not exist; give the path of a JSONL or parquet file "
                          "or of a folder saved by datasets' save_to_disk")
    else:
        ext = os.path.splitext(path)[1].lower()
        builder = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}.get(ext)
        if builder is None:
            raise RecipeError(f"{field}: '{path}' has extension '{ext}'; use .jsonl, .json or .parquet")
        streamed = _read_json(path, field, help, text) if builder == "json" else None
        records = _read_with_datasets(builder, path, field, help) if streamed is None else streamed
    kept = text.clean(records, path, measure=streamed is None)  # rows a library read are measured now
    if not kept:
        raise RecipeError(f"{field}: '{path}' holds no row whose text is UTF-8 (data.decode_errors is skip); fix "
                          "the file, or set data.decode_errors to replace")
    return kept
