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
