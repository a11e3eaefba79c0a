/* The C of pagegate/kernels/cpu_decode.pyx: a whole forward pass of a Llama-family decoder over a
   few tokens (decode steps) in one OpenMP parallel region. The same graph covers Qwen3 (QK-norm) and
   Gemma 2 / 3 (four norms per layer, GeGLU, a scaled embedding, soft-capped attention scores and
   logits, a second RoPE table on the sliding layers): each difference is a branch per layer or op,
   never per element, so the Llama path runs as before. The threads walk the layers together;
   each op is split over them with `omp for` (its implied barrier is the only synchronisation), so a
   step costs no Python, no tensor allocation and no thread start per op.

   NOTE: deterministic by construction. A token's arithmetic never depends on the tokens beside it, the
   step's size or the thread count: activations are quantized per row, matmuls split the output rows (never
   the sum) and take the step's rows 16 at a time through one kernel whose per-row order of addition is
   fixed, and attention walks a token's keys in parts of a fixed span aligned to key 0, merged in order. So
   prefill, chunked prefill, decode and any batch give a request the same bits. */
#ifndef PAGEGATE_CPU_DECODE_H
#define PAGEGATE_CPU_DECODE_H

#include <math.h>
#include <omp.h>
#include <stdint.h>
#include "cpu_lora.h"
#include "cpu_paged.h"
#include "cpu_qdot.h"

#define PGD_MAX_TOKENS 256         /* tokens one call takes (a longer step is cut into calls: cpu_decode.pyx) */
#define PGD_MAX_GROUP 16          /* query heads per KV head */
#define PGD_MAX_HEAD_DIM 256
#define PGD_KEY_TILE 128          /* keys per online-softmax step */
#define PGD_PREFETCH_BYTES 2048
#define PGD_PART_KEYS 256         /* keys of one attention part: a fixed span, aligned to key 0 */
#define PGD_SPLIT_STATES 2048     /* part states a step may keep to split few (token, KV head) items over threads */
#define PGD_TILE_GROUPS 4         /* weight row groups a thread takes together in a step of many tokens */
#define PGD_BLOCK_ROWS 32         /* query rows (tokens x heads of a KV head) that read each key tile once */

/* A linear layer: N rows of K weights in one ggml type (F32/F16 rows or blocks), an optional bias; `rest`: the
   layer's next rows, in another type (a packed projection whose shards the file keeps in different types). */
typedef struct pgd_linear {
    int qtype;
    const uint8_t *data;
    int64_t row_bytes, n, k;
    const float *bias;
    const struct pgd_linear *rest;
} pgd_linear;

typedef struct {
    const float *attn_norm, *ffn_norm;            /* before attention, before the MLP */
    const float *q_norm, *k_norm;                 /* [head_dim] RMSNorm of each q / k head before RoPE; NULL: none */
    const float *post_attn_norm, *post_ffn_norm;  /* Gemma: RMSNorm of the attention / MLP output; NULL: none */
    pgd_linear qkv, o, gate_up, down;
    uint8_t *k_cache, *v_cache;  /* [pages, block_size, kv_heads, row] in kv_format */
    int kv_format;               /* this layer's pages' PG_ format (cpu_paged.h): auto-4 mixes int8 and int4 */
    int64_t kv_row_bytes;        /* one (slot, KV head) row of it */
    const float *cos_sin;      /* this layer's RoPE table [positions, 2 * head_dim] (the model's or a local one) */
    int window;                /* 0: none */
    float softcap;             /* attention scores s -> softcap * tanh(s / softcap); 0: none */
} pgd_layer;

enum { PGD_SILU = 0, PGD_GELU_TANH = 1 };  /* the gated MLP's activation: SwiGLU or GeGLU */

typedef struct {
    int num_layers, hidden, num_heads, num_kv_heads, head_dim, intermediate, block_size;
    float eps, scale;
    int exact;             /* 1: integer blocks too take float32 inputs (the torch path's arithmetic) */
    int act;               /* PGD_SILU or PGD_GELU_TANH */
    float embed_scale;     /* the embedding times this before the first layer (Gemma); 0: none */
    float final_softcap;   /* logits -> cap * tanh(logits / cap); 0: none */
    const float *final_norm;
    pgd_linear embed, lm_head;  /* embed: vocab rows of hidden weights */
    const pgd_layer *layers;
} pgd_model;

typedef struct {
    int tokens, seqs;
    const int64_t *positions, *slots;  /* slot -1: not written */
    const int32_t *block_tables;
    int64_t table_width;
    const int32_t *seq_lens, *query_start;
    const pgl_table *lora;  /* the adapters' slots; NULL, or lora_groups.count 0: every token runs on the base */
    pgl_groups lora_groups;
    int num_given;  /* tokens whose input rows are given (an image encoder's), not looked up from ids */
    const int32_t *given_tokens;  /* [num_given]: which tokens */
    const float *given;  /* [num_given, hidden]: their input rows, used as they are (not scaled) */
    const int64_t *key_ends;  /* [tokens]: the last key each token sees (>= its position: an image's tokens see the
                                 whole image, Gemma 3); NULL: each sees up to itself */
} pgd_step;

/* Per-step buffers, sized by the caller for PGD_MAX_TOKENS tokens. `normed` holds the input of the
   next matmul, T rows of its K values (contiguous); act its Q8 (act.k is set per matmul by each
   thread on its own copy). */
typedef struct {
    float *normed;  /* [T, max(hidden, intermediate, heads * head_dim)] */
    float *qkv;     /* [T, q + 2 kv] */
    float *gate_up; /* [T, 2 intermediate] */
    float *branch;  /* [T, hidden]: an attention / MLP output before its post-norm */
    float *attn_parts; /* [PGD_SPLIT_STATES, group * (head_dim + 2)]: attention's part states */
    pgq_act act;    /* q [T, max K], d and s [T, max K / 32] and [T, PGQ_SUMS max K / 32] */
    int token_seq[PGD_MAX_TOKENS];
} pgd_buffers;

/* Whether l takes its input in Q8: integer blocks, unless the model runs exact. */
static inline int pgd_q8(const pgd_model *m, const pgd_linear *l) {
    return !m->exact && !pgq_is_float(l->qtype) && !pgq_is_panels(l->qtype);
}

/* Whether some part of l takes its input in Q8. */
static inline int pgd_any_q8(const pgd_model *m, const pgd_linear *l) {
    for (; l != NULL; l = l->rest)
        if (pgd_q8(m, l)) return 1;
    return 0;
}

/* out[r * out_stride] = x_r . w for one float row w of any length (F32 rows need not be whole blocks). */
static void pgd_row(const pgd_linear *l, const uint8_t *w, const float *x, int tokens, float *out, int64_t out_stride) {
    const int k = (int)l->k, whole = k & ~31;
    if (whole == k) {
        pgq_row(l->qtype, w, k, x, tokens, out, out_stride);
        return;
    }
    for (int r = 0; r < tokens; r++) {
        const float *xr = x + (int64_t)r * k, *wf = (const float *)w;
        float tail = 0.0f;
        pgq_row(l->qtype, w, whole, xr, 1, out + r * out_stride, out_stride);
        for (int i = whole; i < k; i++) tail += wf[i] * xr[i];
        out[r * out_stride] += tail;
    }
}

/* part[i] = x . row i for four float rows of one activation row (F32 rows need not be whole blocks). */
static void pgd_rows4_one(const pgd_linear *l, const uint8_t *w, const float *x, float *part) {
    const int k = (int)l->k, whole = k & ~31;
    pgq_rows4_one(l->qtype, w, l->row_bytes, whole, x, part);
    for (int i = 0; i < PGQ_GROUP && whole < k; i++) {
        const float *wf = (const float *)(w + i * l->row_bytes);
        float tail = 0.0f;
        for (int j = whole; j < k; j++) tail += wf[j] * x[j];
        part[i] += tail;
    }
}

/* part[r * PGQ_GROUP + i] = x_(t0 + r) . row (first + i) for `count` (<= PGQ_MAX_M) tokens from t0: x (rows of
   l->k floats) for float weights, its Q8 act for integer blocks. */
static void pgd_group_dot(const pgd_model *m, const pgd_linear *l, int64_t first, int rows, const float *x,
                          const pgq_act *act, int t0, int count, float *part) {
    const uint8_t *w = l->data + first * l->row_bytes;
    if (pgd_q8(m, l)) {
        const int64_t nb = act->k / 32;
        const pgq_act chunk = {act->k, count, act->q + t0 * act->k, act->d + t0 * nb, act->s + PGQ_SUMS * t0 * nb};
        pgq_qdot(l->qtype, w, l->row_bytes, rows, &chunk, part, PGQ_GROUP);
    } else if (pgq_is_x8(l->qtype)) {  /* an exact model's interleaved rows, each copied out of its group */
        for (int i = 0; i < rows; i++)
            pgq_row_of(l->qtype, l->data, l->n, first + i, (int)l->k, x + t0 * l->k, count, part + i, PGQ_GROUP);
    } else if (count == 1 && rows == PGQ_GROUP) {
        pgd_rows4_one(l, w, x + t0 * l->k, part);
    } else {
        for (int i = 0; i < rows; i++) pgd_row(l, w + i * l->row_bytes, x + t0 * l->k, count, part + i, PGQ_GROUP);
    }
}

/* out[r * out_stride + first + i] (+)= part[r * part_stride + i] + bias for `count` rows from t0 and `rows` outputs. */
static void pgd_store(const pgd_linear *l, const float *part, int64_t part_stride, int t0, int count, int64_t first,
                      int rows, float *out, int64_t out_stride, int accumulate) {
    const float *bias = l->bias ? l->bias + first : NULL;
    for (int r = 0; r < count; r++) {  /* four plain loops the compiler vectorizes */
        const float *p = part + r * part_stride;
        float *o = out + (t0 + r) * out_stride + first;
        if (accumulate && bias) for (int i = 0; i < rows; i++) o[i] += p[i] + bias[i];
        else if (accumulate) for (int i = 0; i < rows; i++) o[i] += p[i];
        else if (bias) for (int i = 0; i < rows; i++) o[i] = p[i] + bias[i];
        else memcpy(o, p, rows * sizeof(float));
    }
}

/* pgd_matmul for integer rows interleaved eight at a time (cpu_qx8.h): a group's eight rows (two groups' where the
   instruction set reads them as one vector, for more than one token) against every token, the tokens in chunks whose
   Q8 stays in L2; the rows after the last group (in their file layout) four at a time. */
static void pgd_matmul_x8(const pgd_model *m, const pgd_linear *l, const pgq_act *act, int tokens, float *out,
                          int64_t out_stride, int accumulate) {
    const int64_t nb = act->k / 32, groups = l->n / PGQ_X8_ROWS, rest = l->n - groups * PGQ_X8_ROWS;
    /* one token is bound by memory, where one group a call streams its weights best */
    const int64_t span = tokens > 1 ? pgq_x8_span() : 1, units = (groups + span - 1) / span;
    pgd_linear tail = *l;  /* the rows after the groups, as the file has them */
    tail.qtype = pgq_base_type(l->qtype);
    int chunk = (int)((256 << 10) / act->k) & ~3;
    chunk = chunk < 16 ? 16 : chunk > PGD_MAX_TOKENS ? PGD_MAX_TOKENS : chunk;
    for (int t0 = 0; t0 < tokens; t0 += chunk) {
        const int count = tokens - t0 < chunk ? tokens - t0 : chunk;
        const pgq_act part_act = {act->k, count, act->q + t0 * act->k, act->d + t0 * nb, act->s + PGQ_SUMS * t0 * nb};
        #pragma omp for schedule(static) nowait
        for (int64_t u = 0; u < units + (rest > 0); u++) {
            float part[PGD_MAX_TOKENS * 2 * PGQ_X8_ROWS];
            if (u == units) {
                for (int c0 = 0; c0 < count; c0 += PGQ_MAX_M) {
                    const int n = count - c0 < PGQ_MAX_M ? count - c0 : PGQ_MAX_M;
                    for (int64_t first = groups * PGQ_X8_ROWS; first < l->n; first += PGQ_GROUP) {
                        const int rows = (int)(l->n - first < PGQ_GROUP ? l->n - first : PGQ_GROUP);
                        pgd_group_dot(m, &tail, first, rows, NULL, act, t0 + c0, n, part);
                        pgd_store(l, part, PGQ_GROUP, t0 + c0, n, first, rows, out, out_stride, accumulate);
                    }
                }
                continue;
            }
            const int64_t g = u * span, these = groups - g < span ? groups - g : span;
            pgq_x8_dot_groups(tail.qtype, l->data + g * PGQ_X8_ROWS * l->row_bytes, l->row_bytes, these, &part_act,
                              part, span * PGQ_X8_ROWS);
            pgd_store(l, part, span * PGQ_X8_ROWS, t0, count, g * PGQ_X8_ROWS, (int)(these * PGQ_X8_ROWS), out,
                      out_stride, accumulate);
        }
    }
    #pragma omp barrier
}

/* out[r * out_stride + n] (+)= x_r . row n + bias[n] for the step's rows, the weight rows split over the threads
   in tiles (one group a tile for a few tokens, PGD_TILE_GROUPS for many, so a tile's weights stay in cache while
   the tokens pass 16 at a time). */
static void pgd_matmul_part(const pgd_model *m, const pgd_linear *l, const float *x, const pgq_act *act, int tokens,
                            float *out, int64_t out_stride, int accumulate) {
    if (pgd_q8(m, l) && pgq_is_x8(l->qtype)) {
        pgd_matmul_x8(m, l, act, tokens, out, out_stride, accumulate);
        return;
    }
    if (pgq_is_panels(l->qtype)) {  /* whole panels a thread, each against every token (cpu_panels.h) */
        #pragma omp for schedule(static)
        for (int64_t p = 0; p < (l->n + PGQ_PANEL - 1) / PGQ_PANEL; p++)
            pgq_panels_matmul(l->qtype, l->data, l->n, l->k, p, p + 1, x, tokens, out, out_stride, l->bias,
                              accumulate);
        return;
    }
    const int64_t groups = (l->n + PGQ_GROUP - 1) / PGQ_GROUP, per_tile = tokens > PGQ_MAX_M ? PGD_TILE_GROUPS : 1;
    #pragma omp for schedule(static)
    for (int64_t tile = 0; tile < (groups + per_tile - 1) / per_tile; tile++) {
        const int64_t last_group = (tile + 1) * per_tile < groups ? (tile + 1) * per_tile : groups;
        for (int t0 = 0; t0 < tokens; t0 += PGQ_MAX_M) {
            const int count = tokens - t0 < PGQ_MAX_M ? tokens - t0 : PGQ_MAX_M;
            for (int64_t g = tile * per_tile; g < last_group; g++) {
                const int64_t first = g * PGQ_GROUP;
                const int rows = (int)(l->n - first < PGQ_GROUP ? l->n - first : PGQ_GROUP);
                float part[PGQ_MAX_M * PGQ_GROUP];
                pgd_group_dot(m, l, first, rows, x, act, t0, count, part);
                pgd_store(l, part, PGQ_GROUP, t0, count, first, rows, out, out_stride, accumulate);
            }
        }
    }
}

/* pgd_matmul_part for each part of l, its outputs after the previous parts'. */
static void pgd_matmul(const pgd_model *m, const pgd_linear *l, const float *x, const pgq_act *act, int tokens, float *out,
                       int64_t out_stride, int accumulate) {
    for (; l != NULL; out += l->n, l = l->rest) pgd_matmul_part(m, l, x, act, tokens, out, out_stride, accumulate);
}

/* The Q8 of x's rows (T rows of act->k), when `next` (some part of it) is in integer blocks. */
static void pgd_quantize(const pgd_model *m, const pgd_linear *next, const float *x, const pgq_act *act,
                         int tokens) {
    if (!pgd_any_q8(m, next)) return;
    const int64_t nb = act->k / 32;
    if (tokens >= 2 * omp_get_num_threads()) {  /* whole rows a thread; a few rows are split by blocks */
        #pragma omp for schedule(static)
        for (int t = 0; t < tokens; t++) pgq_quantize_row(x + t * act->k, act, t, 0, nb);
        return;
    }
    #pragma omp for schedule(static)
    for (int64_t item = 0; item < tokens * nb; item++)
        pgq_quantize_row(x + (item / nb) * act->k, act, (int)(item / nb), item % nb, item % nb + 1);
}

/* out = x * rsqrt(mean(x^2) + eps) * w, as torch's rms_norm. */
static void pgd_rms_norm(const float *x, const float *w, int n, float eps, float *out) {
    float sum = 0.0f;
    for (int i = 0; i < n; i++) sum += x[i] * x[i];
    const float inverse = 1.0f / sqrtf(sum / (float)n + eps);
    for (int i = 0; i < n; i++) out[i] = x[i] * inverse * w[i];
}

static void pgd_norm_rows(const pgd_model *m, const float *x, const float *w, int tokens, float *out) {
    #pragma omp for schedule(static)
    for (int t = 0; t < tokens; t++)
        pgd_rms_norm(x + (int64_t)t * m->hidden, w, m->hidden, m->eps, out + (int64_t)t * m->hidden);
}

/* x += rms_norm(branch) * w row by row (Gemma's post-attention and post-MLP norms); branch is overwritten. */
static void pgd_add_normed(const pgd_model *m, float *branch, const float *w, int tokens, float *x) {
    #pragma omp for schedule(static)
    for (int t = 0; t < tokens; t++) {
        float *row = branch + (int64_t)t * m->hidden, *dst = x + (int64_t)t * m->hidden;
        pgd_rms_norm(row, w, m->hidden, m->eps, row);
        for (int i = 0; i < m->hidden; i++) dst[i] += row[i];
    }
}

/* Neox RoPE of one head in place: x -> x cos + roll(x, D / 2) sin' (the table's signed sin). */
static void pgd_rope(float *x, const float *cos_sin, int d) {
    float rolled[PGD_MAX_HEAD_DIM];
    for (int i = 0; i < d; i++) rolled[i] = x[(i + d / 2) % d];
    for (int i = 0; i < d; i++) x[i] = x[i] * cos_sin[i] + rolled[i] * cos_sin[d + i];
}

/* QK-norm (where the layer has it), then rotate q and k of every token, and write its k and v into
   their cache slot. */
static void pgd_rope_and_write(const pgd_model *m, const pgd_layer *layer, const pgd_step *s, float *qkv) {
    const int d = m->head_dim, heads = m->num_heads + m->num_kv_heads;
    const int64_t width = (int64_t)(m->num_heads + 2 * m->num_kv_heads) * d, slot_stride = m->num_kv_heads * layer->kv_row_bytes;
    #pragma omp for schedule(static)
    for (int item = 0; item < s->tokens * heads; item++) {
        const int t = item / heads, h = item % heads;
        float *head = qkv + t * width + (int64_t)h * d;
        const float *norm = h < m->num_heads ? layer->q_norm : layer->k_norm;
        if (norm) pgd_rms_norm(head, norm, d, m->eps, head);
        pgd_rope(head, layer->cos_sin + s->positions[t] * 2 * d, d);
        if (h < m->num_heads) {
            if (layer->kv_format == PG_I4) pg_rotate(head, d);  /* R q meets R k */
            continue;
        }
        if (s->slots[t] < 0) continue;
        const int64_t at = s->slots[t] * slot_stride + (h - m->num_heads) * layer->kv_row_bytes;
        float *value = head + (int64_t)m->num_kv_heads * d;
        if (layer->kv_format == PG_I4) {  /* int4 pages hold R k and R v (rotation.py); k and v are not read again here */
            pg_rotate(head, d);
            pg_rotate(value, d);
        }
        pg_store_row(layer->kv_format, head, d, layer->k_cache + at);
        pg_store_row(layer->kv_format, value, d, layer->v_cache + at);
    }
}

/* The keys [first, last] token t of sequence seq sees (causal, windowed; up to its key end where the step gives
   one: the window still counts back from its own position, as transformers' Gemma 3 masks). */
static void pgd_visible(const pgd_layer *layer, const pgd_step *s, int t, int seq, int *first, int *last) {
    const int q_len = s->query_start[seq + 1] - s->query_start[seq];
    const int pos = s->seq_lens[seq] - q_len + (t - s->query_start[seq]);
    *first = layer->window > 0 && pos - layer->window + 1 > 0 ? pos - layer->window + 1 : 0;
    *last = s->key_ends != NULL && s->key_ends[t] > pos ? (int)s->key_ends[t] : pos;
}

/* One tile of n keys (at `slot`) for `rows` query rows of one KV head: their scores, the online softmax's step
   (each row's running max and sum, its acc [rows, d] rescaled), the values weighed into acc. Each row's arithmetic
   is its own: the same whichever rows share the call. */
static void pgd_tile(const pgd_model *m, const pgd_layer *layer, const int64_t *slot, int n, const float **query_row,
                     const int64_t *head_offset, int rows, int ahead, float *probs, float *acc, float *row_max,
                     float *row_sum) {
    const int d = m->head_dim;
    pg_score_tile(layer->kv_format, layer->k_cache, slot, n, query_row, head_offset, rows, d, ahead, probs, PGD_KEY_TILE);
    for (int r = 0; r < rows; r++) {
        float *p = probs + r * PGD_KEY_TILE;
        if (layer->softcap > 0.0f) pg_softcap(p, m->scale / layer->softcap, layer->softcap, n);
        else pg_scale(p, m->scale, n);
        const float new_max = fmaxf(row_max[r], pg_max(p, n)), correction = expf(row_max[r] - new_max);
        if (correction != 1.0f) pg_scale(acc + r * d, correction, d);
        row_sum[r] = row_sum[r] * correction + pg_exp_sum(p, n, new_max);
        row_max[r] = new_max;
    }
    pg_accumulate_tile(layer->kv_format, layer->v_cache, slot, n, probs, PGD_KEY_TILE, head_offset, rows, d, ahead, acc);
}

/* Token t's query heads of KV head g over keys [first, last] of sequence seq, with an online softmax over
   tiles of keys: leaves each row's unnormalised output in acc [group, d], its running max and sum of
   exp(score - max) in row_max and row_sum (an empty range: -inf and 0). */
static void pgd_attend_keys(const pgd_model *m, const pgd_layer *layer, const pgd_step *s, int seq, int g,
                            const float *qkv_t, int first, int last, float *acc, float *row_max, float *row_sum) {
    const int d = m->head_dim, group = m->num_heads / m->num_kv_heads, bs = m->block_size;
    const int32_t *table = s->block_tables + seq * s->table_width;
    const int64_t slot_stride = m->num_kv_heads * layer->kv_row_bytes;
    const int ahead = pg_ahead(PGD_PREFETCH_BYTES, layer->kv_row_bytes);
    const float *query_row[PGD_MAX_GROUP];
    int64_t head_offset[PGD_MAX_GROUP], slot[PGD_KEY_TILE + PG_MAX_AHEAD + 4];
    float probs[PGD_MAX_GROUP * PGD_KEY_TILE];
    for (int r = 0; r < group; r++) {
        query_row[r] = qkv_t + (int64_t)(g * group + r) * d;
        head_offset[r] = g * layer->kv_row_bytes;
        row_max[r] = -INFINITY;
        row_sum[r] = 0.0f;
    }
    memset(acc, 0, sizeof(float) * group * d);
    for (int start = first; start <= last; start += PGD_KEY_TILE) {
        const int n = last + 1 - start < PGD_KEY_TILE ? last + 1 - start : PGD_KEY_TILE;
        const int known = last + 1 - start < n + ahead ? last + 1 - start : n + ahead;
        pg_slots(table, bs, slot_stride, start, known, n + ahead + 4, slot);
        pgd_tile(m, layer, slot, n, query_row, head_offset, group, ahead, probs, acc, row_max, row_sum);
    }
}

/* The parts of token t's keys: part p holds keys [p * PGD_PART_KEYS, (p + 1) * PGD_PART_KEYS) of those it sees. */
static void pgd_parts(const pgd_layer *layer, const pgd_step *s, int t, int seq, int *first_part, int *parts) {
    int first, last;
    pgd_visible(layer, s, t, seq, &first, &last);
    *first_part = first / PGD_PART_KEYS;
    *parts = last / PGD_PART_KEYS - *first_part + 1;
}

/* Part p of token t's keys for KV head g: its state (acc [group, d], then the rows' max and sum) into state. */
static void pgd_attend_part(const pgd_model *m, const pgd_layer *layer, const pgd_step *s, int t, int seq, int g,
                            int p, const float *qkv_t, float *state) {
    const int group = m->num_heads / m->num_kv_heads;
    int first, last;
    pgd_visible(layer, s, t, seq, &first, &last);
    const int lo = p * PGD_PART_KEYS > first ? p * PGD_PART_KEYS : first;
    const int hi = (p + 1) * PGD_PART_KEYS - 1 < last ? (p + 1) * PGD_PART_KEYS - 1 : last;
    float *row_max = state + group * m->head_dim;
    pgd_attend_keys(m, layer, s, seq, g, qkv_t, lo, hi, state, row_max, row_max + group);
}

/* total (a running state) then `part`, as one state: both rescaled to the larger max (flash-decoding's merge). The
   parts of a token are merged into the first in key order, whoever computed them. */
static void pgd_merge_state(int group, int d, float *total, const float *part) {
    float *max = total + group * d, *sum = max + group;
    const float *part_max = part + group * d, *part_sum = part_max + group;
    for (int r = 0; r < group; r++) {
        if (part_max[r] == -INFINITY) continue;
        const float top = fmaxf(max[r], part_max[r]), a = expf(max[r] - top), b = expf(part_max[r] - top);
        for (int i = 0; i < d; i++) total[r * d + i] = total[r * d + i] * a + part[r * d + i] * b;
        sum[r] = sum[r] * a + part_sum[r] * b;
        max[r] = top;
    }
}

/* A merged state's rows, normalised, into token t's heads of KV head g (rotated back from int4 pages' space). */
static void pgd_finish_state(const pgd_model *m, const pgd_layer *layer, int g, const float *state, float *out_t) {
    const int d = m->head_dim, group = m->num_heads / m->num_kv_heads;
    for (int r = 0; r < group; r++) {
        float *out = out_t + (int64_t)(g * group + r) * d;
        for (int i = 0; i < d; i++) out[i] = state[r * d + i] / state[group * d + group + r];
        if (layer->kv_format == PG_I4) pg_unrotate(out, d);
    }
}

/* Token t's attention for KV head g, its parts computed and merged here, one after the other. */
static void pgd_attend_item(const pgd_model *m, const pgd_layer *layer, const pgd_step *s, int t, int seq, int g,
                            const float *qkv_t, float *out_t) {
    const int group = m->num_heads / m->num_kv_heads;
    float total[PGD_MAX_GROUP * (PGD_MAX_HEAD_DIM + 2)], part[PGD_MAX_GROUP * (PGD_MAX_HEAD_DIM + 2)];
    int first_part, parts;
    pgd_parts(layer, s, t, seq, &first_part, &parts);
    pgd_attend_part(m, layer, s, t, seq, g, first_part, qkv_t, total);
    for (int p = first_part + 1; p < first_part + parts; p++) {
        pgd_attend_part(m, layer, s, t, seq, g, p, qkv_t, part);
        pgd_merge_state(group, m->head_dim, total, part);
    }
    pgd_finish_state(m, layer, g, total, out_t);
}

/* Part p for the tokens of a block (pgd_attend_block) that see keys of it: each row's acc [d] in acc (rows of
   token `first_row / group` on), its max and sum in row_max and row_sum. Tiles that every such token sees whole
   are read once for all their rows; the tiles where the tokens' last keys fall, token by token. */
static void pgd_block_part(const pgd_model *m, const pgd_layer *layer, const pgd_step *s, int seq, int t0, int count,
                           int p, const float **query_row, const int64_t *head_offset, float *acc, float *row_max,
                           float *row_sum) {
    const int d = m->head_dim, group = m->num_heads / m->num_kv_heads;
    const int32_t *table = s->block_tables + seq * s->table_width;
    const int64_t slot_stride = m->num_kv_heads * layer->kv_row_bytes;
    const int ahead = pg_ahead(PGD_PREFETCH_BYTES, layer->kv_row_bytes);
    int64_t slot[PGD_KEY_TILE + PG_MAX_AHEAD + 4];
    float probs[PGD_BLOCK_ROWS * PGD_KEY_TILE];
    int hi[PGD_BLOCK_ROWS], first = count;  /* each token's last key in the part; the first token that sees it */
    for (int i = count - 1; i >= 0; i--) {
        int lo, last;
        pgd_visible(layer, s, t0 + i, seq, &lo, &last);
        hi[i] = (p + 1) * PGD_PART_KEYS - 1 < last ? (p + 1) * PGD_PART_KEYS - 1 : last;
        if (hi[i] < p * PGD_PART_KEYS) break;
        first = i;
    }
    for (int r = first * group; r < count * group; r++) {
        row_max[r] = -INFINITY;
        row_sum[r] = 0.0f;
    }
    memset(acc + (int64_t)first * group * d, 0, sizeof(float) * (count - first) * group * d);
    for (int start = p * PGD_PART_KEYS; start <= hi[count - 1]; start += PGD_KEY_TILE) {
        int whole = count;  /* tokens [whole, count) see the tile's every key; hi rises with the token */
        while (whole > first && hi[whole - 1] >= start + PGD_KEY_TILE - 1) whole--;
        for (int i = first; i <= whole; i++) {  /* token by token, then (i == whole) the rest at once */
            if (i < whole && hi[i] < start) continue;
            const int n = i < whole ? hi[i] + 1 - start : PGD_KEY_TILE, top = i < whole ? hi[i] : hi[count - 1];
            const int rows = (i < whole ? 1 : count - whole) * group, r0 = i * group;
            if (rows == 0) continue;
            const int known = top + 1 - start < n + ahead ? top + 1 - start : n + ahead;
            pg_slots(table, m->block_size, slot_stride, start, known, n + ahead + 4, slot);
            pgd_tile(m, layer, slot, n, query_row + r0, head_offset + r0, rows, ahead, probs, acc + (int64_t)r0 * d,
                     row_max + r0, row_sum + r0);
        }
    }
}

/* Attention for KV head g of a block of `count` consecutive tokens of one sequence (no sliding window), from
   t0: bit for bit what pgd_attend_item computes for each alone (the same tiles, parts and merges per row), with
   each key tile read and converted once for the block's rows rather than once per token. */
static void pgd_attend_block(const pgd_model *m, const pgd_layer *layer, const pgd_step *s, int seq, int g, int t0,
                             int count, const float *qkv, int64_t qkv_width, float *out, int64_t out_width) {
    const int d = m->head_dim, group = m->num_heads / m->num_kv_heads;
    const int64_t state_size = (int64_t)group * (d + 2);
    const float *query_row[PGD_BLOCK_ROWS];
    int64_t head_offset[PGD_BLOCK_ROWS];
    float acc[PGD_BLOCK_ROWS * PGD_MAX_HEAD_DIM], row_max[PGD_BLOCK_ROWS], row_sum[PGD_BLOCK_ROWS];
    float total[PGD_BLOCK_ROWS * (PGD_MAX_HEAD_DIM + 2)], part[PGD_MAX_GROUP * (PGD_MAX_HEAD_DIM + 2)];
    for (int r = 0; r < count * group; r++) {
        query_row[r] = qkv + (t0 + r / group) * qkv_width + (int64_t)(g * group + r % group) * d;
        head_offset[r] = g * layer->kv_row_bytes;
    }
    int first_part, parts;
    pgd_parts(layer, s, t0 + count - 1, seq, &first_part, &parts);  /* the last token has the most */
    for (int p = first_part; p < first_part + parts; p++) {
        pgd_block_part(m, layer, s, seq, t0, count, p, query_row, head_offset, acc, row_max, row_sum);
        for (int i = 0; i < count; i++) {
            int token_first, token_parts;
            pgd_parts(layer, s, t0 + i, seq, &token_first, &token_parts);
            if (p >= token_first + token_parts) continue;
            float *state = p == token_first ? total + i * state_size : part;
            memcpy(state, acc + (int64_t)i * group * d, sizeof(float) * group * d);
            memcpy(state + group * d, row_max + i * group, sizeof(float) * group);
            memcpy(state + group * d + group, row_sum + i * group, sizeof(float) * group);
            if (p > token_first) pgd_merge_state(group, d, total + i * state_size, part);
        }
    }
    for (int i = 0; i < count; i++) pgd_finish_state(m, layer, g, total + i * state_size, out + (t0 + i) * out_width);
}

/* Whether the step's (token, KV head) items are too few to keep the threads busy, and their parts few enough to
   keep every part's state (PGD_SPLIT_STATES): then the threads take parts, not items. */
static int pgd_split_parts(const pgd_model *m, const pgd_layer *layer, const pgd_step *s, const pgd_buffers *b,
                           int threads, int *most_parts) {
    int most = 1;
    for (int t = 0; t < s->tokens; t++) {
        int first_part, parts;
        pgd_parts(layer, s, t, b->token_seq[t], &first_part, &parts);
        most = parts > most ? parts : most;
    }
    *most_parts = most;
    const int items = s->tokens * m->num_kv_heads;
    return most > 1 && items < 4 * threads && items * most <= PGD_SPLIT_STATES;
}

/* Attention of every token of the step into out [T, heads * d]: (token, KV head) items on the threads, or, when
   they are few, (item, part) pairs whose states are then merged in order. Either way each token's parts are the
   same and merge in the same order, so the threads change only who computes them. */
static void pgd_attention(const pgd_model *m, const pgd_layer *layer, const pgd_step *s, const pgd_buffers *b,
                          const float *qkv, int64_t qkv_width, float *out, int64_t out_width) {
    const int kv_heads = m->num_kv_heads, group = m->num_heads / kv_heads;
    const int64_t state_size = (int64_t)group * (m->head_dim + 2);
    int most;
    if (!pgd_split_parts(m, layer, s, b, omp_get_num_threads(), &most)) {
        /* blocks assume each token sees up to itself */
        const int per_block = layer->window > 0 || s->key_ends != NULL ? 1 : PGD_BLOCK_ROWS / group;
        #pragma omp for schedule(dynamic)
        for (int item = 0; item < s->tokens * kv_heads; item++) {
            const int t = item / kv_heads, seq = b->token_seq[t];
            const int offset = t - s->query_start[seq];  /* blocks start every per_block tokens of a sequence */
            if (offset % per_block != 0) continue;
            const int left = s->query_start[seq + 1] - t, count = left < per_block ? left : per_block;
            if (count == 1)
                pgd_attend_item(m, layer, s, t, seq, item % kv_heads, qkv + t * qkv_width, out + t * out_width);
            else
                pgd_attend_block(m, layer, s, seq, item % kv_heads, t, count, qkv, qkv_width, out, out_width);
        }
        return;
    }
    #pragma omp for schedule(dynamic)
    for (int pair = 0; pair < s->tokens * kv_heads * most; pair++) {
        const int item = pair / most, t = item / kv_heads, seq = b->token_seq[t];
        int first_part, parts;
        pgd_parts(layer, s, t, seq, &first_part, &parts);
        if (pair % most < parts)
            pgd_attend_part(m, layer, s, t, seq, item % kv_heads, first_part + pair % most, qkv + t * qkv_width,
                            b->attn_parts + pair * state_size);
    }
    #pragma omp for schedule(static)
    for (int item = 0; item < s->tokens * kv_heads; item++) {
        const int t = item / kv_heads;
        int first_part, parts;
        pgd_parts(layer, s, t, b->token_seq[t], &first_part, &parts);
        float *total = b->attn_parts + (int64_t)item * most * state_size;
        for (int p = 1; p < parts; p++) pgd_merge_state(group, m->head_dim, total, total + p * state_size);
        pgd_finish_state(m, layer, item % kv_heads, total, out + t * out_width);
    }
}

/* out[i] = silu(gate[i]) * up[i] for i < n, split over the threads eight values an item on AVX2 (so a value's
   bits never depend on the thread count), no barrier. */
static void pgd_swiglu(const float *gate, const float *up, int64_t n, float *out) {
#if defined(PAGEGATE_CPU_TILES_AVX2_H)
    if (pg_has_avx2()) {
        #pragma omp for schedule(static) nowait
        for (int64_t i = 0; i < n / 8; i++) pg_silu_mul8(gate + 8 * i, up + 8 * i, out + 8 * i);
        #pragma omp single nowait
        for (int64_t i = n / 8 * 8; i < n; i++) out[i] = gate[i] / (1.0f + expf(-gate[i])) * up[i];
        return;
    }
#endif
    #pragma omp for schedule(static) nowait
    for (int64_t i = 0; i < n; i++) out[i] = gate[i] / (1.0f + expf(-gate[i])) * up[i];
}

/* act(gate) * up of every token into out [T, intermediate]: silu (SwiGLU) or tanh-approximated GELU
   (GeGLU, torch's formula: 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3)))). Split over the values, not the
   tokens: a decode step has one token, which would leave every thread but one waiting. */
static void pgd_gated(const pgd_model *m, int tokens, const float *gate_up, float *out) {
    const int64_t n = m->intermediate;
    const float beta = (float)0.7978845608028654, kappa = 0.044715f;  /* sqrt(2 / pi) */
    for (int t = 0; t < tokens; t++) {
        const float *gate = gate_up + t * 2 * n, *up = gate + n;
        float *o = out + t * n;
        if (m->act == PGD_GELU_TANH) {
            #pragma omp for schedule(static) nowait
            for (int64_t i = 0; i < n; i++)
                o[i] = 0.5f * gate[i] * (1.0f + pg_tanh(beta * (gate[i] + kappa * (gate[i] * gate[i] * gate[i])))) * up[i];
        } else {
            pgd_swiglu(gate, up, n, o);
        }
    }
    #pragma omp barrier
}

/* The adapted tokens' LoRA updates of projection `proj` (PGL_QKV ...) of layer `index`: pgd_lora_shrink before its
   base matmul (no barrier of its own: the matmul's covers it), x [T, k] its input; pgd_lora_expand after it, adding
   into its output. */
static void pgd_lora_shrink(const pgd_step *s, int index, int proj, const float *x, int64_t k) {
    if (s->lora && s->lora_groups.count) pgl_shrink(s->lora, &s->lora_groups, index, proj, x, k, k);
}

static void pgd_lora_expand(const pgd_step *s, int index, int proj, float *out, int64_t out_stride) {
    if (s->lora && s->lora_groups.count) pgl_expand_all(s->lora, &s->lora_groups, index, proj, out, out_stride);
}

/* One decoder layer (number `index`) over the step's tokens, x [T, hidden] the residual stream; act is this
   thread's copy of b->act. */
static void pgd_layer_forward(const pgd_model *m, int index, const pgd_step *s, float *x, pgd_buffers *b,
                              pgq_act *act) {
    const pgd_layer *layer = &m->layers[index];
    const int tokens = s->tokens;
    const int64_t q_width = (int64_t)m->num_heads * m->head_dim;
    const int64_t qkv_width = q_width + 2 * (int64_t)m->num_kv_heads * m->head_dim;
    act->k = m->hidden;
    pgd_norm_rows(m, x, layer->attn_norm, tokens, b->normed);
    pgd_quantize(m, &layer->qkv, b->normed, act, tokens);
    pgd_lora_shrink(s, index, PGL_QKV, b->normed, m->hidden);
    pgd_matmul(m, &layer->qkv, b->normed, act, tokens, b->qkv, qkv_width, 0);
    pgd_lora_expand(s, index, PGL_QKV, b->qkv, qkv_width);
    pgd_rope_and_write(m, layer, s, b->qkv);
    pgd_attention(m, layer, s, b, b->qkv, qkv_width, b->normed, q_width);
    act->k = q_width;
    pgd_quantize(m, &layer->o, b->normed, act, tokens);
    pgd_lora_shrink(s, index, PGL_O, b->normed, q_width);
    if (layer->post_attn_norm) {
        pgd_matmul(m, &layer->o, b->normed, act, tokens, b->branch, m->hidden, 0);
        pgd_lora_expand(s, index, PGL_O, b->branch, m->hidden);
        pgd_add_normed(m, b->branch, layer->post_attn_norm, tokens, x);
    } else {
        pgd_matmul(m, &layer->o, b->normed, act, tokens, x, m->hidden, 1);
        pgd_lora_expand(s, index, PGL_O, x, m->hidden);
    }
    act->k = m->hidden;
    pgd_norm_rows(m, x, layer->ffn_norm, tokens, b->normed);
    pgd_quantize(m, &layer->gate_up, b->normed, act, tokens);
    pgd_lora_shrink(s, index, PGL_GATE_UP, b->normed, m->hidden);
    pgd_matmul(m, &layer->gate_up, b->normed, act, tokens, b->gate_up, 2 * (int64_t)m->intermediate, 0);
    pgd_lora_expand(s, index, PGL_GATE_UP, b->gate_up, 2 * (int64_t)m->intermediate);
    act->k = m->intermediate;
    pgd_gated(m, tokens, b->gate_up, b->normed);
    pgd_quantize(m, &layer->down, b->normed, act, tokens);
    pgd_lora_shrink(s, index, PGL_DOWN, b->normed, m->intermediate);
    if (layer->post_ffn_norm) {
        pgd_matmul(m, &layer->down, b->normed, act, tokens, b->branch, m->hidden, 0);
        pgd_lora_expand(s, index, PGL_DOWN, b->branch, m->hidden);
        pgd_add_normed(m, b->branch, layer->post_ffn_norm, tokens, x);
    } else {
        pgd_matmul(m, &layer->down, b->normed, act, tokens, x, m->hidden, 1);
        pgd_lora_expand(s, index, PGL_DOWN, x, m->hidden);
    }
}

/* The decoder over the step's tokens on `threads` threads: x [T, hidden] ends as the final norm's
   output of their embeddings (looked up here from ids; the step's given rows in place of theirs). */
static void pgd_forward(const pgd_model *m, const pgd_step *s, const int64_t *ids, float *x, pgd_buffers *b,
                        int threads) {
    const int tokens = s->tokens;
    for (int seq = 0; seq < s->seqs; seq++)
        for (int t = s->query_start[seq]; t < s->query_start[seq + 1]; t++) b->token_seq[t] = seq;
    #pragma omp parallel num_threads(threads)
    {
        pgq_act act = b->act;
        act.m = tokens;
        #pragma omp for schedule(static)
        for (int t = 0; t < tokens; t++) {
            float *xt = x + (int64_t)t * m->hidden;
            if (m->embed.qtype == PGQ_F32)
                memcpy(xt, m->embed.data + ids[t] * m->embed.row_bytes, m->hidden * sizeof(float));
            else
                pgq_dequantize_row_of(m->embed.qtype, m->embed.data, m->embed.n, ids[t], m->hidden, xt);
            if (m->embed_scale != 0.0f) pg_scale(xt, m->embed_scale, m->hidden);
        }
        #pragma omp for schedule(static)
        for (int r = 0; r < s->num_given; r++)
            memcpy(x + (int64_t)s->given_tokens[r] * m->hidden, s->given + (int64_t)r * m->hidden,
                   m->hidden * sizeof(float));
        for (int l = 0; l < m->num_layers; l++) pgd_layer_forward(m, l, s, x, b, &act);
        #pragma omp for schedule(static)
        for (int t = 0; t < tokens; t++) {
            float *row = x + (int64_t)t * m->hidden;
            pgd_rms_norm(row, m->final_norm, m->hidden, m->eps, row);
        }
    }
}

/* logits [rows, vocab] of the final hidden states x [rows <= PGD_MAX_TOKENS, hidden], soft-capped as
   torch's tanh(logits / cap) * cap where the model says so. */
static void pgd_logits(const pgd_model *m, const float *x, int rows, float *logits, pgd_buffers *b, int threads) {
    #pragma omp parallel num_threads(threads)
    {
        pgq_act act = b->act;
        act.m = rows;
        act.k = m->hidden;
        pgd_quantize(m, &m->lm_head, x, &act, rows);
        pgd_matmul(m, &m->lm_head, x, &act, rows, logits, m->lm_head.n, 0);
        if (m->final_softcap > 0.0f) {
            const float cap = m->final_softcap;
            const int64_t n = rows * m->lm_head.n;
            #pragma omp for schedule(static)
            for (int64_t i = 0; i < n; i++) logits[i] = pg_tanh(logits[i] / cap) * cap;
        }
    }
}

/* 0 when every token's position, slot and pages lie inside the model's tables and the cache. */
static int pgd_check(const pgd_model *m, const pgd_step *s, const int64_t *ids, int64_t num_pages,
                     int64_t max_positions) {
    if (s->tokens < 1 || s->tokens > PGD_MAX_TOKENS || s->seqs < 1 || s->query_start[0] != 0
        || s->query_start[s->seqs] != s->tokens)
        return 1;
    for (int t = 0; t < s->tokens; t++)
        if (ids[t] < 0 || ids[t] >= m->embed.n || s->positions[t] < 0 || s->positions[t] >= max_positions
            || s->slots[t] >= num_pages * m->block_size)
            return 2;
    for (int seq = 0; s->key_ends != NULL && seq < s->seqs; seq++)
        for (int t = s->query_start[seq]; t < s->query_start[seq + 1]; t++) {
            const int64_t pos = s->seq_lens[seq] - (s->query_start[seq + 1] - t);
            if (s->key_ends[t] < pos || s->key_ends[t] >= s->seq_lens[seq]) return 5;
        }
    for (int seq = 0; seq < s->seqs; seq++) {
        const int q_len = s->query_start[seq + 1] - s->query_start[seq];
        const int64_t pages = ((int64_t)s->seq_lens[seq] + m->block_size - 1) / m->block_size;
        if (q_len < 0 || q_len > s->seq_lens[seq] || pages > s->table_width) return 3;
        for (int64_t p = 0; p < pages; p++) {
            const int32_t page = s->block_tables[seq * s->table_width + p];
            if (page < 0 || page >= num_pages) return 4;
        }
    }
    return 0;
}

#endif /* PAGEGATE_CPU_DECODE_H */
