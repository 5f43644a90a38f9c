"""Rollouts with Hugging Face ``generate``."""

from __future__ import annotations

import time

import torch

from rllight.errors import RecipeError
from rllight.rollout.base import Generation, RolloutEngine, pad_left, response_mask_from_ids


def eos_token_ids(model, tokenizer) -> list[int]:
    """Every id that ends a response: the generation config's end tokens and the tokenizer's."""
    ids: set[int] = set()
    cfg = getattr(model, "generation_config", None)
    eos = getattr(cfg, "eos_token_id", None)
    if isinstance(eos, int):
        ids.add(eos)
    elif eos:
        ids.update(eos)
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return sorted(ids)


_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


class HFEngine(RolloutEngine):
    """Batched generation in the training process with ``model.generate`` and a KV cache.

    The sampling log-probs come from the processed scores of ``generate`` (after temperature, top-k
    and top-p), i.e. the distribution the tokens were actually drawn from.

    Args:
        max_new_tokens: Longest response, in tokens.
        temperature: Sampling temperature.
        top_p: Nucleus sampling threshold (1.0 = off).
        top_k: Keep the k most likely tokens (0 = off).
        batch_size: Prompts per ``generate`` call (bounds the KV cache memory).
        dtype: Generate with a copy of the policy in this dtype (``bfloat16``: faster on GPUs and on CPUs
            with AMX), refreshed after every update; None = the policy itself. The engine's sampling
            log-probs then differ from the trainer's (``train/rollout/logprob_diff_*``): the behaviour
            policy is the copy, which truncated importance sampling and VESPO correct for.
    """

    def __init__(
        self,
        max_new_tokens: int = 64,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        batch_size: int = 64,
        dtype: str | None = None,
    ):
        super().__init__(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k)
        if batch_size < 1:
            raise RecipeError(f"model.rollout.init_args.batch_size must be >= 1, got {batch_size}")
        if dtype is not None and dtype not in _DTYPES:
            raise RecipeError(f"model.rollout.init_args.dtype: '{dtype}' is not one of {', '.join(_DTYPES)} or null")
        self.batch_size = batch_size
        self.dtype = dtype
        self._copy: torch.nn.Module | None = None  # the policy in ``dtype``, for generation
        self._copy_of: int | None = None  # id() of the policy the copy was made from

    def _generator(self, model: torch.nn.Module) -> torch.nn.Module:
        """The model to generate with: the policy, or its copy in ``dtype`` (made on first use)."""
        if self.dtype is None:
            return model
        if self._copy is None or self._copy_of != id(model):
            import copy

            self._copy = copy.deepcopy(model).to(_DTYPES[self.dtype]).eval()
            self._copy.requires_grad_(False)
            self._copy_of = id(model)
        return self._copy

    def update_weights(self, model: torch.nn.Module) -> dict[str, float]:
        if self._copy is None or self._copy_of != id(model):
            return {}
        start = time.perf_counter()
        with torch.no_grad():
            for target, source in zip(self._copy.parameters(), model.parameters()):
                target.copy_(source)
        return {"rollout/sync_time": time.perf_counter() - start}

    @torch.no_grad()
    def generate(self, model, tokenizer, prompts: list[list[int]], greedy: bool = False) -> Generation:
        start = time.perf_counter()
        out = self._generate_all(self._generator(model), tokenizer, prompts, greedy)
        self.last_metrics = {"rollout/tokens_per_s": out.response_mask.sum().item() / (time.perf_counter() - start)}
        return out

    def _generate_all(self, model, tokenizer, prompts: list[list[int]], greedy: bool) -> Generation:
        parts = [self._generate(model, tokenizer, prompts[i : i + self.batch_size], greedy)
                 for i in range(0, len(prompts), self.batch_size)]
        if len(parts) == 1:
            return parts[0]
        width = max(p.response_ids.shape[1] for p in parts)
        pwidth = max(p.prompt_ids.shape[1] for p in parts)
        pad = tokenizer.pad_token_id

        def right(x, value):
            return torch.nn.functional.pad(x, (0, width - x.shape[1]), value=value)

        def left(x, value):
            return torch.nn.functional.pad(x, (pwidth - x.shape[1], 0), value=value)

        return Generation(
            prompt_ids=torch.cat([left(p.prompt_ids, pad) for p in parts]),
            prompt_mask=torch.cat([left(p.prompt_mask, 0) for p in parts]),
            response_ids=torch.cat([right(p.response_ids, pad) for p in parts]),
            response_mask=torch.cat([right(p.response_mask, 0) for p in parts]),
            logprobs=torch.cat([right(p.logprobs, 0.0) for p in parts]),
            truncated=torch.cat([p.truncated for p in parts]),
        )

    def _generate(self, model, tokenizer, prompts: list[list[int]], greedy: bool) -> Generation:
        device = next(model.parameters()).device
        prompt_ids, prompt_mask = pad_left(prompts, tokenizer.pad_token_id)
        prompt_ids, prompt_mask = prompt_ids.to(device), prompt_mask.to(device)
        eos = eos_token_ids(model, tokenizer)
        kwargs = dict(do_sample=False) if greedy else dict(
            do_sample=True, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k
        )
        was_training = model.training
        model.eval()
        try:
            out = model.generate(
                input_ids=prompt_ids,
                attention_mask=prompt_mask,
                max_new_tokens=self.max_new_tokens,
                eos_token_id=eos,
                pad_token_id=tokenizer.pad_token_id,
                return_dict_in_generate=True,
                output_scores=True,
                **kwargs,
            )
        finally:
            model.train(was_training)
        response_ids = out.sequences[:, prompt_ids.shape[1] :]
        scores = torch.stack(out.scores, dim=1).float()  # (B, T, V), processed by the sampling warpers
        logprobs = torch.log_softmax(scores, dim=-1).gather(-1, response_ids.unsqueeze(-1)).squeeze(-1)
        mask, truncated = response_mask_from_ids(response_ids, eos)
        response_ids = torch.where(mask.bool(), response_ids, torch.full_like(response_ids, tokenizer.pad_token_id))
        logprobs = torch.where(mask.bool(), logprobs, torch.zeros_like(logprobs))
        return Generation(prompt_ids, prompt_mask, response_ids, mask, logprobs, truncated.cpu().to(device))
