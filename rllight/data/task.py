"""The base class of an embedded task: a source of training and held-out rows without data files."""

from __future__ import annotations


class Task:
    """Rows made in code rather than read from files (``data.task`` when no ``data.train_files`` are given).

    Subclass it and select it with ``class_path`` in a recipe."""

    def splits(self) -> tuple[list[dict], list[dict]]:
        """``(train, val)`` rows, each with ``prompt`` and ``answer`` (strings) and optionally ``data_source``
        (evaluation reports each source separately); no held-out row may also be a training row."""
        raise NotImplementedError
