# The C of cpu_qdot.h (and the float kernels of cpu_quant.h it includes), declared once for the modules that
# cimport it: cpu_quant and cpu_decode. Each module links its own copy, with its own instruction-set choice.
from libc.stdint cimport int8_t, int64_t, uint8_t, uintptr_t

cdef extern from "cpu_qdot.h":
    enum:
        PGQ_GROUP  # weight rows one integer kernel call takes
        PGQ_MAX_M  # activation rows one kernel call takes
        PGQ_SUMS  # floats of pgq_act.s a block
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
    void pgq_row_of(int qtype, const uint8_t *w, int64_t n, int64_t r, int k, const float *x, int rows, float *out,
                    int64_t out_stride) noexcept nogil
    void pgq_dequantize_row_of(int qtype, const uint8_t *w, int64_t n, int64_t r, int k, float *out) noexcept nogil
    void pgq_quantize_row(const float *x, const pgq_act *a, int r, int64_t first, int64_t last) noexcept nogil
    void pgq_qdot(int qtype, const uint8_t *w, int64_t row_bytes, int rows, const pgq_act *a, float *out,
                  int64_t out_stride) noexcept nogil
    enum:
        PGQ_X8  # added to a K-quant's type id: its rows interleaved eight at a time (cpu_qx8.h)
    int pgq_is_x8(int qtype) noexcept nogil
    int pgq_base_type(int qtype) noexcept nogil
    void pgq_x8_pack(int base, const uintptr_t *rows, int64_t row_bytes, uint8_t *out) noexcept nogil
    const uint8_t *pgq_row_at(int qtype, const uint8_t *w, int64_t n, int64_t row_bytes, int64_t r,
                              uint8_t *buf) noexcept nogil
    int pgq_x8_span() noexcept nogil
    void pgq_x8_dot_groups(int base, const uint8_t *group, int64_t row_bytes, int64_t groups, const pgq_act *a,
                           float *out, int64_t out_stride) noexcept nogil
    enum:
        PGQ_F32_PANELS  # float32 rows 32 at a time, each panel k-major (cpu_panels.h)
        PGQ_F16_PANELS  # the same of float16 rows
        PGQ_BF16_PANELS  # and of bfloat16 rows
        PGQ_PANEL  # rows a panel
    void pgq_panels_pack(const uint8_t *rows, int64_t n, int64_t k, int bytes, uint8_t *out) noexcept nogil
    void pgq_panels_matmul(int qtype, const uint8_t *w, int64_t n, int64_t k, int64_t p0, int64_t p1, const float *x,
                           int tokens, float *out, int64_t out_stride, const float *bias,
                           int accumulate) noexcept nogil
