# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""The next token of float32 logits rows in C (cpu_sample.h): greedy, or temperature with min-p, top-k and top-p,
and logprobs with their top alternatives, for rows that no penalty, bias or grammar touches."""

from libc.stdint cimport int32_t, int64_t
from libc.stdlib cimport free, malloc

cdef extern from "cpu_sample.h":
    ctypedef struct pgs_params:
        float temperature, top_p, min_p, uniform
        int top_k, logprobs
    int pgs_sample(const float *logits, int rows, int64_t vocab, const pgs_params *params, int32_t *tokens,
                   float *chosen, int32_t *top_ids, float *top_values, int width, int threads) noexcept nogil


def sample(const float[:, ::1] logits, const float[::1] temperature, const int32_t[::1] top_k,
           const float[::1] top_p, const float[::1] min_p, const float[::1] uniform, const int32_t[::1] logprobs,
           int32_t[::1] tokens, float[::1] chosen, int32_t[:, ::1] top_ids, float[:, ::1] top_values,
           int threads) -> None:
    """Row r's token into tokens[r] (temperature[r] <= 0: the argmax; else drawn with uniform[r] in [0, 1) under
    its filters: top_k[r] 0 and top_p[r] 1 are off); where logprobs[r] >= 0, the token's logprob into chosen[r] and
    the logprobs[r] best (at most top_ids' width; ids past them -1) into top_ids[r] / top_values[r]."""
    cdef int rows = logits.shape[0], r
    cdef int64_t vocab = logits.shape[1]
    lengths = (temperature.shape[0], top_k.shape[0], top_p.shape[0], min_p.shape[0], uniform.shape[0],
               logprobs.shape[0], tokens.shape[0], chosen.shape[0], top_ids.shape[0], top_values.shape[0])
    if any(length != rows for length in lengths):
        raise ValueError(f"every argument needs one entry per logits row ({rows})")
    if rows == 0:
        return
    if vocab < 1 or top_ids.shape[1] != top_values.shape[1]:
        raise ValueError("the logits need a vocabulary, and top_ids and top_values one width")
    cdef pgs_params *params = <pgs_params *>malloc(rows * sizeof(pgs_params))
    if params == NULL:
        raise MemoryError()
    for r in range(rows):
        params[r] = pgs_params(temperature[r], top_p[r], min_p[r], uniform[r], top_k[r], logprobs[r])
    cdef int failed
    with nogil:
        failed = pgs_sample(&logits[0, 0], rows, vocab, params, &tokens[0], &chosen[0],
                            &top_ids[0, 0] if top_ids.shape[1] else NULL,
                            &top_values[0, 0] if top_values.shape[1] else NULL, top_ids.shape[1], threads)
    free(params)
    if failed:
        raise MemoryError("no scratch for sampling")
