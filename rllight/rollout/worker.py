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
  samples from its own RNG stream, which starts as a copy of the trainer's (so its first batch is a synchronous
  run's first batch, at the same seed); ``state_dict`` (saved in checkpoints) waits for the
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
import logging
import time
import weakref
from typing import Any

import torch

from rllight.bounds import NonNegativeInt, PositiveFiniteFloat, PositiveFloat, PositiveInt, UpToOne, bounded
from rllight.errors import ComponentError, RecipeError
from rllight.rollout.ahead import SentAhead
from rllight.rollout.base import Generation, RolloutEngine, Sampling, outer_or_inner_sampling, request_key
from rllight.rollout.tensor_parallel import TENSOR_PARALLEL, TensorParallelGroup, groups_message, own_rows
from rllight.rollout.weights import adapter_state_dict, base_state_dict, full_state_dict
from rllight.rollout.worker_process import (
    RolloutWorker,
    SharedWeights,
    WorkerDied,
    WorkerSpec,
    describe,
    policy_description,
    rng_states,
    set_rng_states,
)

log = logging.getLogger(__name__)


def _forwarded(name: str) -> property:
    """An attribute of the inner engine, read and set through the ``ProcessEngine``."""
    return property(lambda self: getattr(self.engine, name), lambda self, value: setattr(self.engine, name, value),
                    doc=f"The inner engine's ``{name}`` (sent to the worker with every request).")


@dataclasses.dataclass
class _Request:
    """A request sent to the worker in asynchronous mode, and its reply once read."""

    kind: str  # "sync" or "generate"
    version: int  # the policy version it was sent with (a sync: the version it loads)
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

    @bounded
    def __init__(self, engine: RolloutEngine, sync_every: PositiveInt = 1, timeout_seconds: PositiveFiniteFloat = 600.0,
                 max_staleness: int = 0, max_new_tokens: PositiveInt | None = None,
                 temperature: PositiveFloat | None = None, top_p: UpToOne | None = None,
                 top_k: NonNegativeInt | None = None):
        key = "model.rollout.init_args"
        if isinstance(engine, ProcessEngine):
            raise RecipeError(f"{key}.engine: a ProcessEngine inside a ProcessEngine; name the engine to run "
                              "(e.g. rllight.rollout.HFEngine)")
        SentAhead(max_staleness, key).check_sync_every(sync_every, key)
        if max_staleness and getattr(engine, "tensor_parallel_size", 1) > 1:
            raise RecipeError(f"{key}: max_staleness={max_staleness} with a tensor-parallel engine "
                              f"({TENSOR_PARALLEL}={engine.tensor_parallel_size}); its groups generate synchronously: "
                              "set max_staleness: 0")
        sampling = outer_or_inner_sampling(engine, {"max_new_tokens": max_new_tokens, "temperature": temperature,
                                                    "top_p": top_p, "top_k": top_k}, key)
        self.max_staleness = max_staleness
        self.engine = engine
        self.sync_every = sync_every
        self.timeout_seconds = float(timeout_seconds)
        super().__init__(**sampling)  # validated as any engine's, and set on the inner engine (the properties above)
        self._updates = 0  # update_weights calls so far
        self._group: TensorParallelGroup | None = None  # a tensor-parallel engine's ranks (made at the first start)
        self._reset()

    def _reset(self) -> None:
        """No worker, no shared weights: the next ``generate`` starts from the policy it is given."""
        self._worker: RolloutWorker | None = None
        self._stop_worker_at_exit: weakref.finalize | None = None
        self._policy: dict[str, Any] | None = None  # what builds the worker's model, less the weights
        self._weights: SharedWeights | None = None  # the last weights sent (with LoRA adapters only: the adapter)
        self._base: SharedWeights | None = None  # with LoRA adapters only: the base weights, sent once
        self._version = 0  # optimizer updates included in the last weights sent
        self._sync_time = 0.0  # seconds spent on syncs since the last generate
        # Asynchronous mode
        self._outstanding: collections.deque[_Request] = collections.deque()  # sent, reply not read yet
        self._ahead = SentAhead(self.max_staleness)  # generations sent ahead and not yet collected (read or not)
        self._worker_rng: int | dict | None = None  # the worker's RNG: a seed, or its states after the last reply

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
            raise RecipeError(groups_message(self.tensor_parallel_size, world_size))

    # ------------------------------------------------------------------------------- worker
    def _start(self, model: torch.nn.Module, tokenizer) -> None:
        """Take the policy as it is now (version: the updates so far); the worker starts at the next call."""
        self._policy = policy_description(model, tokenizer, self.syncs_lora_adapters)
        self._base = None if self._policy["lora"] is None else SharedWeights(base_state_dict(model))
        self._weights = SharedWeights(self._sync_weights(model))
        self._version = self._updates
        if self.asynchronous and self._worker_rng is None:
            # A stream of its own that starts where the trainer's is now, without drawing from it: the first batch
            # is then the one a synchronous run of the same seed draws (its request carries this state), so that
            # a staleness comparison's arms share their first, on-policy batch.
            self._worker_rng = rng_states(next(model.parameters()).device)
        if self.tensor_parallel_size > 1 and self._group is None:
            self._group = TensorParallelGroup(self.tensor_parallel_size)

    def _launch(self) -> None:
        """Start a worker on the last weights sent and wait until it is ready."""
        spec = WorkerSpec(engine=self.engine, threads=torch.get_num_threads(), weights=self._weights, base=self._base,
                           version=self._version, rng=self._worker_rng,
                           env=None if self._group is None else self._group.env, **self._policy)
        self._worker = RolloutWorker(spec)
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

    def _call(self, message: tuple, what: str) -> tuple:
        """Send ``message`` and return the reply (starting the worker if needed), once more on a new worker if it
        died (``_resilient``)."""

        def exchange() -> tuple:
            if self._worker is None:
                self._launch()
            self._worker.send(message)
            return self._check(self._worker.receive(self.timeout_seconds, what), what)

        return self._resilient(exchange, what)

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
        rng, own = rng_states(device), slice(0, len(prompts))
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
            set_rng_states(rng, device)
        if self._group is not None:
            out = own_rows(out, own)
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
        return self._ahead.asynchronous

    def _send(self, kind: str, message: tuple) -> _Request:
        if self._worker is None:
            self._launch()
        request = _Request(kind, self._version)
        self._worker.send(message)
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

    def _wait_for(self, request: _Request) -> tuple:
        """The reply to ``request``, reading the worker's replies in order until it has come."""
        while request.result is None:
            self._read_reply()
        return request.result

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
        self._ahead.forget(lambda sent: sent.handle.result is None)  # their replies will never come
        self._stop_worker(at_once=True)
        return lost

    def _resilient(self, action, what: str):
        """Run ``action``; if the worker died, once more on a new one (the last weights, version and RNG). A worker
        that times out, or a call interrupted (Ctrl-C) mid-request, is killed and the error raised: a reply may
        still come, and no later request may read it as its own."""
        for attempt in (1, 2):
            try:
                return action()
            except WorkerDied as died:
                lost = self._abandon_worker()
                if self._group is not None:
                    raise ComponentError(
                        f"model.rollout: the rollout worker died ({died}) trying to {what}; it ran part of a "
                        f"tensor-parallel engine, whose other parts cannot go on without it. Resume from the last "
                        "checkpoint") from None
                if attempt == 2:
                    raise ComponentError(
                        f"model.rollout: the rollout worker died twice in a row ({died}) trying to {what}; look "
                        "for an out-of-memory kill or a crash in the inner engine, or generate in the training "
                        "process (model.rollout.class_path: rllight.rollout.HFEngine)"
                    ) from None
                lost_note = (f" ({lost} generation(s) sent ahead are lost and are generated again when needed)"
                             if lost else "")
                log.warning("the rollout worker died (%s) trying to %s; restarting it with policy version %d%s", died,
                            what, self._version, lost_note)
            except BaseException:
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
            request = self._send("generate", ("generate", self._version, prompts, sampling, None))
            self._ahead.add(key, request.version, request)

        self._resilient(send, "generate")

    def _collect(self, model, prompts: list[list[int]], sampling: Sampling) -> Generation:
        """Asynchronous ``generate``: the generation sent ahead for these prompts if there is one and it is fresh
        (``SentAhead.claim``), else a new one from the current weights."""
        device = next(model.parameters()).device
        key = request_key(prompts, sampling)
        start = time.perf_counter()

        def collect() -> tuple[_Request, bool]:
            claimed = self._ahead.claim(key, self._updates, lambda sent: self._wait_for(sent.handle))
            if claimed is not None:
                return claimed[0].handle, True
            self._sync_if_behind(model)
            request = self._send("generate", ("generate", self._version, prompts, sampling, None))
            self._wait_for(request)
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
            "rollout/stale_discarded": float(self._ahead.pop_discarded()),
        }
        self._sync_time = 0.0
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
                        "(%s); a run resumed from it generates them again", lost, describe(err))
        state["ready"] = self._ahead.answers(lambda sent: sent.handle.result)
        state["rng"] = self._worker_rng
        return state

    def load_state_dict(self, state: dict) -> None:
        self._updates = state.get("updates", self._updates)
        if "rng" in state:
            self._worker_rng = state["rng"]
        for key, version, result in state.get("ready", []):
            self._ahead.add(key, version, _Request("generate", version, result=result))


__all__ = ["ProcessEngine", "SharedWeights"]
