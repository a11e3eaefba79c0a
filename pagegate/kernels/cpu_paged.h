/* The C of pagegate/kernels/cpu_paged.pyx: included by the Cython module, readable by C tools. */
#ifndef PAGEGATE_CPU_PAGED_H
#define PAGEGATE_CPU_PAGED_H

#include <math.h>
#include <stdint.h>
#include <string.h>
#include "cpu_page_rows.h"

/* Plain loops that gcc -O3 vectorises without -ffast-math: `omp simd reduction` (honoured under -fopenmp)
   lets a dot product's sum be split into vector lanes. Four keys at a time give four independent sums (no
   wait on one adder chain), and one load and store of an accumulator per four value rows. Other formats
   convert their rows into float32 first (PG_CONVERTED_TILES). */
static inline float pg_dot_f32(const float *q, const float *k, int n) {
    float s = 0.0f;
    #pragma omp simd reduction(+:s)
    for (int i = 0; i < n; i++) s += q[i] * k[i];
    return s;
}
static inline void pg_dot4_f32(const float *q, const float *k0, const float *k1, const float *k2, const float *k3,
                               int n, float *out) {
    float s0 = 0.0f, s1 = 0.0f, s2 = 0.0f, s3 = 0.0f;
    #pragma omp simd reduction(+:s0, s1, s2, s3)
    for (int i = 0; i < n; i++) {
        s0 += q[i] * k0[i];
        s1 += q[i] * k1[i];
        s2 += q[i] * k2[i];
        s3 += q[i] * k3[i];
    }
    out[0] = s0; out[1] = s1; out[2] = s2; out[3] = s3;
}
static inline void pg_axpy_f32(float *y, float w, const float *v, int n) {
    for (int i = 0; i < n; i++) y[i] += w * v[i];
}
static inline void pg_axpy4_f32(float *y, const float *w, const float *v0, const float *v1, const float *v2,
                                const float *v3, int n) {
    const float w0 = w[0], w1 = w[1], w2 = w[2], w3 = w[3];
    for (int i = 0; i < n; i++)
        y[i] += w0 * v0[i] + w1 * v1[i] + w2 * v2[i] + w3 * v3[i];
}

static inline void pg_scale(float *y, float a, int n) {
    for (int i = 0; i < n; i++) y[i] *= a;
}


/* tanh as Eigen computes it for float: a 13/6 rational function on [-7.9053, 7.9053] (within 4
   ulp; beyond, tanh rounds to +-1), plain arithmetic so a loop of it vectorises, where libm's
   tanhf is a call per element. NaN stays NaN. */
static inline float pg_tanh(float x) {
    const float clamp = 7.90531110763549805f;
    x = x > clamp ? clamp : (x < -clamp ? -clamp : x);
    const float x2 = x * x;
    float p = -2.76076847742355e-16f;
    p = p * x2 + 2.00018790482477e-13f;
    p = p * x2 - 8.60467152213735e-11f;
    p = p * x2 + 5.12229709037114e-08f;
    p = p * x2 + 1.48572235717979e-05f;
    p = p * x2 + 6.37261928875436e-04f;
    p = p * x2 + 4.89352455891786e-03f;
    float q = 1.19825839466702e-06f;
    q = q * x2 + 1.18534705686654e-04f;
    q = q * x2 + 2.26843463243900e-03f;
    q = q * x2 + 4.89352518554385e-03f;
    return x * p / q;
}

/* Gemma 2's logit soft-cap of a row of raw dot products: y = cap * tanh(y * scale / cap), with
   a = scale / cap folded into one multiply. (Unused by modules that include this header only
   for the tile functions.) */
PG_CLONES __attribute__((unused)) static void pg_softcap(float *y, float a, float cap, int n) {
    for (int i = 0; i < n; i++) y[i] = cap * pg_tanh(a * y[i]);
}


/* How far ahead of use a tile asks for K/V rows, in keys: prefetch_bytes of rows of row_bytes. */
#define PG_MAX_AHEAD 64
static inline int pg_ahead(int64_t prefetch_bytes, int64_t row_bytes) {
    const int64_t keys = prefetch_bytes / row_bytes;
    return keys < 4 ? 4 : keys > PG_MAX_AHEAD ? PG_MAX_AHEAD : (int)keys;
}

/* slot[j] = the byte offset in the caches of key first + j's slot, for j < count (table: the sequence's
   pages), then copies of the last one up to `total`: a tile of n keys fetching `ahead` keys on needs
   n + ahead + 4 slots. */
static inline void pg_slots(const int32_t *table, int block_size, int64_t slot_stride, int first, int count,
                            int total, int64_t *slot) {
    int page = first / block_size, at = first % block_size;
    for (int j = 0; j < count; j++) {
        slot[j] = ((int64_t)table[page] * block_size + at) * slot_stride;
        if (++at == block_size) {
            at = 0;
            page++;
        }
    }
    for (int j = count; j < total; j++) slot[j] = slot[count - 1];
}

/* scores[r * stride + j] = q_r . k_j for every row r and key j of a tile, key by key across the rows so pages
   are read in order; row r's K row of key j starts at keys + slot[j] + head_offset[r] (bytes). Asks for the
   keys `ahead` places on in advance (slot holds num_keys + ahead + 4 entries: pg_slots). Float32 rows are
   read where they lie. */
PG_CLONES static void pg_score_tile_f32(const uint8_t *keys, const int64_t *slot, int num_keys,
                                        const float **query_row, const int64_t *head_offset, int rows, int head_dim,
                                        int ahead, float *scores, int stride) {
    const int64_t span = pg_span(head_offset, rows, (int64_t)head_dim * 4);
    int j = 0;
    for (; j + 4 <= num_keys; j += 4) {
        pg_prefetch_ahead(keys, slot, j, ahead, head_offset[0], span);
        for (int r = 0; r < rows; r++) {
            const uint8_t *k = keys + head_offset[r];
            pg_dot4_f32(query_row[r], (const float *)(k + slot[j]), (const float *)(k + slot[j + 1]),
                        (const float *)(k + slot[j + 2]), (const float *)(k + slot[j + 3]), head_dim,
                        scores + r * stride + j);
        }
    }
    for (; j < num_keys; j++)
        for (int r = 0; r < rows; r++)
            scores[r * stride + j] = pg_dot_f32(query_row[r], (const float *)(keys + head_offset[r] + slot[j]), head_dim);
}

/* acc[r] += weights[r * stride + j] * v_j over a tile, laid out and prefetched like pg_score_tile; acc is
   [rows, head_dim]. */
PG_CLONES static void pg_accumulate_tile_f32(const uint8_t *values, const int64_t *slot, int num_keys,
                                             const float *weights, int stride, const int64_t *head_offset, int rows,
                                             int head_dim, int ahead, float *acc) {
    const int64_t span = pg_span(head_offset, rows, (int64_t)head_dim * 4);
    int j = 0;
    for (; j + 4 <= num_keys; j += 4) {
        pg_prefetch_ahead(values, slot, j, ahead, head_offset[0], span);
        for (int r = 0; r < rows; r++) {
            const uint8_t *v = values + head_offset[r];
            pg_axpy4_f32(acc + r * head_dim, weights + r * stride + j, (const float *)(v + slot[j]),
                         (const float *)(v + slot[j + 1]), (const float *)(v + slot[j + 2]),
                         (const float *)(v + slot[j + 3]), head_dim);
        }
    }
    for (; j < num_keys; j++)
        for (int r = 0; r < rows; r++)
            pg_axpy_f32(acc + r * head_dim, weights[r * stride + j], (const float *)(values + head_offset[r] + slot[j]),
                        head_dim);
}


/* The other formats: a KV head's rows of four keys are converted once (times a one-byte format's scale) into
   four float rows on the stack, which all the query rows of that head (GQA) then read as float32 rows: a
   value is converted once per key, not once per query head. */
#define PG_CONVERTED_TILES(NAME, T, INVERSE_MAX, FORMAT)                                                      \
static inline void pg_row_##NAME(const uint8_t *row, int head_dim, float *out) {                              \
    const float inverse_max = INVERSE_MAX;                                                                    \
    const int value_bytes = (int)pg_row_bytes(FORMAT, head_dim) - 2;                                          \
    const float scale = inverse_max != 0.0f ? pg_row_scale(row, value_bytes, inverse_max) : 1.0f;             \
    for (int i = 0; i < head_dim; i++)                                                                        \
        out[i] = pg_ld_##NAME((const T *)row, i, head_dim) * scale;                                           \
}                                                                                                             \
static inline void pg_rows4_##NAME(const uint8_t *base, const int64_t *slot, int head_dim, float *out) {      \
    for (int a = 0; a < 4; a++) pg_row_##NAME(base + slot[a], head_dim, out + a * head_dim);                  \
}                                                                                                             \
PG_CLONES static void pg_score_tile_##NAME(const uint8_t *keys, const int64_t *slot, int num_keys,            \
                                           const float **query_row, const int64_t *head_offset, int rows,     \
                                           int head_dim, int ahead, float *scores, int stride) {              \
    const int64_t row_bytes = pg_row_bytes(FORMAT, head_dim);                                                 \
    const int64_t span = pg_span(head_offset, rows, row_bytes);                                               \
    float k[4 * PG_MAX_HEAD_DIM];                                                                             \
    int j = 0;                                                                                                \
    for (; j + 4 <= num_keys; j += 4) {                                                                       \
        pg_prefetch_ahead(keys, slot, j, ahead, head_offset[0], span);                                        \
        for (int r = 0; r < rows; r++) {                                                                      \
            if (r == 0 || head_offset[r] != head_offset[r - 1])                                               \
                pg_rows4_##NAME(keys + head_offset[r], slot + j, head_dim, k);                                \
            pg_dot4_f32(query_row[r], k, k + head_dim, k + 2 * head_dim, k + 3 * head_dim, head_dim,          \
                        scores + r * stride + j);                                                             \
        }                                                                                                     \
    }                                                                                                         \
    for (; j < num_keys; j++)                                                                                 \
        for (int r = 0; r < rows; r++) {                                                                      \
            if (r == 0 || head_offset[r] != head_offset[r - 1])                                               \
                pg_row_##NAME(keys + head_offset[r] + slot[j], head_dim, k);                                  \
            scores[r * stride + j] = pg_dot_f32(query_row[r], k, head_dim);                                   \
        }                                                                                                     \
}                                                                                                             \
PG_CLONES static void pg_accumulate_tile_##NAME(const uint8_t *values, const int64_t *slot, int num_keys,     \
                                                const float *weights, int stride, const int64_t *head_offset, \
                                                int rows, int head_dim, int ahead, float *acc) {              \
    const int64_t row_bytes = pg_row_bytes(FORMAT, head_dim);                                                 \
    const int64_t span = pg_span(head_offset, rows, row_bytes);                                               \
    float v[4 * PG_MAX_HEAD_DIM];                                                                             \
    int j = 0;                                                                                                \
    for (; j + 4 <= num_keys; j += 4) {                                                                       \
        pg_prefetch_ahead(values, slot, j, ahead, head_offset[0], span);                                      \
        for (int r = 0; r < rows; r++) {                                                                      \
            if (r == 0 || head_offset[r] != head_offset[r - 1])                                               \
                pg_rows4_##NAME(values + head_offset[r], slot + j, head_dim, v);                              \
            pg_axpy4_f32(acc + r * head_dim, weights + r * stride + j, v, v + head_dim, v + 2 * head_dim,     \
                         v + 3 * head_dim, head_dim);                                                         \
        }                                                                                                     \
    }                                                                                                         \
    for (; j < num_keys; j++)                                                                                 \
        for (int r = 0; r < rows; r++) {                                                                      \
            if (r == 0 || head_offset[r] != head_offset[r - 1])                                               \
                pg_row_##NAME(values + head_offset[r] + slot[j], head_dim, v);                                \
            pg_axpy_f32(acc + r * head_dim, weights[r * stride + j], v, head_dim);                            \
        }                                                                                                     \
}

PG_CONVERTED_TILES(f16, pg_half, 0.0f, PG_F16)
PG_CONVERTED_TILES(bf16, uint16_t, 0.0f, PG_BF16)
PG_CONVERTED_TILES(i8, int8_t, 1.0f / 127.0f, PG_I8)
PG_CONVERTED_TILES(e4m3, uint8_t, 1.0f / 448.0f, PG_E4M3)
PG_CONVERTED_TILES(e5m2, uint8_t, 1.0f / 57344.0f, PG_E5M2)
PG_CONVERTED_TILES(i4, uint8_t, 1.0f / 8.0f, PG_I4)

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#  include "cpu_tiles_avx2.h"
#  define PG_TILES_AVX2(format, head_dim) ((head_dim) % 8 == 0 && pg_has_avx2())
#else
#  define PG_TILES_AVX2(format, head_dim) 0
#endif

/* p[j] = exp(p[j] - max) for j < n; returns their sum. */
__attribute__((unused)) static float pg_exp_sum(float *p, int n, float max) {
#if defined(PAGEGATE_CPU_TILES_AVX2_H)
    if (pg_has_avx2()) return pg_exp_sum_avx2(p, n, max);
#endif
    float total = 0.0f;
    for (int j = 0; j < n; j++) {
        p[j] = expf(p[j] - max);
        total += p[j];
    }
    return total;
}

/* The largest of p[0..n) (-inf for none); NaN-blind, as scores hold none. */
static inline float pg_max(const float *p, int n) {
    float top = -INFINITY;
    for (int j = 0; j < n; j++) top = p[j] > top ? p[j] : top;
    return top;
}

/* A page format's tile functions, in a table indexed by its PG_ code. */
typedef void (*pg_score_fn)(const uint8_t *keys, const int64_t *slot, int num_keys, const float **query_row,
                            const int64_t *head_offset, int rows, int head_dim, int ahead, float *scores, int stride);
typedef void (*pg_accumulate_fn)(const uint8_t *values, const int64_t *slot, int num_keys, const float *weights,
                                 int stride, const int64_t *head_offset, int rows, int head_dim, int ahead,
                                 float *acc);
typedef struct {
    pg_score_fn score;
    pg_accumulate_fn accumulate;
} pg_tiles;

#define PG_TILE_ROW(PREFIX, NAME) {PREFIX##score_tile_##NAME, PREFIX##accumulate_tile_##NAME}
#define PG_TILE_TABLE(PREFIX) {PG_TILE_ROW(PREFIX, f32), PG_TILE_ROW(PREFIX, f16), PG_TILE_ROW(PREFIX, bf16),      \
                               PG_TILE_ROW(PREFIX, i8), PG_TILE_ROW(PREFIX, e4m3), PG_TILE_ROW(PREFIX, e5m2),      \
                               PG_TILE_ROW(PREFIX, i4)}

static inline const pg_tiles *pg_tiles_of(int format, int head_dim) {
    static const pg_tiles plain[] = PG_TILE_TABLE(pg_);
#if defined(PAGEGATE_CPU_TILES_AVX2_H)
    static const pg_tiles avx2[] = PG_TILE_TABLE(pg_avx2_), avx512[] = PG_TILE_TABLE(pg_avx512_);
    if (PG_TILES_AVX2(format, head_dim)) return head_dim % 16 == 0 && pg_has_avx512() ? &avx512[format] : &avx2[format];
#endif
    return &plain[format];
}

__attribute__((unused)) static void pg_score_tile(int format, const uint8_t *keys, const int64_t *slot, int num_keys,
                                                  const float **query_row, const int64_t *head_offset, int rows,
                                                  int head_dim, int ahead, float *scores, int stride) {
    pg_tiles_of(format, head_dim)->score(keys, slot, num_keys, query_row, head_offset, rows, head_dim, ahead, scores,
                                         stride);
}

__attribute__((unused)) static void pg_accumulate_tile(int format, const uint8_t *values, const int64_t *slot,
                                                       int num_keys, const float *weights, int stride,
                                                       const int64_t *head_offset, int rows, int head_dim, int ahead,
                                                       float *acc) {
    pg_tiles_of(format, head_dim)->accumulate(values, slot, num_keys, weights, stride, head_offset, rows, head_dim,
                                              ahead, acc);
}

#endif /* PAGEGATE_CPU_PAGED_H */
