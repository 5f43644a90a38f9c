"""What a checkpoint holds besides the weights and the optimizer (every random stream, and the run's own
counters, so that a resumed run continues exactly where the checkpoint was taken), and how it is written."""

from __future__ import annotations

import contextlib
import os
import random

import numpy as np
import torch
from lightning.pytorch.plugins.io import TorchCheckpointIO

REFERENCE_PREFIX = "ref_policy."
"""State-dict keys of the frozen reference policy: reloaded from its source, never saved."""


def rng_state() -> dict:
    """Every random stream a step draws from, as tensors and ints (loadable with weights_only)."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": (kind, torch.from_numpy(keys.astype("int64")), pos, has_gauss, cached),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    """Restore what ``rng_state`` saved."""
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype("uint32"), pos, has_gauss, cached))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_run_state(checkpoint: dict, module) -> None:
    """Add the random streams (``rng``) and the run's counters (``rllight``) of an ``RLModule`` to a Lightning
    checkpoint: the cursor of extra training prompts, the count of skipped updates in a row, the last batch
    generated ahead, the rollout engine's and the rollout producer's own state. With several processes each rank
    has its own streams and counters: all of them go into ``ranks`` (a collective: every rank saves)."""
    checkpoint["rng"] = rng_state()
    checkpoint["rllight"] = {
        "extra_prompt_cursor": module.prompt_stream.cursor if module.prompt_stream is not None else 0,
        "consecutive_skips": module.updater.consecutive_skips,
        "prefetched_through": module.prefetched_through,
        "rollout_engine": module.rollout.state_dict(),
        **module.producer.state_dict(),
    }
    world = module.ranks.world_size
    if world > 1 and torch.distributed.is_initialized():
        ranks: list = [None] * world
        torch.distributed.all_gather_object(ranks, {"rng": checkpoint["rng"], "rllight": checkpoint["rllight"]})
        checkpoint["ranks"] = ranks


def load_run_state(checkpoint: dict, module) -> None:
    """Restore what ``save_run_state`` added (a checkpoint without it leaves the fresh state); each rank takes its
    own part when the checkpoint has one per rank of this run."""
    ranks = checkpoint.get("ranks")
    if ranks and len(ranks) == module.ranks.world_size:
        checkpoint = ranks[module.ranks.rank]
    if "rng" in checkpoint:
        set_rng_state(checkpoint["rng"])
    state = checkpoint.get("rllight", {})
    module.extra_prompt_cursor = state.get("extra_prompt_cursor", 0)  # applied when the stream is built (setup)
    if module.prompt_stream is not None:
        module.prompt_stream.cursor = module.extra_prompt_cursor
    module.updater.consecutive_skips = state.get("consecutive_skips", 0)
    module.prefetched_through = state.get("prefetched_through", -1)
    module.rollout.load_state_dict(state.get("rollout_engine", {}))
    module.producer.load_state_dict(state)


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning's checkpoint writer, made atomic on a local filesystem: the checkpoint is written to a temporary
    file beside its target and renamed over it only once complete, so a failed write (a full disk, a kill) never
    leaves a truncated file under the final name, and the previous checkpoint of that name stays loadable.
    Remote paths (``s3://...``) are written as Lightning writes them."""

    def save_checkpoint(self, checkpoint: dict, path, storage_options=None) -> None:
        path = str(path)
        if "://" in path:
            return super().save_checkpoint(checkpoint, path, storage_options)
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        tmp = f"{path}.tmp{os.getpid()}"
        try:
            torch.save(checkpoint, tmp)
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.remove(tmp)
            raise
