"""What a row must hold, and how it is read: the prompt (a string or a list of chat messages), the reference answer
(as it is, or the final answer of a GSM8K solution) and the data source, at the fields a datamodule's options name
(a dotted name walks into nested objects). The files themselves are read by ``rllight.data.files``."""

from __future__ import annotations

import os
import re
from collections.abc import Sequence

from rllight.data.files import JsonNumber, file_records, json_type
from rllight.data.text import TextPolicy
from rllight.errors import RecipeError


CHAT_ROLES = ("system", "user", "assistant", "tool")
"""Roles a chat message in a ``prompt`` list may have."""

ANSWER_FORMATS = ("auto", "plain", "gsm8k")
"""How a reference answer is read: see ``RLDataModule``'s ``answer_format``."""

_GSM8K_MARK = "####"


class RowFields:
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


def _missing(where: str, row: dict, key: str, option: str, what: str, fields: RowFields) -> RecipeError:
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


def _check_prompt(where: str, prompt: object, key: str = "prompt") -> None:
    """Raise on a prompt the chat template cannot take: not a non-empty string or list of chat messages.
    ``key`` is the prompt's field name, for the message."""
    if isinstance(prompt, str) and not isinstance(prompt, JsonNumber):
        return
    if not isinstance(prompt, list):
        raise RecipeError(f"{where}: '{key}' is a {json_type(prompt)}; give a string or a list of chat "
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
        if not isinstance(content, str) or isinstance(content, JsonNumber):
            raise RecipeError(f"{where}: {key}[{j}].content is missing or not a string; give each message "
                              "its text as 'content'")


def _read_answer(where: str, row: dict, fields: RowFields) -> str:
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


def read_prompts(path: str, field: str, prompt_key: str = "prompt", text: TextPolicy | None = None) -> list[dict]:
    """The prompts of a JSONL / JSON / parquet file or saved ``datasets`` folder, answers not needed (for
    ``rllight generate``): rows ``{"prompt", "source"}``, plus ``"answer"`` as the file gives it, if it does.
    ``text``: the decoding policy and the bound on a row (``rllight.data.text``)."""
    help = f"every row needs '{prompt_key}' (a string or a list of chat messages)"
    rows = []
    for where, row in file_records(path, field, help, text):
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


def load_rows(paths: Sequence[str], field: str, fields: RowFields | None = None,
              text: TextPolicy | None = None) -> list[dict]:
    """Rows of JSONL / JSON / parquet files or saved ``datasets`` folders, read through ``fields``.

    Each row is ``{"prompt", "answer", "data_source", "source"}``: ``data_source`` names the dataset the row
    belongs to (its ``fields.data_source_key`` value, else the file's name without extension), which
    evaluation groups by; ``source`` is where it came from (``"train.jsonl row 7"``, with the line when it
    differs), so that later checks (``rllight.rewards.check_answers``) can name it. ``text``: the decoding
    policy and the bound on a row (``rllight.data.text``).
    """
    fields = fields or RowFields()
    rows: list[dict] = []
    for path in paths:
        records = file_records(path, field, fields.help, text)
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
