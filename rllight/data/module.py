"""Prompts for training and evaluation: JSONL or parquet files, or the embedded arithmetic task."""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence

import lightning as L
import torch
from torch.utils.data import DataLoader

from rllight.data.arithmetic import ArithmeticTask
from rllight.errors import RecipeError

# ResumableSampler restarts the data stream at the trained-batch count saved in checkpoints, so
# Lightning's generic warning about resuming mid-epoch with a plain dataloader does not apply.
warnings.filterwarnings("ignore", message=".*your dataloader is not resumable.*")


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
                raise RecipeError(
                    f"{path} row {i + 1}: missing field 'prompt'; every row needs 'prompt' "
                    "(a string or a list of chat messages) and 'answer'"
                )
            if isinstance(prompt, list) and not all(
                isinstance(m, dict) and "role" in m and "content" in m for m in prompt
            ):
                raise RecipeError(
                    f"{path} row {i + 1}: 'prompt' is a list but not of chat messages ({{'role': ..., 'content': ...}})"
                )
            if row.get("answer") is None:
                raise RecipeError(f"{path} row {i + 1}: missing field 'answer'; every row needs 'prompt' and 'answer'")
            rows.append({"prompt": prompt, "answer": str(row["answer"])})
        if not len(ds):
            raise RecipeError(f"{field}: '{path}' holds no rows")
    return rows


class ResumableSampler(torch.utils.data.Sampler[int]):
    """A fresh seeded permutation of the training rows each epoch, able to start mid-epoch.

    Each epoch yields the first ``epoch_rows`` indices of a permutation of ``num_rows`` that depends only
    on ``(seed, epoch)``; ``start_at(n)`` skips the first ``n`` rows of that stream. A run resumed after
    ``k`` trained batches therefore sees exactly the rows an uninterrupted run would: the trained-batch
    count decides where it resumes, not the dataloader's prefetching.
    """

    def __init__(self, num_rows: int, epoch_rows: int, seed: int):
        self.num_rows = num_rows
        self.epoch_rows = epoch_rows
        self.seed = seed
        self.skip = 0  # rows of the stream already consumed by training

    def start_at(self, rows_consumed: int) -> None:
        self.skip = rows_consumed

    def __iter__(self):
        epoch, offset = divmod(self.skip, self.epoch_rows)
        g = torch.Generator().manual_seed(self.seed + epoch)
        order = torch.randperm(self.num_rows, generator=g)[: self.epoch_rows].tolist()
        self.skip = (epoch + 1) * self.epoch_rows  # the next iterator starts the next epoch
        yield from order[offset:]

    def __len__(self) -> int:
        # A full epoch, also when resuming mid-epoch: Lightning's restored batch counter then reaches the
        # epoch's end exactly when this iterator runs out.
        return self.epoch_rows


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
        self.batches_trained = 0
        """Training batches completed (advanced by the module after each RL step; saved in checkpoints)."""

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
        per_epoch = len(self.train_rows) // self.batch_size
        if per_epoch == 0:
            raise RecipeError(
                f"data.batch_size={self.batch_size} is larger than the {len(self.train_rows)} training rows"
            )
        sampler = ResumableSampler(len(self.train_rows), per_epoch * self.batch_size, self.seed)
        # Whole batches: resuming after k trained batches skips k * batch_size rows of the stream.
        sampler.start_at(self.batches_trained * self.batch_size)
        # The loader's own generator keeps iterator creation from drawing on the global RNG, which the
        # rollouts use: a resumed run must see the same random stream as an uninterrupted one.
        return DataLoader(
            self.train_rows,
            batch_size=self.batch_size,
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
