"""The rollout worker's process: what it is sent (``WorkerSpec``, the weights in ``SharedWeights``), the loop it
runs (``serve``: build the policy, then answer sync and generate requests one at a time), and the trainer's handle
on it (``RolloutWorker``). ``ProcessEngine`` (``rllight.rollout.worker``) decides what to send and when."""

from __future__ import annotations

import dataclasses
import functools
import multiprocessing
import os
from typing import Any

import torch
from torch import Tensor

from rllight.errors import ComponentError, one_line
from rllight.rollout.base import Generation, RolloutEngine
from rllight.rollout.weights import GatheredState, lora_config
from rllight.supervised import ChildDied, SupervisedProcess, become_child


def describe(err: BaseException) -> str:
    text = one_line(err)
    if "create shm in SHMManager failed. errno: 17" in text:
        text += (f" (a vLLM segment of this group's name is left in {SHM} by an earlier run: ls {SHM}/*cpushm*; "
                 "remove it if no other run on this machine uses it)")
    return text


class SharedWeights:
    """A state dict in shared memory: one flat CPU buffer per dtype, written in place at every sync.

    Pickled through a ``torch.multiprocessing`` pipe, the buffers travel as handles to the same memory: the
    worker reads what the trainer last wrote.
    """

    def __init__(self, weights: dict[str, Tensor]):
        sizes: dict[torch.dtype, int] = {}
        self.layout: dict[str, tuple[torch.dtype, int, torch.Size]] = {}
        """Where each tensor lives: ``name -> (dtype, offset in that dtype's buffer, shape)``."""
        # A sharded model's weights: their full shapes (a DTensor's shape is the full one), read without a gather.
        shapes = weights.state if isinstance(weights, GatheredState) else weights
        for name, value in shapes.items():
            offset = sizes.get(value.dtype, 0)
            self.layout[name] = (value.dtype, offset, value.shape)
            sizes[value.dtype] = offset + value.numel()
        self.buffers = {dtype: torch.empty(size, dtype=dtype).share_memory_() for dtype, size in sizes.items()}
        self.write(weights)

    def tensor(self, name: str) -> Tensor:
        """A view of one weight in its buffer."""
        dtype, offset, shape = self.layout[name]
        return self.buffers[dtype][offset : offset + shape.numel()].view(shape)

    def tensors(self) -> dict[str, Tensor]:
        """Every weight, as views of the buffers (a state dict to load)."""
        return {name: self.tensor(name) for name in self.layout}

    @torch.no_grad()
    def write(self, weights: dict[str, Tensor]) -> None:
        """Overwrite the buffers with ``weights`` (the same names and shapes as at construction)."""
        for name, value in weights.items():
            self.tensor(name).copy_(value)


@dataclasses.dataclass
class WorkerSpec:
    """What a worker needs to build its copy of the policy and serve requests."""

    engine: RolloutEngine
    model_class: type
    config: Any
    generation_config: Any
    dtype: torch.dtype
    device: str
    tokenizer: Any
    threads: int
    weights: SharedWeights
    version: int
    rng: Any = None
    """Asynchronous mode: the worker's own RNG, a seed (a new stream) or the states a previous worker left."""
    lora: Any = None
    """LoRA adapters only: the adapter's ``peft.LoraConfig``; ``weights`` then holds the adapter tensors."""
    base: SharedWeights | None = None
    """LoRA adapters only: the base weights, written once."""
    env: dict[str, str] | None = None
    """Set in the worker's environment before anything else: a tensor-parallel engine's place in its group."""


def policy_description(model: torch.nn.Module, tokenizer, adapter_only: bool) -> dict[str, Any]:
    """What builds the worker's copy of ``model``, less the weights: the ``WorkerSpec`` fields ``model_class``,
    ``config``, ``generation_config``, ``dtype``, ``device``, ``tokenizer`` and ``lora`` (the adapter's config when
    ``adapter_only`` and the policy is a peft LoRA model: the worker then rebuilds the peft model on base weights;
    else None)."""
    try:
        from peft import PeftModel
    except ImportError:
        PeftModel = None
    base = model.get_base_model() if PeftModel is not None and isinstance(model, PeftModel) else model
    first = next(model.parameters())
    return {"model_class": type(base), "config": base.config, "generation_config": base.generation_config,
            "dtype": first.dtype, "device": str(first.device), "tokenizer": tokenizer,
            "lora": lora_config(model) if adapter_only else None}


# --------------------------------------------------------------------------------------------- worker side
def rng_states(device: torch.device) -> dict[str, Tensor]:
    """The torch RNG states that sampling on ``device`` draws from."""
    states = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        states["cuda"] = torch.cuda.get_rng_state(device)
    return states


def set_rng_states(states: dict[str, Tensor], device: torch.device) -> None:
    torch.set_rng_state(states["cpu"])
    if "cuda" in states:
        torch.cuda.set_rng_state(states["cuda"], device)


SHM = "/dev/shm"
VLLM_CPU_SHM = "-cpushm_"
"""What vLLM's CPU tensor-parallel groups name their shared-memory segments: ``<ident>-tp:<n>-[<ranks>]-cpushm_<rank>``,
the same name in every run of a group of the same ranks. vLLM leaves them in /dev/shm when its process ends, and the
next group of those ranks on the machine then fails to start (``create shm in SHMManager failed. errno: 17``)."""


def vllm_shm_segments() -> set[str]:
    """The vLLM CPU shared-memory segments in /dev/shm now (an empty set where there is no /dev/shm)."""
    try:
        return {name for name in os.listdir(SHM) if VLLM_CPU_SHM in name}
    except OSError:
        return set()


def _remove_own_segments(before: set[str], rank: str | None) -> None:
    """Unlink this worker's vLLM CPU segment (``..._<rank in its group>``) where it appeared in /dev/shm while the
    worker ran: its own engine made it. Segments that were there before, and other ranks', are left alone; a worker
    outside a tensor-parallel group (``rank`` None) has none."""
    if rank is None:
        return
    for name in vllm_shm_segments() - before:
        if not name.endswith(f"{VLLM_CPU_SHM}{rank}"):
            continue
        try:
            os.unlink(os.path.join(SHM, name))
        except OSError:
            pass  # the group's other worker removed it first


def _build_policy(spec: WorkerSpec) -> torch.nn.Module:
    """The worker's copy of the policy: the model with the shared weights, or with LoRA adapters only the base
    model with the shared base weights, wrapped in a peft model of the adapter's config."""
    model = spec.model_class(spec.config).to(spec.dtype)
    model.generation_config = spec.generation_config
    if spec.lora is None:
        model.load_state_dict(spec.weights.tensors())
        return model
    from peft import get_peft_model

    model.load_state_dict(spec.base.tensors())
    model = get_peft_model(model, spec.lora)
    _load_weights(model, spec)
    return model


def _load_weights(model: torch.nn.Module, spec: WorkerSpec) -> None:
    """Copy the shared weights (with LoRA adapters only: the adapter tensors) into the worker's policy."""
    if spec.lora is None:
        model.load_state_dict(spec.weights.tensors())
        return
    from peft import set_peft_model_state_dict

    result = set_peft_model_state_dict(model, spec.weights.tensors())
    if result.unexpected_keys:
        raise RuntimeError(f"adapter tensors the worker's peft model does not have: {result.unexpected_keys[:3]}")


def _serve(conn, spec: WorkerSpec) -> None:
    """The worker's main loop: build the policy, then answer one request at a time (``sync``: load the
    shared weights; ``generate``; ``stop``) until told to stop or the trainer's end of the pipe closes."""
    segments = vllm_shm_segments()  # a tensor-parallel vLLM engine's segment is made after this
    group_rank = (spec.env or {}).get("RANK")  # set for a tensor-parallel group's worker only
    become_child(cleanup=functools.partial(_remove_own_segments, segments, group_rank))
    os.environ.update(spec.env or {})
    try:
        _serve_requests(conn, spec)
    finally:
        _remove_own_segments(segments, group_rank)


def _serve_requests(conn, spec: WorkerSpec) -> None:
    """``_serve``'s loop."""
    torch.set_num_threads(spec.threads)
    device = torch.device(spec.device)  # the trainer's: requests carry its random streams
    # An engine with weights of its own (vLLM) reads the copy only to fill them: it stays in host memory, so that
    # the device holds the engine's weights alone (a tensor-parallel engine's part of them).
    home = torch.device("cpu") if getattr(spec.engine, "syncs_merged_weights", False) else device
    try:
        model = _build_policy(spec)
        model.requires_grad_(False).eval().to(home)
    except Exception as err:  # noqa: BLE001 - whatever failed, the trainer raises it as one line
        conn.send(("error", describe(err)))
        return
    engine, version = spec.engine, spec.version
    if isinstance(spec.rng, int):
        torch.manual_seed(spec.rng)
    elif spec.rng is not None:
        set_rng_states(spec.rng, device)
    conn.send(("ready", version))
    while True:
        try:
            message = conn.recv()
        except EOFError:
            return
        try:
            if message[0] == "sync":
                _load_weights(model, spec)
                engine.update_weights(model)  # e.g. HFEngine's copy in another dtype
                version = message[1]
                conn.send(("synced", version))
            elif message[0] == "generate":
                _, expected, prompts, sampling, rng = message
                if expected != version:
                    conn.send(("stale", version))
                    continue
                if rng is not None:  # synchronous mode: the trainer's stream; else the worker's own
                    set_rng_states(rng, device)
                out = engine.generate(model, spec.tokenizer, prompts, sampling)
                out = Generation(**{f.name: getattr(out, f.name).cpu() for f in dataclasses.fields(Generation)})
                conn.send(("generated", version, out, dict(engine.last_metrics), rng_states(device)))
            else:
                return
        except Exception as err:  # noqa: BLE001 - the trainer raises it as one line; the worker stays usable
            conn.send(("error", describe(err)))


# --------------------------------------------------------------------------------------------- trainer side
WorkerDied = ChildDied
"""The worker process is gone; the message describes its exit ("exit code 3")."""


def _timed_out(what: str, timeout: float) -> ComponentError:
    return ComponentError(
        f"model.rollout: the rollout worker did not {what} within timeout_seconds={timeout:g} and was "
        "stopped; raise model.rollout.init_args.timeout_seconds if it is only slow, or check the inner "
        "engine (model.rollout.init_args.engine)"
    )


class RolloutWorker:
    """One worker process and the trainer's end of its pipe: a ``SupervisedProcess`` spawned through
    ``torch.multiprocessing``, so that the spec's ``SharedWeights`` travel as handles to the same memory."""

    def __init__(self, spec: WorkerSpec):
        self.child = SupervisedProcess.spawn(_serve, spec, name="the rollout worker process",
                                             process_name="rllight-rollout", timed_out=_timed_out)

    @property
    def process(self) -> multiprocessing.process.BaseProcess:
        return self.child.process

    def send(self, message: tuple) -> None:
        """Send ``message``; ``WorkerDied`` if the worker is gone."""
        self.child.send(message)

    def receive(self, timeout: float, what: str) -> tuple:
        """The worker's next message; ``WorkerDied`` if it died, ``ComponentError`` after ``timeout`` seconds."""
        return self.child.receive(timeout, what)

    def describe_exit(self) -> str:
        return self.child.describe_exit()

    def stop(self) -> None:
        """Ask the worker to leave (it is between requests), then make sure it has."""
        self.child.stop()

    def kill(self) -> int | None:
        """End the worker and what it started at once (it hangs, died, or is busy with a request whose reply
        nobody will read); returns its exit code."""
        return self.child.kill()
