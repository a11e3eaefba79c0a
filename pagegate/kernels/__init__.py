"""Operations on KV page data: write new K/V, paged attention, copy-on-write and swap of pages.

The torch reference runs anywhere and defines correct; Triton kernels serve CUDA tensors.
PAGEGATE_KERNEL_BACKEND=auto|reference|triton (or `backend=`) forces one. A model builds one
AttentionOps, which reads it once; the module-level functions choose on every call. Importing
this package never imports triton.
"""

from pagegate.kernels.api import AttentionOps, paged_attention, write_kv
from pagegate.kernels.blocks import copy_blocks, swap_blocks
from pagegate.kernels.dispatch import BACKEND_ENV, resolve_backend

__all__ = ["BACKEND_ENV", "AttentionOps", "copy_blocks", "paged_attention", "resolve_backend", "swap_blocks", "write_kv"]
