"""``VLLMEngine``: vLLM in the training process, started from the policy at the first ``generate``, sampling with
the ``Sampling`` each call passes, and given the policy's weights after optimizer updates (the full state dict, or a
LoRA policy's adapter alone). How it runs: ``rllight.rollout.vllm``."""

from __future__ import annotations

import glob
import importlib.util
import os
import shutil
import tempfile
import time
import weakref
from collections.abc import Mapping

import torch
from torch import Tensor

from rllight.bounds import NonNegativeInt, PositiveFloat, PositiveInt, UpToOne, bounded
from rllight.errors import RecipeError
from rllight.rollout.base import Generation, RolloutEngine, Sampling
from rllight.rollout.hf import eos_token_ids
from rllight.rollout.samples import generation_from_samples
from rllight.rollout.vllm.host import INSTALL_HINT, import_vllm, keep_process_state, quiet_vllm_noise
from rllight.rollout.vllm.transfer import (
    in_dtype,
    lora_engine_args,
    save_adapter,
    save_base,
    save_policy,
    torch_dtype,
)
from rllight.rollout.weights import base_state_dict, full_state_dict, lora_config

__all__ = ["LORA_SYNCS", "VLLMEngine"]

LORA_SYNCS = ("adapter", "merged")


def _engine_dtype(llm) -> torch.dtype | None:
    """The dtype of every parameter of the engine's model; None where they differ (a float32 router bias beside
    bfloat16 weights, quantised weights with their scales), where only vLLM knows which weight goes where."""
    dtypes = set().union(*llm.apply_model(_parameter_dtypes))
    return dtypes.pop() if len(dtypes) == 1 else None


def _parameter_dtypes(model: torch.nn.Module) -> set[torch.dtype]:
    return {p.dtype for p in model.parameters()}


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

    @bounded
    def __init__(
        self,
        max_new_tokens: PositiveInt = 64,
        temperature: PositiveFloat = 1.0,
        top_p: UpToOne = 1.0,
        top_k: NonNegativeInt = 0,
        gpu_memory_utilization: UpToOne = 0.3,
        kv_cache_gb: float | None = None,
        sync_every: PositiveInt = 1,
        dtype: str = "auto",
        enforce_eager: bool = False,
        max_model_len: int | None = None,
        seed: int | None = None,
        lora_sync: str = "adapter",
        tensor_parallel_size: PositiveInt = 1,
    ):
        super().__init__(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k)
        if lora_sync not in LORA_SYNCS:
            raise RecipeError(
                f"model.rollout.init_args.lora_sync must be one of {', '.join(LORA_SYNCS)}, got {lora_sync!r}")
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
        kwargs = self._write_start_folder(model, tokenizer, torch_dtype(dtype))
        if self.kv_cache_gb is not None:
            kwargs["kv_cache_memory_bytes"] = int(self.kv_cache_gb * 2**30)
        if self.tensor_parallel_size > 1:  # the group's processes and port: set by its rollout worker
            kwargs.update(tensor_parallel_size=self.tensor_parallel_size,
                          distributed_executor_backend="external_launcher")
        quiet_vllm_noise()  # before the start, whose own messages it reads too
        with keep_process_state():
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
        if self._sync_dtype is None and torch_dtype(dtype) not in (None, next(model.parameters()).dtype):
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

        common = {"max_tokens": sampling.max_new_tokens, "logprobs": 0, "detokenize": False,
                  "stop_token_ids": eos_token_ids(model, tokenizer)}
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
        its parameters have one (``in_dtype``: the bits vLLM's own cast would give)."""
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": in_dtype(weights, self._sync_dtype)})

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
            save_policy(model, tokenizer, self._dir, dtype)
            return {}
        engine_args = lora_engine_args(config)
        save_base(model, tokenizer, self._dir, dtype)
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
        except Exception as err:
            raise RecipeError(f"model.rollout.init_args.lora_sync: vLLM cannot load the policy's LoRA adapter "
                              f"({' '.join(str(err).split())}); set lora_sync: merged") from err
        if previous is not None:
            self.llm.llm_engine.remove_lora(previous.lora_int_id)
        self._lora = new
        return size
