"""Outcome rewards: verifiers that score one response against its reference answer.

A reward is any subclass of ``Reward`` (select it in a recipe by ``class_path``, including from your own
module). ``score_batch`` is what the trainer calls: a reward that raises or returns a value that is not
finite in float32 for one sample gives that sample 0 and counts it, so one bad sample never stops a run.
``check_answers`` runs before training: it rejects a reference answer the reward can never match, which
would otherwise score every response to that prompt as wrong without a word.

A ``BatchReward`` (``rllight.rewards.batch``) scores a whole batch of ``Sample``s at once in the trainer's process:
``RewardModel`` (a Hugging Face sequence classifier) and ``LLMJudge`` (a model behind an OpenAI-compatible URL) are two.
"""

from rllight.rewards.base import IntegerMatch, MathVerify, Reward, check_answers, last_integer, score_batch
from rllight.rewards.batch import BatchReward, BatchScores, Sample, as_batch_scores
from rllight.rewards.combine import FormatReward, Weighted, WeightedBatch
from rllight.rewards.judge import LLMJudge
from rllight.rewards.per_source import PerSource, batch_rewards, by_source, check_rows, score_rows
from rllight.rewards.reasoning_gym import ReasoningGymScore
from rllight.rewards.reward_model import RewardModel
from rllight.rewards.runner import RewardRunner, RewardScores

__all__ = ["BatchReward", "BatchScores", "FormatReward", "IntegerMatch", "LLMJudge", "MathVerify", "PerSource",
           "ReasoningGymScore", "Reward", "RewardModel", "RewardRunner", "RewardScores", "Sample", "Weighted",
           "WeightedBatch", "as_batch_scores", "batch_rewards", "by_source", "check_answers", "check_rows",
           "last_integer", "score_batch", "score_rows"]
