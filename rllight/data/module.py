"""Prompts for training and evaluation: JSONL or parquet files, or the embedded arithmetic task."""

from __future__ import annotations

import os
from collections.abc import Sequence

import lightning as L
import torch
from torch.utils.data import DataLoader

from rllight.data.arithmetic import ArithmeticTask
from rllight.errors import RecipeError


def _load_rows(paths: Sequence[str], field: str) -> list[dict]:
    """Rows of JSONL / JSON / parquet files via ``datasets``, checked for ``prompt`` and ``answer``."""
    rows: list[dict] = []
    for path in paths:
        if not os.path.isfile(path):
            raise RecipeError(f"{field}: file '{path}' does not exist; give the path of a JSONL or parquet file")
        ext = os.path.splitext(path)[1].lower()
        builder = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}.get(ext)
        if builder is None:
            raise RecipeError(f"{field}: '{path}' has extension '{ext}'; use .jsonl, .json or .parquet")
        import datasets

        datasets.disable_progress_bars()
        try:
            ds = datasets.load_dataset(builder, data_files=path, split="train")
        except Exception as err:  # surface the file name; datasets' own messages omit it
            raise RecipeError(f"{field}: cannot read '{path}': {str(err).splitlines()[0]}") from err
        for i, row in enumerate(ds):
            prompt = row.get("prompt")
            if prompt is None or (isinstance(prompt, str) and not prompt.strip()):
                raise RecipeError(f"{path} row {i + 1}: missing field 'prompt'; every row needs 'prompt' "
                                  "(a string or a list of chat messages) and 'answer'")
            if isinstance(prompt, list) and not all(isinstance(m, dict) and "role" in m and "content" in m
                                                    for m in prompt):
                raise RecipeError(f"{path} row {i + 1}: 'prompt' is a list but not of chat messages "
                                  "({'role': ..., 'content': ...})")
            if row.get("answer") is None:
                raise RecipeError(f"{path} row {i + 1}: missing field 'answer'; every row needs 'prompt' and 'answer'")
            rows.append({"prompt": prompt, "answer": str(row["answer"])})
        if not len(ds):
            raise RecipeError(f"{field}: '{path}' holds no rows")
    return rows


def collate(rows: list[dict]) -> list[dict]:
    """Prompts stay as Python objects: the module tokenises them with its own tokenizer."""
    return rows


class RLDataModule(L.LightningDataModule):
    """Prompts with reference answers.

    With no ``train_files`` the embedded ``task`` supplies both splits. Rows have ``prompt`` (a string,
    or a list of chat messages) and ``answer``; the module applies the tokenizer's chat template.

    Args:
        train_files: JSONL / JSON / parquet files of training prompts.
        val_files: Held-out prompts for the validation loop (default: the task's held-out split, or
            none when ``train_files`` is set).
        task: The embedded task, used when ``train_files`` is not given.
        batch_size: Prompts per training step (each is sampled ``group_size`` times by the sampler).
        val_batch_size: Prompts per validation batch.
        val_size: Use only the first ``val_size`` held-out prompts (None = all).
        system_prompt: A system message put before each string prompt (None = the template's default).
        seed: Shuffling seed of the training prompts.
    """

    def __init__(
        self,
        train_files: list[str] | None = None,
        val_files: list[str] | None = None,
        task: ArithmeticTask | None = None,
        batch_size: int = 8,
        val_batch_size: int = 64,
        val_size: int | None = None,
        system_prompt: str | None = None,
        seed: int = 0,
    ):
        super().__init__()
        if batch_size < 1:
            raise RecipeError(f"data.batch_size must be >= 1, got {batch_size}")
        self.train_files = train_files
        self.val_files = val_files
        self.task = task if task is not None or train_files else ArithmeticTask()
        self.batch_size = batch_size
        self.val_batch_size = val_batch_size
        self.val_size = val_size
        self.system_prompt = system_prompt
        self.seed = seed
        self.train_rows: list[dict] | None = None
        self.val_rows: list[dict] = []

    def setup(self, stage: str | None = None) -> None:
        if self.train_rows is not None:
            return
        if self.train_files:
            self.train_rows = _load_rows(self.train_files, "data.train_files")
            self.val_rows = _load_rows(self.val_files, "data.val_files") if self.val_files else []
        else:
            self.train_rows, self.val_rows = self.task.splits()
            if self.val_files:
                self.val_rows = _load_rows(self.val_files, "data.val_files")
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

    def train_dataloader(self) -> DataLoader:
        generator = torch.Generator().manual_seed(self.seed)
        return DataLoader(self.train_rows, batch_size=self.batch_size, shuffle=True, drop_last=True,
                          collate_fn=collate, generator=generator)

    def val_dataloader(self) -> DataLoader | list:
        if not self.val_rows:
            return []
        return DataLoader(self.val_rows, batch_size=self.val_batch_size, shuffle=False, collate_fn=collate)
