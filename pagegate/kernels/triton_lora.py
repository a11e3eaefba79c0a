"""Triton kernels for LoRA over a mixed batch (Punica's SGMV, S-LoRA): a step's rows come in segments, each run
with one adapter slot (or none), and every adapter sits in one stacked tensor, so one launch serves the whole batch.

    shrink:  s[rows of g] = x[rows of g] @ A[slot g].T          A: [num_slots, R, in]
    expand:  y[rows of g] += s[rows of g] @ B[slot g].T         B: [num_slots, out, R]

A segment whose slot is -1 holds base-model rows and is skipped; rows in no segment are not touched. The grid is
(segment, tile of BLOCK_M of its rows, tile of the output's columns): tiles past a short segment's end return at
once, so a decode row (a segment of one) costs one program per column tile.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pagegate.kernels.triton_common import INTERPRETED

BLOCK_M = 16  # rows per program: tl.dot's least M
BLOCK_K = 64  # the shrink's reduction tile over the input features
BLOCK_N = 64  # the expand's output columns per program
MAX_BLOCK_R = 64  # rank columns per program (the shrink's output tile, the expand's reduction tile)


@dataclass(frozen=True)
class Segments:
    """A step's row segments, on the kernels' device: segment g is rows starts[g] : starts[g] + lengths[g], run
    with adapter slot slots[g] (-1: the base model alone)."""

    starts: torch.Tensor  # int32 [G]
    lengths: torch.Tensor  # int32 [G]
    slots: torch.Tensor  # int32 [G]
    max_length: int  # the longest segment's rows: what the grid's second axis covers

    @classmethod
    def of(cls, spans: Sequence[tuple[int, int, int]], device: torch.device | str) -> Segments:
        """Segments from (start, stop, slot) row spans, copied to `device` in one transfer."""
        table = torch.tensor([[start, stop - start, slot] for start, stop, slot in spans], dtype=torch.int32)
        table = table.reshape(-1, 3).T.contiguous().to(device)
        return cls(table[0], table[1], table[2], max((stop - start for start, stop, _ in spans), default=0))

    def __len__(self) -> int:
        return len(self.starts)


@triton.jit
def _segment_rows(starts_ptr, lengths_ptr, slots_ptr, BLOCK: tl.constexpr):
    """This program's slot, its rows (int64 row indices) and which of them exist; slot -1 when it has none
    to compute (a base segment, or a tile past its segment's end)."""
    segment = tl.program_id(0)
    slot = tl.load(slots_ptr + segment)
    length = tl.load(lengths_ptr + segment)
    offsets = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    rows = tl.load(starts_ptr + segment).to(tl.int64) + offsets
    slot = tl.where(tl.program_id(1) * BLOCK < length, slot, -1)
    return slot, rows, offsets < length


@triton.jit
def _shrink_kernel(x_ptr, a_ptr, s_ptr, starts_ptr, lengths_ptr, slots_ptr, in_features, rank,
                   x_stride, a_stride_slot, a_stride_rank, s_stride,
                   BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
                   DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """One program: BLOCK_M rows of a segment times BLOCK_R ranks of its slot's A, reduced over in_features."""
    slot, rows, row_mask = _segment_rows(starts_ptr, lengths_ptr, slots_ptr, BLOCK_M)
    if slot < 0:
        return
    ranks = tl.program_id(2) * BLOCK_R + tl.arange(0, BLOCK_R)
    rank_mask = ranks < rank
    a_rows = a_ptr + slot.to(tl.int64) * a_stride_slot + ranks[:, None] * a_stride_rank
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for first in range(0, in_features, BLOCK_K):
        columns = first + tl.arange(0, BLOCK_K)
        column_mask = columns < in_features
        x = tl.load(x_ptr + rows[:, None] * x_stride + columns[None, :],
                    mask=row_mask[:, None] & column_mask[None, :], other=0.0)
        a = tl.load(a_rows + columns[None, :], mask=rank_mask[:, None] & column_mask[None, :], other=0.0)
        if UPCAST:
            x, a = x.to(tl.float32), a.to(tl.float32)
        acc += tl.dot(x, tl.trans(a), input_precision=DOT_PRECISION)
    tl.store(s_ptr + rows[:, None] * s_stride + ranks[None, :], acc.to(s_ptr.dtype.element_ty),
             mask=row_mask[:, None] & rank_mask[None, :])


@triton.jit
def _expand_kernel(s_ptr, b_ptr, y_ptr, starts_ptr, lengths_ptr, slots_ptr, out_features, rank,
                   s_stride, b_stride_slot, b_stride_out, y_stride,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
                   DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """One program: BLOCK_M rows of a segment, BLOCK_N output columns: y += s @ B[slot].T, added in float32."""
    slot, rows, row_mask = _segment_rows(starts_ptr, lengths_ptr, slots_ptr, BLOCK_M)
    if slot < 0:
        return
    columns = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    column_mask = columns < out_features
    b_rows = b_ptr + slot.to(tl.int64) * b_stride_slot + columns[:, None] * b_stride_out
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for first in range(0, rank, BLOCK_R):
        ranks = first + tl.arange(0, BLOCK_R)
        rank_mask = ranks < rank
        b = tl.load(b_rows + ranks[None, :], mask=column_mask[:, None] & rank_mask[None, :], other=0.0)
        s = tl.load(s_ptr + rows[:, None] * s_stride + ranks[None, :], mask=row_mask[:, None] & rank_mask[None, :],
                    other=0.0)
        s = s.to(b.dtype)  # the shrunk rows in the weights' dtype, as the torch path multiplies them
        if UPCAST:
            s, b = s.to(tl.float32), b.to(tl.float32)
        acc += tl.dot(s, tl.trans(b), input_precision=DOT_PRECISION)
    y_at = y_ptr + rows[:, None] * y_stride + columns[None, :]
    mask = row_mask[:, None] & column_mask[None, :]
    y = tl.load(y_at, mask=mask, other=0.0)
    tl.store(y_at, (y.to(tl.float32) + acc).to(y_ptr.dtype.element_ty), mask=mask)


def lora_shrink(x: torch.Tensor, lora_a: torch.Tensor, segments: Segments,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """s [T, R] (x's dtype unless `out` is given): each segment's rows of x [T, in] times its slot's A.T
    (lora_a [num_slots, R, in]); rows of base segments and of no segment stay as they were (0 in a new s)."""
    _check_rows("x", x)
    _check_rows("lora_a", lora_a)
    rank, in_features = lora_a.shape[1:]
    if x.shape[1] != in_features:
        raise ValueError(f"x has {x.shape[1]} features, lora_a takes {in_features}")
    if out is None:
        out = x.new_zeros(x.shape[0], rank)
    _check_rows("out", out)
    if len(segments) and segments.max_length:
        block_r = _rank_block(rank)
        grid = (len(segments), triton.cdiv(segments.max_length, BLOCK_M), triton.cdiv(rank, block_r))
        _shrink_kernel[grid](x, lora_a, out, segments.starts, segments.lengths, segments.slots, in_features, rank,
                             x.stride(0), lora_a.stride(0), lora_a.stride(1), out.stride(0),
                             BLOCK_M=BLOCK_M, BLOCK_R=block_r, BLOCK_K=BLOCK_K, **_dot_options(lora_a.dtype))
    return out


def lora_expand(shrunk: torch.Tensor, lora_b: torch.Tensor, segments: Segments, y: torch.Tensor) -> None:
    """y [T, out] += each segment's rows of shrunk [T, R] times its slot's B.T (lora_b [num_slots, out, R]), in
    place; `y` may be a column slice of a wider output (a packed projection's shard)."""
    _check_rows("shrunk", shrunk)
    _check_rows("lora_b", lora_b)
    _check_rows("y", y)
    out_features, rank = lora_b.shape[1:]
    if shrunk.shape[1] != rank or y.shape[1] != out_features:
        raise ValueError(f"lora_b {tuple(lora_b.shape)} does not map shrunk {tuple(shrunk.shape)} to "
                         f"y {tuple(y.shape)}")
    if not len(segments) or not segments.max_length:
        return
    grid = (len(segments), triton.cdiv(segments.max_length, BLOCK_M), triton.cdiv(out_features, BLOCK_N))
    _expand_kernel[grid](shrunk, lora_b, y, segments.starts, segments.lengths, segments.slots, out_features, rank,
                         shrunk.stride(0), lora_b.stride(0), lora_b.stride(1), y.stride(0),
                         BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_R=_rank_block(rank),
                         **_dot_options(lora_b.dtype))


def _rank_block(rank: int) -> int:
    return min(max(16, triton.next_power_of_2(rank)), MAX_BLOCK_R)


def _dot_options(dtype: torch.dtype) -> dict:
    """IEEE float32 dots (not TF32: the update must match the torch path's); float32 for bfloat16 under the
    interpreter, whose bfloat16 tl.dot is broken upstream (as triton_common.dot_options)."""
    upcast = dtype == torch.bfloat16 and INTERPRETED
    return {"DOT_PRECISION": "ieee" if dtype == torch.float32 or upcast else "tf32", "UPCAST": upcast}


def _check_rows(name: str, tensor: torch.Tensor) -> None:
    if tensor.stride(-1) != 1:
        raise ValueError(f"{name} needs its last dimension contiguous (stride 1)")
