# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""Per-sequence block tables in C arrays, copy-on-write, swap bookkeeping and the batch builder."""

cimport cython
cimport numpy as cnp
from libc.stdint cimport int32_t, int64_t, uint8_t, uint64_t
from libc.stdlib cimport free, malloc
from libc.string cimport memcpy, memset

from pagegate.core.block_pool cimport BlockPool

import numpy as np

from pagegate.core.block_pool import NoFreeBlocksError

cnp.import_array()

cdef enum SeqState:
    EMPTY = 0
    ON_DEVICE = 1
    SWAPPED = 2


cdef inline cnp.ndarray int32_array(object values):
    """A contiguous 1-D int32 array of `values`; no copy (and no numpy call) when it already is one."""
    cdef cnp.ndarray arr
    if type(values) is cnp.ndarray:
        arr = <cnp.ndarray>values
        if cnp.PyArray_TYPE(arr) == cnp.NPY_INT32 and cnp.PyArray_NDIM(arr) == 1 and cnp.PyArray_IS_C_CONTIGUOUS(arr):
            return arr
    return np.ascontiguousarray(values, dtype=np.int32).reshape(-1)


@cython.final
cdef class BlockTables:
    """Block tables of up to `max_seqs` sequences over one device pool (and an optional CPU pool).

    A sequence is a small int handle. Invariant: a sequence holding n tokens holds
    ceil(n / block_size) pages, the pages its tokens' slots live in. Of those n, the first
    `num_committed` have their KV written (see `commit`); each page they fill is registered in
    the pool's prefix cache as it fills, chained from the sequence's root hash (its salt).
    """

    cdef readonly BlockPool pool
    cdef readonly BlockPool cpu_pool
    cdef readonly int max_seqs
    cdef readonly int max_blocks_per_seq
    cdef readonly int num_sequences
    cdef int block_size
    cdef int32_t* table
    cdef int32_t* nblocks
    cdef int64_t* ntokens
    cdef uint8_t* state
    cdef int32_t* free_slots
    cdef int num_free_slots
    cdef list cow_pairs
    cdef int64_t* ncommitted
    cdef uint64_t* parent_hash  # hash of the last full committed page (or the root hash)
    cdef int32_t* partial  # [max_seqs, block_size]: tokens of the page being filled

    def __cinit__(self, BlockPool pool, int max_seqs, int max_blocks_per_seq, BlockPool cpu_pool=None):
        if max_seqs <= 0 or max_blocks_per_seq <= 0:
            raise ValueError("max_seqs and max_blocks_per_seq must be positive")
        if cpu_pool is not None and cpu_pool.block_size != pool.block_size:
            raise ValueError("the CPU pool must use the device pool's block size")
        self.pool = pool
        self.cpu_pool = cpu_pool
        self.block_size = pool.block_size
        self.max_seqs = max_seqs
        self.max_blocks_per_seq = max_blocks_per_seq
        self.table = <int32_t*>malloc(<size_t>max_seqs * max_blocks_per_seq * sizeof(int32_t))
        self.nblocks = <int32_t*>malloc(max_seqs * sizeof(int32_t))
        self.ntokens = <int64_t*>malloc(max_seqs * sizeof(int64_t))
        self.state = <uint8_t*>malloc(max_seqs * sizeof(uint8_t))
        self.free_slots = <int32_t*>malloc(max_seqs * sizeof(int32_t))
        self.ncommitted = <int64_t*>malloc(max_seqs * sizeof(int64_t))
        self.parent_hash = <uint64_t*>malloc(max_seqs * sizeof(uint64_t))
        self.partial = <int32_t*>malloc(<size_t>max_seqs * pool.block_size * sizeof(int32_t))
        if not (self.table and self.nblocks and self.ntokens and self.state and self.free_slots
                and self.ncommitted and self.parent_hash and self.partial):
            raise MemoryError("cannot allocate block tables")
        memset(self.state, EMPTY, max_seqs)
        cdef int i
        for i in range(max_seqs):
            self.free_slots[i] = max_seqs - 1 - i  # pop from the end: handle 0 first
        self.num_free_slots = max_seqs
        self.num_sequences = 0
        self.cow_pairs = []

    def __dealloc__(self):
        free(self.table); free(self.nblocks); free(self.ntokens); free(self.state); free(self.free_slots)
        free(self.ncommitted); free(self.parent_hash); free(self.partial)

    cdef inline int32_t* row(self, int seq) noexcept:
        return &self.table[<size_t>seq * self.max_blocks_per_seq]

    cdef int check(self, int seq, int expected_state) except -1:
        if seq < 0 or seq >= self.max_seqs or self.state[seq] == EMPTY:
            raise ValueError(f"no sequence with handle {seq}")
        if self.state[seq] != expected_state:
            where = "swapped out to CPU" if self.state[seq] == SWAPPED else "on the device"
            raise ValueError(f"sequence {seq} is {where}")
        return 0

    cdef inline int pages_for(self, int64_t num_tokens) noexcept:
        return <int>((num_tokens + self.block_size - 1) // self.block_size)

    # ---- lifetime --------------------------------------------------------------------------------

    def add_sequence(self, block_ids=None, int64_t num_tokens=0, root_hash: int = 0) -> int:
        """A new sequence starting with `block_ids`: full prefix-cache hits whose references
        the caller already took (`BlockPool.match_prefix`), holding `num_tokens` committed tokens."""
        cdef cnp.ndarray ids = int32_array(() if block_ids is None else block_ids)
        cdef int n = ids.shape[0]
        cdef uint64_t parent = <uint64_t>root_hash
        cdef int32_t last
        if n:
            last = (<int32_t*>cnp.PyArray_DATA(ids))[n - 1]
            if (last < 0 or last >= self.pool.num_blocks or not self.pool.cached[last]
                    or num_tokens != <int64_t>n * self.block_size):
                raise ValueError("a new sequence can only start with full prefix-cache hits")
            parent = self.pool.hashes[last]
        if self.num_free_slots == 0:
            raise ValueError(f"all {self.max_seqs} sequence slots are in use")
        if n != self.pages_for(num_tokens) or n > self.max_blocks_per_seq:
            raise ValueError(f"{n} pages cannot hold exactly {num_tokens} tokens "
                             f"(block size {self.block_size}, at most {self.max_blocks_per_seq} pages)")
        self.num_free_slots -= 1
        cdef int seq = self.free_slots[self.num_free_slots]
        if n:
            memcpy(self.row(seq), cnp.PyArray_DATA(ids), n * sizeof(int32_t))
        self.nblocks[seq] = n
        self.ntokens[seq] = num_tokens
        self.ncommitted[seq] = num_tokens
        self.parent_hash[seq] = parent
        self.state[seq] = ON_DEVICE
        self.num_sequences += 1
        return seq

    cdef void release_slot(self, int seq) noexcept:
        self.state[seq] = EMPTY
        self.free_slots[self.num_free_slots] = seq
        self.num_free_slots += 1
        self.num_sequences -= 1

    def free_sequence(self, int seq) -> None:
        """Drop the sequence and its references to its pages (device or CPU)."""
        if seq < 0 or seq >= self.max_seqs or self.state[seq] == EMPTY:
            raise ValueError(f"no sequence with handle {seq}")
        cdef BlockPool owner = self.cpu_pool if self.state[seq] == SWAPPED else self.pool
        owner.free_ptr(self.row(seq), self.nblocks[seq])
        self.release_slot(seq)

    def fork(self, int seq) -> int:
        """A new sequence sharing every page of `seq` (refcounts up); writes copy on demand."""
        self.check(seq, ON_DEVICE)
        if self.num_free_slots == 0:
            raise ValueError(f"all {self.max_seqs} sequence slots are in use")
        self.num_free_slots -= 1
        cdef int child = self.free_slots[self.num_free_slots], i
        memcpy(self.row(child), self.row(seq), self.nblocks[seq] * sizeof(int32_t))
        for i in range(self.nblocks[seq]):
            self.pool.ref(self.row(seq)[i])
        self.nblocks[child] = self.nblocks[seq]
        self.ntokens[child] = self.ntokens[seq]
        self.ncommitted[child] = self.ncommitted[seq]
        self.parent_hash[child] = self.parent_hash[seq]
        memcpy(&self.partial[<size_t>child * self.block_size], &self.partial[<size_t>seq * self.block_size],
               self.block_size * sizeof(int32_t))
        self.state[child] = ON_DEVICE
        self.num_sequences += 1
        return child

    # ---- growth and copy-on-write ----------------------------------------------------------------

    cdef inline bint needs_copy(self, int seq, int k) noexcept:
        """Writing k tokens touches the partly filled last page; a shared one must be copied first."""
        return (k > 0 and self.ntokens[seq] % self.block_size != 0
                and self.pool.refcounts[self.row(seq)[self.nblocks[seq] - 1]] > 1)

    cdef inline int pages_needed_unchecked(self, int seq, int k) noexcept:
        return self.pages_for(self.ntokens[seq] + k) - self.nblocks[seq] + self.needs_copy(seq, k)

    def pages_needed(self, int seq, int k) -> int:
        """Free pages that grow(seq, k) would take (new pages plus a copy-on-write page)."""
        self.check(seq, ON_DEVICE)
        return self.pages_needed_unchecked(seq, k)

    cdef int grow_unchecked(self, int seq, int k) except -1:
        cdef int new_pages = self.pages_for(self.ntokens[seq] + k) - self.nblocks[seq]
        cdef int32_t* r = self.row(seq)
        cdef int32_t old, copy
        if self.nblocks[seq] + new_pages > self.max_blocks_per_seq:
            raise ValueError(f"sequence {seq} would exceed {self.max_blocks_per_seq} pages")
        if new_pages + self.needs_copy(seq, k) > self.pool.num_free_blocks:
            raise NoFreeBlocksError(new_pages + self.needs_copy(seq, k), self.pool.num_free_blocks)
        if self.needs_copy(seq, k):
            # NOTE: copy-on-write only of a shared, partly filled last page: full pages are never written
            # again, so forks share them for good; the copy is owed to the runner (take_cow_pairs).
            old = r[self.nblocks[seq] - 1]
            copy = self.pool.take_free()
            self.pool.unref(old)
            r[self.nblocks[seq] - 1] = copy
            self.cow_pairs.append((old, copy))
        self.pool.allocate_into(&r[self.nblocks[seq]], new_pages)
        self.nblocks[seq] += new_pages
        self.ntokens[seq] += k
        return new_pages

    def grow(self, int seq, int k) -> int:
        """Make room for k more tokens: a new page exactly when the last is full. All or nothing."""
        self.check(seq, ON_DEVICE)
        if k < 0:
            raise ValueError(f"cannot grow by a negative number of tokens ({k})")
        return self.grow_unchecked(seq, k)

    def grow_many(self, seqs, int k) -> int:
        """Grow each sequence in order by k tokens; stops at the first that does not fit.

        Returns how many grew, so the scheduler can preempt and retry the rest.
        """
        cdef cnp.ndarray handles = int32_array(seqs)
        cdef const int32_t* h = <int32_t*>cnp.PyArray_DATA(handles)
        cdef Py_ssize_t i, n = handles.shape[0]
        for i in range(n):
            self.check(h[i], ON_DEVICE)
        for i in range(n):
            if self.pages_needed_unchecked(h[i], k) > self.pool.num_free_blocks:
                return i
            self.grow_unchecked(h[i], k)
        return n

    def take_cow_pairs(self) -> cnp.ndarray:
        """The (src, dst) page copies owed since the last call, as an [M, 2] int32 array."""
        pairs = np.array(self.cow_pairs, dtype=np.int32).reshape(-1, 2)
        self.cow_pairs = []
        return pairs

    def truncate(self, int seq, int64_t num_tokens) -> int:
        """Give back the slots past `num_tokens`, which must all be uncommitted (speculative tokens that were
        not accepted); pages no slot is left in return to the pool. Returns how many pages went back.

        Committed tokens are never dropped: their pages may already be in the prefix cache (and in KV
        events), so only what was never committed can be taken back, and nothing rejected is ever cached.
        """
        self.check(seq, ON_DEVICE)
        if num_tokens < self.ncommitted[seq] or num_tokens > self.ntokens[seq]:
            raise ValueError(f"sequence {seq}: cannot truncate to {num_tokens} tokens: it holds "
                             f"{self.ntokens[seq]}, of which {self.ncommitted[seq]} are committed")
        cdef int keep = self.pages_for(num_tokens)
        cdef int dropped = self.nblocks[seq] - keep
        self.pool.free_ptr(&self.row(seq)[keep], dropped)
        self.nblocks[seq] = keep
        self.ntokens[seq] = num_tokens
        return dropped

    # ---- committed tokens and the prefix cache ----------------------------------------------------

    cdef int commit_unchecked(self, int seq, const int32_t* tokens, Py_ssize_t n) except -1:
        cdef int bs = self.block_size
        cdef int32_t* partial = &self.partial[<size_t>seq * bs]
        cdef int64_t c = self.ncommitted[seq]
        cdef Py_ssize_t i
        if c + n > self.ntokens[seq]:
            raise ValueError(f"sequence {seq}: committing {n} tokens past its {self.ntokens[seq]} slots")
        for i in range(n):
            partial[c % bs] = tokens[i]
            c += 1
            if c % bs == 0:
                self.parent_hash[seq] = self.pool.cache_block_c(self.row(seq)[c // bs - 1],
                                                                self.parent_hash[seq], partial, c == bs)
        self.ncommitted[seq] = c
        return 0

    def commit(self, int seq, token_ids) -> None:
        """Record tokens whose KV is now written; each page they fill enters the prefix cache."""
        self.check(seq, ON_DEVICE)
        cdef cnp.ndarray tokens = int32_array(token_ids)
        self.commit_unchecked(seq, <int32_t*>cnp.PyArray_DATA(tokens), tokens.shape[0])

    def append(self, int seq, token_ids) -> int:
        """grow + commit: reserve slots for known tokens and record them; returns new pages.

        Safe before the forward pass that writes their KV: every layer writes a step's KV
        before any attention of that step reads it.
        """
        self.check(seq, ON_DEVICE)
        cdef cnp.ndarray tokens = int32_array(token_ids)
        cdef int added = self.grow_unchecked(seq, tokens.shape[0])
        self.commit_unchecked(seq, <int32_t*>cnp.PyArray_DATA(tokens), tokens.shape[0])
        return added

    def append_many(self, seqs, token_ids) -> int:
        """`append` of one token to each sequence in order (a decode step); stops at the first
        that does not fit and returns how many were appended."""
        cdef cnp.ndarray handles = int32_array(seqs), tokens = int32_array(token_ids)
        cdef const int32_t* h = <int32_t*>cnp.PyArray_DATA(handles)
        cdef const int32_t* t = <int32_t*>cnp.PyArray_DATA(tokens)
        cdef Py_ssize_t i, n = handles.shape[0]
        if tokens.shape[0] != n:
            raise ValueError(f"{n} sequences but {tokens.shape[0]} tokens")
        for i in range(n):
            self.check(h[i], ON_DEVICE)
            if self.ncommitted[h[i]] != self.ntokens[h[i]]:
                raise ValueError(f"sequence {h[i]} has uncommitted slots")
        for i in range(n):
            if not self.append_one(h[i], t[i]):
                return i
        return n

    cdef inline bint append_one(self, int seq, int32_t token) except -1:
        """The decode hot path of append_many, fused; False when the pool has no page for it."""
        cdef int bs = self.block_size
        cdef int64_t n = self.ntokens[seq]
        cdef int32_t* r = self.row(seq)
        if n % bs == 0:  # the last page is full: take a fresh one
            if self.pool.num_free_blocks == 0:
                return False
            if self.nblocks[seq] >= self.max_blocks_per_seq:
                raise ValueError(f"sequence {seq} would exceed {self.max_blocks_per_seq} pages")
            r[self.nblocks[seq]] = self.pool.take_free()
            self.nblocks[seq] += 1
        elif self.pool.refcounts[r[self.nblocks[seq] - 1]] > 1:
            if self.pool.num_free_blocks == 0:
                return False
            self.grow_unchecked(seq, 1)  # copy-on-write: the rare path
        self.ntokens[seq] = n + 1
        self.partial[<size_t>seq * bs + n % bs] = token
        self.ncommitted[seq] = n + 1
        if (n + 1) % bs == 0:
            self.parent_hash[seq] = self.pool.cache_block_c(r[n // bs], self.parent_hash[seq],
                                                            &self.partial[<size_t>seq * bs], n < bs)
        return True

    def num_committed(self, int seq) -> int:
        if seq < 0 or seq >= self.max_seqs or self.state[seq] == EMPTY:
            raise ValueError(f"no sequence with handle {seq}")
        return self.ncommitted[seq]

    # ---- swap bookkeeping ------------------------------------------------------------------------

    def swap_out(self, int seq) -> cnp.ndarray:
        """Move a sequence's pages to the CPU pool: returns (device page, cpu page) pairs to copy.

        The device pages are released (the caller must copy before they are reused).
        """
        self.check(seq, ON_DEVICE)
        if self.cpu_pool is None:
            raise ValueError("no CPU pool: swap space is 0")
        return self.move(seq, self.pool, self.cpu_pool, SWAPPED)

    def swap_in(self, int seq) -> cnp.ndarray:
        """Bring a swapped sequence back: returns (cpu page, device page) pairs to copy."""
        self.check(seq, SWAPPED)
        return self.move(seq, self.cpu_pool, self.pool, ON_DEVICE)

    cdef cnp.ndarray move(self, int seq, BlockPool src, BlockPool dst, int new_state):
        cdef int n = self.nblocks[seq]
        pairs = np.empty((n, 2), dtype=np.int32)
        cdef int32_t[:, :] p = pairs
        cdef int32_t* r = self.row(seq)
        cdef int i
        dst_ids = dst.allocate(n)  # raises NoFreeBlocksError first, changing nothing
        cdef int32_t[:] d = dst_ids
        for i in range(n):
            p[i, 0] = r[i]
            p[i, 1] = d[i]
        src.free_ptr(r, n)
        for i in range(n):
            r[i] = d[i]
        self.state[seq] = new_state
        return pairs

    # ---- introspection ----------------------------------------------------------------------------

    def block_ids(self, int seq) -> cnp.ndarray:
        """A copy of the sequence's block table."""
        if seq < 0 or seq >= self.max_seqs or self.state[seq] == EMPTY:
            raise ValueError(f"no sequence with handle {seq}")
        out = np.empty(self.nblocks[seq], dtype=np.int32)
        if self.nblocks[seq]:
            memcpy(cnp.PyArray_DATA(out), self.row(seq), self.nblocks[seq] * sizeof(int32_t))
        return out

    def num_tokens(self, int seq) -> int:
        if seq < 0 or seq >= self.max_seqs or self.state[seq] == EMPTY:
            raise ValueError(f"no sequence with handle {seq}")
        return self.ntokens[seq]

    def num_blocks(self, int seq) -> int:
        if seq < 0 or seq >= self.max_seqs or self.state[seq] == EMPTY:
            raise ValueError(f"no sequence with handle {seq}")
        return self.nblocks[seq]

    def is_swapped(self, int seq) -> bool:
        return 0 <= seq < self.max_seqs and self.state[seq] == SWAPPED


@cython.final
cdef class BatchBuilder:
    """Fills preallocated arrays describing one forward step over a mix of prefill chunks and decodes.

    For sequence b computing its last q tokens of a context of n (already grown to n):
    positions n-q .. n-1, slot = table[p // block_size] * block_size + p % block_size.
    """

    cdef BlockTables tables
    cdef readonly int max_num_seqs
    cdef readonly int max_num_tokens
    cdef readonly cnp.ndarray block_tables_buf
    cdef readonly cnp.ndarray slot_mapping_buf
    cdef readonly cnp.ndarray positions_buf
    cdef readonly cnp.ndarray seq_lens_buf
    cdef readonly cnp.ndarray query_start_loc_buf

    def __cinit__(self, BlockTables tables, int max_num_seqs, int max_num_tokens):
        self.tables = tables
        self.max_num_seqs = max_num_seqs
        self.max_num_tokens = max_num_tokens
        self.block_tables_buf = np.zeros(max_num_seqs * tables.max_blocks_per_seq, dtype=np.int32)
        self.slot_mapping_buf = np.zeros(max_num_tokens, dtype=np.int64)
        self.positions_buf = np.zeros(max_num_tokens, dtype=np.int64)
        self.seq_lens_buf = np.zeros(max_num_seqs, dtype=np.int32)
        self.query_start_loc_buf = np.zeros(max_num_seqs + 1, dtype=np.int32)

    def build(self, seqs, query_lens) -> tuple:
        """Returns (block_tables [B, W], slot_mapping [T], positions [T], seq_lens [B],
        query_start_loc [B + 1]) as views of the preallocated arrays (valid until the next build)."""
        cdef cnp.ndarray handles = int32_array(seqs), qlens = int32_array(query_lens)
        cdef const int32_t* h = <int32_t*>cnp.PyArray_DATA(handles)
        cdef const int32_t* q = <int32_t*>cnp.PyArray_DATA(qlens)
        cdef Py_ssize_t b, num_seqs = handles.shape[0]
        cdef int64_t total = 0
        cdef int width = 1
        cdef BlockTables t = self.tables
        if qlens.shape[0] != num_seqs or num_seqs > self.max_num_seqs:
            raise ValueError(f"{num_seqs} sequences with {qlens.shape[0]} query lengths "
                             f"(at most {self.max_num_seqs} sequences)")
        for b in range(num_seqs):
            t.check(h[b], ON_DEVICE)
            if q[b] < 1 or q[b] > t.ntokens[h[b]]:
                raise ValueError(f"query length {q[b]} of sequence {h[b]} not in [1, {t.ntokens[h[b]]}]")
            total += q[b]
            width = max(width, t.nblocks[h[b]])
        if total > self.max_num_tokens:
            raise ValueError(f"{total} tokens exceed the step budget of {self.max_num_tokens}")
        self.fill(h, q, num_seqs, width)
        return (self.block_tables_buf[:num_seqs * width].reshape(num_seqs, width),
                self.slot_mapping_buf[:total], self.positions_buf[:total],
                self.seq_lens_buf[:num_seqs], self.query_start_loc_buf[:num_seqs + 1])

    cdef void fill(self, const int32_t* h, const int32_t* q, Py_ssize_t num_seqs, int width) noexcept:
        cdef BlockTables t = self.tables
        cdef int32_t* bt = <int32_t*>cnp.PyArray_DATA(self.block_tables_buf)
        cdef int64_t* slots = <int64_t*>cnp.PyArray_DATA(self.slot_mapping_buf)
        cdef int64_t* pos = <int64_t*>cnp.PyArray_DATA(self.positions_buf)
        cdef int32_t* lens = <int32_t*>cnp.PyArray_DATA(self.seq_lens_buf)
        cdef int32_t* starts = <int32_t*>cnp.PyArray_DATA(self.query_start_loc_buf)
        cdef int bs = t.block_size, nb
        cdef int32_t* r
        cdef int64_t p, n, k = 0
        cdef Py_ssize_t b
        starts[0] = 0
        for b in range(num_seqs):
            r = t.row(h[b])
            nb = t.nblocks[h[b]]
            n = t.ntokens[h[b]]
            memcpy(&bt[b * width], r, nb * sizeof(int32_t))
            if nb < width:
                memset(&bt[b * width + nb], 0, (width - nb) * sizeof(int32_t))
            for p in range(n - q[b], n):
                pos[k] = p
                slots[k] = <int64_t>r[p // bs] * bs + p % bs
                k += 1
            lens[b] = <int32_t>n
            starts[b + 1] = <int32_t>k
