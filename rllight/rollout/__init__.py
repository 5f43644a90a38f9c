"""Generation engines behind one interface (``RolloutEngine.generate``)."""

from rllight.rollout.base import Generation, RolloutEngine, Sampling
from rllight.rollout.hf import HFEngine
from rllight.rollout.remote import VLLMServerEngine
from rllight.rollout.worker import ProcessEngine

__all__ = ["Generation", "HFEngine", "ProcessEngine", "RolloutEngine", "Sampling", "VLLMServerEngine"]
