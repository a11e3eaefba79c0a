/* The vector kernels of cpu_qdot.h for one instruction set. cpu_qdot.h includes this once per set,
   with PGQ_ISA (the name suffix), PGQ_TARGET (the function attribute), PGQ_DOT(u, q) (unsigned
   bytes times signed bytes, summed into eight int32 lanes of four). Q8_0 goes through the sign
   trick (|w| . q signed like w), so no 16-bit sum of PGQ_DOT saturates and no correction is needed. */

#define PGQ_CAT2(a, b) a##_##b
#define PGQ_CAT(a, b) PGQ_CAT2(a, b)
#define PGQ_FN(name) PGQ_CAT(name, PGQ_ISA)

/* Four weight rows' unpacked block b: the bytes u[i], and as vectors over the rows (lane i: row i) the scales d0, d1
   and offsets c0, c1 of the block's halves (one scale but for Q6_K); rows past `rows` are zero. */
typedef struct {
    __m256i u[PGQ_GROUP];
    __m128 d0, d1, c0, c1;
} PGQ_FN(pgq_quad);

PGQ_TARGET PGQ_INLINE void PGQ_FN(pgq_unpack4)(const int qtype, const uint8_t *w, int64_t row_bytes, const int rows,
                                               int64_t b, int prefetch, PGQ_FN(pgq_quad) *out) {
    __m256 d[PGQ_GROUP];
    float c0[PGQ_GROUP] = {0}, c1[PGQ_GROUP] = {0};
    #pragma GCC unroll 4
    for (int i = 0; i < PGQ_GROUP; i++) {
        if (i >= rows) {
            out->u[i] = _mm256_setzero_si256();
            d[i] = _mm256_setzero_ps();
            continue;
        }
        const uint8_t *row = w + i * row_bytes;
        if (prefetch) _mm_prefetch((const char *)pgq_block_of(qtype, row, b) + PGQ_PREFETCH, _MM_HINT_T0);
        float c[2];
        out->u[i] = pgq_unpack_avx2(qtype, row, b, &d[i], c);
        c0[i] = c[0];
        c1[i] = c[1];
    }
    /* lane 0 (the first half's scale) and lane 4 (the second's) of each row, gathered in registers */
    const __m256 d01 = _mm256_unpacklo_ps(d[0], d[1]), d23 = _mm256_unpacklo_ps(d[2], d[3]);
    const __m256 both = _mm256_shuffle_ps(d01, d23, 0x44);  /* lanes 0-3: rows' first halves; 4-7: second halves */
    out->d0 = _mm256_castps256_ps128(both);
    out->d1 = _mm256_extractf128_ps(both, 1);
    out->c0 = _mm_setr_ps(c0[0], c0[1], c0[2], c0[3]);
    out->c1 = _mm_setr_ps(c1[0], c1[1], c1[2], c1[3]);
}

/* acc (lane i: row i) += activation block x of a against the four rows of `quad`, in the canonical order. */
PGQ_TARGET PGQ_INLINE __m128 PGQ_FN(pgq_quad_step)(const int qtype, const PGQ_FN(pgq_quad) *quad, const pgq_act *a,
                                                   int64_t x, __m128 acc) {
    const __m256i q = _mm256_loadu_si256((const __m256i *)(a->q + x * 32));
    __m256i dot[PGQ_GROUP];
    #pragma GCC unroll 4
    for (int i = 0; i < PGQ_GROUP; i++)  /* Q8_0: |w| . (q with w's sign) = w . q */
        dot[i] = qtype == PGQ_Q8_0 ? PGQ_DOT(_mm256_sign_epi8(quad->u[i], quad->u[i]), _mm256_sign_epi8(q, quad->u[i]))
                                   : PGQ_DOT(quad->u[i], q);
    /* lane i of the low half: row i's sum over values 0-15, of the high half: over values 16-31 (exact) */
    const __m256i sums = _mm256_hadd_epi32(_mm256_hadd_epi32(dot[0], dot[1]), _mm256_hadd_epi32(dot[2], dot[3]));
    const __m128i low = _mm256_castsi256_si128(sums), high = _mm256_extracti128_si256(sums, 1);
    const __m128 dx = _mm_set1_ps(a->d[x]);
    if (qtype == PGQ_Q6_K) {
        acc = _mm_fmadd_ps(_mm_cvtepi32_ps(low), _mm_mul_ps(quad->d0, dx), acc);
        acc = _mm_fmadd_ps(_mm_cvtepi32_ps(high), _mm_mul_ps(quad->d1, dx), acc);
        acc = _mm_fmadd_ps(quad->c0, _mm_set1_ps(a->s[PGQ_SUMS * x]), acc);
        return _mm_fmadd_ps(quad->c1, _mm_set1_ps(a->s[PGQ_SUMS * x + 1]), acc);
    }
    acc = _mm_fmadd_ps(_mm_cvtepi32_ps(_mm_add_epi32(low, high)), _mm_mul_ps(quad->d0, dx), acc);
    if (qtype == PGQ_Q8_0) return acc;
    return _mm_fmadd_ps(quad->c0, _mm_set1_ps(a->s[PGQ_SUMS * x + 2]), acc);
}

/* `rows` (<= 4) weight rows against the m activation rows of a; qtype and m are constants where this is inlined.
   One activation row (a decode step) prefetches each weight row PGQ_PREFETCH bytes ahead, four streams the
   hardware prefetcher alone keeps too short. */
PGQ_TARGET PGQ_INLINE void PGQ_FN(pgq_qdot_body)(const int qtype, const uint8_t *w, int64_t row_bytes,
                                                 const int rows, const pgq_act *a, const int m,
                                                 float *out, int64_t out_stride) {
    const int64_t nb = a->k / 32;
    __m128 acc[PGQ_MAX_M];
    #pragma GCC unroll 16
    for (int r = 0; r < m; r++) acc[r] = _mm_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        PGQ_FN(pgq_quad) quad;
        PGQ_FN(pgq_unpack4)(qtype, w, row_bytes, rows, b, m == 1, &quad);
        #pragma GCC unroll 16
        for (int r = 0; r < m; r++) acc[r] = PGQ_FN(pgq_quad_step)(qtype, &quad, a, r * nb + b, acc[r]);
    }
    for (int r = 0; r < m; r++) {
        float lanes[PGQ_GROUP];
        _mm_storeu_ps(lanes, acc[r]);
        for (int i = 0; i < rows; i++) out[r * out_stride + i] = lanes[i];
    }
}

/* pgq_qdot_body for the K-quants, a super-block at a time: each row's scales decoded once for its eight sub-blocks
   (the same float products as pgq_unpack4 forms one block at a time), then the blocks in order as there. */
PGQ_TARGET PGQ_INLINE void PGQ_FN(pgq_qdot_k_body)(const int qtype, const uint8_t *w, int64_t row_bytes,
                                                   const int rows, const pgq_act *a, const int m,
                                                   float *out, int64_t out_stride) {
    const int64_t nb = a->k / 32, bytes = pgq_block_bytes(qtype);
    __m128 acc[PGQ_MAX_M];
    #pragma GCC unroll 16
    for (int r = 0; r < m; r++) acc[r] = _mm_setzero_ps();
    for (int64_t sb = 0; sb < nb / 8; sb++) {
        __m256 d[2][PGQ_GROUP], c[PGQ_GROUP];
        #pragma GCC unroll 4
        for (int i = 0; i < PGQ_GROUP; i++) {
            __m256 di[2];
            d[0][i] = d[1][i] = c[i] = _mm256_setzero_ps();
            if (i >= rows) continue;
            pgq_kscales_avx2(qtype, w + i * row_bytes + sb * bytes, di, &c[i]);
            d[0][i] = di[0];
            if (qtype == PGQ_Q6_K) d[1][i] = di[1];
        }
        __m128 dt[16], ct[8];  /* lane i: row i; Q6_K: dt[e] for half e, else dt[j], ct[j] for sub-block j */
        pgq_transpose4x8(d[0], dt);
        if (qtype == PGQ_Q6_K) pgq_transpose4x8(d[1], dt + 8);
        else pgq_transpose4x8(c, ct);
        for (int j = 0; j < 8; j++) {
            PGQ_FN(pgq_quad) quad;
            #pragma GCC unroll 4
            for (int i = 0; i < PGQ_GROUP; i++) {
                const uint8_t *blk = w + i * row_bytes + sb * bytes;
                if (m == 1 && i < rows) _mm_prefetch((const char *)blk + 18 * j + PGQ_PREFETCH, _MM_HINT_T0);
                quad.u[i] = i < rows ? pgq_kbits_avx2(qtype, blk, j) : _mm256_setzero_si256();
            }
            if (qtype == PGQ_Q6_K) {
                const __m128 minus32 = _mm_set1_ps(-32.0f);
                quad.d0 = dt[2 * j], quad.d1 = dt[2 * j + 1];
                quad.c0 = _mm_mul_ps(minus32, quad.d0), quad.c1 = _mm_mul_ps(minus32, quad.d1);
            } else {
                quad.d0 = dt[j], quad.c0 = ct[j];
            }
            #pragma GCC unroll 16
            for (int r = 0; r < m; r++) acc[r] = PGQ_FN(pgq_quad_step)(qtype, &quad, a, r * nb + sb * 8 + j, acc[r]);
        }
    }
    for (int r = 0; r < m; r++) {
        float lanes[PGQ_GROUP];
        _mm_storeu_ps(lanes, acc[r]);
        for (int i = 0; i < rows; i++) out[r * out_stride + i] = lanes[i];
    }
}

/* the interleaved kernels on this set, one group (eight rows) a 256-bit vector */
#define PGQ_X_GROUPS 1
#include "cpu_qx8_isa.h"

#define PGQ_CASE(T, BODY)                                                                        \
    case T:                                                                                      \
        if (a->m == 1) PGQ_FN(BODY)(T, w, row_bytes, rows, a, 1, out, out_stride);               \
        else PGQ_FN(BODY)(T, w, row_bytes, rows, a, a->m, out, out_stride);                      \
        break;

/* pgq_qdot_plain's contract, on this instruction set. */
PGQ_TARGET static void PGQ_FN(pgq_qdot)(int qtype, const uint8_t *w, int64_t row_bytes, int rows,
                                        const pgq_act *a, float *out, int64_t out_stride) {
    switch (qtype) {
        PGQ_CASE(PGQ_Q4_0, pgq_qdot_body) PGQ_CASE(PGQ_Q4_1, pgq_qdot_body) PGQ_CASE(PGQ_Q5_0, pgq_qdot_body)
        PGQ_CASE(PGQ_Q5_1, pgq_qdot_body) PGQ_CASE(PGQ_Q8_0, pgq_qdot_body)
        PGQ_CASE(PGQ_Q4_K, pgq_qdot_k_body) PGQ_CASE(PGQ_Q5_K, pgq_qdot_k_body) PGQ_CASE(PGQ_Q6_K, pgq_qdot_k_body)
    }
}

#undef PGQ_CASE
#undef PGQ_FN
#undef PGQ_CAT
#undef PGQ_CAT2
#undef PGQ_ISA
#undef PGQ_TARGET
#undef PGQ_DOT
#undef PGQ_DOT_BCAST
#undef PGQ_SATURATES
#undef PGQ_X8_TOKENS
