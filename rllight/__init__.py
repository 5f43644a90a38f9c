"""rllight: a Lightning-based, modular reinforcement-learning trainer for language models."""

__version__ = "0.1.0"
