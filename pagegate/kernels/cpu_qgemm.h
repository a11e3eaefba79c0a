/* Many activation rows against eight weight rows at a time, on AVX-512 VNNI (256-bit vectors): the rows' blocks
   are unpacked once into a tile whose vector lane i is weight row i (4 bytes of it a lane, as vpdpbusd sums
   them), so each activation dword is broadcast once for eight rows, the integer sums need no horizontal adds and
   one float multiply-add serves eight outputs. The tile is unpacked once for all the rows of a call, which is what
   makes a prompt cheap; its arithmetic is cpu_qdot.h's canonical order, so a row gets the bits the few-row
   kernels give it (batch invariance). Included by cpu_qdot.h on x86-64 gcc. */
#ifndef PAGEGATE_CPU_QGEMM_H
#define PAGEGATE_CPU_QGEMM_H

#include <stdlib.h>

#define PGQ_TILE_ROWS 8
#define PGQ_TILE_BLOCK 416  /* bytes of one block in a tile: 8 dwords x 8 rows, then wsum, d0, d1, c0, c1 (8 each) */
#define PGQ_VNNI __attribute__((target("avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni")))

static __thread uint8_t *pgq_tile_buffer;
static __thread int64_t pgq_tile_capacity;

/* This thread's tile of at least `bytes` (it lives as long as the thread); NULL when memory ran out. */
static uint8_t *pgq_tile(int64_t bytes) {
    if (bytes > pgq_tile_capacity) {
        free(pgq_tile_buffer);
        pgq_tile_buffer = aligned_alloc(64, (size_t)((bytes + 63) & ~(int64_t)63));
        pgq_tile_capacity = pgq_tile_buffer ? bytes : 0;
    }
    return pgq_tile_buffer;
}

/* v[i] = dword i of each of the eight rows v held (an 8 x 8 transpose of dwords). */
PGQ_VNNI PGQ_INLINE void pgq_transpose8(__m256i *v) {
    __m256i t[8], s[8];
    for (int i = 0; i < 4; i++) {
        t[2 * i] = _mm256_unpacklo_epi32(v[2 * i], v[2 * i + 1]);
        t[2 * i + 1] = _mm256_unpackhi_epi32(v[2 * i], v[2 * i + 1]);
    }
    for (int h = 0; h < 2; h++) {
        s[4 * h] = _mm256_unpacklo_epi64(t[4 * h], t[4 * h + 2]);
        s[4 * h + 1] = _mm256_unpackhi_epi64(t[4 * h], t[4 * h + 2]);
        s[4 * h + 2] = _mm256_unpacklo_epi64(t[4 * h + 1], t[4 * h + 3]);
        s[4 * h + 3] = _mm256_unpackhi_epi64(t[4 * h + 1], t[4 * h + 3]);
    }
    for (int i = 0; i < 4; i++) {
        v[i] = _mm256_permute2x128_si256(s[i], s[i + 4], 0x20);
        v[i + 4] = _mm256_permute2x128_si256(s[i], s[i + 4], 0x31);
    }
}

/* The eight rows at w into the tile, block by block: their values (Q8_0: signed, with wsum = 128 x each row's
   sum), the halves' scales and offsets. */
PGQ_VNNI PGQ_INLINE void pgq_tile_unpack(const int qtype, const uint8_t *w, int64_t row_bytes, int64_t nb,
                                         uint8_t *tile) {
    for (int64_t b = 0; b < nb; b++) {
        __m256i v[PGQ_TILE_ROWS];
        float scales[4][PGQ_TILE_ROWS];
        for (int i = 0; i < PGQ_TILE_ROWS; i++) {
            __m256 d;
            float c[2];
            v[i] = pgq_unpack_avx2(qtype, w + i * row_bytes, b, &d, c);
            scales[0][i] = _mm256_cvtss_f32(d);
            scales[1][i] = _mm_cvtss_f32(_mm256_extractf128_ps(d, 1));
            scales[2][i] = c[0];
            scales[3][i] = c[1];
        }
        pgq_transpose8(v);
        uint8_t *at = tile + b * PGQ_TILE_BLOCK;
        __m256i wsum = _mm256_setzero_si256();
        for (int j = 0; j < 8; j++) {
            _mm256_store_si256((__m256i *)(at + 32 * j), v[j]);
            if (qtype == PGQ_Q8_0) wsum = _mm256_dpbusd_epi32(wsum, _mm256_set1_epi8(1), v[j]);
        }
        _mm256_store_si256((__m256i *)(at + 256), _mm256_slli_epi32(wsum, 7));
        for (int j = 0; j < 4; j++) _mm256_store_ps((float *)(at + 288 + 32 * j), _mm256_loadu_ps(scales[j]));
    }
}

/* Activation rows r0 .. r0 + rows - 1 of a against the tile into out (eight floats a row), in the canonical order. */
PGQ_VNNI PGQ_INLINE void pgq_tile_rows(const int qtype, const uint8_t *tile, const pgq_act *a, int r0, const int rows,
                                       float *out, int64_t out_stride) {
    const int64_t nb = a->k / 32;
    __m256 f[4];
    for (int r = 0; r < rows; r++) f[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *at = tile + b * PGQ_TILE_BLOCK;
        __m256i v[8];
        for (int j = 0; j < 8; j++) v[j] = _mm256_load_si256((const __m256i *)(at + 32 * j));
        const __m256 d0 = _mm256_load_ps((const float *)(at + 288)), d1 = _mm256_load_ps((const float *)(at + 320));
        const __m256 c0 = _mm256_load_ps((const float *)(at + 352)), c1 = _mm256_load_ps((const float *)(at + 384));
        for (int r = 0; r < rows; r++) {
            const int64_t x = (r0 + r) * nb + b;
            const int32_t *q = (const int32_t *)(a->q + x * 32);
            const __m256 dx = _mm256_set1_ps(a->d[x]);
            __m256i low = _mm256_setzero_si256(), high = _mm256_setzero_si256();
            if (qtype == PGQ_Q8_0) {  /* (q + 128) . w, less 128 sum(w): w . q */
                for (int j = 0; j < 8; j++)
                    low = _mm256_dpbusd_epi32(low, _mm256_set1_epi32(q[j] ^ (int32_t)0x80808080), v[j]);
                low = _mm256_sub_epi32(low, _mm256_load_si256((const __m256i *)(at + 256)));
                f[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(low), _mm256_mul_ps(d0, dx), f[r]);
                continue;
            }
            for (int j = 0; j < 4; j++) low = _mm256_dpbusd_epi32(low, v[j], _mm256_set1_epi32(q[j]));
            for (int j = 4; j < 8; j++) high = _mm256_dpbusd_epi32(high, v[j], _mm256_set1_epi32(q[j]));
            if (qtype == PGQ_Q6_K) {
                f[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(low), _mm256_mul_ps(d0, dx), f[r]);
                f[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(high), _mm256_mul_ps(d1, dx), f[r]);
                f[r] = _mm256_fmadd_ps(c0, _mm256_set1_ps(a->s[PGQ_SUMS * x]), f[r]);
                f[r] = _mm256_fmadd_ps(c1, _mm256_set1_ps(a->s[PGQ_SUMS * x + 1]), f[r]);
            } else {
                const __m256i sum = _mm256_add_epi32(low, high);
                f[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_mul_ps(d0, dx), f[r]);
                f[r] = _mm256_fmadd_ps(c0, _mm256_set1_ps(a->s[PGQ_SUMS * x + 2]), f[r]);
            }
        }
    }
    for (int r = 0; r < rows; r++) _mm256_storeu_ps(out + (r0 + r) * out_stride, f[r]);
}

PGQ_VNNI PGQ_INLINE void pgq_gemm8_body(const int qtype, const uint8_t *w, int64_t row_bytes, const pgq_act *a,
                                        uint8_t *tile, float *out, int64_t out_stride) {
    pgq_tile_unpack(qtype, w, row_bytes, a->k / 32, tile);
    int r0 = 0;
    for (; r0 + 4 <= a->m; r0 += 4) pgq_tile_rows(qtype, tile, a, r0, 4, out, out_stride);
    for (; r0 < a->m; r0++) pgq_tile_rows(qtype, tile, a, r0, 1, out, out_stride);
}

/* out[r * out_stride + i] = row i . x_r for the eight weight rows at w and every activation row of a; 0 when this
   thread's tile could not be had (the caller then takes the few-row kernels). */
PGQ_VNNI static int pgq_gemm8_vnni(int qtype, const uint8_t *w, int64_t row_bytes, const pgq_act *a, float *out,
                                   int64_t out_stride) {
    uint8_t *tile = pgq_tile(a->k / 32 * PGQ_TILE_BLOCK);
    if (tile == NULL) return 0;
    switch (qtype) {
#define PGQ_GEMM_CASE(T) case T: pgq_gemm8_body(T, w, row_bytes, a, tile, out, out_stride); return 1;
        PGQ_GEMM_CASE(PGQ_Q4_0) PGQ_GEMM_CASE(PGQ_Q4_1) PGQ_GEMM_CASE(PGQ_Q5_0) PGQ_GEMM_CASE(PGQ_Q5_1)
        PGQ_GEMM_CASE(PGQ_Q8_0) PGQ_GEMM_CASE(PGQ_Q4_K) PGQ_GEMM_CASE(PGQ_Q5_K) PGQ_GEMM_CASE(PGQ_Q6_K)
#undef PGQ_GEMM_CASE
    }
    return 0;
}

#endif /* PAGEGATE_CPU_QGEMM_H */
