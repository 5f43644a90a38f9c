"""Rewards: every reward scores a batch of ``Sample``s and returns ``Scores`` (``Reward.score``).

A reward is any subclass of ``Reward`` (select it in a recipe by ``class_path``, including from your own module):
a ``Verifier`` of one response against its reference answer (``IntegerMatch``, ``MathVerify``, ``FormatReward``,
``ReasoningGymScore``), a reward model (``RewardModel``), an LLM judge (``LLMJudge``), or a combination of rewards
(``Weighted``, ``PerSource``). Verifiers run in the worker processes of ``RewardRunner`` (``Reward.guarded``): one
that raises, hangs or kills its process costs its sample, never the run. ``check_rows`` runs before training: it
rejects a reference answer the reward can never match; ``preflight`` checks that the reward tells a right answer
from a wrong one.
"""

from rllight.rewards.base import IntegerMatch, MathVerify, Reward, Verifier, check_answers, last_integer
from rllight.rewards.combine import FormatReward, Weighted, scored
from rllight.rewards.judge import LLMJudge
from rllight.rewards.per_source import PerSource, check_rows
from rllight.rewards.preflight import preflight
from rllight.rewards.reasoning_gym import ReasoningGymScore
from rllight.rewards.reward_model import RewardModel
from rllight.rewards.runner import Guarded, RewardRunner
from rllight.rewards.scores import Sample, Scores, checked

__all__ = ["FormatReward", "Guarded", "IntegerMatch", "LLMJudge", "MathVerify",
           "PerSource", "ReasoningGymScore", "Reward", "RewardModel", "RewardRunner", "Sample", "Scores", "Verifier",
           "Weighted", "check_answers", "check_rows", "checked", "last_integer", "preflight", "scored"]
