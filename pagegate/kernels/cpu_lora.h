/* LoRA adapters on the native CPU step (S-LoRA / Punica's grouped shrink and expand): after a projection's base
   matmul over every token of a step, each token that runs with an adapter gets out += B (A x). A is the adapter's
   shrink [rank, in] (the packed shards' A stacked), each shard's B (scale folded in) is kept transposed, [ranks, cols],
   so the expand streams it along the output. The step's adapted tokens come grouped by adapter slot (the caller sorts
   them once per step), so one adapter's A and B are read once per projection whatever its token count. Float32
   weights whatever the base's blocks. AVX2 + FMA where the CPU has it, portable C elsewhere. pgl_shrink and
   pgl_expand_all are called by every thread of a parallel region, with a barrier between them. */
#ifndef PAGEGATE_CPU_LORA_H
#define PAGEGATE_CPU_LORA_H

#include <omp.h>
#include <stdint.h>
#include "cpu_paged.h"  /* PG_AVX2 and pg_has_avx2 on x86-64 gcc */

enum { PGL_QKV = 0, PGL_O = 1, PGL_GATE_UP = 2, PGL_DOWN = 3, PGL_PROJS = 4 };  /* a layer's adapted projections */
#define PGL_MAX_SHARDS 3     /* checkpoint projections packed into one (q, k, v) */
#define PGL_TOKEN_TILE 16    /* tokens one shrink item takes (an A row is read once for them) */
#define PGL_COLUMN_TILE 64   /* output values one expand item adds */

typedef struct {
    int first_col, cols, first_rank, ranks;  /* the shard's output columns and its ranks inside the shrink */
    const float *expand;                     /* [ranks, cols]: the shard's B (scaled), transposed */
} pgl_shard;

typedef struct {
    const float *shrink;  /* [rank, in]; NULL: the adapter leaves this projection alone */
    int rank, shards;
    pgl_shard shard[PGL_MAX_SHARDS];
} pgl_update;

typedef struct {
    int slots, layers, max_rank;  /* max_rank: the widest shrink of any update */
    pgl_update *updates;          /* [slots, layers, PGL_PROJS] */
} pgl_table;

typedef struct {
    int count;                            /* groups; 0: no token of the step runs with an adapter */
    const int32_t *slot, *start, *token;  /* group i: tokens token[start[i]:start[i + 1]] run with slot[i]'s adapter */
    float *shrunk;                        /* [T, max_rank] scratch: each adapted token's A x */
} pgl_groups;

static int pgl_portable = 0;  /* 1: the portable C even where the CPU has AVX2 (tests) */

static inline const pgl_update *pgl_at(const pgl_table *t, int slot, int layer, int proj) {
    return &t->updates[((int64_t)slot * t->layers + layer) * PGL_PROJS + proj];
}

static float pgl_dot_portable(const float *a, const float *b, int64_t n) {
    float sum = 0.0f;
    for (int64_t i = 0; i < n; i++) sum += a[i] * b[i];
    return sum;
}

/* o[c] += u . e[:, c] for c in [c0, c1): one token's expand over some of a shard's columns (e [ranks, cols]). */
static void pgl_expand_portable(const float *e, int64_t cols, int ranks, const float *u, float *o, int64_t c0,
                                int64_t c1) {
    for (int64_t c = c0; c < c1; c++) {
        float acc = o[c];
        for (int r = 0; r < ranks; r++) acc += u[r] * e[r * cols + c];
        o[c] = acc;
    }
}

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)

PG_AVX2 static float pgl_dot_avx2(const float *a, const float *b, int64_t n) {
    __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
        s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), s1);
    }
    for (; i + 8 <= n; i += 8) s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
    s0 = _mm256_add_ps(s0, s1);
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(s0), _mm256_extractf128_ps(s0, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    h = _mm_add_ss(h, _mm_movehdup_ps(h));
    float sum = _mm_cvtss_f32(h);
    for (; i < n; i++) sum += a[i] * b[i];
    return sum;
}

PG_AVX2 static void pgl_expand_avx2(const float *e, int64_t cols, int ranks, const float *u, float *o, int64_t c0,
                                    int64_t c1) {
    int64_t c = c0;
    for (; c + 32 <= c1; c += 32) {  /* four independent sums: the rank loop is a chain of FMAs */
        __m256 a0 = _mm256_loadu_ps(o + c), a1 = _mm256_loadu_ps(o + c + 8);
        __m256 a2 = _mm256_loadu_ps(o + c + 16), a3 = _mm256_loadu_ps(o + c + 24);
        for (int r = 0; r < ranks; r++) {
            const __m256 ur = _mm256_set1_ps(u[r]);
            const float *er = e + r * cols + c;
            a0 = _mm256_fmadd_ps(ur, _mm256_loadu_ps(er), a0);
            a1 = _mm256_fmadd_ps(ur, _mm256_loadu_ps(er + 8), a1);
            a2 = _mm256_fmadd_ps(ur, _mm256_loadu_ps(er + 16), a2);
            a3 = _mm256_fmadd_ps(ur, _mm256_loadu_ps(er + 24), a3);
        }
        _mm256_storeu_ps(o + c, a0);
        _mm256_storeu_ps(o + c + 8, a1);
        _mm256_storeu_ps(o + c + 16, a2);
        _mm256_storeu_ps(o + c + 24, a3);
    }
    for (; c + 8 <= c1; c += 8) {
        __m256 acc = _mm256_loadu_ps(o + c);
        for (int r = 0; r < ranks; r++) acc = _mm256_fmadd_ps(_mm256_set1_ps(u[r]), _mm256_loadu_ps(e + r * cols + c), acc);
        _mm256_storeu_ps(o + c, acc);
    }
    pgl_expand_portable(e, cols, ranks, u, o, c, c1);
}

static inline int pgl_avx2(void) { return !pgl_portable && pg_has_avx2(); }

static inline float pgl_dot(const float *a, const float *b, int64_t n) {
    return pgl_avx2() ? pgl_dot_avx2(a, b, n) : pgl_dot_portable(a, b, n);
}

static inline void pgl_expand(const float *e, int64_t cols, int ranks, const float *u, float *o, int64_t c0,
                              int64_t c1) {
    if (pgl_avx2()) pgl_expand_avx2(e, cols, ranks, u, o, c0, c1);
    else pgl_expand_portable(e, cols, ranks, u, o, c0, c1);
}
static int pgl_set_isa(int portable) {
    pgl_portable = portable;
    return portable || pg_has_avx2();
}
#else
#  define pgl_dot pgl_dot_portable
#  define pgl_expand pgl_expand_portable
static int pgl_set_isa(int portable) { return pgl_portable = portable; }
#endif

/* Shrink items of group i: (token tile, rank row) pairs. */
static int64_t pgl_shrink_items(const pgl_groups *g, const pgl_update *u, int i) {
    const int64_t tokens = g->start[i + 1] - g->start[i];
    return u->shrink ? (tokens + PGL_TOKEN_TILE - 1) / PGL_TOKEN_TILE * u->rank : 0;
}

/* Expand items of an update: (shard, column tile) pairs. */
static int64_t pgl_expand_items(const pgl_update *u) {
    int64_t items = 0;
    for (int s = 0; u->shrink && s < u->shards; s++) items += (u->shard[s].cols + PGL_COLUMN_TILE - 1) / PGL_COLUMN_TILE;
    return items;
}

/* shrunk[t, r] = A[r] . x_t for one token tile of group i. */
static void pgl_shrink_item(const pgl_table *table, const pgl_groups *g, const pgl_update *u, int i, int64_t item,
                            const float *x, int64_t x_stride, int64_t k) {
    const int tile = (int)(item / u->rank), r = (int)(item % u->rank);
    const int first = g->start[i] + tile * PGL_TOKEN_TILE;
    const int last = first + PGL_TOKEN_TILE < g->start[i + 1] ? first + PGL_TOKEN_TILE : g->start[i + 1];
    const float *a = u->shrink + (int64_t)r * k;
    for (int j = first; j < last; j++) {
        const int t = g->token[j];
        g->shrunk[(int64_t)t * table->max_rank + r] = pgl_dot(a, x + t * x_stride, k);
    }
}

/* One column tile of one shard of group i's update, for each of the group's tokens. */
static void pgl_expand_item(const pgl_table *table, const pgl_groups *g, const pgl_update *u, int i, int64_t item,
                            float *out, int64_t out_stride) {
    int s = 0;
    for (int64_t tiles; item >= (tiles = (u->shard[s].cols + PGL_COLUMN_TILE - 1) / PGL_COLUMN_TILE); s++) item -= tiles;
    const pgl_shard *shard = &u->shard[s];
    const int64_t c0 = item * PGL_COLUMN_TILE, c1 = c0 + PGL_COLUMN_TILE < shard->cols ? c0 + PGL_COLUMN_TILE : shard->cols;
    for (int j = g->start[i]; j < g->start[i + 1]; j++) {
        const int t = g->token[j];
        pgl_expand(shard->expand, shard->cols, shard->ranks, g->shrunk + (int64_t)t * table->max_rank + shard->first_rank,
                   out + t * out_stride + shard->first_col, c0, c1);
    }
}

/* The shrink of the updates: A x_t of every grouped token for projection `proj` of `layer` (x [T, k], rows x_stride
   apart, its input) into g->shrunk, split over the threads by (group, token tile, rank row) items. No barrier at its
   end (`nowait`): the native step runs it before the projection's base matmul, whose barrier then covers both. */
static void pgl_shrink(const pgl_table *table, const pgl_groups *g, int layer, int proj, const float *x,
                       int64_t x_stride, int64_t k) {
    int64_t items = 0;
    for (int i = 0; i < g->count; i++) items += pgl_shrink_items(g, pgl_at(table, g->slot[i], layer, proj), i);
    #pragma omp for schedule(static) nowait
    for (int64_t item = 0; item < items; item++) {
        int i = 0;
        int64_t at = item;
        for (int64_t n; at >= (n = pgl_shrink_items(g, pgl_at(table, g->slot[i], layer, proj), i)); i++) at -= n;
        pgl_shrink_item(table, g, pgl_at(table, g->slot[i], layer, proj), i, at, x, x_stride, k);
    }
}

/* The expand, after a barrier past the shrink: out[t * out_stride + c] += B (A x_t), split over the threads by (group, shard,
   column tile) items, each reading its rows of B once for all the group's tokens. */
static void pgl_expand_all(const pgl_table *table, const pgl_groups *g, int layer, int proj, float *out,
                           int64_t out_stride) {
    int64_t expand_items = 0;
    for (int i = 0; i < g->count; i++) expand_items += pgl_expand_items(pgl_at(table, g->slot[i], layer, proj));
    if (!expand_items) return;  /* the same answer on every thread: none of them meets the barrier below */
    #pragma omp for schedule(static)
    for (int64_t item = 0; item < expand_items; item++) {
        int i = 0;
        int64_t at = item;
        for (int64_t n; at >= (n = pgl_expand_items(pgl_at(table, g->slot[i], layer, proj))); i++) at -= n;
        pgl_expand_item(table, g, pgl_at(table, g->slot[i], layer, proj), i, at, out, out_stride);
    }
}

/* out[t * out_stride + c] += B (A x_t) of token t's adapter for projection `proj` of `layer`, for every grouped token
   (x [T, k] the projection's input), on its own parallel region: the torch forward's projections, one call each. */
static void pgl_add_parallel(const pgl_table *table, const pgl_groups *g, int layer, int proj, const float *x,
                             int64_t k, float *out, int64_t out_stride, int threads) {
    #pragma omp parallel num_threads(threads)
    {
        pgl_shrink(table, g, layer, proj, x, k, k);
        #pragma omp barrier
        pgl_expand_all(table, g, layer, proj, out, out_stride);
    }
}

#endif /* PAGEGATE_CPU_LORA_H */
