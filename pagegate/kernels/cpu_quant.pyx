# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""Weight-only quantized matmul on CPU over GGUF blocks kept as they are in the file.

A weight [N, K] is N rows of K / 32 blocks, each block 32 weights in ggml's layout:
Q8_0 (float16 d, 32 int8: w = d q), Q4_0 (float16 d, 16 bytes of nibbles: w = d (q - 8)) and
Q4_1 (float16 d, float16 m, nibbles: w = d q + m); low nibbles hold weights 0..15 of the
block, high nibbles 16..31. A block decodes to exactly the float32 values gguf's dequantize gives.

`matmul` decodes each block once per call and folds it into every input row (few rows: decode
steps, where reading the weights is the whole cost and they are 4-8x smaller than float32).
`dequantize` writes whole float32 rows, for the caller's GEMM when many rows share the weights.
"""

from cython.parallel cimport prange
from libc.stdint cimport int64_t, uint8_t, uint16_t

import torch

F32, F16, Q4_0, Q4_1, Q8_0 = 0, 1, 2, 3, 8  # ggml's type ids
BLOCK_BYTES = {F32: 128, F16: 64, Q4_0: 18, Q4_1: 20, Q8_0: 34}
cdef enum:
    BLOCK = 32
    MAX_ROWS = 16  # input rows matmul takes at once (accumulators on the stack)

cdef extern from "cpu_quant.h":
    void pgq_init() noexcept nogil
    void pgq_row(int qtype, const uint8_t *blocks, int block_bytes, int k, const float *x, int rows,
                 float *out, int64_t out_stride) noexcept nogil
    void pgq_dequantize_row(int qtype, const uint8_t *blocks, int block_bytes, int k, float *out) noexcept nogil

pgq_init()


def _check(blocks, int qtype, int k):
    if qtype not in BLOCK_BYTES:
        raise ValueError(f"ggml type {qtype} has no CPU kernel; supported: F32, F16, Q4_0, Q4_1, Q8_0")
    if k % BLOCK or blocks.dtype != torch.uint8 or blocks.dim() != 2 or not blocks.is_contiguous():
        raise ValueError("blocks must be a contiguous uint8 [N, K / 32 * block bytes] tensor, K a multiple of 32")
    if blocks.shape[1] != k // BLOCK * BLOCK_BYTES[qtype]:
        raise ValueError(f"blocks have {blocks.shape[1]} bytes a row; K={k} needs {k // BLOCK * BLOCK_BYTES[qtype]}")


def matmul(x, blocks, int qtype):
    """x [M, K] float32 @ W.T for W [N, K] given as its blocks: [M, N] float32."""
    cdef int k = x.shape[1]
    _check(blocks, qtype, k)
    x = x.contiguous()
    if x.dtype != torch.float32:
        raise ValueError("x must be float32")
    cdef int64_t n = blocks.shape[0], m = x.shape[0], start, row
    cdef int rows, block_bytes = BLOCK_BYTES[qtype]
    out = torch.empty((m, n), dtype=torch.float32)
    cdef const uint8_t *w = <const uint8_t *><size_t>blocks.data_ptr()
    cdef const float *xp = <const float *><size_t>x.data_ptr()
    cdef float *op = <float *><size_t>out.data_ptr()
    cdef int64_t row_bytes = blocks.shape[1]
    for start in range(0, m, MAX_ROWS):
        rows = min(MAX_ROWS, m - start)
        for row in prange(n, nogil=True, schedule="static"):
            pgq_row(qtype, w + row * row_bytes, block_bytes, k, xp + start * k, rows, op + start * n + row, n)
    return out


def dequantize(blocks, int qtype, int k, rows=None):
    """W [N, K] float32 from its blocks; only the given row ids (e.g. an embedding lookup) if `rows`."""
    _check(blocks, qtype, k)
    ids = torch.arange(blocks.shape[0]) if rows is None else rows.to(torch.int64).contiguous()
    cdef int64_t count = ids.shape[0], i, num = blocks.shape[0], row_bytes = blocks.shape[1]
    if count and (int(ids.min()) < 0 or int(ids.max()) >= num):
        raise IndexError(f"row id out of range [0, {num})")
    out = torch.empty((count, k), dtype=torch.float32)
    cdef const int64_t *idp = <const int64_t *><size_t>ids.data_ptr()
    cdef const uint8_t *w = <const uint8_t *><size_t>blocks.data_ptr()
    cdef float *op = <float *><size_t>out.data_ptr()
    cdef int block_bytes = BLOCK_BYTES[qtype]
    for i in prange(count, nogil=True, schedule="static"):
        pgq_dequantize_row(qtype, w + idp[i] * row_bytes, block_bytes, k, op + i * k)
    return out
