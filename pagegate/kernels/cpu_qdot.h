/* Integer dot products of GGUF blocks with activations quantized once per matmul, as llama.cpp
   computes them: x is rounded to int8 per 32 values with one float scale (Q8), every weight
   sub-block is unpacked to 32 unsigned bytes u with w = d * u + c (d per 16 values for Q6_K), and
       w . x = d * dx * sum(u * q) + c * dx * sum(q),
   so a sub-block costs one integer dot product and one float multiply-add. The integer sums are
   exact; only the float scales and their order of addition round.

   NOTE: one order of float operations for every kernel, so a row's result never depends on the rows
   computed with it (batch invariance): per row, f = 0, then for each 32-block b in order
       f = fma(float(isum), d * dx, f),  f = fma(c, s0 + s1, f)
   with isum the block's exact integer sum (Q6_K: its two halves, each with its own d and c:
   fma(isum0, d0 dx), fma(isum1, d1 dx), fma(c0, s0), fma(c1, s1); Q8_0: isum = sum(w q), no c).
   The few-row kernels take four weight rows of the file's layout at once; the interleaved kernels
   (cpu_qx8.h's layout) put eight weight rows in the lanes of a vector; the portable C is scalar:
   all give the same bits.

   Four builds of the kernels: AVX-512 VNNI with the interleaved kernels on 512-bit vectors (two
   groups, sixteen rows, a vector: cpu_qx8_isa.h), the same on 256-bit vectors (vpdpbusd), AVX2
   (vpmaddubsw) and portable C; the CPU picks one when the module loads, and pgq_set_isa forces one
   (the tests run all four). */
#ifndef PAGEGATE_CPU_QDOT_H
#define PAGEGATE_CPU_QDOT_H

#include <math.h>
#include <stdint.h>
#include "cpu_quant.h"

#define PGQ_GROUP 4   /* weight rows a kernel call takes */
#ifndef PGQ_PREFETCH
#define PGQ_PREFETCH 2048  /* bytes ahead of the block being read that a decode step prefetches in each row */
#endif
#define PGQ_MAX_M 16  /* activation rows a kernel call takes */

/* Activations in Q8: m rows of k values; per 32-block b of row r (i = r * k / 32 + b): the scale d[i], and
   s[PGQ_SUMS * i + h] = d * the sum of half h's 16 int8 values, s[PGQ_SUMS * i + 2] = the two added (the kernels'
   c term), s[PGQ_SUMS * i + 3] = 128 * the sum of the 32 int8 values (exact: what interleaved Q8_0 takes off). */
#define PGQ_SUMS 4
typedef struct {
    int64_t k;
    int m;
    int8_t *q;
    float *d;
    float *s;
} pgq_act;

/* One block of 32 values into int8 q, its scale d and the two halves' integer sums (the same bits on every ISA:
   a max, one float product a value, round to nearest even). */
static void pgq_quantize_block_plain(const float *xb, int8_t *q, float *d, int *sum) {
    float amax = 0.0f;
    for (int l = 0; l < 32; l++) amax = fmaxf(amax, fabsf(xb[l]));
    const float id = amax > 0.0f ? 1.0f / (amax / 127.0f) : 0.0f;
    *d = amax / 127.0f;
    sum[0] = sum[1] = 0;
    for (int l = 0; l < 32; l++) {
        q[l] = (int8_t)lrintf(xb[l] * id);
        sum[l / 16] += q[l];
    }
}

#if defined(__GNUC__) && defined(__x86_64__)
__attribute__((target("avx2,fma,f16c"))) static void pgq_quantize_block_avx2(const float *xb, int8_t *q, float *d,
                                                                              int *sum) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 v[4], m = _mm256_setzero_ps();
    for (int i = 0; i < 4; i++) {
        v[i] = _mm256_loadu_ps(xb + 8 * i);
        m = _mm256_max_ps(m, _mm256_andnot_ps(sign, v[i]));
    }
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    const float amax = _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
    const __m256 id = _mm256_set1_ps(amax > 0.0f ? 1.0f / (amax / 127.0f) : 0.0f);
    *d = amax / 127.0f;
    __m256i n[4];
    for (int i = 0; i < 4; i++) n[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], id));
    const __m256i words = _mm256_packs_epi32(n[0], n[1]), words2 = _mm256_packs_epi32(n[2], n[3]);
    const __m256i bytes = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(words, words2),
                                                      _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256((__m256i *)q, bytes);
    const __m256i low = _mm256_add_epi32(n[0], n[1]), high = _mm256_add_epi32(n[2], n[3]);
    __m128i s0 = _mm_add_epi32(_mm256_castsi256_si128(low), _mm256_extracti128_si256(low, 1));
    __m128i s1 = _mm_add_epi32(_mm256_castsi256_si128(high), _mm256_extracti128_si256(high, 1));
    s0 = _mm_hadd_epi32(_mm_hadd_epi32(s0, s1), _mm_setzero_si128());
    sum[0] = _mm_cvtsi128_si32(s0);
    sum[1] = _mm_extract_epi32(s0, 1);
}
#endif

typedef void (*pgq_quantize_block_fn)(const float *, int8_t *, float *, int *);
static pgq_quantize_block_fn pgq_quantize_block = pgq_quantize_block_plain;

/* Row r of x (k floats) into the Q8 of a, blocks [first, last) of it. */
static void pgq_quantize_row(const float *x, const pgq_act *a, int r, int64_t first, int64_t last) {
    const int64_t nb = a->k / 32;
    for (int64_t b = first; b < last; b++) {
        const int64_t i = r * nb + b;
        int sum[2];
        pgq_quantize_block(x + b * 32, a->q + r * a->k + b * 32, &a->d[i], sum);
        float *s = a->s + PGQ_SUMS * i;
        s[0] = a->d[i] * (float)sum[0];
        s[1] = a->d[i] * (float)sum[1];
        s[2] = s[0] + s[1];
        s[3] = 128.0f * (float)(sum[0] + sum[1]);
    }
}

/* Row i's block b against activation block x of row r, in the canonical order (the NOTE above) into f. */
static inline float pgq_block_plain(int qtype, const uint8_t *w, int64_t b, const pgq_act *a, int64_t x, float f) {
    uint8_t u[32];
    float d[2], c[2];
    pgq_unpack(qtype, w, b, u, d, c);
    const int8_t *q = a->q + x * 32;
    int sum[2] = {0, 0}, qsum = 0;
    for (int l = 0; l < 32; l++) {
        sum[l / 16] += u[l] * q[l];
        qsum += q[l];
    }
    const float dx = a->d[x], *s = a->s + PGQ_SUMS * x;
    if (qtype == PGQ_Q6_K) {
        f = fmaf((float)sum[0], d[0] * dx, f);
        f = fmaf((float)sum[1], d[1] * dx, f);
        f = fmaf(c[0], s[0], f);
        return fmaf(c[1], s[1], f);
    }
    if (qtype == PGQ_Q8_0) return fmaf((float)(sum[0] + sum[1] - 128 * qsum), d[0] * dx, f);  /* u = w + 128 */
    f = fmaf((float)(sum[0] + sum[1]), d[0] * dx, f);
    return fmaf(c[0], s[2], f);
}

/* out[r * out_stride + i] = row i . x_r for the `rows` (<= PGQ_GROUP) weight rows at w, w + row_bytes, ... */
static void pgq_qdot_plain(int qtype, const uint8_t *w, int64_t row_bytes, int rows, const pgq_act *a,
                           float *out, int64_t out_stride) {
    const int64_t nb = a->k / 32;
    for (int r = 0; r < a->m; r++)
        for (int i = 0; i < rows; i++) {
            float f = 0.0f;
            for (int64_t b = 0; b < nb; b++) f = pgq_block_plain(qtype, w + i * row_bytes, b, a, r * nb + b, f);
            out[r * out_stride + i] = f;
        }
}

#if defined(__GNUC__) && defined(__x86_64__)
#define PGQ_INLINE static inline __attribute__((always_inline))

/* 32 bytes: 0x10 where bit l of bits is set, else 0 (llama.cpp's bytes_from_bits_32). */
PGQ_AVX2 PGQ_INLINE __m256i pgq_bits_to_16s(uint32_t bits) {
    const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32((int)bits),
        _mm256_setr_epi64x(0x0000000000000000, 0x0101010101010101, 0x0202020202020202, 0x0303030303030303));
    const __m256i set = _mm256_cmpeq_epi8(_mm256_or_si256(spread, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe)),
                                          _mm256_set1_epi64x(-1));
    return _mm256_and_si256(set, _mm256_set1_epi8(0x10));
}
PGQ_AVX2 PGQ_INLINE __m256i pgq_nibbles_16(const uint8_t *q) {  /* 16 bytes: low nibbles, then high */
    const __m128i v = _mm_loadu_si128((const __m128i *)q), low4 = _mm_set1_epi8(15);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), low4), _mm_and_si128(v, low4));
}
PGQ_AVX2 PGQ_INLINE __m256i pgq_bits_at(__m256i v, int shift, int mask) {  /* (v >> shift) & mask per byte */
    return _mm256_and_si256(_mm256_srli_epi16(v, shift), _mm256_set1_epi8((char)mask));
}

/* Sub-block j of K-quant super-block blk as 32 unsigned bytes (pgq_unpack's u). */
PGQ_AVX2 PGQ_INLINE __m256i pgq_kbits_avx2(const int qtype, const uint8_t *blk, int j) {
    if (qtype == PGQ_Q6_K) {
        const int n = j / 4, t = j % 4;
        const __m256i ql = _mm256_loadu_si256((const __m256i *)(blk + 64 * n + 32 * (t & 1)));
        const __m256i qh = _mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * n));
        return _mm256_or_si256(pgq_bits_at(ql, 4 * (t >> 1), 15), _mm256_slli_epi16(pgq_bits_at(qh, 2 * t, 3), 4));
    }
    const int five = qtype == PGQ_Q5_K;
    const __m256i q = _mm256_loadu_si256((const __m256i *)(blk + (five ? 48 : 16) + 32 * (j / 2)));
    const __m256i u = pgq_bits_at(q, 4 * (j & 1), 15);
    if (!five) return u;
    const __m256i qh = _mm256_loadu_si256((const __m256i *)(blk + 16));
    return _mm256_or_si256(u, _mm256_slli_epi16(pgq_bits_at(qh, j, 1), 4));
}

/* pgq_unpack as one vector, qtype a constant where it is inlined. d is the per-lane scale (lanes
   0-3 hold values 0-15, lanes 4-7 values 16-31); Q8_0 comes back as its int8 values (c unused). */
PGQ_AVX2 PGQ_INLINE __m256i pgq_unpack_avx2(const int qtype, const uint8_t *row, int64_t b, __m256 *d, float *c) {
    const uint8_t *blk = pgq_block_of(qtype, row, b);
    const int j = (int)(b % 8);
    if (qtype == PGQ_Q8_0) {
        *d = _mm256_set1_ps(pgq_half_f16c(blk));
        c[0] = c[1] = -128.0f * pgq_half_f16c(blk);
        return _mm256_loadu_si256((const __m256i *)(blk + 2));
    }
    if (qtype == PGQ_Q4_0 || qtype == PGQ_Q4_1 || qtype == PGQ_Q5_0 || qtype == PGQ_Q5_1) {
        const int one = qtype == PGQ_Q4_1 || qtype == PGQ_Q5_1, five = qtype == PGQ_Q5_0 || qtype == PGQ_Q5_1;
        /* the scale and the minimum (Q4_1, Q5_1) are adjacent halves: one conversion for both */
        const __m128 scales = _mm_cvtph_ps(_mm_cvtsi32_si128((int)pgq_u32(blk)));
        *d = _mm256_broadcastss_ps(scales);
        c[0] = c[1] = one ? _mm_cvtss_f32(_mm_movehdup_ps(scales)) : (five ? -16.0f : -8.0f) * _mm_cvtss_f32(scales);
        const __m256i u = pgq_nibbles_16(blk + (one ? 4 : 2) + (five ? 4 : 0));
        return five ? _mm256_or_si256(u, pgq_bits_to_16s(pgq_u32(blk + (one ? 4 : 2)))) : u;
    }
    if (qtype == PGQ_Q4_K || qtype == PGQ_Q5_K) {
        int scale, min;
        pgq_scale_min_k4(j, blk + 4, &scale, &min);
        *d = _mm256_set1_ps(pgq_half_f16c(blk) * (float)scale);
        c[0] = c[1] = -pgq_half_f16c(blk + 2) * (float)min;
        return pgq_kbits_avx2(qtype, blk, j);
    }
    /* Q6_K */
    const int8_t *scales = (const int8_t *)(blk + 192) + 2 * j;
    const float dd = pgq_half_f16c(blk + 208), d0 = dd * (float)scales[0], d1 = dd * (float)scales[1];
    *d = _mm256_setr_m128(_mm_set1_ps(d0), _mm_set1_ps(d1));
    c[0] = -32.0f * d0;
    c[1] = -32.0f * d1;
    return pgq_kbits_avx2(qtype, blk, j);
}

/* The scales of K-quant super-block blk, in the lanes of two vectors: Q4_K and Q5_K: d[0] lane j: sub-block j's
   scale (the products pgq_unpack_avx2 forms), c[0]: its offset; Q6_K: d[0], d[1]: the scales of its 16 halves (c is
   -32 d). */
PGQ_AVX2 PGQ_INLINE void pgq_kscales_avx2(const int qtype, const uint8_t *blk, __m256 *d, __m256 *c) {
    if (qtype == PGQ_Q6_K) {
        const __m256 dd = _mm256_set1_ps(pgq_half_f16c(blk + 208));
        const __m128i scales = _mm_loadu_si128((const __m128i *)(blk + 192));
        d[0] = _mm256_mul_ps(dd, pgq_bytes_to_float(scales, 1));
        d[1] = _mm256_mul_ps(dd, pgq_bytes_to_float(_mm_srli_si128(scales, 8), 1));
        return;
    }
    /* twelve bytes: scales 0-3 and mins 0-3 in their low six bits, 4-7 in the rest (pgq_scale_min_k4) */
    const uint32_t low = pgq_u32(blk + 4), mid = pgq_u32(blk + 8), high = pgq_u32(blk + 12);
    const uint32_t scales_high = (high & 0x0f0f0f0f) | ((low >> 6) & 0x03030303) << 4;
    const uint32_t mins_high = ((high >> 4) & 0x0f0f0f0f) | ((mid >> 6) & 0x03030303) << 4;
    const __m128i scales = _mm_cvtsi64_si128((int64_t)((uint64_t)scales_high << 32 | (low & 0x3f3f3f3f)));
    const __m128i mins = _mm_cvtsi64_si128((int64_t)((uint64_t)mins_high << 32 | (mid & 0x3f3f3f3f)));
    d[0] = _mm256_mul_ps(_mm256_set1_ps(pgq_half_f16c(blk)), pgq_bytes_to_float(scales, 0));
    c[0] = _mm256_mul_ps(_mm256_set1_ps(-pgq_half_f16c(blk + 2)), pgq_bytes_to_float(mins, 0));
}

/* out[e][i] = rows[i] lane e: four rows' eight lanes as eight vectors of four. */
PGQ_AVX2 PGQ_INLINE void pgq_transpose4x8(const __m256 *rows, __m128 *out) {
    const __m256 t0 = _mm256_unpacklo_ps(rows[0], rows[1]), t1 = _mm256_unpackhi_ps(rows[0], rows[1]);
    const __m256 t2 = _mm256_unpacklo_ps(rows[2], rows[3]), t3 = _mm256_unpackhi_ps(rows[2], rows[3]);
    const __m256 lanes[4] = {_mm256_shuffle_ps(t0, t2, 0x44), _mm256_shuffle_ps(t0, t2, 0xEE),
                             _mm256_shuffle_ps(t1, t3, 0x44), _mm256_shuffle_ps(t1, t3, 0xEE)};
    for (int e = 0; e < 4; e++) {  /* lanes[e]: lane e of the rows, then lane e + 4 */
        out[e] = _mm256_castps256_ps128(lanes[e]);
        out[e + 4] = _mm256_extractf128_ps(lanes[e], 1);
    }
}

PGQ_AVX2 PGQ_INLINE float pgq_hsum(__m256 v) {
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    h = _mm_add_ss(h, _mm_movehdup_ps(h));
    return _mm_cvtss_f32(h);
}

#define PGQ_ISA avx2
#define PGQ_TARGET PGQ_AVX2
#define PGQ_DOT(u, q) _mm256_madd_epi16(_mm256_maddubs_epi16(u, q), _mm256_set1_epi16(1))
#define PGQ_DOT_BCAST(acc, u, q) _mm256_add_epi32(acc, PGQ_DOT(u, _mm256_set1_epi32(*(q))))
#define PGQ_SATURATES 1  /* vpmaddubsw's pair sums are 16-bit */
#define PGQ_X8_TOKENS 4  /* activation rows an interleaved kernel's pass takes: as many as 16 registers hold */
#include "cpu_qdot_isa.h"

#define PGQ_ISA vnni
#define PGQ_VNNI_TARGET __attribute__((target("avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni")))
#define PGQ_TARGET PGQ_VNNI_TARGET
#define PGQ_DOT(u, q) _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, q)
/* acc += u . (the dword at q, in every lane): vpdpbusd with the dword broadcast from memory in the instruction (gcc
   loads it into a register first, one more instruction for each of the kernels' most frequent one). */
PGQ_VNNI_TARGET PGQ_INLINE __m256i pgq_dot_bcast_vnni(__m256i acc, __m256i u, const int32_t *q) {
    __asm__("vpdpbusd %2%{1to8%}, %1, %0" : "+v"(acc) : "v"(u), "m"(*q));
    return acc;
}
#define PGQ_DOT_BCAST(acc, u, q) pgq_dot_bcast_vnni(acc, u, q)
#define PGQ_SATURATES 0
#define PGQ_X8_TOKENS 8  /* AVX-512's 32 registers */
#include "cpu_qdot_isa.h"

/* The interleaved kernels again on 512-bit vectors, two groups a call (cpu_qx8_isa.h). */
PGQ_VNNI_TARGET PGQ_INLINE __m512i pgq_dot_bcast_vnni_pair(__m512i acc, __m512i u, const int32_t *q) {
    __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(u), "m"(*q));
    return acc;
}
#define PGQ_ISA vnni_pair
#define PGQ_TARGET PGQ_VNNI_TARGET
#define PGQ_DOT_BCAST(acc, u, q) pgq_dot_bcast_vnni_pair(acc, u, q)
#define PGQ_SATURATES 0
#define PGQ_X8_TOKENS 8
#define PGQ_X_GROUPS 2
#include "cpu_qx8_isa.h"
#undef PGQ_ISA
#undef PGQ_TARGET
#undef PGQ_DOT_BCAST
#undef PGQ_SATURATES
#undef PGQ_X8_TOKENS

static int pgq_has_vnni(void) {
    return pgq_has_avx2() && __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl")
           && __builtin_cpu_supports("avx512bw");
}
#else
static void pgq_qdot_avx2(int qtype, const uint8_t *w, int64_t row_bytes, int rows, const pgq_act *a,
                          float *out, int64_t out_stride) {}
static void pgq_qdot_vnni(int qtype, const uint8_t *w, int64_t row_bytes, int rows, const pgq_act *a,
                          float *out, int64_t out_stride) {}
static int pgq_has_vnni(void) { return 0; }
static void pgq_x8_dot_avx2(int base, const uint8_t *group, int64_t row_bytes, const pgq_act *a, float *out,
                            int64_t out_stride) {}
static void pgq_x8_dot_vnni(int base, const uint8_t *group, int64_t row_bytes, const pgq_act *a, float *out,
                            int64_t out_stride) {}
static void pgq_x8_dot_vnni_pair(int base, const uint8_t *group, int64_t row_bytes, const pgq_act *a, float *out,
                                 int64_t out_stride) {}
#endif

/* out[r * out_stride + i] = row i . x_r for the eight rows of an interleaved group (cpu_qx8.h) of `base` blocks and
   every activation row of a: row by row, each copied out of the group (the vector kernels read it in place). */
static void pgq_x8_dot_plain(int base, const uint8_t *group, int64_t row_bytes, const pgq_act *a, float *out,
                             int64_t out_stride) {
    uint8_t row[row_bytes];
    for (int i = 0; i < PGQ_X8_ROWS; i++)
        pgq_qdot_plain(base, pgq_row_at(base + PGQ_X8, group, PGQ_X8_ROWS, row_bytes, i, row), row_bytes, 1, a,
                       out + i, out_stride);
}

typedef void (*pgq_qdot_fn)(int, const uint8_t *, int64_t, int, const pgq_act *, float *, int64_t);
typedef void (*pgq_x8_dot_fn)(int, const uint8_t *, int64_t, const pgq_act *, float *, int64_t);
static pgq_qdot_fn pgq_qdot = pgq_qdot_plain;
static pgq_x8_dot_fn pgq_x8_dot = pgq_x8_dot_plain;
static pgq_x8_dot_fn pgq_x8_pair_dot = NULL;  /* two adjacent groups a call, where the set reads them as one */
static const char *pgq_isa = "portable";

/* Groups a call of pgq_x8_dot_groups serves at once: 2 where the instruction set reads two groups as one vector. */
static inline int pgq_x8_span(void) { return pgq_x8_pair_dot ? 2 : 1; }

/* pgq_x8_dot for `groups` adjacent groups (8 * row_bytes apart), their outputs side by side: out[r * out_stride +
   8 g + i]; pairs of them in one call where the instruction set has it (the same bits). */
static void pgq_x8_dot_groups(int base, const uint8_t *group, int64_t row_bytes, int64_t groups, const pgq_act *a,
                              float *out, int64_t out_stride) {
    int64_t g = 0;
    const int64_t bytes = PGQ_X8_ROWS * row_bytes;
    if (pgq_x8_pair_dot)
        for (; g + 2 <= groups; g += 2) pgq_x8_pair_dot(base, group + g * bytes, row_bytes, a, out + 8 * g, out_stride);
    for (; g < groups; g++) pgq_x8_dot(base, group + g * bytes, row_bytes, a, out + 8 * g, out_stride);
}

/* Use the named kernels ("avx512", "vnni", "avx2", "portable") if this CPU runs them; returns whether it does.
   "avx512" is "vnni" with the interleaved kernels on 512-bit vectors. */
static int pgq_set_isa(const char *name) {
    const int avx512 = !strcmp(name, "avx512");
    if ((avx512 || !strcmp(name, "vnni")) && pgq_has_vnni()) {
        pgq_qdot = pgq_qdot_vnni, pgq_x8_dot = pgq_x8_dot_vnni, pgq_isa = avx512 ? "avx512" : "vnni";
        pgq_x8_pair_dot = avx512 ? pgq_x8_dot_vnni_pair : NULL;
        pgq_panels_isa = pgq_has_avx512vl() ? 2 : 1;
        return 1;
    }
    if (!strcmp(name, "avx2") && pgq_has_avx2()) {
        pgq_qdot = pgq_qdot_avx2, pgq_x8_dot = pgq_x8_dot_avx2, pgq_isa = "avx2", pgq_x8_pair_dot = NULL;
        pgq_panels_isa = 1;
        return 1;
    }
    if (!strcmp(name, "portable")) {
        pgq_qdot = pgq_qdot_plain, pgq_x8_dot = pgq_x8_dot_plain, pgq_isa = "portable", pgq_x8_pair_dot = NULL;
        pgq_panels_isa = 0;
        return 1;
    }
    return 0;
}
static void pgq_init(void) {
    pgq_init_float();
#if defined(__GNUC__) && defined(__x86_64__)
    if (pgq_has_avx2()) pgq_quantize_block = pgq_quantize_block_avx2;
#endif
    if (!pgq_set_isa("avx512")) (void)(pgq_set_isa("avx2") || pgq_set_isa("portable"));
}

#endif /* PAGEGATE_CPU_QDOT_H */
