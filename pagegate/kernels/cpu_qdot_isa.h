/* The vector kernels of cpu_qdot.h for one instruction set. cpu_qdot.h includes this once per set,
   with PGQ_ISA (the name suffix), PGQ_TARGET (the function attribute), PGQ_DOT(u, q) (unsigned
   bytes times signed bytes, summed into eight int32 lanes of four). Q8_0 goes through the sign
   trick (|w| . q signed like w), so no 16-bit sum of PGQ_DOT saturates and no correction is needed. */

#define PGQ_CAT2(a, b) a##_##b
#define PGQ_CAT(a, b) PGQ_CAT2(a, b)
#define PGQ_FN(name) PGQ_CAT(name, PGQ_ISA)

/* `rows` weight rows against the m activation rows of a; qtype, rows and m are constants where
   this is inlined, so each case compiles to its own loop with the accumulators in registers. */
PGQ_TARGET PGQ_INLINE void PGQ_FN(pgq_qdot_body)(const int qtype, const uint8_t *w, int64_t row_bytes,
                                                 const int rows, const pgq_act *a, const int m,
                                                 float *out, int64_t out_stride) {
    const int64_t nb = a->k / 32;
    __m256 acc[PGQ_MAX_M * PGQ_GROUP];
    float corr[PGQ_MAX_M * PGQ_GROUP];
    #pragma GCC unroll 64
    for (int i = 0; i < m * PGQ_GROUP; i++) {
        acc[i] = _mm256_setzero_ps();
        corr[i] = 0.0f;
    }
    for (int64_t b = 0; b < nb; b++) {
        __m256i u[PGQ_GROUP];
        __m256 d[PGQ_GROUP];
        float c[PGQ_GROUP][2];
        #pragma GCC unroll 4
        for (int i = 0; i < rows; i++) u[i] = pgq_unpack_avx2(qtype, w + i * row_bytes, b, &d[i], c[i]);
        #pragma GCC unroll 16
        for (int r = 0; r < m; r++) {
            const int64_t x = r * nb + b;
            const __m256i q = _mm256_loadu_si256((const __m256i *)(a->q + x * 32));
            const __m256 dx = _mm256_set1_ps(a->d[x]);
            const float s0 = a->s[2 * x], s1 = a->s[2 * x + 1], s01 = s0 + s1;
            #pragma GCC unroll 4
            for (int i = 0; i < rows; i++) {
                __m256i dot;
                if (qtype == PGQ_Q8_0) {  /* |w| . (q with w's sign): no correction term */
                    dot = PGQ_DOT(_mm256_sign_epi8(u[i], u[i]), _mm256_sign_epi8(q, u[i]));
                } else {
                    dot = PGQ_DOT(u[i], q);  /* one offset a sub-block but for Q6_K's two halves */
                    corr[r * PGQ_GROUP + i] += qtype == PGQ_Q6_K ? c[i][0] * s0 + c[i][1] * s1 : c[i][0] * s01;
                }
                acc[r * PGQ_GROUP + i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(d[i], dx),
                                                         acc[r * PGQ_GROUP + i]);
            }
        }
    }
    #pragma GCC unroll 16
    for (int r = 0; r < m; r++)
        #pragma GCC unroll 4
        for (int i = 0; i < rows; i++)
            out[r * out_stride + i] = pgq_hsum(acc[r * PGQ_GROUP + i]) + corr[r * PGQ_GROUP + i];
}

/* pgq_qdot_body for one activation row (a decode step) and PGQ_GROUP weight rows: its few accumulators stay in
   registers (the body's 64 are kept on the stack), and each weight row is prefetched PGQ_PREFETCH bytes ahead,
   four streams the hardware prefetcher alone keeps too short. */
PGQ_TARGET PGQ_INLINE void PGQ_FN(pgq_qdot_one)(const int qtype, const uint8_t *w, int64_t row_bytes, const pgq_act *a,
                                                float *out) {
    const int64_t nb = a->k / 32;
    __m256 acc[PGQ_GROUP];
    float corr[PGQ_GROUP];
    #pragma GCC unroll 4
    for (int i = 0; i < PGQ_GROUP; i++) {
        acc[i] = _mm256_setzero_ps();
        corr[i] = 0.0f;
    }
    for (int64_t b = 0; b < nb; b++) {
        const __m256i q = _mm256_loadu_si256((const __m256i *)(a->q + b * 32));
        const __m256 dx = _mm256_set1_ps(a->d[b]);
        const float s0 = a->s[2 * b], s1 = a->s[2 * b + 1], s01 = s0 + s1;
        #pragma GCC unroll 4
        for (int i = 0; i < PGQ_GROUP; i++) {
            const uint8_t *row = w + i * row_bytes;
            _mm_prefetch((const char *)pgq_block_of(qtype, row, b) + PGQ_PREFETCH, _MM_HINT_T0);
            __m256 d;
            float c[2];
            const __m256i u = pgq_unpack_avx2(qtype, row, b, &d, c);
            __m256i dot;
            if (qtype == PGQ_Q8_0) {
                dot = PGQ_DOT(_mm256_sign_epi8(u, u), _mm256_sign_epi8(q, u));
            } else {
                dot = PGQ_DOT(u, q);
                corr[i] += qtype == PGQ_Q6_K ? c[0] * s0 + c[1] * s1 : c[0] * s01;
            }
            acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(d, dx), acc[i]);
        }
    }
    #pragma GCC unroll 4
    for (int i = 0; i < PGQ_GROUP; i++) out[i] = pgq_hsum(acc[i]) + corr[i];
}

#define PGQ_CASE(T)                                                                              \
    case T:                                                                                      \
        if (rows == PGQ_GROUP && a->m == 1) PGQ_FN(pgq_qdot_one)(T, w, row_bytes, a, out);       \
        else if (rows == PGQ_GROUP) PGQ_FN(pgq_qdot_body)(T, w, row_bytes, PGQ_GROUP, a, a->m, out, out_stride);     \
        else PGQ_FN(pgq_qdot_body)(T, w, row_bytes, rows, a, a->m, out, out_stride);              \
        break;

/* pgq_qdot_plain's contract, on this instruction set. */
PGQ_TARGET static void PGQ_FN(pgq_qdot)(int qtype, const uint8_t *w, int64_t row_bytes, int rows,
                                        const pgq_act *a, float *out, int64_t out_stride) {
    switch (qtype) {
        PGQ_CASE(PGQ_Q4_0) PGQ_CASE(PGQ_Q4_1) PGQ_CASE(PGQ_Q5_0) PGQ_CASE(PGQ_Q5_1) PGQ_CASE(PGQ_Q8_0)
        PGQ_CASE(PGQ_Q4_K) PGQ_CASE(PGQ_Q5_K) PGQ_CASE(PGQ_Q6_K)
    }
}

#undef PGQ_CASE
#undef PGQ_FN
#undef PGQ_CAT
#undef PGQ_CAT2
#undef PGQ_ISA
#undef PGQ_TARGET
#undef PGQ_DOT
