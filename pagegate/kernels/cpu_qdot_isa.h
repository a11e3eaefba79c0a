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

/* The first pass over a group reads its blocks from memory, their fields out of order, and the slower for every
   activation row it takes (a pass of four rows without it read Q6_K at a third of the speed): the super-block
   PGQ_X8_AHEAD after this one, line by line, is asked for now. */
PGQ_TARGET PGQ_INLINE void PGQ_FN(pgq_x8_prefetch)(const uint8_t *block, int64_t bytes) {
    for (int64_t at = 0; at < bytes; at += 64) _mm_prefetch((const char *)block + PGQ_X8_AHEAD * bytes + at, _MM_HINT_T1);
}

/* Eight interleaved rows (cpu_qx8.h) of Q4_K or Q5_K against activation rows r0 .. r0 + R - 1, in the canonical
   order: lane i of every vector is weight row i, so a sub-block's integer sums and its float steps serve eight rows
   at once. out[r * out_stride + i]. */
PGQ_TARGET PGQ_INLINE void PGQ_FN(pgq_x8_k4_rows)(const int base, const uint8_t *group, int64_t row_bytes,
                                                  const pgq_act *a, int r0, const int R, float *out,
                                                  int64_t out_stride) {
    const int64_t nb = a->k / 32, bytes = pgq_block_bytes(base);
    const int five = base == PGQ_Q5_K, values_at = five ? 384 : 128;
    const __m256i six = _mm256_set1_epi32(0x3f3f3f3f), four = _mm256_set1_epi32(0x0f0f0f0f);
    const __m256i two = _mm256_set1_epi32(0x03030303), nibble = _mm256_set1_epi8(15), bit = _mm256_set1_epi8(1);
    const __m256i byte = _mm256_set1_epi32(0xff);
    __m256 f[PGQ_X8_TOKENS];
    for (int r = 0; r < R; r++) f[r] = _mm256_setzero_ps();
    for (int64_t sb = 0; sb < nb / 8; sb++) {
        const uint8_t *g = group + sb * PGQ_X8_ROWS * bytes;
        if (r0 == 0 && R > 1) PGQ_FN(pgq_x8_prefetch)(g, PGQ_X8_ROWS * bytes);  /* one row: the prefetcher keeps up */
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)g));
        const __m256 minus_min = _mm256_xor_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(g + 16))),
                                               _mm256_set1_ps(-0.0f));
        /* the 12 scale bytes of each row as three dwords (pgq_scale_min_k4): sub-blocks 0-3, then 4-7 */
        const __m256i w0 = _mm256_loadu_si256((const __m256i *)(g + 32));
        const __m256i w1 = _mm256_loadu_si256((const __m256i *)(g + 64));
        const __m256i w2 = _mm256_loadu_si256((const __m256i *)(g + 96));
        const __m256i scales[2] = {_mm256_and_si256(w0, six), _mm256_or_si256(_mm256_and_si256(w2, four),
                                   _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(w0, 6), two), 4))};
        const __m256i mins[2] = {_mm256_and_si256(w1, six), _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(w2, 4), four),
                                 _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(w1, 6), two), 4))};
        #pragma GCC unroll 4
        for (int p = 0; p < 4; p++) {  /* sub-blocks 2p (low nibbles) and 2p + 1 (high) */
            __m256i sums[2][PGQ_X8_TOKENS];
            for (int r = 0; r < R; r++) sums[0][r] = sums[1][r] = _mm256_setzero_si256();
            #pragma GCC unroll 8
            for (int c = 0; c < 8; c++) {  /* values 4c .. 4c + 3 of both sub-blocks */
                const __m256i v = _mm256_loadu_si256((const __m256i *)(g + values_at + 32 * (8 * p + c)));
                __m256i low = _mm256_and_si256(v, nibble), high = _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble);
                if (five) {
                    const __m256i h = _mm256_loadu_si256((const __m256i *)(g + 128 + 32 * c));
                    low = _mm256_or_si256(low, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 2 * p), bit), 4));
                    high = _mm256_or_si256(high,
                                           _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 2 * p + 1), bit), 4));
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
                const __m256 dj = _mm256_mul_ps(d, _mm256_cvtepi32_ps(
                    _mm256_and_si256(_mm256_srli_epi32(scales[j / 4], 8 * (j % 4)), byte)));
                const __m256 cj = _mm256_mul_ps(minus_min, _mm256_cvtepi32_ps(
                    _mm256_and_si256(_mm256_srli_epi32(mins[j / 4], 8 * (j % 4)), byte)));
                for (int r = 0; r < R; r++) {
                    const int64_t x = (r0 + r) * nb + 8 * sb + j;
                    f[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[h][r]), _mm256_mul_ps(dj, _mm256_set1_ps(a->d[x])),
                                           f[r]);
                    f[r] = _mm256_fmadd_ps(cj, _mm256_set1_ps(a->s[PGQ_SUMS * x + 2]), f[r]);
                }
            }
        }
    }
    for (int r = 0; r < R; r++) _mm256_storeu_ps(out + (r0 + r) * out_stride, f[r]);
}

/* The same for Q6_K: a sub-block's halves (16 values each) keep their own sums and scales. A super-block's 128-value
   halves n hold four sub-blocks t each, their low four bits in ql (t = 0, 1: low nibbles of the two 32-byte runs;
   2, 3: the high ones) and their top two in qh (bits 2t, 2t + 1); one sub-block at a time keeps 2R sums live. */
PGQ_TARGET PGQ_INLINE void PGQ_FN(pgq_x8_q6_rows)(const uint8_t *group, const pgq_act *a, int r0, const int R,
                                                  float *out, int64_t out_stride) {
    const int64_t nb = a->k / 32, bytes = 210;
    const __m256i nibble = _mm256_set1_epi8(15), pair = _mm256_set1_epi8(3);
    const __m256 minus32 = _mm256_set1_ps(-32.0f);
    __m256 f[PGQ_X8_TOKENS];
    for (int r = 0; r < R; r++) f[r] = _mm256_setzero_ps();
    for (int64_t sb = 0; sb < nb / 8; sb++) {
        const uint8_t *g = group + sb * PGQ_X8_ROWS * bytes;
        if (r0 == 0) PGQ_FN(pgq_x8_prefetch)(g, PGQ_X8_ROWS * bytes);
        const __m256 dd = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(g + 1664)));
        #pragma GCC unroll 8
        for (int j = 0; j < 8; j++) {
            const int n = j / 4, t = j % 4;
            __m256i sums[2][PGQ_X8_TOKENS];
            for (int r = 0; r < R; r++) sums[0][r] = sums[1][r] = _mm256_setzero_si256();
            #pragma GCC unroll 8
            for (int l4 = 0; l4 < 8; l4++) {  /* values 4 l4 .. 4 l4 + 3 of sub-block j */
                const __m256i ql = _mm256_loadu_si256((const __m256i *)(g + 32 * (16 * n + 8 * (t & 1) + l4)));
                const __m256i qh = _mm256_loadu_si256((const __m256i *)(g + 1024 + 32 * (8 * n + l4)));
                const __m256i low = t < 2 ? ql : _mm256_srli_epi16(ql, 4);
                const __m256i high = t == 0 ? qh : _mm256_srli_epi16(qh, 2 * t);
                const __m256i u = _mm256_or_si256(_mm256_and_si256(low, nibble),
                                                  _mm256_slli_epi16(_mm256_and_si256(high, pair), 4));
                for (int r = 0; r < R; r++) {
                    const int32_t *q = (const int32_t *)(a->q + ((r0 + r) * nb + 8 * sb + j) * 32);
                    sums[l4 / 4][r] = PGQ_DOT_BCAST(sums[l4 / 4][r], u, q + l4);
                }
            }
            const __m256 d0 = _mm256_mul_ps(dd, pgq_bytes_to_float(_mm_loadl_epi64((const __m128i *)(g + 1536 + 16 * j)), 1));
            const __m256 d1 = _mm256_mul_ps(dd, pgq_bytes_to_float(_mm_loadl_epi64((const __m128i *)(g + 1544 + 16 * j)), 1));
            const __m256 c0 = _mm256_mul_ps(minus32, d0), c1 = _mm256_mul_ps(minus32, d1);
            for (int r = 0; r < R; r++) {
                const int64_t x = (r0 + r) * nb + 8 * sb + j;
                const __m256 dx = _mm256_set1_ps(a->d[x]);
                f[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[0][r]), _mm256_mul_ps(d0, dx), f[r]);
                f[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[1][r]), _mm256_mul_ps(d1, dx), f[r]);
                f[r] = _mm256_fmadd_ps(c0, _mm256_set1_ps(a->s[PGQ_SUMS * x]), f[r]);
                f[r] = _mm256_fmadd_ps(c1, _mm256_set1_ps(a->s[PGQ_SUMS * x + 1]), f[r]);
            }
        }
    }
    for (int r = 0; r < R; r++) _mm256_storeu_ps(out + (r0 + r) * out_stride, f[r]);
}

/* The fifth bit of values 4 c .. 4 c + 3 (bits 4c.. of each lane's 32) as 0x10 in each of the lane's four bytes. */
PGQ_TARGET PGQ_INLINE __m256i PGQ_FN(pgq_x8_fifth_bits)(__m256i qh, int c) {
    const __m256i nibble = _mm256_and_si256(_mm256_srli_epi32(qh, c), _mm256_set1_epi32(15));
    /* bit j to bit 8 j (the four products' bits never meet: no carries), then up to bit 4 of its byte */
    const __m256i spread = _mm256_mullo_epi32(nibble, _mm256_set1_epi32(0x00204081));
    return _mm256_slli_epi32(_mm256_and_si256(spread, _mm256_set1_epi32(0x01010101)), 4);
}

/* The same for Q4_0, Q4_1, Q5_0 and Q5_1 (a block of 32 values: one scale, one offset). */
PGQ_TARGET PGQ_INLINE void PGQ_FN(pgq_x8_q4_rows)(const int base, const uint8_t *group, const pgq_act *a, int r0,
                                                  const int R, float *out, int64_t out_stride) {
    const int64_t nb = a->k / 32, bytes = pgq_block_bytes(base);
    const int one = base == PGQ_Q4_1 || base == PGQ_Q5_1, five = base == PGQ_Q5_0 || base == PGQ_Q5_1;
    const int high_at = 16 + 16 * one, values_at = high_at + 32 * five;
    const __m256i nibble = _mm256_set1_epi8(15);
    __m256 f[PGQ_X8_TOKENS];
    for (int r = 0; r < R; r++) f[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *g = group + b * PGQ_X8_ROWS * bytes;
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)g));
        const __m256 c = one ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(g + 16)))
                             : _mm256_mul_ps(d, _mm256_set1_ps(five ? -16.0f : -8.0f));
        const __m256i qh = five ? _mm256_loadu_si256((const __m256i *)(g + high_at)) : _mm256_setzero_si256();
        __m256i sums[PGQ_X8_TOKENS];
        for (int r = 0; r < R; r++) sums[r] = _mm256_setzero_si256();
        #pragma GCC unroll 4
        for (int c4 = 0; c4 < 4; c4++) {  /* values 4 c4 .. 4 c4 + 3 (low nibbles) and 16 more (high) */
            const __m256i v = _mm256_loadu_si256((const __m256i *)(g + values_at + 32 * c4));
            __m256i low = _mm256_and_si256(v, nibble), high = _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble);
            if (five) {
                low = _mm256_or_si256(low, PGQ_FN(pgq_x8_fifth_bits)(qh, 4 * c4));
                high = _mm256_or_si256(high, PGQ_FN(pgq_x8_fifth_bits)(qh, 16 + 4 * c4));
            }
            for (int r = 0; r < R; r++) {
                const int32_t *q = (const int32_t *)(a->q + ((r0 + r) * nb + b) * 32);
                sums[r] = PGQ_DOT_BCAST(PGQ_DOT_BCAST(sums[r], low, q + c4), high, q + 4 + c4);
            }
        }
        for (int r = 0; r < R; r++) {
            const int64_t x = (r0 + r) * nb + b;
            f[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[r]), _mm256_mul_ps(d, _mm256_set1_ps(a->d[x])), f[r]);
            f[r] = _mm256_fmadd_ps(c, _mm256_set1_ps(a->s[PGQ_SUMS * x + 2]), f[r]);
        }
    }
    for (int r = 0; r < R; r++) _mm256_storeu_ps(out + (r0 + r) * out_stride, f[r]);
}

/* The same for Q8_0, its values stored plus 128: the sum of (w + 128) q less 128 sum(q), exact in float (where 16-bit
   pair sums saturate, AVX2's, the sign trick of pgq_quad_step instead). */
PGQ_TARGET PGQ_INLINE void PGQ_FN(pgq_x8_q8_rows)(const uint8_t *group, const pgq_act *a, int r0, const int R,
                                                  float *out, int64_t out_stride) {
    const int64_t nb = a->k / 32;
    __m256 f[PGQ_X8_TOKENS];
    for (int r = 0; r < R; r++) f[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *g = group + b * PGQ_X8_ROWS * 34;
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)g));
        __m256i sums[PGQ_X8_TOKENS];
        for (int r = 0; r < R; r++) sums[r] = _mm256_setzero_si256();
        #pragma GCC unroll 8
        for (int c = 0; c < 8; c++) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(g + 16 + 32 * c));
            const __m256i w = _mm256_xor_si256(v, _mm256_set1_epi8((char)0x80));  /* PGQ_SATURATES: the signed values */
            for (int r = 0; r < R; r++) {
                const int32_t *q = (const int32_t *)(a->q + ((r0 + r) * nb + b) * 32) + c;
                sums[r] = PGQ_SATURATES  /* |w| . (q with w's sign) = w . q: no 16-bit sum saturates */
                    ? _mm256_add_epi32(sums[r], PGQ_DOT(_mm256_sign_epi8(w, w), _mm256_sign_epi8(_mm256_set1_epi32(*q), w)))
                    : PGQ_DOT_BCAST(sums[r], v, q);
            }
        }
        for (int r = 0; r < R; r++) {
            const int64_t x = (r0 + r) * nb + b;
            const __m256 sum = _mm256_cvtepi32_ps(sums[r]);
            const __m256 exact = PGQ_SATURATES ? sum : _mm256_sub_ps(sum, _mm256_set1_ps(a->s[PGQ_SUMS * x + 3]));
            f[r] = _mm256_fmadd_ps(exact, _mm256_mul_ps(d, _mm256_set1_ps(a->d[x])), f[r]);
        }
    }
    for (int r = 0; r < R; r++) _mm256_storeu_ps(out + (r0 + r) * out_stride, f[r]);
}

/* pgq_x8_dot_plain's contract, on this instruction set: a few activation rows a pass over the group's weights. */
PGQ_TARGET static void PGQ_FN(pgq_x8_dot)(int base, const uint8_t *group, int64_t row_bytes, const pgq_act *a,
                                          float *out, int64_t out_stride) {
    int r0 = 0;
/* KERNEL(..., r0, R, out, out_stride) over every activation row: PGQ_X8_TOKENS rows a pass, then 4, then 1 */
#define PGQ_X8_PASSES(KERNEL, ...)                                                                           \
    for (; r0 + PGQ_X8_TOKENS <= a->m; r0 += PGQ_X8_TOKENS) KERNEL(__VA_ARGS__, r0, PGQ_X8_TOKENS, out, out_stride); \
    for (; r0 + 4 <= a->m; r0 += 4) KERNEL(__VA_ARGS__, r0, 4, out, out_stride);                           \
    for (; r0 < a->m; r0++) KERNEL(__VA_ARGS__, r0, 1, out, out_stride);                                     \
    return;
    switch (base) {
        case PGQ_Q4_K: PGQ_X8_PASSES(PGQ_FN(pgq_x8_k4_rows), PGQ_Q4_K, group, row_bytes, a)
        case PGQ_Q5_K: PGQ_X8_PASSES(PGQ_FN(pgq_x8_k4_rows), PGQ_Q5_K, group, row_bytes, a)
        case PGQ_Q4_0: PGQ_X8_PASSES(PGQ_FN(pgq_x8_q4_rows), PGQ_Q4_0, group, a)
        case PGQ_Q4_1: PGQ_X8_PASSES(PGQ_FN(pgq_x8_q4_rows), PGQ_Q4_1, group, a)
        case PGQ_Q5_0: PGQ_X8_PASSES(PGQ_FN(pgq_x8_q4_rows), PGQ_Q5_0, group, a)
        case PGQ_Q5_1: PGQ_X8_PASSES(PGQ_FN(pgq_x8_q4_rows), PGQ_Q5_1, group, a)
        case PGQ_Q8_0: PGQ_X8_PASSES(PGQ_FN(pgq_x8_q8_rows), group, a)
        case PGQ_Q6_K: PGQ_X8_PASSES(PGQ_FN(pgq_x8_q6_rows), group, a)
    }
#undef PGQ_X8_PASSES
}

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
