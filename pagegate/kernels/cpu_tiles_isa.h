/* The tiles of cpu_tiles_avx2.h for one vector width. The includer defines PG_TILE_ISA (the names' prefix),
   PG_TILE_TARGET (the function attribute), PG_TILE_DOT4(q, k, n) (four keys' dot products with a query row, as
   an __m128) and PG_TILE_AXPY4(y, w, v, n) (y += four weighted value rows); the rows come converted by
   pg_rows4_avx2, which every width shares. */

#define PG_TILE_CAT2(a, b, c) a##b##c
#define PG_TILE_CAT(a, b, c) PG_TILE_CAT2(a, b, c)
#define PG_TILE_FN(prefix, name) PG_TILE_CAT(prefix, PG_TILE_ISA, name)

PG_TILE_TARGET static inline __attribute__((always_inline)) void PG_TILE_FN(pg_score_tile_, _of)(
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
            const __m128 s = _mm_mul_ps(PG_TILE_DOT4(query_row[r], k, head_dim), _mm_loadu_ps(scale));
            if (valid == 4) {
                _mm_storeu_ps(scores + r * stride + j, s);
            } else {
                _mm_storeu_ps(out, s);
                memcpy(scores + r * stride + j, out, sizeof(float) * valid);
            }
        }
    }
}

PG_TILE_TARGET static inline __attribute__((always_inline)) void PG_TILE_FN(pg_accumulate_tile_, _of)(
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
            PG_TILE_AXPY4(acc + r * head_dim, w, v, head_dim);
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
#undef PG_TILE_DOT4
#undef PG_TILE_AXPY4
