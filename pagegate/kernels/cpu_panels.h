/* Float weights in panels: the layout the native step reads F32, F16 and BF16 matrices in.

   A matrix W [N, K] keeps its rows 32 at a time, each such panel k-major: element (r, k) of panel p = r / 32 lies at
   32 p K + k width + r % 32, width = min(32, N - 32 p) (only the last panel is narrower). The same values as the
   row-major matrix, permuted; the type ids PGQ_F32_PANELS, PGQ_F16_PANELS and PGQ_BF16_PANELS say so (pagegate's,
   never in a file). Half values widen to float32 exactly as they are loaded (F16C; BF16 a shift), so all three run
   the same float32 arithmetic.

   Every output is one chain of fused multiply-adds over k in order (w[r][0] x[0] first, from +0): a vector holds
   16 (or 8) outputs' weights of one k, each token's x[k] is broadcast, and no sum crosses lanes. So AVX-512, AVX2
   and plain C (fmaf) compute every output with the same operations, and a token's outputs have the same bits alone
   or beside any others. Against a row-major matrix's dot products (a vector of partial sums along k) the loads
   per multiply-add fall from ten in 24 to 14 in 24 broadcasts included, and there are no horizontal sums: the
   kernel runs near the FMA units' peak where the row-major one ran at ~60% (issue 56's F32 model). */
#ifndef PAGEGATE_CPU_PANELS_H
#define PAGEGATE_CPU_PANELS_H

#include <math.h>
#include <stdint.h>

enum { PGQ_BF16_PANELS = 97, PGQ_F16_PANELS = 98, PGQ_F32_PANELS = 99, PGQ_PANEL = 32 };
#define PGQ_PANEL_TOKENS 12  /* tokens an AVX-512 pass takes: 2 x 12 accumulators of 32 registers */

static int pgq_panels_isa = 0;  /* 2: AVX-512, 1: AVX2, 0: plain C (the same bits) */

static inline int64_t pgq_panel_width(int64_t n, int64_t p) {
    return n - p * PGQ_PANEL < PGQ_PANEL ? n - p * PGQ_PANEL : PGQ_PANEL;
}

static inline int pgq_is_panels(int qtype) { return qtype >= PGQ_BF16_PANELS && qtype <= PGQ_F32_PANELS; }
static inline int pgq_panel_bytes(int qtype) { return qtype == PGQ_F32_PANELS ? 4 : 2; }

/* W [n, k] row-major -> panels, values of `bytes` (4: F32, 2: F16 or BF16) copied as they are. */
static void pgq_panels_pack(const uint8_t *rows, int64_t n, int64_t k, int bytes, uint8_t *out) {
    for (int64_t p = 0; p * PGQ_PANEL < n; p++) {
        const int64_t width = pgq_panel_width(n, p), first = p * PGQ_PANEL * k;
        for (int64_t i = 0; i < k; i++)
            for (int64_t r = 0; r < width; r++) {
                const int64_t to = first + i * width + r, from = first + r * k + i;
                if (bytes == 4) ((uint32_t *)out)[to] = ((const uint32_t *)rows)[from];
                else ((uint16_t *)out)[to] = ((const uint16_t *)rows)[from];
            }
    }
}

/* Row c's value at k = i in a panel of `width` of `qtype`, as float32. */
static inline float pgq_panel_value(int qtype, const uint8_t *panel, int64_t width, int64_t i, int64_t c) {
    if (qtype == PGQ_F16_PANELS) return pgq_half(panel + (i * width + c) * 2);
    if (qtype == PGQ_BF16_PANELS) return pgq_bf16(panel + (i * width + c) * 2);
    return ((const float *)panel)[i * width + c];
}

/* Row r of panels w [n, k] (an embedding lookup). */
static void pgq_panels_row(int qtype, const uint8_t *w, int64_t n, int64_t k, int64_t r, float *out) {
    const uint8_t *panel = w + r / PGQ_PANEL * PGQ_PANEL * k * pgq_panel_bytes(qtype);
    const int64_t width = pgq_panel_width(n, r / PGQ_PANEL);
    for (int64_t i = 0; i < k; i++) out[i] = pgq_panel_value(qtype, panel, width, i, r % PGQ_PANEL);
}

/* out (+)= value + bias, in the order every kernel here stores in. */
static inline float pgq_panel_out(float out, float value, const float *bias, int accumulate) {
    if (bias) value += *bias;
    return accumulate ? out + value : value;
}

/* Columns c0..c1 of one panel against `tokens` activation rows, one output at a time. */
static void pgq_panel_plain(int qtype, const uint8_t *panel, int64_t width, int64_t k, int64_t c0, int64_t c1,
                            const float *x, int tokens, float *out, int64_t out_stride, const float *bias,
                            int accumulate) {
    for (int t = 0; t < tokens; t++)
        for (int64_t c = c0; c < c1; c++) {
            float acc = 0.0f;
            for (int64_t i = 0; i < k; i++) acc = fmaf(pgq_panel_value(qtype, panel, width, i, c), x[t * k + i], acc);
            float *o = out + t * out_stride + c;
            *o = pgq_panel_out(*o, acc, bias ? bias + c : NULL, accumulate);
        }
}

#if defined(__GNUC__) && defined(__x86_64__)
#define PGQ_INLINE static inline __attribute__((always_inline))
/* 8 values of row i from column c of a panel of `qtype` (a constant where it is inlined). */
PGQ_AVX2 PGQ_INLINE __m256 pgq_panel_load8(const int qtype, const uint8_t *panel, int64_t width, int64_t i, int64_t c) {
    if (qtype == PGQ_F32_PANELS) return _mm256_loadu_ps((const float *)panel + i * width + c);
    const __m128i halves = _mm_loadu_si128((const __m128i *)(panel + (i * width + c) * 2));
    if (qtype == PGQ_F16_PANELS) return _mm256_cvtph_ps(halves);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(halves), 16));
}
/* 8 or 16 columns from c (`strips` of 8) against up to six tokens, in 12 ymm accumulators. */
PGQ_AVX2 PGQ_INLINE void pgq_panel_avx2_pass(const int qtype, const uint8_t *panel, int64_t width, int64_t k, int64_t c,
                                             const int strips, const float *x, const int tokens, float *out,
                                             int64_t out_stride, const float *bias, int accumulate) {
    __m256 acc[2][6];
    for (int s = 0; s < strips; s++)
        for (int t = 0; t < tokens; t++) acc[s][t] = _mm256_setzero_ps();
    for (int64_t i = 0; i < k; i++) {
        const __m256 w0 = pgq_panel_load8(qtype, panel, width, i, c);
        const __m256 w1 = strips > 1 ? pgq_panel_load8(qtype, panel, width, i, c + 8) : w0;
        for (int t = 0; t < tokens; t++) {
            const __m256 xt = _mm256_broadcast_ss(x + t * k + i);
            acc[0][t] = _mm256_fmadd_ps(w0, xt, acc[0][t]);
            if (strips > 1) acc[1][t] = _mm256_fmadd_ps(w1, xt, acc[1][t]);
        }
    }
    for (int s = 0; s < strips; s++)
        for (int t = 0; t < tokens; t++) {
            float *o = out + t * out_stride + c + 8 * s;
            __m256 v = acc[s][t];
            if (bias) v = _mm256_add_ps(v, _mm256_loadu_ps(bias + c + 8 * s));
            _mm256_storeu_ps(o, accumulate ? _mm256_add_ps(_mm256_loadu_ps(o), v) : v);
        }
}
#define PGQ_PANEL_AVX2(S, T) \
    pgq_panel_avx2_pass(qtype, panel, width, k, c, S, xt, T, out + t0 * out_stride, out_stride, bias, accumulate)
PGQ_AVX2 PGQ_INLINE void pgq_panel_avx2_of(const int qtype, const uint8_t *panel, int64_t width, int64_t k,
                                           const float *x, int tokens, float *out, int64_t out_stride,
                                           const float *bias, int accumulate) {
    int64_t c = 0;
    for (; c + 8 <= width; c += c + 16 <= width ? 16 : 8) {
        const int strips = c + 16 <= width ? 2 : 1;
        for (int t0 = 0; t0 < tokens; t0 += 6) {
            const float *xt = x + t0 * k;
            switch ((tokens - t0 < 6 ? tokens - t0 : 6) * 2 + strips - 1) {  /* constant counts: registers */
                case 2: PGQ_PANEL_AVX2(1, 1); break;
                case 3: PGQ_PANEL_AVX2(2, 1); break;
                case 4: PGQ_PANEL_AVX2(1, 2); break;
                case 5: PGQ_PANEL_AVX2(2, 2); break;
                case 6: PGQ_PANEL_AVX2(1, 3); break;
                case 7: PGQ_PANEL_AVX2(2, 3); break;
                case 8: PGQ_PANEL_AVX2(1, 4); break;
                case 9: PGQ_PANEL_AVX2(2, 4); break;
                case 10: PGQ_PANEL_AVX2(1, 5); break;
                case 11: PGQ_PANEL_AVX2(2, 5); break;
                case 12: PGQ_PANEL_AVX2(1, 6); break;
                default: PGQ_PANEL_AVX2(2, 6);
            }
        }
    }
    pgq_panel_plain(qtype, panel, width, k, c, width, x, tokens, out, out_stride, bias, accumulate);
}
PGQ_AVX2 static void pgq_panel_avx2(int qtype, const uint8_t *panel, int64_t width, int64_t k, const float *x,
                                    int tokens, float *out, int64_t out_stride, const float *bias, int accumulate) {
    #define PGQ_PANEL_AVX2_OF(Q) pgq_panel_avx2_of(Q, panel, width, k, x, tokens, out, out_stride, bias, accumulate)
    if (qtype == PGQ_F16_PANELS) PGQ_PANEL_AVX2_OF(PGQ_F16_PANELS);  /* constant types: one body each */
    else if (qtype == PGQ_BF16_PANELS) PGQ_PANEL_AVX2_OF(PGQ_BF16_PANELS);
    else PGQ_PANEL_AVX2_OF(PGQ_F32_PANELS);
}

/* 16 values of row i of a whole panel from column c, of `qtype` as pgq_panel_load8's. */
PGQ_AVX512 PGQ_INLINE __m512 pgq_panel_load16(const int qtype, const uint8_t *panel, int64_t i, int c) {
    if (qtype == PGQ_F32_PANELS) return _mm512_loadu_ps((const float *)panel + i * PGQ_PANEL + c);
    const __m256i halves = _mm256_loadu_si256((const __m256i *)(panel + (i * PGQ_PANEL + c) * 2));
    if (qtype == PGQ_F16_PANELS) return _mm512_cvtph_ps(halves);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(halves), 16));
}
/* A whole panel (32 columns) against up to PGQ_PANEL_TOKENS tokens, in 24 zmm accumulators. */
PGQ_AVX512 PGQ_INLINE void pgq_panel_avx512_pass(const int qtype, const uint8_t *panel, int64_t k, const float *x,
                                                 const int tokens, float *out, int64_t out_stride, const float *bias,
                                                 int accumulate) {
    __m512 acc[2][PGQ_PANEL_TOKENS];
    for (int t = 0; t < tokens; t++) acc[0][t] = acc[1][t] = _mm512_setzero_ps();
    for (int64_t i = 0; i < k; i++) {
        const __m512 w0 = pgq_panel_load16(qtype, panel, i, 0), w1 = pgq_panel_load16(qtype, panel, i, 16);
        for (int t = 0; t < tokens; t++) {
            const __m512 xt = _mm512_set1_ps(x[t * k + i]);
            acc[0][t] = _mm512_fmadd_ps(w0, xt, acc[0][t]);
            acc[1][t] = _mm512_fmadd_ps(w1, xt, acc[1][t]);
        }
    }
    for (int s = 0; s < 2; s++)
        for (int t = 0; t < tokens; t++) {
            float *o = out + t * out_stride + 16 * s;
            __m512 v = acc[s][t];
            if (bias) v = _mm512_add_ps(v, _mm512_loadu_ps(bias + 16 * s));
            _mm512_storeu_ps(o, accumulate ? _mm512_add_ps(_mm512_loadu_ps(o), v) : v);
        }
}
#define PGQ_PANEL_AVX512(T) \
    pgq_panel_avx512_pass(qtype, panel, k, x + t0 * k, T, out + t0 * out_stride, out_stride, bias, accumulate)
PGQ_AVX512 PGQ_INLINE void pgq_panel_avx512_of(const int qtype, const uint8_t *panel, int64_t k, const float *x,
                                               int tokens, float *out, int64_t out_stride, const float *bias,
                                               int accumulate) {
    for (int t0 = 0; t0 < tokens; t0 += PGQ_PANEL_TOKENS) {
        switch (tokens - t0 < PGQ_PANEL_TOKENS ? tokens - t0 : PGQ_PANEL_TOKENS) {  /* a constant count: registers */
            case 1: PGQ_PANEL_AVX512(1); break;
            case 2: PGQ_PANEL_AVX512(2); break;
            case 3: PGQ_PANEL_AVX512(3); break;
            case 4: PGQ_PANEL_AVX512(4); break;
            case 5: PGQ_PANEL_AVX512(5); break;
            case 6: PGQ_PANEL_AVX512(6); break;
            case 7: PGQ_PANEL_AVX512(7); break;
            case 8: PGQ_PANEL_AVX512(8); break;
            case 9: PGQ_PANEL_AVX512(9); break;
            case 10: PGQ_PANEL_AVX512(10); break;
            case 11: PGQ_PANEL_AVX512(11); break;
            default: PGQ_PANEL_AVX512(PGQ_PANEL_TOKENS);
        }
    }
}
PGQ_AVX512 static void pgq_panel_avx512(int qtype, const uint8_t *panel, int64_t k, const float *x, int tokens,
                                        float *out, int64_t out_stride, const float *bias, int accumulate) {
    #define PGQ_PANEL_AVX512_OF(Q) pgq_panel_avx512_of(Q, panel, k, x, tokens, out, out_stride, bias, accumulate)
    if (qtype == PGQ_F16_PANELS) PGQ_PANEL_AVX512_OF(PGQ_F16_PANELS);  /* constant types: one body each */
    else if (qtype == PGQ_BF16_PANELS) PGQ_PANEL_AVX512_OF(PGQ_BF16_PANELS);
    else PGQ_PANEL_AVX512_OF(PGQ_F32_PANELS);
}
#else
static void pgq_panel_avx2(int qtype, const uint8_t *panel, int64_t width, int64_t k, const float *x, int tokens,
                           float *out, int64_t out_stride, const float *bias, int accumulate) {}
static void pgq_panel_avx512(int qtype, const uint8_t *panel, int64_t k, const float *x, int tokens, float *out,
                             int64_t out_stride, const float *bias, int accumulate) {}
#endif

/* out[t * out_stride + 32 p + c] (+)= x_t . row (32 p + c) + bias for panels p0..p1 of w [n, k] in `qtype` (F32, F16
   or BF16 panels) and `tokens` rows of x [tokens, k]; bias (NULL: none) and out start at output 0. */
static void pgq_panels_matmul(int qtype, const uint8_t *w, int64_t n, int64_t k, int64_t p0, int64_t p1,
                              const float *x, int tokens, float *out, int64_t out_stride, const float *bias,
                              int accumulate) {
    for (int64_t p = p0; p < p1; p++) {
        const uint8_t *panel = w + p * PGQ_PANEL * k * pgq_panel_bytes(qtype);
        const float *b = bias ? bias + p * PGQ_PANEL : NULL;
        const int64_t width = pgq_panel_width(n, p);
        float *o = out + p * PGQ_PANEL;
        if (pgq_panels_isa == 2 && width == PGQ_PANEL)
            pgq_panel_avx512(qtype, panel, k, x, tokens, o, out_stride, b, accumulate);
        else if (pgq_panels_isa >= 1)
            pgq_panel_avx2(qtype, panel, width, k, x, tokens, o, out_stride, b, accumulate);
        else
            pgq_panel_plain(qtype, panel, width, k, 0, width, x, tokens, o, out_stride, b, accumulate);
    }
}

#endif /* PAGEGATE_CPU_PANELS_H */
