"""Multi-turn environments: the model answers, the environment replies (feedback, tool results), until done.

Select one with ``model.environment``; the rollout producer then runs episodes (``rllight.rollout.episodes``)
instead of single responses, token in and token out.

Environments the ecosystem ships run through adapters, each with its package as an optional extra:
``FactoryEnvironment`` (any class written to TRL's environment contract), ``OpenEnv``,
``Verifiers`` and ``TextArena``; their packages are imported when an episode first needs them.
"""

from rllight.envs.arithmetic import ArithmeticFeedback
from rllight.envs.base import Environment, StepResult
from rllight.envs.calculator import CalcError, Calculator, evaluate, format_number
from rllight.envs.factory import FactoryEnvironment
from rllight.envs.feedback import Feedback
from rllight.envs.openenv import OpenEnv
from rllight.envs.textarena import TextArena
from rllight.envs.tool_calls import ToolCall, parse_tool_calls
from rllight.envs.verifiers_env import Verifiers

__all__ = ["ArithmeticFeedback", "CalcError", "Calculator", "Environment", "FactoryEnvironment", "Feedback",
           "OpenEnv", "StepResult", "TextArena", "ToolCall", "Verifiers", "evaluate", "format_number", "parse_tool_calls"]
