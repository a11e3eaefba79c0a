"""Backend choice: Triton for CUDA tensors, the torch reference everywhere else.

Under "auto", CPU float32 attention inside the reference backend runs the fused Cython kernel
(pagegate.kernels.cpu_paged) when it is built; naming "reference" keeps the pure torch path.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os
from types import ModuleType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

BACKEND_ENV = "PAGEGATE_KERNEL_BACKEND"
BACKENDS = ("auto", "reference", "triton")


@functools.cache
def triton_available() -> bool:
    """True when the triton package can be imported (it is optional)."""
    try:
        return importlib.util.find_spec("triton") is not None
    except (ImportError, ValueError):  # ValueError: sys.modules["triton"] is None (import blocked)
        return False


def triton_interpreted() -> bool:
    """True when Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


@functools.cache
def _extension(name: str) -> ModuleType | None:
    """A compiled kernel module of this package, or None when it was not built (or cannot load)."""
    try:
        return importlib.import_module(f"pagegate.kernels.{name}")
    except ImportError:
        return None


def cpu_kernel() -> ModuleType | None:
    """The fused CPU attention extension (cpu_paged), or None."""
    return _extension("cpu_paged")


def quant_kernel() -> ModuleType | None:
    """The CPU quantized-matmul extension (cpu_quant), or None."""
    return _extension("cpu_quant")


def decode_kernel() -> ModuleType | None:
    """The native decode-step extension (cpu_decode), or None."""
    return _extension("cpu_decode")


def sample_kernel() -> ModuleType | None:
    """The C sampler extension (cpu_sample), or None."""
    return _extension("cpu_sample")


INTEGER_ISAS = ("avx512", "vnni", "avx2", "portable")  # the integer dot products' instruction sets, fastest first


def _integer_modules() -> list[ModuleType]:
    """The built extensions that run integer dot products; each links its own copy of cpu_qdot.h and keeps its own
    instruction set, so these functions set them together."""
    return [m for m in (quant_kernel(), decode_kernel()) if m is not None]


def integer_isa() -> str:
    """The instruction set the integer dot products run on: one of INTEGER_ISAS."""
    modules = _integer_modules()
    return str(modules[0]._isa()) if modules else "portable"


def set_integer_isa(name: str) -> bool:
    """Run the integer dot products on `name` if this CPU has it (tests force each one); False, changing nothing,
    if not (the modules share their C, so they accept the same names)."""
    return name in INTEGER_ISAS and all([bool(m._set_isa(name)) for m in _integer_modules()])


def integer_isas() -> list[str]:
    """The instruction sets of INTEGER_ISAS this CPU has, fastest first."""
    before = integer_isa()
    try:
        return [name for name in INTEGER_ISAS if set_integer_isa(name)]
    finally:
        set_integer_isa(before)


def default_threads() -> int:
    """The CPUs this process may run on: the threads a C step or the C sampler takes unless told otherwise (the
    torch runner tells them torch's)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def requested_backend(backend: str | None = None) -> str:
    """The backend asked for: `backend`, else PAGEGATE_KERNEL_BACKEND, else "auto" (validated)."""
    choice = (backend or os.environ.get(BACKEND_ENV) or "auto").lower()
    if choice not in BACKENDS:
        raise ValueError(f"unknown kernel backend {choice!r}; expected one of {', '.join(BACKENDS)}")
    return choice


def fused_cpu_kernel(device: torch.device, backend: str | None = None) -> ModuleType | None:
    """The fused CPU attention kernel when attention on `device` may use it (CPU tensors, backend
    "auto", extension built); None sends attention to the backend resolve_backend names."""
    if device.type != "cpu" or requested_backend(backend) != "auto":
        return None
    return cpu_kernel()


def resolve_backend(device: torch.device, backend: str | None = None) -> str:
    """Name the backend ("reference" or "triton") that runs an op on `device`.

    `backend` wins over the PAGEGATE_KERNEL_BACKEND environment variable; "auto" picks
    Triton for CUDA tensors when triton is installed and the reference otherwise.
    """
    choice = requested_backend(backend)
    if choice == "auto":
        return "triton" if device.type == "cuda" and triton_available() else "reference"
    if choice == "triton":
        if not triton_available():
            raise RuntimeError("the triton kernel backend was requested but triton is not installed")
        if device.type != "cuda" and not triton_interpreted():
            raise RuntimeError(f"the triton kernel backend needs CUDA tensors (got {device.type}); "
                               "set TRITON_INTERPRET=1 before importing triton to run it on the CPU")
    return choice
