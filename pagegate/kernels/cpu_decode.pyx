# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""A Llama-family decoder's forward pass over a few tokens, in C (cpu_decode.h): one OpenMP parallel
region walks every layer, so a decode step costs no Python and no thread start per op. Qwen3's QK-norm
and Gemma 2 / 3's block (post-attention and post-MLP norms, GeGLU, the scaled embedding, soft-capped
attention scores and logits, a local RoPE table on the sliding layers) are options of the same graph.

`DecodeModel` holds pointers into the model's own tensors (weights in float rows or GGUF blocks,
norms, the rotary table) and the KV pages; it copies nothing, and the tensors must outlive it.
Linear layers in integer blocks take their input in Q8 (llama.cpp's arithmetic, cpu_qdot.h);
float32 and float16 weights take it in float32, as pagegate.kernels.cpu_quant.matmul does.
"""

from libc.stdint cimport int8_t, int32_t, int64_t, uint8_t
from libc.stdlib cimport free, malloc

from pagegate.kernels.cpu_qdot cimport pgq_act, pgq_init, pgq_isa, pgq_set_isa

import torch

from pagegate.kernels.cpu_paged import FORMAT_CODES
from pagegate.kernels.cpu_quant import BLOCK_BYTES, BLOCK_ELEMS
from pagegate.kernels.kv_format import format_of

cdef extern from "cpu_paged.h":
    int64_t pg_row_bytes(int format, int head_dim) noexcept nogil

cdef extern from "cpu_decode.h":
    ctypedef struct pgd_linear:
        int qtype
        const uint8_t *data
        int64_t row_bytes, n, k
        const float *bias
    ctypedef struct pgd_layer:
        const float *attn_norm
        const float *ffn_norm
        const float *q_norm
        const float *k_norm
        const float *post_attn_norm
        const float *post_ffn_norm
        pgd_linear qkv, o, gate_up, down
        uint8_t *k_cache
        uint8_t *v_cache
        const float *cos_sin
        int window
        float softcap
    ctypedef struct pgd_model:
        int num_layers, hidden, num_heads, num_kv_heads, head_dim, intermediate, block_size
        int kv_format
        int64_t kv_row_bytes
        float eps, scale
        int exact
        int act
        float embed_scale
        float final_softcap
        const float *final_norm
        pgd_linear embed, lm_head
        const pgd_layer *layers
    ctypedef struct pgd_step:
        int tokens, seqs
        const int64_t *positions
        const int64_t *slots
        const int32_t *block_tables
        int64_t table_width
        const int32_t *seq_lens
        const int32_t *query_start
    ctypedef struct pgd_buffers:
        float *normed
        float *qkv
        float *gate_up
        float *branch
        float *attn_parts
        pgq_act act
    enum:
        PGD_SILU
        PGD_GELU_TANH
        PGD_MAX_TOKENS
        PGD_MAX_GROUP
        PGD_MAX_HEAD_DIM
        PGD_MAX_PARTS
    void pgd_forward(const pgd_model *m, const pgd_step *s, const int64_t *ids, float *x, pgd_buffers *b,
                     int threads) noexcept nogil
    void pgd_logits(const pgd_model *m, const float *x, int rows, float *logits, pgd_buffers *b,
                    int threads) noexcept nogil
    int pgd_check(const pgd_model *m, const pgd_step *s, const int64_t *ids, int64_t num_pages,
                  int64_t max_positions) noexcept nogil

pgq_init()

MAX_TOKENS = PGD_MAX_TOKENS  # tokens one forward takes
_STEP_ERRORS = {1: "the step needs 1 to {} tokens in sequences that cover them".format(PGD_MAX_TOKENS),
                2: "a token id, position or cache slot is out of range",
                3: "a sequence's length or page count does not fit its block table",
                4: "a block table names a page outside the cache"}


ACTIVATIONS = {"silu": PGD_SILU, "gelu_tanh": PGD_GELU_TANH}  # the gated MLP's activations


def isa() -> str:
    """The instruction set of the integer dot products: "vnni", "avx2" or "portable"."""
    return pgq_isa.decode()


def set_isa(name: str) -> bool:
    """Run the integer dot products on the named instruction set if this CPU has it."""
    return bool(pgq_set_isa(name.encode()))


cdef size_t _address(t, dtype, shape, what) except? 0:
    if t.dtype != dtype or tuple(t.shape) != tuple(shape) or not t.is_contiguous() or t.device.type != "cpu":
        raise ValueError(f"{what} must be a contiguous CPU {dtype} tensor of shape {tuple(shape)}, "
                         f"not {t.dtype} {tuple(t.shape)}")
    return <size_t>t.data_ptr()


cdef pgd_linear _linear(spec, int64_t k, int64_t n, what) except *:
    """(qtype, rows, bias): rows uint8 [n, row bytes], float rows (F32, F16) viewed as bytes or blocks;
    F32 rows may be of any length, the others are whole blocks."""
    qtype, rows, bias = spec
    if qtype not in BLOCK_BYTES or (qtype != 0 and k % BLOCK_ELEMS[qtype]):
        raise ValueError(f"{what}: ggml type {qtype} does not fit rows of {k}")
    cdef pgd_linear l
    l.qtype, l.n, l.k = qtype, n, k
    l.row_bytes = k * BLOCK_BYTES[qtype] // BLOCK_ELEMS[qtype]
    l.data = <const uint8_t *>_address(rows, torch.uint8, (n, l.row_bytes), f"{what} weight")
    l.bias = NULL if bias is None else <const float *>_address(bias, torch.float32, (n,), f"{what} bias")
    return l


cdef const float *_optional(t, int64_t n, what) except? NULL:
    """The float32 [n] vector t, or NULL for None."""
    return NULL if t is None else <const float *>_address(t, torch.float32, (n,), what)


cdef class DecodeModel:
    """The decoder of one model over its KV pages; `forward` runs a step, `logits` the LM head.

    dims: (hidden, heads, kv_heads, head_dim, intermediate, eps, scale); linears are
    (qtype, rows, bias) triples, rows the weight's bytes [N, row bytes]; each layer is (attn_norm, ffn_norm,
    qkv, o, gate_up, down, k_cache, v_cache, window, q_norm, k_norm, post_attn_norm, post_ffn_norm, local_rope,
    softcap) with caches [pages, block_size, kv_heads, row] of one page format (kv_format.py): ffn_norm the norm before the MLP;
    q_norm and k_norm [head_dim] (QK-norm) and the post-norms [hidden] (Gemma) None where the layer has
    none; local_rope True for a layer on `local_cos_sin` rather than `cos_sin`; softcap the attention
    score cap (None or 0: none). `activation` is "silu" (SwiGLU) or "gelu_tanh" (GeGLU), `embed_scale`
    multiplies the embedding, `final_softcap` caps the logits. `exact` gives integer blocks float32 inputs
    too: the torch path's arithmetic, for tests."""

    cdef pgd_model model
    cdef pgd_layer *layers
    cdef pgd_buffers buffers
    cdef int64_t num_pages, max_positions
    cdef object keep  # every tensor the pointers point into

    def __cinit__(self):
        self.layers = NULL

    def __init__(self, dims, cos_sin, final_norm, embed, lm_head, layers, exact=False, *, local_cos_sin=None,
                 activation="silu", embed_scale=None, final_softcap=None):
        hidden, heads, kv_heads, head_dim, intermediate, eps, scale = dims
        if not layers or heads % kv_heads or heads // kv_heads > PGD_MAX_GROUP or head_dim > PGD_MAX_HEAD_DIM \
                or head_dim % 2:
            raise ValueError(f"the native decoder does not take {dims} over {len(layers)} layers")
        if activation not in ACTIVATIONS:
            raise ValueError(f"the native decoder has no activation {activation!r}; it has {', '.join(ACTIVATIONS)}")
        caps = [final_softcap] + [spec[14] for spec in layers]
        if any(cap is not None and not cap >= 0 for cap in caps) or (embed_scale is not None and not embed_scale > 0):
            raise ValueError(f"soft-caps and the embedding scale must be positive, not {caps} and {embed_scale}")
        cdef pgd_model *m = &self.model
        cdef pgd_layer *layer
        cdef int64_t widest, t
        m.num_layers, m.hidden, m.num_heads, m.num_kv_heads = len(layers), hidden, heads, kv_heads
        m.head_dim, m.intermediate, m.eps, m.scale = head_dim, intermediate, eps, scale
        m.exact = bool(exact)
        m.act = ACTIVATIONS[activation]
        m.embed_scale = embed_scale or 0.0
        m.final_softcap = final_softcap or 0.0
        self.max_positions = cos_sin.shape[0]
        cdef const float *table = <const float *>_address(cos_sin, torch.float32, (self.max_positions, 2 * head_dim),
                                                           "cos_sin")
        cdef const float *local_table = NULL
        if local_cos_sin is not None:
            local_table = <const float *>_address(local_cos_sin, torch.float32, (self.max_positions, 2 * head_dim),
                                                  "local cos_sin")
        m.final_norm = <const float *>_address(final_norm, torch.float32, (hidden,), "final norm")
        vocab = embed[1].shape[0]
        m.embed = _linear(embed, hidden, vocab, "embedding")
        m.lm_head = _linear(lm_head, hidden, lm_head[1].shape[0], "lm_head")
        self.layers = <pgd_layer *>malloc(len(layers) * sizeof(pgd_layer))
        if self.layers == NULL:
            raise MemoryError()
        m.layers = self.layers
        q, kv = heads * head_dim, kv_heads * head_dim
        first_cache = layers[0][6]
        self.num_pages, m.block_size = first_cache.shape[0], first_cache.shape[1]
        kv_format = format_of(first_cache)
        m.kv_format = FORMAT_CODES[kv_format.dtype]
        m.kv_row_bytes = pg_row_bytes(m.kv_format, head_dim)
        cache_shape = (self.num_pages, m.block_size, kv_heads, kv_format.row_width(head_dim))
        for i, (attn_norm, ffn_norm, qkv, o, gate_up, down, k_cache, v_cache, window, q_norm, k_norm,
                post_attn_norm, post_ffn_norm, local_rope, softcap) in enumerate(layers):
            layer = &self.layers[i]
            layer.attn_norm = <const float *>_address(attn_norm, torch.float32, (hidden,), "attention norm")
            layer.ffn_norm = <const float *>_address(ffn_norm, torch.float32, (hidden,), "MLP norm")
            layer.q_norm = _optional(q_norm, head_dim, f"layer {i} q norm")
            layer.k_norm = _optional(k_norm, head_dim, f"layer {i} k norm")
            layer.post_attn_norm = _optional(post_attn_norm, hidden, f"layer {i} post-attention norm")
            layer.post_ffn_norm = _optional(post_ffn_norm, hidden, f"layer {i} post-MLP norm")
            if local_rope and local_table == NULL:
                raise ValueError(f"layer {i} asks for the local RoPE table, and there is none")
            layer.cos_sin = local_table if local_rope else table
            layer.softcap = softcap or 0.0
            layer.qkv = _linear(qkv, hidden, q + 2 * kv, f"layer {i} qkv")
            layer.o = _linear(o, q, hidden, f"layer {i} o_proj")
            layer.gate_up = _linear(gate_up, hidden, 2 * intermediate, f"layer {i} gate_up")
            layer.down = _linear(down, intermediate, hidden, f"layer {i} down_proj")
            layer.k_cache = <uint8_t *>_address(k_cache, kv_format.dtype, cache_shape, "k cache")
            layer.v_cache = <uint8_t *>_address(v_cache, kv_format.dtype, cache_shape, "v cache")
            layer.window = window or 0
        widest, t = max(hidden, intermediate, q), PGD_MAX_TOKENS
        buffers = (torch.empty(t * widest), torch.empty(t * (q + 2 * kv)), torch.empty(t * 2 * intermediate),
                   torch.empty(t * widest, dtype=torch.int8), torch.empty(t * widest // 32 * 3), torch.empty(t * hidden),
                   torch.empty(t * PGD_MAX_PARTS * heads * (head_dim + 2)))
        self.buffers.normed = <float *><size_t>buffers[0].data_ptr()
        self.buffers.qkv = <float *><size_t>buffers[1].data_ptr()
        self.buffers.gate_up = <float *><size_t>buffers[2].data_ptr()
        self.buffers.branch = <float *><size_t>buffers[5].data_ptr()
        self.buffers.attn_parts = <float *><size_t>buffers[6].data_ptr()
        self.buffers.act.q = <int8_t *><size_t>buffers[3].data_ptr()
        self.buffers.act.d = <float *><size_t>buffers[4].data_ptr()
        self.buffers.act.s = self.buffers.act.d + t * widest // 32
        self.keep = (cos_sin, local_cos_sin, final_norm, embed, lm_head, layers, buffers)

    def __dealloc__(self):
        free(self.layers)

    def forward(self, const int64_t[::1] ids, const int64_t[::1] positions, const int64_t[::1] slots,
                const int32_t[:, ::1] block_tables, const int32_t[::1] seq_lens, const int32_t[::1] query_start):
        """Final hidden states [T, hidden] (float32) of the step's tokens; their K and V go to their slots."""
        cdef pgd_step s
        s.tokens, s.seqs = ids.shape[0], seq_lens.shape[0]
        if s.tokens < 1 or s.seqs < 1:
            raise ValueError(_STEP_ERRORS[1])
        if positions.shape[0] != s.tokens or slots.shape[0] != s.tokens or query_start.shape[0] != s.seqs + 1 \
                or block_tables.shape[0] < s.seqs:
            raise ValueError("the step's arrays disagree on the number of tokens or sequences")
        s.positions, s.slots, s.seq_lens, s.query_start = &positions[0], &slots[0], &seq_lens[0], &query_start[0]
        s.block_tables, s.table_width = &block_tables[0, 0], block_tables.shape[1]
        cdef int error = pgd_check(&self.model, &s, &ids[0], self.num_pages, self.max_positions)
        if error:
            raise ValueError(_STEP_ERRORS[error])
        out = torch.empty((s.tokens, self.model.hidden))
        cdef float *x = <float *><size_t>out.data_ptr()
        cdef int threads = torch.get_num_threads()
        with nogil:
            pgd_forward(&self.model, &s, &ids[0], x, &self.buffers, threads)
        return out

    def logits(self, hidden):
        """Float32 logits [N, vocab] of final hidden states [N, hidden]."""
        hidden = hidden.float().contiguous()
        cdef int64_t n = hidden.shape[0], start
        cdef int rows
        cdef int threads = torch.get_num_threads()
        out = torch.empty((n, self.model.lm_head.n))
        _address(hidden, torch.float32, (n, self.model.hidden), "hidden")
        cdef const float *x = <const float *><size_t>hidden.data_ptr()
        cdef float *o = <float *><size_t>out.data_ptr()
        for start in range(0, n, PGD_MAX_TOKENS):
            rows = min(PGD_MAX_TOKENS, n - start)
            with nogil:
                pgd_logits(&self.model, x + start * self.model.hidden, rows, o + start * self.model.lm_head.n,
                           &self.buffers, threads)
        return out
