"""Which kind of device `--device` names, asking torch only where an accelerator may be there (a CPU-only core
never imports torch for it)."""

from __future__ import annotations

from pathlib import Path

ACCELERATOR_NODES = ("/dev/nvidiactl", "/proc/driver/nvidia", "/dev/kfd")  # NVIDIA's driver, ROCm's


def device_kind(device: str) -> str:
    """"cpu" or "cuda": the type of the device named ("auto": CUDA where torch finds it, else the CPU)."""
    if device != "auto":
        return device.split(":", 1)[0]
    if not any(Path(node).exists() for node in ACCELERATOR_NODES):
        return "cpu"
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"
