"""Rollouts in the training process: a Hugging Face model, a KV cache and the engine's own decode loop."""

from __future__ import annotations

import contextlib
import logging
import time

import torch
from torch import Tensor
from torch.profiler import record_function

from rllight._compat import return_free_memory
from rllight.bounds import NonNegativeInt, PositiveFloat, PositiveInt, UpToOne, bounded
from rllight.dtensor import full_tensor
from rllight.errors import RecipeError
from rllight.precision import AUTO, DTYPES, Float32Head, cpu_bf16
from rllight.rollout.base import (
    Generation,
    RolloutEngine,
    Sampling,
    distinct_prompts,
    pad_left,
    position_ids,
    response_mask_from_ids,
    seeded,
)

log = logging.getLogger(__name__)


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


@contextlib.contextmanager
def contiguous_head_input(model: torch.nn.Module):
    """Within the block, the output layer gets a contiguous input.

    The prompt pass asks for the last position's logits only (``logits_to_keep=1``), and the model slices its
    hidden states to that position: a non-contiguous (B, 1, H) view. On CPU, a bfloat16 ``linear`` on such a view
    broadcasts the (V, H) weight to a (B, H, V) copy (49152 x 576 x 2 bytes per row for SmolLM2: 3.4 GB for 64
    prompts, and seconds to write), where a contiguous input is one (B, H) x (H, V) product. float32 folds the view
    itself, so this showed as bfloat16 taking GBs more memory than float32 (``tests/test_precision.py``).
    """
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is None:
        yield
        return
    handle = head.register_forward_pre_hook(lambda module, args: (args[0].contiguous(), *args[1:]))
    try:
        yield
    finally:
        handle.remove()


class HFEngine(RolloutEngine):
    """Batched generation in the training process with a KV cache.

    The loop is the engine's own (``_decode``): each step keeps only the sampled token's log-prob under the
    distribution it was drawn from (after temperature, top-k and top-p), so the behaviour log-probs cost
    (B, T) memory, not the (B, T, V) scores ``generate`` would return.

    Args:
        max_new_tokens: Longest response, in tokens.
        temperature: Sampling temperature.
        top_p: Nucleus sampling threshold (1.0 = off).
        top_k: Keep the k most likely tokens (0 = off).
        batch_size: Prompts per ``generate`` call (bounds the KV cache memory).
        dtype: Generate with a copy of the policy in this dtype (``bfloat16``: faster on GPUs and on CPUs
            with AMX or AVX-512 BF16; on a CPU without them, e.g. AVX2 only, bfloat16 matrix products are
            many times slower than float32 and the engine warns), its weights made from the policy's at each
            generation and freed after it, so that the trainer's update (where memory peaks) runs without them
            (under FSDP the copy is kept and refreshed after every update); None = the policy itself;
            ``auto`` (the default) = what the trainer computes in: a bfloat16 copy under
            ``trainer.precision: bf16-mixed``, else the policy itself (the ``rllight`` command resolves it when
            it reads the recipe, ``rllight.precision``; an engine built in code treats ``auto`` as None). The
            engine's sampling log-probs then differ from the trainer's (``train/rollout/logprob_diff_*``): the
            behaviour policy is the copy, which truncated importance sampling and VESPO correct for. A policy
            whose output layer computes in float32 (``rllight.models.HFModel``'s ``float32_lm_head``) keeps
            it so in the copy: its weight stays a float32 copy of the policy's, synced with the rest.
        min_new_tokens: The end tokens cannot be drawn before this many response tokens (as ``generate``'s
            ``min_new_tokens``; 0 = off). For benchmarks that need responses of equal length
            (``max_new_tokens`` here gives exactly that many): the behaviour log-probs are then under the
            distribution without the end tokens, which the trainer's log-probs do not know, so the two differ
            (``train/rollout/logprob_diff_*``) and an off-policy correction would count it as staleness.
    """

    @bounded
    def __init__(
        self,
        max_new_tokens: PositiveInt = 64,
        temperature: PositiveFloat = 1.0,
        top_p: UpToOne = 1.0,
        top_k: NonNegativeInt = 0,
        batch_size: PositiveInt = 64,
        dtype: str | None = AUTO,
        min_new_tokens: NonNegativeInt = 0,
    ):
        super().__init__(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k)
        if not min_new_tokens <= max_new_tokens:
            raise RecipeError(f"model.rollout.init_args.min_new_tokens must be in 0..max_new_tokens "
                              f"({max_new_tokens}), got {min_new_tokens}")
        self.min_new_tokens = min_new_tokens
        if dtype is not None and dtype != AUTO and dtype not in DTYPES:
            raise RecipeError(f"model.rollout.init_args.dtype: '{dtype}' is not one of {', '.join(DTYPES)}, "
                              f"{AUTO} or null")
        self.batch_size = batch_size
        self.dtype = None if dtype == AUTO else dtype  # unresolved auto (no trainer precision known): the policy
        self._copy: torch.nn.Module | None = None  # the policy in ``dtype``, for generation
        self._copy_of: int | None = None  # id() of the policy the copy was made from
        self._kept = False  # keep_copy: the copy's weights stay between generations (else filled at each one)

    def _generator(self, model: torch.nn.Module) -> torch.nn.Module:
        """The model to generate with: the policy, or its copy in ``dtype`` (made on first use, its weights filled
        from the policy at each generation; under FSDP the full copy ``keep_copy`` took before sharding)."""
        if not self._kept:  # keep_copy's copy (FSDP) is the generator whatever the dtype
            if self.dtype is None:
                return model
            if self._copy is None or self._copy_of != id(model):
                self._make_copy(model)
            else:
                self._fill(model)
        device = next(model.parameters()).device
        if next(self._copy.parameters()).device != device:  # the trainer moved the policy (e.g. to its GPU)
            self._copy.to(device)
        return self._copy

    def keep_copy(self, model: torch.nn.Module) -> None:
        """Generate from a copy of ``model`` (in ``dtype`` when set) that stays between generations and is
        refreshed by ``update_weights`` (FSDP: the copy is taken before the policy is sharded)."""
        self._make_copy(model)
        self._kept = True

    def _make_copy(self, model: torch.nn.Module) -> None:
        import copy

        device = next(model.parameters()).device
        if device.type == "cpu" and self.dtype not in (None, "float32"):
            native, reason = cpu_bf16()
            if not native:
                log.warning("model.rollout.init_args.dtype is %s but the %s: generation will be much slower than in "
                            "float32; set dtype: null on this machine", self.dtype, reason)
        # The parameters go straight into the copy's dtype (deepcopy takes them from the memo): a deepcopy followed
        # by .to(dtype) would first hold a second full float32 policy.
        dtype = DTYPES[self.dtype] if self.dtype is not None else None
        memo = {id(p): torch.nn.Parameter(p.detach().to(dtype, copy=True), requires_grad=p.requires_grad)
                for p in model.parameters()} if dtype is not None else {}
        self._copy = copy.deepcopy(model, memo)
        if dtype is not None:
            self._copy.to(dtype)  # the floating-point buffers (rotary frequencies ...)
            head = self._copy.get_output_embeddings()
            if isinstance(head, Float32Head):  # its own float32 weight (a tied one is the bfloat16 embedding now)
                source = model.get_output_embeddings()
                head.weight = torch.nn.Parameter(full_tensor(source.weight).detach().float().clone())
                if head.bias is not None:
                    head.bias = torch.nn.Parameter(full_tensor(source.bias).detach().float().clone())
        self._copy.eval().requires_grad_(False)
        self._copy_of = id(model)

    def _fill(self, model: torch.nn.Module) -> None:
        """The copy's weights from the policy's (a parameter already in the copy's dtype, e.g. a float32 output
        layer's, is shared, not copied). By name, tied parameters under each of their names: a float32 output
        layer's weight is a parameter of its own in the copy, while the policy's may be its input embedding's."""
        sources = dict(model.named_parameters(remove_duplicate=False))
        for name, target in self._copy.named_parameters():
            target.data = sources[name].detach().to(target.dtype)

    def _release(self) -> None:
        """Free the copy's weights between generations (unless ``keep_copy`` keeps them): the trainer's update,
        where memory peaks (gradients, optimizer state, activations), then runs without them."""
        if self._copy is None or self._kept:
            return
        for p in self._copy.parameters():
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)

    def update_weights(self, model: torch.nn.Module) -> dict[str, float]:
        """Sync the copy ``keep_copy`` keeps; {} otherwise (the policy itself, or a copy filled at each
        generation)."""
        if self._copy is None or self._copy_of != id(model) or not self._kept:
            return {}
        start = time.perf_counter()
        sources = dict(model.named_parameters(remove_duplicate=False))  # by name, as in _fill
        with torch.no_grad():
            for name, target in self._copy.named_parameters():
                target.copy_(full_tensor(sources[name]))  # one parameter at a time: under FSDP a gather of its shards
        return {"rollout/sync_time": time.perf_counter() - start}

    @torch.no_grad()
    def generate(self, model, tokenizer, prompts: list[list[int]], sampling: Sampling) -> Generation:
        start = time.perf_counter()
        try:
            with seeded(sampling.seed, next(model.parameters()).device):
                out = self._generate_all(self._generator(model), tokenizer, prompts, sampling)
        finally:
            self._release()
            return_free_memory()  # the copy's weights and the caches, freed: else resident through the update
        self.last_metrics = {"rollout/tokens_per_s": out.response_mask.sum().item() / (time.perf_counter() - start)}
        return out

    def _generate_all(self, model, tokenizer, prompts: list[list[int]], sampling: Sampling) -> Generation:
        parts = [self._generate(model, tokenizer, prompts[i : i + self.batch_size], sampling)
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

    def _generate(self, model, tokenizer, prompts: list[list[int]], sampling: Sampling) -> Generation:
        device = next(model.parameters()).device
        prompt_ids, prompt_mask = pad_left(prompts, tokenizer.pad_token_id)
        prompt_ids, prompt_mask = prompt_ids.to(device), prompt_mask.to(device)
        eos = eos_token_ids(model, tokenizer)
        was_training = model.training
        model.eval()
        try:
            with contiguous_head_input(model):
                response_ids, logprobs = self._decode(model, prompt_ids, prompt_mask, eos, tokenizer.pad_token_id,
                                                      sampling)
        finally:
            model.train(was_training)
        mask, truncated = response_mask_from_ids(response_ids, eos)
        response_ids = torch.where(mask.bool(), response_ids, torch.full_like(response_ids, tokenizer.pad_token_id))
        logprobs = torch.where(mask.bool(), logprobs, torch.zeros_like(logprobs))
        return Generation(prompt_ids, prompt_mask, response_ids, mask, logprobs, truncated.cpu().to(device))

    def _decode(self, model, prompt_ids: Tensor, prompt_mask: Tensor, eos: list[int], pad_id: int,
                sampling: Sampling) -> tuple[Tensor, Tensor]:
        """Sample up to ``sampling.max_new_tokens`` per row with a KV cache; ``(response_ids, logprobs)``, both (B, T).

        Each step keeps only the sampled token's log-prob under the distribution it was drawn from
        (``sample_next``), so memory does not grow with T x V. Rows with the same prompt share one prompt
        pass. A row that ends leaves the batch (and its cache), so later steps compute only the rows still
        running; its remaining columns hold the pad id. Positions count real tokens only (prompts are
        left-padded), as in ``model.generate``.
        """
        b, device = prompt_ids.shape[0], prompt_ids.device
        eos_ids = torch.tensor(eos, device=device)
        longest = sampling.max_new_tokens
        response_ids = torch.full((b, longest), pad_id, dtype=torch.long, device=device)
        logprobs = torch.zeros((b, longest), device=device)
        # The prompt pass runs once per distinct prompt (a group's G samples share theirs); its cache is then
        # gathered to every row.
        ids, mask, row_prompt = distinct_prompts(prompt_ids, prompt_mask)
        with record_function("rllight.generate.prefill"):
            out = model(input_ids=ids, attention_mask=mask, position_ids=position_ids(mask), use_cache=True,
                        logits_to_keep=1)
        cache = out.past_key_values
        cache.reorder_cache(row_prompt)
        logits = out.logits[row_prompt, -1]
        rows = torch.arange(b, device=device)  # the batch row of each running sequence
        mask = prompt_mask
        positions = position_ids(mask)[:, -1:]
        width = 0
        for step in range(longest):
            if step < self.min_new_tokens:
                logits = logits.index_fill(-1, eos_ids, float("-inf"))
            token, logprob = sample_next(logits.float(), sampling.temperature, sampling.top_k, sampling.top_p,
                                         sampling.greedy)
            response_ids[rows, step], logprobs[rows, step] = token, logprob
            width = step + 1
            running = ~torch.isin(token, eos_ids)
            if not running.any() or width == longest:
                break
            if not running.all():  # the ended rows leave the batch
                keep = running.nonzero().squeeze(1)
                cache.reorder_cache(keep)
                rows, token, mask, positions = rows[keep], token[keep], mask[keep], positions[keep]
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            positions = positions + 1
            with record_function("rllight.generate.token"):
                out = model(input_ids=token[:, None], attention_mask=mask, position_ids=positions,
                            past_key_values=cache, use_cache=True, logits_to_keep=1)
            cache, logits = out.past_key_values, out.logits[:, -1]
        return response_ids[:, :width], logprobs[:, :width]


def sample_next(logits: Tensor, temperature: float, top_k: int, top_p: float, greedy: bool) -> tuple[Tensor, Tensor]:
    """One token per row from ``logits`` (B, V) and its log-prob under the distribution it came from.

    Greedy: the arg-max, with the log-prob of the unscaled logits. Sampling: logits divided by
    ``temperature``, then the ``top_k`` largest kept (0 = all), then the smallest set whose probability
    reaches ``top_p`` (1.0 = all; the most likely token always stays), the order ``model.generate`` applies.
    """
    if greedy:
        token = logits.argmax(-1)
        return token, torch.log_softmax(logits, -1).gather(-1, token[:, None]).squeeze(-1)
    logits = logits / temperature
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1)  # ascending
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        drop_sorted = cumulative <= 1 - top_p
        drop_sorted[:, -1] = False
        logits = logits.masked_fill(drop_sorted.scatter(-1, order, drop_sorted), float("-inf"))
    logp = torch.log_softmax(logits, -1)
    token = torch.multinomial(logp.exp(), 1).squeeze(-1)
    return token, logp.gather(-1, token[:, None]).squeeze(-1)
