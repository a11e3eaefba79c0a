"""Pieces shared by the Triton attention kernels: the page walk, the online-softmax tile step, launch helpers."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagegate.kernels.dispatch import triton_interpreted

LOG2_E = 1.4426950408889634  # kernels use exp2, so scores are pre-scaled by log2(e)
# triton.jit reads TRITON_INTERPRET when it decorates a kernel, i.e. as these modules are imported:
# read it then too, not on every launch
INTERPRETED = triton_interpreted()


@triton.jit
def load_page_rows(cache_ptr, block_table_row_ptr, positions, valid, dims, dim_mask,
                   kv_head, block_size, cache_stride_block, cache_stride_slot, cache_stride_h):
    """Rows [positions, D] of one KV head, read through a sequence's block table; invalid rows are 0."""
    pages = tl.load(block_table_row_ptr + positions // block_size, mask=valid, other=0).to(tl.int64)
    rows = pages * cache_stride_block + (positions % block_size) * cache_stride_slot + kv_head * cache_stride_h
    return tl.load(cache_ptr + rows[:, None] + dims[None, :], mask=valid[:, None] & dim_mask[None, :], other=0.0)


@triton.jit
def tanh(x):
    """tanh from exp2 (no libdevice, so it also runs in the interpreter); saturates to +-1 where exp2 overflows."""
    return 1.0 - 2.0 / (tl.exp2(x * 2.8853900817779268) + 1.0)  # 2 * log2(e): exp2(2x log2 e) = e^2x


@triton.jit
def attend_tile(q, visible, k_cache_ptr, v_cache_ptr, table, positions, valid, dims, dim_mask, kv_head, block_size,
                cache_stride_block, cache_stride_slot, cache_stride_h, qk_scale, cap_scale, running_max, running_sum,
                acc, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr, SOFTCAP: tl.constexpr):
    """One step of the online softmax: the query rows q [M, D] against one tile of keys at `positions`,
    masked to `visible` ([M, N], or [1, N]); returns the updated running max, running sum and accumulator.
    Scores come out in log2 units: dot * qk_scale, or with SOFTCAP tanh(dot * qk_scale) * cap_scale
    (see score_scales)."""
    k = load_page_rows(k_cache_ptr, table, positions, valid, dims, dim_mask, kv_head, block_size,
                       cache_stride_block, cache_stride_slot, cache_stride_h)
    k = k.to(tl.float32) if UPCAST else k
    scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
    if SOFTCAP:
        scores = tanh(scores) * cap_scale
    scores = tl.where(visible, scores, float("-inf"))
    new_max = tl.maximum(running_max, tl.max(scores, 1))
    # a row may see nothing in this tile (causal edge, window start): keep its exps at 0, not NaN
    safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)
    alpha = tl.exp2(running_max - safe_max)
    p = tl.exp2(scores - safe_max[:, None])
    running_sum = running_sum * alpha + tl.sum(p, 1)
    v = load_page_rows(v_cache_ptr, table, positions, valid, dims, dim_mask, kv_head, block_size,
                       cache_stride_block, cache_stride_slot, cache_stride_h)
    v = v.to(tl.float32) if UPCAST else v
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return new_max, running_sum, acc


def score_scales(scale: float, softcap: float | None) -> tuple[float, float]:
    """(qk_scale, cap_scale) for attend_tile: scale * log2(e) and unused without a soft-cap; with one,
    softcap * tanh(dot * scale / softcap) * log2(e) as tanh(dot * qk_scale) * cap_scale."""
    if softcap is None:
        return scale * LOG2_E, 0.0
    return scale / softcap, softcap * LOG2_E


def dot_options(cache: torch.Tensor) -> dict:
    """Constexprs that keep dots exact enough: IEEE float32 (not TF32) for float32 caches, and
    float32 dots for bfloat16 under the interpreter, whose bfloat16 tl.dot is broken upstream."""
    upcast = cache.dtype == torch.bfloat16 and INTERPRETED
    return {"DOT_PRECISION": "ieee" if cache.dtype == torch.float32 or upcast else "tf32", "UPCAST": upcast}


def check_attention_inputs(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """Reject layouts the kernels do not handle instead of reading the wrong memory."""
    if query.stride(-1) != 1 or k_cache.stride(-1) != 1:
        raise ValueError("paged_attention needs the head dimension contiguous (stride 1)")
    if k_cache.stride() != v_cache.stride():
        raise ValueError("k_cache and v_cache must share one layout")
    if query.shape[1] % k_cache.shape[2]:
        raise ValueError(f"{query.shape[1]} query heads do not divide into {k_cache.shape[2]} KV heads")
