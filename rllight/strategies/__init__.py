"""Strategies: small classes composed in a recipe by ``class_path``. Each ``__init__`` holds
hyper-parameters (its docstring is the CLI help); ``__call__`` delegates to ``rllight.algorithms``.
Subclass any base class in your own module and name it in a recipe; nothing here needs editing.

One file per kind, named after the recipe key it fills; every class is exported here, which is the ``class_path``
a recipe names (``rllight.strategies.GroupRelative``):

- ``advantages.py``, advantage estimators (``model.advantage``): ``AdvantageEstimator``, ``GAE``, ``DecoupledGAE``,
  ``PromptBaseline``, ``GroupRelative``, ``RLOO``, ``ReMax``, ``ReinforcePP``, ``OnPolicyDistillation``;
- ``lambdas.py``, lambda schedules (``DecoupledGAE``'s ``policy_lambda``): ``LambdaSchedule``, ``FixedLambda``,
  ``AdaptiveLambda``, ``VAPOLambda``;
- ``policy_losses.py``, policy losses (``model.policy_loss``): ``PolicyLoss``, ``ClippedSurrogate``, ``CISPO``,
  ``VESPO``, ``SequenceClippedSurrogate``, ``GSPO``;
- ``loss_wrappers.py``, policy losses that wrap one of those: ``TruncatedIS``, ``MaskedIS``, ``PositiveExampleNLL``;
- ``aggregations.py``, aggregations (``model.aggregation``): ``Aggregation``, ``TokenMean``, ``SeqMeanTokenMean``,
  ``SeqMeanTokenSum``, ``SeqMeanTokenSumNorm``;
- ``samplers.py``, samplers (``model.sampler``): ``Sampler``, ``GroupSampler``, ``ReMaxSampler``, ``DynamicSampling``;
- ``kl.py``, the KL penalty (``model.kl``): ``KLPenalty``;
- ``token_rewards.py``, the rewards per response token an estimator reads (the outcome, a reward's token scores, a
  KL penalty in the reward): ``token_rewards``.

A method is a recipe, not a class. What the recipe of each method (``recipes/<recipe>.yaml``) composes: its
advantage + policy loss + aggregation + sampler, then a critic (``critics.``: ``rllight.critics``), rollout callbacks
(``callbacks.``: ``rllight.callbacks``, in ``trainer.callbacks``) or a KL penalty (``model.kl``) where it has one. The
settings shown are those that make the method (the recipe sets more); ``tests/strategies/test_strategies_table.py`` checks each
row against its recipe.

```text
method       arXiv        recipe         classes it composes
PPO          1707.06347   ppo            GAE + ClippedSurrogate + TokenMean + GroupSampler(group_size=1)
                                         + critics.ValueHead
GRPO         2402.03300   grpo           GroupRelative + ClippedSurrogate + SeqMeanTokenMean + GroupSampler
DAPO         2503.14476   dapo           GroupRelative + ClippedSurrogate(clip_high=0.28) + TokenMean + DynamicSampling
                                         + callbacks.SoftOverlongPunishment + callbacks.OverlongFilter
VAPO         2504.05118   vapo           DecoupledGAE(policy_lambda=AdaptiveLambda, value_lam=1.0)
                                         + ClippedSurrogate(clip_high=0.28) + TokenMean + GroupSampler
                                         + critics.SeparateCritic + callbacks.ValuePretraining
                                         + callbacks.SelfImitation + SeqMeanTokenSum (its eq. 11 aggregation)
SPPO         2604.08865   sppo           PromptBaseline + SequenceClippedSurrogate + TokenMean (unused: one loss a
                                         response) + GroupSampler(group_size=1) + critics.PromptCritic
VESPO        2602.10693   vespo          GroupRelative + VESPO + TokenMean + GroupSampler
RLOO         2402.14740   rloo           RLOO + ClippedSurrogate + SeqMeanTokenSum + GroupSampler(group_size=4)
ReMax        2310.10505   remax          ReMax + ClippedSurrogate + SeqMeanTokenSum + ReMaxSampler
REINFORCE++  2501.03262   reinforce_pp   ReinforcePP + ClippedSurrogate + TokenMean + GroupSampler(group_size=1)
                                         + KLPenalty(kind=k1, in_reward=True)
GSPO         2507.18071   gspo           GroupRelative + GSPO + SeqMeanTokenMean (unused: one loss a response)
                                         + GroupSampler
Dr. GRPO     2503.20783   dr_grpo        GroupRelative(scale_by_std=False) + ClippedSurrogate
                                         + SeqMeanTokenSumNorm(max_len=24) + GroupSampler
CISPO        2506.13585   cispo          GroupRelative + CISPO(clip_low=None, clip_high=0.28) + TokenMean + GroupSampler
OPD          2306.13649   distill-quickstart  OnPolicyDistillation(task=GroupRelative, task_weight=0.0)
                                         + ClippedSurrogate + TokenMean + GroupSampler + callbacks.TeacherLogprobs
```
"""

from rllight.strategies.advantages import (
    GAE,
    RLOO,
    AdvantageEstimator,
    DecoupledGAE,
    GroupRelative,
    OnPolicyDistillation,
    PromptBaseline,
    ReinforcePP,
    ReMax,
)
from rllight.strategies.aggregations import (
    Aggregation,
    SeqMeanTokenMean,
    SeqMeanTokenSum,
    SeqMeanTokenSumNorm,
    TokenMean,
)
from rllight.strategies.kl import KLPenalty
from rllight.strategies.lambdas import AdaptiveLambda, FixedLambda, LambdaSchedule, VAPOLambda
from rllight.strategies.loss_wrappers import MaskedIS, PositiveExampleNLL, TruncatedIS
from rllight.strategies.policy_losses import (
    CISPO,
    GSPO,
    VESPO,
    ClippedSurrogate,
    PolicyLoss,
    SequenceClippedSurrogate,
)
from rllight.strategies.samplers import DynamicSampling, GroupSampler, ReMaxSampler, Sampler

__all__ = [
    "CISPO",
    "GAE",
    "GSPO",
    "RLOO",
    "VESPO",
    "AdaptiveLambda",
    "AdvantageEstimator",
    "Aggregation",
    "ClippedSurrogate",
    "DecoupledGAE",
    "DynamicSampling",
    "FixedLambda",
    "GroupRelative",
    "GroupSampler",
    "KLPenalty",
    "LambdaSchedule",
    "MaskedIS",
    "OnPolicyDistillation",
    "PolicyLoss",
    "PositiveExampleNLL",
    "PromptBaseline",
    "ReMax",
    "ReMaxSampler",
    "ReinforcePP",
    "Sampler",
    "SeqMeanTokenMean",
    "SeqMeanTokenSum",
    "SeqMeanTokenSumNorm",
    "SequenceClippedSurrogate",
    "TokenMean",
    "TruncatedIS",
    "VAPOLambda",
]
