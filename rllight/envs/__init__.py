"""Multi-turn environments: the model answers, the environment replies (feedback, tool results), until done.

Select one with ``model.environment``; the rollout producer then runs episodes (``rllight.rollout.episodes``)
instead of single responses, token in and token out.
"""

from rllight.envs.arithmetic import ArithmeticFeedback
from rllight.envs.base import Environment, StepResult
from rllight.envs.calculator import CalcError, Calculator, evaluate, format_number
from rllight.envs.feedback import Feedback

__all__ = ["ArithmeticFeedback", "CalcError", "Calculator", "Environment", "Feedback", "StepResult", "evaluate",
           "format_number"]
