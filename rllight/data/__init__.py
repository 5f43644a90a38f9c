"""Data: the datamodule, mixing sources by weight, curricula (difficulty pools, or a rule of your own), the embedded
arithmetic task, reasoning-gym's tasks, seeded tasks (an environment draws the task from the seed) and verifiers'
tasksets."""

from rllight.data.arithmetic import ArithmeticTask
from rllight.data.curriculum import Curriculum
from rllight.data.mix import SourceMix
from rllight.data.module import RLDataModule
from rllight.data.pools import DifficultyPools
from rllight.data.reasoning_gym import ReasoningGymTask
from rllight.data.seeded import SeededTask
from rllight.data.task import Task
from rllight.data.verifiers_data import VerifiersTask

__all__ = ["ArithmeticTask", "Curriculum", "DifficultyPools", "RLDataModule", "ReasoningGymTask", "SeededTask",
           "SourceMix", "Task", "VerifiersTask"]
