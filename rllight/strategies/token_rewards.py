"""The rewards per response token that an advantage estimator reads: the outcome on the last token, the scores a
reward gave per token, and a KL penalty in the reward."""

from __future__ import annotations

from torch import Tensor

from rllight.errors import RecipeError
from rllight.types import Rollout


def token_rewards(rollout: Rollout, advantage, kl=None) -> Tensor:
    """Shape (B, T): the outcome reward on each response's last token (``Rollout.outcome_token_rewards``), plus the
    reward's token scores (``Rollout.dense_rewards``), minus ``kl.coef * KL(policy || reference)`` on every response
    token when the KL penalty is in the reward (``KLPenalty.in_reward``, PPO-RLHF, Ouyang et al. arXiv:2203.02155;
    the KL of the log-probs before the update: ``old_logprobs``, else the sampler's).

    Raises ``RecipeError`` in one line when the reward gives token scores that ``advantage`` would drop (it reads
    one reward per response)."""
    rewards = rollout.outcome_token_rewards()
    if rollout.dense_rewards is not None:
        if not advantage.uses_token_rewards:
            raise RecipeError(f"model.reward gives scores per response token, which model.advantage "
                              f"{type(advantage).__name__} does not read (it reads one reward per response); choose "
                              "an estimator that reads token rewards (GAE, VAPO, REINFORCE++) or give one score per "
                              "response")
        rewards = rewards + rollout.dense_rewards
    if kl is not None and kl.in_reward:
        base = rollout.old_logprobs if rollout.old_logprobs is not None else rollout.sample_logprobs
        rewards = rewards - kl.coef * kl(base, rollout.ref_logprobs) * rollout.response_mask.float()
    return rewards


__all__ = ["token_rewards"]
