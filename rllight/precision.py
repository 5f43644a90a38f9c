"""``trainer.precision: auto``: bfloat16 where the hardware computes it, float32 where it does not.

``auto`` becomes, while the recipe is parsed (so ``--print_config`` and the checkpoint's recipe show the value the
run used, and the Trainer only ever sees one of Lightning's own values):

- ``bf16-mixed`` where the device computes bfloat16 natively: a CUDA device for which
  ``torch.cuda.is_bf16_supported()`` holds (Ampere and newer), or a CPU for which torch reports AVX-512 BF16 or
  AMX (``cpu_bf16_units``) and whose oneDNN, which computes the CPU's bfloat16 products, is not held below those
  instructions by ``ONEDNN_MAX_CPU_ISA`` (``onednn_isa_cap``; ``cpu_bf16``). Lightning then runs the forward
  passes under ``torch.autocast`` (matrix products in bfloat16, float32 weights, gradients and optimizer state),
  and the rollout engine's ``dtype: auto`` generates with a bfloat16 copy of the policy (``engine_dtype``).
- ``32-true`` elsewhere: an AVX2-only CPU multiplies bfloat16 matrices several times slower than float32
  (the README's measurement: 0.4-3 against 15-25 GFLOP/s), and GPUs before Ampere have no bfloat16 units
  (float16 there needs loss scaling, which is no default to choose silently).

Which device: ``trainer.accelerator`` ``cpu`` is the CPU; ``gpu`` or ``cuda`` is CUDA; ``auto`` (or unset) is
CUDA when torch sees one, else the CPU; any other accelerator keeps ``32-true``. The choice and its reason are
logged once, first thing (``precision: bf16-mixed (CPU has AVX-512 BF16)``). A recipe that names a precision
(``32-true``, ``bf16-mixed``, ...) or an engine dtype (``float32``, ``bfloat16``) keeps it: ``auto`` is a value,
not an override.
"""

from __future__ import annotations

import logging
import os

import torch
from torch import Tensor

from rllight.algorithms.logprobs import chunked_logprobs_and_entropy
from rllight.machine import ONEDNN_ISA_BOUNDS, cpu_flags

log = logging.getLogger("rllight")

AUTO = "auto"
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
"""The dtypes a recipe names by string (a model's, an engine copy's, FSDP's compute dtype)."""
ONEDNN_CACHE = "64"
"""Primitives oneDNN keeps per process (``ONEDNN_PRIMITIVE_CACHE_CAPACITY``; its default is 1024). On a CPU,
bfloat16 products run through oneDNN, which caches a compiled kernel for every new shape, and RL makes new
shapes all the time (each micro-batch's and each prompt pass's lengths), so the cache fills with kernels that are
rarely used again; float32 products (MKL) keep none. The rllight command sets this bound, and ``IDEEP_CACHE``,
unless the environment names them."""
IDEEP_CACHE = "16"
"""Primitives PyTorch's oneDNN layer (ideep) keeps in a cache of its own (``LRU_CACHE_CAPACITY``; its default is
1024), on top of oneDNN's. Measured with 600 new shapes of a SmolLM2-sized bfloat16 layer pair, forward and
backward: the resident memory grew by 820 MB at both defaults, 430 MB with oneDNN's bound at 256 alone, 55 MB at
these two bounds (32 MB in float32), in the same time (the kernels of new shapes are compiled in any case)."""
ENGINE_KEYS = ("model.rollout",)
"""Where the rollout engine's config lives; a ``dtype: auto`` in its ``init_args`` (or in those of an engine it
wraps, e.g. ``rllight.rollout.worker.ProcessEngine``'s ``engine``) follows the trainer's precision."""


def cpu_bf16_units() -> str | None:
    """The CPU's native bfloat16 units as torch reports them (``AVX-512 BF16``, ``AMX``), or None.

    torch's own checks (``torch.cpu._is_avx512_bf16_supported`` / ``_is_amx_tile_supported``, what its oneDNN
    kernels dispatch on) where this torch has them, else the /proc/cpuinfo flags ``avx512_bf16`` and
    ``amx_bf16``. An AVX-512 CPU without BF16 (e.g. Skylake) has none: its bfloat16 products are emulated.
    """
    cpu = torch.cpu
    if hasattr(cpu, "_is_avx512_bf16_supported") and hasattr(cpu, "_is_amx_tile_supported"):
        avx512_bf16, amx = cpu._is_avx512_bf16_supported(), cpu._is_amx_tile_supported()
    else:
        flags = cpu_flags()
        avx512_bf16, amx = "avx512_bf16" in flags, "amx_bf16" in flags
    if avx512_bf16:
        return "AVX-512 BF16"
    return "AMX" if amx else None


ONEDNN_BELOW_BF16 = ("SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE", "AVX512_CORE_VNNI")
"""oneDNN's ISA names (``ONEDNN_MAX_CPU_ISA``) below its first with bfloat16 products (``AVX512_CORE_BF16``). Held at
one of them, oneDNN computes bfloat16 without the CPU's units; measured on an AMD EPYC with AVX-512 BF16 (a
512x576 by 576x1536 product, one thread): 432 GFLOP/s in bfloat16 as it is, 2.1 at ``AVX2`` (as on an AVX2-only
CPU), 74 at ``AVX512_CORE``, against 84-97 in float32 at any of them."""


def onednn_isa_cap() -> str | None:
    """``ONEDNN_MAX_CPU_ISA=VALUE`` (or oneDNN's older name for it, ``DNNL_MAX_CPU_ISA``, which it reads where the
    first is unset) where the environment holds oneDNN below its bfloat16 instructions (``ONEDNN_BELOW_BF16``), else
    None: torch's own checks read the CPU, not the bound its oneDNN kernels keep to."""
    for name in ONEDNN_ISA_BOUNDS:
        value = os.environ.get(name, "").strip().upper()
        if value:
            return f"{name}={value}" if value in ONEDNN_BELOW_BF16 else None
    return None


def cpu_bf16() -> tuple[bool, str]:
    """``(whether this process's bfloat16 products on the CPU run on its native units, why)``: e.g. ``(True, "CPU
    has AVX-512 BF16")``, ``(False, "CPU has AVX-512 BF16, which ONEDNN_MAX_CPU_ISA=AVX2 keeps oneDNN from using")``,
    ``(False, "CPU has no AVX-512 BF16 or AMX (AVX2)")``."""
    units = cpu_bf16_units()
    if units is None:
        return False, f"CPU has no AVX-512 BF16 or AMX ({torch.backends.cpu.get_cpu_capability()})"
    cap = onednn_isa_cap()
    if cap is not None:
        return False, f"CPU has {units}, which {cap} keeps oneDNN from using"
    return True, f"CPU has {units}"


def cuda_bf16() -> tuple[bool, str]:
    """``(whether the CUDA device computes bfloat16 natively, its name)``; only called where CUDA is available."""
    return bool(torch.cuda.is_bf16_supported(including_emulation=False)), torch.cuda.get_device_name()


def _device(accelerator) -> str | None:
    """``cuda``, ``cpu``, or None (an accelerator ``auto`` has no rule for) for ``trainer.accelerator``."""
    name = accelerator if isinstance(accelerator, str) or accelerator is None else None
    if name in (None, "auto"):
        return "cuda" if torch.cuda.is_available() else "cpu"
    return {"cpu": "cpu", "gpu": "cuda", "cuda": "cuda"}.get(name)


def resolve_precision(accelerator=None) -> tuple[str, str]:
    """What ``trainer.precision: auto`` becomes on this machine for ``accelerator``: ``(precision, reason)``,
    e.g. ``("bf16-mixed", "CPU has AVX-512 BF16")`` or ``("32-true", "CPU has no AVX-512 BF16 or AMX (AVX2)")``."""
    device = _device(accelerator)
    if device == "cuda":
        native, name = cuda_bf16()
        if native:
            return "bf16-mixed", f"CUDA device {name} computes bfloat16"
        return "32-true", f"CUDA device {name} has no native bfloat16"
    if device == "cpu":
        native, reason = cpu_bf16()
        return ("bf16-mixed" if native else "32-true"), reason
    return "32-true", f"accelerator {accelerator!r}: auto chooses bfloat16 only on CPUs and CUDA devices"


def engine_dtype(precision) -> str | None:
    """The rollout engine's dtype that ``dtype: auto`` stands for under the trainer's ``precision``:
    ``bfloat16`` under ``bf16-mixed`` (a bfloat16 copy of the float32 policy generates), ``float16`` under
    ``16-mixed``; None otherwise: the policy's own dtype (float32, or the bfloat16 of ``bf16-true``, where the
    policy itself is already in bfloat16)."""
    return {"bf16-mixed": "bfloat16", "bf16": "bfloat16", "16-mixed": "float16", "16": "float16"}.get(str(precision))


def _engine_specs(spec):
    """Every ``init_args`` in an engine's config, the engines it wraps included."""
    init_args = getattr(spec, "init_args", None) if not isinstance(spec, dict) else spec.get("init_args")
    if init_args is None:
        return
    yield init_args
    for value in (vars(init_args) if not isinstance(init_args, dict) else init_args).values():
        if hasattr(value, "init_args") or (isinstance(value, dict) and "init_args" in value):
            yield from _engine_specs(value)


def _get(spec, key):
    return spec.get(key) if isinstance(spec, dict) else getattr(spec, key, None)


def resolve_engine_dtype(config, precision) -> None:
    """Replace each ``dtype: auto`` of the rollout engine(s) in ``config`` (a run's parsed config) by what it
    stands for under ``precision`` (``engine_dtype``); where that is the policy's own dtype, ``auto`` stays (both
    engines read it so)."""
    dtype = engine_dtype(precision)
    if dtype is None:
        return
    for key in ENGINE_KEYS:
        spec = config.get(key) if hasattr(config, "get") else None
        for init_args in _engine_specs(spec) if spec is not None else ():
            if _get(init_args, "dtype") == AUTO:
                init_args["dtype"] = dtype


TRUE_HALF = ("bf16-true", "16-true")
"""Lightning's precisions that hold the weights themselves in 16 bits: refused, with what to use instead."""


def resolve_config(config) -> None:
    """Resolve ``trainer.precision: auto`` in one subcommand's parsed ``config`` (logging the choice and why),
    then the engine's ``dtype: auto`` from the trainer's precision, whatever set it."""
    precision = config.get("trainer.precision")
    if str(precision) in TRUE_HALF:
        from rllight.errors import RecipeError

        raise RecipeError(f"trainer.precision {precision}: rllight keeps the weights and the optimizer's state in "
                          "float32 (in half precision an RL update's small steps round away, and the engines expect "
                          "float32 weights); compute in bfloat16 with bf16-mixed (or auto), or under FSDP with "
                          "trainer.strategy.init_args.param_dtype: bfloat16")
    if precision == AUTO:
        precision, reason = resolve_precision(config.get("trainer.accelerator"))
        config["trainer.precision"] = precision
        if os.environ.get("LOCAL_RANK", "0") == "0" and os.environ.get("NODE_RANK", "0") == "0":
            log.info("precision: %s (%s)", precision, reason)
    resolve_engine_dtype(config, precision)


def bound_onednn_cache() -> None:
    """Bound oneDNN's primitive cache (``ONEDNN_CACHE``) and ideep's (``IDEEP_CACHE``) unless the environment sets
    them; before the first product (each reads its variable once, when its cache is first used). Rollout worker
    processes inherit them."""
    os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", ONEDNN_CACHE)
    os.environ.setdefault("LRU_CACHE_CAPACITY", IDEEP_CACHE)


def check_float32_lm_head(config) -> None:
    """Refuse ``float32_lm_head`` with an engine that holds weights of its own (vLLM, a rollout worker, a server):
    it would compute the output layer in its own dtype, so only the trainer's half would change."""
    if not config.get("model.model.init_args.float32_lm_head"):
        return
    class_path = config.get("model.rollout.class_path")
    if not isinstance(class_path, str) or "." not in class_path:
        return
    import importlib

    from rllight.errors import RecipeError

    module, _, name = class_path.rpartition(".")
    try:
        engine = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return  # the parser names a class it cannot import itself
    if getattr(engine, "syncs_merged_weights", False):
        raise RecipeError(f"model.model.init_args.float32_lm_head: {name} holds weights of its own and computes the "
                          "output layer in its dtype, so only the trainer's would be float32; use model.rollout: "
                          "rllight.rollout.HFEngine, or set float32_lm_head: false")


class Float32Head(torch.nn.Module):
    """A policy's output layer (``lm_head``) computed in float32 whatever the model's dtype or autocast: the
    hidden states, weight and bias in float32 and ``torch.autocast`` off around the product, so the logits, and
    the log-probs read from them, carry no bfloat16 rounding of the last layer. It holds the ``nn.Linear``'s own
    parameters under the same names (``weight``, ``bias``): a tied weight stays tied to the input embedding, and
    state dicts, checkpoints and exports keep their keys. TRL and prime-rl compute the output layer in float32
    for the same reason: the engine/trainer log-prob mismatch under bfloat16 (see ``rllight.models.HFModel``'s
    ``float32_lm_head``).

    Shape: hidden (..., H) -> logits (..., V), float32.
    """

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias

    def forward(self, hidden: Tensor) -> Tensor:
        with torch.autocast(hidden.device.type, enabled=False):
            bias = None if self.bias is None else self.bias.float()
            return torch.nn.functional.linear(hidden.float(), self.weight.float(), bias)

    def chunked_logprobs_and_entropy(self, hidden: Tensor, targets: Tensor, temperature: float,
                                     chunk_size: int) -> tuple[Tensor, Tensor]:
        """``rllight.algorithms.chunked_logprobs_and_entropy`` through this layer, in float32.

        Shapes: hidden (B, T, H), targets (B, T) -> (logprobs, entropy), each (B, T)."""
        with torch.autocast(hidden.device.type, enabled=False):
            bias = None if self.bias is None else self.bias.float()
            return chunked_logprobs_and_entropy(hidden.float(), self.weight.float(), targets, temperature, bias=bias,
                                                chunk_size=chunk_size)


class _RecastLinear(torch.autograd.Function):
    """``linear`` in the autocast dtype that saves the full-precision ``weight`` for the backward pass, not its
    cast, and casts it again there: the same products as autocast's (inputs, weight and bias cast to ``dtype``;
    the gradients of full-precision inputs returned in their own dtype), without a low-precision copy of every
    weight alive from the forward pass to the backward one.

    Shapes: x (..., in), weight (out, in), bias (out,) or None -> (..., out) in ``dtype``."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None, dtype: torch.dtype) -> Tensor:
        x_low = x.to(dtype)
        with torch.autocast(x.device.type, enabled=False):
            out = torch.nn.functional.linear(x_low, weight.to(dtype), None if bias is None else bias.to(dtype))
        ctx.save_for_backward(x_low if ctx.needs_input_grad[1] else None, weight)
        ctx.dtype, ctx.x_dtype, ctx.has_bias = dtype, x.dtype, bias is not None
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        x_low, weight = ctx.saved_tensors
        grad = grad.to(ctx.dtype)
        grad_x = grad_w = grad_b = None
        with torch.autocast(grad.device.type, enabled=False):
            if ctx.needs_input_grad[0]:
                grad_x = (grad @ weight.to(ctx.dtype)).to(ctx.x_dtype)
            flat = grad.reshape(-1, grad.shape[-1])
            if ctx.needs_input_grad[1]:
                grad_w = (flat.t() @ x_low.reshape(-1, x_low.shape[-1])).to(weight.dtype)
            if ctx.has_bias and ctx.needs_input_grad[2]:
                grad_b = flat.sum(0).to(weight.dtype)
        return grad_x, grad_w, grad_b, None


class RecastWeights(torch.overrides.TorchFunctionMode):
    """Inside this context, a ``linear`` with a full-precision parameter as its weight, run with gradients under
    ``torch.autocast`` to a lower dtype, saves the parameter for the backward pass and casts it again there
    (``_RecastLinear``) instead of keeping autocast's cast of it: under ``bf16-mixed`` that cast is 2 bytes a
    parameter (0.2 GB for a 135M model) held from the forward pass until the backward one reaches its layer,
    on top of the float32 training state, which made a bfloat16 update peak higher than a float32 one. The
    price: one more cast of each weight in the backward pass, a small share of the products it feeds. Other calls,
    and every call without autocast or gradients, run unchanged. Not used on sharded (FSDP) policies, whose
    mixed precision is FSDP's own (``rllight.fsdp``)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.nn.functional.linear and torch.is_grad_enabled():
            x, weight = args[0], args[1] if len(args) > 1 else kwargs["weight"]
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            device = x.device.type
            if (type(weight) is torch.nn.Parameter and torch.is_autocast_enabled(device)  # not DTensor, 4-bit ...
                    and weight.dtype.itemsize > torch.get_autocast_dtype(device).itemsize):
                return _RecastLinear.apply(x, weight, bias, torch.get_autocast_dtype(device))
        return func(*args, **kwargs)
