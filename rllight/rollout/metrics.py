"""Metrics of a rollout and of the updates on it, among them how far the engine's sampling log-probs are from
the trainer's for the same tokens."""

from __future__ import annotations

import torch
from torch import Tensor

from rllight.algorithms import explained_variance
from rllight.rollout.episodes import main_rows
from rllight.rollout.producer import SAMPLE_STALENESS


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


def is_scalar(value) -> bool:
    return isinstance(value, (int, float)) or (isinstance(value, Tensor) and value.dim() == 0)


def scalar_extras(rollout) -> dict:
    """The scalars that samplers, estimators and callbacks put in ``rollout.extras`` (logged as they are)."""
    return {k: v for k, v in rollout.extras.items() if is_scalar(v)}


def reduce_stats(stats: dict[str, list[Tensor]], micro_batches: bool = False) -> dict[str, Tensor]:
    """One number per key from per-micro-batch (or per-update) values: the loss of an update is the sum of its
    micro-batches' shares, a ``*_max`` metric is a maximum, everything else a mean."""
    out = {}
    for key, values in stats.items():
        stacked = torch.stack(values).float()
        if micro_batches and key in ("policy/loss", "value/total_loss"):
            out[key] = stacked.sum()
        else:
            out[key] = stacked.max() if key.endswith("_max") else stacked.mean()
    return out


def critic_explained_variance(rollout) -> Tensor | None:
    """Explained variance of a token-level critic's values against the rollout's returns (None without values
    (B, T) and returns)."""
    if len(rollout) == 0 or rollout.values is None or rollout.returns is None or rollout.values.dim() != 2:
        return None
    return explained_variance(rollout.values, rollout.returns, rollout.response_mask)


def rollout_metrics(rollout) -> dict[str, Tensor | float]:
    """The per-step ledger of a rollout (reward, accuracy, lengths, truncation, groups, staleness, and the
    scalars of its extras)."""
    if len(rollout) == 0:
        return scalar_extras(rollout)
    lengths = rollout.response_lengths.float()
    full, rollout = rollout, main_rows(rollout)  # reward statistics count each episode once
    groups = torch.unique(rollout.group_ids)
    mixed = sum(int(rollout.rewards[rollout.group_ids == g].unique().numel() > 1) for g in groups.tolist())
    metrics: dict[str, Tensor | float] = {
        "reward/mean": rollout.rewards.mean(),
        "reward/std": rollout.rewards.std() if len(rollout) > 1 else torch.tensor(0.0),
        "reward/accuracy": rollout.correct.mean(),
        "reward/valid_group_ratio": mixed / max(len(groups), 1),
        "response/length_mean": lengths.mean(),  # per row: a sample's model and observation tokens
        "response/length_max": lengths.max(),
        "response/truncated_ratio": full.truncated.float().mean(),
        "response/tokens": lengths.sum(),
    }
    staleness = full.extras.get(SAMPLE_STALENESS)
    if staleness is not None:
        metrics["rollout/staleness_mean"] = staleness.float().mean()
        metrics["rollout/staleness_max"] = staleness.float().max()
    metrics.update(scalar_extras(full))
    return metrics
