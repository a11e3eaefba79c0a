# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""A Llama-family decoder's forward pass over a few tokens, in C (cpu_decode.h): one OpenMP parallel
region walks every layer, so a decode step costs no Python and no thread start per op. Qwen3's QK-norm
and Gemma 2 / 3's block (post-attention and post-MLP norms, GeGLU, the scaled embedding, soft-capped
attention scores and logits, a local RoPE table on the sliding layers) are options of the same graph.

`DecodeModel` holds pointers into the model's own tensors (weights in float rows or GGUF blocks,
norms, the rotary table) and the KV pages; it copies nothing, and the tensors must outlive it.
Linear layers in integer blocks take their input in Q8 (llama.cpp's arithmetic, cpu_qdot.h);
float32 and float16 weights take it in float32, as pagegate.kernels.cpu_quant.matmul does.

`LoRATable` holds LoRA adapters in slots (cpu_lora.h): a step's tokens grouped by slot get each adapter's
low-rank update after every projection's base matmul, on the native step (`DecodeModel.forward(lora=...)`) or one
projection at a time for the torch forward (`LoRATable.add`).
"""

from libc.stdint cimport int8_t, int32_t, int64_t, uint8_t
from libc.stdlib cimport calloc, free, malloc
from libc.string cimport memset

from pagegate.kernels.cpu_qdot cimport PGQ_SUMS, pgq_act, pgq_init, pgq_isa, pgq_set_isa

import numpy as np

from pagegate.kernels.cpu_quant import BLOCK_BYTES, BLOCK_ELEMS
from pagegate.kernels.dispatch import default_threads
from pagegate.kernels.page_codes import FORMAT_CODES

cdef extern from "cpu_paged.h":
    int64_t pg_row_bytes(int format, int head_dim) noexcept nogil

cdef extern from "cpu_lora.h":
    ctypedef struct pgl_shard:
        int first_col, cols, first_rank, ranks
        const float *expand
    ctypedef struct pgl_update:
        const float *shrink
        int rank, shards
        pgl_shard shard[3]
    ctypedef struct pgl_table:
        int slots, layers, max_rank
        pgl_update *updates
    ctypedef struct pgl_groups:
        int count
        const int32_t *slot
        const int32_t *start
        const int32_t *token
        float *shrunk
    enum:
        PGL_PROJS
        PGL_MAX_SHARDS
    int pgl_set_isa(int portable) noexcept nogil
    void pgl_add_parallel(const pgl_table *table, const pgl_groups *g, int layer, int proj, const float *x, int64_t k,
                          float *out, int64_t out_stride, int threads) noexcept nogil

cdef extern from "cpu_decode.h":
    ctypedef struct pgd_linear:
        int qtype
        const uint8_t *data
        int64_t row_bytes, n, k
        const float *bias
        const pgd_linear *rest
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
        int kv_format
        int64_t kv_row_bytes
        const float *cos_sin
        int window
        float softcap
    ctypedef struct pgd_model:
        int num_layers, hidden, num_heads, num_kv_heads, head_dim, intermediate, block_size
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
        const pgl_table *lora
        pgl_groups lora_groups
        int num_given
        const int32_t *given_tokens
        const float *given
        const int64_t *key_ends
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
        PGD_SPLIT_STATES
    void pgd_forward(const pgd_model *m, const pgd_step *s, const int64_t *ids, float *x, pgd_buffers *b,
                     int threads) noexcept nogil
    void pgd_logits(const pgd_model *m, const float *x, int rows, float *logits, pgd_buffers *b,
                    int threads) noexcept nogil
    int pgd_check(const pgd_model *m, const pgd_step *s, const int64_t *ids, int64_t num_pages,
                  int64_t max_positions) noexcept nogil

pgq_init()

MAX_TOKENS = PGD_MAX_TOKENS  # tokens one forward takes (NativeDecoder cuts longer steps)
_STEP_ERRORS = {1: "the step needs 1 to {} tokens in sequences that cover them".format(PGD_MAX_TOKENS),
                2: "a token id, position or cache slot is out of range",
                3: "a sequence's length or page count does not fit its block table",
                4: "a block table names a page outside the cache",
                5: "a token's key end is before its position or past its sequence's keys in the step"}


ACTIVATIONS = {"silu": PGD_SILU, "gelu_tanh": PGD_GELU_TANH}  # the gated MLP's activations


def _isa() -> str:
    """The integer dot products' instruction set here (dispatch.integer_isa)."""
    return pgq_isa.decode()


def _set_isa(name: str) -> bool:
    """dispatch.set_integer_isa for this module."""
    return bool(pgq_set_isa(name.encode()))


def set_lora_isa(name: str) -> bool:
    """Run the LoRA updates on "avx2" (the default where the CPU has it) or "portable" C; False if unavailable."""
    if name not in ("avx2", "portable"):
        raise ValueError(f"the LoRA updates run on avx2 or portable, not {name!r}")
    return bool(pgl_set_isa(name == "portable"))


cdef size_t _address(t, str dtype, shape, what) except? 0:
    """The data of `t`, a contiguous CPU array of `dtype` ("float32", "uint8", ...) and `shape`: a numpy array or a
    torch tensor (duck-typed: nothing here imports torch)."""
    cdef bint torch_tensor = hasattr(t, "data_ptr")
    name = str(t.dtype).removeprefix("torch.")
    contiguous = t.is_contiguous() and t.device.type == "cpu" if torch_tensor else t.flags.c_contiguous
    if name != dtype or tuple(t.shape) != tuple(shape) or not contiguous:
        raise ValueError(f"{what} must be a contiguous CPU {dtype} array of shape {tuple(shape)}, "
                         f"not {name} {tuple(t.shape)}")
    return <size_t>(t.data_ptr() if torch_tensor else t.ctypes.data)


cdef size_t _cache_address(t, shape, what) except? 0:
    """A KV cache's data: any one format's array [pages, block, kv_heads, row] whose rows are `shape`[-1] bytes."""
    itemsize = t.element_size() if hasattr(t, "data_ptr") else t.itemsize
    if len(t.shape) != 4 or tuple(t.shape[:3]) != tuple(shape[:3]) or t.shape[3] * itemsize != shape[3]:
        raise ValueError(f"{what} must be [pages, block, kv_heads, row] of {tuple(shape)} bytes, not {tuple(t.shape)}")
    return _address(t, str(t.dtype).removeprefix("torch."), tuple(t.shape), what)


cdef pgd_linear _linear(spec, int64_t k, int64_t n, what) except *:
    """(qtype, rows, bias): rows uint8 [n, row bytes], float rows (F32, F16, BF16, or any of them in panels) viewed
    as bytes or blocks; F32 rows and panels may be of any length, the others are whole blocks."""
    qtype, rows, bias = spec
    if qtype not in BLOCK_BYTES or (qtype != 0 and k % BLOCK_ELEMS[qtype]):
        raise ValueError(f"{what}: ggml type {qtype} does not fit rows of {k}")
    cdef pgd_linear l
    l.qtype, l.n, l.k, l.rest = qtype, n, k, NULL
    l.row_bytes = k * BLOCK_BYTES[qtype] // BLOCK_ELEMS[qtype]
    l.data = <const uint8_t *>_address(rows, "uint8", (n, l.row_bytes), f"{what} weight")
    l.bias = NULL if bias is None else <const float *>_address(bias, "float32", (n,), f"{what} bias")
    return l


cdef pgd_linear _linear_parts(spec, int64_t k, int64_t n, what, pgd_linear *rest) except *:
    """_linear, or for a list of such triples (a layer's rows part after part, in different types) its first part,
    the others written to rest (len(spec) - 1 of them) and chained after it."""
    if not isinstance(spec, list):
        return _linear(spec, k, n, what)
    if sum(part[1].shape[0] for part in spec) != n:
        raise ValueError(f"{what}: parts of {[part[1].shape[0] for part in spec]} rows, not {n} in all")
    cdef pgd_linear first = _linear(spec[0], k, spec[0][1].shape[0], f"{what} part 0")
    cdef pgd_linear *previous = &first
    cdef int i
    for i in range(1, len(spec)):
        rest[i - 1] = _linear(spec[i], k, spec[i][1].shape[0], f"{what} part {i}")
        previous.rest = &rest[i - 1]
        previous = &rest[i - 1]
    return first


cdef const float *_optional(t, int64_t n, what) except? NULL:
    """The float32 [n] vector t, or NULL for None."""
    return NULL if t is None else <const float *>_address(t, "float32", (n,), what)


PROJECTIONS = ("qkv", "o", "gate_up", "down")  # a layer's projections that take adapters, in the table's order


cdef class LoRATable:
    """LoRA adapters in `slots` slots over a model's layers: a slot's update of one projection is a float32 shrink
    A [rank, in] (the packed shards' A stacked) and, per shard, its expand: B with the scale folded in, transposed
    [ranks, cols], with the shard's first output column and first rank. `shapes` gives each layer's (in, out) of its
    PROJECTIONS; `max_rank` the widest shrink a slot may hold. The table keeps the tensors it points into until
    their slot is cleared.

    A step's adapted tokens come as groups (slot, start, token), three int32 arrays: group i is the tokens
    token[start[i]:start[i + 1]] of adapter slot[i]; each token at most once, base tokens in none."""

    cdef pgl_table table
    cdef list shapes
    cdef public int threads  # the threads `add` takes (default_threads(); the torch forward sets torch's)
    cdef list keep  # per slot: {(layer, projection): the tensors its update points into}

    def __cinit__(self):
        self.table.updates = NULL

    def __init__(self, int slots, shapes, int max_rank):
        if slots < 1 or max_rank < 1 or not shapes or any(len(layer) != PGL_PROJS for layer in shapes):
            raise ValueError(f"a LoRA table needs slots, a rank and ({', '.join(PROJECTIONS)}) shapes per layer")
        self.shapes = [tuple((int(k), int(n)) for k, n in layer) for layer in shapes]
        self.table.slots, self.table.layers, self.table.max_rank = slots, len(shapes), max_rank
        self.table.updates = <pgl_update *>calloc(slots * len(shapes) * PGL_PROJS, sizeof(pgl_update))
        if self.table.updates == NULL:
            raise MemoryError()
        self.keep = [{} for _ in range(slots)]
        self.threads = default_threads()

    def __dealloc__(self):
        free(self.table.updates)

    @property
    def slots(self) -> int:
        return self.table.slots

    @property
    def max_rank(self) -> int:
        return self.table.max_rank

    def layer_shapes(self) -> list:
        """Each layer's (in, out) of its PROJECTIONS."""
        return list(self.shapes)

    cdef pgl_update *_update(self, int slot, int layer, int proj) except NULL:
        if not (0 <= slot < self.table.slots and 0 <= layer < self.table.layers and 0 <= proj < PGL_PROJS):
            raise IndexError(f"no LoRA slot {slot}, layer {layer}, projection {proj}")
        return &self.table.updates[(<int64_t>slot * self.table.layers + layer) * PGL_PROJS + proj]

    def set(self, int slot, int layer, int proj, shrink, shards):
        """Slot `slot`'s update of projection PROJECTIONS[proj] of `layer`: shrink [rank, in] and shards, each
        (first column, first rank, expand [ranks, cols]) inside the projection's output and the shrink's ranks."""
        cdef pgl_update *update = self._update(slot, layer, proj)
        k, n = self.shapes[layer][proj]
        rank = shrink.shape[0] if len(shrink.shape) == 2 else 0
        if not 1 <= rank <= self.table.max_rank or not 1 <= len(shards) <= PGL_MAX_SHARDS:
            raise ValueError(f"a LoRA update takes a shrink of rank 1 to {self.table.max_rank} and 1 to "
                             f"{PGL_MAX_SHARDS} shards, not {tuple(shrink.shape)} and {len(shards)}")
        cdef pgl_update made
        memset(&made, 0, sizeof(pgl_update))
        made.shrink = <const float *>_address(shrink, "float32", (rank, k), "LoRA shrink")
        made.rank, made.shards = rank, len(shards)
        for i, (first_col, first_rank, expand) in enumerate(shards):
            ranks, cols = expand.shape if len(expand.shape) == 2 else (0, 0)
            if not (0 <= first_col and 1 <= cols and first_col + cols <= n and 0 <= first_rank and 1 <= ranks
                    and first_rank + ranks <= rank):
                raise ValueError(f"a LoRA expand {tuple(expand.shape)} at column {first_col}, rank {first_rank} "
                                 f"does not fit a projection of {n} outputs and a shrink of rank {rank}")
            made.shard[i].expand = <const float *>_address(expand, "float32", (ranks, cols), "LoRA expand")
            made.shard[i].first_col, made.shard[i].cols = first_col, cols
            made.shard[i].first_rank, made.shard[i].ranks = first_rank, ranks
        spans = sorted((made.shard[i].first_col, made.shard[i].cols) for i in range(made.shards))
        if any(first + cols > next_first for (first, cols), (next_first, _) in zip(spans, spans[1:])):
            raise ValueError(f"LoRA shards overlap in their columns: {spans}")  # their threads would race
        update[0] = made
        self.keep[slot][layer, proj] = (shrink, shards)

    def clear(self, int slot):
        """Empty slot `slot`: its tokens would run on the base."""
        for layer in range(self.table.layers):
            for proj in range(PGL_PROJS):
                memset(self._update(slot, layer, proj), 0, sizeof(pgl_update))
        self.keep[slot] = {}

    cdef _groups(self, groups, int tokens, pgl_groups *g):
        """Fill g from (slot, start, token) after checking them against the table and a step of `tokens`."""
        cdef const int32_t[::1] slot = groups[0]
        cdef const int32_t[::1] start = groups[1]
        cdef const int32_t[::1] token = groups[2]
        cdef int count = slot.shape[0], i, j
        if start.shape[0] != count + 1 or (count and (start[0] != 0 or start[count] != token.shape[0])):
            raise ValueError("LoRA groups: start must run from 0 to the number of tokens, one more than the slots")
        seen = bytearray(tokens)
        for i in range(count):
            if not 0 <= slot[i] < self.table.slots or start[i + 1] < start[i]:
                raise ValueError(f"LoRA group {i}: slot {slot[i]} or its tokens are out of range")
            for j in range(start[i], start[i + 1]):
                if not 0 <= token[j] < tokens or seen[token[j]]:
                    raise ValueError(f"LoRA group {i}: token {token[j]} is out of range or in another group")
                seen[token[j]] = 1
        g.count = count
        g.slot = &slot[0] if count else NULL
        g.start = &start[0]
        g.token = &token[0] if token.shape[0] else NULL
        g.shrunk = NULL

    def add(self, int layer, int proj, x, out, groups):
        """out [T, out] += each grouped token's update of projection PROJECTIONS[proj] of `layer`, in place; x [T, in]
        the projection's input (float32, contiguous)."""
        self._update(0, layer, proj)
        cdef int64_t k = self.shapes[layer][proj][0], n = self.shapes[layer][proj][1]
        cdef int64_t tokens = x.shape[0]
        cdef const float *xs = <const float *>_address(x, "float32", (tokens, k), "LoRA input")
        cdef float *o = <float *>_address(out, "float32", (tokens, n), "LoRA output")
        cdef pgl_groups g
        self._groups(groups, tokens, &g)
        if not g.count:
            return
        cdef int threads = self.threads
        g.shrunk = <float *>malloc(tokens * self.table.max_rank * sizeof(float))
        if g.shrunk == NULL:
            raise MemoryError()
        with nogil:
            pgl_add_parallel(&self.table, &g, layer, proj, xs, k, o, n, threads)
        free(g.shrunk)


cdef class DecodeModel:
    """The decoder of one model over its KV pages; `forward` runs a step, `logits` the LM head.

    dims: (hidden, heads, kv_heads, head_dim, intermediate, eps, scale); linears are
    (qtype, rows, bias) triples, rows the weight's bytes [N, row bytes] (a layer's projection whose rows come in
    parts of different types: a list of triples, part after part); each layer is (attn_norm, ffn_norm,
    qkv, o, gate_up, down, k_cache, v_cache, window, q_norm, k_norm, post_attn_norm, post_ffn_norm, local_rope,
    softcap, page_format) with caches [pages, block_size, kv_heads, row] of a page format each (its name, kv_format.py):
    ffn_norm the norm before the MLP;
    q_norm and k_norm [head_dim] (QK-norm) and the post-norms [hidden] (Gemma) None where the layer has
    none; local_rope True for a layer on `local_cos_sin` rather than `cos_sin`; softcap the attention
    score cap (None or 0: none). `activation` is "silu" (SwiGLU) or "gelu_tanh" (GeGLU), `embed_scale`
    multiplies the embedding, `final_softcap` caps the logits. `exact` gives integer blocks float32 inputs
    too: the torch path's arithmetic, for tests."""

    cdef pgd_model model
    cdef pgd_layer *layers
    cdef pgd_linear *parts  # the parts of the layers' linears after their first (_linear_parts)
    cdef pgd_buffers buffers
    cdef int64_t num_pages, max_positions
    cdef object keep  # every tensor the pointers point into
    cdef object lora_checked  # the last LoRA table found to fit this model's projections
    cdef public int threads  # the threads a step takes (default_threads(); the torch path sets torch's)

    def __cinit__(self):
        self.layers = NULL
        self.parts = NULL

    def __init__(self, dims, cos_sin, final_norm, embed, lm_head, layers, exact=False, *, local_cos_sin=None,
                 activation="silu", embed_scale=None, final_softcap=None, threads=None):
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
        cdef pgd_linear *targets[4]
        m.num_layers, m.hidden, m.num_heads, m.num_kv_heads = len(layers), hidden, heads, kv_heads
        m.head_dim, m.intermediate, m.eps, m.scale = head_dim, intermediate, eps, scale
        m.exact = bool(exact)
        m.act = ACTIVATIONS[activation]
        m.embed_scale = embed_scale or 0.0
        m.final_softcap = final_softcap or 0.0
        self.max_positions = cos_sin.shape[0]
        cdef const float *table = <const float *>_address(cos_sin, "float32", (self.max_positions, 2 * head_dim),
                                                           "cos_sin")
        cdef const float *local_table = NULL
        if local_cos_sin is not None:
            local_table = <const float *>_address(local_cos_sin, "float32", (self.max_positions, 2 * head_dim),
                                                  "local cos_sin")
        m.final_norm = <const float *>_address(final_norm, "float32", (hidden,), "final norm")
        vocab = embed[1].shape[0]
        m.embed = _linear(embed, hidden, vocab, "embedding")
        m.lm_head = _linear(lm_head, hidden, lm_head[1].shape[0], "lm_head")
        self.layers = <pgd_layer *>malloc(len(layers) * sizeof(pgd_layer))
        extra = [len(spec) - 1 if isinstance(spec, list) else 0 for specs in layers for spec in specs[2:6]]
        self.parts = <pgd_linear *>malloc(max(1, sum(extra)) * sizeof(pgd_linear))
        if self.layers == NULL or self.parts == NULL:
            raise MemoryError()
        cdef pgd_linear *rest = self.parts
        m.layers = self.layers
        q, kv = heads * head_dim, kv_heads * head_dim
        first_cache = layers[0][6]
        self.num_pages, m.block_size = first_cache.shape[0], first_cache.shape[1]
        for i, (attn_norm, ffn_norm, qkv, o, gate_up, down, k_cache, v_cache, window, q_norm, k_norm,
                post_attn_norm, post_ffn_norm, local_rope, softcap, page_format) in enumerate(layers):
            layer = &self.layers[i]
            layer.attn_norm = <const float *>_address(attn_norm, "float32", (hidden,), "attention norm")
            layer.ffn_norm = <const float *>_address(ffn_norm, "float32", (hidden,), "MLP norm")
            layer.q_norm = _optional(q_norm, head_dim, f"layer {i} q norm")
            layer.k_norm = _optional(k_norm, head_dim, f"layer {i} k norm")
            layer.post_attn_norm = _optional(post_attn_norm, hidden, f"layer {i} post-attention norm")
            layer.post_ffn_norm = _optional(post_ffn_norm, hidden, f"layer {i} post-MLP norm")
            if local_rope and local_table == NULL:
                raise ValueError(f"layer {i} asks for the local RoPE table, and there is none")
            layer.cos_sin = local_table if local_rope else table
            layer.softcap = softcap or 0.0
            targets[0], targets[1], targets[2], targets[3] = &layer.qkv, &layer.o, &layer.gate_up, &layer.down
            for j, (spec, k, n, name) in enumerate(((qkv, hidden, q + 2 * kv, "qkv"), (o, q, hidden, "o_proj"),
                                                    (gate_up, hidden, 2 * intermediate, "gate_up"),
                                                    (down, intermediate, hidden, "down_proj"))):
                targets[j][0] = _linear_parts(spec, k, n, f"layer {i} {name}", rest)
                rest += len(spec) - 1 if isinstance(spec, list) else 0
            if page_format not in FORMAT_CODES:  # each layer's own: auto-4 mixes int8 and int4
                raise ValueError(f"layer {i}: no page format {page_format!r}")
            layer.kv_format = FORMAT_CODES[page_format]
            layer.kv_row_bytes = pg_row_bytes(layer.kv_format, head_dim)
            cache_shape = (self.num_pages, m.block_size, kv_heads, layer.kv_row_bytes)
            layer.k_cache = <uint8_t *>_cache_address(k_cache, cache_shape, "k cache")
            layer.v_cache = <uint8_t *>_cache_address(v_cache, cache_shape, "v cache")
            layer.window = window or 0
        widest, t = max(hidden, intermediate, q), PGD_MAX_TOKENS
        f32 = np.float32
        buffers = (np.empty(t * widest, f32), np.empty(t * (q + 2 * kv), f32), np.empty(t * 2 * intermediate, f32),
                   np.empty(t * widest, np.int8), np.empty(t * widest // 32 * (1 + PGQ_SUMS), f32),
                   np.empty(t * hidden, f32), np.empty(PGD_SPLIT_STATES * (heads // kv_heads) * (head_dim + 2), f32))
        self.buffers.normed = <float *><size_t>buffers[0].ctypes.data
        self.buffers.qkv = <float *><size_t>buffers[1].ctypes.data
        self.buffers.gate_up = <float *><size_t>buffers[2].ctypes.data
        self.buffers.branch = <float *><size_t>buffers[5].ctypes.data
        self.buffers.attn_parts = <float *><size_t>buffers[6].ctypes.data
        self.buffers.act.q = <int8_t *><size_t>buffers[3].ctypes.data
        self.buffers.act.d = <float *><size_t>buffers[4].ctypes.data
        self.buffers.act.s = self.buffers.act.d + t * widest // 32
        self.keep = (cos_sin, local_cos_sin, final_norm, embed, lm_head, layers, buffers)
        self.threads = threads or default_threads()

    def __dealloc__(self):
        free(self.layers)
        free(self.parts)

    def forward(self, const int64_t[::1] ids, const int64_t[::1] positions, const int64_t[::1] slots,
                const int32_t[:, ::1] block_tables, const int32_t[::1] seq_lens, const int32_t[::1] query_start,
                LoRATable lora=None, lora_groups=None, given=None, const int64_t[::1] key_ends=None):
        """Final hidden states [T, hidden] (float32) of the step's tokens; their K and V go to their slots. With
        `lora` and `lora_groups` (LoRATable's groups), the grouped tokens run with their slots' adapters. `given`:
        (tokens int32 [R], rows float32 [R, hidden]), input rows that replace those tokens' embeddings. `key_ends`
        [T]: the last position each token attends to (its own, or further within the step: an image's tokens)."""
        cdef pgd_step s
        s.lora = NULL
        s.key_ends = NULL
        if key_ends is not None:
            if key_ends.shape[0] != ids.shape[0]:
                raise ValueError("key_ends must give one position per token of the step")
            s.key_ends = &key_ends[0]
        s.lora_groups.count = 0
        s.lora_groups.shrunk = NULL
        cdef const int32_t[::1] given_tokens
        cdef const float[:, ::1] given_rows
        s.num_given = 0
        if given is not None:
            given_tokens, given_rows = given[0], np.asarray(given[1])
            if given_rows.shape[0] != given_tokens.shape[0] or given_rows.shape[1] != self.model.hidden \
                    or given_tokens.shape[0] > ids.shape[0] \
                    or any(not 0 <= t < ids.shape[0] for t in given_tokens):
                raise ValueError("the given input rows are not [tokens of the step, hidden]")
            s.num_given = given_tokens.shape[0]
            if s.num_given:
                s.given_tokens, s.given = &given_tokens[0], &given_rows[0, 0]
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
        if lora is not None and lora_groups is not None:
            self._check_lora(lora)
            lora._groups(lora_groups, s.tokens, &s.lora_groups)
            s.lora = &lora.table
        out = np.empty((s.tokens, self.model.hidden), np.float32)
        cdef float *x = <float *><size_t>out.ctypes.data
        cdef int threads = self.threads
        if s.lora_groups.count:
            s.lora_groups.shrunk = <float *>malloc(s.tokens * lora.table.max_rank * sizeof(float))
            if s.lora_groups.shrunk == NULL:
                raise MemoryError()
        with nogil:
            pgd_forward(&self.model, &s, &ids[0], x, &self.buffers, threads)
        free(s.lora_groups.shrunk)
        return out

    cdef _check_lora(self, LoRATable lora):
        """ValueError unless `lora`'s layers and shapes are this model's."""
        if lora is self.lora_checked:
            return
        cdef const pgd_layer *l
        shapes = []
        for i in range(self.model.num_layers):
            l = &self.model.layers[i]
            shapes.append(((l.qkv.k, l.qkv.n), (l.o.k, l.o.n), (l.gate_up.k, l.gate_up.n), (l.down.k, l.down.n)))
        if lora.layer_shapes() != shapes:
            raise ValueError("the LoRA table's layers and projections are not this model's")
        self.lora_checked = lora

    def logits(self, hidden):
        """Float32 logits [N, vocab] of final hidden states [N, hidden]."""
        hidden = np.ascontiguousarray(hidden, dtype=np.float32)
        cdef int64_t n = hidden.shape[0], start
        cdef int rows
        cdef int threads = self.threads
        out = np.empty((n, self.model.lm_head.n), np.float32)
        cdef const float *x = <const float *>_address(hidden, "float32", (n, self.model.hidden), "hidden")
        cdef float *o = <float *><size_t>out.ctypes.data
        for start in range(0, n, PGD_MAX_TOKENS):
            rows = min(PGD_MAX_TOKENS, n - start)
            with nogil:
                pgd_logits(&self.model, x + start * self.model.hidden, rows, o + start * self.model.lm_head.n,
                           &self.buffers, threads)
        return out
