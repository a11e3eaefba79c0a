# The C of cpu_qdot.h (and the float kernels of cpu_quant.h it includes), declared once for the modules that
# cimport it: cpu_quant and cpu_decode. Each module links its own copy, with its own instruction-set choice.
from libc.stdint cimport int8_t, int64_t, uint8_t

cdef extern from "cpu_qdot.h":
    enum:
        PGQ_GROUP  # weight rows one integer kernel call takes
        PGQ_MAX_M  # activation rows one kernel call takes
    ctypedef struct pgq_act:
        int64_t k
        int m
        int8_t *q
        float *d
        float *s
    void pgq_init() noexcept nogil
    int pgq_set_isa(const char *name) noexcept nogil
    const char *pgq_isa
    void pgq_row(int qtype, const uint8_t *row, int k, const float *x, int rows, float *out,
                 int64_t out_stride) noexcept nogil
    void pgq_dequantize_row(int qtype, const uint8_t *row, int k, float *out) noexcept nogil
    void pgq_quantize_row(const float *x, const pgq_act *a, int r, int64_t first, int64_t last) noexcept nogil
    void pgq_qdot(int qtype, const uint8_t *w, int64_t row_bytes, int rows, const pgq_act *a, float *out,
                  int64_t out_stride) noexcept nogil
    ctypedef int (*pgq_gemm8_fn)(int, const uint8_t *, int64_t, const pgq_act *, float *, int64_t) noexcept nogil
    pgq_gemm8_fn pgq_gemm8
