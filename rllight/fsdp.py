"""Fully sharded data parallel training (FSDP2, ``torch.distributed.fsdp.fully_shard``) through Lightning's
``ModelParallelStrategy``: each process holds a shard of the policy's (and critic's) weights, gradients and
optimizer state, on GPUs with NCCL and on CPU processes with gloo.

A recipe selects it as ``trainer.strategy: {class_path: rllight.fsdp.FSDP}``. What changes in an RL step:

- Each decoder layer is one FSDP unit; everything else (embeddings, final norm, output layer, value heads) is
  held by one root unit around the scoring passes (``Scoring.run``), because those passes call the decoder
  and the output layer directly rather than the model's ``forward``.
- FSDP gathers weights inside every forward and reduces gradients inside every backward, so every rank must
  run the same number of passes: a rank with fewer micro-batches (or no rows) runs passes on a padding row
  whose loss is multiplied by zero (``padding_row``).
- Gradients are summed over ranks, not averaged: the losses are already normalised by global token or
  sequence counts (``set_gradient_divide_factor(1)``), as in the DDP path.
- The in-process engine (``HFEngine``) generates from its own full copy of the policy, taken before sharding
  and refreshed after each update one parameter at a time (``full_tensor``), so a rank never holds two full
  copies of the trained weights besides its shard. vLLM engines hold a copy of their own anyway.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import Tensor, nn

from rllight.dtensor import full_tensor, is_dtensor
from rllight.errors import RecipeError
from rllight.precision import DTYPES
from rllight.types import Rollout


class FSDP(ModelParallelStrategy):
    """Lightning's ``ModelParallelStrategy`` as plain data-parallel FSDP2 over every process of the run (one
    data-parallel mesh dimension of size ``devices x num_nodes``, no tensor parallelism), CPU included.

    Args:
        save_distributed_checkpoint: Each rank saves its own shard into a checkpoint folder (default); False
            gathers a single full checkpoint file on rank 0.
        process_group_backend: None = NCCL on GPUs, gloo on CPUs.
        param_dtype: FSDP2's mixed precision (``MixedPrecisionPolicy``): the decoder layers gather their weights
            in this dtype and compute in it (e.g. ``bfloat16``), while the shards, the gradients the optimizer
            sees and its state stay float32. The root unit (embeddings, final norm, output layer, value heads)
            stays in the weights' dtype, so the log-probs are read from a float32 output layer. None (default):
            the weights' own dtype; ``trainer.precision: bf16-mixed`` then computes under autocast instead. The two
            compose; with ``param_dtype`` the usual pairing is ``trainer.precision: 32-true`` (no autocast).
        reduce_dtype: The dtype the gradients are summed over ranks in (with ``param_dtype``); float32 by default,
            as torchtitan and verl do, so the sum carries no bfloat16 rounding.
    """

    def __init__(self, save_distributed_checkpoint: bool = True, process_group_backend: str | None = None,
                 param_dtype: str | None = None, reduce_dtype: str = "float32", **kwargs):
        super().__init__(save_distributed_checkpoint=save_distributed_checkpoint,
                         process_group_backend=process_group_backend, **kwargs)
        self.param_dtype = _dtype(param_dtype, "param_dtype") if param_dtype is not None else None
        self.reduce_dtype = _dtype(reduce_dtype, "reduce_dtype")

    def mixed_precision(self):
        """The ``MixedPrecisionPolicy`` of the decoder layers (None: the weights' own dtype)."""
        if self.param_dtype is None:
            return None
        from torch.distributed.fsdp import MixedPrecisionPolicy

        return MixedPrecisionPolicy(param_dtype=self.param_dtype, reduce_dtype=self.reduce_dtype)

    def setup_environment(self) -> None:
        world = self.num_nodes * self.num_processes
        self._data_parallel_size, self._tensor_parallel_size = world, 1
        super().setup_environment()


def _dtype(name: str, key: str) -> torch.dtype:
    if name not in DTYPES:
        raise RecipeError(f"trainer.strategy.init_args.{key}={name!r} is not a dtype FSDP can compute in; use one of "
                          f"{', '.join(DTYPES)}")
    return DTYPES[name]


def is_sharded(trainer) -> bool:
    """Whether ``trainer`` (None = no run) trains with ``FSDP``."""
    return trainer is not None and isinstance(getattr(trainer, "strategy", None), ModelParallelStrategy)


class _Pass(nn.Module):
    """The root FSDP unit: holds every sharded model, and its ``forward`` runs a scoring pass (a function of
    no arguments) while the root's weights are gathered."""

    def __init__(self, **models: nn.Module):
        super().__init__()
        for name, model in models.items():
            self.add_module(name, model)

    def forward(self, fn):
        return fn()


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The decoder layers of a causal LM (a peft model's too), of a critic's backbone, or none (a value head)."""
    owner = getattr(model, "backbone", None)
    owner = model if owner is None else owner
    if hasattr(owner, "layers"):
        return list(owner.layers)
    if hasattr(owner, "get_decoder"):
        return list(getattr(owner.get_decoder(), "layers", []))
    return []


def shard(models: dict[str, nn.Module], mesh, mixed_precision=None) -> nn.Module:
    """Shard ``models`` (the policy, a critic) over the data-parallel ``mesh``: one unit per decoder layer (with
    ``mixed_precision``, a ``MixedPrecisionPolicy``, if given) and a root unit (returned) holding the rest.
    Gradients are summed over ranks."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    # The root's outputs are views (log-probs of the response positions); nothing changes them in place, which
    # is what torch warns about on every pass.
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    for model in models.values():
        for layer in decoder_layers(model):
            fully_shard(layer, mesh=mesh, **({"mp_policy": mixed_precision} if mixed_precision is not None else {}))
    root = fully_shard(_Pass(**models), mesh=mesh)
    for module in root.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # a plain sum (gloo has no pre-multiplied sum)
    return root


def padding_row(like: Rollout) -> Rollout:
    """One row shaped like ``like``'s rows (every field it has, zeros; one prompt and one response token), for
    a pass a rank must run to keep step with the others when it has no rows of its own left. Its loss is
    multiplied by zero."""
    device = like.response_mask.device
    one = torch.ones((1, 1), dtype=torch.long, device=device)
    fields = {}
    for name in ("rewards", "correct", "old_logprobs", "ref_logprobs", "values", "advantages", "returns",
                 "token_rewards", "dense_rewards"):
        value = getattr(like, name)
        if value is not None:
            fields[name] = torch.zeros((1, 1) if value.dim() == 2 else (1,), dtype=value.dtype, device=device)
    extras = {k: torch.zeros((1, *v.shape[1:]), dtype=v.dtype, device=v.device)
              if torch.is_tensor(v) and v.dim() and v.shape[0] == len(like) else v for k, v in like.extras.items()}
    return Rollout(prompt_ids=one * 0, prompt_mask=one, response_ids=one * 0, response_mask=one,
                   sample_logprobs=torch.zeros((1, 1), device=device),
                   truncated=torch.zeros(1, dtype=torch.bool, device=device),
                   group_ids=torch.zeros(1, dtype=torch.long, device=device), answers=[""], texts=[""], extras=extras,
                   **fields)


def padding_passes(count: int, sharded: bool, device) -> int:
    """How many passes on a padding row this rank adds to its ``count`` to run as many as the rank with the most
    (a collective under FSDP; 0 elsewhere)."""
    if not sharded:
        return 0
    most = torch.tensor(float(count), device=device)
    torch.distributed.all_reduce(most, op=torch.distributed.ReduceOp.MAX)
    return int(most.item()) - count


def gathered_policy(policy: nn.Module, lora=None) -> nn.Module | None:
    """A plain (unsharded) copy of a sharded ``policy`` on rank 0 (None on the other ranks), e.g. to export it;
    every rank must call it. ``lora``: the recipe's ``LoRA``, to rebuild a peft policy's adapters."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full = get_model_state_dict(policy, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if torch.distributed.get_rank() != 0:
        return None
    base = policy.get_base_model() if lora is not None else policy
    plain = type(base)(base.config)
    if lora is not None:
        plain = lora.apply(plain)
    plain.load_state_dict(full)
    return plain


__all__ = ["FSDP", "decoder_layers", "full_tensor", "gathered_policy", "is_dtensor", "is_sharded",
           "padding_passes", "padding_row", "shard"]
