"""What a checkpoint holds besides the weights and the optimizer (every random stream, and the run's own
counters, so that a resumed run continues exactly where the checkpoint was taken), how it is written, and how many
a run keeps (``CheckpointSettings``)."""

from __future__ import annotations

import contextlib
import os
import random

import numpy as np
import torch
from lightning.pytorch.plugins.io import TorchCheckpointIO

from rllight.errors import RecipeError

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
    if module.ranks.world_size > 1 and torch.distributed.is_initialized():
        checkpoint["ranks"] = module.ranks.gather_objects({"rng": checkpoint["rng"], "rllight": checkpoint["rllight"]})


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
        except BaseException as err:
            with contextlib.suppress(FileNotFoundError):
                os.remove(tmp)
            if isinstance(err, Exception):  # a full disk is an OSError, or torch's zip writer's RuntimeError
                raise DiskWriteError(f"could not write the checkpoint {path} ({err}; {free_space(path)})") from err
            raise


class DiskWriteError(OSError):
    """A save (a checkpoint, an export) failed to write: a full or failing disk, whatever the writer raised (torch's
    zip writer raises ``RuntimeError``). Its partial files are removed and the message names the disk's free space;
    as an ``OSError`` it is caught where a failed save must not end the run."""


def free_space(path: str) -> str:
    """``1.2 GB free on the disk of /runs``: the free space where ``path`` is, or would be, written."""
    import shutil

    from rllight.paths import existing_ancestor

    folder = existing_ancestor(os.path.dirname(os.path.abspath(path)))
    try:
        return f"{human_size(shutil.disk_usage(folder).free)} free on the disk of {folder}"
    except OSError:
        return f"the free space on the disk of {folder} is unknown"


class CheckpointSettings:
    """The checkpoints a run keeps (``checkpoint:`` at the top level of a recipe, or ``--checkpoint.keep 3``),
    written by the checkpoint callback rllight adds to every ``fit`` unless the recipe configures a
    ``ModelCheckpoint`` of its own or sets ``trainer.enable_checkpointing: false``. A checkpoint holds the weights
    and the optimizer's state: with AdamW in float32, 12 bytes per trained parameter (1.6 GB for a 135M model),
    of which the weights are 4. The first one saved says its folder and size.

    Args:
        every_n_steps: RL steps (rollouts) between checkpoints, however many optimizer updates each makes; the
            run's last step is saved too.
        keep: How many to keep. 1: ``last.ckpt`` alone, replaced at each save. N > 1: the newest N as
            ``step=K.ckpt``, and ``last.ckpt`` a link to the newest (no extra space).
        final_weights_only: The checkpoint of the run's last step holds the weights without the optimizer's state
            (a third of the size with AdamW): ``rllight validate --ckpt_path`` evaluates it; it cannot be resumed.
    """

    def __init__(self, every_n_steps: int = 10, keep: int = 1, final_weights_only: bool = False):
        for name, value in (("every_n_steps", every_n_steps), ("keep", keep)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise RecipeError(f"checkpoint.{name} must be an integer >= 1, got {value!r}")
        self.every_n_steps, self.keep, self.final_weights_only = every_n_steps, keep, bool(final_weights_only)

    def is_default(self) -> bool:
        return vars(self) == vars(CheckpointSettings())


def disk_size(path: str) -> int:
    """Bytes that ``path`` takes: a file's size (through a link), or the sum over a folder (a sharded
    checkpoint); 0 when there is nothing."""
    if os.path.isdir(path):
        return sum(os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(path) for f in files)
    return os.path.getsize(path) if os.path.exists(path) else 0


def human_size(size: float) -> str:
    """``1.62 GB``, ``540 MB``, ``12.3 kB`` (powers of 1000, as disks are sold)."""
    for unit in ("B", "kB", "MB"):
        if size < 999.5:
            return f"{size:.3g} {unit}"
        size /= 1000
    return f"{size:.3g} GB"
