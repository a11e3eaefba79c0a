/* The interleaved kernels (cpu_qx8.h's layout) for one instruction set and one vector width. The includer defines
   PGQ_ISA, PGQ_TARGET, PGQ_DOT_BCAST, PGQ_SATURATES, PGQ_X8_TOKENS (as for cpu_qdot_isa.h) and PGQ_X_GROUPS:
     1  one group a call, a 256-bit vector of its eight rows;
     2  two adjacent groups a call, a 512-bit vector: lanes 0-7 the first group's rows, 8-15 the second's, each
        half loaded from its group (AVX-512). Every lane does what it does with one group, so the bits are the same;
        a weight vector serves sixteen rows, and its unpacking costs half as much a row. */

#if PGQ_X_GROUPS == 2
#define PGQ_XI __m512i
#define PGQ_XF __m512
/* 32 bytes at p of the first group and at p + next of the second */
#define PGQ_XLOAD(p, next) _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(p))), \
                                              _mm256_loadu_si256((const __m256i *)((p) + (next))), 1)
#define PGQ_XHALVES(p, next) _mm512_cvtph_ps(_mm256_inserti128_si256(                                   \
    _mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(p))), _mm_loadu_si128((const __m128i *)((p) + (next))), 1))
#define PGQ_XSBYTES(p, next) _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_unpacklo_epi64(                  \
    _mm_loadl_epi64((const __m128i *)(p)), _mm_loadl_epi64((const __m128i *)((p) + (next))))))
#define PGQ_XSET8(c) _mm512_set1_epi8(c)
#define PGQ_XSET32(c) _mm512_set1_epi32(c)
#define PGQ_XZERO() _mm512_setzero_si512()
#define PGQ_XAND(a, b) _mm512_and_si512(a, b)
#define PGQ_XOR(a, b) _mm512_or_si512(a, b)
#define PGQ_XSRL16(a, n) _mm512_srli_epi16(a, n)
#define PGQ_XSLL16(a, n) _mm512_slli_epi16(a, n)
#define PGQ_XSRL32(a, n) _mm512_srli_epi32(a, n)
#define PGQ_XSLL32(a, n) _mm512_slli_epi32(a, n)
#define PGQ_XMULLO32(a, b) _mm512_mullo_epi32(a, b)
#define PGQ_XCVT(a) _mm512_cvtepi32_ps(a)
#define PGQ_XFMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define PGQ_XMUL(a, b) _mm512_mul_ps(a, b)
#define PGQ_XSUB(a, b) _mm512_sub_ps(a, b)
#define PGQ_XSETF(f) _mm512_set1_ps(f)
#define PGQ_XZEROF() _mm512_setzero_ps()
#define PGQ_XNEG(a) _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(a), _mm512_set1_epi32((int)0x80000000)))
#define PGQ_XSTORE(p, v) _mm512_storeu_ps(p, v)
#else
#define PGQ_XI __m256i
#define PGQ_XF __m256
#define PGQ_XLOAD(p, next) _mm256_loadu_si256((const __m256i *)(p))
#define PGQ_XHALVES(p, next) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p)))
#define PGQ_XSBYTES(p, next) pgq_bytes_to_float(_mm_loadl_epi64((const __m128i *)(p)), 1)
#define PGQ_XSET8(c) _mm256_set1_epi8(c)
#define PGQ_XSET32(c) _mm256_set1_epi32(c)
#define PGQ_XZERO() _mm256_setzero_si256()
#define PGQ_XAND(a, b) _mm256_and_si256(a, b)
#define PGQ_XOR(a, b) _mm256_or_si256(a, b)
#define PGQ_XSRL16(a, n) _mm256_srli_epi16(a, n)
#define PGQ_XSLL16(a, n) _mm256_slli_epi16(a, n)
#define PGQ_XSRL32(a, n) _mm256_srli_epi32(a, n)
#define PGQ_XSLL32(a, n) _mm256_slli_epi32(a, n)
#define PGQ_XMULLO32(a, b) _mm256_mullo_epi32(a, b)
#define PGQ_XCVT(a) _mm256_cvtepi32_ps(a)
#define PGQ_XFMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define PGQ_XMUL(a, b) _mm256_mul_ps(a, b)
#define PGQ_XSUB(a, b) _mm256_sub_ps(a, b)
#define PGQ_XSETF(f) _mm256_set1_ps(f)
#define PGQ_XZEROF() _mm256_setzero_ps()
#define PGQ_XNEG(a) _mm256_xor_ps(a, _mm256_set1_ps(-0.0f))
#define PGQ_XSTORE(p, v) _mm256_storeu_ps(p, v)
#endif

#define PGQ_XCAT2(a, b) a##_##b
#define PGQ_XCAT(a, b) PGQ_XCAT2(a, b)
#define PGQ_XFN(name) PGQ_XCAT(name, PGQ_ISA)

/* The first pass over a group reads its blocks from memory, their fields out of order, and the slower for every
   activation row it takes (a pass of four rows without it read Q6_K at a third of the speed): the super-block
   PGQ_X8_AHEAD after this one, line by line, is asked for now (in each group of the call). */
PGQ_TARGET PGQ_INLINE void PGQ_XFN(pgq_x8_prefetch)(const uint8_t *block, int64_t bytes, int64_t next) {
    for (int g = 0; g < PGQ_X_GROUPS; g++)
        for (int64_t at = 0; at < bytes; at += 64)
            _mm_prefetch((const char *)block + g * next + PGQ_X8_AHEAD * bytes + at, _MM_HINT_T1);
}

/* The groups' rows (eight a group, interleaved: cpu_qx8.h) of Q4_K or Q5_K against activation rows r0 .. r0 + R - 1,
   in the canonical order: lane i of every vector is weight row i, so a sub-block's integer sums and its float steps
   serve every row at once. The second group (PGQ_X_GROUPS 2) starts `next` bytes after the first.
   out[r * out_stride + i]. */
PGQ_TARGET PGQ_INLINE void PGQ_XFN(pgq_x8_k4_rows)(const int base, const uint8_t *group, int64_t next,
                                                   const pgq_act *a, int r0, const int R, float *out,
                                                   int64_t out_stride) {
    const int64_t nb = a->k / 32, bytes = pgq_block_bytes(base);
    const int five = base == PGQ_Q5_K, values_at = five ? 384 : 128;
    const PGQ_XI six = PGQ_XSET32(0x3f3f3f3f), four = PGQ_XSET32(0x0f0f0f0f);
    const PGQ_XI two = PGQ_XSET32(0x03030303), nibble = PGQ_XSET8(15), bit = PGQ_XSET8(1);
    const PGQ_XI byte = PGQ_XSET32(0xff);
    PGQ_XF f[PGQ_X8_TOKENS];
    for (int r = 0; r < R; r++) f[r] = PGQ_XZEROF();
    for (int64_t sb = 0; sb < nb / 8; sb++) {
        const uint8_t *g = group + sb * PGQ_X8_ROWS * bytes;
        if (r0 == 0 && R > 1)  /* one row: the prefetcher keeps up */
            PGQ_XFN(pgq_x8_prefetch)(g, PGQ_X8_ROWS * bytes, next);
        const PGQ_XF d = PGQ_XHALVES(g, next);
        const PGQ_XF minus_min = PGQ_XNEG(PGQ_XHALVES(g + 16, next));
        /* the 12 scale bytes of each row as three dwords (pgq_scale_min_k4): sub-blocks 0-3, then 4-7 */
        const PGQ_XI w0 = PGQ_XLOAD(g + 32, next), w1 = PGQ_XLOAD(g + 64, next), w2 = PGQ_XLOAD(g + 96, next);
        const PGQ_XI scales[2] = {PGQ_XAND(w0, six), PGQ_XOR(PGQ_XAND(w2, four),
                                  PGQ_XSLL32(PGQ_XAND(PGQ_XSRL32(w0, 6), two), 4))};
        const PGQ_XI mins[2] = {PGQ_XAND(w1, six), PGQ_XOR(PGQ_XAND(PGQ_XSRL32(w2, 4), four),
                                PGQ_XSLL32(PGQ_XAND(PGQ_XSRL32(w1, 6), two), 4))};
        #pragma GCC unroll 4
        for (int p = 0; p < 4; p++) {  /* sub-blocks 2p (low nibbles) and 2p + 1 (high) */
            PGQ_XI sums[2][PGQ_X8_TOKENS];
            for (int r = 0; r < R; r++) sums[0][r] = sums[1][r] = PGQ_XZERO();
            #pragma GCC unroll 8
            for (int c = 0; c < 8; c++) {  /* values 4c .. 4c + 3 of both sub-blocks */
                const PGQ_XI v = PGQ_XLOAD(g + values_at + 32 * (8 * p + c), next);
                PGQ_XI low = PGQ_XAND(v, nibble), high = PGQ_XAND(PGQ_XSRL16(v, 4), nibble);
                if (five) {
                    const PGQ_XI h = PGQ_XLOAD(g + 128 + 32 * c, next);
                    low = PGQ_XOR(low, PGQ_XSLL16(PGQ_XAND(PGQ_XSRL16(h, 2 * p), bit), 4));
                    high = PGQ_XOR(high, PGQ_XSLL16(PGQ_XAND(PGQ_XSRL16(h, 2 * p + 1), bit), 4));
                }
                for (int r = 0; r < R; r++) {
                    const int32_t *q = (const int32_t *)(a->q + ((r0 + r) * nb + 8 * sb + 2 * p) * 32);
                    sums[0][r] = PGQ_DOT_BCAST(sums[0][r], low, q + c);
                    sums[1][r] = PGQ_DOT_BCAST(sums[1][r], high, q + 8 + c);
                }
            }
            #pragma GCC unroll 2
            for (int h = 0; h < 2; h++) {
                const int j = 2 * p + h;
                const PGQ_XF dj = PGQ_XMUL(d, PGQ_XCVT(PGQ_XAND(PGQ_XSRL32(scales[j / 4], 8 * (j % 4)), byte)));
                const PGQ_XF cj = PGQ_XMUL(minus_min, PGQ_XCVT(PGQ_XAND(PGQ_XSRL32(mins[j / 4], 8 * (j % 4)), byte)));
                for (int r = 0; r < R; r++) {
                    const int64_t x = (r0 + r) * nb + 8 * sb + j;
                    f[r] = PGQ_XFMA(PGQ_XCVT(sums[h][r]), PGQ_XMUL(dj, PGQ_XSETF(a->d[x])), f[r]);
                    f[r] = PGQ_XFMA(cj, PGQ_XSETF(a->s[PGQ_SUMS * x + 2]), f[r]);
                }
            }
        }
    }
    for (int r = 0; r < R; r++) PGQ_XSTORE(out + (r0 + r) * out_stride, f[r]);
}

/* The same for Q6_K: a sub-block's halves (16 values each) keep their own sums and scales. A super-block's 128-value
   halves n hold four sub-blocks t each, their low four bits in ql (t = 0, 1: low nibbles of the two 32-byte runs;
   2, 3: the high ones) and their top two in qh (bits 2t, 2t + 1); one sub-block at a time keeps 2R sums live. */
PGQ_TARGET PGQ_INLINE void PGQ_XFN(pgq_x8_q6_rows)(const uint8_t *group, int64_t next, const pgq_act *a, int r0,
                                                   const int R, float *out, int64_t out_stride) {
    const int64_t nb = a->k / 32, bytes = 210;
    const PGQ_XI nibble = PGQ_XSET8(15), pair = PGQ_XSET8(3);
    const PGQ_XF minus32 = PGQ_XSETF(-32.0f);
    PGQ_XF f[PGQ_X8_TOKENS];
    for (int r = 0; r < R; r++) f[r] = PGQ_XZEROF();
    for (int64_t sb = 0; sb < nb / 8; sb++) {
        const uint8_t *g = group + sb * PGQ_X8_ROWS * bytes;
        if (r0 == 0) PGQ_XFN(pgq_x8_prefetch)(g, PGQ_X8_ROWS * bytes, next);
        const PGQ_XF dd = PGQ_XHALVES(g + 1664, next);
        #pragma GCC unroll 8
        for (int j = 0; j < 8; j++) {
            const int n = j / 4, t = j % 4;
            PGQ_XI sums[2][PGQ_X8_TOKENS];
            for (int r = 0; r < R; r++) sums[0][r] = sums[1][r] = PGQ_XZERO();
            #pragma GCC unroll 8
            for (int l4 = 0; l4 < 8; l4++) {  /* values 4 l4 .. 4 l4 + 3 of sub-block j */
                const PGQ_XI ql = PGQ_XLOAD(g + 32 * (16 * n + 8 * (t & 1) + l4), next);
                const PGQ_XI qh = PGQ_XLOAD(g + 1024 + 32 * (8 * n + l4), next);
                const PGQ_XI low = t < 2 ? ql : PGQ_XSRL16(ql, 4);
                const PGQ_XI high = t == 0 ? qh : PGQ_XSRL16(qh, 2 * t);
                const PGQ_XI u = PGQ_XOR(PGQ_XAND(low, nibble), PGQ_XSLL16(PGQ_XAND(high, pair), 4));
                for (int r = 0; r < R; r++) {
                    const int32_t *q = (const int32_t *)(a->q + ((r0 + r) * nb + 8 * sb + j) * 32);
                    sums[l4 / 4][r] = PGQ_DOT_BCAST(sums[l4 / 4][r], u, q + l4);
                }
            }
            const PGQ_XF d0 = PGQ_XMUL(dd, PGQ_XSBYTES(g + 1536 + 16 * j, next));
            const PGQ_XF d1 = PGQ_XMUL(dd, PGQ_XSBYTES(g + 1544 + 16 * j, next));
            const PGQ_XF c0 = PGQ_XMUL(minus32, d0), c1 = PGQ_XMUL(minus32, d1);
            for (int r = 0; r < R; r++) {
                const int64_t x = (r0 + r) * nb + 8 * sb + j;
                const PGQ_XF dx = PGQ_XSETF(a->d[x]);
                f[r] = PGQ_XFMA(PGQ_XCVT(sums[0][r]), PGQ_XMUL(d0, dx), f[r]);
                f[r] = PGQ_XFMA(PGQ_XCVT(sums[1][r]), PGQ_XMUL(d1, dx), f[r]);
                f[r] = PGQ_XFMA(c0, PGQ_XSETF(a->s[PGQ_SUMS * x]), f[r]);
                f[r] = PGQ_XFMA(c1, PGQ_XSETF(a->s[PGQ_SUMS * x + 1]), f[r]);
            }
        }
    }
    for (int r = 0; r < R; r++) PGQ_XSTORE(out + (r0 + r) * out_stride, f[r]);
}

/* The fifth bit of values 4 c .. 4 c + 3 (bits 4c.. of each lane's 32) as 0x10 in each of the lane's four bytes. */
PGQ_TARGET PGQ_INLINE PGQ_XI PGQ_XFN(pgq_x8_fifth_bits)(PGQ_XI qh, int c) {
    const PGQ_XI nibble = PGQ_XAND(PGQ_XSRL32(qh, c), PGQ_XSET32(15));
    /* bit j to bit 8 j (the four products' bits never meet: no carries), then up to bit 4 of its byte */
    const PGQ_XI spread = PGQ_XMULLO32(nibble, PGQ_XSET32(0x00204081));
    return PGQ_XSLL32(PGQ_XAND(spread, PGQ_XSET32(0x01010101)), 4);
}

/* The same for Q4_0, Q4_1, Q5_0 and Q5_1 (a block of 32 values: one scale, one offset). */
PGQ_TARGET PGQ_INLINE void PGQ_XFN(pgq_x8_q4_rows)(const int base, const uint8_t *group, int64_t next,
                                                   const pgq_act *a, int r0, const int R, float *out,
                                                   int64_t out_stride) {
    const int64_t nb = a->k / 32, bytes = pgq_block_bytes(base);
    const int one = base == PGQ_Q4_1 || base == PGQ_Q5_1, five = base == PGQ_Q5_0 || base == PGQ_Q5_1;
    const int high_at = 16 + 16 * one, values_at = high_at + 32 * five;
    const PGQ_XI nibble = PGQ_XSET8(15);
    PGQ_XF f[PGQ_X8_TOKENS];
    for (int r = 0; r < R; r++) f[r] = PGQ_XZEROF();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *g = group + b * PGQ_X8_ROWS * bytes;
        const PGQ_XF d = PGQ_XHALVES(g, next);
        const PGQ_XF c = one ? PGQ_XHALVES(g + 16, next) : PGQ_XMUL(d, PGQ_XSETF(five ? -16.0f : -8.0f));
        const PGQ_XI qh = five ? PGQ_XLOAD(g + high_at, next) : PGQ_XZERO();
        PGQ_XI sums[PGQ_X8_TOKENS];
        for (int r = 0; r < R; r++) sums[r] = PGQ_XZERO();
        #pragma GCC unroll 4
        for (int c4 = 0; c4 < 4; c4++) {  /* values 4 c4 .. 4 c4 + 3 (low nibbles) and 16 more (high) */
            const PGQ_XI v = PGQ_XLOAD(g + values_at + 32 * c4, next);
            PGQ_XI low = PGQ_XAND(v, nibble), high = PGQ_XAND(PGQ_XSRL16(v, 4), nibble);
            if (five) {
                low = PGQ_XOR(low, PGQ_XFN(pgq_x8_fifth_bits)(qh, 4 * c4));
                high = PGQ_XOR(high, PGQ_XFN(pgq_x8_fifth_bits)(qh, 16 + 4 * c4));
            }
            for (int r = 0; r < R; r++) {
                const int32_t *q = (const int32_t *)(a->q + ((r0 + r) * nb + b) * 32);
                sums[r] = PGQ_DOT_BCAST(PGQ_DOT_BCAST(sums[r], low, q + c4), high, q + 4 + c4);
            }
        }
        for (int r = 0; r < R; r++) {
            const int64_t x = (r0 + r) * nb + b;
            f[r] = PGQ_XFMA(PGQ_XCVT(sums[r]), PGQ_XMUL(d, PGQ_XSETF(a->d[x])), f[r]);
            f[r] = PGQ_XFMA(c, PGQ_XSETF(a->s[PGQ_SUMS * x + 2]), f[r]);
        }
    }
    for (int r = 0; r < R; r++) PGQ_XSTORE(out + (r0 + r) * out_stride, f[r]);
}

/* The same for Q8_0, its values stored plus 128: the sum of (w + 128) q less 128 sum(q), exact in float (where 16-bit
   pair sums saturate, AVX2's, the sign trick of pgq_quad_step instead). */
PGQ_TARGET PGQ_INLINE void PGQ_XFN(pgq_x8_q8_rows)(const uint8_t *group, int64_t next, const pgq_act *a, int r0,
                                                   const int R, float *out, int64_t out_stride) {
    const int64_t nb = a->k / 32;
    PGQ_XF f[PGQ_X8_TOKENS];
    for (int r = 0; r < R; r++) f[r] = PGQ_XZEROF();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *g = group + b * PGQ_X8_ROWS * 34;
        const PGQ_XF d = PGQ_XHALVES(g, next);
        PGQ_XI sums[PGQ_X8_TOKENS];
        for (int r = 0; r < R; r++) sums[r] = PGQ_XZERO();
        #pragma GCC unroll 8
        for (int c = 0; c < 8; c++) {
            const PGQ_XI v = PGQ_XLOAD(g + 16 + 32 * c, next);
            for (int r = 0; r < R; r++) {
                const int32_t *q = (const int32_t *)(a->q + ((r0 + r) * nb + b) * 32) + c;
#if PGQ_SATURATES  /* |w| . (q with w's sign) = w . q, w the signed values: no 16-bit sum saturates */
                const __m256i w = _mm256_xor_si256(v, _mm256_set1_epi8((char)0x80));
                sums[r] = _mm256_add_epi32(sums[r], PGQ_DOT(_mm256_sign_epi8(w, w),
                                                            _mm256_sign_epi8(_mm256_set1_epi32(*q), w)));
#else
                sums[r] = PGQ_DOT_BCAST(sums[r], v, q);
#endif
            }
        }
        for (int r = 0; r < R; r++) {
            const int64_t x = (r0 + r) * nb + b;
            const PGQ_XF sum = PGQ_XCVT(sums[r]);
            const PGQ_XF exact = PGQ_SATURATES ? sum : PGQ_XSUB(sum, PGQ_XSETF(a->s[PGQ_SUMS * x + 3]));
            f[r] = PGQ_XFMA(exact, PGQ_XMUL(d, PGQ_XSETF(a->d[x])), f[r]);
        }
    }
    for (int r = 0; r < R; r++) PGQ_XSTORE(out + (r0 + r) * out_stride, f[r]);
}

/* PGQ_X_GROUPS adjacent groups of `base` rows (the second `row_bytes` * 8 after the first) against every activation
   row of a: PGQ_X8_TOKENS rows a pass over the weights, then 4, then 1. out[r * out_stride + i]. */
PGQ_TARGET static void PGQ_XFN(pgq_x8_dot)(int base, const uint8_t *group, int64_t row_bytes, const pgq_act *a,
                                           float *out, int64_t out_stride) {
    const int64_t next = PGQ_X8_ROWS * row_bytes;
    int r0 = 0;
#define PGQ_X8_PASSES(KERNEL, ...)                                                                           \
    for (; r0 + PGQ_X8_TOKENS <= a->m; r0 += PGQ_X8_TOKENS) KERNEL(__VA_ARGS__, r0, PGQ_X8_TOKENS, out, out_stride); \
    for (; r0 + 4 <= a->m; r0 += 4) KERNEL(__VA_ARGS__, r0, 4, out, out_stride);                           \
    for (; r0 < a->m; r0++) KERNEL(__VA_ARGS__, r0, 1, out, out_stride);                                     \
    return;
    switch (base) {
        case PGQ_Q4_K: PGQ_X8_PASSES(PGQ_XFN(pgq_x8_k4_rows), PGQ_Q4_K, group, next, a)
        case PGQ_Q5_K: PGQ_X8_PASSES(PGQ_XFN(pgq_x8_k4_rows), PGQ_Q5_K, group, next, a)
        case PGQ_Q4_0: PGQ_X8_PASSES(PGQ_XFN(pgq_x8_q4_rows), PGQ_Q4_0, group, next, a)
        case PGQ_Q4_1: PGQ_X8_PASSES(PGQ_XFN(pgq_x8_q4_rows), PGQ_Q4_1, group, next, a)
        case PGQ_Q5_0: PGQ_X8_PASSES(PGQ_XFN(pgq_x8_q4_rows), PGQ_Q5_0, group, next, a)
        case PGQ_Q5_1: PGQ_X8_PASSES(PGQ_XFN(pgq_x8_q4_rows), PGQ_Q5_1, group, next, a)
        case PGQ_Q8_0: PGQ_X8_PASSES(PGQ_XFN(pgq_x8_q8_rows), group, next, a)
        case PGQ_Q6_K: PGQ_X8_PASSES(PGQ_XFN(pgq_x8_q6_rows), group, next, a)
    }
#undef PGQ_X8_PASSES
}

#undef PGQ_XFN
#undef PGQ_XCAT
#undef PGQ_XCAT2
#undef PGQ_XI
#undef PGQ_XF
#undef PGQ_XLOAD
#undef PGQ_XHALVES
#undef PGQ_XSBYTES
#undef PGQ_XSET8
#undef PGQ_XSET32
#undef PGQ_XZERO
#undef PGQ_XAND
#undef PGQ_XOR
#undef PGQ_XSRL16
#undef PGQ_XSLL16
#undef PGQ_XSRL32
#undef PGQ_XSLL32
#undef PGQ_XMULLO32
#undef PGQ_XCVT
#undef PGQ_XFMA
#undef PGQ_XMUL
#undef PGQ_XSUB
#undef PGQ_XSETF
#undef PGQ_XZEROF
#undef PGQ_XNEG
#undef PGQ_XSTORE
#undef PGQ_X_GROUPS
