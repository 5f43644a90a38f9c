"""Prompts for training and evaluation: JSONL, JSON or parquet files, folders saved by ``datasets``, or the
embedded arithmetic task.

The column names are options of the datamodule, so files written for other trainers load unchanged:
verl's parquet (``answer_key: reward_model.ground_truth``), TRL's JSONL, OpenRLHF's ``input_key`` /
``label_key`` (``prompt_key`` / ``answer_key``) and GSM8K's worked solutions ending in ``#### 42``.
"""

from __future__ import annotations

import codecs
import json
import os
import re
import warnings
from collections.abc import Sequence

import lightning as L
import torch
from torch.utils.data import DataLoader

from rllight.data.arithmetic import ArithmeticTask
from rllight.data.context import LONG_PROMPTS, fit_to_context
from rllight.data.task import Task
from rllight.data.text import BOM, MAX_ROW_BYTES, TextPolicy, decode
from rllight.distributed import share
from rllight.errors import RecipeError

# ResumableSampler restarts the data stream at the trained-batch count saved in checkpoints, so
# Lightning's generic warning about resuming mid-epoch with a plain dataloader does not apply.
warnings.filterwarnings("ignore", message=".*your dataloader is not resumable.*")


CHAT_ROLES = ("system", "user", "assistant", "tool")
"""Roles a chat message in a ``prompt`` list may have."""

ANSWER_FORMATS = ("auto", "plain", "gsm8k")
"""How a reference answer is read: see ``RLDataModule``'s ``answer_format``."""

_GSM8K_MARK = "####"

TASK_DATA_SOURCE = "arithmetic"
"""The ``data_source`` of the embedded task's rows."""


class _Fields:
    """Where a row keeps its prompt, answer and data source, and how its answer is read."""

    def __init__(self, prompt_key: str = "prompt", answer_key: str = "answer", data_source_key: str = "data_source",
                 answer_format: str = "auto"):
        self.prompt_key = prompt_key
        self.answer_key = answer_key
        self.data_source_key = data_source_key
        self.answer_format = answer_format

    @property
    def help(self) -> str:
        return f"every row needs '{self.prompt_key}' (a string or a list of chat messages) and '{self.answer_key}'"


_MISSING = object()


def _lookup(row: dict, key: str) -> object:
    """``row[key]``, where a dotted ``key`` ("reward_model.ground_truth") walks into nested objects; a column
    whose own name has the dot wins. ``_MISSING`` when absent."""
    if key in row:
        return row[key]
    value: object = row
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            return _MISSING
        value = value[part]
    return value


def _missing(where: str, row: dict, key: str, option: str, what: str, fields: _Fields) -> RecipeError:
    """The error for a row without ``key``; it lists the row's fields when the key is absent altogether,
    since the usual cause is a file whose columns have other names."""
    message = f"{where}: missing field '{key}'; {fields.help}"
    if _lookup(row, key) is _MISSING:
        names = ", ".join(map(str, row)) or "none"
        message += f" (this row has: {names}; set {option} to the field holding {what})"
    return RecipeError(message)


def gsm8k_answer(text: str) -> str | None:
    """The final answer of a GSM8K solution: what follows its last ``####``, stripped, thousands separators
    removed ("...so she has 1,200 left.\\n#### 1,200" -> "1200", as verl's GSM8K preprocessing reads it).
    None when there is no ``####`` or nothing after it."""
    _, mark, tail = str(text).rpartition(_GSM8K_MARK)
    if not mark:
        return None
    tail = tail.strip()
    if re.fullmatch(r"-?[0-9][0-9,]*(\.[0-9]+)?", tail):
        tail = tail.replace(",", "")
    return tail or None


def _is_gsm8k_solution(text: str) -> bool:
    """Whether an answer reads as a GSM8K solution: its last non-empty line starts with ``####``."""
    lines = [line for line in str(text).splitlines() if line.strip()]
    return bool(lines) and lines[-1].lstrip().startswith(_GSM8K_MARK) and gsm8k_answer(lines[-1]) is not None


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


class _Number(str):
    """A JSON number, kept as the text the file has ("4", "2.50", "12345678901234567890")."""


def _json_type(value: object) -> str:
    if isinstance(value, _Number):
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
    stream, parser = _TextStream(f), json.JSONDecoder(parse_int=_Number, parse_float=_Number)
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
                raise RecipeError(f"{where}: a JSON {_json_type(item)}, not an object; {help}")
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
    parse = {"parse_int": _Number, "parse_float": _Number}
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
            raise RecipeError(f"{path} line {number}: a JSON {_json_type(item)}, not an object; {help}")
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
    integer into a float with 17 digits. Numbers are read as their text (``_Number``).

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


def _check_prompt(where: str, prompt: object, key: str = "prompt") -> None:
    """Raise on a prompt the chat template cannot take: not a non-empty string or list of chat messages.
    ``key`` is the prompt's field name, for the message."""
    if isinstance(prompt, str) and not isinstance(prompt, _Number):
        return
    if not isinstance(prompt, list):
        raise RecipeError(f"{where}: '{key}' is a {_json_type(prompt)}; give a string or a list of chat "
                          "messages ({'role': ..., 'content': ...})")
    if not prompt:
        raise RecipeError(f"{where}: '{key}' is an empty list; give a string or a list of chat messages")
    for j, message in enumerate(prompt):
        if not isinstance(message, dict):
            raise RecipeError(f"{where}: {key}[{j}] is not a chat message; '{key}' is a list but not of chat "
                              "messages ({'role': ..., 'content': ...})")
        role = message.get("role")
        if role not in CHAT_ROLES:
            got = "missing" if role is None else repr(role if isinstance(role, str) else str(role))
            raise RecipeError(f"{where}: {key}[{j}].role is {got}; use one of {', '.join(CHAT_ROLES)}")
        content = message.get("content")
        if not isinstance(content, str) or isinstance(content, _Number):
            raise RecipeError(f"{where}: {key}[{j}].content is missing or not a string; give each message "
                              "its text as 'content'")


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


def _read_answer(where: str, row: dict, fields: _Fields) -> str:
    """A row's reference answer as text, read as ``fields.answer_format`` says."""
    key = fields.answer_key
    value = _lookup(row, key)
    if value is _MISSING or value is None:
        raise _missing(where, row, key, "data.answer_key", "the reference answer", fields)
    if isinstance(value, dict):
        inner = ", ".join(map(str, value)) or "none"
        first = "ground_truth" if "ground_truth" in value else next(iter(value), "ground_truth")
        raise RecipeError(f"{where}: '{key}' is an object (fields: {inner}); set data.answer_key to the field "
                          f"inside it, e.g. '{key}.{first}'")
    if isinstance(value, list):
        raise RecipeError(f"{where}: '{key}' is a list; give one reference answer per row (a string or a number)")
    text = str(value)
    if fields.answer_format == "gsm8k" or (fields.answer_format == "auto" and _is_gsm8k_solution(text)):
        answer = gsm8k_answer(text)
        if answer is None:
            raise RecipeError(f"{where}: '{key}' has no final answer after '{_GSM8K_MARK}'; with "
                              f"data.answer_format gsm8k every answer ends in '{_GSM8K_MARK} <answer>' (use plain "
                              "to take answers as they are)")
        return answer
    return text


def _read_data_source(where: str, row: dict, key: str, default: str) -> str:
    value = _lookup(row, key)
    if value is _MISSING or value is None or (isinstance(value, str) and not value.strip()):
        return default
    if isinstance(value, (dict, list)):
        kind = "an array" if isinstance(value, list) else "an object"
        raise RecipeError(f"{where}: '{key}' is {kind}; give a string naming the row's dataset "
                          "(or set data.data_source_key to another field)")
    return str(value)


def _clean_messages(prompt: list[dict]) -> list[dict]:
    """Chat messages without the None fields that a columnar file gives every message that lacks a field
    some other message has (parquet stores one struct type per column)."""
    return [{k: v for k, v in message.items() if v is not None} for message in prompt]


def _records(path: str, field: str, help: str, text: TextPolicy | None = None) -> list[tuple[str, dict]]:
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


def read_prompts(path: str, field: str, prompt_key: str = "prompt", text: TextPolicy | None = None) -> list[dict]:
    """The prompts of a JSONL / JSON / parquet file or saved ``datasets`` folder, answers not needed (for
    ``rllight generate``): rows ``{"prompt", "source"}``, plus ``"answer"`` as the file gives it, if it does.
    ``text``: the decoding policy and the bound on a row (``rllight.data.text``)."""
    help = f"every row needs '{prompt_key}' (a string or a list of chat messages)"
    rows = []
    for where, row in _records(path, field, help, text):
        prompt = _lookup(row, prompt_key)
        if prompt is _MISSING or prompt is None or (isinstance(prompt, str) and not prompt.strip()):
            names = ", ".join(map(str, row)) or "none"
            raise RecipeError(f"{where}: missing field '{prompt_key}'; {help} (this row has: {names}; set "
                              "data.prompt_key to the field holding the prompt)")
        _check_prompt(where, prompt, prompt_key)
        out = {"prompt": _clean_messages(prompt) if isinstance(prompt, list) else str(prompt), "source": where}
        answer = _lookup(row, "answer")
        if answer is not _MISSING and answer is not None:
            out["answer"] = str(answer)
        rows.append(out)
    return rows


def _load_rows(paths: Sequence[str], field: str, fields: _Fields | None = None,
               text: TextPolicy | None = None) -> list[dict]:
    """Rows of JSONL / JSON / parquet files or saved ``datasets`` folders, read through ``fields``.

    Each row is ``{"prompt", "answer", "data_source", "source"}``: ``data_source`` names the dataset the row
    belongs to (its ``fields.data_source_key`` value, else the file's name without extension), which
    evaluation groups by; ``source`` is where it came from (``"train.jsonl row 7"``, with the line when it
    differs), so that later checks (``rllight.rewards.check_answers``) can name it. ``text``: the decoding
    policy and the bound on a row (``rllight.data.text``).
    """
    fields = fields or _Fields()
    rows: list[dict] = []
    for path in paths:
        records = _records(path, field, fields.help, text)
        name = os.path.splitext(os.path.basename(os.path.normpath(path)))[0]
        for where, row in records:
            prompt = _lookup(row, fields.prompt_key)
            if prompt is _MISSING or prompt is None or (isinstance(prompt, str) and not prompt.strip()):
                raise _missing(where, row, fields.prompt_key, "data.prompt_key", "the prompt", fields)
            _check_prompt(where, prompt, fields.prompt_key)
            rows.append({
                "prompt": _clean_messages(prompt) if isinstance(prompt, list) else str(prompt),
                "answer": _read_answer(where, row, fields),
                "data_source": _read_data_source(where, row, fields.data_source_key, name),
                "source": where,
            })
    return rows


class ResumableSampler(torch.utils.data.DistributedSampler):
    """A fresh seeded permutation of the training rows each epoch, dealt out to the training processes, able to
    start mid-epoch.

    Each epoch takes the first ``epoch_rows`` indices of a permutation of ``num_rows`` that depends only on
    ``(seed, epoch)``; process ``rank`` of ``world`` gets every ``world``-th of them, from its ``rank``-th on (so
    consecutive batches of ``b`` rows on each process together make consecutive global batches of ``b x world``
    rows, with no row twice). ``start_at(n)`` skips the first ``n`` rows of this process's stream. A run resumed
    after ``k`` trained batches therefore sees exactly the rows an uninterrupted run would: the trained-batch
    count decides where it resumes, not the dataloader's prefetching.

    It is a ``DistributedSampler`` so that Lightning uses it as it is under several processes (it would wrap
    any other sampler in one that splits its stream again); the split is its own.
    """

    def __init__(self, num_rows: int, epoch_rows: int, seed: int, rank: int = 0, world: int = 1):
        self.num_rows = num_rows
        self.epoch_rows = epoch_rows  # over all processes; a multiple of world
        self.seed = seed
        self.rank = rank
        self.world = self.num_replicas = world  # num_replicas: the name DistributedSampler's readers know
        self.shuffle = False  # the order is this class's own; nothing is to shuffle it again
        self.skip = 0  # rows of this process's stream already consumed by training

    def start_at(self, rows_consumed: int) -> None:
        self.skip = rows_consumed

    def set_epoch(self, epoch: int) -> None:
        """Lightning's per-epoch call: nothing to do, the stream counts its own epochs."""

    def order(self, epoch: int) -> list[int]:
        """The row indices this process gets in epoch ``epoch``."""
        g = torch.Generator().manual_seed(self.seed + epoch)
        return torch.randperm(self.num_rows, generator=g)[: self.epoch_rows][self.rank :: self.world].tolist()

    def __iter__(self):
        epoch, offset = divmod(self.skip, len(self))
        order = self.order(epoch)
        self.skip = (epoch + 1) * len(self)  # the next iterator starts the next epoch
        yield from order[offset:]

    def __len__(self) -> int:
        # A full epoch, also when resuming mid-epoch: Lightning's restored batch counter then reaches the
        # epoch's end exactly when this iterator runs out.
        return self.epoch_rows // self.world


def collate(rows: list[dict]) -> list[dict]:
    """Prompts stay as Python objects: the module tokenises them with its own tokenizer."""
    return rows


class RLDataModule(L.LightningDataModule):
    """Prompts with reference answers.

    With no ``train_files`` the embedded ``task`` supplies both splits. Rows have a prompt (a string, or a
    list of chat messages), a reference answer and a ``data_source`` (the dataset it belongs to, which
    evaluation reports separately); the module applies the tokenizer's chat template.

    Args:
        train_files: Training prompts: JSONL / JSON / parquet files, or folders written by
            ``datasets.Dataset.save_to_disk`` (a ``DatasetDict`` folder with several splits: name one split's
            folder, e.g. ``gsm8k/train``).
        val_files: Held-out prompts for the validation loop (default: the task's held-out split, or
            none when ``train_files`` is set).
        task: The embedded task, used when ``train_files`` is not given.
        batch_size: Prompts per training step over all processes (each is sampled ``group_size`` times by the
            sampler); each of the ``trainer.devices x trainer.num_nodes`` processes takes an equal share.
        val_batch_size: Prompts per validation batch.
        val_size: Use only the first ``val_size`` held-out prompts (None = all).
        system_prompt: A system message put before each string prompt (None = the template's default).
        seed: Shuffling seed of the training prompts.
        prompt_key: The field holding the prompt (OpenRLHF's ``input_key``); a dotted path reads a nested
            field.
        answer_key: The field holding the reference answer (OpenRLHF's ``label_key``); a dotted path reads a
            nested field, e.g. ``reward_model.ground_truth`` for verl's parquet files.
        data_source_key: The field naming each row's dataset (verl's ``data_source``); rows without it take
            the file's name without extension.
        answer_format: How an answer is read. ``plain``: as it is. ``gsm8k``: every answer is a worked
            solution ending in ``#### <answer>``, and the answer is what follows the last ``####`` (thousands
            separators removed). ``auto``: an answer whose last non-empty line starts with ``####`` is read as
            ``gsm8k``, any other as ``plain``.
        decode_errors: What is done with a row whose text is not UTF-8 (bytes that are not, or an escaped lone
            surrogate such as ``\\ud800``, which no tokenizer takes). ``replace``: each bad character becomes
            U+FFFD. ``skip``: the row is left out. ``error``: one line naming the row. Rows replaced or left out
            are counted in one warning per file. The same for ``rllight generate`` and ``rllight chat``'s input.
        max_row_bytes: The largest row, in bytes of its line (a JSONL line, a line of a ``.txt`` prompt file or
            of chat input; characters of its text for a JSON array's item, a parquet or ``datasets`` row). Files
            are read a row at a time; a longer row is one line naming it, before it is read whole.
        long_prompts: What is done before training (and before validation) with a prompt whose tokens plus the
            longest response (``max_new_tokens``) do not fit the model's positions
            (``config.max_position_embeddings``). ``refuse``: one line naming the row. ``truncate``: the start of
            its last user message is cut until it fits (the end, where the question usually is, is kept).
            ``drop``: the row is left out, counted in one warning.
    """

    def __init__(
        self,
        train_files: list[str] | None = None,
        val_files: list[str] | None = None,
        task: Task | None = None,
        batch_size: int = 8,
        val_batch_size: int = 64,
        val_size: int | None = None,
        system_prompt: str | None = None,
        seed: int = 0,
        prompt_key: str = "prompt",
        answer_key: str = "answer",
        data_source_key: str = "data_source",
        answer_format: str = "auto",
        decode_errors: str = "replace",
        max_row_bytes: int = MAX_ROW_BYTES,
        long_prompts: str = "refuse",
    ):
        super().__init__()
        if long_prompts not in LONG_PROMPTS:
            raise RecipeError(f"data.long_prompts is {long_prompts!r}; use refuse (stop with one line), truncate (cut "
                              "the prompt's start) or drop (leave the row out)")
        self.text = TextPolicy(decode_errors, max_row_bytes)  # checks both
        self.long_prompts = long_prompts
        self._fitted: set[str] = set()  # the splits fitted to the model's context
        if batch_size < 1:
            raise RecipeError(f"data.batch_size must be >= 1, got {batch_size}")
        for name, key in (("prompt_key", prompt_key), ("answer_key", answer_key), ("data_source_key", data_source_key)):
            if not isinstance(key, str) or not key.strip():
                raise RecipeError(f"data.{name} must name a field of the rows, got {key!r}")
        if answer_format not in ANSWER_FORMATS:
            raise RecipeError(f"data.answer_format is {answer_format!r}; use one of {', '.join(ANSWER_FORMATS)}")
        self.fields = _Fields(prompt_key, answer_key, data_source_key, answer_format)
        self.train_files = train_files
        self.val_files = val_files
        self.task = task if task is not None or train_files else ArithmeticTask()
        self.batch_size = batch_size
        self.rank, self.world = 0, 1  # this process among the training processes (set up with the trainer)
        self.val_batch_size = val_batch_size
        self.val_size = val_size
        self.system_prompt = system_prompt
        self.seed = seed
        self.train_rows: list[dict] | None = None
        self.val_rows: list[dict] = []
        self.batches_trained = 0
        """Training batches completed (advanced by the module after each RL step; saved in checkpoints)."""

    @property
    def local_batch_size(self) -> int:
        """This process's share of ``batch_size``."""
        return share(self.batch_size, self.world, "data.batch_size")

    def setup(self, stage: str | None = None) -> None:
        if self.trainer is not None:
            self.rank, self.world = self.trainer.global_rank, self.trainer.world_size
            self.local_batch_size  # noqa: B018  (a size that does not divide is refused before the model loads)
        if self.train_rows is not None:
            return
        if self.train_files:
            self.train_rows = _load_rows(self.train_files, "data.train_files", self.fields, self.text)
            self.val_rows = (_load_rows(self.val_files, "data.val_files", self.fields, self.text) if self.val_files
                             else [])
        else:
            self.train_rows, self.val_rows = self.task.splits()
            for split, rows in (("train", self.train_rows), ("val", self.val_rows)):
                for i, row in enumerate(rows):
                    row.setdefault("source", f"data.task {split} row {i + 1}")
                    row.setdefault("data_source", TASK_DATA_SOURCE)
            self.train_rows, self.val_rows = (  # the task's rows, under the same policy as a file's
                [row for _, row in self.text.clean([(r["source"], r) for r in rows], "data.task", measure=True)]
                for rows in (self.train_rows, self.val_rows))
            if self.val_files:
                self.val_rows = _load_rows(self.val_files, "data.val_files", self.fields, self.text)
        if self.val_size is not None:
            self.val_rows = self.val_rows[: self.val_size]
        for row in self.train_rows + self.val_rows:
            row["messages"] = self.messages(row["prompt"])

    def messages(self, prompt: str | list[dict]) -> list[dict]:
        """A prompt as chat messages, with the configured system prompt before a string prompt."""
        if isinstance(prompt, list):
            return prompt
        msgs = [{"role": "user", "content": prompt}]
        if self.system_prompt is not None:
            msgs.insert(0, {"role": "system", "content": self.system_prompt})
        return msgs

    def _sampler(self) -> ResumableSampler:
        per_epoch = len(self.train_rows) // self.batch_size
        if per_epoch == 0:
            raise RecipeError(
                f"data.batch_size={self.batch_size} is larger than the {len(self.train_rows)} training rows"
            )
        return ResumableSampler(len(self.train_rows), per_epoch * self.batch_size, self.seed, self.rank, self.world)

    def upcoming_batches(self, first: int, count: int) -> list[list[dict]]:
        """The rows of this process's training batches ``first .. first + count - 1`` (counted from the run's
        first batch), as its training loader yields them: asynchronous rollouts generate them ahead."""
        sampler = self._sampler()
        size = self.local_batch_size
        batches_per_epoch = len(sampler) // size
        orders: dict[int, list[int]] = {}
        batches = []
        for index in range(first, first + max(count, 0)):
            epoch, batch = divmod(index, batches_per_epoch)
            order = orders.setdefault(epoch, sampler.order(epoch))
            batches.append([self.train_rows[i] for i in order[batch * size : (batch + 1) * size]])
        return batches

    def fit_context(self, split: str) -> None:
        """Once per split ("train", "val"), when its loader is first made (the model and its tokenizer are loaded
        by then, after ``setup``): the rows whose prompt and longest response do not fit the model's positions are
        refused, cut or dropped as ``long_prompts`` says (``rllight.data.context``). In place: the prompt stream
        of the training rows keeps seeing the same list."""
        if split in self._fitted or self.trainer is None:
            return
        rows = self.train_rows if split == "train" else self.val_rows
        name = "training rows" if split == "train" else "validation rows"
        kept = fit_to_context(getattr(self.trainer, "lightning_module", None), rows, self.long_prompts, split, name)
        if not kept and rows:
            raise RecipeError(f"every {split} row is too long for the model's context (data.long_prompts: drop); "
                              "shorten the prompts, or lower max_new_tokens")
        rows[:] = kept
        self._fitted.add(split)

    def train_dataloader(self) -> DataLoader:
        self.fit_context("train")
        sampler = self._sampler()
        # Whole batches: resuming after k trained batches skips k batches of this process's stream.
        sampler.start_at(self.batches_trained * self.local_batch_size)
        # The loader's own generator keeps iterator creation from drawing on the global RNG, which the
        # rollouts use: a resumed run must see the same random stream as an uninterrupted one.
        return DataLoader(
            self.train_rows,
            batch_size=self.local_batch_size,
            sampler=sampler,
            drop_last=True,
            collate_fn=collate,
            generator=torch.Generator().manual_seed(self.seed),
        )

    def state_dict(self) -> dict:
        return {"batches_trained": self.batches_trained}

    def load_state_dict(self, state_dict: dict) -> None:
        self.batches_trained = state_dict.get("batches_trained", 0)

    def val_dataloader(self) -> DataLoader | list:
        self.fit_context("val")
        if not self.val_rows:
            return []
        return DataLoader(self.val_rows, batch_size=self.val_batch_size, shuffle=False, collate_fn=collate)
