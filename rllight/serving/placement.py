"""Where a model runs, as a part its owner composes: ``InProcess`` (the trainer's process), ``Worker`` (a supervised
child process) or ``rllight.serving.Endpoint`` (a server at a URL, spoken to in a wire protocol).

The owner (a reward model, a judge, a distillation teacher) is the ``Served`` side: it says what it is in messages
and how it answers a batch of inputs in this process or in a worker; the placement decides where that happens and
returns one value per input. Every placement of one owner gets the same inputs and returns values of the same
form, so the owner's code after ``answer`` is the same wherever the model runs. A new placement is a subclass of
``Placement`` in the user's own module, named by ``class_path`` under the owner's ``placement``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Protocol as Interface, runtime_checkable

from rllight.bounds import PositiveFiniteFloat, check_declared
from rllight.errors import RecipeError
from rllight.serving.protocols import Protocol
from rllight.serving.worker import WorkerProcess


class Failed(Exception):
    """The value of an input whose answer failed (``Endpoint`` gives one per failed request): the message is the
    one-line reason, the key redacted. ``failure`` is the transport's ``rllight.serving.http.Failure`` where there
    was one, ``route`` the request's route."""

    def __init__(self, reason: str, failure: Exception | None = None, route: str = ""):
        super().__init__(reason)
        self.failure, self.route = failure, route


@runtime_checkable
class Served(Interface):
    """What a placement places: the owner of a model (a reward model, a judge, a teacher).

    Attributes:
        what: The model in messages (``the judge``).
        default_timeout: Seconds a batch (a worker) or a request (an endpoint) waits where the recipe sets none.
        worker_target: The child function of a ``Worker`` (``"package.module:function"``, which calls
            ``rllight.serving.worker.serve``); None where the model cannot run in a worker.

    An owner may also set ``default_max_answer_bytes``, the longest answer an ``Endpoint`` reads for it where the
    recipe sets no ``max_answer_bytes`` (``rllight.serving.endpoint.LARGEST_ANSWER`` without one).
    """

    what: str
    default_timeout: float
    worker_target: str | None

    def forward(self, inputs: list) -> list:
        """The model's value for each input, computed in this process."""

    def worker_settings(self) -> dict:
        """What a worker child builds its copy of the model from."""

    def default_protocol(self) -> Protocol:
        """The wire protocol an ``Endpoint`` speaks where the recipe names none."""

    def served_name(self) -> str | None:
        """The model's name in a protocol's requests, where the protocol names none."""

    def check_local(self) -> None:
        """Before the run, for a model that runs here or in a worker: what can be checked without loading it."""


class Placement(ABC):
    """Where a model runs (see ``rllight.serving.placement``). Subclasses hold their settings in ``__init__``,
    check them in ``bind`` and answer batches in ``answer``."""

    where = "placement"  # the recipe key of this placement's settings, set by ``bind``

    def bind(self, where: str, served: Served) -> Placement:
        """Check the settings, naming ``where`` (``model.reward.init_args.placement.init_args``) in a one-line
        ``RecipeError``, and take ``served``'s defaults; the owner calls it once, in its constructor."""
        self.where = where
        return self

    def check(self, served: Served) -> None:
        """Before the policy loads: what the run will need and can be checked now (a key's variable, a folder)."""
        served.check_local()

    @abstractmethod
    def answer(self, served: Served, inputs: list) -> list[Any]:
        """``served``'s value for each of ``inputs``, in order: a value, or a ``Failed`` for an input whose answer
        failed alone. Raises where the whole batch failed."""

    def close(self) -> None:
        """Release what ``answer`` started (processes, threads); the next ``answer`` starts them again."""

    def redact(self, text: str) -> str:
        """``text`` with any secret of this placement (an endpoint's key) masked: for reasons that quote answers.
        Mask before cutting a text to length (``rllight.serving.http.clip``), so that a cut leaves no piece of it."""
        return text

    def __str__(self) -> str:  # where the model runs, in messages
        return type(self).__name__


class InProcess(Placement):
    """In the trainer's process: ``served.forward(inputs)``. A crash or a hang in the model is the trainer's."""

    def answer(self, served: Served, inputs: list) -> list:
        return served.forward(list(inputs)) if inputs else []

    def __repr__(self) -> str:
        return "InProcess()"

    def __str__(self) -> str:
        return "the trainer's process"


class Worker(Placement):
    """In a supervised child process (``rllight.serving.worker``), started at the first batch and stopped at
    ``close``: a model that runs out of memory, crashes or hangs costs a batch, not the run. On a GPU the child keeps
    its weights on its device (they are not the policy's memory to share).

    Args:
        timeout_seconds: Longest wait for one batch's answers; past it the child is killed and the batch fails.
            None = the owner's default.
        load_timeout_seconds: Longest wait for the child to start and load the model.
    """

    def __init__(self, timeout_seconds: PositiveFiniteFloat | None = None,
                 load_timeout_seconds: PositiveFiniteFloat = 600.0):
        self.timeout_seconds, self.load_timeout_seconds = timeout_seconds, load_timeout_seconds
        self._process: WorkerProcess | None = None

    def __repr__(self) -> str:
        return f"Worker(timeout_seconds={self.timeout_seconds!r})"

    def __str__(self) -> str:
        return "a worker process"

    def __getstate__(self) -> dict:  # a copy carries the settings, not the process
        return {**self.__dict__, "_process": None}

    def bind(self, where: str, served: Served) -> Worker:
        super().bind(where, served)
        if served.worker_target is None:
            raise RecipeError(f"{where.rsplit('.init_args', 1)[0]}: {served.what} cannot run in a Worker; place it "
                              "InProcess or at an Endpoint")
        self.timeout_seconds = served.default_timeout if self.timeout_seconds is None else self.timeout_seconds
        check_declared(self, where)  # the bounds of __init__'s annotations (timeout_seconds filled in above)
        return self

    @property
    def child(self):
        """The running child process (``rllight.supervised.SupervisedProcess``), or None."""
        return self._process.child if self._process is not None else None

    def answer(self, served: Served, inputs: list) -> list:
        if not inputs:
            return []
        if self._process is None:
            self._process = WorkerProcess(served.worker_target, served.worker_settings(), self.timeout_seconds,
                                          self.load_timeout_seconds, name=f"{served.what}'s worker process")
        return self._process.answer(list(inputs))

    def close(self) -> None:
        if self._process is not None:
            self._process.close()
        self._process = None


__all__ = ["Failed", "InProcess", "Placement", "Served", "Worker"]
