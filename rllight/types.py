"""The batch that flows through a training step."""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any

import torch
from torch import Tensor


MEAN_EXTRAS = "mean_extras"
"""``Rollout.extras`` key: the names of the batch's scalar extras that are means or rates over its responses, not
counts or times (``rllight.rollout.scoring.mean_metric_keys``, the engine's metrics, an episode's means): a sampler
that joins several batches weights these by responses (``rllight.strategies.samplers.RoundTotals``)."""


@dataclass
class Rollout:
    """Sampled responses with everything the update needs. B rows (one per response), P prompt
    columns (left-padded), T response columns (right-padded).

    Tensor fields that are ``None`` have not been computed (yet) for this algorithm.
    """

    prompt_ids: Tensor
    """Shape (B, P): prompt token ids, left-padded."""
    prompt_mask: Tensor
    """Shape (B, P): 1 on prompt tokens, 0 on padding."""
    response_ids: Tensor
    """Shape (B, T): response token ids, right-padded; the end-of-sequence token is included."""
    response_mask: Tensor
    """Shape (B, T): 1 on response tokens that enter the loss: the model's own tokens (its actions)."""
    sample_logprobs: Tensor
    """Shape (B, T): log-probs of the response tokens under the engine's sampling distribution."""
    truncated: Tensor
    """Shape (B,), bool: the response hit the token limit without ending."""
    group_ids: Tensor
    """Shape (B,), long: responses with equal ids answer the same prompt."""
    answers: list[str]
    """Reference answers, one per row."""
    texts: list[str]
    """Decoded responses, one per row."""
    rewards: Tensor | None = None
    """Shape (B,): outcome reward of each response (task reward plus any shaping)."""
    correct: Tensor | None = None
    """Shape (B,), float 0/1: whether the response solved the task (for accuracy metrics)."""
    token_rewards: Tensor | None = None
    """Shape (B, T): per-token rewards; the outcome reward sits on the last response token."""
    dense_rewards: Tensor | None = None
    """Shape (B, T): rewards a reward gave per response token (``Scores.token_scores``), zero elsewhere; added
    to ``token_rewards`` with the outcome. None: the reward gives none."""
    old_logprobs: Tensor | None = None
    """Shape (B, T): log-probs under the policy before this step's updates (the PPO ratio's base)."""
    ref_logprobs: Tensor | None = None
    """Shape (B, T): log-probs under the frozen reference policy (KL)."""
    values: Tensor | None = None
    """Shape (B, T): value estimates V(s_t) of the critic."""
    advantages: Tensor | None = None
    """Shape (B, T): advantages, zero outside ``response_mask``."""
    returns: Tensor | None = None
    """Shape (B, T): value targets."""
    context_mask: Tensor | None = None
    """Shape (B, T): 1 on every real token after the prompt, the model's and an environment's observations
    of a multi-turn episode alike (observations are context, not actions: ``response_mask`` leaves them
    out). None = ``response_mask`` (a single turn)."""
    extras: dict[str, Any] = field(default_factory=dict)
    """Per-rollout values that callbacks and strategies add (tensors with a leading B are sliced)."""

    @staticmethod
    def empty(extras: dict[str, Any] | None = None) -> Rollout:
        """A rollout with no rows (every prompt was filtered out)."""
        z2 = torch.zeros((0, 1), dtype=torch.long)
        return Rollout(
            prompt_ids=z2,
            prompt_mask=z2,
            response_ids=z2,
            response_mask=z2,
            sample_logprobs=torch.zeros((0, 1)),
            truncated=torch.zeros(0, dtype=torch.bool),
            group_ids=torch.zeros(0, dtype=torch.long),
            answers=[],
            texts=[],
            rewards=torch.zeros(0),
            correct=torch.zeros(0),
            extras=dict(extras or {}),
        )

    def __len__(self) -> int:
        return self.response_ids.shape[0]

    @property
    def response_lengths(self) -> Tensor:
        """Shape (B,): number of response tokens of each row."""
        return self.response_mask.sum(-1)

    @property
    def input_ids(self) -> Tensor:
        """Shape (B, P + T): prompt and response."""
        return torch.cat([self.prompt_ids, self.response_ids], dim=1)

    @property
    def valid_mask(self) -> Tensor:
        """Shape (B, T): every real token after the prompt (``context_mask``, else ``response_mask``)."""
        return self.response_mask if self.context_mask is None else self.context_mask

    @property
    def attention_mask(self) -> Tensor:
        """Shape (B, P + T). Padding inside the response (after the end token) is masked; observation tokens
        of a multi-turn episode are attended to."""
        return torch.cat([self.prompt_mask, self.valid_mask.to(self.prompt_mask.dtype)], dim=1)

    @property
    def span_lengths(self) -> Tensor:
        """Shape (B,), long: columns up to each row's last real token after the prompt (observations included;
        ``response_lengths`` for a single turn), 0 for a row without one."""
        valid = self.valid_mask
        return (valid.shape[1] - valid.flip(-1).int().argmax(-1)).masked_fill(valid.sum(-1) == 0, 0)

    @property
    def last_action_index(self) -> Tensor:
        """Shape (B,), long: the position of each row's last model token (where the outcome reward sits);
        0 for a row without one. Equals ``response_lengths - 1`` for a single turn."""
        t = self.response_mask.shape[1]
        positions = torch.arange(t, device=self.response_mask.device).expand_as(self.response_mask)
        return torch.where(self.response_mask.bool(), positions, torch.full_like(positions, -1)).amax(-1).clamp(min=0)

    def outcome_token_rewards(self) -> Tensor:
        """Shape (B, T): each response's outcome reward on its last model token, zero elsewhere (and for empty
        ones). In a multi-turn episode that is the model's last token, not an observation's."""
        mask = self.response_mask.float()
        token_rewards = torch.zeros_like(mask)
        token_rewards[torch.arange(len(self), device=mask.device), self.last_action_index] = self.rewards.to(mask) * (
            self.response_lengths > 0
        )
        return token_rewards

    def select(self, index: Tensor | list[int]) -> Rollout:
        """The rows ``index`` as a new Rollout (tensors sliced along B, lists picked)."""
        idx = torch.as_tensor(index, dtype=torch.long)
        n = len(self)

        def pick(value: Any) -> Any:
            if isinstance(value, Tensor) and value.dim() > 0 and value.shape[0] == n:
                return value[idx.to(value.device)]
            if isinstance(value, list) and len(value) == n:
                return [value[i] for i in idx.tolist()]
            return value

        changes = {f.name: pick(getattr(self, f.name)) for f in fields(self) if f.name != "extras"}
        changes["extras"] = {k: pick(v) for k, v in self.extras.items()}
        return replace(self, **changes)

    def trim(self) -> Rollout:
        """Drop prompt columns that are padding in every row and response columns past the longest
        response, so a micro-batch of short sequences costs only its own length."""
        p = int(self.prompt_mask.sum(-1).max().item()) if len(self) else 0
        t = int(self.span_lengths.max().item()) if len(self) else 0
        t = max(t, 1)
        full_p, full_t = self.prompt_ids.shape[1], self.response_ids.shape[1]
        if p == full_p and t == full_t:
            return self

        def cut(name: str, value: Any) -> Any:
            if not isinstance(value, Tensor) or value.dim() < 2:
                return value
            if name in ("prompt_ids", "prompt_mask"):
                return value[:, full_p - p :]
            return value[:, :t] if value.shape[1] == full_t else value

        changes = {f.name: cut(f.name, getattr(self, f.name)) for f in fields(self) if f.name != "extras"}
        changes["extras"] = {k: cut(k, v) for k, v in self.extras.items()}
        return replace(self, **changes)

    def to(self, device: torch.device | str) -> Rollout:
        changes = {
            f.name: getattr(self, f.name).to(device) for f in fields(self) if isinstance(getattr(self, f.name), Tensor)
        }
        return replace(self, **changes)

    @staticmethod
    def cat(parts: list[Rollout], pad_id: int) -> Rollout:
        """Concatenate rollouts along B, padding prompts on the left and responses on the right."""
        if len(parts) == 1:
            return parts[0]
        p = max(r.prompt_ids.shape[1] for r in parts)
        t = max(r.response_ids.shape[1] for r in parts)

        def left(x: Tensor, width: int, value: float) -> Tensor:
            return torch.nn.functional.pad(x, (width - x.shape[1], 0), value=value)

        def right(x: Tensor, width: int, value: float) -> Tensor:
            return torch.nn.functional.pad(x, (0, width - x.shape[1]), value=value)

        out: dict[str, Any] = {}
        for f in fields(Rollout):
            values = [getattr(r, f.name) for r in parts]
            if f.name == "context_mask" and any(v is not None for v in values):
                values = [r.valid_mask for r in parts]  # a single-turn part's context is its response
            if f.name == "dense_rewards" and any(v is not None for v in values):  # a part without: zeros
                values = [torch.zeros_like(r.response_mask, dtype=torch.float32) if v is None else v
                          for r, v in zip(parts, values)]
            if f.name == "extras":
                out[f.name] = {
                    k: torch.cat([r.extras[k] for r in parts])
                    if isinstance(v, Tensor)
                    else sum((r.extras[k] for r in parts), [])
                    if isinstance(v, list)
                    else v
                    for k, v in parts[0].extras.items()
                }
            elif values[0] is None:
                out[f.name] = None
            elif isinstance(values[0], list):
                out[f.name] = sum(values, [])
            elif f.name == "prompt_ids":
                out[f.name] = torch.cat([left(v, p, pad_id) for v in values])
            elif f.name == "prompt_mask":
                out[f.name] = torch.cat([left(v, p, 0) for v in values])
            elif values[0].dim() == 2:
                fill = pad_id if f.name == "response_ids" else 0
                out[f.name] = torch.cat([right(v, t, fill) for v in values])
            else:
                out[f.name] = torch.cat(values)
        return Rollout(**out)
