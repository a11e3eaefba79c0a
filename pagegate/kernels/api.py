"""The public kernel API. `AttentionOps` chooses the backend once, when a model is built: the environment,
the optional Triton import and the compiled CPU kernel are looked up then, not on every call of every layer.
The module-level functions choose per call, for one-off use and tests."""

from __future__ import annotations

import importlib
from types import ModuleType

import torch

from pagegate.kernels import reference
from pagegate.kernels.dispatch import fused_cpu_kernel, requested_backend, resolve_backend
from pagegate.kernels.kv_format import format_of
from pagegate.kernels.rotation import rotate, unrotate


class AttentionOps:
    """write_kv and paged_attention on one device's backend: "triton", or "reference" (where CPU attention over
    pages of any format, and the writes into them, run the fused Cython kernel under "auto" when it is built)."""

    def __init__(self, device: torch.device | str, backend: str | None = None) -> None:
        device = torch.device(device)
        choice = requested_backend(backend)  # the one read of PAGEGATE_KERNEL_BACKEND
        self.backend = resolve_backend(device, choice)
        self._impl: ModuleType = (importlib.import_module("pagegate.kernels.triton_ops") if self.backend == "triton"
                                  else reference)
        self._fused = fused_cpu_kernel(device, choice)

    def __repr__(self) -> str:
        return f"AttentionOps(backend={self.backend!r}, fused_cpu={self._fused is not None})"

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        """Scatter key/value [T, Hkv, D] into cache slots slot_mapping[T] in the caches' page format; slot -1 is
        padding, skipped. Rotated pages (int4) take R key and R value (rotation.py)."""
        if format_of(k_cache).rotated:
            key, value = rotate(key).to(key.dtype), rotate(value).to(value.dtype)
        if self._fused is not None and self._fused.supports(key, k_cache, v_cache) and k_cache.is_contiguous():
            self._fused.write_kv(key, value, k_cache, v_cache, slot_mapping)
            return
        self._impl.write_kv(key, value, k_cache, v_cache, slot_mapping)

    def paged_attention(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                        scale: float, sliding_window: int | None = None, *, softcap: float | None = None,
                        out: torch.Tensor | None = None, key_ends: torch.Tensor | None = None) -> torch.Tensor:
        """Causal attention over paged K/V for a varlen batch of prefill, chunked-prefill and decode tokens.

        query [T, H, D] holds sequence b's tokens at query_start_loc[b]:query_start_loc[b+1]: the last
        q_len of its seq_lens[b] context tokens, all already written to the cache. Returns [T, H, D]
        (written into `out` when given, e.g. a preallocated buffer). `softcap` (Gemma 2; None or 0:
        off) turns each scaled score s into softcap * tanh(s / softcap) before the mask and softmax.
        `key_ends` [T] (None: causal): the last position each token sees, past its own for the tokens of an image
        a model reads bidirectionally (Gemma 3; the sliding window still counts back from the token's own position).
        Such steps run on the reference kernel on every device (only image prefill steps carry them).
        """
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be a positive number of tokens, got {sliding_window}")
        softcap = reference.check_softcap(softcap)
        if key_ends is not None:
            return self._bidirectional(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale,
                                       sliding_window, softcap, out, key_ends)
        if format_of(k_cache).rotated:  # R q meets R k; the output, a sum of R v, is rotated back
            result = self._attend(rotate(query).to(query.dtype), k_cache, v_cache, block_tables, seq_lens,
                                  query_start_loc, scale, sliding_window, softcap, None)
            result = unrotate(result).to(query.dtype)
            return result if out is None else out.copy_(result)
        return self._attend(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, sliding_window,
                            softcap, out)

    @staticmethod
    def _bidirectional(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                       seq_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float, sliding_window: int | None,
                       softcap: float | None, out: torch.Tensor | None, key_ends: torch.Tensor) -> torch.Tensor:
        rotated = format_of(k_cache).rotated
        result = reference.paged_attention(rotate(query).to(query.dtype) if rotated else query, k_cache, v_cache,
                                           block_tables, seq_lens, query_start_loc, scale, sliding_window,
                                           softcap=softcap, key_ends=key_ends)
        result = unrotate(result).to(query.dtype) if rotated else result
        return result if out is None else out.copy_(result)

    def _attend(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                seq_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float, sliding_window: int | None,
                softcap: float | None, out: torch.Tensor | None) -> torch.Tensor:
        if self._fused is not None and self._fused.supports(query, k_cache, v_cache):  # dtypes: per call
            return self._fused.paged_attention(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
                                               scale, sliding_window, softcap=softcap, out=out)
        return self._impl.paged_attention(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
                                          scale, sliding_window, softcap=softcap, out=out)


def write_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, *, backend: str | None = None) -> None:
    """AttentionOps.write_kv on the backend chosen now for the cache's device."""
    AttentionOps(k_cache.device, backend).write_kv(key, value, k_cache, v_cache, slot_mapping)


def paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                    scale: float, sliding_window: int | None = None, *, softcap: float | None = None,
                    out: torch.Tensor | None = None, backend: str | None = None) -> torch.Tensor:
    """AttentionOps.paged_attention on the backend chosen now for the query's device."""
    return AttentionOps(query.device, backend).paged_attention(
        query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, sliding_window, softcap=softcap,
        out=out)
