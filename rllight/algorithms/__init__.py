"""The mathematics of rllight as pure tensor functions: no Lightning, no config objects, no
``torch.distributed``. Global counts (tokens, sequences) are arguments."""

from rllight.algorithms.advantages import discounted_cumsum, gae, group_relative
from rllight.algorithms.kl import kl_penalty, masked_mean, masked_whiten
from rllight.algorithms.logprobs import chunked_logprobs_and_entropy, logprobs_and_entropy
from rllight.algorithms.losses import aggregate, clip_fractions, clipped_surrogate, explained_variance, value_loss

__all__ = [
    "aggregate",
    "chunked_logprobs_and_entropy",
    "clip_fractions",
    "clipped_surrogate",
    "discounted_cumsum",
    "explained_variance",
    "gae",
    "group_relative",
    "kl_penalty",
    "logprobs_and_entropy",
    "masked_mean",
    "masked_whiten",
    "value_loss",
]

from rllight.algorithms.baselines import reinforce_pp, remax, rloo  # noqa: E402
from rllight.algorithms.masked_is import icepop_weight, sequence_is_mask, token_is_mask  # noqa: E402
from rllight.algorithms.sequence import (  # noqa: E402
    cispo,
    effective_sample_size,
    gspo,
    sequence_clipped_surrogate,
    truncated_is_weight,
    vespo_weight,
)

__all__ += [
    "cispo",
    "effective_sample_size",
    "gspo",
    "icepop_weight",
    "reinforce_pp",
    "remax",
    "rloo",
    "sequence_clipped_surrogate",
    "sequence_is_mask",
    "token_is_mask",
    "truncated_is_weight",
    "vespo_weight",
]

from rllight.algorithms.batching import deal_groups, first_in_rank_order, minibatch_shares  # noqa: E402
from rllight.algorithms.lambdas import adaptive_lambda, vapo_lambda  # noqa: E402
from rllight.algorithms.shaping import group_retention_probability, mixed_groups, soft_overlong_punishment  # noqa: E402

__all__ += ["adaptive_lambda", "group_retention_probability", "mixed_groups", "soft_overlong_punishment", "vapo_lambda"]
__all__ += ["deal_groups", "first_in_rank_order", "minibatch_shares"]

from rllight.algorithms.evaluation import (  # noqa: E402
    Estimate,
    avg_at_k,
    bootstrap_interval,
    maj_at_k,
    majority_vote,
    mean_and_se,
    pass_at_k,
    pass_at_k_over_prompts,
)

__all__ += ["Estimate", "avg_at_k", "bootstrap_interval", "maj_at_k", "majority_vote", "mean_and_se", "pass_at_k",
            "pass_at_k_over_prompts"]

from rllight.algorithms.distillation import (  # noqa: E402
    chunked_teacher_divergence,
    forward_kl,
    generalized_jsd,
    reverse_kl,
    teacher_divergence,
    with_rest,
)

__all__ += ["chunked_teacher_divergence", "forward_kl", "generalized_jsd", "reverse_kl", "teacher_divergence",
            "with_rest"]
