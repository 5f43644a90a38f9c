"""A verifiers environment's tasks as training and validation rows (``bash tools/install.sh verifiers``).

In a recipe, with the same environment in ``model.environment`` (``rllight.envs.verifiers_env.Verifiers``), which
plays each row's task::

    data:
      task:
        class_path: rllight.data.verifiers_data.VerifiersTask
        init_args:
          load: my_pkg.envs:load_environment
          args: {difficulty: easy}
          train_size: 1000
          val_size: 100
"""

from __future__ import annotations

import itertools

from rllight.bounds import NonNegativeInt, PositiveInt, bounded
from rllight.data.task import Task
from rllight.envs.verifiers_env import check_settings, load_source, require_verifiers
from rllight.errors import RecipeError

KEY = "data.task.init_args"


class VerifiersTask(Task):
    """The tasks of a verifiers environment's taskset, in its order: the first ``val_size`` are held out, the next
    ``train_size`` train (a training task whose key is also a held-out one is dropped, so the splits never share
    a task). Each row has the task's prompt as chat messages (its system prompt first), its ``answer`` when its data
    has one, ``data_source`` (the environment's name) and the task's data (``verifiers_task``), from which the
    environment rebuilds the task its rewards score.

    Args:
        load: Import path (``module:attr``) of a function or class that returns a ``vf.Env`` or ``vf.Taskset``,
            called with ``args`` (as ``Verifiers``' ``load``).
        env_id: Instead of ``load``: a verifiers taskset id (as ``Verifiers``' ``env_id``).
        args: Keyword arguments of ``load``, or the taskset settings of ``env_id``.
        train_size: Training tasks (None = every task after the held-out ones; needed for an endless taskset).
        val_size: Held-out tasks, the first of the taskset.
    """

    @bounded
    def __init__(self, load: str | None = None, env_id: str | None = None, args: dict | None = None,
                 train_size: PositiveInt | None = None, val_size: NonNegativeInt = 0):
        self.args = check_settings(load, env_id, args, KEY)
        require_verifiers("data.task: VerifiersTask")  # before the model loads
        self.load, self.env_id, self.train_size, self.val_size = load, env_id, train_size, val_size

    def splits(self) -> tuple[list[dict], list[dict]]:
        source = load_source(self.load, self.env_id, self.args, KEY)
        taskset = source.taskset
        if self.train_size is None and not taskset.bounded:
            raise RecipeError(f"{KEY}.train_size: {type(taskset).__name__} has no end; give how many tasks to train on")
        stop = None if self.train_size is None else self.val_size + self.train_size
        tasks = list(itertools.islice(iter(taskset), stop))
        held_out, rest = tasks[: self.val_size], tasks[self.val_size:]
        keys = {task.key for task in held_out}
        train = [source.row(task) for task in rest if task.key not in keys]
        if not train:
            raise RecipeError(f"{KEY}: the verifiers environment {source.name!r} gave no training task (it has "
                              f"{len(tasks)} task(s) and val_size is {self.val_size})")
        return train, [source.row(task) for task in held_out]


__all__ = ["VerifiersTask"]
