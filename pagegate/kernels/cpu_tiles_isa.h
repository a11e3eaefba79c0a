/* The tiles of cpu_tiles_avx2.h for one vector width. The includer defines PG_TILE_ISA (the names' infix),
   PG_TILE_TARGET (the function attribute), the vector type PG_TV of PG_TW floats and its operations (PG_TLOAD,
   PG_TSTORE, PG_TSET1, PG_TZERO, PG_TFMA) and PG_TFOLD (a vector's lanes added down to eight, as an __m256); the
   rows come converted by pg_rows4_avx2, which every width shares. */

#define PG_TILE_CAT2(a, b, c) a##b##c
#define PG_TILE_CAT(a, b, c) PG_TILE_CAT2(a, b, c)
#define PG_TILE_FN(prefix, name) PG_TILE_CAT(prefix, PG_TILE_ISA, name)
#define PG_TILE_INLINE PG_TILE_TARGET static inline __attribute__((always_inline))

/* Four keys' dot products with a query row of n values, as [k0 k1 k2 k3]: each key's lanes folded to eight, then
   summed across them (two hadds and the halves added). */
PG_TILE_INLINE __m128 PG_TILE_FN(pg_dot4_, )(const float *q, const float *const *k, int n) {
    PG_TV s0 = PG_TZERO(), s1 = s0, s2 = s0, s3 = s0;
    for (int i = 0; i < n; i += PG_TW) {
        const PG_TV x = PG_TLOAD(q + i);
        s0 = PG_TFMA(x, PG_TLOAD(k[0] + i), s0);
        s1 = PG_TFMA(x, PG_TLOAD(k[1] + i), s1);
        s2 = PG_TFMA(x, PG_TLOAD(k[2] + i), s2);
        s3 = PG_TFMA(x, PG_TLOAD(k[3] + i), s3);
    }
    const __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(PG_TFOLD(s0), PG_TFOLD(s1)),
                                    _mm256_hadd_ps(PG_TFOLD(s2), PG_TFOLD(s3)));
    return _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
}

/* y[i] += w[0] v[0][i] + ... + w[3] v[3][i] for i < n, each y[i] through four fused multiply-adds in key order. */
PG_TILE_INLINE void PG_TILE_FN(pg_axpy4_, )(float *y, const float *w, const float *const *v, int n) {
    const PG_TV w0 = PG_TSET1(w[0]), w1 = PG_TSET1(w[1]), w2 = PG_TSET1(w[2]), w3 = PG_TSET1(w[3]);
    for (int i = 0; i < n; i += PG_TW) {
        PG_TV sum = PG_TLOAD(y + i);
        sum = PG_TFMA(w0, PG_TLOAD(v[0] + i), sum);
        sum = PG_TFMA(w1, PG_TLOAD(v[1] + i), sum);
        sum = PG_TFMA(w2, PG_TLOAD(v[2] + i), sum);
        sum = PG_TFMA(w3, PG_TLOAD(v[3] + i), sum);
        PG_TSTORE(y + i, sum);
    }
}

PG_TILE_INLINE void PG_TILE_FN(pg_score_tile_, _of)(
        const int format, const uint8_t *keys, const int64_t *slot, int num_keys, const float **query_row,
        const int64_t *head_offset, int rows, int head_dim, int ahead, float *scores, int stride) {
    const int64_t span = pg_span(head_offset, rows, pg_row_bytes(format, head_dim));
    float tile[4 * PG_MAX_HEAD_DIM] __attribute__((aligned(64))), scale[4], out[4];
    const float *k[4];
    int64_t slots[4];
    for (int j = 0; j < num_keys; j += 4) {
        pg_prefetch_ahead(keys, slot, j, ahead, head_offset[0], span);
        pg_slots4(slot, j, num_keys, slots);
        const int valid = num_keys - j < 4 ? num_keys - j : 4;
        for (int r = 0; r < rows; r++) {
            if (r == 0 || head_offset[r] != head_offset[r - 1])
                pg_rows4_avx2(format, keys + head_offset[r], slots, head_dim, tile, k, scale);
            const __m128 s = _mm_mul_ps(PG_TILE_FN(pg_dot4_, )(query_row[r], k, head_dim), _mm_loadu_ps(scale));
            if (valid == 4) {
                _mm_storeu_ps(scores + r * stride + j, s);
            } else {
                _mm_storeu_ps(out, s);
                memcpy(scores + r * stride + j, out, sizeof(float) * valid);
            }
        }
    }
}

PG_TILE_INLINE void PG_TILE_FN(pg_accumulate_tile_, _of)(
        const int format, const uint8_t *values, const int64_t *slot, int num_keys, const float *weights, int stride,
        const int64_t *head_offset, int rows, int head_dim, int ahead, float *acc) {
    const int64_t span = pg_span(head_offset, rows, pg_row_bytes(format, head_dim));
    float tile[4 * PG_MAX_HEAD_DIM] __attribute__((aligned(64))), scale[4];
    const float *v[4];
    int64_t slots[4];
    for (int j = 0; j < num_keys; j += 4) {
        pg_prefetch_ahead(values, slot, j, ahead, head_offset[0], span);
        pg_slots4(slot, j, num_keys, slots);
        for (int r = 0; r < rows; r++) {
            if (r == 0 || head_offset[r] != head_offset[r - 1])
                pg_rows4_avx2(format, values + head_offset[r], slots, head_dim, tile, v, scale);
            float w[4];
            for (int a = 0; a < 4; a++) w[a] = j + a < num_keys ? weights[r * stride + j + a] * scale[a] : 0.0f;
            PG_TILE_FN(pg_axpy4_, )(acc + r * head_dim, w, v, head_dim);
        }
    }
}

/* One function per format, each with its conversion inlined: pg_<isa>_score_tile_<format>, ... */
#define PG_ISA_TILES(NAME, FORMAT)                                                                            \
PG_TILE_TARGET static void PG_TILE_FN(pg_, _score_tile_##NAME)(                                               \
        const uint8_t *keys, const int64_t *slot, int num_keys, const float **query_row,                     \
        const int64_t *head_offset, int rows, int head_dim, int ahead, float *scores, int stride) {          \
    PG_TILE_FN(pg_score_tile_, _of)(FORMAT, keys, slot, num_keys, query_row, head_offset, rows, head_dim,    \
                                    ahead, scores, stride);                                                   \
}                                                                                                             \
PG_TILE_TARGET static void PG_TILE_FN(pg_, _accumulate_tile_##NAME)(                                          \
        const uint8_t *values, const int64_t *slot, int num_keys, const float *weights, int stride,          \
        const int64_t *head_offset, int rows, int head_dim, int ahead, float *acc) {                         \
    PG_TILE_FN(pg_accumulate_tile_, _of)(FORMAT, values, slot, num_keys, weights, stride, head_offset, rows, \
                                         head_dim, ahead, acc);                                               \
}
PG_ISA_TILES(f32, PG_F32)
PG_ISA_TILES(f16, PG_F16)
PG_ISA_TILES(bf16, PG_BF16)
PG_ISA_TILES(i8, PG_I8)
PG_ISA_TILES(e4m3, PG_E4M3)
PG_ISA_TILES(e5m2, PG_E5M2)
PG_ISA_TILES(i4, PG_I4)

#undef PG_ISA_TILES
#undef PG_TILE_FN
#undef PG_TILE_CAT
#undef PG_TILE_CAT2
#undef PG_TILE_ISA
#undef PG_TILE_TARGET
#undef PG_TILE_INLINE
#undef PG_TV
#undef PG_TW
#undef PG_TLOAD
#undef PG_TSTORE
#undef PG_TSET1
#undef PG_TZERO
#undef PG_TFMA
#undef PG_TFOLD
