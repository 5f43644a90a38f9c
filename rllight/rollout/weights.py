"""The policy's weights as an engine reads them, under the names of its Hugging Face checkpoint, detached: all of
them with LoRA merged (``full_state_dict``), or a LoRA policy's base weights and its adapter apart
(``base_state_dict``, ``adapter_state_dict``, ``lora_config``). A model sharded by FSDP gives its weights gathered one
at a time, as they are read (``GatheredState``). The vLLM engine, the rollout worker and the server engine send
these."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

from rllight.dtensor import full_tensor, is_dtensor
from rllight.errors import RecipeError

__all__ = ["GatheredState", "adapter_state_dict", "base_state_dict", "full_state_dict", "lora_config"]


def full_state_dict(model: torch.nn.Module) -> dict[str, Tensor]:
    """The policy's weights under the names of its Hugging Face checkpoint, detached.

    For a peft LoRA model the adapters are merged into copies of the base weights (``W + B A * scaling`` for
    every active adapter) and the peft prefixes are dropped (``base_model.model.``, ``.base_layer``,
    ``.modules_to_save.<adapter>``); the model itself is not modified.
    """
    try:
        from peft import PeftModel
        from peft.tuners.lora import LoraLayer
    except ImportError:
        PeftModel = None
    if PeftModel is None or not isinstance(model, PeftModel):
        state = model.state_dict()
        if any(is_dtensor(value) for value in state.values()):
            return GatheredState(state)
        return {name: value.detach() for name, value in state.items()}
    if any(is_dtensor(p) for p in model.parameters()):
        raise RecipeError("model.lora: a LoRA policy sharded by FSDP cannot be merged for a vLLM engine or worker yet; "
                          "use model.rollout: rllight.rollout.HFEngine, or train without FSDP")

    base = model.get_base_model()
    deltas: dict[str, Tensor] = {}
    for name, module in base.named_modules():
        if not isinstance(module, LoraLayer) or module.merged or module.disable_adapters:
            continue
        for adapter in module.active_adapters:
            if adapter not in module.lora_A and adapter not in getattr(module, "lora_embedding_A", {}):
                continue
            if module.lora_variant.get(adapter) is not None or module.lora_bias.get(adapter, False):
                raise NotImplementedError(f"VLLMEngine: merging LoRA variants (DoRA, ...) or lora_bias is not "
                                          f"supported (module {name}, adapter {adapter})")
            delta = module.get_delta_weight(adapter).detach()
            key = f"{name}.weight"
            deltas[key] = deltas[key] + delta if key in deltas else delta
    active = model.active_adapter
    weights: dict[str, Tensor] = {}
    for key, value in base.state_dict().items():
        if ".lora_" in key or ".original_module." in key:
            continue
        if ".modules_to_save." in key:
            if f".modules_to_save.{active}." not in key:
                continue
            key = key.replace(f".modules_to_save.{active}.", ".")
        key = key.replace(".base_layer.", ".")
        value = value.detach()
        if key in deltas:
            value = value + deltas[key].to(value.dtype)
        weights[key] = value
    return weights


class GatheredState(Mapping):
    """A sharded model's state dict whose values are gathered one at a time, when read (``full_tensor``, a
    collective: every rank reads the same names in the same order): a sync never holds more than one full
    weight beyond the engine's own copy."""

    def __init__(self, state: dict[str, Tensor]):
        self.state = state

    def __getitem__(self, name: str) -> Tensor:
        return full_tensor(self.state[name]).detach()

    def __iter__(self):
        return iter(self.state)

    def __len__(self) -> int:
        return len(self.state)


def lora_config(model: torch.nn.Module):
    """The ``peft.LoraConfig`` of a peft LoRA policy's active adapter; None for any other model."""
    try:
        from peft import LoraConfig, PeftModel
    except ImportError:
        return None
    if not isinstance(model, PeftModel):
        return None
    config = model.peft_config[model.active_adapter]
    return config if isinstance(config, LoraConfig) else None


def base_state_dict(model: torch.nn.Module) -> Mapping[str, Tensor]:
    """A peft LoRA policy's base weights under the names of its Hugging Face checkpoint, adapters left out
    (not merged), detached; a sharded model's are gathered one at a time when read (``GatheredState``)."""
    if lora_config(model).modules_to_save:  # their trained copies would have to travel with every adapter
        raise RecipeError("model.lora: an adapter with modules_to_save cannot be synced to vLLM on its own; set "
                          "lora_sync: merged on the VLLMEngine")
    state = {key.replace(".base_layer.", "."): value for key, value in model.get_base_model().state_dict().items()
             if ".lora_" not in key}
    if any(is_dtensor(value) for value in state.values()):
        return GatheredState(state)
    return {name: value.detach() for name, value in state.items()}


def adapter_state_dict(model: torch.nn.Module) -> dict[str, Tensor]:
    """The active LoRA adapter's tensors, under the names of a peft adapter checkpoint
    (``base_model.model.<module>.lora_A.weight``), detached. A sharded model's adapter tensors are gathered
    (a collective: every rank calls it); they are all that is gathered, a few MB where the merged weights are
    the whole model."""
    from peft import get_peft_model_state_dict

    adapter = model.active_adapter
    state = {name: full_tensor(value).detach() for name, value in model.state_dict().items()
             if ".lora_" in name and f".{adapter}" in name}
    return get_peft_model_state_dict(model, state_dict=state, adapter_name=adapter, save_embedding_layers=False)
