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

from rllight.bounds import PositiveInt, bounded
from rllight.errors import RecipeError

REFERENCE_PREFIX = "ref_policy."
"""State-dict keys of the frozen reference policy: reloaded from its source, never saved."""


def without_reference(state: dict) -> dict:
    """A module's state dict without the reference policy's weights (``REFERENCE_PREFIX``)."""
    return {k: v for k, v in state.items() if not k.startswith(REFERENCE_PREFIX)}


def with_reference(state: dict, reference: torch.nn.Module | None) -> dict:
    """``state`` with the weights of the reference policy as it is now, which a checkpoint does not hold, so that a
    strict load passes (``reference`` None: ``state`` unchanged)."""
    if reference is None:
        return state
    return {**state, **{f"{REFERENCE_PREFIX}{k}": v for k, v in reference.state_dict().items()}}


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


RUN_STATE_FORMAT = 2
"""The layout of ``checkpoint["rllight"]``: ``{"format": 2, "parts": {name: state}}``, each part's own
``state_dict()`` under the name its owner gives it (``RLModule.on_save_checkpoint``). Format 1, written before the
parts kept their own state, is one flat dict of counters (no ``format`` key): ``FLAT_RUN_STATE`` reads it."""

FLAT_RUN_STATE = {"extra_prompt_cursor": ("prompt_stream", "cursor"),
                  "consecutive_skips": ("updater", "consecutive_skips"),
                  "prefetched_through": ("prefetched_through", None), "rollout_engine": ("rollout_engine", None)}
"""Format 1: a flat key -> the part (and the key in its state; None = the value is the part's state) it is now.
The other flat keys were the rollout producer's counters (``producer``)."""


def save_run_state(checkpoint: dict, parts: dict, ranks) -> None:
    """Add the random streams (``rng``) and a run's own state (``rllight``: ``parts``, its parts' states by name, in
    the layout ``RUN_STATE_FORMAT``) to a Lightning checkpoint. With several processes each rank has its own
    streams and parts: all of them go into ``ranks`` (``rllight.distributed.Ranks``; a collective: every rank
    saves)."""
    checkpoint["rng"] = rng_state()
    checkpoint["rllight"] = {"format": RUN_STATE_FORMAT, "parts": parts}
    if ranks.world_size > 1 and torch.distributed.is_initialized():
        checkpoint["ranks"] = ranks.gather_objects({"rng": checkpoint["rng"], "rllight": checkpoint["rllight"]})


def load_run_state(checkpoint: dict, ranks) -> dict:
    """Restore the random streams that ``save_run_state`` saved and return the parts' states by name (``{}`` for
    a checkpoint without them: the parts stay fresh); each rank takes its own when the checkpoint has one per rank
    of this run. A checkpoint of format 1 is read as the parts it held; one of a newer format is refused."""
    per_rank = checkpoint.get("ranks")
    if per_rank and len(per_rank) == ranks.world_size:
        checkpoint = per_rank[ranks.rank]
    if "rng" in checkpoint:
        set_rng_state(checkpoint["rng"])
    saved = checkpoint.get("rllight", {})
    if "format" not in saved:
        return parts_of_flat_state(saved)
    if saved["format"] > RUN_STATE_FORMAT:
        raise RecipeError(f"--ckpt_path: the checkpoint's run state has format {saved['format']}, newer than this "
                          f"rllight reads ({RUN_STATE_FORMAT}); resume it with the rllight version that wrote it")
    return saved["parts"]


def parts_of_flat_state(flat: dict) -> dict:
    """The parts' states held by a run state of format 1 (``FLAT_RUN_STATE``); ``{}`` for none."""
    if not flat:
        return {}
    parts: dict = {"producer": {k: v for k, v in flat.items() if k not in FLAT_RUN_STATE}}
    for key, (part, inner) in FLAT_RUN_STATE.items():
        if key in flat:
            parts[part] = flat[key] if inner is None else {**parts.get(part, {}), inner: flat[key]}
    return parts


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

    @bounded
    def __init__(self, every_n_steps: PositiveInt = 10, keep: PositiveInt = 1, final_weights_only: bool = False):
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
