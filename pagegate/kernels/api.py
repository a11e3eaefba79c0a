"""The public kernel API: each call runs on the backend that dispatch picks for its tensors."""

from __future__ import annotations

import importlib
from types import ModuleType

import torch

from pagegate.kernels import reference
from pagegate.kernels.dispatch import fused_cpu_kernel, resolve_backend


def _backend(device: torch.device, backend: str | None) -> ModuleType:
    """The module implementing the chosen backend (Triton is imported only when first used)."""
    if resolve_backend(device, backend) == "triton":
        return importlib.import_module("pagegate.kernels.triton_ops")
    return reference


def write_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, *, backend: str | None = None) -> None:
    """Scatter key/value [T, Hkv, D] into cache slots slot_mapping[T]; slot -1 is padding, skipped."""
    _backend(k_cache.device, backend).write_kv(key, value, k_cache, v_cache, slot_mapping)


def paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                    scale: float, sliding_window: int | None = None, *, out: torch.Tensor | None = None,
                    backend: str | None = None) -> torch.Tensor:
    """Causal attention over paged K/V for a varlen batch of prefill, chunked-prefill and decode tokens.

    query [T, H, D] holds sequence b's tokens at query_start_loc[b]:query_start_loc[b+1]: the last
    q_len of its seq_lens[b] context tokens, all already written to the cache. Returns [T, H, D]
    (written into `out` when given, e.g. a preallocated buffer). On CPU under "auto", float32
    calls run the fused kernel of pagegate.kernels.cpu_paged when it is built.
    """
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be a positive number of tokens, got {sliding_window}")
    fused = fused_cpu_kernel(query.device, backend)
    if fused is not None and fused.supports(query, k_cache, v_cache):
        return fused.paged_attention(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale,
                                     sliding_window, out=out)
    return _backend(query.device, backend).paged_attention(
        query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, sliding_window, out=out)
