"""Rollouts from a vLLM server addressed by URL, with versioned weight pushes.

Start the server where generation should run (another machine, or this one), on a copy of the policy's
folder and with the log-probs of the distribution it samples from::

    VLLM_SERVER_DEV_MODE=1 vllm serve /shared/policy --logprobs-mode processed_logprobs \\
        --host 127.0.0.1 --port 8000

and select it in a recipe::

    model:
      rollout:
        class_path: rllight.rollout.remote.VLLMServerEngine
        init_args:
          server: {class_path: rllight.serving.Endpoint, init_args: {url: "http://gen-node:8000"}}
          weights_dir: /shared/rllight-weights
          max_new_tokens: 256

How it runs:
- **Generation** is vLLM's OpenAI-compatible ``POST /v1/completions`` with the prompts as token ids,
  ``logprobs: 0`` and ``return_token_ids: true``: the response ids are the server's samples (the end token kept,
  nothing re-tokenised) and the log-probs those of the sampled tokens. With ``--logprobs-mode
  processed_logprobs`` they are taken after temperature (and top-k / top-p), the distribution the trainer
  divides its logits for; vLLM's default (raw) would make every ratio wrong, so the first sampled generation
  at a temperature other than 1 is checked against one forward pass of the trainer's policy, and a server that
  returns raw log-probs stops the run with one line.
- **Weight push** (every ``sync_every`` optimizer updates, and once before the first generation, so that the
  server never samples from weights the trainer does not have): the trainer writes its full weights (LoRA
  merged) as ``model.safetensors`` into ``weights_dir`` (written to a temporary name, then renamed), and asks the
  server to load them in place (``POST /collective_rpc`` with ``reload_weights(weights_path=weights_dir)``, the
  path that re-runs vLLM's per-layer weight processing), to drop its prefix cache (``POST /reset_prefix_cache``)
  and to record the version (``POST /update_weight_version``). ``weights_dir`` must be readable by the server
  under the same path (a shared filesystem). ``VLLM_SERVER_DEV_MODE=1`` is what exposes the first two routes,
  unauthenticated: bind the server to 127.0.0.1 or a private network's address, never a public interface
  (docs/guides/engines.md).
- **Versions**: the version is the number of optimizer updates the pushed weights include. The trainer reads
  ``GET /weight_info`` before and after each generation: a server on any other version (restarted, or pushed to
  by another trainer) is an error, never trusted. ``rollout/policy_version`` and ``rollout/staleness`` are
  logged as with the worker process.
- **Asynchronous** (``max_staleness`` k > 0, as with the worker process): the trainer sends the next steps'
  prompts before it updates (a background thread waits for the server's answers), and a response more than k
  versions old when its step comes is generated again. Weights are pushed with the next request after an
  update, and only when no request is in flight, so no response mixes two versions. A checkpoint waits for the
  responses in flight and saves them (exact resume of what the next steps train on).
- **Several training processes share one server** (DDP or FSDP, ``trainer.devices`` x ``trainer.num_nodes`` > 1):
  each rank sends its own share of the prompts, tagged with its rank (the ``request_id``
  ``rllight-rank<r>-<n>-<random>``, in the server's log and its answer's ``id``), and the server batches the
  ranks' requests together. A push is made once per version: the ranks read the full weights together (under
  FSDP a gather, one weight at a time), then rank 0 alone writes them and asks the server to load them, between
  two barriers (no request in flight during the load, none sent before it is done). A model too large for one
  device is served with the server's own parallelism (``vllm serve ... --tensor-parallel-size N``), which the
  trainer does not see.
- **Faults never hang the trainer**: the server is an ``rllight.serving.Endpoint``, so every attempt lasts at most its
  ``timeout_seconds`` (600 unless set) and is retried as its ``retries`` say; a server that does not answer, or
  answers with an error, stops the step with one line naming the URL and the route.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from rllight.bounds import NonNegativeInt, PositiveFloat, PositiveInt, UpToOne, bounded
from rllight.distributed import process_rank_and_world
from rllight.dtensor import is_dtensor
from rllight.errors import ComponentError, RecipeError
from rllight.rollout.ahead import SentAhead
from rllight.rollout.base import Generation, RolloutEngine, Sampling, request_key
from rllight.rollout.hf import eos_token_ids
from rllight.rollout.samples import generation_from_samples
from rllight.rollout.weights import GatheredState, full_state_dict
from rllight.serving import Endpoint, Failed
from rllight.stopping import wait_stoppable

log = logging.getLogger(__name__)


class VLLMServerEngine(RolloutEngine):
    """Generates with a vLLM server addressed by URL and pushes the trainer's weights to it (see
    ``rllight.rollout.remote``).

    Args:
        server: The server (``rllight.serving.Endpoint``): its base URL (e.g. ``http://gen-node:8000``), key,
            ``timeout_seconds`` for one request (a generation or a push; 600 unless set) and retries.
        weights_dir: A folder the trainer writes the weights to and the server reads them from (the same path
            on both machines). Needed to train; None only for evaluation of the weights the server holds.
        max_new_tokens, temperature, top_p, top_k: Sampling settings, sent with every request.
        sync_every: Push the weights every k optimizer updates (1 = always on-policy).
        model: The served model name (None = the first of ``GET /v1/models``).
        max_staleness: Asynchronous rollouts: the next steps' generations run while the trainer updates, no
            response older than this many optimizer updates is trained on (0 = synchronous).
    """

    syncs_merged_weights = True  # holds weights of its own, filled from the policy's full state dict

    @bounded
    def __init__(self, server: Endpoint, weights_dir: str | None = None, max_new_tokens: PositiveInt = 64,
                 temperature: PositiveFloat = 1.0, top_p: UpToOne = 1.0, top_k: NonNegativeInt = 0,
                 sync_every: PositiveInt = 1, model: str | None = None, max_staleness: int = 0):
        super().__init__(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k)
        key = "model.rollout.init_args"
        if not isinstance(server, Endpoint):
            raise RecipeError(f"{key}.server must be an rllight.serving.Endpoint (class_path and init_args: url...), "
                              f"got {server!r}")
        self.server = server.bind(f"{key}.server.init_args", what="the vLLM server", timeout=600.0)
        if weights_dir is not None and os.path.exists(weights_dir) and not os.path.isdir(weights_dir):
            raise RecipeError(f"{key}.weights_dir {weights_dir!r} is a file; name a folder the server can read")
        self._ahead = SentAhead(max_staleness, key)  # (request key, version, future of the answer), oldest first
        self._ahead.check_sync_every(sync_every, key)
        self.max_staleness = max_staleness
        self.weights_dir = weights_dir
        self.sync_every = sync_every
        self.model = model
        self._updates = 0  # optimizer updates so far
        self._version: int | None = None  # the version last pushed (None: nothing pushed yet)
        self._checked_logprobs = False
        self._sync_time = 0.0
        self._pool: ThreadPoolExecutor | None = None
        self._requests = 0  # completions requested by this process (its part of each request's tag)
        self.last_request_id: str | None = None  # the server's id of the last completion, e.g. cmpl-rllight-rank1-7-...

    def __getstate__(self) -> dict:  # copies (checkpoints, deep copies) carry the settings, not the threads
        state = dict(self.__dict__)
        state.update(_pool=None, _ahead=SentAhead(self.max_staleness))
        return state

    @property
    def url(self) -> str:
        return self.server.url

    # ------------------------------------------------------------------------------- HTTP
    def _request(self, route: str, body: dict | None = None) -> dict:
        """``GET`` (no body) or ``POST`` a JSON body to the server; the decoded JSON answer ({} if none), else
        ``ComponentError`` in one line naming the URL and the route (``Endpoint.call``: on the main thread a stop is
        seen within seconds however long the server takes)."""
        try:
            return self.server.call(route, body, empty={})
        except Failed as failed:
            status = getattr(failed.failure, "status", None)
            if status == 404 and route in ("/collective_rpc", "/reset_prefix_cache"):
                raise ComponentError(f"model.rollout: the vLLM server at {self.url} answered {route} with HTTP 404; "
                                     "start the server with VLLM_SERVER_DEV_MODE=1") from None
            raise ComponentError(f"model.rollout: {failed}") from None

    def _served_model(self) -> str:
        if self.model is None:
            models = self._request("/v1/models").get("data") or []
            if not models:
                raise ComponentError(f"model.rollout: the vLLM server at {self.url} serves no model; start it with "
                                     "the policy's folder (vllm serve <folder>)")
            self.model = str(models[0].get("id")) if isinstance(models[0], dict) else str(models[0])
        return self.model

    def _server_version(self) -> str | None:
        return self._request("/weight_info").get("weight_version")

    # ---------------------------------------------------------------------------- weights
    @torch.no_grad()
    def _push(self, model: torch.nn.Module) -> None:
        """Write the weights to ``weights_dir`` and have the server load them as version ``self._updates``.

        With several training processes sharing the server, every rank calls this at the same point: the ranks
        read the full weights together (under FSDP a collective, one weight at a time), rank 0 alone writes them
        and asks the server to load them, between two barriers, so that no rank's request is in flight during
        the load and none generates before it is done."""
        if self.weights_dir is None:
            raise RecipeError("model.rollout.init_args.weights_dir is not set: the trainer cannot send its weights "
                              "to the vLLM server; name a folder both can read (a shared filesystem)")
        from safetensors.torch import save_file

        start = time.perf_counter()
        rank, world = process_rank_and_world()
        state = full_state_dict(model)
        if rank == 0:
            os.makedirs(self.weights_dir, exist_ok=True)
            # Copies: tied weights (the embedding and the output layer) share memory, which safetensors refuses.
            weights = {name: value.detach().to("cpu", copy=True).contiguous() for name, value in state.items()}
        elif isinstance(state, GatheredState):  # every rank takes part in each weight's gather
            for name in state:
                state[name]
        if world > 1:
            torch.distributed.barrier()  # every rank's requests have been answered (``_current`` waited for them)
        if rank == 0:
            path = os.path.join(self.weights_dir, "model.safetensors")
            save_file(weights, f"{path}.tmp{os.getpid()}")  # the server never reads a half-written file
            del weights
            os.replace(f"{path}.tmp{os.getpid()}", path)
            self._request("/collective_rpc", {"method": "reload_weights",
                                              "kwargs": {"weights_path": os.path.abspath(self.weights_dir)}})
            self._request("/reset_prefix_cache", {})
            self._request("/update_weight_version", {"new_version": str(self._updates)})
        if world > 1:
            torch.distributed.barrier()  # the server holds the new version before any rank asks it again
        self._version = self._updates
        self._sync_time += time.perf_counter() - start

    def update_weights(self, model: torch.nn.Module) -> dict[str, float]:
        """Every ``sync_every`` calls, push the weights (see the module's docstring); ``{}`` before the first
        generation (which pushes the then-current weights), between pushes, and when asynchronous (the next
        request pushes them)."""
        if self._version is None:
            return {}
        self._updates += 1
        if self.max_staleness or self._updates % self.sync_every:
            return {}
        before = self._sync_time
        self._push(model)
        return {"rollout/sync_time": self._sync_time - before}

    # ---------------------------------------------------------------------------- generate
    def _check_version(self, when: str) -> None:
        version = self._server_version()
        if version != str(self._version):
            raise ComponentError(
                f"model.rollout: the vLLM server at {self.url} holds weight version {version!r} {when} generating "
                f"where {self._version} was pushed (restarted, or pushed to by another trainer); its samples are "
                "not used. Resume from the last checkpoint"
            )

    def _complete(self, prompts: list[list[int]], sampling: Sampling, eos: list[int]) -> list[dict]:
        settings = ({"temperature": 0.0} if sampling.greedy else
                    {"temperature": sampling.temperature, "top_p": sampling.top_p, "top_k": sampling.top_k or -1})
        if sampling.seed is not None:
            settings["seed"] = sampling.seed
        rank, _ = process_rank_and_world()
        self._requests += 1
        tag = f"rllight-rank{rank}-{self._requests}-{uuid.uuid4().hex[:8]}"  # in the server's log and its answer
        answer = self._request("/v1/completions", {
            "model": self._served_model(), "prompt": prompts, "max_tokens": sampling.max_new_tokens, "logprobs": 0,
            "return_token_ids": True, "stop_token_ids": eos, "skip_special_tokens": False, "request_id": tag,
            **settings})
        self.last_request_id = str(answer.get("id", tag))
        try:
            choices = sorted(answer.get("choices") or [], key=lambda c: c["index"])
            complete = all(c.get("token_ids") is not None and c["logprobs"]["token_logprobs"] is not None
                           and "finish_reason" in c for c in choices)
        except (KeyError, TypeError, AttributeError):
            complete = False
        if not complete:
            raise ComponentError(f"model.rollout: the vLLM server at {self.url} answered /v1/completions without "
                                 "the completions' index, token ids, log-probs and finish reason; it needs an "
                                 "OpenAI-compatible vLLM server >= 0.10 (vllm serve)")
        if len(choices) != len(prompts):
            raise ComponentError(f"model.rollout: the vLLM server at {self.url} answered {len(choices)} completions "
                                 f"with token ids for {len(prompts)} prompts; it needs vLLM >= 0.10 "
                                 "(return_token_ids)")
        return choices

    @torch.no_grad()
    def _check_processed_logprobs(self, model: torch.nn.Module, prompt: list[int], gen: Generation,
                                  temperature: float) -> None:
        """The server's log-probs of the first response must be the trainer's after temperature, not before
        (a server started without ``--logprobs-mode processed_logprobs``): one forward pass over it."""
        response = gen.response_ids[0][gen.response_mask[0].bool()]
        if len(response) == 0:
            return
        if any(is_dtensor(p) for p in model.parameters()):
            # A sharded policy runs forward passes only together with the other ranks (``Scoring``), so the engine
            # cannot run one of its own; the trainer's gap to the server is logged as train/rollout/logprob_diff_max.
            log.warning("the vLLM server at %s is not checked for processed log-probs under FSDP: start it with "
                        "--logprobs-mode processed_logprobs, or the ratios are wrong at temperature %g",
                        self.url, temperature)
            self._checked_logprobs = True
            return
        device = next(model.parameters()).device
        ids = torch.cat([torch.tensor(prompt, device=device), response.to(device)])[None]
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
        server = gen.logprobs[0, : len(response)].to(device)

        def gap(scaled: torch.Tensor) -> float:
            return float((scaled.log_softmax(-1).gather(-1, response[:, None].to(device))[:, 0] - server).abs().mean())

        if gap(logits) < gap(logits / temperature):
            raise ComponentError(f"model.rollout: the vLLM server at {self.url} returns raw log-probs; start it with "
                                 "--logprobs-mode processed_logprobs (the trainer's ratios need the log-probs of the "
                                 "distribution sampled from)")
        self._checked_logprobs = True

    # ------------------------------------------------------------------------- asynchronous
    def _answer(self, prompts: list[list[int]], sampling: Sampling, eos: list[int]) -> tuple[list[dict], float]:
        """One generation with the version checked before and after it; ``(choices, seconds)``."""
        self._check_version("before")
        start = time.perf_counter()
        choices = self._complete(prompts, sampling, eos)
        elapsed = time.perf_counter() - start
        self._check_version("after")
        return choices, elapsed

    def _current(self, model: torch.nn.Module) -> None:
        """Push the trainer's weights if the server's are older, once no request is in flight."""
        if self._version is None or self._version != self._updates:
            for sent in self._ahead.entries:
                self._wait(sent.handle)  # done, one way or the other
            self._push(model)

    def prefetch(self, model, tokenizer, prompts: list[list[int]], sampling: Sampling) -> None:
        """Asynchronous mode: send ``prompts`` now (with the current weights); a later ``generate`` with the same
        prompts and settings collects the answer. Synchronous mode: nothing."""
        if not self.max_staleness:
            return
        self._current(model)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rllight-vllm-server")
        future = self._pool.submit(self._answer, prompts, sampling, eos_token_ids(model, tokenizer))
        self._ahead.add(request_key(prompts, sampling), self._version, future)

    def _wait(self, future: Future) -> Future:
        """``future`` once done, waited for in short slices (a stop is honoured within seconds); a generation
        sent ahead makes three requests, each within the server's bound for one request."""
        done = threading.Event()
        future.add_done_callback(lambda _: done.set())
        bound = 3 * self.server.bound(1)
        if not wait_stoppable(done, bound, f"the vLLM server at {self.url}"):
            raise ComponentError(f"model.rollout: no answer from the vLLM server at {self.url} to a generation sent "
                                 f"ahead within {bound:.0f} s; check that it runs")
        return future

    def state_dict(self) -> dict:
        """The update count and, when asynchronous, the answers sent ahead (waited for)."""
        return {"updates": self._updates, "ahead": self._ahead.answers(lambda sent: self._wait(sent.handle).result())}

    def load_state_dict(self, state: dict) -> None:
        self._updates = state.get("updates", self._updates)
        for key, version, answer in state.get("ahead", []):
            future: Future = Future()
            future.set_result(tuple(answer))
            self._ahead.add(key, version, future)

    def generate(self, model, tokenizer, prompts: list[list[int]], sampling: Sampling) -> Generation:
        found = (self._ahead.claim(request_key(prompts, sampling), self._updates,
                                   lambda sent: self._wait(sent.handle).result()) if self.max_staleness else None)
        if found is None:
            if self._version is None or self.max_staleness:  # synchronous: pushes come with update_weights
                self._current(model)
            version = self._version
            choices, elapsed = self._answer(prompts, sampling, eos_token_ids(model, tokenizer))
        else:
            version, (choices, elapsed) = found[0].version, found[1]
        gen = generation_from_samples(
            prompts, [c["token_ids"] for c in choices], [c["logprobs"]["token_logprobs"] for c in choices],
            [c["finish_reason"] == "length" for c in choices], tokenizer.pad_token_id,
            next(model.parameters()).device)
        # Against the trainer's weights only when they are the ones that generated (a rollout sent ahead of an
        # update is another policy's, whatever kind of log-probs the server returns).
        if (not self._checked_logprobs and not sampling.greedy and sampling.temperature != 1.0
                and version == self._updates):
            self._check_processed_logprobs(model, prompts[0], gen, sampling.temperature)
        self.last_metrics = {"rollout/tokens_per_s": float(gen.response_mask.sum()) / max(elapsed, 1e-9),
                             "rollout/policy_version": float(version),
                             "rollout/staleness": float(self._updates - version),
                             "rollout/sync_time": self._sync_time}
        if self.max_staleness:
            self.last_metrics.update({"rollout/generated_ahead": float(found is not None),
                                      "rollout/stale_discarded": float(self._ahead.pop_discarded())})
        self._sync_time = 0.0
        return gen


__all__ = ["VLLMServerEngine"]
