/* The C of pagegate/kernels/cpu_quant.pyx: included by the Cython module, readable by C tools. */
#ifndef PAGEGATE_CPU_QUANT_H
#define PAGEGATE_CPU_QUANT_H

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

#endif /* PAGEGATE_CPU_QUANT_H */
