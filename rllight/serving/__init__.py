"""Where a model runs, composed as a part: ``InProcess``, ``Worker`` (a supervised child process) or ``Endpoint``
(a server at a URL) that speaks a wire ``Protocol`` (``VLLMPooling``, ``OpenRLHF``, ``ChatCompletions``,
``PromptLogprobs``). Reward models, LLM judges and the distillation teacher take one as ``placement``; the vLLM
rollout server's engine takes an ``Endpoint`` as ``server``. A new placement or protocol is a subclass in the
user's own module, named by ``class_path``."""

from rllight.serving.endpoint import Endpoint
from rllight.serving.placement import Failed, InProcess, Placement, Served, Worker
from rllight.serving.protocols import (ChatCompletions, Malformed, OpenRLHF, PromptLogprobs, Protocol, Request,
                                       ScoredText, VLLMPooling)

__all__ = ["ChatCompletions", "Endpoint", "Failed", "InProcess", "Malformed", "OpenRLHF", "Placement",
           "PromptLogprobs", "Protocol", "Request", "ScoredText", "Served", "VLLMPooling", "Worker"]


def placed(placement: Placement | None, where: str, served: Served) -> Placement:
    """``placement`` (None: ``InProcess()``) bound to ``served`` under the recipe key ``where`` (the owner's
    ``placement``): its settings checked, the owner's defaults taken."""
    return (placement if placement is not None else InProcess()).bind(f"{where}.init_args", served)


__all__ += ["placed"]
