"""Generation engines behind one interface (``RolloutEngine.generate``)."""

from rllight.rollout.base import Generation, RolloutEngine
from rllight.rollout.hf import HFEngine

__all__ = ["Generation", "HFEngine", "RolloutEngine"]
