"""Prompts for training and evaluation: JSONL, JSON or parquet files, folders saved by ``datasets``, or the
embedded arithmetic task.

The column names are options of the datamodule, so files written for other trainers load unchanged:
verl's parquet (``answer_key: reward_model.ground_truth``), TRL's JSONL, OpenRLHF's ``input_key`` /
``label_key`` (``prompt_key`` / ``answer_key``) and GSM8K's worked solutions ending in ``#### 42``.
"""

from __future__ import annotations

import json
import os
import re
import warnings
from collections.abc import Sequence

import lightning as L
import torch
from torch.utils.data import DataLoader

from rllight.data.arithmetic import ArithmeticTask
from rllight.data.task import Task
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


def _read_json(path: str, field: str, help: str) -> list[tuple[str, dict]] | None:
    """The rows of a JSON Lines file or of a JSON array, each with where it is (``"f.jsonl row 2"``, and
    ``" (line 3)"`` when blank lines put it elsewhere); None for a file that is one JSON object (left to
    ``datasets``, which reads column layouts).

    Read with the ``json`` module, not ``datasets``: a bad line is reported by its 1-based number, and values
    keep their text. ``datasets`` gives a column one type, falling back to pandas when the rows disagree,
    which turns the string "12" into the integer 12, an answer 4 next to 2.5 into "4.0" and a 20-digit
    integer into a float with 17 digits. Numbers are read as their text (``_Number``)."""
    with open(path, "rb") as f:
        raw = f.read()
    try:
        text = raw.decode("utf-8-sig")  # a leading byte-order mark is fine
    except UnicodeDecodeError as err:
        line = raw.count(b"\n", 0, err.start) + 1
        raise RecipeError(f"{field}: '{path}' line {line} is not UTF-8 text ({err.reason}); save the file as UTF-8") from err
    if not text.strip():
        raise RecipeError(f"{field}: '{path}' is empty; write one JSON object per line, {help}")
    parse = {"parse_int": _Number, "parse_float": _Number}
    if text.lstrip().startswith("["):  # one JSON array of rows
        try:
            data = json.loads(text, **parse)
        except json.JSONDecodeError as err:
            raise RecipeError(f"{field}: '{path}' line {err.lineno} is not valid JSON ({err.msg} at column "
                              f"{err.colno}); fix that line") from err
        if not data:
            raise RecipeError(f"{field}: '{path}' holds an empty JSON array; {help}")
        for i, item in enumerate(data):
            if not isinstance(item, dict):
                raise RecipeError(f"{path} row {i + 1}: a JSON {_json_type(item)}, not an object; {help}")
        return [(f"{path} row {i + 1}", item) for i, item in enumerate(data)]
    rows = []
    # split("\n"), not splitlines(): U+2028 and friends may stand unescaped inside JSON strings.
    for number, line in enumerate(text.split("\n"), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line, **parse)
        except json.JSONDecodeError as err:
            try:  # one pretty-printed object rather than JSON Lines
                whole = json.loads(text)
            except json.JSONDecodeError:
                whole = None
            if isinstance(whole, dict):
                return None
            raise RecipeError(f"{field}: '{path}' line {number} is not valid JSON ({err.msg} at column "
                              f"{err.colno}); each line must be one JSON object") from err
        if not isinstance(item, dict):
            raise RecipeError(f"{path} line {number}: a JSON {_json_type(item)}, not an object; {help}")
        where = f"{path} row {len(rows) + 1}" + ("" if number == len(rows) + 1 else f" (line {number})")
        rows.append((where, item))
    return rows


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


def _records(path: str, field: str, help: str) -> list[tuple[str, dict]]:
    """The raw rows of one JSONL / JSON / parquet file or saved ``datasets`` folder, each with where it is."""
    if os.path.isdir(path):
        return _read_saved_dataset(path, field, help)
    if not os.path.isfile(path):
        raise RecipeError(f"{field}: file '{path}' does not exist; give the path of a JSONL or parquet file "
                          "or of a folder saved by datasets' save_to_disk")
    ext = os.path.splitext(path)[1].lower()
    builder = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}.get(ext)
    if builder is None:
        raise RecipeError(f"{field}: '{path}' has extension '{ext}'; use .jsonl, .json or .parquet")
    records = _read_json(path, field, help) if builder == "json" else None
    return _read_with_datasets(builder, path, field, help) if records is None else records


def read_prompts(path: str, field: str, prompt_key: str = "prompt") -> list[dict]:
    """The prompts of a JSONL / JSON / parquet file or saved ``datasets`` folder, answers not needed (for
    ``rllight generate``): rows ``{"prompt", "source"}``, plus ``"answer"`` as the file gives it, if it does."""
    help = f"every row needs '{prompt_key}' (a string or a list of chat messages)"
    rows = []
    for where, row in _records(path, field, help):
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


def _load_rows(paths: Sequence[str], field: str, fields: _Fields | None = None) -> list[dict]:
    """Rows of JSONL / JSON / parquet files or saved ``datasets`` folders, read through ``fields``.

    Each row is ``{"prompt", "answer", "data_source", "source"}``: ``data_source`` names the dataset the row
    belongs to (its ``fields.data_source_key`` value, else the file's name without extension), which
    evaluation groups by; ``source`` is where it came from (``"train.jsonl row 7"``, with the line when it
    differs), so that later checks (``rllight.rewards.check_answers``) can name it.
    """
    fields = fields or _Fields()
    rows: list[dict] = []
    for path in paths:
        records = _records(path, field, fields.help)
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
    ):
        super().__init__()
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
            self.train_rows = _load_rows(self.train_files, "data.train_files", self.fields)
            self.val_rows = _load_rows(self.val_files, "data.val_files", self.fields) if self.val_files else []
        else:
            self.train_rows, self.val_rows = self.task.splits()
            for split, rows in (("train", self.train_rows), ("val", self.val_rows)):
                for i, row in enumerate(rows):
                    row.setdefault("source", f"data.task {split} row {i + 1}")
                    row.setdefault("data_source", TASK_DATA_SOURCE)
            if self.val_files:
                self.val_rows = _load_rows(self.val_files, "data.val_files", self.fields)
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

    def train_dataloader(self) -> DataLoader:
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
        if not self.val_rows:
            return []
        return DataLoader(self.val_rows, batch_size=self.val_batch_size, shuffle=False, collate_fn=collate)
