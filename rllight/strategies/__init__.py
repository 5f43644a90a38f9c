"""Strategies: small classes composed in a recipe by ``class_path``. Each ``__init__`` holds
hyper-parameters (its docstring is the CLI help); ``__call__`` delegates to ``rllight.algorithms``.
Subclass any base class in your own module and name it in a recipe; nothing here needs editing."""

from rllight.strategies.advantages import GAE, AdvantageEstimator, GroupRelative
from rllight.strategies.losses import (
    Aggregation,
    ClippedSurrogate,
    KLPenalty,
    PolicyLoss,
    SeqMeanTokenMean,
    SeqMeanTokenSum,
    SeqMeanTokenSumNorm,
    TokenMean,
)
from rllight.strategies.samplers import GroupSampler, Sampler

__all__ = [
    "GAE",
    "AdvantageEstimator",
    "Aggregation",
    "ClippedSurrogate",
    "GroupRelative",
    "GroupSampler",
    "KLPenalty",
    "PolicyLoss",
    "Sampler",
    "SeqMeanTokenMean",
    "SeqMeanTokenSum",
    "SeqMeanTokenSumNorm",
    "TokenMean",
]

from rllight.strategies.baselines import (  # noqa: E402
    CISPO, GSPO, RLOO, MaskedIS, ReinforcePP, ReMax, ReMaxSampler, TruncatedIS)
from rllight.strategies.sppo import PromptBaseline, SequenceClippedSurrogate  # noqa: E402
from rllight.strategies.vespo import VESPO  # noqa: E402

__all__ += [
    "CISPO",
    "GSPO",
    "PromptBaseline",
    "RLOO",
    "ReMax",
    "ReMaxSampler",
    "ReinforcePP",
    "SequenceClippedSurrogate",
    "TruncatedIS",
    "MaskedIS",
    "VESPO",
]

from rllight.strategies.dapo import DynamicSampling  # noqa: E402
from rllight.strategies.vapo import (  # noqa: E402
    AdaptiveLambda,
    DecoupledGAE,
    FixedLambda,
    LambdaSchedule,
    PositiveExampleNLL,
    VAPOLambda,
)

__all__ += ["AdaptiveLambda", "DecoupledGAE", "DynamicSampling", "FixedLambda", "LambdaSchedule", "PositiveExampleNLL",
            "VAPOLambda"]
