"""Varlen attention for mixed batches: prefill, chunked prefill, prefix hits and decodes together."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagegate.kernels.triton_common import (
    attend_tile,
    check_attention_inputs,
    dot_options,
    query_operand,
    scale_view,
    score_scales,
)


def tile_sizes(device: torch.device) -> tuple[int, int]:
    """(query rows, context tokens) per tile: GPU-sized on CUDA, small under the CPU interpreter."""
    return (64, 64) if device.type == "cuda" else (16, 32)


@triton.jit
def _find_sequence(query_start_loc_ptr, tile, num_seqs, BLOCK_M: tl.constexpr):
    """The sequence that owns query tile `tile`; sequence b's tiles start at qsl[b] // BLOCK_M + b."""
    lo: tl.int32 = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        if tl.load(query_start_loc_ptr + mid) // BLOCK_M + mid <= tile:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _prefill_kernel(q_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, out_ptr, block_tables_ptr, seq_lens_ptr,
                    query_start_loc_ptr, qk_scale, cap_scale, num_seqs,
                    q_stride_t, q_stride_h, out_stride_t, out_stride_h, bt_stride_b,
                    cache_stride_block, cache_stride_slot, cache_stride_h,
                    block_size, head_dim, group, sliding_window,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                    HAS_WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, DOT_PRECISION: tl.constexpr,
                    UPCAST: tl.constexpr, SCALED: tl.constexpr, INV_MAX: tl.constexpr,
                    BOOST: tl.constexpr, PACKED: tl.constexpr):
    """Program (query tile, head): BLOCK_M query rows of one sequence, online softmax over the
    context pages they may see. Row i of a sequence with q_len queries and seq_len context
    tokens sits at position seq_len - q_len + i."""
    tile, head = tl.program_id(0), tl.program_id(1)
    seq = _find_sequence(query_start_loc_ptr, tile, num_seqs, BLOCK_M)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    first_row = (tile - (q_start // BLOCK_M + seq)) * BLOCK_M
    if first_row >= q_len:  # spare tile: the grid reserves one more per sequence than it may need
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    rows = first_row + tl.arange(0, BLOCK_M)
    row_mask = rows < q_len
    query_pos = seq_len - q_len + rows
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < head_dim
    q_offsets = (q_start + rows)[:, None].to(tl.int64) * q_stride_t + head * q_stride_h + dims[None, :]
    q_mask = row_mask[:, None] & dim_mask[None, :]
    q = tl.load(q_ptr + q_offsets, mask=q_mask, other=0.0)
    q = query_operand(q, k_cache_ptr, UPCAST, SCALED)
    kv_head = head // group
    table = block_tables_ptr + seq.to(tl.int64) * bt_stride_b
    end = tl.minimum(seq_len, seq_len - q_len + first_row + BLOCK_M)  # past the tile's last row
    start = 0
    if HAS_WINDOW:
        start = tl.maximum(0, seq_len - q_len + first_row - sliding_window + 1)
    running_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    running_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for key_tile in range(start, end, BLOCK_N):
        key_pos = key_tile + tl.arange(0, BLOCK_N)
        valid = key_pos < end
        visible = valid[None, :] & (key_pos[None, :] <= query_pos[:, None])
        if HAS_WINDOW:
            visible &= query_pos[:, None] - key_pos[None, :] < sliding_window
        running_max, running_sum, acc = attend_tile(
            q, visible, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, table, key_pos, valid, dims, dim_mask,
            kv_head, block_size, head_dim, cache_stride_block, cache_stride_slot, cache_stride_h, qk_scale, cap_scale,
            running_max, running_sum, acc, DOT_PRECISION, SOFTCAP, SCALED, INV_MAX, BOOST, PACKED)
    out = acc / tl.where(running_sum > 0, running_sum, 1.0)[:, None]
    out_offsets = (q_start + rows)[:, None].to(tl.int64) * out_stride_t + head * out_stride_h + dims[None, :]
    tl.store(out_ptr + out_offsets, out.to(out_ptr.dtype.element_ty), mask=q_mask)


def prefill_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                      scale: float, sliding_window: int | None, softcap: float | None, out: torch.Tensor) -> None:
    """Causal varlen attention of every query token in the batch over its paged context, into out
    (scores soft-capped when softcap is a positive number)."""
    check_attention_inputs(query, k_cache, v_cache)
    num_tokens, num_heads, head_dim = query.shape
    num_seqs = seq_lens.shape[0]
    block_m, block_n = tile_sizes(query.device)
    # sequence b owns tiles [qsl[b] // BLOCK_M + b, qsl[b+1] // BLOCK_M + b + 1): no host sync needed
    grid = (num_tokens // block_m + num_seqs, num_heads)
    _prefill_kernel[grid](
        query, k_cache, v_cache, scale_view(k_cache), scale_view(v_cache), out, block_tables, seq_lens, query_start_loc,
        *score_scales(scale, softcap), num_seqs,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        k_cache.shape[1], head_dim, num_heads // k_cache.shape[2], sliding_window or 0,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=triton.next_power_of_2(head_dim),
        HAS_WINDOW=sliding_window is not None, SOFTCAP=softcap is not None, **dot_options(query, k_cache))
