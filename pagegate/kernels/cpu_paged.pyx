# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""Fused paged attention for CPU caches in every page format (pagegate.kernels.kv_format): reads K/V straight
from their pages, no gather copy; a stored value is converted to float32 in registers as it is loaded.

The work is split into items: a few queries of one sequence and a range of its KV heads. An
item's rows are those queries times the query heads of those KV heads (GQA: each K/V row is read
once for all the query heads that share it). Keys go through in tiles of KEY_TILE, key by key
across the item's heads, so a page is read front to back; an online softmax in float32 folds
each tile in. OpenMP threads take items dynamically, without the GIL.

Decodes (one query) take all KV heads in one item, so their pages stream front to back (with
fewer than 4 decodes per thread, one item per KV head instead, so no thread idles); queries of a
prefill go in tiles of up to ROW_TILE rows per KV head, so each K/V row serves many queries. The
K/V rows a tile needs are prefetched a little ahead: pages are scattered, so the hardware
prefetcher alone stalls at every page.

Semantics are those of pagegate.kernels.reference.paged_attention: query i of a sequence with
seq_len context tokens and q_len queries sits at position seq_len - q_len + i and sees keys
k <= that position (and, with a sliding window, position - k < window). A soft-cap (Gemma 2)
turns each scaled score s into softcap * tanh(s / softcap) before the mask and the softmax.
"""

from cython.parallel cimport prange, threadid
from libc.math cimport INFINITY, expf, isfinite
from libc.stdint cimport int32_t, int64_t, uint8_t, uintptr_t
from libc.stdlib cimport free, malloc

import torch

from pagegate.kernels.kv_format import FORMATS, format_of, head_dim_of

# Keys per online-softmax step (one tile), the rows (queries x query heads) a prefill item aims
# for, and how far ahead of use the K/V rows are asked for: a tile's scores and accumulators stay
# in L1/L2 while its K/V rows stream by.
cdef enum:
    KEY_TILE = 128
    ROW_TILE = 32
    PREFETCH_BYTES = 2048

cdef extern from "cpu_paged.h":
    int64_t pg_row_bytes(int format, int head_dim) noexcept nogil
    enum: PG_MAX_HEAD_DIM
    enum: PG_MAX_AHEAD
    int pg_ahead(int64_t prefetch_bytes, int64_t row_bytes) noexcept nogil
    void pg_slots(const int32_t *table, int block_size, int64_t slot_stride, int first, int count, int total,
                  int64_t *slot) noexcept nogil
    void pg_store_row(int format, const float *x, int head_dim, uint8_t *dst) noexcept nogil
    void pg_scale(float *y, float a, int n) noexcept nogil
    void pg_softcap(float *y, float a, float cap, int n) noexcept nogil
    float pg_exp_sum(float *p, int n, float max) noexcept nogil
    float pg_max(const float *p, int n) noexcept nogil
    void pg_score_tile(int format, const uint8_t *keys, const int64_t *slot, int num_keys, const float **query_row,
                       const int64_t *head_offset, int rows, int head_dim, int ahead, float *scores,
                       int stride) noexcept nogil
    void pg_accumulate_tile(int format, const uint8_t *values, const int64_t *slot, int num_keys,
                            const float *weights, int stride, const int64_t *head_offset, int rows, int head_dim,
                            int ahead, float *acc) noexcept nogil

cdef enum:
    SLOTS = KEY_TILE + PG_MAX_AHEAD + 4  # a tile's keys and those it prefetches (pg_slots)

MAX_HEAD_DIM = PG_MAX_HEAD_DIM  # of the formats converted as they are read

# each format's code in cpu_paged.h (PG_F32 ...), by the cache tensor's dtype
FORMAT_CODES = {FORMATS[name].dtype: code for code, name in
                enumerate(("float32", "float16", "bfloat16", "int8", "fp8_e4m3", "fp8_e5m2", "int4"))}


cdef struct Problem:
    # what every item reads and writes; strides count float elements
    const float *query
    int64_t q_token_stride, q_head_stride
    float *out
    int64_t out_token_stride, out_head_stride
    const uint8_t *k_cache
    const uint8_t *v_cache
    int format  # the pages' PG_ code
    int64_t row_bytes  # of one (slot, KV head) row: values and a one-byte format's scale
    const int32_t *block_tables
    int64_t table_width
    const int32_t *seq_lens
    const int32_t *query_start
    int num_heads, num_kv_heads, head_dim, block_size
    float scale
    float softcap  # 0: no soft-cap
    int window  # 0: no sliding window


cdef struct Item:
    # queries first..first+count-1 of sequence seq, with the query heads of KV heads
    # kv_first..kv_first+kv_count-1; row r is query r // (kv_count * group), head r % (kv_count * group)
    int seq, first, count, kv_first, kv_count


cdef struct Scratch:
    # one thread's buffers, reused for every item it takes
    float *acc      # [rows, head_dim] unnormalised output
    float *row_max  # [rows] running max score
    float *row_sum  # [rows] running sum of exp(score - max)
    float *probs    # [rows, KEY_TILE] scores, then their exp
    const float **query_row  # [rows] each row's query vector
    int64_t *head_offset     # [rows] byte offset of the row's KV head within a cache slot
    int64_t *slot_offset     # [SLOTS] byte offset of each key's slot in the caches


def supports(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """True when this kernel can run the call: CPU tensors, a float32 query, caches of one page format,
    and no gradient wanted (the kernel records none; the torch path does)."""
    return (query.device.type == "cpu" and k_cache.device.type == "cpu" and query.dtype == torch.float32
            and k_cache.dtype == v_cache.dtype and k_cache.dtype in FORMAT_CODES
            and (k_cache.dtype == torch.float32 or head_dim_of(k_cache) <= MAX_HEAD_DIM)  # converted on the stack
            and not (torch.is_grad_enabled() and query.requires_grad))


def write_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """reference.write_kv for caches `supports` accepts, byte for byte: each (token, KV head) row is stored in
    the caches' format by the C the native decode step writes with (slot -1 is padding, skipped)."""
    if not (k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.shape == v_cache.shape):
        raise ValueError("write_kv needs contiguous caches of one shape")
    head_dim = head_dim_of(k_cache)
    if key.shape != value.shape or key.dim() != 3 or tuple(key.shape[1:]) != (k_cache.shape[2], head_dim):
        raise ValueError(f"key/value {tuple(key.shape)} do not fit caches {tuple(k_cache.shape)}")
    slots = slot_mapping.to(device="cpu", dtype=torch.int64).contiguous()
    if slots.shape[0] != key.shape[0]:
        raise ValueError(f"{slots.shape[0]} slots for {key.shape[0]} tokens")
    num_slots = k_cache.shape[0] * k_cache.shape[1]
    if slots.numel() and (int(slots.max()) >= num_slots or int(slots.min()) < -1):
        raise ValueError(f"a slot lies outside the cache's {num_slots} slots")
    keys, values = (t.to(torch.float32).contiguous() for t in (key, value))
    cdef int format = FORMAT_CODES[format_of(k_cache).dtype], d = head_dim
    cdef int64_t row_bytes = pg_row_bytes(format, d), heads = key.shape[1], tokens = key.shape[0], t, h
    cdef const int64_t *slot = <const int64_t *><uintptr_t>slots.data_ptr()
    cdef const float *k_rows = <const float *><uintptr_t>keys.data_ptr()
    cdef const float *v_rows = <const float *><uintptr_t>values.data_ptr()
    cdef uint8_t *k_out = <uint8_t *><uintptr_t>k_cache.data_ptr()
    cdef uint8_t *v_out = <uint8_t *><uintptr_t>v_cache.data_ptr()
    with nogil:
        for t in range(tokens):
            if slot[t] < 0:
                continue
            for h in range(heads):
                pg_store_row(format, k_rows + (t * heads + h) * d, d, k_out + (slot[t] * heads + h) * row_bytes)
                pg_store_row(format, v_rows + (t * heads + h) * d, d, v_out + (slot[t] * heads + h) * row_bytes)


def paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                    scale: float, sliding_window: int | None = None, *, softcap: float | None = None,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """Same contract as reference.paged_attention (query [T, H, D] -> [T, H, D]), for inputs
    `supports` accepts; runs on torch's intra-op thread count with the GIL released."""
    if query.stride(-1) != 1:
        query = query.contiguous()
    k_cache, v_cache = k_cache.contiguous(), v_cache.contiguous()
    block_tables, seq_lens, query_start_loc = (
        t.to(device="cpu", dtype=torch.int32).contiguous() for t in (block_tables, seq_lens, query_start_loc))
    out = torch.empty_like(query) if out is None else out
    # the kernel writes float32 rows with contiguous head_dim; anything else goes through a copy
    target = out if out.dtype == torch.float32 and out.stride(-1) == 1 else torch.empty_like(query)
    cdef Problem p = _problem(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
                              target, scale, sliding_window, softcap)
    cdef int num_seqs = seq_lens.shape[0]
    _check(&p, num_seqs, query.shape[0], k_cache.shape[0])
    cdef int num_threads = torch.get_num_threads()
    cdef int status
    with nogil:
        status = _run(&p, num_seqs, num_threads)
    if status != 0:
        raise MemoryError("no memory for paged attention's work list")
    if target is not out:
        out.copy_(target)
    return out


cdef Problem _problem(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, out, scale,
                      sliding_window, softcap) except *:
    """Raw pointers and sizes of the call (the tensors must outlive the kernel run)."""
    cdef Problem p
    num_heads, num_kv_heads = query.shape[1], k_cache.shape[2]
    if num_heads % num_kv_heads or query.shape[2] != head_dim_of(k_cache) or k_cache.shape != v_cache.shape:
        raise ValueError(f"query {tuple(query.shape)} does not fit caches {tuple(k_cache.shape)}")
    if out.shape != query.shape:
        raise ValueError(f"out {tuple(out.shape)} must have the query's shape {tuple(query.shape)}")
    if block_tables.dim() != 2 or query_start_loc.shape[0] != seq_lens.shape[0] + 1:
        raise ValueError("block_tables must be [B, W] and query_start_loc [B + 1] for seq_lens [B]")
    p.query = <const float *><uintptr_t>query.data_ptr()
    p.q_token_stride, p.q_head_stride = query.stride(0), query.stride(1)
    p.out = <float *><uintptr_t>out.data_ptr()
    p.out_token_stride, p.out_head_stride = out.stride(0), out.stride(1)
    p.k_cache = <const uint8_t *><uintptr_t>k_cache.data_ptr()
    p.v_cache = <const uint8_t *><uintptr_t>v_cache.data_ptr()
    p.format = FORMAT_CODES[format_of(k_cache).dtype]
    p.row_bytes = pg_row_bytes(p.format, query.shape[2])
    p.block_tables = <const int32_t *><uintptr_t>block_tables.data_ptr()
    p.table_width = block_tables.shape[1]
    p.seq_lens = <const int32_t *><uintptr_t>seq_lens.data_ptr()
    p.query_start = <const int32_t *><uintptr_t>query_start_loc.data_ptr()
    p.num_heads, p.num_kv_heads = num_heads, num_kv_heads
    p.head_dim, p.block_size = query.shape[2], k_cache.shape[1]
    p.scale = scale
    p.softcap = 0 if softcap is None else softcap
    p.window = 0 if sliding_window is None else sliding_window
    return p


cdef void _check(const Problem *p, int num_seqs, int64_t num_tokens, int64_t num_blocks) except *:
    """Refuse metadata that would make the kernel read outside its tensors (the torch path would
    raise an index error there; here it would be a crash)."""
    cdef int b, page, num_pages, q_len, seq_len
    cdef int32_t block
    if p.window < 0:
        raise ValueError(f"sliding_window must be positive, got {p.window}")
    if not (p.softcap >= 0 and isfinite(p.softcap)):
        raise ValueError(f"softcap must be a positive number (or None/0 for none), got {p.softcap}")
    if p.query_start[0] < 0 or p.query_start[num_seqs] > num_tokens:
        raise ValueError("query_start_loc points outside the query")
    for b in range(num_seqs):
        seq_len, q_len = p.seq_lens[b], p.query_start[b + 1] - p.query_start[b]
        num_pages = (seq_len + p.block_size - 1) // p.block_size
        if q_len < 0 or q_len > seq_len or num_pages > p.table_width:
            raise ValueError(f"sequence {b}: {q_len} queries over {seq_len} tokens do not fit its block table")
        for page in range(num_pages):
            block = p.block_tables[b * p.table_width + page]
            if block < 0 or block >= num_blocks:
                raise ValueError(f"sequence {b}: page {page} is block {block}, outside the cache")


cdef int _run(const Problem *p, int num_seqs, int num_threads) noexcept nogil:
    """Attend every item on num_threads OpenMP threads, each with its own scratch buffers;
    returns -1 when memory runs out (nothing is computed then)."""
    cdef int num_items = 0
    cdef Item *items = _make_items(p, num_seqs, num_threads, &num_items)
    cdef int rows = max(ROW_TILE, p.num_heads)  # no item has more
    cdef char *memory = NULL
    cdef Scratch *scratch = _new_scratch(num_threads, rows, p.head_dim, &memory)
    cdef int i
    if items != NULL and scratch != NULL:
        for i in prange(num_items, schedule="dynamic", num_threads=num_threads):
            _attend_item(p, &scratch[threadid()], &items[i])
    cdef int status = 0 if items != NULL and scratch != NULL else -1
    free(items)
    free(scratch)
    free(memory)
    return status


cdef Scratch *_new_scratch(int num_threads, int rows, int head_dim, char **memory_out) noexcept nogil:
    """One Scratch per thread, their buffers all in one allocation (returned in memory_out; the
    caller frees both); NULL when out of memory."""
    # pointer-sized arrays first, so every array stays aligned to its type
    cdef size_t pointers = rows * (sizeof(float *) + sizeof(int64_t)) + SLOTS * sizeof(int64_t)
    cdef size_t per_thread = pointers + (rows * head_dim + 2 * rows + rows * KEY_TILE) * sizeof(float)
    cdef Scratch *scratch = <Scratch *>malloc(num_threads * sizeof(Scratch))
    cdef char *memory = <char *>malloc(num_threads * per_thread)
    cdef Scratch *s
    cdef int t
    if scratch == NULL or memory == NULL:
        free(scratch)
        free(memory)
        return NULL
    for t in range(num_threads):
        s = &scratch[t]
        s.query_row = <const float **>(memory + t * per_thread)
        s.head_offset = <int64_t *>(s.query_row + rows)
        s.slot_offset = s.head_offset + rows
        s.acc = <float *>(s.slot_offset + SLOTS)
        s.row_max = s.acc + rows * head_dim
        s.row_sum = s.row_max + rows
        s.probs = s.row_sum + rows
    memory_out[0] = memory
    return scratch


cdef Item *_make_items(const Problem *p, int num_seqs, int num_threads, int *num_items) noexcept nogil:
    """Cut the batch into items (see Item); NULL when out of memory."""
    cdef int group = p.num_heads // p.num_kv_heads
    cdef int b, q_len, num_decodes = 0
    for b in range(num_seqs):
        num_decodes += p.query_start[b + 1] - p.query_start[b] == 1
    # decodes take all KV heads at once, unless too few of them would leave threads idle
    cdef int decode_kv_heads = p.num_kv_heads if num_decodes >= 4 * num_threads else 1
    cdef int query_tile = max(1, ROW_TILE // group)  # prefill queries per item, one KV head each
    cdef int n = 0
    for b in range(num_seqs):
        q_len = p.query_start[b + 1] - p.query_start[b]
        if q_len == 1:
            n += p.num_kv_heads // decode_kv_heads
        elif q_len > 1:
            n += (q_len + query_tile - 1) // query_tile * p.num_kv_heads
    cdef Item *items = <Item *>malloc((n + 1) * sizeof(Item))
    if items == NULL:
        return NULL
    num_items[0] = n
    n = 0
    for b in range(num_seqs):
        q_len = p.query_start[b + 1] - p.query_start[b]
        if q_len == 1:
            n = _add_items(items, n, b, 1, 1, decode_kv_heads, p.num_kv_heads)
        elif q_len > 1:
            n = _add_items(items, n, b, q_len, query_tile, 1, p.num_kv_heads)
    return items


cdef int _add_items(Item *items, int n, int seq, int q_len, int query_tile, int kv_heads_per_item,
                    int num_kv_heads) noexcept nogil:
    """Append sequence seq's items: its queries in tiles of query_tile, times its KV heads in
    runs of kv_heads_per_item (which divides num_kv_heads); returns the new item count."""
    cdef int tile, kv
    for tile in range((q_len + query_tile - 1) // query_tile):
        for kv in range(num_kv_heads // kv_heads_per_item):
            items[n].seq = seq
            items[n].first = tile * query_tile
            items[n].count = min(query_tile, q_len - tile * query_tile)
            items[n].kv_first = kv * kv_heads_per_item
            items[n].kv_count = kv_heads_per_item
            n += 1
    return n


cdef void _attend_item(const Problem *p, Scratch *s, const Item *item) noexcept nogil:
    """All of one item: its rows over every key any of its queries sees, a tile at a time."""
    cdef int rows = _item_rows(p, s, item)
    cdef int q_len = p.query_start[item.seq + 1] - p.query_start[item.seq]
    cdef int first_pos = p.seq_lens[item.seq] - q_len + item.first  # context position of the first query
    cdef int key_end = first_pos + item.count  # keys [key_start, key_end) are seen by some query
    cdef int key_start = 0 if p.window == 0 else max(0, first_pos - p.window + 1)
    cdef int r, tile, tile_start, num_keys
    # prefetch distance in keys: PREFETCH_BYTES of the item's K (or V) rows
    cdef int ahead = pg_ahead(PREFETCH_BYTES, item.kv_count * p.row_bytes)
    for r in range(rows):
        s.row_max[r] = -INFINITY
        s.row_sum[r] = 0
    for r in range(rows * p.head_dim):
        s.acc[r] = 0
    for tile in range((key_end - key_start + KEY_TILE - 1) // KEY_TILE):
        tile_start = key_start + tile * KEY_TILE
        num_keys = min(KEY_TILE, key_end - tile_start)
        pg_slots(p.block_tables + item.seq * p.table_width, p.block_size, p.num_kv_heads * p.row_bytes, tile_start,
                 min(num_keys + ahead, key_end - tile_start), num_keys + ahead + 4, s.slot_offset)
        _score_tile(p, s, rows, num_keys, ahead)
        _mask_tile(p, s, item, first_pos, tile_start, num_keys)
        _softmax_tile(s, rows, p.head_dim, num_keys)
        # weights of keys a row may not see are 0, and their value rows are finite (every key of a
        # tile is a written context position)
        pg_accumulate_tile(p.format, p.v_cache, s.slot_offset, num_keys, s.probs, KEY_TILE, s.head_offset, rows,
                           p.head_dim, ahead, s.acc)
    _write_rows(p, s, item)


cdef int _item_rows(const Problem *p, Scratch *s, const Item *item) noexcept nogil:
    """Fill each row's query pointer and KV-head offset; returns the item's row count."""
    cdef int group = p.num_heads // p.num_kv_heads
    cdef int heads = item.kv_count * group  # query heads per query
    cdef int r, head
    for r in range(item.count * heads):
        head = item.kv_first * group + r % heads
        s.query_row[r] = (p.query + (p.query_start[item.seq] + item.first + r // heads) * p.q_token_stride
                          + head * p.q_head_stride)
        s.head_offset[r] = head // group * p.row_bytes
    return item.count * heads


cdef void _score_tile(const Problem *p, Scratch *s, int rows, int num_keys, int ahead) noexcept nogil:
    """probs[r, j] = scale * q_r . k_j for every row and key of the tile, soft-capped when asked."""
    cdef int r
    pg_score_tile(p.format, p.k_cache, s.slot_offset, num_keys, s.query_row, s.head_offset, rows, p.head_dim, ahead,
                  s.probs, KEY_TILE)
    if p.softcap > 0:
        for r in range(rows):
            pg_softcap(s.probs + r * KEY_TILE, p.scale / p.softcap, p.softcap, num_keys)
        return
    for r in range(rows):
        pg_scale(s.probs + r * KEY_TILE, p.scale, num_keys)


cdef void _mask_tile(const Problem *p, Scratch *s, const Item *item, int first_pos, int key_pos,
                     int num_keys) noexcept nogil:
    """Set the score of every key a row may not see to -inf: keys after its query (causal) and,
    with a sliding window, keys window or more positions before it."""
    cdef int heads = item.kv_count * (p.num_heads // p.num_kv_heads)
    cdef int i, r, j, query_pos, lo, hi
    cdef float *scores
    for i in range(item.count):
        query_pos = first_pos + i
        lo = 0 if p.window == 0 else max(0, query_pos - p.window + 1 - key_pos)  # first visible j
        hi = min(num_keys, query_pos + 1 - key_pos)  # one past the last visible j
        if lo <= 0 and hi >= num_keys:
            continue
        for r in range(i * heads, (i + 1) * heads):
            scores = s.probs + r * KEY_TILE
            for j in range(num_keys):
                if j < lo or j >= hi:
                    scores[j] = -INFINITY


cdef void _softmax_tile(Scratch *s, int rows, int head_dim, int num_keys) noexcept nogil:
    """Online softmax step: fold the tile's scores into each row's running max and sum, rescale
    its accumulator to the new max, and turn the scores into weights exp(score - max)."""
    cdef int r, j
    cdef float tile_max, new_max, correction
    cdef float *probs
    for r in range(rows):
        probs = s.probs + r * KEY_TILE
        tile_max = pg_max(probs, num_keys)
        if tile_max == -INFINITY:  # the row sees none of these keys: weights 0, state unchanged
            for j in range(num_keys):
                probs[j] = 0
            continue
        new_max = max(s.row_max[r], tile_max)
        correction = expf(s.row_max[r] - new_max)  # 0 for the first keys the row sees
        if correction != 1:
            pg_scale(s.acc + r * head_dim, correction, head_dim)
        s.row_sum[r] = s.row_sum[r] * correction + pg_exp_sum(probs, num_keys, new_max)
        s.row_max[r] = new_max


cdef void _write_rows(const Problem *p, Scratch *s, const Item *item) noexcept nogil:
    """out[token, head] = acc / sum for the item's rows (every query sees at least its own key)."""
    cdef int group = p.num_heads // p.num_kv_heads
    cdef int heads = item.kv_count * group
    cdef int r, d
    cdef float inverse
    cdef float *dst
    cdef const float *acc
    for r in range(item.count * heads):
        acc = s.acc + r * p.head_dim
        dst = (p.out + (p.query_start[item.seq] + item.first + r // heads) * p.out_token_stride
               + (item.kv_first * group + r % heads) * p.out_head_stride)
        inverse = 1 / s.row_sum[r]
        for d in range(p.head_dim):
            dst[d] = acc[d] * inverse
