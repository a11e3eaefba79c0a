"""Backend choice: Triton for CUDA tensors, the torch reference everywhere else."""

from __future__ import annotations

import functools
import importlib.util
import os

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


def resolve_backend(device: torch.device, backend: str | None = None) -> str:
    """Name the backend ("reference" or "triton") that runs an op on `device`.

    `backend` wins over the PAGEGATE_KERNEL_BACKEND environment variable; "auto" picks
    Triton for CUDA tensors when triton is installed and the reference otherwise.
    """
    choice = (backend or os.environ.get(BACKEND_ENV) or "auto").lower()
    if choice not in BACKENDS:
        raise ValueError(f"unknown kernel backend {choice!r}; expected one of {', '.join(BACKENDS)}")
    if choice == "auto":
        return "triton" if device.type == "cuda" and triton_available() else "reference"
    if choice == "triton":
        if not triton_available():
            raise RuntimeError("the triton kernel backend was requested but triton is not installed")
        if device.type != "cuda" and not triton_interpreted():
            raise RuntimeError(f"the triton kernel backend needs CUDA tensors (got {device.type}); "
                               "set TRITON_INTERPRET=1 before importing triton to run it on the CPU")
    return choice
