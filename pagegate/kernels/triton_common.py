"""Pieces shared by the Triton kernels: the page walk, in-register page formats, the online-softmax tile step,
launch helpers.

Page formats (kv_format.py): float pages hold the values; a scaled page (int8, fp8) holds each (token, KV head)
row's values and then the row's largest magnitude (amax) as a float16 in its last two bytes; the row's scale is
amax * INV_MAX (1 / max_value rounded to float32, kv_format.KVFormat.inverse_max) in float32. The kernels read
amax through a float16 view of the same cache (scale_view): the amax of the row at byte offset r sits at
float16 offset (r + head_dim) // 2. int4 pages (PACKED) hold head_dim / 2 bytes of values a row, value i in the
low nibble of byte i and value i + head_dim / 2 in its high one, each stored as q + 8: their amax sits at
float16 offset (r + head_dim / 2) // 2.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from pagegate.kernels.dispatch import triton_interpreted
from pagegate.kernels.kv_format import KVFormat, as_bytes, format_of
from pagegate.kernels.rotation import rotatable

LOG2_E = 1.4426950408889634  # kernels use exp2, so scores are pre-scaled by log2(e)
# triton.jit reads TRITON_INTERPRET when it decorates a kernel, i.e. as these modules are imported:
# read it then too, not on every launch
INTERPRETED = triton_interpreted()


@triton.jit
def page_row_offsets(block_table_row_ptr, positions, valid, kv_head, block_size,
                     cache_stride_block, cache_stride_slot, cache_stride_h):
    """Element offsets of the rows of one KV head at context `positions`, read through a sequence's block table
    (K and V caches share one layout, so one walk serves both)."""
    pages = tl.load(block_table_row_ptr + positions // block_size, mask=valid, other=0).to(tl.int64)
    return pages * cache_stride_block + (positions % block_size) * cache_stride_slot + kv_head * cache_stride_h


@triton.jit
def load_rows(cache_ptr, rows, valid, dims, dim_mask, head_dim, dtype: tl.constexpr, PACKED: tl.constexpr):
    """The stored values [N, D] of rows at `rows` converted to `dtype` in registers; invalid rows are 0.
    PACKED (int4) rows give value i from byte i % (D / 2), shifted by 4 * (i // (D / 2)), less 8 (exact in
    every dtype the dots run in); their D is a power of two (check_page_layout), so D / 2 is half of dims' block
    and a constant: the index arithmetic compiles to shifts and masks."""
    mask = valid[:, None] & dim_mask[None, :]
    if PACKED:
        half: tl.constexpr = dims.shape[0] // 2
        packed = tl.load(cache_ptr + rows[:, None] + (dims % half)[None, :], mask=mask, other=0).to(tl.int32)
        values = ((packed >> (4 * (dims // half))[None, :]) & 15) - 8
    else:
        values = tl.load(cache_ptr + rows[:, None] + dims[None, :], mask=mask, other=0.0)
    return values.to(dtype)


@triton.jit
def load_scales(scale_ptr, rows, valid, head_dim, INV_MAX: tl.constexpr, PACKED: tl.constexpr):
    """The float32 scales [N] of scaled rows at byte offsets `rows`: the float16 amax in their last two bytes
    (after head_dim value bytes, head_dim / 2 when PACKED) times INV_MAX, as kv_format.dequantize_rows computes
    them."""
    value_bytes = head_dim
    if PACKED:
        value_bytes = head_dim // 2
    return tl.load(scale_ptr + (rows + value_bytes) // 2, mask=valid, other=0.0).to(tl.float32) * INV_MAX


@triton.jit
def round_half_even(x):
    """x rounded to an integer, ties to even (as torch.round), for float32 |x| < 2**22: adding 1.5 * 2**23 leaves
    no fraction bits, and the add rounds half to even."""
    return (x + 12582912.0) - 12582912.0


@triton.jit
def round_to_format(x, INTEGER: tl.constexpr, MANTISSA: tl.constexpr, MIN_EXP: tl.constexpr):
    """float32 x (within the format's range) rounded, half to even, to the nearest value of a one-byte format:
    an integer for int8, else the value of a float with MANTISSA mantissa bits and normal exponents >= MIN_EXP.
    NOTE: the rounding is done here in float32 (steps are powers of two, so every product is exact) and the
    conversion to fp8 then only changes the type: Triton's interpreter rounds float32 -> fp8 wrongly where
    rounding up carries into the exponent (7.79 becomes 4.0 in e4m3), and this way the interpreter and the GPU
    store the same bytes as torch's conversion. A negative x keeps its sign, -0.0 included, as torch's does."""
    if INTEGER:
        return round_half_even(x)
    bits = x.to(tl.int32, bitcast=True)
    exponent = tl.maximum(((bits >> 23) & 0xFF) - 127, MIN_EXP)  # a subnormal's step is the smallest normal's
    step = ((exponent - MANTISSA + 127) << 23).to(tl.float32, bitcast=True)
    inverse_step = ((127 - exponent + MANTISSA) << 23).to(tl.float32, bitcast=True)
    rounded = round_half_even(tl.abs(x) * inverse_step) * step
    return tl.where(bits < 0, -rounded, rounded)


@triton.jit
def round_to_bfloat16(x):
    """float32 x rounded half to even to bfloat16's precision (still float32; NaN stays NaN), as torch's
    conversion does. NOTE: Triton's interpreter truncates float32 -> bfloat16; rounding first makes the
    interpreter store what the GPU (and torch) store, and costs the GPU a few integer ops per written value."""
    bits = x.to(tl.int32, bitcast=True)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) & -65536).to(tl.float32, bitcast=True)
    return tl.where(x != x, x, rounded)


@triton.jit
def query_operand(q, k_cache_ptr, UPCAST: tl.constexpr, SCALED: tl.constexpr):
    """The query tile in the dtype the dots run in: float32 when UPCAST, the query's own dtype for scaled pages
    (their stored values convert to it exactly), else the pages' dtype."""
    if UPCAST:
        q = q.to(tl.float32)
    elif not SCALED:
        q = q.to(k_cache_ptr.dtype.element_ty)
    return q


@triton.jit
def tanh(x):
    """tanh from exp2 (no libdevice, so it also runs in the interpreter); saturates to +-1 where exp2 overflows."""
    return 1.0 - 2.0 / (tl.exp2(x * 2.8853900817779268) + 1.0)  # 2 * log2(e): exp2(2x log2 e) = e^2x


@triton.jit
def attend_tile(q, visible, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, table, positions, valid, dims,
                dim_mask, kv_head, block_size, head_dim, cache_stride_block, cache_stride_slot, cache_stride_h,
                qk_scale, cap_scale, running_max, running_sum, acc,
                DOT_PRECISION: tl.constexpr, SOFTCAP: tl.constexpr, SCALED: tl.constexpr, INV_MAX: tl.constexpr,
                BOOST: tl.constexpr, PACKED: tl.constexpr):
    """One step of the online softmax: the query rows q [M, D] against one tile of keys at `positions`,
    masked to `visible` ([M, N], or [1, N]); returns the updated running max, running sum and accumulator.
    Scores come out in log2 units: dot * qk_scale, or with SOFTCAP tanh(dot * qk_scale) * cap_scale
    (see score_scales). Pages are read as stored and converted to q's dtype in registers.
    NOTE: with scaled pages the dots take the stored values (int8, fp8 and int4 values are exact in float16,
    bfloat16 and float32) and the row scales multiply the scores' columns (K) and the probabilities'
    columns (V): softmax(q (s_k k)^T) (s_v v) = softmax((q k^T) s_k) (p s_v) v, one multiply per key
    instead of one per value, and a float16/bfloat16 tensor-core dot loses nothing to the dequantization.
    The probabilities times the V scales are BOOST times larger (the power of two at or above the format's
    max_value) and so is the running sum, which cancels in acc / running_sum: p * s_v alone (s_v = amax /
    max_value, 5e-5 for e5m2 rows of amax 3) would fall among float16's subnormals, whose steps, times stored
    values up to max_value, cost 1e-3 of the output."""
    rows = page_row_offsets(table, positions, valid, kv_head, block_size, cache_stride_block, cache_stride_slot,
                            cache_stride_h)
    k = load_rows(k_cache_ptr, rows, valid, dims, dim_mask, head_dim, q.dtype, PACKED)
    scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
    if SCALED:
        scores = scores * load_scales(k_scale_ptr, rows, valid, head_dim, INV_MAX, PACKED)[None, :]
    scores = scores * qk_scale
    if SOFTCAP:
        scores = tanh(scores) * cap_scale
    scores = tl.where(visible, scores, float("-inf"))
    new_max = tl.maximum(running_max, tl.max(scores, 1))
    # a row may see nothing in this tile (causal edge, window start): keep its exps at 0, not NaN
    safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)
    alpha = tl.exp2(running_max - safe_max)
    p = tl.exp2(scores - safe_max[:, None])
    running_sum = running_sum * alpha + tl.sum(p, 1) * BOOST
    v = load_rows(v_cache_ptr, rows, valid, dims, dim_mask, head_dim, q.dtype, PACKED)
    if SCALED:
        p = p * (load_scales(v_scale_ptr, rows, valid, head_dim, INV_MAX, PACKED) * BOOST)[None, :]
    acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v, input_precision=DOT_PRECISION)
    return new_max, running_sum, acc


def score_scales(scale: float, softcap: float | None) -> tuple[float, float]:
    """(qk_scale, cap_scale) for attend_tile: scale * log2(e) and unused without a soft-cap; with one,
    softcap * tanh(dot * scale / softcap) * log2(e) as tanh(dot * qk_scale) * cap_scale."""
    if softcap is None:
        return scale * LOG2_E, 0.0
    return scale / softcap, softcap * LOG2_E


def inverse_max(kv_format: KVFormat) -> float:
    """The format's 1 / max_value as the float32 the reference multiplies by (0 for float formats)."""
    return kv_format.inverse_max.item() if kv_format.scaled else 0.0


def scale_view(cache: torch.Tensor) -> torch.Tensor:
    """A float16 view of a scaled cache's bytes, where its kernels read and write the row scales; a float
    cache itself (the kernels then never touch it)."""
    return as_bytes(cache).view(torch.float16) if format_of(cache).scaled else cache


def dot_options(query: torch.Tensor, cache: torch.Tensor) -> dict:
    """Constexprs for attend_tile: the dots run in the pages' dtype (float pages) or the query's (scaled pages);
    IEEE float32 (not TF32) when that is float32, and float32 for bfloat16 under the interpreter, whose bfloat16
    tl.dot is broken upstream (UPCAST); SCALED, INV_MAX and BOOST for scaled pages (see attend_tile), PACKED for
    int4's two values a byte."""
    kv_format = format_of(cache)
    compute = query.dtype if kv_format.scaled else cache.dtype
    upcast = compute == torch.bfloat16 and INTERPRETED
    boost = 2.0 ** math.ceil(math.log2(kv_format.max_value)) if kv_format.scaled else 1.0
    return {"DOT_PRECISION": "ieee" if compute == torch.float32 or upcast else "tf32", "UPCAST": upcast,
            "SCALED": kv_format.scaled, "INV_MAX": inverse_max(kv_format), "BOOST": boost,
            "PACKED": kv_format.bits == 4}


def rounding_options(cache: torch.Tensor) -> dict:
    """Constexprs for writing a cache's format: MAX_VALUE (0 for float pages, stored unscaled) and INV_MAX, how
    a scaled value is rounded (round_to_format: INTEGER for int8, else the fp8 format's mantissa bits and least normal
    exponent), BFLOAT16 for bfloat16 pages (round_to_bfloat16) and PACKED for int4's two values a byte."""
    kv_format = format_of(cache)
    options = {"MAX_VALUE": kv_format.max_value, "INV_MAX": inverse_max(kv_format),
               "INTEGER": kv_format.dtype == torch.int8, "MANTISSA": 0, "MIN_EXP": 0,
               "BFLOAT16": kv_format.dtype == torch.bfloat16, "PACKED": kv_format.bits == 4}
    if kv_format.scaled and kv_format.dtype.is_floating_point:
        info = torch.finfo(kv_format.dtype)
        options.update(MANTISSA=-round(math.log2(info.eps)), MIN_EXP=round(math.log2(info.smallest_normal)))
    return options


@functools.cache
def _capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


def check_device_format(kv_format: KVFormat, device: torch.device | str) -> None:
    """Refuse a page format the Triton kernels cannot compile for `device`: fp8 e4m3 needs an NVIDIA GPU of
    compute capability 8.9 or more (Ada, Hopper), where Triton has its conversions."""
    device = torch.device(device)
    if device.type == "cuda" and kv_format.dtype == torch.float8_e4m3fn and _capability(device) < (8, 9):
        major, minor = _capability(device)
        raise ValueError(f"{kv_format.name} pages need compute capability 8.9+ for Triton's fp8 e4m3 conversions; "
                         f"{device} has {major}.{minor} (int8 pages need no fp8 support)")


def check_page_layout(k_cache: torch.Tensor, v_cache: torch.Tensor, head_dim: int) -> None:
    """Reject caches the kernels would misread: K and V in different formats or layouts, rows that are not
    head_dim values (plus a scaled format's two scale bytes), int4 rows of a head_dim that is no power of two, a
    scaled row whose scale is not 2-byte aligned."""
    kv_format = format_of(k_cache)
    check_device_format(kv_format, k_cache.device)
    if v_cache.dtype != k_cache.dtype:
        raise ValueError(f"k_cache ({k_cache.dtype}) and v_cache ({v_cache.dtype}) must hold one page format")
    if k_cache.stride() != v_cache.stride():
        raise ValueError("k_cache and v_cache must share one layout")
    if k_cache.stride(-1) != 1:
        raise ValueError("the caches need the head dimension contiguous (stride 1)")
    if k_cache.shape[-1] != kv_format.row_width(head_dim):
        raise ValueError(f"{kv_format.name} pages of head_dim {head_dim} have rows of {kv_format.row_width(head_dim)} "
                         f"elements, the caches' have {k_cache.shape[-1]}")
    if kv_format.bits == 4 and not rotatable(head_dim):
        raise ValueError(f"int4 pages need a power-of-two head_dim up to 256, not {head_dim}")
    if kv_format.scaled and (head_dim % 2 or any(s % 2 for s in k_cache.stride()[:-1])
                             or k_cache.storage_offset() % 2 or v_cache.storage_offset() % 2):
        raise ValueError(f"{kv_format.name} pages are read with their float16 scales in place: head_dim and the "
                         f"cache strides must be even (head_dim {head_dim}, strides {k_cache.stride()})")


def check_attention_inputs(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """Reject layouts the kernels do not handle instead of reading the wrong memory."""
    if query.stride(-1) != 1:
        raise ValueError("paged_attention needs the head dimension contiguous (stride 1)")
    check_page_layout(k_cache, v_cache, query.shape[-1])
    if query.shape[1] % k_cache.shape[2]:
        raise ValueError(f"{query.shape[1]} query heads do not divide into {k_cache.shape[2]} KV heads")
