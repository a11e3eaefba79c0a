"""Reusable scratch buffers for the reference backend.

A fresh multi-megabyte CPU allocation page-faults on every call; reusing one buffer per
(name, dtype, device) keeps the decode path's gathers in warm memory. Per thread, so two
engine threads never share one.
"""

from __future__ import annotations

import math
import threading

import torch

_local = threading.local()


def scratch(name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A tensor of `shape` backed by a buffer kept for the next call (contents undefined)."""
    buffers = _local.__dict__.setdefault("buffers", {})
    numel = math.prod(shape)
    # a buffer made under inference mode cannot be written outside it (and the other way round)
    key = (name, dtype, device, torch.is_inference_mode_enabled())
    buffer = buffers.get(key)
    if buffer is None or buffer.numel() < numel:
        buffer = buffers[key] = torch.empty(numel, dtype=dtype, device=device)
    return buffer[:numel].view(shape)
