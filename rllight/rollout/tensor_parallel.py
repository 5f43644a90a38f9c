"""Tensor parallelism across rollout workers: the training ranks whose workers run one engine split across them
(``TensorParallelGroup``), and each rank's own rows of what the group generated (``own_rows``)."""

from __future__ import annotations

import os
import socket
from typing import Any

import torch

from rllight.errors import RecipeError
from rllight.rollout.base import Generation


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TensorParallelGroup:
    """The training ranks whose rollout workers run one tensor-parallel engine: ``size`` consecutive ranks, on one
    machine. ``gather`` collects an object from each (over a gloo group of these ranks, whatever the trainer's
    backend); ``env`` is what the rank's worker sets to join vLLM's group (``external_launcher``: ``env://``)."""

    def __init__(self, size: int):
        import torch.distributed as dist

        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        if world % size:  # also refused before the model loads (ProcessEngine.check_processes)
            raise RecipeError(groups_message(size, world))
        self.size = size
        self.group, _ = dist.new_subgroups(group_size=size, backend="gloo")  # a collective: every rank, at once
        self.rank = dist.get_rank(self.group)
        members = self.gather((socket.gethostname(), free_port() if self.rank == 0 else None))
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


def groups_message(size: int, world: int) -> str:
    return (f"{TENSOR_PARALLEL}={size}: each engine spans {size} training processes, and {world} do not make groups "
            f"of {size}; make trainer.devices x trainer.num_nodes a multiple of it")


def own_rows(gen: Generation, rows: slice) -> Generation:
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
