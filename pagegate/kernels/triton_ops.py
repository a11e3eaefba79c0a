"""The Triton backend: the same operations as the reference, as CUDA kernels."""

from __future__ import annotations

import torch

from pagegate.kernels.reference import check_softcap
from pagegate.kernels.triton_decode import decode_attention
from pagegate.kernels.triton_prefill import prefill_attention
from pagegate.kernels.triton_write import write_kv

__all__ = ["paged_attention", "write_kv"]


def paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                    scale: float, sliding_window: int | None = None, *, softcap: float | None = None,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of each sequence's last q_len tokens over its paged context.

    A batch with one query token per sequence (T == B, every q_len >= 1) is all decode and
    takes the flash-decoding kernel; anything else takes the varlen kernel. Neither syncs.
    `softcap` (None or 0: off) caps scores as reference.paged_attention does.
    """
    softcap = check_softcap(softcap)
    out = torch.empty_like(query) if out is None else out
    if query.shape[0] == 0:
        return out
    if query.shape[0] == seq_lens.shape[0]:
        decode_attention(query, k_cache, v_cache, block_tables, seq_lens, scale, sliding_window, softcap, out)
    else:
        prefill_attention(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale,
                          sliding_window, softcap, out)
    return out
