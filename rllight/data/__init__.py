"""Data: the datamodule and the embedded arithmetic task."""

from rllight.data.arithmetic import ArithmeticTask
from rllight.data.module import RLDataModule

__all__ = ["ArithmeticTask", "RLDataModule"]
