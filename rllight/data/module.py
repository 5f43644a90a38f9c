"""Prompts for training and evaluation: JSONL, JSON or parquet files, folders saved by ``datasets``, or the
embedded arithmetic task.

The column names are options of the datamodule, so files written for other trainers load unchanged:
verl's parquet (``answer_key: reward_model.ground_truth``), TRL's JSONL, OpenRLHF's ``input_key`` /
``label_key`` (``prompt_key`` / ``answer_key``) and GSM8K's worked solutions ending in ``#### 42``.

Files are read by ``rllight.data.files``; what a row must hold is checked by ``rllight.data.rows``.
"""

from __future__ import annotations

import warnings
from collections import Counter

import lightning as L
import torch
from torch.utils.data import DataLoader

from rllight.bounds import PositiveInt, bounded
from rllight.data.arithmetic import ArithmeticTask
from rllight.data.context import LONG_PROMPTS, fit_to_context
from rllight.data.curriculum import Curriculum
from rllight.data.mix import MixedSampler, SourceMix
from rllight.data.sampler import ResumableSampler
from rllight.data.rows import ANSWER_FORMATS, RowFields, load_rows
from rllight.data.rows import CHAT_ROLES, gsm8k_answer, read_prompts  # noqa: F401  (importable from here too)
from rllight.data.task import Task
from rllight.data.text import MAX_ROW_BYTES, TextPolicy
from rllight.distributed import share
from rllight.errors import RecipeError


# ResumableSampler restarts the data stream at the trained-batch count saved in checkpoints, so
# Lightning's generic warning about resuming mid-epoch with a plain dataloader does not apply.
warnings.filterwarnings("ignore", message=".*your dataloader is not resumable.*")

TASK_DATA_SOURCE = "arithmetic"
"""The ``data_source`` of the embedded task's rows."""


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
        task: The embedded task, used when ``train_files`` is not given (or with ``include_task``).
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
        include_task: With ``train_files``, also train on ``task``'s rows (after the files'), and validate on its
            held-out rows unless ``val_files`` is given: a file and a task in one run, e.g. mixed by ``mix``. False:
            the files replace the task (so that a recipe's task can be swapped for your files).
        mix: How many prompts of each data source every training batch holds, and how that changes over steps
            (``rllight.data.SourceMix``); None = the rows in one seeded order whatever their source. The sources
            are the rows' ``data_source`` values; each step logs ``train/data/<source>/share`` and ``/weight``.
        curriculum: Which prompts of each source a step trains on, chosen by a rule (a ``rllight.data.Curriculum``:
            ``rllight.data.DifficultyPools`` draws by recent pass rates, with admission gates and a draw cap; or a
            rule of your own); the step's count of each source stays the mix's (or the seeded order's,
            ``step_counts``). None = the loader's batch as it is.
    """

    @bounded
    def __init__(
        self,
        train_files: list[str] | None = None,
        val_files: list[str] | None = None,
        task: Task | None = None,
        batch_size: PositiveInt = 8,
        val_batch_size: int = 64,
        val_size: int | None = None,
        system_prompt: str | None = None,
        seed: int = 0,
        prompt_key: str = "prompt",
        answer_key: str = "answer",
        data_source_key: str = "data_source",
        answer_format: str = "auto",
        decode_errors: str = "replace",
        max_row_bytes: PositiveInt = MAX_ROW_BYTES,
        long_prompts: str = "refuse",
        include_task: bool = False,
        mix: SourceMix | None = None,
        curriculum: Curriculum | None = None,
    ):
        super().__init__()
        if long_prompts not in LONG_PROMPTS:
            raise RecipeError(f"data.long_prompts is {long_prompts!r}; use refuse (stop with one line), truncate (cut "
                              "the prompt's start) or drop (leave the row out)")
        self.text = TextPolicy(decode_errors, max_row_bytes)  # checks both
        self.long_prompts = long_prompts
        self._fitted: set[str] = set()  # the splits fitted to the model's context
        for name, key in (("prompt_key", prompt_key), ("answer_key", answer_key), ("data_source_key", data_source_key)):
            if not isinstance(key, str) or not key.strip():
                raise RecipeError(f"data.{name} must name a field of the rows, got {key!r}")
        if answer_format not in ANSWER_FORMATS:
            raise RecipeError(f"data.answer_format is {answer_format!r}; use one of {', '.join(ANSWER_FORMATS)}")
        self.fields = RowFields(prompt_key, answer_key, data_source_key, answer_format)
        self.train_files = train_files
        self.val_files = val_files
        self.task = task if task is not None or train_files else ArithmeticTask()
        self.include_task = include_task
        if include_task and self.task is None:
            raise RecipeError("data.include_task is true but no data.task is given; name the task whose rows join "
                              "data.train_files")
        self.batch_size = batch_size
        self.mix, self.curriculum = mix, curriculum
        self.rank, self.world = 0, 1  # this process among the training processes (set up with the trainer)
        self.val_batch_size = val_batch_size
        self.val_size = val_size
        self.system_prompt = system_prompt
        self.seed = seed
        self.train_rows: list[dict] | None = None
        self.val_rows: list[dict] = []
        self.batches_trained = 0
        """Training batches completed (counted by the prompt source, ``PromptSource.trained``, after each RL step;
        saved in checkpoints)."""

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
        self.train_rows, self.val_rows = [], []
        if self.task is not None and (self.include_task or not self.train_files):
            self.train_rows, self.val_rows = self._task_rows()
        if self.train_files:  # before the task's rows, when both are used
            self.train_rows = load_rows(self.train_files, "data.train_files", self.fields, self.text) + self.train_rows
        if self.val_files:
            self.val_rows = load_rows(self.val_files, "data.val_files", self.fields, self.text)
        if self.val_size is not None:
            self.val_rows = self.val_rows[: self.val_size]
        for row in self.train_rows + self.val_rows:
            row["messages"] = self.messages(row["prompt"])
        if self.mix is not None and self.train_rows:
            self._sampler()  # a source without a weight, or a weight without rows, is one line before the model loads

    def _task_rows(self) -> tuple[list[dict], list[dict]]:
        """The task's training and held-out rows, each with its ``source`` and ``data_source``, under the same text
        policy as a file's."""
        splits = self.task.splits()
        for split, rows in zip(("train", "val"), splits):
            for i, row in enumerate(rows):
                row.setdefault("source", f"data.task {split} row {i + 1}")
                row.setdefault("data_source", TASK_DATA_SOURCE)
        train, val = ([row for _, row in self.text.clean([(r["source"], r) for r in rows], "data.task", measure=True)]
                      for rows in splits)
        return train, val

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
        if self.mix is not None:
            return MixedSampler(self.train_rows, self.mix, self.batch_size, per_epoch, self.seed, self.rank,
                                self.world)
        return ResumableSampler(len(self.train_rows), per_epoch * self.batch_size, self.seed, self.rank, self.world)

    def step_counts(self, step: int) -> dict[str, int]:
        """The prompts of each data source in training batch ``step`` (counted from the run's first) over all
        processes: the mix's counts, else those of the seeded order's batch. A curriculum draws that many of each."""
        if self.mix is not None:
            return self.mix.counts(step, step + 1, self.batch_size)[0]
        rows, size = self.train_rows, self.batch_size
        epoch, batch = divmod(step, len(rows) // size)
        order = ResumableSampler(len(rows), len(rows) // size * size, self.seed).order(epoch)  # the global order
        return dict(Counter(str(rows[i].get("data_source")) for i in order[batch * size : (batch + 1) * size]))

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
        # Whole batches: each iterator (one an epoch, and the first after a resume) skips the k batches of this
        # process's stream trained so far.
        sampler.start_at(lambda: self.batches_trained * self.local_batch_size)
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
