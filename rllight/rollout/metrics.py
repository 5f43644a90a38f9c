"""How far the engine's sampling log-probs are from the trainer's, for the same tokens."""

from __future__ import annotations

import torch
from torch import Tensor


def logprob_mismatch(trainer_logprobs: Tensor, engine_logprobs: Tensor, mask: Tensor) -> dict[str, Tensor]:
    """Mismatch between the trainer's log-probs and the engine's (the behaviour policy's) on sampled tokens.

    Engines compute the same distribution with other kernels (and sometimes another dtype or stale weights);
    a growing mismatch makes the importance ratio off-policy without the clip noticing.

    Args:
        trainer_logprobs: Shape (B, T): log pi_train(y_t) of the sampled tokens.
        engine_logprobs: Shape (B, T): log pi_engine(y_t), what the engine reported when it sampled them.
        mask: Shape (B, T): 1 on response tokens.

    Returns:
        0-dim tensors, over the masked tokens (0 when there are none):
        ``rollout/logprob_diff_mean``: mean of ``|log pi_train - log pi_engine|``;
        ``rollout/logprob_diff_max``: its maximum;
        ``rollout/kl_engine_trainer``: KL(pi_engine || pi_train) per token, estimated on the engine's own
        samples with ``r - 1 - log r``, ``r = pi_train / pi_engine`` (non-negative, unbiased; Schulman's k3,
        http://joschu.net/blog/kl-approx.html).
    """
    m = mask.bool()
    delta = (trainer_logprobs.detach().float() - engine_logprobs.detach().float())[m]
    if delta.numel() == 0:
        zero = torch.zeros((), device=trainer_logprobs.device)
        return {"rollout/logprob_diff_mean": zero, "rollout/logprob_diff_max": zero.clone(),
                "rollout/kl_engine_trainer": zero.clone()}
    # expm1(d) - d equals exp(d) - 1 - d without the cancellation when d is tiny (the usual case).
    k3 = torch.expm1(delta) - delta
    return {
        "rollout/logprob_diff_mean": delta.abs().mean(),
        "rollout/logprob_diff_max": delta.abs().max(),
        "rollout/kl_engine_trainer": k3.mean(),
    }
