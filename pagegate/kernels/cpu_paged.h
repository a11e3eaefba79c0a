/* The C of pagegate/kernels/cpu_paged.pyx: included by the Cython module, readable by C tools. */
#ifndef PAGEGATE_CPU_PAGED_H
#define PAGEGATE_CPU_PAGED_H

#include <stdint.h>

/* With gcc on x86-64 glibc each tile function is built twice, plain (SSE2) and AVX2+FMA, and
   the CPU picks one when the module loads (an ifunc); elsewhere only the plain build exists. */
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__GLIBC__)
#  if __has_attribute(target_clones)
#    define PG_CLONES __attribute__((target_clones("arch=x86-64-v3", "default")))
#  endif
#endif
#ifndef PG_CLONES
#  define PG_CLONES
#endif

/* Plain loops over contiguous float* that gcc -O3 vectorises without -ffast-math: `omp simd
   reduction` (honoured under -fopenmp) lets a dot product's sum be split into vector lanes.
   Four keys at a time give four independent sums (no wait on one adder chain), and one load
   and store of an accumulator per four value rows. */
static inline void pg_prefetch(const float *x, int n) {
    for (int i = 0; i < n; i += 16) __builtin_prefetch(x + i);  /* one 64-byte line each */
}
static inline float pg_dot(const float *q, const float *k, int n) {
    float s = 0.0f;
    #pragma omp simd reduction(+:s)
    for (int i = 0; i < n; i++) s += q[i] * k[i];
    return s;
}
static inline void pg_dot4(const float *q, const float *k0, const float *k1, const float *k2,
                           const float *k3, int n, float *out) {
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
static inline void pg_axpy(float *y, float w, const float *v, int n) {
    for (int i = 0; i < n; i++) y[i] += w * v[i];
}
static inline void pg_axpy4(float *y, const float *w, const float *v0, const float *v1,
                            const float *v2, const float *v3, int n) {
    const float w0 = w[0], w1 = w[1], w2 = w[2], w3 = w[3];
    for (int i = 0; i < n; i++) y[i] += w0 * v0[i] + w1 * v1[i] + w2 * v2[i] + w3 * v3[i];
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

/* The rows' heads of one cache slot: they are adjacent, from head_offset[0] to the end of
   head_offset[rows - 1] (rows go head by head, query by query). */
static inline int pg_span(const int64_t *head_offset, int rows, int head_dim) {
    return (int)(head_offset[rows - 1] - head_offset[0]) + head_dim;
}

/* scores[r * stride + j] = q_r . k_j for every row r and key j of a tile, key by key across
   the rows so pages are read in order; row r's K row of key j starts at
   keys + slot[j] + head_offset[r]. Asks for the keys `ahead` places on in advance. */
PG_CLONES static void pg_score_tile(const float *keys, const int64_t *slot, int num_keys,
                                    const float **query_row, const int64_t *head_offset, int rows,
                                    int head_dim, int ahead, float *scores, int stride) {
    const int span = pg_span(head_offset, rows, head_dim);
    int j = 0;
    for (; j + 4 <= num_keys; j += 4) {
        for (int a = j + ahead; a < j + ahead + 4 && a < num_keys; a++)
            pg_prefetch(keys + slot[a] + head_offset[0], span);
        for (int r = 0; r < rows; r++) {
            const float *k = keys + head_offset[r];
            pg_dot4(query_row[r], k + slot[j], k + slot[j + 1], k + slot[j + 2], k + slot[j + 3],
                    head_dim, scores + r * stride + j);
        }
    }
    for (; j < num_keys; j++)
        for (int r = 0; r < rows; r++)
            scores[r * stride + j] = pg_dot(query_row[r], keys + head_offset[r] + slot[j], head_dim);
}

/* acc[r] += weights[r * stride + j] * v_j over a tile, laid out and prefetched like
   pg_score_tile; acc is [rows, head_dim]. */
PG_CLONES static void pg_accumulate_tile(const float *values, const int64_t *slot, int num_keys,
                                         const float *weights, int stride, const int64_t *head_offset,
                                         int rows, int head_dim, int ahead, float *acc) {
    const int span = pg_span(head_offset, rows, head_dim);
    int j = 0;
    for (; j + 4 <= num_keys; j += 4) {
        for (int a = j + ahead; a < j + ahead + 4 && a < num_keys; a++)
            pg_prefetch(values + slot[a] + head_offset[0], span);
        for (int r = 0; r < rows; r++) {
            const float *v = values + head_offset[r];
            pg_axpy4(acc + r * head_dim, weights + r * stride + j, v + slot[j], v + slot[j + 1],
                     v + slot[j + 2], v + slot[j + 3], head_dim);
        }
    }
    for (; j < num_keys; j++)
        for (int r = 0; r < rows; r++)
            pg_axpy(acc + r * head_dim, weights[r * stride + j], values + head_offset[r] + slot[j], head_dim);
}

#endif /* PAGEGATE_CPU_PAGED_H */
