/* The C of pagegate/kernels/cpu_quant.pyx: GGUF block formats decoded to float32, and the float
   matmul over them. Included by the Cython modules, readable by C tools. */
#ifndef PAGEGATE_CPU_QUANT_H
#define PAGEGATE_CPU_QUANT_H

#include <stdint.h>
#include <string.h>

/* ggml's type ids. A row of K weights is K / 32 sub-blocks of 32; the K-quants group 8 of them
   into a 256-weight super-block that shares one header. */
enum { PGQ_F32 = 0, PGQ_F16 = 1, PGQ_Q4_0 = 2, PGQ_Q4_1 = 3, PGQ_Q5_0 = 6, PGQ_Q5_1 = 7, PGQ_Q8_0 = 8,
       PGQ_Q4_K = 12, PGQ_Q5_K = 13, PGQ_Q6_K = 14, PGQ_BF16 = 30 };

static inline int pgq_is_k_quant(int qtype) {
    const int base = qtype > 100 ? qtype - 100 : qtype;
    return base >= PGQ_Q4_K && base <= PGQ_Q6_K;
}
static inline int pgq_is_float(int qtype) { return qtype == PGQ_F32 || qtype == PGQ_F16 || qtype == PGQ_BF16; }
static inline int pgq_block_elems(int qtype) { return pgq_is_k_quant(qtype) ? 256 : 32; }
static inline int pgq_block_bytes(int qtype) {
    switch (qtype) {
        case PGQ_F32: return 128;
        case PGQ_F16: return 64;
        case PGQ_BF16: return 64;
        case PGQ_Q4_0: return 18;
        case PGQ_Q4_1: return 20;
        case PGQ_Q5_0: return 22;
        case PGQ_Q5_1: return 24;
        case PGQ_Q8_0: return 34;
        case PGQ_Q4_K: return 144;
        case PGQ_Q5_K: return 176;
        case PGQ_Q6_K: return 210;
        default: return qtype > 100 ? pgq_block_bytes(qtype - 100) : 0;  /* rows interleaved (cpu_qx8.h) */
    }
}

#include "cpu_qx8.h"

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
/* bfloat16 bits -> float32: the top half of its bits, exactly. */
static inline float pgq_bf16(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    const uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static inline float pgq_half(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return pgq_half_table[h];
}
static inline uint32_t pgq_u32(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}

/* Sub-block j (0..7) of a Q4_K/Q5_K super-block: its 6-bit scale and min, packed in 12 bytes. */
static inline void pgq_scale_min_k4(int j, const uint8_t *q, int *scale, int *min) {
    if (j < 4) {
        *scale = q[j] & 63;
        *min = q[j + 4] & 63;
    } else {
        *scale = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        *min = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

/* The bytes of sub-block b of a row: its own block, or the super-block holding it. */
static inline const uint8_t *pgq_block_of(int qtype, const uint8_t *row, int64_t b) {
    return row + (pgq_is_k_quant(qtype) ? b / 8 : b) * pgq_block_bytes(qtype);
}

/* Sub-block b of a row as 32 unsigned bytes u with w = d[h] * u + c[h] for half h (Q8_0: the
   int8 values themselves, c = -128 d: u is q + 128, which the kernels form). */
static inline void pgq_unpack(int qtype, const uint8_t *row, int64_t b, uint8_t *u, float *d, float *c) {
    const uint8_t *blk = pgq_block_of(qtype, row, b);
    const int j = (int)(b % 8);
    switch (qtype) {
        case PGQ_Q8_0:
            d[0] = pgq_half(blk);
            c[0] = -128.0f * d[0];
            for (int l = 0; l < 32; l++) u[l] = (uint8_t)(blk[2 + l] ^ 0x80);
            break;
        case PGQ_Q4_0: case PGQ_Q4_1: case PGQ_Q5_0: case PGQ_Q5_1: {
            const int one = qtype == PGQ_Q4_1 || qtype == PGQ_Q5_1, five = qtype == PGQ_Q5_0 || qtype == PGQ_Q5_1;
            d[0] = pgq_half(blk);
            c[0] = one ? pgq_half(blk + 2) : (five ? -16.0f : -8.0f) * d[0];
            const uint32_t qh = five ? pgq_u32(blk + (one ? 4 : 2)) : 0;
            const uint8_t *q = blk + (one ? 4 : 2) + (five ? 4 : 0);
            for (int l = 0; l < 32; l++)
                u[l] = (uint8_t)((l < 16 ? q[l] & 15 : q[l - 16] >> 4) | ((qh >> l) & 1) << 4);
            break;
        }
        case PGQ_Q4_K: case PGQ_Q5_K: {
            int scale, min;
            pgq_scale_min_k4(j, blk + 4, &scale, &min);
            d[0] = pgq_half(blk) * (float)scale;
            c[0] = -pgq_half(blk + 2) * (float)min;
            const int five = qtype == PGQ_Q5_K;
            const uint8_t *qh = blk + 16, *q = blk + (five ? 48 : 16) + 32 * (j / 2);
            for (int l = 0; l < 32; l++)
                u[l] = (uint8_t)(((j & 1) ? q[l] >> 4 : q[l] & 15) | (five ? ((qh[l] >> j) & 1) << 4 : 0));
            break;
        }
        case PGQ_Q6_K: {
            const int n = j / 4, t = j % 4;
            const uint8_t *ql = blk + 64 * n + 32 * (t & 1), *qh = blk + 128 + 32 * n;
            const int8_t *scales = (const int8_t *)(blk + 192) + 8 * n + 2 * t;
            const float dd = pgq_half(blk + 208);
            for (int h = 0; h < 2; h++) {
                d[h] = dd * (float)scales[h];
                c[h] = -32.0f * d[h];
            }
            for (int l = 0; l < 32; l++)
                u[l] = (uint8_t)(((ql[l] >> (4 * (t >> 1))) & 15) | ((qh[l] >> (2 * t)) & 3) << 4);
            return;
        }
        default:
            d[0] = c[0] = 0.0f;
    }
    d[1] = d[0];
    c[1] = c[0];
}

/* Sub-block b of a row as 32 float32 weights, as gguf's dequantize computes them: for the integer types
   d[h] * u + c[h] is the same single rounding as gguf's expressions, every product being exact in float32. */
static void pgq_decode(int qtype, const uint8_t *row, int64_t b, float *w) {
    const uint8_t *blk = pgq_block_of(qtype, row, b);
    if (qtype == PGQ_F32) {
        memcpy(w, blk, 128);
    } else if (qtype == PGQ_F16) {
        for (int l = 0; l < 32; l++) w[l] = pgq_half(blk + 2 * l);
    } else if (qtype == PGQ_BF16) {
        for (int l = 0; l < 32; l++) w[l] = pgq_bf16(blk + 2 * l);
    } else {
        uint8_t u[32];
        float d[2], c[2];
        pgq_unpack(qtype, row, b, u, d, c);
        for (int l = 0; l < 32; l++) w[l] = d[l / 16] * (float)u[l] + c[l / 16];
    }
}

/* out[r * out_stride] = x_r . w for the rows x_r = x + r * k of one weight row (exact weights,
   float32 arithmetic: the oracle the integer dot products of cpu_qdot.h are checked against). */
static void pgq_row_plain(int qtype, const uint8_t *row, int k, const float *x, int rows, float *out,
                          int64_t out_stride) {
    float w[32], acc[16] = {0};
    for (int64_t b = 0; b < k / 32; b++) {
        pgq_decode(qtype, row, b, w);
        for (int r = 0; r < rows; r++) {
            const float *xb = x + (int64_t)r * k + b * 32;
            float s = 0.0f;
            for (int l = 0; l < 32; l++) s += w[l] * xb[l];
            acc[r] += s;
        }
    }
    for (int r = 0; r < rows; r++) out[r * out_stride] = acc[r];
}

static void pgq_dequantize_row_plain(int qtype, const uint8_t *row, int k, float *out) {
    for (int64_t b = 0; b < k / 32; b++) pgq_decode(qtype, row, b, out + b * 32);
}

#if defined(__GNUC__) && defined(__x86_64__)
#include <immintrin.h>
#define PGQ_AVX2 __attribute__((target("avx2,fma,f16c")))

/* One float16 scale by the F16C instruction (exact, as the table; no load from a 256 KiB table). */
PGQ_AVX2 static inline float pgq_half_f16c(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

PGQ_AVX2 static inline __m256 pgq_bytes_to_float(__m128i bytes, int is_signed) {
    return _mm256_cvtepi32_ps(is_signed ? _mm256_cvtepi8_epi32(bytes) : _mm256_cvtepu8_epi32(bytes));
}

/* Sub-block b as four AVX2 vectors, the same values as pgq_decode (no fused multiply-add); the
   formats without a vector decoder here go through pgq_decode. */
PGQ_AVX2 static inline void pgq_decode_avx2(int qtype, const uint8_t *row, int64_t b, __m256 *w) {
    const uint8_t *blk = pgq_block_of(qtype, row, b);
    if (qtype == PGQ_F32) {
        for (int i = 0; i < 4; i++) w[i] = _mm256_loadu_ps((const float *)blk + 8 * i);
    } else if (qtype == PGQ_F16) {
        for (int i = 0; i < 4; i++) w[i] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 16 * i)));
    } else if (qtype == PGQ_BF16) {
        for (int i = 0; i < 4; i++)
            w[i] = _mm256_castsi256_ps(
                _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(blk + 16 * i))), 16));
    } else if (qtype == PGQ_Q8_0) {
        const __m256 d = _mm256_set1_ps(pgq_half_f16c(blk));
        for (int i = 0; i < 4; i++)
            w[i] = _mm256_mul_ps(d, pgq_bytes_to_float(_mm_loadl_epi64((const __m128i *)(blk + 2 + 8 * i)), 1));
    } else if (qtype == PGQ_Q4_0 || qtype == PGQ_Q4_1) {
        const __m256 d = _mm256_set1_ps(pgq_half_f16c(blk));
        const __m128i low4 = _mm_set1_epi8(15);
        const __m128i bytes = _mm_loadu_si128((const __m128i *)(blk + (qtype == PGQ_Q4_1 ? 4 : 2)));
        const __m128i lo = _mm_and_si128(bytes, low4), hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), low4);
        const __m128i nibbles[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
        if (qtype == PGQ_Q4_1) {
            const __m256 m = _mm256_set1_ps(pgq_half_f16c(blk + 2));
            for (int i = 0; i < 4; i++) w[i] = _mm256_add_ps(_mm256_mul_ps(d, pgq_bytes_to_float(nibbles[i], 0)), m);
        } else {
            const __m256 eight = _mm256_set1_ps(8.0f);
            for (int i = 0; i < 4; i++)
                w[i] = _mm256_mul_ps(d, _mm256_sub_ps(pgq_bytes_to_float(nibbles[i], 0), eight));
        }
    } else if (qtype == PGQ_Q5_0 || qtype == PGQ_Q5_1) {
        const int one = qtype == PGQ_Q5_1;
        const __m256 d = _mm256_set1_ps(pgq_half_f16c(blk));
        const __m128i low4 = _mm_set1_epi8(15), sixteen = _mm_set1_epi8(16);
        const __m128i bytes = _mm_loadu_si128((const __m128i *)(blk + (one ? 8 : 6)));
        const __m128i lo = _mm_and_si128(bytes, low4), hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), low4);
        /* value l's fifth bit is bit l of qh: byte l / 8 of qh spread over eight bytes, one bit each */
        const __m128i qh = _mm_cvtsi32_si128((int)pgq_u32(blk + (one ? 4 : 2)));
        const __m128i bit = _mm_set1_epi64x((long long)0x8040201008040201ULL);
        const __m128i lo_bits = _mm_shuffle_epi8(qh, _mm_set_epi64x(0x0101010101010101LL, 0));
        const __m128i hi_bits = _mm_shuffle_epi8(qh, _mm_set_epi64x(0x0303030303030303LL, 0x0202020202020202LL));
        const __m128i q_lo = _mm_or_si128(lo, _mm_and_si128(_mm_cmpeq_epi8(_mm_and_si128(lo_bits, bit), bit), sixteen));
        const __m128i q_hi = _mm_or_si128(hi, _mm_and_si128(_mm_cmpeq_epi8(_mm_and_si128(hi_bits, bit), bit), sixteen));
        const __m128i fives[4] = {q_lo, _mm_srli_si128(q_lo, 8), q_hi, _mm_srli_si128(q_hi, 8)};
        if (one) {
            const __m256 m = _mm256_set1_ps(pgq_half_f16c(blk + 2));
            for (int i = 0; i < 4; i++) w[i] = _mm256_add_ps(_mm256_mul_ps(d, pgq_bytes_to_float(fives[i], 0)), m);
        } else {
            const __m256 bias = _mm256_set1_ps(16.0f);
            for (int i = 0; i < 4; i++) w[i] = _mm256_mul_ps(d, _mm256_sub_ps(pgq_bytes_to_float(fives[i], 0), bias));
        }
    } else {
        float plain[32];
        pgq_decode(qtype, row, b, plain);
        for (int i = 0; i < 4; i++) w[i] = _mm256_loadu_ps(plain + 8 * i);
    }
}

/* pgq_row_plain with AVX2: each sub-block decoded once, folded into two accumulators a row so
   consecutive FMAs do not wait on each other. */
PGQ_AVX2 static void pgq_row_avx2(int qtype, const uint8_t *row, int k, const float *x, int rows,
                                  float *out, int64_t out_stride) {
    __m256 acc[2 * 16];
    for (int i = 0; i < 2 * rows; i++) acc[i] = _mm256_setzero_ps();
    for (int64_t b = 0; b < k / 32; b++) {
        __m256 w[4];
        pgq_decode_avx2(qtype, row, b, w);
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

/* A decode step's float matvec: out[i] = x . row i for four F16 rows (or blocks, exact) of k at once, each
   row's two accumulators in registers (pgq_row_avx2's order of addition: rows = 1 gives its bits) and every
   F16 row prefetched PGQ_FLOAT_PREFETCH bytes ahead (rows are contiguous, so this runs on into the next rows). */
#define PGQ_FLOAT_PREFETCH 1024
PGQ_AVX2 static void pgq_rows4_one_avx2(int qtype, const uint8_t *w, int64_t row_bytes, int k, const float *x,
                                        float *out) {
    __m256 acc[8];
    for (int i = 0; i < 8; i++) acc[i] = _mm256_setzero_ps();
    for (int64_t b = 0; b < k / 32; b++) {
        const __m256 x0 = _mm256_loadu_ps(x + b * 32), x1 = _mm256_loadu_ps(x + b * 32 + 8);
        const __m256 x2 = _mm256_loadu_ps(x + b * 32 + 16), x3 = _mm256_loadu_ps(x + b * 32 + 24);
        for (int r = 0; r < 4; r++) {
            const uint8_t *row = w + r * row_bytes;
            __m256 v[4];
            _mm_prefetch((const char *)pgq_block_of(qtype, row, b) + PGQ_FLOAT_PREFETCH, _MM_HINT_T0);
            pgq_decode_avx2(qtype, row, b, v);
            acc[2 * r] = _mm256_fmadd_ps(v[0], x0, acc[2 * r]);
            acc[2 * r + 1] = _mm256_fmadd_ps(v[1], x1, acc[2 * r + 1]);
            acc[2 * r] = _mm256_fmadd_ps(v[2], x2, acc[2 * r]);
            acc[2 * r + 1] = _mm256_fmadd_ps(v[3], x3, acc[2 * r + 1]);
        }
    }
    for (int r = 0; r < 4; r++) {
        const __m256 v = _mm256_add_ps(acc[2 * r], acc[2 * r + 1]);
        __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        h = _mm_add_ps(h, _mm_movehl_ps(h, h));
        h = _mm_add_ss(h, _mm_movehdup_ps(h));
        out[r] = _mm_cvtss_f32(h);
    }
}
static int pgq_has_avx2(void);
#define PGQ_AVX512 __attribute__((target("avx2,fma,avx512f,avx512vl")))
static int pgq_has_avx512vl(void) {
    return pgq_has_avx2() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl");
}

PGQ_AVX2 static void pgq_dequantize_row_avx2(int qtype, const uint8_t *row, int k, float *out) {
    for (int64_t b = 0; b < k / 32; b++) {
        __m256 w[4];
        pgq_decode_avx2(qtype, row, b, w);
        for (int i = 0; i < 4; i++) _mm256_storeu_ps(out + b * 32 + 8 * i, w[i]);
    }
}
static int pgq_has_avx2(void) {
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
}
#else
static void pgq_row_avx2(int qtype, const uint8_t *row, int k, const float *x, int rows, float *out,
                         int64_t out_stride) {}
static void pgq_dequantize_row_avx2(int qtype, const uint8_t *row, int k, float *out) {}
static void pgq_rows4_one_avx2(int qtype, const uint8_t *w, int64_t row_bytes, int k, const float *x, float *out) {}
static int pgq_has_avx2(void) { return 0; }
static int pgq_has_avx512vl(void) { return 0; }
#endif

typedef void (*pgq_row_fn)(int, const uint8_t *, int, const float *, int, float *, int64_t);
static pgq_row_fn pgq_row = pgq_row_plain;
typedef void (*pgq_dequantize_fn)(int, const uint8_t *, int, float *);
typedef void (*pgq_rows4_one_fn)(int, const uint8_t *, int64_t, int, const float *, float *);

/* Four rows, one activation row, row by row (what pgq_rows4_one_avx2 does in one pass). */
static void pgq_rows4_one_plain(int qtype, const uint8_t *w, int64_t row_bytes, int k, const float *x, float *out) {
    for (int r = 0; r < 4; r++) pgq_row(qtype, w + r * row_bytes, k, x, 1, out + r, 1);
}
static pgq_dequantize_fn pgq_dequantize_row = pgq_dequantize_row_plain;
static pgq_rows4_one_fn pgq_rows4_one = pgq_rows4_one_plain;
static void pgq_init_float(void) {
    for (uint32_t h = 0; h < 65536; h++) pgq_half_table[h] = pgq_half_to_float((uint16_t)h);
    if (pgq_has_avx2()) {
        pgq_row = pgq_row_avx2;
        pgq_dequantize_row = pgq_dequantize_row_avx2;
        pgq_rows4_one = pgq_rows4_one_avx2;
    }
}

#include "cpu_panels.h"

/* pgq_row and pgq_dequantize_row for row r of an N-row matrix in any layout (an interleaved one: cpu_qx8.h). */
static void pgq_row_of(int qtype, const uint8_t *w, int64_t n, int64_t r, int k, const float *x, int rows, float *out,
                       int64_t out_stride) {
    const int64_t row_bytes = (int64_t)k / pgq_block_elems(qtype) * pgq_block_bytes(qtype);
    uint8_t buf[pgq_is_x8(qtype) ? row_bytes : 1];
    pgq_row(pgq_base_type(qtype), pgq_row_at(qtype, w, n, row_bytes, r, buf), k, x, rows, out, out_stride);
}
static void pgq_dequantize_row_of(int qtype, const uint8_t *w, int64_t n, int64_t r, int k, float *out) {
    if (pgq_is_panels(qtype)) {
        pgq_panels_row(qtype, w, n, k, r, out);
        return;
    }
    const int64_t row_bytes = (int64_t)k / pgq_block_elems(qtype) * pgq_block_bytes(qtype);
    uint8_t buf[pgq_is_x8(qtype) ? row_bytes : 1];
    pgq_dequantize_row(pgq_base_type(qtype), pgq_row_at(qtype, w, n, row_bytes, r, buf), k, out);
}

#endif /* PAGEGATE_CPU_QUANT_H */
