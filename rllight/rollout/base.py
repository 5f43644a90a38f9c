"""The interface every rollout engine implements."""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from rllight.bounds import NonNegativeInt, PositiveFloat, PositiveInt, UpToOne, bounded
from rllight.errors import RecipeError


@dataclass
class Generation:
    """What an engine returns for a list of prompts (one row per prompt it was given)."""

    prompt_ids: Tensor
    """Shape (B, P), left-padded."""
    prompt_mask: Tensor
    """Shape (B, P)."""
    response_ids: Tensor
    """Shape (B, T), right-padded with the pad id; the end token is kept."""
    response_mask: Tensor
    """Shape (B, T): 1 up to and including the end token."""
    logprobs: Tensor
    """Shape (B, T): log-probs of the sampled tokens under the sampling distribution (0 on padding)."""
    truncated: Tensor
    """Shape (B,), bool: the response reached ``max_new_tokens`` without an end token."""


LOGPROB_SLACK = 1e-4
"""How far above 0 a sampled token's log-prob may round (float32 log-softmax) before it counts as malformed."""


def malformed(gen: Generation, rows: int, max_new_tokens: int | None) -> str | None:
    """Why an engine's ``gen`` for ``rows`` prompts cannot be trained on, or None: one row per prompt, a log-prob
    per response position, finite and at most 0 on the response's tokens, and no response longer than
    ``max_new_tokens``. What a faulty server or a broken engine returns is caught here, before the loss sees it
    (a NaN log-prob would mask every token under ``MaskedIS``, and the run would train on nothing)."""
    ids, mask, logprobs = gen.response_ids, gen.response_mask, gen.logprobs
    if ids.dim() != 2 or ids.shape[0] != rows or mask.shape != ids.shape:
        return f"{rows} responses expected, got response ids of shape {tuple(ids.shape)}, mask {tuple(mask.shape)}"
    if gen.prompt_ids.shape[0] != rows:
        return f"{rows} prompts expected, got prompt ids of shape {tuple(gen.prompt_ids.shape)}"
    if not torch.is_tensor(logprobs) or not logprobs.is_floating_point():
        return f"one log-prob per response token expected (shape {tuple(ids.shape)}), got {type(logprobs).__name__}"
    lengths = mask.sum(-1)
    if logprobs.shape == ids.shape and max_new_tokens is not None and rows and int(lengths.max()) > max_new_tokens:
        return f"a response of {int(lengths.max())} tokens, over max_new_tokens={max_new_tokens}"
    return logprob_fault(logprobs, mask.bool())


def logprob_fault(logprobs: Tensor, on: Tensor, above: str = "positive log-probs") -> str | None:
    """Why ``logprobs`` cannot be trained on, or None: one per position of ``on`` (the same shape), and at the
    positions ``on`` marks (the response mask: padding is never read) each finite and at most 0, ``LOGPROB_SLACK``
    above it allowed for float32 rounding. A NaN would make every later loss NaN, and a log-prob above 0 is a model
    surer than certain. The one check of the engine's sampled log-probs (``malformed``) and of a distillation
    teacher's (``rllight.callbacks.distillation.unusable_logprobs``); ``above`` names the last fault in the
    caller's words.

    Shapes: logprobs and on alike, e.g. (B, T) or (n,); ``on`` bool.
    """
    if logprobs.shape != on.shape:
        if on.dim() == 1:
            return f"{logprobs.numel()} log-probs for {on.numel()} response tokens"
        return f"one log-prob per response token expected (shape {tuple(on.shape)}), got {tuple(logprobs.shape)}"
    values = logprobs[on]
    if not torch.isfinite(values).all():
        return f"{int((~torch.isfinite(values)).sum())} log-probs that are not finite (NaN or infinite)"
    if values.numel() and float(values.max()) > LOGPROB_SLACK:
        return f"{above} (largest {float(values.max()):.3g}): a log-probability is at most 0"
    return None


SAMPLING_SETTINGS = ("max_new_tokens", "temperature", "top_p", "top_k")
"""The engine settings (recipe keys under ``model.rollout.init_args``) that make its ``sampling``."""


@dataclass(frozen=True)
class Sampling:
    """How one ``generate`` call samples, passed with it as vLLM passes ``SamplingParams``: training passes the
    engine's own (``RolloutEngine.sampling``, its recipe settings), evaluation its own, and the engine's settings
    never change for a call. ``temperature`` 0 decodes greedily (the arg-max; top-p and top-k do not apply);
    ``seed`` None draws from the engine's random stream, an int from a stream of that seed for this call alone
    (the engine's stream is left as it was)."""

    max_new_tokens: int
    temperature: float
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def as_greedy(self) -> Sampling:
        """The same with temperature 0: the arg-max."""
        return replace(self, temperature=0.0)

    def key(self) -> tuple:
        """What tells two requests' sampling apart (``request_key``)."""
        settings = (self.max_new_tokens, self.temperature, self.top_p, self.top_k)
        return settings if self.seed is None else (*settings, self.seed)


def request_key(prompts: list[list[int]], sampling: Sampling) -> tuple:
    """What identifies a generation request sent ahead (asynchronous rollouts): the prompts and the sampling; a
    later ``generate`` collects it only when both are equal. (The form of the keys in checkpoints, which hold the
    requests sent ahead: prompts, greedy or not, then the sampling settings.)"""
    return (tuple(tuple(p) for p in prompts), sampling.greedy, sampling.key())


@contextmanager
def seeded(seed: int | None, device: torch.device) -> Iterator[None]:
    """Within the block torch draws from a stream of ``seed`` (``Sampling.seed``), and the stream it had is back
    after; with None nothing changes."""
    if seed is None:
        yield
        return
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        yield


class RolloutEngine:
    """Generates responses with the current policy.

    Args:
        max_new_tokens: Longest response, in tokens.
        temperature: Sampling temperature; the trainer divides its logits by the same value so that its
            log-probs and the engine's describe the same distribution (validation already decodes greedily).
        top_p: Nucleus sampling threshold (1.0 = off).
        top_k: Keep the k most likely tokens (0 = off).
    """

    syncs_merged_weights = False
    """The engine holds weights of its own, filled from the policy's full state dict with LoRA adapters merged
    (``rllight.rollout.weights.full_state_dict``), rather than generating with the policy or a copy of it."""

    @bounded
    def __init__(self, max_new_tokens: PositiveInt = 64, temperature: PositiveFloat = 1.0, top_p: UpToOne = 1.0,
                 top_k: NonNegativeInt = 0):
        self.max_new_tokens = max_new_tokens
        self.temperature = temperature
        self.top_p = top_p
        self.top_k = top_k
        self.last_metrics: dict[str, float] = {}
        """Metrics of the last ``generate`` call (e.g. ``rollout/tokens_per_s``), logged by the module."""

    @property
    def sampling(self) -> Sampling:
        """The engine's own sampling (its recipe settings), which training passes to ``generate``."""
        return Sampling(self.max_new_tokens, self.temperature, self.top_p, self.top_k)

    def generate(self, model: torch.nn.Module, tokenizer, prompts: list[list[int]], sampling: Sampling) -> Generation:
        """One response per prompt (token id lists), sampled as ``sampling`` says (temperature 0: greedily)."""
        raise NotImplementedError

    def check_processes(self, world_size: int) -> None:
        """Refuse with one line, before the model loads, a number of training processes this engine cannot
        serve (each process has an engine of its own). Every number by default."""

    def update_weights(self, model: torch.nn.Module) -> dict[str, float]:
        """Called by the module after every optimizer update with the trained policy. Engines that hold
        their own copy of the weights (vLLM) sync here; returns metrics (e.g. ``rollout/sync_time``).
        Engines that generate with ``model`` itself need nothing."""
        return {}

    def keep_copy(self, model: torch.nn.Module) -> None:
        """Called under FSDP with the policy before it is sharded. An engine that generates with ``model``
        itself must keep a full copy of it here (and refresh it in ``update_weights``); engines that hold
        weights of their own need nothing."""

    def prefetch(self, model: torch.nn.Module, tokenizer, prompts: list[list[int]], sampling: Sampling) -> None:
        """Start generating for ``prompts`` now, with the current weights, to be collected by a later
        ``generate`` call with the same prompts and sampling (an engine that generates in another process overlaps
        it with training). Engines that generate in the training process do nothing here."""

    def state_dict(self) -> dict:
        """What a checkpoint must hold to resume the engine exactly (e.g. rollouts generated ahead)."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Restore ``state_dict()``."""


def outer_or_inner_sampling(inner: RolloutEngine, given: dict, key: str) -> dict:
    """The sampling settings of an engine that runs ``inner`` (``ProcessEngine``), from those ``given`` to it (None:
    not given) and the inner engine's own: for each, the one that differs from every engine's default (64 tokens,
    temperature 1.0, top_p 1.0, top_k 0), since a default cannot be told from a value left out. Two values that both
    differ from the default and from each other are refused in one line naming ``key`` (the outer engine's
    ``init_args``)."""
    defaults = inspect.signature(RolloutEngine).parameters
    settings = {}
    for name, value in given.items():
        own, default = getattr(inner, name), defaults[name].default
        if value is not None and value != own and default not in (value, own):
            raise RecipeError(f"{key}.{name}={value} and {key}.engine.init_args.{name}={own} disagree (the first is "
                              "usually the recipe's, kept when an overlay switched the engine to ProcessEngine); give "
                              "it in one place, or the same value in both")
        settings[name] = own if value is None or value == default else value
    return settings


def pad_left(sequences: list[list[int]], pad_id: int) -> tuple[Tensor, Tensor]:
    """Token id lists as a left-padded (B, P) tensor and its mask."""
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for i, s in enumerate(sequences):
        if s:
            ids[i, width - len(s) :] = torch.tensor(s, dtype=torch.long)
            mask[i, width - len(s) :] = 1
    return ids, mask


def position_ids(mask: Tensor) -> Tensor:
    """Position ids of left-padded rows: real tokens count from 0, padding gets 0 (as generation uses them)."""
    return (mask.cumsum(-1) - 1).clamp(min=0)


def distinct_prompts(prompt_ids: Tensor, prompt_mask: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The distinct rows of left-padded prompts (ids and mask compared together) as ``(ids, mask, row_of)``,
    ``row_of[i]`` the distinct prompt of row i: rows with the same prompt (a group's responses) can share one
    pass over it."""
    rows = torch.cat([prompt_ids, prompt_mask.to(prompt_ids.dtype)], dim=1)
    distinct, row_of = torch.unique(rows, dim=0, return_inverse=True)
    width = prompt_ids.shape[1]
    return distinct[:, :width], distinct[:, width:], row_of


def response_mask_from_ids(response_ids: Tensor, eos_ids: list[int]) -> tuple[Tensor, Tensor]:
    """Mask up to and including the first end token of each row, and whether a row never ended.

    Args:
        response_ids: Shape (B, T).

    Returns:
        ``(mask (B, T) long, truncated (B,) bool)``.
    """
    is_eos = torch.isin(response_ids, torch.tensor(eos_ids, device=response_ids.device))
    # Tokens strictly after the first end token have a positive count of earlier end tokens.
    before = torch.cumsum(is_eos.long(), dim=1) - is_eos.long()
    mask = (before == 0).long()
    truncated = ~is_eos.any(dim=1)
    return mask, truncated
