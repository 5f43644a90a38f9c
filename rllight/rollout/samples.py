"""A ``Generation`` from what an engine that is not torch gives back (vLLM in this process, a vLLM server): per
prompt, the sampled token ids, their log-probs and whether the response hit the length limit."""

from __future__ import annotations

import torch

from rllight.rollout.base import Generation, pad_left

__all__ = ["generation_from_samples"]


def generation_from_samples(prompts: list[list[int]], responses: list[list[int]], logprobs: list[list[float]],
                            truncated: list[bool], pad_id: int, device: torch.device) -> Generation:
    """A ``Generation`` from an engine's per-prompt outputs: the sampled token ids (the end token kept), the
    sampled tokens' log-probs and whether each response hit the length limit."""
    width = max(1, max(len(ids) for ids in responses))
    response_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    response_mask = torch.zeros((len(prompts), width), dtype=torch.long)
    sampled = torch.zeros((len(prompts), width), dtype=torch.float32)
    for i, (ids, values) in enumerate(zip(responses, logprobs)):
        if ids:
            response_ids[i, : len(ids)] = torch.tensor(ids)
            response_mask[i, : len(ids)] = 1
            sampled[i, : len(ids)] = torch.tensor(values, dtype=torch.float32)
    prompt_ids, prompt_mask = pad_left(prompts, pad_id)
    return Generation(prompt_ids.to(device), prompt_mask.to(device), response_ids.to(device), response_mask.to(device),
                      sampled.to(device), torch.tensor(truncated, dtype=torch.bool).to(device))
