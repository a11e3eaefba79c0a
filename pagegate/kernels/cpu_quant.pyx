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

cdef extern from *:
    """
    #include <stdint.h>
    #include <string.h>

    static float pgq_half_table[65536];  /* float16 bits -> float32, filled once at import */

    static float pgq_half_to_float(uint16_t h) {
        uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
        if (exp == 0 && man == 0) bits = sign;
        else if (exp == 0) {  /* subnormal: normalise */
            exp = 127 - 15 + 1;
            while (!(man & 0x400)) { man <<= 1; exp--; }
            bits = sign | (exp << 23) | ((man & 0x3ff) << 13);
        } else if (exp == 31) bits = sign | 0x7f800000 | (man << 13);
        else bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
        float f;
        memcpy(&f, &bits, 4);
        return f;
    }
    static inline float pgq_half(const uint8_t *p) {
        uint16_t h;
        memcpy(&h, p, 2);
        return pgq_half_table[h];
    }

    /* One block's 32 weights as float32, exactly as ggml defines them. */
    static inline void pgq_decode(int qtype, const uint8_t *block, float *w) {
        if (qtype == 0) {
            memcpy(w, block, 128);
            return;
        }
        if (qtype == 1) {
            for (int j = 0; j < 32; j++) w[j] = pgq_half(block + 2 * j);
            return;
        }
        const float d = pgq_half(block);
        if (qtype == 8) {
            const int8_t *q = (const int8_t *)(block + 2);
            for (int j = 0; j < 32; j++) w[j] = d * (float)q[j];
        } else if (qtype == 2) {
            const uint8_t *q = block + 2;
            for (int j = 0; j < 16; j++) w[j] = d * (float)((int)(q[j] & 15) - 8);
            for (int j = 0; j < 16; j++) w[j + 16] = d * (float)((int)(q[j] >> 4) - 8);
        } else {
            const float m = pgq_half(block + 2);
            const uint8_t *q = block + 4;
            for (int j = 0; j < 16; j++) w[j] = d * (float)(q[j] & 15) + m;
            for (int j = 0; j < 16; j++) w[j + 16] = d * (float)(q[j] >> 4) + m;
        }
    }

    /* out[r * out_stride] = x_r . w for the rows x_r = x + r * k of one weight row w (its blocks). */
    static void pgq_row_plain(int qtype, const uint8_t *blocks, int block_bytes, int k,
                              const float *x, int rows, float *out, int64_t out_stride) {
        float w[32], acc[16] = {0};
        for (int b = 0; b < k / 32; b++) {
            pgq_decode(qtype, blocks + (int64_t)b * block_bytes, w);
            for (int r = 0; r < rows; r++) {
                const float *xb = x + (int64_t)r * k + b * 32;
                float s = 0.0f;
                for (int j = 0; j < 32; j++) s += w[j] * xb[j];
                acc[r] += s;
            }
        }
        for (int r = 0; r < rows; r++) out[r * out_stride] = acc[r];
    }

    #if defined(__GNUC__) && defined(__x86_64__)
    #include <immintrin.h>
    #define PGQ_AVX2 __attribute__((target("avx2,fma,f16c")))

    PGQ_AVX2 static inline __m256 pgq_bytes_to_float(__m128i bytes, int is_signed) {
        return _mm256_cvtepi32_ps(is_signed ? _mm256_cvtepi8_epi32(bytes) : _mm256_cvtepu8_epi32(bytes));
    }

    /* One block's 32 weights as four AVX2 vectors, the same values as pgq_decode (no fused multiply-add). */
    PGQ_AVX2 static inline void pgq_decode_avx2(int qtype, const uint8_t *block, __m256 *w) {
        if (qtype == 0) {
            for (int i = 0; i < 4; i++) w[i] = _mm256_loadu_ps((const float *)block + 8 * i);
        } else if (qtype == 1) {
            for (int i = 0; i < 4; i++) w[i] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(block + 16 * i)));
        } else if (qtype == 8) {
            const __m256 d = _mm256_set1_ps(pgq_half(block));
            for (int i = 0; i < 4; i++)
                w[i] = _mm256_mul_ps(d, pgq_bytes_to_float(_mm_loadl_epi64((const __m128i *)(block + 2 + 8 * i)), 1));
        } else {
            const __m256 d = _mm256_set1_ps(pgq_half(block));
            const __m128i low4 = _mm_set1_epi8(15), bytes = _mm_loadu_si128((const __m128i *)(block + (qtype == 3 ? 4 : 2)));
            const __m128i lo = _mm_and_si128(bytes, low4), hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), low4);
            const __m128i nibbles[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
            if (qtype == 3) {
                const __m256 m = _mm256_set1_ps(pgq_half(block + 2));
                for (int i = 0; i < 4; i++) w[i] = _mm256_add_ps(_mm256_mul_ps(d, pgq_bytes_to_float(nibbles[i], 0)), m);
            } else {
                const __m256 eight = _mm256_set1_ps(8.0f);
                for (int i = 0; i < 4; i++)
                    w[i] = _mm256_mul_ps(d, _mm256_sub_ps(pgq_bytes_to_float(nibbles[i], 0), eight));
            }
        }
    }

    /* pgq_row_plain with AVX2: each block decoded once, folded into two accumulators a row so
       consecutive FMAs do not wait on each other. */
    PGQ_AVX2 static void pgq_row_avx2(int qtype, const uint8_t *blocks, int block_bytes, int k,
                                      const float *x, int rows, float *out, int64_t out_stride) {
        __m256 acc[2 * 16];
        for (int i = 0; i < 2 * rows; i++) acc[i] = _mm256_setzero_ps();
        for (int b = 0; b < k / 32; b++) {
            __m256 w[4];
            pgq_decode_avx2(qtype, blocks + (int64_t)b * block_bytes, w);
            for (int r = 0; r < rows; r++) {
                const float *xb = x + (int64_t)r * k + b * 32;
                acc[2 * r] = _mm256_fmadd_ps(w[0], _mm256_loadu_ps(xb), acc[2 * r]);
                acc[2 * r + 1] = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(xb + 8), acc[2 * r + 1]);
                acc[2 * r] = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(xb + 16), acc[2 * r]);
                acc[2 * r + 1] = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(xb + 24), acc[2 * r + 1]);
            }
        }
        for (int r = 0; r < rows; r++) {
            const __m256 v = _mm256_add_ps(acc[2 * r], acc[2 * r + 1]);
            __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
            h = _mm_add_ps(h, _mm_movehl_ps(h, h));
            h = _mm_add_ss(h, _mm_movehdup_ps(h));
            out[r * out_stride] = _mm_cvtss_f32(h);
        }
    }

    PGQ_AVX2 static void pgq_dequantize_row_avx2(int qtype, const uint8_t *blocks, int block_bytes, int k,
                                                 float *out) {
        for (int b = 0; b < k / 32; b++) {
            __m256 w[4];
            pgq_decode_avx2(qtype, blocks + (int64_t)b * block_bytes, w);
            for (int i = 0; i < 4; i++) _mm256_storeu_ps(out + b * 32 + 8 * i, w[i]);
        }
    }
    static int pgq_use_avx2(void) {
        return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
    }
    #else
    static void pgq_row_avx2(int qtype, const uint8_t *blocks, int block_bytes, int k,
                             const float *x, int rows, float *out, int64_t out_stride) {}
    static void pgq_dequantize_row_avx2(int qtype, const uint8_t *blocks, int block_bytes, int k, float *out) {}
    static int pgq_use_avx2(void) { return 0; }
    #endif

    static void pgq_dequantize_row_plain(int qtype, const uint8_t *blocks, int block_bytes, int k, float *out) {
        for (int b = 0; b < k / 32; b++) pgq_decode(qtype, blocks + (int64_t)b * block_bytes, out + b * 32);
    }

    typedef void (*pgq_row_fn)(int, const uint8_t *, int, int, const float *, int, float *, int64_t);
    typedef void (*pgq_dequantize_fn)(int, const uint8_t *, int, int, float *);
    static pgq_row_fn pgq_row = pgq_row_plain;
    static pgq_dequantize_fn pgq_dequantize_row = pgq_dequantize_row_plain;
    static void pgq_init(void) {
        for (uint32_t h = 0; h < 65536; h++) pgq_half_table[h] = pgq_half_to_float((uint16_t)h);
        if (pgq_use_avx2()) {
            pgq_row = pgq_row_avx2;
            pgq_dequantize_row = pgq_dequantize_row_avx2;
        }
    }
    """
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
