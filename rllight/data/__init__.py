"""Data: the datamodule, the embedded arithmetic task and reasoning-gym's tasks."""

from rllight.data.arithmetic import ArithmeticTask
from rllight.data.module import RLDataModule
from rllight.data.reasoning_gym import ReasoningGymTask
from rllight.data.task import Task

__all__ = ["ArithmeticTask", "RLDataModule", "ReasoningGymTask", "Task"]
