"""Aggregations (``model.aggregation``): how the per-token losses of an optimizer step become one number, a choice
separate from the policy loss (``rllight.algorithms.aggregate`` has the modes)."""

from __future__ import annotations

from torch import Tensor

from rllight.algorithms import aggregate

__all__ = ["Aggregation", "SeqMeanTokenMean", "SeqMeanTokenSum", "SeqMeanTokenSumNorm", "TokenMean"]


class Aggregation:
    """How per-token losses become one number; see ``rllight.algorithms.aggregate`` for the modes.

    ``num_tokens`` / ``num_seqs`` are the global counts of the optimizer step (all micro-batches, all ranks).
    """

    mode = "token-mean"

    def __init__(self, max_len: int | None = None):
        self.max_len = max_len

    def __call__(self, per_token: Tensor, response_mask: Tensor, num_tokens: Tensor | float | None = None,
                 num_seqs: Tensor | float | None = None) -> Tensor:
        return aggregate(per_token, response_mask, self.mode, num_tokens=num_tokens, max_len=self.max_len,
                         num_seqs=num_seqs)


class TokenMean(Aggregation):
    """Every valid token of the optimizer step weighs the same (DAPO's token-level loss)."""

    mode = "token-mean"

    def __init__(self):
        super().__init__()


class SeqMeanTokenMean(Aggregation):
    """Mean over each response, then over responses (GRPO as published)."""

    mode = "seq-mean-token-mean"

    def __init__(self):
        super().__init__()


class SeqMeanTokenSum(Aggregation):
    """Sum over each response, then mean over responses."""

    mode = "seq-mean-token-sum"

    def __init__(self):
        super().__init__()


class SeqMeanTokenSumNorm(Aggregation):
    """Sum over each response divided by a constant, then mean over responses (Dr. GRPO).

    Args:
        max_len: The constant; default the response width T of the batch. Set it to
            ``rollout.max_new_tokens`` for one constant across batches, as the paper does.
    """

    mode = "seq-mean-token-sum-norm"

    def __init__(self, max_len: int | None = None):
        super().__init__(max_len=max_len)
