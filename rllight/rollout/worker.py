"""Rollouts in a worker process of its own, with versioned weight syncs.

Select it in a recipe (or with ``--config recipes/overlays/process-worker.yaml``)::

    model:
      rollout:
        class_path: rllight.rollout.worker.ProcessEngine
        init_args:
          engine: {class_path: rllight.rollout.HFEngine}   # the engine the worker runs
          max_new_tokens: 24                            # its sampling settings (see ProcessEngine)
          temperature: 0.7
          sync_every: 1
          timeout_seconds: 600

How it runs:
- **A copy of the policy in another process**: the first ``generate`` starts a worker (``torch.multiprocessing``,
  spawn start) and sends it the policy's class, config, generation config, dtype and device, the tokenizer and
  the inner engine (all pickled), and the weights; the worker builds the model and runs the inner engine on it.
- **Weights through shared memory**: the full state dict (LoRA merged, ``full_state_dict``) is copied into one
  flat shared-memory CPU buffer per dtype, allocated at the start and overwritten at every sync; the worker maps
  the same buffers and copies them into its model, so nothing of the weights' size goes through the pipe. The
  buffers stay in the trainer as the last weights sent, to restart a worker that died with them (one CPU copy
  of the policy in ``/dev/shm``; in a container give it room, e.g. ``docker run --shm-size``).
- **LoRA adapters only**, when the inner engine syncs adapters (``syncs_lora_adapters``: ``VLLMEngine`` with its
  default ``lora_sync: adapter``) and the policy is a peft LoRA model: the base weights go once into buffers of
  their own, the worker rebuilds the peft model on them from the adapter's config, and every sync writes and
  loads the adapter tensors alone (under FSDP only they are gathered). Any other engine gets merged weights.
- **Versions**: the policy version is the number of optimizer updates (``update_weights`` calls) the weights
  include. A sync, every ``sync_every`` updates, sets it to the update count; the worker acknowledges with the
  version it loaded. Every request to generate names the version the trainer expects (the last one sent) and
  the worker refuses any other; the reply names the version that generated it and the trainer checks it too,
  so a stale worker raises an error instead of sampling from the wrong policy. ``rollout/staleness`` is the
  number of updates the worker's weights lack (0 with ``sync_every: 1``).
- **Exactly the in-process results**: each request carries the trainer's torch RNG state (and on CUDA the
  device's); the worker generates from it and sends its state back, which the trainer takes on. The worker
  uses the trainer's number of torch threads. With ``HFEngine`` inside, training then gives the same numbers
  as ``HFEngine`` in the training process.
- **Asynchronous rollouts** (``max_staleness`` k > 0): ``prefetch`` sends a generation request without waiting
  for it (the module sends the next training batches' prompts before each update), and ``generate`` collects the
  one sent for the same prompts and sampling, or generates anew if there is none or it is more than k versions
  old. Replies come in the order sent; the trainer reads them as it needs them. Weights go with the next request
  after an update (a "sync" queued before it; the buffers are rewritten only once the worker has read the last
  ones), so requests already queued keep the version they were sent with, and each reply names it. The worker
  samples from its own RNG stream, seeded from the trainer's; ``state_dict`` (saved in checkpoints) waits for the
  requests in flight and keeps their results and the worker's RNG state, so a resumed run continues exactly. A
  worker that dies loses the requests in flight: they are generated again when asked for.
- **Tensor parallelism** (the inner ``VLLMEngine``'s ``tensor_parallel_size`` n > 1, with several training
  processes): each group of n consecutive ranks on one machine runs one engine split across their workers, which
  join vLLM's group as its ``external_launcher`` expects (the environment each worker gets names its place in the
  group and a port the group's first rank chose). Every generation gathers the group's prompts (over a gloo group
  of its ranks), each worker generates them all from the first rank's RNG state (so the parts agree), and each
  rank takes its own rows back. Synchronous only; a worker of such a group that dies ends the run with one line
  (its group cannot go on without it): resume from the last checkpoint.
- **Faults never hang the trainer**: every wait for the worker lasts at most ``timeout_seconds``; past it the
  worker is killed and the call raises. A worker that dies (its pipe closes or its process ends) is restarted
  once with the last weights and version and the request is sent again; if the new one dies on the same
  request too, the call raises. The worker ignores Ctrl-C (the trainer's to handle) and exits when the trainer
  does.
"""

from __future__ import annotations

import collections
import dataclasses
import inspect
import logging
import math
import multiprocessing
import os
import signal
import socket
import threading
import time
import weakref
from multiprocessing.connection import wait
from typing import Any

import torch
from torch import Tensor

from rllight.errors import ComponentError, RecipeError
from rllight.rollout.base import SAMPLING_SETTINGS, Generation, RolloutEngine, Sampling, request_key
from rllight.rollout.vllm import GatheredState, adapter_state_dict, base_state_dict, full_state_dict, lora_config
from rllight.stopping import check_stop

log = logging.getLogger(__name__)



def _describe(err: BaseException) -> str:
    text = " ".join(f"{type(err).__name__}: {err}".split())
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
class _WorkerSpec:
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


# --------------------------------------------------------------------------------------------- worker side
def _rng_states(device: torch.device) -> dict[str, Tensor]:
    """The torch RNG states that sampling on ``device`` draws from."""
    states = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        states["cuda"] = torch.cuda.get_rng_state(device)
    return states


def _set_rng_states(states: dict[str, Tensor], device: torch.device) -> None:
    torch.set_rng_state(states["cpu"])
    if "cuda" in states:
        torch.cuda.set_rng_state(states["cuda"], device)


SHM = "/dev/shm"
VLLM_CPU_SHM = "-cpushm_"
"""What vLLM's CPU tensor-parallel groups name their shared-memory segments: ``<ident>-tp:<n>-[<ranks>]-cpushm_<rank>``,
the same name in every run of a group of the same ranks. vLLM leaves them in /dev/shm when its process ends, and the
next group of those ranks on the machine then fails to start (``create shm in SHMManager failed. errno: 17``)."""


def _vllm_shm_segments() -> set[str]:
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
    for name in _vllm_shm_segments() - before:
        if not name.endswith(f"{VLLM_CPU_SHM}{rank}"):
            continue
        try:
            os.unlink(os.path.join(SHM, name))
        except OSError:
            pass  # the group's other worker removed it first


def _exit_with_parent(before: set[str], rank: str | None) -> None:
    # A worker busy generating never reads its pipe's end: leave when the trainer is gone.
    multiprocessing.parent_process().join()
    _remove_own_segments(before, rank)
    os._exit(0)


def _build_policy(spec: _WorkerSpec) -> torch.nn.Module:
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


def _load_weights(model: torch.nn.Module, spec: _WorkerSpec) -> None:
    """Copy the shared weights (with LoRA adapters only: the adapter tensors) into the worker's policy."""
    if spec.lora is None:
        model.load_state_dict(spec.weights.tensors())
        return
    from peft import set_peft_model_state_dict

    result = set_peft_model_state_dict(model, spec.weights.tensors())
    if result.unexpected_keys:
        raise RuntimeError(f"adapter tensors the worker's peft model does not have: {result.unexpected_keys[:3]}")


def _serve(conn, spec: _WorkerSpec) -> None:
    """The worker's main loop: build the policy, then answer one request at a time (``sync``: load the
    shared weights; ``generate``; ``stop``) until told to stop or the trainer's end of the pipe closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the trainer's to handle; it then stops us
    os.environ.update(spec.env or {})
    segments = _vllm_shm_segments()  # a tensor-parallel vLLM engine's segment is made after this
    group_rank = (spec.env or {}).get("RANK")  # set for a tensor-parallel group's worker only
    threading.Thread(target=_exit_with_parent, args=(segments, group_rank), daemon=True).start()
    try:
        _serve_requests(conn, spec)
    finally:
        _remove_own_segments(segments, group_rank)


def _serve_requests(conn, spec: _WorkerSpec) -> None:
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
        conn.send(("error", _describe(err)))
        return
    engine, version = spec.engine, spec.version
    if isinstance(spec.rng, int):
        torch.manual_seed(spec.rng)
    elif spec.rng is not None:
        _set_rng_states(spec.rng, device)
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
                    _set_rng_states(rng, device)
                out = engine.generate(model, spec.tokenizer, prompts, sampling)
                out = Generation(**{f.name: getattr(out, f.name).cpu() for f in dataclasses.fields(Generation)})
                conn.send(("generated", version, out, dict(engine.last_metrics), _rng_states(device)))
            else:
                return
        except Exception as err:  # noqa: BLE001 - the trainer raises it as one line; the worker stays usable
            conn.send(("error", _describe(err)))


# --------------------------------------------------------------------------------------------- trainer side
class _WorkerDied(Exception):
    pass


class _Worker:
    """One worker process and the trainer's end of its pipe."""

    def __init__(self, spec: _WorkerSpec):
        context = torch.multiprocessing.get_context("spawn")
        self.conn, child = context.Pipe()
        # Daemonic: at the trainer's exit multiprocessing terminates it instead of waiting for it.
        self.process = context.Process(target=_serve, args=(child, spec), daemon=True, name="rllight-rollout")
        self.process.start()
        child.close()  # so that the worker's death closes the pipe

    def send(self, message: tuple) -> None:
        try:
            self.conn.send(message)
        except OSError as err:  # a broken pipe: the worker is gone
            raise _WorkerDied(self.describe_exit()) from err

    def receive(self, timeout: float, what: str) -> tuple:
        """The worker's next message; ``_WorkerDied`` if it died, ``ComponentError`` after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while not wait([self.conn, self.process.sentinel], max(0.0, min(0.2, deadline - time.monotonic()))):
            if time.monotonic() < deadline:  # short slices, so that Ctrl-C or SIGTERM is seen within seconds
                check_stop("the rollout worker process")
                continue
            raise ComponentError(
                f"model.rollout: the rollout worker did not {what} within timeout_seconds={timeout:g} and was "
                "stopped; raise model.rollout.init_args.timeout_seconds if it is only slow, or check the inner "
                "engine (model.rollout.init_args.engine)"
            )
        try:
            return self.conn.recv()
        except (EOFError, OSError) as err:  # its end closed, also mid-message
            raise _WorkerDied(self.describe_exit()) from err

    def describe_exit(self) -> str:
        self.process.join(timeout=5)
        return "still running" if self.process.exitcode is None else f"exit code {self.process.exitcode}"

    def stop(self) -> None:
        """Ask the worker to leave (it is between requests), then make sure it has."""
        if self.process.is_alive():
            try:
                self.conn.send(("stop",))
            except OSError:
                pass
            self.process.join(timeout=5)
        self.kill()

    def kill(self) -> None:
        """End the worker at once (it hangs, died, or is busy with a request whose reply nobody will read)."""
        if self.process.is_alive():
            self.process.kill()
        self.process.join(timeout=5)
        self.conn.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _TensorParallelGroup:
    """The training ranks whose rollout workers run one tensor-parallel engine: ``size`` consecutive ranks, on one
    machine. ``gather`` collects an object from each (over a gloo group of these ranks, whatever the trainer's
    backend); ``env`` is what the rank's worker sets to join vLLM's group (``external_launcher``: ``env://``)."""

    def __init__(self, size: int):
        import torch.distributed as dist

        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        if world % size:  # also refused before the model loads (ProcessEngine.check_processes)
            raise RecipeError(_groups_message(size, world))
        self.size = size
        self.group, _ = dist.new_subgroups(group_size=size, backend="gloo")  # a collective: every rank, at once
        self.rank = dist.get_rank(self.group)
        members = self.gather((socket.gethostname(), _free_port() if self.rank == 0 else None))
        if len({host for host, _ in members}) > 1:
            raise RecipeError(f"{TENSOR_PARALLEL}={size}: the {size} ranks of one engine run on different machines "
                              f"({', '.join(sorted({h for h, _ in members}))}); make trainer.devices a multiple of it")
        self.env = {"RANK": str(self.rank), "WORLD_SIZE": str(size), "LOCAL_RANK": os.environ.get("LOCAL_RANK", "0"),
                    "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(members[0][1])}

    def gather(self, obj: Any) -> list:
        """``obj`` of every rank of the group, in rank order."""
        out = [None] * self.size
        torch.distributed.all_gather_object(out, obj, group=self.group)
        return out


TENSOR_PARALLEL = "model.rollout.init_args.engine.init_args.tensor_parallel_size"


def _groups_message(size: int, world: int) -> str:
    return (f"{TENSOR_PARALLEL}={size}: each engine spans {size} training processes, and {world} do not make groups "
            f"of {size}; make trainer.devices x trainer.num_nodes a multiple of it")


def _own_rows(gen: Generation, rows: slice) -> Generation:
    """Rows ``rows`` of a generation made for a whole group, less the padding columns only other rows needed
    (prompts are left-padded, responses right-padded): what generating these rows alone gives."""
    prompt_mask, response_mask = gen.prompt_mask[rows], gen.response_mask[rows]
    used = prompt_mask.bool().any(0).nonzero()
    first = int(used[0]) if len(used) else 0
    used = response_mask.bool().any(0).nonzero()
    end = int(used[-1]) + 1 if len(used) else response_mask.shape[1]
    return Generation(prompt_ids=gen.prompt_ids[rows, first:], prompt_mask=prompt_mask[:, first:],
                      response_ids=gen.response_ids[rows, :end], response_mask=response_mask[:, :end],
                      logprobs=gen.logprobs[rows, :end], truncated=gen.truncated[rows])


def _forwarded(name: str) -> property:
    """An attribute of the inner engine, read and set through the ``ProcessEngine``."""
    return property(lambda self: getattr(self.engine, name), lambda self, value: setattr(self.engine, name, value),
                    doc=f"The inner engine's ``{name}`` (sent to the worker with every request).")


_DEFAULTS = {name: inspect.signature(RolloutEngine).parameters[name].default for name in SAMPLING_SETTINGS}
"""Every engine's default sampling settings (64 tokens, temperature 1.0, top_p 1.0, top_k 0)."""


@dataclasses.dataclass
class _Request:
    """A request sent to the worker in asynchronous mode, and its reply once read."""

    kind: str  # "sync" or "generate"
    version: int  # the policy version it was sent with (a sync: the version it loads)
    key: tuple = ()  # a generation: its request_key (prompts and sampling), what a later generate call matches
    seq: int = 0  # order of sending
    result: tuple | None = None  # a generation's (Generation as a dict of tensors, the inner engine's metrics)


class ProcessEngine(RolloutEngine):
    """Runs another rollout engine in a worker process with its own copy of the policy, synced after
    optimizer updates with a version (see ``rllight.rollout.worker``).

    The sampling settings (``max_new_tokens``, ``temperature``, ``top_p``, ``top_k``) are the inner engine's,
    read and set through this one; each request carries the ``Sampling`` it was called with (training: these
    settings; evaluation: its own), which the worker passes on. They can also be given here: an overlay that
    switches a recipe's engine to this one (e.g. ``recipes/overlays/process-worker.yaml``) keeps those of the
    recipe's ``model.rollout.init_args`` that this class accepts (the parser drops the rest when the class
    changes), so the worker samples as the recipe says, not with the inner engine's defaults.

    ``last_metrics`` holds the inner engine's metrics (e.g. ``rollout/tokens_per_s``), ``rollout/policy_version``
    (optimizer updates in the weights that generated), ``rollout/staleness`` (updates since then) and
    ``rollout/sync_time`` (seconds spent on the syncs since the previous ``generate``). ``close()`` stops the
    worker and frees its shared weights; a later ``generate`` starts a new one from the then-current policy.

    Args:
        engine: The engine the worker runs (e.g. ``rllight.rollout.HFEngine``), with its sampling settings.
        sync_every: Send the weights every k optimizer updates (1 = always on-policy; with k > 1 the worker
            samples from weights up to k - 1 updates old, reported as ``rollout/staleness``, and the
            importance ratio corrects for it).
        timeout_seconds: Longest wait for the worker to start, load weights or generate; past it the worker is
            killed and the step fails with one line.
        max_staleness: Asynchronous rollouts (0 = synchronous). With k > 0 the trainer asks the worker for the
            next steps' rollouts before it updates, so generation overlaps training, and no response is trained
            on more than k policy versions (optimizer updates) after the weights that generated it: the trainer
            runs ``k // (updates per step)`` steps ahead, and a response older than that when its step comes
            (e.g. after a larger step) is dropped and generated again. The worker then samples from its own
            random stream. See "Asynchronous rollouts" in ``rllight.rollout.worker``.
        max_new_tokens: Longest response, in tokens (None: the inner engine's).
        temperature: Sampling temperature (None: the inner engine's).
        top_p: Nucleus sampling threshold (None: the inner engine's).
        top_k: Keep the k most likely tokens (None: the inner engine's).

    Each setting is the one of the two (here, the inner engine) that differs from every engine's default (64
    tokens, temperature 1.0, top_p 1.0, top_k 0): a default cannot be told from a value left out, and a recipe
    that names no engine carries the default engine's settings here. Two different values that both differ from
    the default are refused with one line. So a value equal to the default, given on one side, does not override
    the other side's: give sampling settings in one place, preferably here.
    """

    syncs_merged_weights = True  # holds weights of its own, filled from the policy's full state dict

    max_new_tokens = _forwarded("max_new_tokens")
    temperature = _forwarded("temperature")
    top_p = _forwarded("top_p")
    top_k = _forwarded("top_k")

    def __init__(self, engine: RolloutEngine, sync_every: int = 1, timeout_seconds: float = 600.0,
                 max_staleness: int = 0, max_new_tokens: int | None = None, temperature: float | None = None,
                 top_p: float | None = None, top_k: int | None = None):
        key = "model.rollout.init_args"
        if isinstance(engine, ProcessEngine):
            raise RecipeError(f"{key}.engine: a ProcessEngine inside a ProcessEngine; name the engine to run "
                              "(e.g. rllight.rollout.HFEngine)")
        if sync_every < 1:
            raise RecipeError(f"{key}.sync_every must be >= 1, got {sync_every}")
        if not (math.isfinite(timeout_seconds) and timeout_seconds > 0):
            raise RecipeError(f"{key}.timeout_seconds must be a positive number of seconds, got {timeout_seconds}")
        if max_staleness < 0:
            raise RecipeError(f"{key}.max_staleness must be >= 0 (0 = synchronous), got {max_staleness}")
        if max_staleness and getattr(engine, "tensor_parallel_size", 1) > 1:
            raise RecipeError(f"{key}: max_staleness={max_staleness} with a tensor-parallel engine "
                              f"({TENSOR_PARALLEL}={engine.tensor_parallel_size}); its groups generate synchronously: "
                              "set max_staleness: 0")
        if max_staleness and sync_every != 1:
            raise RecipeError(f"{key}: max_staleness={max_staleness} with sync_every={sync_every}; asynchronous "
                              "rollouts send the weights with every request, so leave sync_every at 1 and bound "
                              "the lag with max_staleness")
        given = {"max_new_tokens": max_new_tokens, "temperature": temperature, "top_p": top_p, "top_k": top_k}
        sampling = {}
        for name, value in given.items():
            inner, default = getattr(engine, name), _DEFAULTS[name]
            if value is not None and value != inner and default not in (value, inner):
                raise RecipeError(
                    f"{key}.{name}={value} and {key}.engine.init_args.{name}={inner} disagree (the first is "
                    "usually the recipe's, kept when an overlay switched the engine to ProcessEngine); give it in "
                    "one place, or the same value in both"
                )
            sampling[name] = inner if value is None or value == default else value
        self.max_staleness = max_staleness
        self.engine = engine
        self.sync_every = sync_every
        self.timeout_seconds = float(timeout_seconds)
        super().__init__(**sampling)  # validated as any engine's, and set on the inner engine (the properties above)
        self._updates = 0  # update_weights calls so far
        self._group: _TensorParallelGroup | None = None  # a tensor-parallel engine's ranks (made at the first start)
        self._reset()

    def _reset(self) -> None:
        """No worker, no shared weights: the next ``generate`` starts from the policy it is given."""
        self._worker: _Worker | None = None
        self._stop_worker_at_exit: weakref.finalize | None = None
        self._policy: dict[str, Any] | None = None  # what builds the worker's model, less the weights
        self._weights: SharedWeights | None = None  # the last weights sent (with LoRA adapters only: the adapter)
        self._base: SharedWeights | None = None  # with LoRA adapters only: the base weights, sent once
        self._version = 0  # optimizer updates included in the last weights sent
        self._sync_time = 0.0  # seconds spent on syncs since the last generate
        # Asynchronous mode
        self._outstanding: collections.deque[_Request] = collections.deque()  # sent, reply not read yet
        self._ready: list[_Request] = []  # generations read and not yet collected, in order of sending
        self._sent = 0  # requests sent so far (their seq)
        self._worker_rng: int | dict | None = None  # the worker's RNG: a seed, or its states after the last reply
        self._discarded = 0  # generations dropped as too stale since the last generate

    # Pickling or copying the engine (a checkpoint, a deep copy of the module) carries its settings only.
    def __getstate__(self) -> dict:
        return {"engine": self.engine, "sync_every": self.sync_every, "timeout_seconds": self.timeout_seconds,
                "max_staleness": self.max_staleness, "last_metrics": self.last_metrics, "_updates": self._updates}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._group = None
        self._reset()

    @property
    def tensor_parallel_size(self) -> int:
        """Devices (training processes) the inner engine spans: its ``tensor_parallel_size``, else 1."""
        return int(getattr(self.engine, "tensor_parallel_size", 1))

    @property
    def tensor_parallel_rank(self) -> int | None:
        """This rank's place in its engine's group once it has started (None without tensor parallelism)."""
        return None if self._group is None else self._group.rank

    def check_processes(self, world_size: int) -> None:
        if world_size % self.tensor_parallel_size:
            raise RecipeError(_groups_message(self.tensor_parallel_size, world_size))

    # ------------------------------------------------------------------------------- worker
    def _start(self, model: torch.nn.Module, tokenizer) -> None:
        """Take the policy as it is now (version: the updates so far); the worker starts at the next call."""
        try:
            from peft import PeftModel
        except ImportError:
            PeftModel = None
        base = model.get_base_model() if PeftModel is not None and isinstance(model, PeftModel) else model
        adapter = lora_config(model) if self.syncs_lora_adapters else None
        self._policy = {
            "model_class": type(base),
            "config": base.config,
            "generation_config": base.generation_config,
            "dtype": next(model.parameters()).dtype,
            "device": str(next(model.parameters()).device),
            "tokenizer": tokenizer,
            "lora": adapter,
        }
        self._base = None if adapter is None else SharedWeights(base_state_dict(model))
        self._weights = SharedWeights(self._sync_weights(model))
        self._version = self._updates
        if self.asynchronous and self._worker_rng is None:  # a stream of its own, seeded from the trainer's
            self._worker_rng = int(torch.randint(2**62, ()).item())
        if self.tensor_parallel_size > 1 and self._group is None:
            self._group = _TensorParallelGroup(self.tensor_parallel_size)

    def _launch(self) -> None:
        """Start a worker on the last weights sent and wait until it is ready."""
        spec = _WorkerSpec(engine=self.engine, threads=torch.get_num_threads(), weights=self._weights, base=self._base,
                           version=self._version, rng=self._worker_rng,
                           env=None if self._group is None else self._group.env, **self._policy)
        self._worker = _Worker(spec)
        self._stop_worker_at_exit = weakref.finalize(self, self._worker.stop)
        self._check(self._worker.receive(self.timeout_seconds, "start"), "start")

    def _stop_worker(self, at_once: bool = False) -> None:
        """Stop the worker: ask it to leave, or with ``at_once`` kill it."""
        if self._worker is not None:
            self._stop_worker_at_exit.detach()
            self._worker.kill() if at_once else self._worker.stop()
        self._worker = self._stop_worker_at_exit = None

    def _check(self, reply: tuple, what: str) -> tuple:
        if reply[0] == "error":
            raise ComponentError(f"model.rollout: the rollout worker's {type(self.engine).__name__} failed to {what}: "
                                 f"{reply[1]}; fix the inner engine (model.rollout.init_args.engine), or generate in "
                                 "the training process (model.rollout.class_path: rllight.rollout.HFEngine)")
        return reply

    def _attempt(self, message: tuple, what: str) -> tuple:
        """Send ``message`` and return the reply, starting the worker if needed."""
        try:
            if self._worker is None:
                self._launch()
            self._worker.send(message)
            reply = self._worker.receive(self.timeout_seconds, what)
        except BaseException:
            # Timed out, died, or interrupted (Ctrl-C) mid-request: a reply may still come, and no later
            # request may read it as its own.
            self._stop_worker(at_once=True)
            raise
        return self._check(reply, what)

    def _call(self, message: tuple, what: str) -> tuple:
        """``_attempt``, and once more on a new worker (the last weights and version) if the worker died."""
        try:
            return self._attempt(message, what)
        except _WorkerDied as died:
            if self._group is not None:
                raise ComponentError(
                    f"model.rollout: the rollout worker died ({died}) trying to {what}; it ran part of a "
                    f"tensor-parallel engine, whose other parts cannot go on without it. Resume from the last "
                    "checkpoint") from None
            log.warning("the rollout worker died (%s) trying to %s; restarting it with policy version %d",
                        died, what, self._version)
        try:
            return self._attempt(message, what)
        except _WorkerDied as died:
            raise ComponentError(
                f"model.rollout: the rollout worker died twice in a row ({died}) trying to {what}; look for an "
                "out-of-memory kill or a crash in the inner engine, or generate in the training process "
                "(model.rollout.class_path: rllight.rollout.HFEngine)"
            ) from None

    def close(self) -> None:
        """Stop the worker and free the shared weights (a later ``generate`` starts a new worker)."""
        self._stop_worker()
        self._reset()

    # ---------------------------------------------------------------------------- generate
    def generate(self, model, tokenizer, prompts: list[list[int]], sampling: Sampling) -> Generation:
        if self._weights is None:
            self._start(model, tokenizer)
        if self.asynchronous:
            return self._collect(model, prompts, sampling)
        device = next(model.parameters()).device
        expected = self._version
        rng, own = _rng_states(device), slice(0, len(prompts))
        if self._group is not None:  # the group's prompts, all sampled from its first rank's stream
            parts = self._group.gather((prompts, rng))
            start = sum(len(part) for part, _ in parts[: self._group.rank])
            prompts, rng, own = [p for part, _ in parts for p in part], parts[0][1], slice(start, start + len(prompts))
        reply = self._call(("generate", expected, prompts, sampling, rng), "generate")
        if reply[0] != "generated" or reply[1] != expected:
            raise ComponentError(
                f"model.rollout: the rollout worker answered with policy version {reply[1]} where {expected} was "
                "sent (a weight sync was lost); its samples are not used. Resume from the last checkpoint"
            )
        _, version, out, metrics, rng = reply
        if self._group is None or self._group.rank == 0:  # the other ranks' streams were not drawn from
            _set_rng_states(rng, device)
        if self._group is not None:
            out = _own_rows(out, own)
        self.last_metrics = {**metrics, "rollout/policy_version": float(version),
                             "rollout/staleness": float(self._updates - version), "rollout/sync_time": self._sync_time}
        self._sync_time = 0.0
        return Generation(**{f.name: getattr(out, f.name).to(device) for f in dataclasses.fields(Generation)})

    # ------------------------------------------------------------------------- weight sync
    @torch.no_grad()
    def update_weights(self, model: torch.nn.Module) -> dict[str, float]:
        """Every ``sync_every`` calls, write the policy's full weights (LoRA merged) to the shared buffers and
        have the worker load them as version = the number of calls so far.

        Returns ``{"rollout/sync_time": seconds}`` when it synced, ``{}`` otherwise (or before the worker has
        started: it starts from the then-current policy).
        """
        if self._weights is None:  # nothing sent yet: the worker starts from the then-current policy
            return {}
        self._updates += 1
        if self.asynchronous or self._updates % self.sync_every:  # asynchronous: sent with the next request
            return {}
        start = time.perf_counter()
        self._weights.write(self._sync_weights(model))
        self._version = self._updates
        if self._worker is not None:  # else the next start loads them
            reply = self._call(("sync", self._version), "load weights")
            if reply[1] != self._version:
                raise ComponentError(f"model.rollout: the rollout worker acknowledged policy version {reply[1]} "
                                     f"where {self._version} was sent; resume from the last checkpoint")
        seconds = time.perf_counter() - start
        self._sync_time += seconds
        return {"rollout/sync_time": seconds}

    @property
    def syncs_lora_adapters(self) -> bool:
        """A LoRA policy's syncs carry its adapter only, as the inner engine's do (``VLLMEngine``'s default)."""
        return getattr(self.engine, "syncs_lora_adapters", False)

    def _sync_weights(self, model: torch.nn.Module):
        """What a sync writes: the LoRA adapter's tensors when the worker holds base weights, else the full
        weights (LoRA merged)."""
        return full_state_dict(model) if self._base is None else adapter_state_dict(model)

    # ------------------------------------------------------------------------- asynchronous
    @property
    def asynchronous(self) -> bool:
        return self.max_staleness > 0

    def _send(self, kind: str, message: tuple, key: tuple = ()) -> _Request:
        if self._worker is None:
            self._launch()
        request = _Request(kind, self._version, key, seq=self._sent)
        self._worker.send(message)
        self._sent += 1
        self._outstanding.append(request)
        return request

    def _read_reply(self) -> None:
        """Read the worker's reply to the oldest outstanding request (replies come in the order sent)."""
        request = self._outstanding[0]
        what = "load weights" if request.kind == "sync" else "generate"
        reply = self._check(self._worker.receive(self.timeout_seconds, what), what)
        self._outstanding.popleft()
        if request.kind == "sync":
            if reply[0] != "synced" or reply[1] != request.version:
                raise ComponentError(f"model.rollout: the rollout worker acknowledged policy version {reply[1]} "
                                     f"where {request.version} was sent; resume from the last checkpoint")
            return
        if reply[0] != "generated" or reply[1] != request.version:
            raise ComponentError(
                f"model.rollout: the rollout worker answered with policy version {reply[1]} where "
                f"{request.version} was sent (a weight sync was lost); its samples are not used. Resume from the "
                "last checkpoint"
            )
        _, _, out, metrics, self._worker_rng = reply
        request.result = ({f.name: getattr(out, f.name) for f in dataclasses.fields(Generation)}, metrics)
        self._ready.append(request)

    def _wait_for(self, request: _Request) -> None:
        while request.result is None:
            self._read_reply()

    def _sync_if_behind(self, model: torch.nn.Module) -> None:
        """Send the trainer's weights if the worker's are older (after it has read the last ones sent)."""
        if self._version == self._updates:
            return
        start = time.perf_counter()
        while any(r.kind == "sync" for r in self._outstanding):  # it may still be reading the buffers
            self._read_reply()
        self._weights.write(self._sync_weights(model))
        self._version = self._updates
        if self._worker is not None:  # else the next start loads them
            self._send("sync", ("sync", self._version))
        self._sync_time += time.perf_counter() - start

    def _abandon_worker(self) -> int:
        """Kill the worker; the requests it had not answered are lost. Returns how many generations that was."""
        lost = sum(r.kind == "generate" for r in self._outstanding)
        self._outstanding.clear()
        self._stop_worker(at_once=True)
        return lost

    def _resilient(self, action, what: str):
        """Run ``action``; if the worker died, once more on a new one (the last weights, version and RNG)."""
        for attempt in (1, 2):
            try:
                return action()
            except _WorkerDied as died:
                lost = self._abandon_worker()
                if attempt == 2:
                    raise ComponentError(
                        f"model.rollout: the rollout worker died twice in a row ({died}) trying to {what}; look "
                        "for an out-of-memory kill or a crash in the inner engine, or generate in the training "
                        "process (model.rollout.class_path: rllight.rollout.HFEngine)"
                    ) from None
                log.warning("the rollout worker died (%s) trying to %s; restarting it with policy version %d (%d "
                            "generation(s) sent ahead are lost and are generated again when needed)", died, what,
                            self._version, lost)
            except BaseException:  # timed out or interrupted: a reply may still come that no request may read
                self._abandon_worker()
                raise

    def prefetch(self, model, tokenizer, prompts: list[list[int]], sampling: Sampling) -> None:
        """Asynchronous mode: send the trainer's current weights if the worker's are older and ask it to
        generate for ``prompts``, without waiting; a later ``generate`` with the same prompts and sampling
        collects the result. Synchronous mode: nothing."""
        if not self.asynchronous:
            return
        if self._weights is None:
            self._start(model, tokenizer)
        key = request_key(prompts, sampling)

        def send() -> None:
            self._sync_if_behind(model)
            self._send("generate", ("generate", self._version, prompts, sampling, None), key)

        self._resilient(send, "generate")

    def _claim(self, key: tuple) -> _Request | None:
        """The oldest generation sent for ``key`` that nobody has collected, waiting for its reply; older
        uncollected generations are dropped (they were for steps already past)."""
        request = next((r for r in [*self._ready, *self._outstanding] if r.kind == "generate" and r.key == key), None)
        if request is None:
            return None
        self._wait_for(request)
        self._ready = [r for r in self._ready if r.seq > request.seq]
        return request

    def _collect(self, model, prompts: list[list[int]], sampling: Sampling) -> Generation:
        """Asynchronous ``generate``: the generation sent ahead for these prompts if there is one and it is at
        most ``max_staleness`` versions old, else a new one from the current weights."""
        device = next(model.parameters()).device
        key = request_key(prompts, sampling)
        start = time.perf_counter()

        def collect() -> tuple[_Request, bool]:
            request = self._claim(key)
            if request is not None:
                if self._updates - request.version <= self.max_staleness:
                    return request, True
                self._discarded += 1
                log.warning("a rollout generated ahead with policy version %d is %d versions old, more than "
                            "max_staleness=%d; it is generated again", request.version,
                            self._updates - request.version, self.max_staleness)
            self._sync_if_behind(model)
            request = self._send("generate", ("generate", self._version, prompts, sampling, None), key)
            self._wait_for(request)
            self._ready.remove(request)
            return request, False

        request, ahead = self._resilient(collect, "generate")
        out, metrics = request.result
        self.last_metrics = {
            **metrics,
            "rollout/policy_version": float(request.version),
            "rollout/staleness": float(self._updates - request.version),
            "rollout/sync_time": self._sync_time,
            "rollout/wait_time": time.perf_counter() - start,
            "rollout/generated_ahead": float(ahead),
            "rollout/stale_discarded": float(self._discarded),
        }
        self._sync_time, self._discarded = 0.0, 0
        return Generation(**{name: value.to(device) for name, value in out.items()})

    # ---------------------------------------------------------------------------- checkpoint
    def state_dict(self) -> dict:
        """The update count and, in asynchronous mode, the generations sent ahead (waited for: a resumed run
        trains on exactly these) and the worker's RNG, so that a resumed run continues the same streams."""
        state: dict[str, Any] = {"updates": self._updates}
        if not self.asynchronous:
            return state
        try:
            while self._outstanding:
                self._read_reply()
        except Exception as err:  # noqa: BLE001 - the checkpoint still saves; these are generated again
            lost = self._abandon_worker()
            log.warning("the rollout worker failed while a checkpoint waited for its %d generation(s) sent ahead "
                        "(%s); a run resumed from it generates them again", lost, _describe(err))
        state["ready"] = [(r.key, r.version, r.result) for r in self._ready]
        state["rng"] = self._worker_rng
        return state

    def load_state_dict(self, state: dict) -> None:
        self._updates = state.get("updates", self._updates)
        if "rng" in state:
            self._worker_rng = state["rng"]
        for key, version, result in state.get("ready", []):
            self._ready.append(_Request("generate", version, tuple(key), seq=self._sent, result=result))
            self._sent += 1


__all__ = ["ProcessEngine", "SharedWeights"]
