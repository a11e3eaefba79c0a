# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""Weight-only quantized matmul on CPU over GGUF blocks kept as they are in the file.

A weight [N, K] is N rows of K / 32 sub-blocks of 32 weights in ggml's layouts: Q8_0, Q4_0, Q4_1,
Q5_0 and Q5_1 (one block per 32 weights), Q4_K, Q5_K and Q6_K (a 256-weight super-block with its
sub-blocks' scales), and the float rows F32, F16 and BF16. A sub-block decodes to exactly the float32
values gguf's dequantize gives.

`matmul` decodes each sub-block once per call and folds it into every input row in float32: the
exact product with the dequantized weights (the oracle). `matmul_q8` is llama.cpp's arithmetic:
the inputs rounded to int8 once per call (Q8: 32 values, one scale), integer dot products with the
weights' own integers (cpu_qdot.h). `dequantize` writes whole float32 rows, for the caller's GEMM
when many rows share the weights.
"""

from cython.parallel cimport prange
from openmp cimport omp_get_max_threads
from libc.stdint cimport int8_t, int64_t, uint8_t, uintptr_t
from libc.string cimport memcpy

from pagegate.kernels.cpu_qdot cimport (PGQ_BF16_PANELS, PGQ_F16_PANELS, PGQ_F32_PANELS, PGQ_GROUP, PGQ_MAX_M, PGQ_PANEL, PGQ_SUMS, PGQ_X8, pgq_act,
                                        pgq_base_type, pgq_dequantize_row_of, pgq_init, pgq_is_x8, pgq_isa,
                                        pgq_panels_matmul, pgq_panels_pack, pgq_qdot, pgq_quantize_row,
                                        pgq_row_of, pgq_set_isa, pgq_x8_dot_groups, pgq_x8_pack,
                                        pgq_x8_span)

import numpy as np

from pagegate.kernels import huge_pages

F32, F16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, BF16 = 0, 1, 2, 3, 6, 7, 8, 12, 13, 14, 30  # ggml's ids
BLOCK_BYTES = {F32: 128, F16: 64, BF16: 64, Q4_0: 18, Q4_1: 20, Q5_0: 22, Q5_1: 24, Q8_0: 34, Q4_K: 144, Q5_K: 176,
               Q6_K: 210}
K_QUANTS = (Q4_K, Q5_K, Q6_K)
INTERLEAVED = (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, *K_QUANTS)  # the types interleaved() repacks
X8 = PGQ_X8  # such a type's id plus this: its rows interleaved eight at a time (interleaved(); cpu_qx8.h)
BLOCK_BYTES.update({t + X8: BLOCK_BYTES[t] for t in INTERLEAVED})
BLOCK_ELEMS = {t: 256 if t % X8 in K_QUANTS else 32 for t in BLOCK_BYTES}
INTEGER_TYPES = frozenset(BLOCK_BYTES) - {F32, F16, BF16}  # what matmul_q8 takes
F32_PANELS, F16_PANELS, BF16_PANELS = PGQ_F32_PANELS, PGQ_F16_PANELS, PGQ_BF16_PANELS  # float rows in panels
PANELS = {F32: F32_PANELS, F16: F16_PANELS, BF16: BF16_PANELS}  # a float type's id -> its panels' (panels())
BLOCK_BYTES.update({F32_PANELS: 4, F16_PANELS: 2, BF16_PANELS: 2})  # rows of any length
BLOCK_ELEMS.update({F32_PANELS: 1, F16_PANELS: 1, BF16_PANELS: 1})
pgq_init()


def _isa() -> str:
    """The integer dot products' instruction set here (dispatch.integer_isa)."""
    return pgq_isa.decode()


def _set_isa(name: str) -> bool:
    """dispatch.set_integer_isa for this module."""
    return bool(pgq_set_isa(name.encode()))


def _check(blocks, int qtype, int k):
    """`blocks` as a tensor (an array is shared, not copied), checked to be K-wide rows of `qtype`.

    NOTE: torch is imported here, by the torch path's functions (matmul, dequantize, matmul_q8) only: the native
    step's (interleaved, panels) take and return numpy arrays, so an engine core on it never imports torch."""
    import torch
    if isinstance(blocks, np.ndarray):
        blocks = torch.from_numpy(blocks)
    if qtype not in BLOCK_BYTES:
        raise ValueError(f"ggml type {qtype} has no CPU kernel; supported: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, "
                         "Q8_0, Q4_K, Q5_K, Q6_K")
    if k % BLOCK_ELEMS[qtype] or blocks.dtype != torch.uint8 or blocks.dim() != 2 or not blocks.is_contiguous():
        raise ValueError(f"blocks must be a contiguous uint8 [N, K / {BLOCK_ELEMS[qtype]} * block bytes] tensor, "
                         f"K a multiple of {BLOCK_ELEMS[qtype]}")
    row_bytes = k // BLOCK_ELEMS[qtype] * BLOCK_BYTES[qtype]
    if blocks.shape[1] != row_bytes:
        raise ValueError(f"blocks have {blocks.shape[1]} bytes a row; K={k} needs {row_bytes}")
    return blocks


def _float_input(x):
    import torch
    x = x.contiguous()
    if x.dtype != torch.float32:
        raise ValueError("x must be float32")
    return x


def matmul(x, blocks, int qtype):
    """x [M, K] float32 @ W.T for W [N, K] given as its blocks: [M, N] float32."""
    cdef int k = x.shape[1]
    blocks = _check(blocks, qtype, k)
    x = _float_input(x)
    import torch
    cdef int64_t n = blocks.shape[0], m = x.shape[0], start, row
    cdef int rows
    out = torch.empty((m, n), dtype=torch.float32)
    cdef const uint8_t *w = <const uint8_t *><size_t>blocks.data_ptr()
    cdef const float *xp = <const float *><size_t>x.data_ptr()
    cdef float *op = <float *><size_t>out.data_ptr()
    cdef int64_t row_bytes = blocks.shape[1], p
    if qtype in PANELS.values():
        for p in prange((n + PGQ_PANEL - 1) // PGQ_PANEL, nogil=True, schedule="static"):
            pgq_panels_matmul(qtype, w, n, k, p, p + 1, xp, m, op, n, NULL, 0)
        return out
    for start in range(0, m, PGQ_MAX_M):
        rows = min(PGQ_MAX_M, m - start)
        for row in prange(n, nogil=True, schedule="static"):
            pgq_row_of(qtype, w, n, row, k, xp + start * k, rows, op + start * n + row, n)
    return out


def dequantize(blocks, int qtype, int k, rows=None):
    """W [N, K] float32 from its blocks; only the given row ids (e.g. an embedding lookup) if `rows`."""
    blocks = _check(blocks, qtype, k)
    import torch
    ids = torch.arange(blocks.shape[0]) if rows is None else rows.to(torch.int64).contiguous()
    cdef int64_t count = ids.shape[0], i, num = blocks.shape[0]
    if count and (int(ids.min()) < 0 or int(ids.max()) >= num):
        raise IndexError(f"row id out of range [0, {num})")
    out = torch.empty((count, k), dtype=torch.float32)
    cdef const int64_t *idp = <const int64_t *><size_t>ids.data_ptr()
    cdef const uint8_t *w = <const uint8_t *><size_t>blocks.data_ptr()
    cdef float *op = <float *><size_t>out.data_ptr()
    for i in prange(count, nogil=True, schedule="static"):
        pgq_dequantize_row_of(qtype, w, num, idp[i], k, op + i * k)
    return out


def interleaved(blocks, int qtype, order=None, int threads=0, empty=huge_pages.empty):
    """(blocks, qtype) of a matrix in Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 or a K-quant repacked for the integer kernels:
    its rows interleaved eight at a time (cpu_qx8.h; the same bytes, permuted; Q8_0's values plus 128), its type id
    qtype + X8; any other matrix as it is (copied). `blocks` is the matrix (a uint8 array or CPU tensor), or a list
    of them of one row width, one above the other; `order`, where given, the rows to take (indices into those rows):
    the result is interleaved(np.concatenate(blocks)[order]), without that copy. They may be read-only (a file's
    mapping: the returned array is the one copy made of it). `threads`: the OpenMP threads it takes (0: OpenMP's
    default); `empty(shape)`: the new uint8 array it repacks into (on huge pages by default)."""
    parts = [np.ascontiguousarray(part) for part in (blocks if isinstance(blocks, list) else [blocks])]
    count = sum(part.shape[0] for part in parts) if order is None else len(order)
    if qtype not in INTERLEAVED or count < 8:
        source = np.concatenate(parts) if len(parts) > 1 else parts[0]
        return (np.array(source) if order is None else source[order]), qtype
    width = parts[0].shape[1] if parts[0].ndim == 2 else -1
    if any(part.dtype != np.uint8 or part.ndim != 2 or part.shape[1] != width for part in parts) or \
            width % BLOCK_BYTES[qtype]:
        raise ValueError(f"blocks must be uint8 [N, blocks * {BLOCK_BYTES[qtype]}] matrices of one width")
    cdef const uintptr_t[::1] rows = _row_addresses(parts, order)  # parts holds the rows while they are read
    cdef int64_t row_bytes = width, g, r, groups = count // 8
    cdef int team = threads if threads > 0 else omp_get_max_threads()
    out = empty((count, width))
    cdef uint8_t *o = <uint8_t *><size_t>out.ctypes.data
    for r in range(groups * 8, count):  # the last N % 8 rows stay as they are
        memcpy(o + r * row_bytes, <const uint8_t *>rows[r], row_bytes)
    for g in prange(groups, nogil=True, schedule="static", num_threads=team):
        pgq_x8_pack(qtype, &rows[g * 8], row_bytes, o + g * 8 * row_bytes)
    return out, qtype + X8


def _row_addresses(parts, order):
    """The address of each row of `parts` (C-contiguous matrices, one above the other), in `order` if given."""
    addresses = np.concatenate([part.ctypes.data + np.arange(part.shape[0], dtype=np.uintp) * part.strides[0]
                                for part in parts])
    return addresses if order is None else addresses[np.asarray(order, dtype=np.intp)]


def panels(blocks, int qtype, empty=huge_pages.empty):
    """(blocks, qtype) of a float matrix W [N, K] as the native step reads it: rows of F32, F16 or BF16 (blocks: its
    bytes [N, K * value bytes], an array or a CPU tensor) in panels of 32, each k-major (cpu_panels.h; the same
    values, permuted) in a new array, its type id PANELS[qtype]. `empty(shape)`: the new uint8 array (on huge pages
    by default)."""
    source = np.ascontiguousarray(blocks)
    if qtype not in PANELS or source.dtype != np.uint8 or source.ndim != 2:
        raise ValueError("blocks must be the uint8 [N, row bytes] of an F32, F16 or BF16 matrix")
    cdef int bytes = 4 if qtype == F32 else 2
    if source.shape[1] % bytes:
        raise ValueError(f"rows of {source.shape[1]} bytes are no whole number of values")
    out = empty(tuple(source.shape))
    pgq_panels_pack(<const uint8_t *><size_t>source.ctypes.data, source.shape[0], source.shape[1] // bytes, bytes,
                    <uint8_t *><size_t>out.ctypes.data)
    return out, PANELS[qtype]


def matmul_q8(x, blocks, int qtype):
    """x [M, K] float32 @ W.T as llama.cpp computes it: x in Q8, integer dot products; [M, N] float32. Interleaved
    rows (interleaved()) go eight at a time through their own kernel: the same bits (cpu_qdot.h)."""
    cdef int k = x.shape[1]
    blocks = _check(blocks, qtype, k)
    if qtype not in INTEGER_TYPES:
        raise ValueError(f"ggml type {qtype} is a float format; use matmul")
    x = _float_input(x)
    import torch
    cdef int64_t n = blocks.shape[0], m = x.shape[0], row_bytes = blocks.shape[1], r, g, nb = k // 32, stride = n
    out = torch.empty((m, n), dtype=torch.float32)
    q8 = torch.empty(max(m, 1) * k, dtype=torch.int8)
    scales = torch.empty(max(m, 1) * nb * (1 + PGQ_SUMS), dtype=torch.float32)
    cdef pgq_act act
    act.k, act.m = k, m
    act.q = <int8_t *><size_t>q8.data_ptr()
    act.d = <float *><size_t>scales.data_ptr()
    act.s = act.d + max(m, 1) * nb
    cdef const uint8_t *w = <const uint8_t *><size_t>blocks.data_ptr()
    cdef const float *xp = <const float *><size_t>x.data_ptr()
    cdef float *op = <float *><size_t>out.data_ptr()
    for r in range(m):
        pgq_quantize_row(xp + r * k, &act, r, 0, nb)
    cdef int64_t span = pgq_x8_span(), groups = n // 8
    if pgq_is_x8(qtype):  # whole groups (span at a time), then the rows after them in their file layout
        for g in prange((groups + span - 1) // span, nogil=True, schedule="static"):
            pgq_x8_dot_groups(pgq_base_type(qtype), w + g * span * 8 * row_bytes, row_bytes,
                              min(span, groups - g * span), &act, op + g * span * 8, stride)
        w, qtype = w + n // 8 * 8 * row_bytes, pgq_base_type(qtype)
        op, n = op + n // 8 * 8, n % 8
    for g in prange((n + PGQ_GROUP - 1) // PGQ_GROUP, nogil=True, schedule="static"):
        _qdot_rows(qtype, w + g * PGQ_GROUP * row_bytes, row_bytes, min(PGQ_GROUP, n - g * PGQ_GROUP), &act,
                   op + g * PGQ_GROUP, stride)
    return out


cdef void _qdot_rows(int qtype, const uint8_t *w, int64_t row_bytes, int rows, const pgq_act *act, float *out,
                     int64_t n) noexcept nogil:
    """pgq_qdot over every activation row of act, PGQ_MAX_M at a time."""
    cdef pgq_act chunk
    cdef int64_t start = 0, nb = act.k // 32
    while start < act.m:
        chunk.k, chunk.m = act.k, min(PGQ_MAX_M, act.m - start)
        chunk.q, chunk.d, chunk.s = act.q + start * act.k, act.d + start * nb, act.s + PGQ_SUMS * start * nb
        pgq_qdot(qtype, w, row_bytes, rows, &chunk, out + start * n, n)
        start += PGQ_MAX_M
