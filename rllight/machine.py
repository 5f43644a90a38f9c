"""The machine a measurement ran on, in one line: CPU model, cores, its bfloat16 units, GPU and load.

A CPU number means little without it: this project's machines range from AVX2-only CPUs, on which a bfloat16
matrix product runs far slower than a float32 one, to CPUs with AVX-512 BF16 and AMX, and other jobs sometimes
share the cores. The tools in ``tools/`` print :func:`machine_line` just before their last ``name=value`` line,
and ``tools/rerun_numbers.py`` prints it above its table. Standard library only: importing this costs nothing.
"""

from __future__ import annotations

import os
import platform
import sys


def _read_cpuinfo(path: str) -> tuple[str, set[str]]:
    """(model name, feature flags) of the first CPU in ``path`` (``("", set())`` where it cannot be read)."""
    model, flags = "", set()
    try:
        with open(path) as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name" and not model:
                    model = value.strip()
                elif key == "flags" and not flags:
                    flags = set(value.split())
                if model and flags:
                    break
    except OSError:
        pass
    return model, flags


def cpu_flags(path: str = "/proc/cpuinfo") -> set[str]:
    """The CPU's feature flags (``avx2``, ``avx512_bf16``, ``amx_bf16``, ...); empty where there is no ``path``."""
    return _read_cpuinfo(path)[1]


def cpu_info(path: str = "/proc/cpuinfo") -> dict:
    """``{"model": str, "cores": int, "avx2": bool, "avx512_bf16": bool, "amx": bool}`` for this process's CPU.

    ``cores`` are the ones this process may run on; ``amx`` means AMX with bfloat16 tiles (``amx_bf16``). Where
    ``path`` cannot be read (not Linux), the flags are False and the model is ``platform.processor()``.
    """
    model, flags = _read_cpuinfo(path)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return {"model": model or platform.processor() or "unknown CPU", "cores": cores, "avx2": "avx2" in flags,
            "avx512_bf16": "avx512_bf16" in flags, "amx": "amx_bf16" in flags}


def gpu_name() -> str | None:
    """The first CUDA device's name, when torch is already imported and sees one (never imports torch)."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_name(0)


ONEDNN_ISA_BOUNDS = ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA")
"""oneDNN's bound on its kernels' instruction set, under its current name and the older one it reads where the first
is unset (``rllight.precision.onednn_isa_cap`` reads them for ``auto``)."""
ISA_BOUNDS = (*ONEDNN_ISA_BOUNDS, "MKL_ENABLE_INSTRUCTIONS", "ATEN_CPU_CAPABILITY")
"""Environment variables that hold torch's CPU kernels below the CPU's instruction set (oneDNN's, under its new and
old name, MKL's, ATen's own): set, they make a CPU compute as an older one would (e.g. all at AVX2 on a CPU with
AVX-512 BF16, where a bfloat16 product then runs some 200 times slower), so a number measured under them says so."""


def isa_bounds() -> str:
    """``ONEDNN_MAX_CPU_ISA=AVX2 ...``: the ``ISA_BOUNDS`` the environment sets, or ``""``."""
    return " ".join(f"{name}={os.environ[name]}" for name in ISA_BOUNDS if os.environ.get(name))


def machine_line(path: str = "/proc/cpuinfo") -> str:
    """``machine: <CPU model>, <n> cores, AVX-512 BF16 yes|no, AMX yes|no, GPU <name>|none, load <1-min load>``,
    followed by ``, kernels held at <ISA_BOUNDS set>`` where the environment bounds the kernels' instructions.

    The load average counts every process on the machine: near the core count or above means the cores were
    shared while the tool ran (read it with the tool's numbers: a shared machine makes them slower and noisier).
    """
    cpu = cpu_info(path)
    yes = {True: "yes", False: "no"}
    load = f"{os.getloadavg()[0]:.1f}" if hasattr(os, "getloadavg") else "?"
    bounds = isa_bounds()
    return (f"machine: {cpu['model']}, {cpu['cores']} cores, AVX-512 BF16 {yes[cpu['avx512_bf16']]}, "
            f"AMX {yes[cpu['amx']]}, GPU {gpu_name() or 'none'}, load {load}"
            + (f", kernels held at {bounds}" if bounds else ""))


__all__ = ["ISA_BOUNDS", "ONEDNN_ISA_BOUNDS", "cpu_flags", "cpu_info", "gpu_name", "isa_bounds",
           "machine_line"]
