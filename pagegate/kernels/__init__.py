"""Operations on KV page data: write new K/V, paged attention, copy-on-write and swap of pages.

The torch reference runs anywhere and defines correct; Triton kernels serve CUDA tensors.
PAGEGATE_KERNEL_BACKEND=auto|reference|triton (or `backend=`) forces one. A model builds one
AttentionOps, which reads it once; the module-level functions choose on every call. Importing
this package never imports triton, nor torch: the names below load their modules when first used, so the
native step's extensions (cpu_decode, cpu_quant, cpu_sample) serve an engine core that never imports torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_HOMES = {"AttentionOps": "api", "paged_attention": "api", "write_kv": "api", "copy_blocks": "blocks",
          "swap_blocks": "blocks", "BACKEND_ENV": "dispatch", "resolve_backend": "dispatch"}

__all__ = ["BACKEND_ENV", "AttentionOps", "copy_blocks", "paged_attention", "resolve_backend", "swap_blocks", "write_kv"]


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_HOMES[name]}"), name)
