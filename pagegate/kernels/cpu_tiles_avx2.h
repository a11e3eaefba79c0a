/* AVX2 + FMA + F16C tiles of paged attention (included by cpu_paged.h on x86-64 gcc; the CPU is asked once).
   A page's row is read eight values at a time straight into registers (float16 by F16C, int8 and fp8 widened
   and converted), four keys at a time: the four dot products of a query row are summed across lanes together
   (three hadds), a one-byte format's scales multiply the four scores (keys) or fold into the four weights
   (values) rather than every value. Rows of other formats are converted once per KV head into a float tile that
   the query rows of that head (GQA) then share; float32 rows are read where they lie. head_dim % 8 == 0. The dot
   products and accumulations run on 512-bit vectors where the CPU has AVX-512 and head_dim % 16 == 0
   (cpu_tiles_isa.h builds the tiles once for each width). */
#ifndef PAGEGATE_CPU_TILES_AVX2_H
#define PAGEGATE_CPU_TILES_AVX2_H

#include <immintrin.h>
#include "cpu_page_rows.h"

#define PG_AVX2 __attribute__((target("avx2,fma,f16c")))
#define PG_AVX2_INLINE PG_AVX2 static inline __attribute__((always_inline))

static int pg_has_avx2(void) {
    static int has = -1;  /* a benign race: every thread stores the same answer */
    if (has < 0)
        has = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
    return has;
}

/* Eight stored values of a row of d from value i (i % 8 == 0), as floats (unscaled); the conversions are pg_ld_*'s. */
PG_AVX2_INLINE __m256 pg_load8(const int format, const uint8_t *row, int i, int d) {
    switch (format) {
    case PG_I4: {
        const __m128i bytes = _mm_loadl_epi64((const __m128i *)(row + (i < d / 2 ? i : i - d / 2)));
        const __m128i nibbles = _mm_and_si128(i < d / 2 ? bytes : _mm_srli_epi16(bytes, 4), _mm_set1_epi8(15));
        return _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_cvtepu8_epi32(nibbles), _mm256_set1_epi32(8)));
    }
    case PG_F16: return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(row + 2 * i)));
    case PG_BF16:
        return _mm256_castsi256_ps(_mm256_slli_epi32(
            _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(row + 2 * i))), 16));
    case PG_I8: return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(row + i))));
    case PG_E4M3:
    case PG_E5M2: {
        const __m256i x = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(row + i)));
        const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(x, _mm256_set1_epi32(0x80)), 24);
        const __m256i rest = _mm256_and_si256(x, _mm256_set1_epi32(0x7f));
        const __m256i bits = _mm256_or_si256(sign, format == PG_E4M3 ? _mm256_slli_epi32(rest, 20)
                                                                     : _mm256_slli_epi32(rest, 21));
        return _mm256_mul_ps(_mm256_castsi256_ps(bits), _mm256_set1_ps(format == PG_E4M3 ? 0x1p120f : 0x1p112f));
    }
    default: return _mm256_loadu_ps((const float *)row + i);
    }
}

/* The float rows of four keys: float32 rows where they lie, others converted into tile [4][head_dim]; their
   scales (1 for unscaled formats) go to scale. */
PG_AVX2_INLINE void pg_rows4_avx2(const int format, const uint8_t *base, const int64_t *slot, int head_dim,
                                  float *tile, const float **rows, float *scale) {
    for (int a = 0; a < 4; a++) {
        const uint8_t *row = base + slot[a];
        scale[a] = pg_scaled(format) ? pg_row_scale(row, (int)pg_row_bytes(format, head_dim) - 2,
                                                    1.0f / pg_max_value(format)) : 1.0f;
        if (format == PG_F32) {
            rows[a] = (const float *)row;
            continue;
        }
        for (int i = 0; i < head_dim; i += 8)
            _mm256_storeu_ps(tile + a * head_dim + i, pg_load8(format, row, i, head_dim));
        rows[a] = tile + a * head_dim;
    }
}

/* The slots of keys j..j+3, the last real one repeated past num_keys (its weight is then 0). */
static inline void pg_slots4(const int64_t *slot, int j, int num_keys, int64_t *out) {
    for (int a = 0; a < 4; a++) out[a] = slot[j + a < num_keys ? j + a : num_keys - 1];
}

#define PG_TILE_ISA avx2
#define PG_TILE_TARGET PG_AVX2
#define PG_TV __m256
#define PG_TW 8
#define PG_TLOAD(p) _mm256_loadu_ps(p)
#define PG_TSTORE(p, v) _mm256_storeu_ps(p, v)
#define PG_TSET1(f) _mm256_set1_ps(f)
#define PG_TZERO() _mm256_setzero_ps()
#define PG_TFMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define PG_TFOLD(v) (v)
#include "cpu_tiles_isa.h"

/* The same on 512-bit vectors (head_dim % 16 == 0): a score's lanes sum other products first than the 256-bit
   tiles' (its own bits, the same for every row: each key's two halves are added, then summed across lanes as
   there); an accumulation's are the 256-bit tiles'. */
#define PG_AVX512 __attribute__((target("avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512dq")))

static int pg_has_avx512(void) {
    static int has = -1;  /* a benign race: every thread stores the same answer */
    if (has < 0)
        has = pg_has_avx2() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl")
              && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq");
    return has;
}

#define PG_TILE_ISA avx512
#define PG_TILE_TARGET PG_AVX512
#define PG_TV __m512
#define PG_TW 16
#define PG_TLOAD(p) _mm512_loadu_ps(p)
#define PG_TSTORE(p, v) _mm512_storeu_ps(p, v)
#define PG_TSET1(f) _mm512_set1_ps(f)
#define PG_TZERO() _mm512_setzero_ps()
#define PG_TFMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define PG_TFOLD(v) _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1))
#include "cpu_tiles_isa.h"

/* exp(x) for x >= -87.3 (0 below): Cephes' expf, a degree-6 polynomial on [-ln2/2, ln2/2] after taking out
   n ln2, within 2 ulp of libm's. x <= 88 (the callers keep it there). */
PG_AVX2_INLINE __m256 pg_exp8(const __m256 x0) {
    const __m256 low = _mm256_set1_ps(-87.3f), x1 = _mm256_max_ps(x0, low);
    const __m256 k = _mm256_round_ps(_mm256_mul_ps(x1, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 x = _mm256_fnmadd_ps(k, _mm256_set1_ps(0.693359375f), x1);
    x = _mm256_fnmadd_ps(k, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
    const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23);
    y = _mm256_mul_ps(y, _mm256_castsi256_ps(bits));
    return _mm256_and_ps(y, _mm256_cmp_ps(x0, low, _CMP_GE_OQ));
}

/* p[j] = exp(p[j] - max) for j < n (all <= max), returning their sum. */
PG_AVX2 static float pg_exp_sum_avx2(float *p, int n, float max) {
    const __m256 m = _mm256_set1_ps(max);
    __m256 total = _mm256_setzero_ps();
    float rest = 0.0f;
    int j = 0;
    for (; j + 8 <= n; j += 8) {
        const __m256 y = pg_exp8(_mm256_sub_ps(_mm256_loadu_ps(p + j), m));
        _mm256_storeu_ps(p + j, y);
        total = _mm256_add_ps(total, y);
    }
    for (; j < n; j++) {
        p[j] = expf(p[j] - max);
        rest += p[j];
    }
    const __m128 half = _mm_add_ps(_mm256_castps256_ps128(total), _mm256_extractf128_ps(total, 1));
    const __m128 pair = _mm_add_ps(half, _mm_movehl_ps(half, half));
    return _mm_cvtss_f32(_mm_add_ss(pair, _mm_movehdup_ps(pair))) + rest;
}

/* out[i] = silu(gate[i]) * up[i] = gate[i] / (1 + exp(-gate[i])) * up[i] for eight values (SwiGLU); exp's argument is
   held at 88, where 1 + exp already swamps any gate. */
PG_AVX2 static void pg_silu_mul8(const float *gate, const float *up, float *out) {
    const __m256 g = _mm256_loadu_ps(gate);
    const __m256 e = pg_exp8(_mm256_min_ps(_mm256_sub_ps(_mm256_setzero_ps(), g), _mm256_set1_ps(88.0f)));
    const __m256 silu = _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
    _mm256_storeu_ps(out, _mm256_mul_ps(silu, _mm256_loadu_ps(up)));
}

#endif /* PAGEGATE_CPU_TILES_AVX2_H */
