"""Flash-decoding: one query token per sequence, long contexts split across programs."""

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

DECODE_BLOCK_N = 64  # context tokens per inner step
MIN_SPLIT_TOKENS = 256  # a split shorter than this costs more in the reduction than it saves
MAX_SPLITS = 32


@triton.jit
def _decode_split_kernel(q_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, block_tables_ptr, seq_lens_ptr,
                         acc_ptr, max_ptr, sum_ptr, out_ptr, qk_scale, cap_scale,
                         q_stride_t, q_stride_h, out_stride_t, out_stride_h, bt_stride_b,
                         cache_stride_block, cache_stride_slot, cache_stride_h,
                         block_size, head_dim, group, split_len, sliding_window,
                         BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                         SINGLE_SPLIT: tl.constexpr, HAS_WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
                         DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr, SCALED: tl.constexpr,
                         INV_MAX: tl.constexpr, BOOST: tl.constexpr, PACKED: tl.constexpr):
    """Program (sequence, KV head, split): the `group` query heads of that KV head over one
    split of the context. Writes the final output when there is one split, else the split's
    unnormalised accumulator, running max and sum (partials laid out [B, H, splits, ...])."""
    seq, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    num_splits = tl.num_programs(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)
    if HAS_WINDOW:  # the query sits at seq_len - 1 and sees keys k with seq_len - 1 - k < window
        start = tl.maximum(start, seq_len - sliding_window)
    g = tl.arange(0, BLOCK_G)
    heads = kv_head * group + g
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < head_dim
    q_mask = (g < group)[:, None] & dim_mask[None, :]
    q = tl.load(q_ptr + seq * q_stride_t + heads[:, None] * q_stride_h + dims[None, :], mask=q_mask, other=0.0)
    q = query_operand(q, k_cache_ptr, UPCAST, SCALED)
    running_max = tl.full([BLOCK_G], float("-inf"), tl.float32)
    running_sum = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * bt_stride_b
    for tile in range(start, end, BLOCK_N):
        positions = tile + tl.arange(0, BLOCK_N)
        valid = positions < end
        running_max, running_sum, acc = attend_tile(
            q, valid[None, :], k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, table, positions, valid, dims,
            dim_mask, kv_head, block_size, head_dim, cache_stride_block, cache_stride_slot, cache_stride_h, qk_scale,
            cap_scale, running_max, running_sum, acc, DOT_PRECISION, SOFTCAP, SCALED, INV_MAX, BOOST, PACKED)
    if SINGLE_SPLIT:
        out = acc / running_sum[:, None]
        out_offsets = seq * out_stride_t + heads[:, None] * out_stride_h + dims[None, :]
        tl.store(out_ptr + out_offsets, out.to(out_ptr.dtype.element_ty), mask=q_mask)
    else:
        stat_offsets = (seq * tl.num_programs(1) * group + heads) * num_splits + split
        tl.store(max_ptr + stat_offsets, running_max, mask=g < group)
        tl.store(sum_ptr + stat_offsets, running_sum, mask=g < group)
        tl.store(acc_ptr + stat_offsets[:, None] * head_dim + dims[None, :], acc, mask=q_mask)


@triton.jit
def _decode_reduce_kernel(acc_ptr, max_ptr, sum_ptr, out_ptr, out_stride_t, out_stride_h,
                          head_dim, num_splits, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    """Program (sequence, head): merge the splits' partial softmaxes into the output row."""
    seq, head = tl.program_id(0), tl.program_id(1)
    row = seq * tl.num_programs(1) + head
    splits = tl.arange(0, BLOCK_S)
    dims = tl.arange(0, BLOCK_D)
    split_mask = splits < num_splits
    # a split past the context (or before the window) left max -inf and sum 0: weight 0
    maxes = tl.load(max_ptr + row * num_splits + splits, mask=split_mask, other=float("-inf"))
    sums = tl.load(sum_ptr + row * num_splits + splits, mask=split_mask, other=0.0)
    weights = tl.exp2(maxes - tl.max(maxes, 0))
    acc_offsets = (row * num_splits + splits)[:, None] * head_dim + dims[None, :]
    accs = tl.load(acc_ptr + acc_offsets, mask=split_mask[:, None] & (dims < head_dim)[None, :], other=0.0)
    out = tl.sum(accs * weights[:, None], 0) / tl.sum(sums * weights, 0)
    tl.store(out_ptr + seq * out_stride_t + head * out_stride_h + dims, out.to(out_ptr.dtype.element_ty),
             mask=dims < head_dim)


def _context_bound(block_tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int) -> int:
    """An upper bound on the longest context, read without a device sync."""
    if seq_lens.device.type == "cpu":
        return max(int(seq_lens.max()), 1)
    return block_tables.shape[1] * block_size


def _target_programs(device: torch.device) -> int:
    """Programs that keep the device busy: a few waves per SM on CUDA, a handful elsewhere."""
    if device.type == "cuda":
        return 4 * torch.cuda.get_device_properties(device).multi_processor_count
    return 8


def split_length(num_seqs: int, num_kv_heads: int, context_bound: int, device: torch.device) -> int:
    """Context tokens per split: split only while there are too few (sequence, head) programs."""
    wanted = triton.cdiv(_target_programs(device), num_seqs * num_kv_heads)
    splits = max(1, min(wanted, MAX_SPLITS, triton.cdiv(context_bound, MIN_SPLIT_TOKENS)))
    return triton.cdiv(triton.cdiv(context_bound, splits), DECODE_BLOCK_N) * DECODE_BLOCK_N


def decode_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                     seq_lens: torch.Tensor, scale: float, sliding_window: int | None, softcap: float | None,
                     out: torch.Tensor) -> None:
    """Attention of one query token per sequence (query [B, H, D]) over its paged context, into out
    (scores soft-capped when softcap is a positive number)."""
    check_attention_inputs(query, k_cache, v_cache)
    num_seqs, num_heads, head_dim = query.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    bound = _context_bound(block_tables, seq_lens, block_size)
    split_len = split_length(num_seqs, num_kv_heads, bound, query.device)
    num_splits = triton.cdiv(bound, split_len)
    partial_shape = (num_seqs, num_heads, num_splits)
    acc = torch.empty((*partial_shape, head_dim) if num_splits > 1 else (1,), dtype=torch.float32, device=query.device)
    maxes = torch.empty(partial_shape if num_splits > 1 else (1,), dtype=torch.float32, device=query.device)
    sums = torch.empty_like(maxes)
    block_d = triton.next_power_of_2(head_dim)
    _decode_split_kernel[(num_seqs, num_kv_heads, num_splits)](
        query, k_cache, v_cache, scale_view(k_cache), scale_view(v_cache), block_tables, seq_lens, acc, maxes, sums,
        out, *score_scales(scale, softcap),
        query.stride(0), query.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_size, head_dim, group, split_len, sliding_window or 0,
        BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_N=DECODE_BLOCK_N, BLOCK_D=block_d,
        SINGLE_SPLIT=num_splits == 1, HAS_WINDOW=sliding_window is not None, SOFTCAP=softcap is not None,
        **dot_options(query, k_cache))
    if num_splits > 1:
        _decode_reduce_kernel[(num_seqs, num_heads)](
            acc, maxes, sums, out, out.stride(0), out.stride(1), head_dim, num_splits,
            BLOCK_S=triton.next_power_of_2(num_splits), BLOCK_D=block_d)
