"""How the policy's weights reach a vLLM engine: cast to the engine's dtype as it reads them (``in_dtype``,
``state_in_dtype``), the Hugging Face folder it starts from (``save_policy``, or ``save_base`` for a LoRA policy
served with vLLM's LoRA support, ``lora_engine_args``), and the peft adapter folder each LoRA sync writes
(``save_adapter``). The weights themselves come from ``rllight.rollout.weights``."""

from __future__ import annotations

import os
from collections.abc import Mapping

import torch
from torch import Tensor

from rllight.errors import RecipeError
from rllight.rollout.weights import adapter_state_dict, base_state_dict, full_state_dict, lora_config

__all__ = ["in_dtype", "lora_engine_args", "save_adapter", "save_base", "save_policy", "state_in_dtype",
           "torch_dtype"]


def torch_dtype(name: str) -> torch.dtype | None:
    """The torch dtype a vLLM ``dtype`` setting names (``bfloat16``, ``float16``, ``half``, ``float32``, ``float``);
    None for any other (``auto``)."""
    value = getattr(torch, name, None)
    return value if isinstance(value, torch.dtype) else None


def _cast(value: Tensor, dtype: torch.dtype | None) -> Tensor:
    return value.to(dtype) if dtype is not None and value.is_floating_point() and value.dtype != dtype else value


def in_dtype(weights: Mapping[str, Tensor], dtype: torch.dtype | None):
    """``weights``' items with each floating-point tensor cast to ``dtype`` (None: as they are) as the engine reads
    it, one at a time. vLLM's loaders copy a weight into its parameter (``param.copy_``), a cast with the same
    rounding (to nearest even), so the engine gets the same bits (``tests/rollout/test_vllm.py``), without vLLM's warning
    for every weight of another dtype."""
    return ((name, _cast(value, dtype)) for name, value in weights.items())


def state_in_dtype(state: Mapping[str, Tensor], dtype: torch.dtype | None) -> dict[str, Tensor]:
    """``state`` with its floating-point tensors cast to ``dtype`` (None: as they are); a tensor under two names
    (tied embeddings) stays one tensor, which ``save_pretrained`` writes once."""
    cast: dict[tuple, Tensor] = {}
    out = {}
    for name, value in state.items():
        key = (value.data_ptr(), value.dtype, value.shape, value.stride())
        out[name] = cast[key] if key in cast else cast.setdefault(key, _cast(value, dtype))
    return out


def save_policy(model: torch.nn.Module, tokenizer, path: str, dtype: torch.dtype | None = None) -> None:
    """The policy (LoRA merged) and tokenizer as a Hugging Face folder that vLLM can load, its weights in ``dtype``
    (None: the policy's)."""
    try:
        from peft import PeftModel
    except ImportError:
        PeftModel = None
    if PeftModel is not None and isinstance(model, PeftModel):
        model.get_base_model().save_pretrained(path, state_dict=state_in_dtype(full_state_dict(model), dtype))
    elif dtype in (None, next(model.parameters()).dtype):
        model.save_pretrained(path)
    else:
        model.save_pretrained(path, state_dict=state_in_dtype(full_state_dict(model), dtype))
    tokenizer.save_pretrained(path)


def save_base(model: torch.nn.Module, tokenizer, path: str, dtype: torch.dtype | None = None) -> None:
    """A peft LoRA policy's base weights (adapters left out, in ``dtype``; None: the policy's) and tokenizer as a
    Hugging Face folder."""
    model.get_base_model().save_pretrained(path, state_dict=state_in_dtype(base_state_dict(model), dtype))
    tokenizer.save_pretrained(path)


_VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vllm.config.lora.MaxLoRARanks (0.32)


def lora_engine_args(config) -> dict:
    """``vllm.LLM`` arguments that serve one LoRA adapter of ``config``'s rank on the base weights."""
    unsupported = [name for name, value in (("modules_to_save", config.modules_to_save), ("use_dora", config.use_dora),
                                            ("lora_bias", getattr(config, "lora_bias", False))) if value]
    if unsupported:  # what vLLM's LoRA refuses, said before it starts
        raise RecipeError(f"model.rollout.init_args.lora_sync: vLLM's LoRA cannot serve an adapter with "
                          f"{', '.join(unsupported)}; set lora_sync: merged")
    rank = max([config.r, *config.rank_pattern.values()])
    max_lora_rank = next((r for r in _VLLM_LORA_RANKS if r >= rank), rank)  # past 512: vLLM says it is too large
    return {"enable_lora": True, "max_lora_rank": max_lora_rank, "max_loras": 1}


def save_adapter(model: torch.nn.Module, path: str) -> int:
    """Write the active LoRA adapter as a peft adapter folder (``adapter_config.json``,
    ``adapter_model.safetensors``), which vLLM loads; returns the tensors' size in bytes."""
    from safetensors.torch import save_file

    tensors = {name: value.contiguous() for name, value in adapter_state_dict(model).items()}
    os.makedirs(path, exist_ok=True)
    lora_config(model).save_pretrained(path)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    return sum(value.numel() * value.element_size() for value in tensors.values())
