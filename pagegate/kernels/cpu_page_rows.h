/* A KV page's rows: their formats, how a row is read and stored, and how a tile asks for the rows it will read.
   Shared by cpu_paged.h's portable tiles and cpu_tiles_avx2.h's. */
#ifndef PAGEGATE_CPU_PAGE_ROWS_H
#define PAGEGATE_CPU_PAGE_ROWS_H

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
enum { PG_F32 = 0, PG_F16 = 1, PG_BF16 = 2, PG_I8 = 3, PG_E4M3 = 4, PG_E5M2 = 5, PG_I4 = 6 };

static inline int pg_scaled(int format) { return format >= PG_I8; }
static inline int64_t pg_row_bytes(int format, int head_dim) {
    if (format == PG_I4) return head_dim / 2 + 2;  /* two values a byte */
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
static inline float pg_ld_f16(const pg_half *p, int i, int d) { return pg_half_float(p[i]); }
static inline float pg_ld_bf16(const uint16_t *p, int i, int d) { return pg_bits_float((uint32_t)p[i] << 16); }
static inline float pg_ld_i8(const int8_t *p, int i, int d) { return (float)p[i]; }
static inline float pg_ld_e4m3(const uint8_t *p, int i, int d) {
    const uint32_t x = p[i];
    return pg_bits_float(((x & 0x80u) << 24) | ((x & 0x7fu) << 20)) * 0x1p120f;
}
static inline float pg_ld_e5m2(const uint8_t *p, int i, int d) {
    const uint32_t x = p[i];
    return pg_bits_float(((x & 0x80u) << 24) | ((x & 0x7fu) << 21)) * 0x1p112f;
}

static inline float pg_max_value(int format) {
    return format == PG_I8 ? 127.0f : format == PG_I4 ? 8.0f : format == PG_E4M3 ? 448.0f : 57344.0f;
}

/* Value i of an int4 row of d values: byte i's low nibble for the first half, byte i - d / 2's high one after (the
   other formats' pg_ld_ take d too, unused). */
static inline float pg_ld_i4(const uint8_t *row, int i, int d) {
    const int half = d / 2;
    return (float)((i < half ? row[i] & 15 : row[i - half] >> 4) - 8);
}

/* The scale of a one-byte format's row: its stored amax times inverse_max = 1 / max_value. */
static inline float pg_row_scale(const uint8_t *row, int value_bytes, float inverse_max) {
    uint16_t h;
    memcpy(&h, row + value_bytes, 2);
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

/* An int4 row as kv_format._quantize_int4 stores it: minus m, the value of largest magnitude (the positive one of a
   tie), as a float16; s = that * (1 / 8); q = x * (1 / s) clamped to [-8, 7], rounded; nibbles q + 8. */
static void pg_store_int4_row(const float *x, int head_dim, uint8_t *dst) {
    float top = x[0], bottom = x[0];
    for (int i = 1; i < head_dim; i++) {
        top = fmaxf(top, x[i]);
        bottom = fminf(bottom, x[i]);
    }
    const float m = top >= -bottom ? top : bottom;
    const uint16_t bits = pg_to_f16(fminf(fmaxf(-m, -65504.0f), 65504.0f));
    const float s = pg_half_float(bits) * (1.0f / 8.0f), inverse = s != 0.0f ? 1.0f / s : 0.0f;
    const int half = head_dim / 2;
    for (int i = 0; i < half; i++) {
        const int low = (int)nearbyintf(fminf(fmaxf(x[i] * inverse, -8.0f), 7.0f)) + 8;
        const int high = (int)nearbyintf(fminf(fmaxf(x[i + half] * inverse, -8.0f), 7.0f)) + 8;
        dst[i] = (uint8_t)(low | high << 4);
    }
    memcpy(dst + half, &bits, 2);
}

/* Store the row x[head_dim] at dst in `format`, as pagegate.kernels.kv_format.quantize_rows does: a one-byte
   format keeps amax as a float16, and x * (1 / scale) clamped (int8: rounded). */
__attribute__((unused)) static void pg_store_row(int format, const float *x, int head_dim, uint8_t *dst) {
    if (format == PG_I4) {
        pg_store_int4_row(x, head_dim, dst);
        return;
    }
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


/* The rotation of int4 rows (pagegate/kernels/rotation.py, which runs the same butterflies): x -> H (s x) / sqrt(d)
   in place, and back, for d a power of two <= PG_MAX_HEAD_DIM. */
static const uint64_t pg_sign_words[4] = {0x9E3779B97F4A7C15ull, 0xBF58476D1CE4E5B9ull, 0x94D049BB133111EBull,
                                          0xD6E8FEB86659FD93ull};
static inline void pg_hadamard(float *x, int d) {
    for (int h = 1; h < d; h *= 2)
        for (int i = 0; i < d; i += 2 * h)
            for (int j = i; j < i + h; j++) {
                const float a = x[j], b = x[j + h];
                x[j] = a + b;
                x[j + h] = a - b;
            }
}
static inline void pg_flip_signs(float *x, int d) {
    for (int i = 0; i < d; i++)
        if ((pg_sign_words[i / 64] >> (i % 64)) & 1) x[i] = -x[i];
}
__attribute__((unused)) static void pg_rotate(float *x, int d) {
    pg_flip_signs(x, d);
    pg_hadamard(x, d);
    const float norm = (float)(1.0 / sqrt((double)d));
    for (int i = 0; i < d; i++) x[i] *= norm;
}
__attribute__((unused)) static void pg_unrotate(float *x, int d) {
    pg_hadamard(x, d);
    const float norm = (float)(1.0 / sqrt((double)d));
    for (int i = 0; i < d; i++) x[i] *= norm;
    pg_flip_signs(x, d);
}

#define PG_MAX_HEAD_DIM 256

static inline void pg_prefetch(const uint8_t *x, int64_t bytes) {
    for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch(x + i);  /* one 64-byte line each */
}

/* Ask for the rows (span bytes from head_offset0) of the four keys `ahead` places after key j. */
static inline void pg_prefetch_ahead(const uint8_t *cache, const int64_t *slot, int j, int ahead,
                                     int64_t head_offset0, int64_t span) {
    for (int a = j + ahead; a < j + ahead + 4; a++) pg_prefetch(cache + slot[a] + head_offset0, span);
}

/* The rows' heads of one cache slot: they are adjacent, from head_offset[0] to the end of the row at
   head_offset[rows - 1] (rows go head by head, query by query; offsets in bytes). */
static inline int64_t pg_span(const int64_t *head_offset, int rows, int64_t row_bytes) {
    return head_offset[rows - 1] - head_offset[0] + row_bytes;
}

#endif /* PAGEGATE_CPU_PAGE_ROWS_H */
