"""Triton kernel that scatters new K/V rows into their cache slots, in the caches' page format."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagegate.kernels.triton_common import (
    check_page_layout,
    round_half_even,
    round_to_bfloat16,
    round_to_format,
    rounding_options,
    scale_view,
)


@triton.jit
def _inverse_scales(amax, INV_MAX: tl.constexpr):
    """1 / s for the float16 amax [H] of rows, s = amax * INV_MAX in float32; 0 where s is 0."""
    s = amax.to(tl.float32) * INV_MAX
    # div_rn: IEEE division as torch's (a plain / is approximate on CUDA)
    return tl.where(s > 0, tl.math.div_rn(tl.full(s.shape, 1.0, tl.float32), tl.where(s > 0, s, 1.0)), 0.0)


@triton.jit
def _store_rows(cache_ptr, scale_ptr, rows, dims, mask, head_mask, head_dim, x, MAX_VALUE: tl.constexpr,
                INV_MAX: tl.constexpr, INTEGER: tl.constexpr, MANTISSA: tl.constexpr, MIN_EXP: tl.constexpr,
                BFLOAT16: tl.constexpr):
    """Store rows x [H, D] at element offsets `rows` [H, 1]: as they are for float pages; for scaled pages
    (MAX_VALUE > 0) as kv_format.quantize_rows does, step for step in float32: amax (at most float16's
    largest) rounded to float16, s = amax * INV_MAX, values x * (1 / s) (0 where s is 0) clamped and rounded
    to the format, amax in the row's last two bytes."""
    if MAX_VALUE > 0:
        x = x.to(tl.float32)
        amax = tl.minimum(tl.max(tl.abs(x), 1), 65504.0).to(tl.float16)  # beyond float16: the values saturate
        inverse = _inverse_scales(amax, INV_MAX)
        x = tl.minimum(tl.maximum(x * inverse[:, None], -MAX_VALUE), MAX_VALUE)
        x = round_to_format(x, INTEGER, MANTISSA, MIN_EXP)
        tl.store(scale_ptr + (rows + head_dim) // 2, amax[:, None], mask=head_mask)
    elif BFLOAT16:
        x = round_to_bfloat16(x.to(tl.float32))
    tl.store(cache_ptr + rows + dims, x.to(cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _nibbles(x, inverse):
    """float32 values x [H, D / 2] as int4 nibbles q + 8: x * (1 / s) clamped to [-8, 7], rounded half to even (as
    kv_format._quantize_int4)."""
    q = round_half_even(tl.minimum(tl.maximum(x * inverse[:, None], -8.0), 7.0))
    return q.to(tl.int32) + 8


@triton.jit
def _store_packed_rows(cache_ptr, scale_ptr, source_ptr, rows, head_mask, head_dim, INV_MAX: tl.constexpr,
                       BLOCK_D: tl.constexpr):
    """Quantize rows [H, D] at source_ptr (+ dims) into int4 rows at byte offsets `rows` [H, 1], as
    kv_format._quantize_int4 does: value i into the low nibble of byte i, value i + D / 2 into its high one, minus
    the value of largest magnitude (the positive one of a tie) as a float16 after the D / 2 bytes."""
    half = head_dim // 2
    dims = tl.arange(0, BLOCK_D // 2)[None, :]
    mask = head_mask & (dims < half)
    low = tl.load(source_ptr + dims, mask=mask, other=0.0).to(tl.float32)
    high = tl.load(source_ptr + half + dims, mask=mask, other=0.0).to(tl.float32)
    top = tl.maximum(tl.max(low, 1), tl.max(high, 1))
    bottom = tl.minimum(tl.min(low, 1), tl.min(high, 1))
    largest = tl.where(top >= -bottom, top, bottom)
    stored = tl.minimum(tl.maximum(-largest, -65504.0), 65504.0).to(tl.float16)  # beyond float16: values saturate
    s = stored.to(tl.float32) * INV_MAX
    # div_rn: IEEE division as torch's (a plain / is approximate on CUDA)
    inverse = tl.where(s != 0, tl.math.div_rn(tl.full(s.shape, 1.0, tl.float32), tl.where(s != 0, s, 1.0)), 0.0)
    packed = _nibbles(low, inverse) | (_nibbles(high, inverse) << 4)
    tl.store(cache_ptr + rows + dims, packed.to(tl.uint8), mask=mask)
    tl.store(scale_ptr + (rows + half) // 2, stored[:, None], mask=head_mask)


@triton.jit
def _write_kv_kernel(key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, slot_ptr,
                     key_stride_t, key_stride_h, value_stride_t, value_stride_h,
                     cache_stride_block, cache_stride_slot, cache_stride_h,
                     block_size, num_kv_heads, head_dim,
                     BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, MAX_VALUE: tl.constexpr, INV_MAX: tl.constexpr,
                     INTEGER: tl.constexpr, MANTISSA: tl.constexpr, MIN_EXP: tl.constexpr, BFLOAT16: tl.constexpr,
                     PACKED: tl.constexpr):
    """One program per token: store its [Hkv, D] key and value into slot_mapping[token]."""
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot < 0:  # padding token
        return
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_D)[None, :]
    head_mask = heads < num_kv_heads
    mask = head_mask & (dims < head_dim)
    rows = (slot // block_size) * cache_stride_block + (slot % block_size) * cache_stride_slot + heads * cache_stride_h
    key_ptr += token * key_stride_t + heads * key_stride_h
    value_ptr += token * value_stride_t + heads * value_stride_h
    if PACKED:
        _store_packed_rows(k_cache_ptr, k_scale_ptr, key_ptr, rows, head_mask, head_dim, INV_MAX, BLOCK_D)
        _store_packed_rows(v_cache_ptr, v_scale_ptr, value_ptr, rows, head_mask, head_dim, INV_MAX, BLOCK_D)
    else:
        key = tl.load(key_ptr + dims, mask=mask, other=0.0)
        value = tl.load(value_ptr + dims, mask=mask, other=0.0)
        _store_rows(k_cache_ptr, k_scale_ptr, rows, dims, mask, head_mask, head_dim, key,
                    MAX_VALUE, INV_MAX, INTEGER, MANTISSA, MIN_EXP, BFLOAT16)
        _store_rows(v_cache_ptr, v_scale_ptr, rows, dims, mask, head_mask, head_dim, value,
                    MAX_VALUE, INV_MAX, INTEGER, MANTISSA, MIN_EXP, BFLOAT16)


def write_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Scatter key/value [T, Hkv, D] into their cache slots in the caches' page format (kv_format.py: scaled
    formats quantize each (token, head) row); slot -1 marks padding and is skipped."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    for tensor in (key, value):
        if tensor.stride(-1) != 1:
            raise ValueError("write_kv needs the head dimension contiguous (stride 1)")
    check_page_layout(k_cache, v_cache, head_dim)
    _write_kv_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, scale_view(k_cache), scale_view(v_cache), slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        k_cache.shape[1], num_kv_heads, head_dim,
        BLOCK_H=triton.next_power_of_2(num_kv_heads), BLOCK_D=triton.next_power_of_2(head_dim),
        **rounding_options(k_cache))
