/* The next token of float32 logits rows in the common case (no penalties, bias or grammar: sampler.py keeps those):
   greedy, or temperature with the min-p, top-k and top-p filters in vLLM's order, and logprobs (log_softmax of the
   logits, before temperature) with the top alternatives. One OpenMP team over the rows; each row's result depends on
   its own logits and its own uniform draw only.

   A sampled row takes one uniform u in [0, 1): of its kept tokens, the first whose cumulative mass passes u times
   their total, in id order where neither top-k nor top-p is on, else by logit (ties: the lower id first). Only the
   candidates that can survive top-k / top-p are sorted: a pass buckets the tokens by the binary exponent of
   p / p_max, and the buckets up to the one where the count reaches k (or the mass reaches top_p) hold every token
   either filter keeps. */
#ifndef PAGEGATE_CPU_SAMPLE_H
#define PAGEGATE_CPU_SAMPLE_H

#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "cpu_paged.h"

#define PGS_BUCKETS 64

typedef struct {
    float temperature, top_p, min_p, uniform;  /* temperature <= 0: greedy */
    int top_k;                                 /* 0: off */
    int logprobs;                              /* alternatives wanted; -1: no logprobs */
} pgs_params;

typedef struct {
    float logit, p;
    int32_t id;
} pgs_token;

/* By logit (probabilities of close logits can round to one value), ties: the lower id first. */
static int pgs_by_logit(const void *a, const void *b) {
    const pgs_token *x = (const pgs_token *)a, *y = (const pgs_token *)b;
    if (x->logit != y->logit) return x->logit < y->logit ? 1 : -1;
    return x->id < y->id ? -1 : x->id > y->id;
}

static int32_t pgs_argmax(const float *x, int64_t n) {
    int64_t best = 0;
    for (int64_t i = 1; i < n; i++)
        if (x[i] > x[best]) best = i;
    return (int32_t)best;
}

/* The first bucket (over e = p / p_max in (0, 1], bucket b: e in [2^-b-1, 2^-b), 1 in bucket 0) up to which the tokens number
   at least `count`, or weigh at least `mass`; the last bucket when none does. */
static int pgs_cut_bucket(const float *e, int64_t n, int64_t count, double mass) {
    int64_t counts[PGS_BUCKETS] = {0};
    double masses[PGS_BUCKETS] = {0};
    for (int64_t i = 0; i < n; i++) {
        if (e[i] <= 0.0f) continue;
        int exponent;
        frexpf(e[i], &exponent);  /* e = m 2^exponent, m in [0.5, 1) */
        const int b = exponent > 0 ? 0 : -exponent >= PGS_BUCKETS - 1 ? PGS_BUCKETS - 1 : -exponent;
        counts[b]++;
        masses[b] += e[i];
    }
    int64_t total_count = 0;
    double total_mass = 0.0;
    for (int b = 0; b < PGS_BUCKETS; b++) {
        total_count += counts[b];
        total_mass += masses[b];
        if ((count > 0 && total_count >= count) || (mass > 0.0 && total_mass >= mass)) return b;
    }
    return PGS_BUCKETS - 1;
}

/* The candidates (e above the cut bucket's floor) in the order of their logits x; their number. */
static int64_t pgs_candidates(const float *x, const float *e, int64_t n, int cut, pgs_token *out) {
    const float floor_e = cut >= PGS_BUCKETS - 1 ? 0.0f : ldexpf(1.0f, -cut - 1);
    int64_t m = 0;
    for (int64_t i = 0; i < n; i++)
        if (e[i] > 0.0f && e[i] >= floor_e) out[m++] = (pgs_token){x[i], e[i], (int32_t)i};
    qsort(out, (size_t)m, sizeof(pgs_token), pgs_by_logit);
    return m;
}

/* A token drawn from x's row under p's filters; e and cand are scratch of n entries. */
static int32_t pgs_draw(const float *x, int64_t n, const pgs_params *p, float *e, pgs_token *cand) {
    const float t = p->temperature > FLT_MAX ? FLT_MAX : p->temperature;
    const float max = x[pgs_argmax(x, n)] / t;
    for (int64_t i = 0; i < n; i++) e[i] = x[i] / t;
    pg_exp_sum(e, (int)n, max);  /* e = p / p_max: the best token's is 1 */
    double kept = 0.0;
    for (int64_t i = 0; i < n; i++) {
        if (e[i] < p->min_p) e[i] = 0.0f;
        kept += e[i];
    }
    const int top_k = p->top_k > 0 && p->top_k < n, top_p = p->top_p < 1.0f;
    if (!top_k && !top_p) {  /* every kept token: the draw in id order needs no sort */
        const double target = p->uniform * kept;
        double sum = 0.0;
        int32_t last = 0;
        for (int64_t i = 0; i < n; i++) {
            if (e[i] <= 0.0f) continue;
            sum += e[i];
            last = (int32_t)i;
            if (sum > target) return last;
        }
        return last;
    }
    const int cut = pgs_cut_bucket(e, n, top_k ? p->top_k : 0, top_k ? 0.0 : p->top_p * kept);
    int64_t m = pgs_candidates(x, e, n, cut, cand);
    if (m == 0) return pgs_argmax(x, n);  /* NaN logits leave no candidate */
    double total = kept;  /* top-p's mass: the top k's, or every kept token's */
    if (top_k) {
        if (m > p->top_k) m = p->top_k;
        total = 0.0;
        for (int64_t j = 0; j < m; j++) total += cand[j].p;
    }
    if (top_p) {  /* the smallest prefix whose mass before each token stays under top_p (the best one always) */
        double before = 0.0;
        int64_t keep = 0;
        while (keep < m && (keep == 0 || before < p->top_p * total)) before += cand[keep++].p;
        m = keep;
        total = before;
    }
    const double target = p->uniform * total;
    double sum = 0.0;
    for (int64_t j = 0; j < m; j++) {
        sum += cand[j].p;
        if (sum > target) return cand[j].id;
    }
    return cand[m - 1].id;
}

/* The chosen token's logprob and the `want` best tokens' (descending, ties: the lower id first; ids -1 past them up
   to `width`). */
static float pgs_logprobs(const float *x, int64_t n, int32_t chosen, int want, int width, float *e, int32_t *top_ids,
                          float *top_values) {
    const float max = x[pgs_argmax(x, n)];
    for (int64_t i = 0; i < n; i++) e[i] = x[i];
    const float lse = max + logf(pg_exp_sum(e, (int)n, max));
    int have = 0;
    for (int64_t i = 0; i < n && want > 0; i++) {  /* insertion into the best `want` so far */
        if (have == want && !(x[i] > top_values[have - 1])) continue;
        int at = have < want ? have++ : want - 1;
        while (at > 0 && x[i] > top_values[at - 1]) {
            top_values[at] = top_values[at - 1];
            top_ids[at] = top_ids[at - 1];
            at--;
        }
        top_values[at] = x[i];
        top_ids[at] = (int32_t)i;
    }
    for (int j = 0; j < have; j++) top_values[j] -= lse;
    for (int j = have; j < width; j++) top_ids[j] = -1;
    return x[chosen] - lse;
}

/* For each row r: tokens[r] and, where params[r].logprobs >= 0, chosen[r] and the top alternatives
   (top_ids / top_values rows of `width`). Returns 0, or 1 when scratch could not be had. */
static int pgs_sample(const float *logits, int rows, int64_t vocab, const pgs_params *params, int32_t *tokens,
                      float *chosen, int32_t *top_ids, float *top_values, int width, int threads) {
    int failed = 0;
    #pragma omp parallel num_threads(rows > 1 ? threads : 1) reduction(| : failed)
    {
        float *e = malloc((size_t)vocab * sizeof(float));
        pgs_token *cand = malloc((size_t)vocab * sizeof(pgs_token));
        failed = e == NULL || cand == NULL;
        #pragma omp for schedule(dynamic, 1)
        for (int r = 0; r < rows; r++) {
            if (failed) continue;
            const float *x = logits + (int64_t)r * vocab;
            const pgs_params *p = params + r;
            tokens[r] = p->temperature <= 0.0f ? pgs_argmax(x, vocab) : pgs_draw(x, vocab, p, e, cand);
            if (p->logprobs >= 0)
                chosen[r] = pgs_logprobs(x, vocab, tokens[r], p->logprobs < width ? p->logprobs : width, width, e,
                                         top_ids + (int64_t)r * width, top_values + (int64_t)r * width);
        }
        free(e);
        free(cand);
    }
    return failed;
}

#endif /* PAGEGATE_CPU_SAMPLE_H */
