/* The C of pagegate/kernels/cpu_paged.pyx: included by the Cython module, readable by C tools. */
#ifndef PAGEGATE_CPU_PAGED_H
#define PAGEGATE_CPU_PAGED_H

#include <math.h>
#include <stdint.h>
#include <string.h>

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

/* KV page formats (pagegate/kernels/kv_format.py): a cache slot holds one row per KV head; a float row is
   head_dim values, a one-byte format's row is head_dim values and then the row's amax as a float16; its
   values read as stored * amax * (1 / max_value). */
enum { PG_F32 = 0, PG_F16 = 1, PG_BF16 = 2, PG_I8 = 3, PG_E4M3 = 4, PG_E5M2 = 5 };

static inline int pg_scaled(int format) { return format >= PG_I8; }
static inline int64_t pg_row_bytes(int format, int head_dim) {
    const int value_bytes = format == PG_F32 ? 4 : format <= PG_BF16 ? 2 : 1;
    return (int64_t)head_dim * value_bytes + (pg_scaled(format) ? 2 : 0);
}

static inline float pg_bits_float(uint32_t bits) { float f; memcpy(&f, &bits, 4); return f; }
static inline uint32_t pg_float_bits(float f) { uint32_t bits; memcpy(&bits, &f, 4); return bits; }

/* Stored values to float in integer and float arithmetic, so that loops of them vectorise: the value's sign,
   exponent and mantissa bits go where a float keeps them, and one multiply by a power of two rebiases the
   exponent (exact, subnormals included). Writes never store infinity or NaN, except a float16 page's
   overflow (which reads back as 65536 rather than infinity). (gcc's _Float16 conversions stay scalar.) */
static inline float pg_half_float(uint16_t h) {
    return pg_bits_float((((uint32_t)h & 0x8000u) << 16) | (((uint32_t)h & 0x7fffu) << 13)) * 0x1p112f;
}
typedef uint16_t pg_half;
static inline float pg_ld_f16(const pg_half *p, int i) { return pg_half_float(p[i]); }
static inline float pg_ld_bf16(const uint16_t *p, int i) { return pg_bits_float((uint32_t)p[i] << 16); }
static inline float pg_ld_i8(const int8_t *p, int i) { return (float)p[i]; }
static inline float pg_ld_e4m3(const uint8_t *p, int i) {
    const uint32_t x = p[i];
    return pg_bits_float(((x & 0x80u) << 24) | ((x & 0x7fu) << 20)) * 0x1p120f;
}
static inline float pg_ld_e5m2(const uint8_t *p, int i) {
    const uint32_t x = p[i];
    return pg_bits_float(((x & 0x80u) << 24) | ((x & 0x7fu) << 21)) * 0x1p112f;
}

static inline float pg_max_value(int format) {
    return format == PG_I8 ? 127.0f : format == PG_E4M3 ? 448.0f : 57344.0f;
}

/* The scale of a one-byte format's row: its stored amax times inverse_max = 1 / max_value. */
static inline float pg_row_scale(const uint8_t *row, int head_dim, float inverse_max) {
    uint16_t h;
    memcpy(&h, row + head_dim, 2);
    return pg_half_float(h) * inverse_max;
}

/* float -> stored formats, rounding to nearest even as torch's conversions do (and overflowing as they do:
   float16 and e5m2 to infinity, e4m3fn to NaN). A normal result rounds its mantissa by adding half an ulp
   less one plus the kept mantissa's lowest bit; a subnormal one is added to a power of two whose ulp is
   the format's subnormal step, so the FPU rounds it. */
static inline uint16_t pg_to_f16(float f) {
    const uint32_t bits = pg_float_bits(f), sign = (bits >> 16) & 0x8000u, a = bits & 0x7fffffffu;
    if (a > 0x7f800000u) return (uint16_t)(sign | 0x7e00u);
    if (a >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u);  /* rounds to 65536 or more */
    if (a < 0x38800000u) return (uint16_t)(sign | (pg_float_bits(pg_bits_float(a) + 0.5f) - 0x3f000000u));
    return (uint16_t)(sign | ((a + 0xc8000fffu + ((a >> 13) & 1u)) >> 13));
}
static inline uint16_t pg_to_bf16(float f) {
    const uint32_t bits = pg_float_bits(f);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40u);
    return (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}
static inline uint8_t pg_to_e4m3(float f) {
    const uint32_t bits = pg_float_bits(f), sign = (bits >> 24) & 0x80u, a = bits & 0x7fffffffu;
    if (a >= 0x43f00000u) return (uint8_t)(sign | 0x7fu);  /* 480 and beyond (or NaN) */
    if (a < 0x3c800000u) return (uint8_t)(sign | (pg_float_bits(pg_bits_float(a) + 16384.0f) - 0x46800000u));
    return (uint8_t)(sign | ((a + 0xc407ffffu + ((a >> 20) & 1u)) >> 20));
}
static inline uint8_t pg_to_e5m2(float f) {
    const uint32_t bits = pg_float_bits(f), sign = (bits >> 24) & 0x80u, a = bits & 0x7fffffffu;
    if (a > 0x7f800000u) return (uint8_t)(sign | 0x7fu);
    if (a >= 0x47700000u) return (uint8_t)(sign | 0x7cu);  /* rounds past 57344 */
    if (a < 0x38800000u) return (uint8_t)(sign | (pg_float_bits(pg_bits_float(a) + 128.0f) - 0x43000000u));
    return (uint8_t)(sign | ((a + 0xc80fffffu + ((a >> 21) & 1u)) >> 21));
}

/* Store the row x[head_dim] at dst in `format`, as pagegate.kernels.kv_format.quantize_rows does: a one-byte
   format keeps amax as a float16, and x * (1 / scale) clamped (int8: rounded). */
__attribute__((unused)) static void pg_store_row(int format, const float *x, int head_dim, uint8_t *dst) {
    if (format == PG_F32) {
        memcpy(dst, x, (size_t)head_dim * sizeof(float));
        return;
    }
    if (format == PG_F16 || format == PG_BF16) {
        uint16_t *out = (uint16_t *)dst;
        for (int i = 0; i < head_dim; i++) out[i] = format == PG_F16 ? pg_to_f16(x[i]) : pg_to_bf16(x[i]);
        return;
    }
    const float max_value = pg_max_value(format);
    float amax = 0.0f;
    for (int i = 0; i < head_dim; i++) amax = fmaxf(amax, fabsf(x[i]));
    const uint16_t amax_bits = pg_to_f16(fminf(amax, 65504.0f));  /* float16's largest: larger values saturate */
    const float scale = pg_half_float(amax_bits) * (1.0f / max_value), inverse = scale > 0.0f ? 1.0f / scale : 0.0f;
    for (int i = 0; i < head_dim; i++) {
        const float v = fminf(fmaxf(x[i] * inverse, -max_value), max_value);
        dst[i] = format == PG_I8 ? (uint8_t)(int8_t)nearbyintf(v) : format == PG_E4M3 ? pg_to_e4m3(v) : pg_to_e5m2(v);
    }
    memcpy(dst + head_dim, &amax_bits, 2);
}

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

static inline void pg_prefetch(const uint8_t *x, int64_t bytes) {
    for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch(x + i);  /* one 64-byte line each */
}

/* Ask for the rows (span bytes from head_offset0) of the four keys `ahead` places after key j. */
static inline void pg_prefetch_ahead(const uint8_t *cache, const int64_t *slot, int j, int ahead,
                                     int64_t head_offset0, int64_t span) {
    for (int a = j + ahead; a < j + ahead + 4; a++) pg_prefetch(cache + slot[a] + head_offset0, span);
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

/* The rows' heads of one cache slot: they are adjacent, from head_offset[0] to the end of the row at
   head_offset[rows - 1] (rows go head by head, query by query; offsets in bytes). */
static inline int64_t pg_span(const int64_t *head_offset, int rows, int64_t row_bytes) {
    return head_offset[rows - 1] - head_offset[0] + row_bytes;
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

#define PG_MAX_HEAD_DIM 256

/* The other formats: a KV head's rows of four keys are converted once (times a one-byte format's scale) into
   four float rows on the stack, which all the query rows of that head (GQA) then read as float32 rows: a
   value is converted once per key, not once per query head. */
#define PG_CONVERTED_TILES(NAME, T, INVERSE_MAX)                                                              \
static inline void pg_row_##NAME(const uint8_t *row, int head_dim, float *out) {                              \
    const float inverse_max = INVERSE_MAX;                                                                    \
    const float scale = inverse_max != 0.0f ? pg_row_scale(row, head_dim, inverse_max) : 1.0f;                \
    for (int i = 0; i < head_dim; i++) out[i] = pg_ld_##NAME((const T *)row, i) * scale;                        \
}                                                                                                             \
static inline void pg_rows4_##NAME(const uint8_t *base, const int64_t *slot, int head_dim, float *out) {      \
    for (int a = 0; a < 4; a++) pg_row_##NAME(base + slot[a], head_dim, out + a * head_dim);                  \
}                                                                                                             \
PG_CLONES static void pg_score_tile_##NAME(const uint8_t *keys, const int64_t *slot, int num_keys,            \
                                           const float **query_row, const int64_t *head_offset, int rows,     \
                                           int head_dim, int ahead, float *scores, int stride) {              \
    const int64_t row_bytes = (int64_t)head_dim * sizeof(T) + ((INVERSE_MAX) != 0.0f ? 2 : 0);                \
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
    const int64_t row_bytes = (int64_t)head_dim * sizeof(T) + ((INVERSE_MAX) != 0.0f ? 2 : 0);                \
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

PG_CONVERTED_TILES(f16, pg_half, 0.0f)
PG_CONVERTED_TILES(bf16, uint16_t, 0.0f)
PG_CONVERTED_TILES(i8, int8_t, 1.0f / 127.0f)
PG_CONVERTED_TILES(e4m3, uint8_t, 1.0f / 448.0f)
PG_CONVERTED_TILES(e5m2, uint8_t, 1.0f / 57344.0f)

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
                               PG_TILE_ROW(PREFIX, i8), PG_TILE_ROW(PREFIX, e4m3), PG_TILE_ROW(PREFIX, e5m2)}

static inline const pg_tiles *pg_tiles_of(int format, int head_dim) {
    static const pg_tiles plain[] = PG_TILE_TABLE(pg_);
#if defined(PAGEGATE_CPU_TILES_AVX2_H)
    static const pg_tiles avx2[] = PG_TILE_TABLE(pg_avx2_);
    if (PG_TILES_AVX2(format, head_dim)) return &avx2[format];
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
