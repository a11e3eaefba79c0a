# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""The physical page pool: O(1) free list, reference counts and a verified prefix-hash cache.

Every array is a C array sized at construction; no Python object exists per page.
"""

cimport numpy as cnp
from libc.stdint cimport int32_t, int64_t, uint32_t, uint64_t, uint8_t
from libc.stdlib cimport calloc, free, malloc
from libc.string cimport memcmp, memcpy, memset

import numpy as np

from pagegate.core.stats import PoolStats

cnp.import_array()

cdef extern from *:
    int __builtin_ctzll(unsigned long long x) nogil


class NoFreeBlocksError(RuntimeError):
    """Fewer free pages than asked for; nothing was changed."""

    def __init__(self, needed: int, free: int) -> None:
        super().__init__(f"out of KV pages: needed {needed}, only {free} free")
        self.needed = needed
        self.free = free


cdef inline uint64_t mix64(uint64_t x) noexcept nogil:
    # splitmix64 finaliser: a cheap, well-spread 64-bit mixer
    x ^= x >> 30
    x *= <uint64_t>0xbf58476d1ce4e5b9
    x ^= x >> 27
    x *= <uint64_t>0x94d049bb133111eb
    x ^= x >> 31
    return x


cdef extern from "page_hash.h":
    uint64_t pg_page_hash(uint64_t parent, const int32_t* tokens, int n) noexcept nogil


cdef inline uint64_t hash_tokens(uint64_t parent, const int32_t* tokens, int n) noexcept nogil:
    # SHA-256 of a length-prefixed (parent, tokens) record, cut to 64 bits (page_hash.h's NOTE)
    return pg_page_hash(parent, tokens, n)


cdef inline cnp.ndarray as_int32_array(object ids):
    """A contiguous 1-D int32 view of `ids`; the fast path costs no copy for int32 arrays."""
    cdef cnp.ndarray arr
    if type(ids) is cnp.ndarray:
        arr = <cnp.ndarray>ids
        if cnp.PyArray_TYPE(arr) == cnp.NPY_INT32 and cnp.PyArray_NDIM(arr) == 1 \
                and cnp.PyArray_IS_C_CONTIGUOUS(arr):
            return arr
    arr = np.asarray(ids)
    if arr.size == 0:
        return np.empty(0, dtype=np.int32)
    if arr.dtype.kind not in "iu":
        raise ValueError(f"block ids must be integers, got dtype {arr.dtype}")
    if arr.min() < -2**31 or arr.max() >= 2**31:
        raise ValueError("block id out of int32 range")
    return np.ascontiguousarray(arr, dtype=np.int32).reshape(-1)


def compute_block_hash(parent_hash: int, token_ids) -> int:
    """The prefix-cache identity of one full page: the first 8 bytes (little-endian) of SHA-256 over
    b"PGPAGE1\\0" + parent (u64) + len(token_ids) (u32) + token ids (u32 each), all little-endian."""
    cdef cnp.ndarray tokens = as_int32_array(token_ids)
    return hash_tokens(<uint64_t>parent_hash, <int32_t*>cnp.PyArray_DATA(tokens), tokens.shape[0])


cdef class BlockPool:
    """A pool of `num_blocks` KV pages of `block_size` tokens each; with `limit`, arrays for `num_blocks` pages
    (its capacity) of which only the first `limit` may be handed out until set_limit moves it.

    `hash_bits` < 64 truncates prefix hashes; it exists so tests can plant collisions.
    """

    def __cinit__(self, int num_blocks, int block_size=16, bint enable_prefix_caching=True,
                  int hash_bits=64, limit=None):
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_blocks and block_size must be positive, got {num_blocks}, {block_size}")
        if not 1 <= hash_bits <= 64:
            raise ValueError(f"hash_bits must be in [1, 64], got {hash_bits}")
        if limit is not None and not 0 <= limit <= num_blocks:
            raise ValueError(f"limit must be within [0, {num_blocks}], got {limit}")
        self.capacity = num_blocks
        self.num_blocks = self.base = num_blocks if limit is None else limit
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.hash_mask = <uint64_t>0xffffffffffffffff if hash_bits == 64 else ((<uint64_t>1 << hash_bits) - 1)
        cdef uint64_t capacity = 16
        while capacity < <uint64_t>(2 * num_blocks):
            capacity <<= 1
        self.table_mask = capacity - 1
        self.refcounts = <int32_t*>malloc(num_blocks * sizeof(int32_t))
        self.prev = <int32_t*>malloc((num_blocks + 2) * sizeof(int32_t))
        self.next = <int32_t*>malloc((num_blocks + 2) * sizeof(int32_t))
        self.cached = <uint8_t*>malloc(num_blocks * sizeof(uint8_t))
        self.hashes = <uint64_t*>malloc(num_blocks * sizeof(uint64_t))
        self.parent_hashes = <uint64_t*>malloc(num_blocks * sizeof(uint64_t))
        self.tokens = <int32_t*>malloc(<size_t>num_blocks * block_size * sizeof(int32_t))
        self.table_blocks = <int32_t*>malloc(capacity * sizeof(int32_t))
        self.firsts = <uint8_t*>malloc(num_blocks * sizeof(uint8_t))
        self.evicted_ids = <int32_t*>malloc(num_blocks * sizeof(int32_t))
        self.evicted_hashes = <uint64_t*>malloc(num_blocks * sizeof(uint64_t))
        self.evicted_parents = <uint64_t*>malloc(num_blocks * sizeof(uint64_t))
        self.evicted_firsts = <uint8_t*>malloc(num_blocks * sizeof(uint8_t))
        self.evicted_tokens = <int32_t*>malloc(<size_t>num_blocks * block_size * sizeof(int32_t))
        if not (self.refcounts and self.prev and self.next and self.cached and self.hashes
                and self.parent_hashes and self.tokens and self.table_blocks and self.firsts and self.evicted_ids
                and self.evicted_hashes and self.evicted_parents and self.evicted_firsts and self.evicted_tokens):
            raise MemoryError("cannot allocate the block pool's bookkeeping arrays")
        cdef Py_ssize_t words = num_blocks - self.base
        while words > 1 or (words == 1 and self.num_levels == 0):
            words = (words + 63) >> 6
            self.levels[self.num_levels] = <uint64_t*>calloc(words, sizeof(uint64_t))
            if not self.levels[self.num_levels]:
                raise MemoryError("cannot allocate the block pool's bitmap")
            self.num_levels += 1
        self.reset()

    def __dealloc__(self):
        free(self.refcounts); free(self.prev); free(self.next); free(self.cached)
        free(self.hashes); free(self.parent_hashes); free(self.tokens); free(self.table_blocks)
        free(self.firsts); free(self.evicted_ids); free(self.evicted_hashes); free(self.evicted_parents)
        free(self.evicted_firsts); free(self.evicted_tokens)
        cdef int lev
        for lev in range(self.num_levels):
            free(self.levels[lev])

    def reset(self) -> None:
        """Return every page to the free list and forget the prefix cache."""
        if self.events is not None:
            self.events.append(("AllBlocksCleared",))
        cdef int i, s, n = self.num_blocks, c = self.capacity, lev
        cdef Py_ssize_t words = c - self.base
        memset(self.refcounts, 0, c * sizeof(int32_t))
        memset(self.cached, 0, c * sizeof(uint8_t))
        memset(self.table_blocks, 0xff, (self.table_mask + 1) * sizeof(int32_t))
        for lev in range(self.num_levels):
            words = (words + 63) >> 6
            memset(self.levels[lev], 0, words * sizeof(uint64_t))
        for s in (c, c + 1):
            self.prev[s] = s
            self.next[s] = s
        for i in range(n):
            self.hand_back(i)
        self.num_free_blocks = n
        self.num_cached_free = 0
        self.num_shared = 0
        self.prefix_hits = 0
        self.prefix_queries = 0
        self.num_evicted = 0

    # ---- free lists ------------------------------------------------------------------------

    cdef void push_back(self, int32_t sentinel, int32_t b) noexcept:
        self.prev[b] = self.prev[sentinel]
        self.next[b] = sentinel
        self.next[self.prev[sentinel]] = b
        self.prev[sentinel] = b

    cdef void unlink(self, int32_t b) noexcept:
        self.next[self.prev[b]] = self.next[b]
        self.prev[self.next[b]] = self.prev[b]

    cdef void mark_free(self, int32_t b) noexcept:
        cdef Py_ssize_t i = b - self.base, w
        cdef uint64_t was
        cdef int lev
        for lev in range(self.num_levels):
            w = i >> 6
            was = self.levels[lev][w]
            self.levels[lev][w] = was | (<uint64_t>1 << (i & 63))
            if was:
                break
            i = w

    cdef void mark_taken(self, int32_t b) noexcept:
        cdef Py_ssize_t i = b - self.base, w
        cdef int lev
        for lev in range(self.num_levels):
            w = i >> 6
            self.levels[lev][w] &= ~(<uint64_t>1 << (i & 63))
            if self.levels[lev][w]:
                break
            i = w

    cdef int32_t lowest_marked(self) noexcept:
        """The lowest uncached free page at or above base, -1 when there is none: one word a level."""
        cdef int lev = self.num_levels - 1
        cdef Py_ssize_t i = 0
        if lev < 0 or self.levels[lev][0] == 0:
            return -1
        while lev >= 0:
            i = (i << 6) | __builtin_ctzll(self.levels[lev][i])
            lev -= 1
        return <int32_t>(i + self.base)

    cdef void hand_back(self, int32_t b) noexcept:
        """An uncached page with no reference joins the free pages: the FIFO list below base, the bitmap above."""
        if b < self.base:
            self.push_back(self.capacity, b)
        else:
            self.mark_free(b)

    cdef void withdraw(self, int32_t b) noexcept:
        """A free page (cached or not) leaves the free pages; the caller counts it."""
        if self.cached[b]:
            self.unlink(b)
            self.num_cached_free -= 1
        elif b < self.base:
            self.unlink(b)
        else:
            self.mark_taken(b)

    cdef int take_free(self) noexcept:
        """Pop a free page (uncached first, else the least recently freed cached one): refcount 1."""
        cdef int32_t uncached = self.capacity, b = self.next[uncached]
        # NOTE: a page with no cached content goes first (handing it out loses nothing); among cached pages the
        # one freed longest ago goes: the least likely to be hit again, and the list's head gives it in O(1).
        # Uncached pages above base (a pool grown past its first limit) go after those below it, lowest id
        # first, so the pages a shrink would take back stay free as long as possible.
        if b == uncached:
            b = self.lowest_marked()
            if b >= 0:
                self.mark_taken(b)
            else:
                b = self.next[uncached + 1]
                if self.logging_evictions:
                    self.log_eviction(b)
                self.evict(b)
                self.num_cached_free -= 1
                self.unlink(b)
        else:
            self.unlink(b)
        self.num_free_blocks -= 1
        self.refcounts[b] = 1
        return b

    cdef void release(self, int32_t block) noexcept:
        """A page whose refcount reached zero goes back; a cached one stays revivable (LRU tail)."""
        if self.cached[block]:
            self.push_back(self.capacity + 1, block)
            self.num_cached_free += 1
        else:
            self.hand_back(block)
        self.num_free_blocks += 1

    cdef void ref(self, int32_t block) noexcept:
        if self.refcounts[block] == 0:  # revive a free page in O(1)
            self.withdraw(block)
            self.num_free_blocks -= 1
        self.refcounts[block] += 1
        if self.refcounts[block] == 2:
            self.num_shared += 1

    cdef void unref(self, int32_t block) noexcept:
        self.refcounts[block] -= 1
        if self.refcounts[block] == 1:
            self.num_shared -= 1
        elif self.refcounts[block] == 0:
            self.release(block)

    # ---- hash table (open addressing, linear probing, backward-shift deletion) -------------

    cdef uint64_t home(self, uint64_t h) noexcept:
        return mix64(h) & self.table_mask

    cdef int32_t find(self, uint64_t h) noexcept:
        cdef uint64_t i = self.home(h)
        while self.table_blocks[i] != -1:
            if self.hashes[self.table_blocks[i]] == h:
                return self.table_blocks[i]
            i = (i + 1) & self.table_mask
        return -1

    cdef void insert(self, int32_t block) noexcept:
        cdef uint64_t i = self.home(self.hashes[block])
        while self.table_blocks[i] != -1:
            i = (i + 1) & self.table_mask
        self.table_blocks[i] = block

    cdef void evict(self, int32_t block) noexcept:
        """Forget a page's cached content."""
        if self.events is not None:
            self.events.append(("BlockRemoved", self.hashes[block]))
        cdef uint64_t i = self.home(self.hashes[block]), j, k
        while self.table_blocks[i] != block:
            i = (i + 1) & self.table_mask
        j = i
        while True:
            j = (j + 1) & self.table_mask
            if self.table_blocks[j] == -1:
                break
            k = self.home(self.hashes[self.table_blocks[j]])
            # move j back to the hole at i unless its home lies cyclically in (i, j]
            if (i <= j and (k <= i or k > j)) or (i > j and k <= i and k > j):
                self.table_blocks[i] = self.table_blocks[j]
                i = j
        self.table_blocks[i] = -1
        self.cached[block] = 0

    cdef void log_eviction(self, int32_t block) noexcept:
        # NOTE: each page is logged at most once between drains: it is handed out uncached, and only caching
        # (after the step's forward, past the drain) makes it evictable again. The log has a row per page.
        cdef int i = self.num_evicted
        self.evicted_ids[i] = block
        self.evicted_hashes[i] = self.hashes[block]
        self.evicted_parents[i] = self.parent_hashes[block]
        self.evicted_firsts[i] = self.firsts[block]
        memcpy(&self.evicted_tokens[<size_t>i * self.block_size], &self.tokens[<size_t>block * self.block_size],
               self.block_size * sizeof(int32_t))
        self.num_evicted += 1

    # ---- batch API --------------------------------------------------------------------------

    cdef int allocate_into(self, int32_t* out, int n) except -1:
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of pages ({n})")
        if n > self.num_free_blocks:
            raise NoFreeBlocksError(n, self.num_free_blocks)
        cdef int i
        for i in range(n):
            out[i] = self.take_free()
        return 0

    def allocate(self, int n) -> cnp.ndarray:
        """Take `n` pages (refcount 1 each), all or nothing; raises NoFreeBlocksError."""
        cdef cnp.npy_intp dims = n if n > 0 else 0
        cdef cnp.ndarray out = cnp.PyArray_EMPTY(1, &dims, cnp.NPY_INT32, 0)
        self.allocate_into(<int32_t*>cnp.PyArray_DATA(out), n)
        return out

    cdef int check_ids(self, const int32_t* ids, Py_ssize_t n, bint allocated) except -1:
        cdef Py_ssize_t i
        for i in range(n):
            if ids[i] < 0 or ids[i] >= self.num_blocks:
                raise ValueError(f"block id {ids[i]} out of range [0, {self.num_blocks})")
            if allocated and self.refcounts[ids[i]] == 0:
                raise ValueError(f"block {ids[i]} is not allocated")
        return 0

    cdef int free_ptr(self, const int32_t* ids, Py_ssize_t n) except -1:
        self.check_ids(ids, n, True)
        cdef Py_ssize_t i, j
        # NOTE: last page first. A sequence's pages then reach the LRU list tail first, so eviction takes a chain
        # from its end and keeps its head (shared by more prompts, and the only way into the rest of the chain).
        for i in range(n - 1, -1, -1):
            if self.refcounts[ids[i]] == 0:  # the same id freed more often than referenced
                for j in range(i + 1, n):
                    self.ref(ids[j])
                raise ValueError(f"block {ids[i]} freed more times than it is referenced")
            self.unref(ids[i])
        return 0

    def free(self, block_ids) -> None:
        """Drop one reference to each page; a page returns to the free list at zero. All or nothing."""
        cdef cnp.ndarray ids = as_int32_array(block_ids)
        self.free_ptr(<int32_t*>cnp.PyArray_DATA(ids), ids.shape[0])

    def incref(self, block_ids) -> None:
        """Add one reference to each (allocated) page, e.g. to share it with a forked sequence."""
        cdef cnp.ndarray ids = as_int32_array(block_ids)
        cdef const int32_t* p = <int32_t*>cnp.PyArray_DATA(ids)
        cdef Py_ssize_t i, n = ids.shape[0]
        self.check_ids(p, n, True)
        for i in range(n):
            self.ref(p[i])

    # ---- prefix cache -------------------------------------------------------------------------

    def cache_block(self, int block_id, parent_hash: int, token_ids, bint first=False) -> int:
        """Register a full, allocated page's content; returns its hash (the next page's parent).
        `first`: the page starts its sequence (`parent_hash` is the chain's root, not a page)."""
        cdef cnp.ndarray tokens = as_int32_array(token_ids)
        if tokens.shape[0] != self.block_size:
            raise ValueError(f"a cached page holds exactly {self.block_size} tokens, got {tokens.shape[0]}")
        cdef int32_t b = block_id
        self.check_ids(&b, 1, True)
        return self.cache_block_c(b, <uint64_t>parent_hash, <int32_t*>cnp.PyArray_DATA(tokens), first)

    cdef uint64_t cache_block_c(self, int32_t block_id, uint64_t parent, const int32_t* t, bint first) noexcept:
        cdef uint64_t h = hash_tokens(parent, t, self.block_size) & self.hash_mask
        if not self.enable_prefix_caching:
            return h
        if self.cached[block_id]:
            if self.same_content(block_id, h, parent, t):
                return h
            self.evict(block_id)  # reused for new content
        # NOTE: one page per hash. Same content cached elsewhere, or a colliding one: the first stays and this
        # page is simply not cached (lookups confirm content, so a collision never serves the wrong page).
        if self.find(h) == -1:
            self.hashes[block_id] = h
            self.parent_hashes[block_id] = parent
            self.firsts[block_id] = first
            memcpy(&self.tokens[<size_t>block_id * self.block_size], t, self.block_size * sizeof(int32_t))
            self.insert(block_id)
            self.cached[block_id] = 1
            if self.events is not None:
                self.events.append(("BlockStored", h, None if first else parent,
                                    [t[i] for i in range(self.block_size)]))
        return h

    cdef bint same_content(self, int32_t b, uint64_t h, uint64_t parent, const int32_t* t) noexcept:
        return (self.hashes[b] == h and self.parent_hashes[b] == parent and
                memcmp(&self.tokens[<size_t>b * self.block_size], t, self.block_size * sizeof(int32_t)) == 0)

    def match_prefix(self, token_ids, root_hash: int = 0) -> tuple:
        """Longest chain of cached full pages matching `token_ids`; each hit takes a reference.

        Every hit is confirmed against the stored tokens and parent, so a hash collision is a miss.
        `root_hash` salts the chain (tenants with different salts never share pages).
        """
        cdef cnp.ndarray tokens = as_int32_array(token_ids)
        cdef cnp.npy_intp dims = tokens.shape[0] // self.block_size
        cdef cnp.ndarray out = cnp.PyArray_EMPTY(1, &dims, cnp.NPY_INT32, 0)
        cdef int i = self.walk_chain(<int32_t*>cnp.PyArray_DATA(tokens), dims, <uint64_t>root_hash,
                                     <int32_t*>cnp.PyArray_DATA(out))
        self.prefix_queries += tokens.shape[0]
        self.prefix_hits += i * self.block_size
        return out[:i], i * self.block_size

    def cached_prefix_tokens(self, token_ids, root_hash: int = 0) -> int:
        """The tokens match_prefix would find now, without taking references or counting a query."""
        cdef cnp.ndarray tokens = as_int32_array(token_ids)
        return self.walk_chain(<int32_t*>cnp.PyArray_DATA(tokens), tokens.shape[0] // self.block_size,
                               <uint64_t>root_hash, NULL) * self.block_size

    cdef int walk_chain(self, const int32_t* t, int num_full, uint64_t parent, int32_t* out) noexcept:
        """How many of the first num_full pages of t are cached in a chain from parent; each one found is
        referenced and written to out, unless out is NULL."""
        cdef int bs = self.block_size, i = 0
        cdef uint64_t h
        cdef int32_t b
        if not self.enable_prefix_caching:
            return 0
        while i < num_full:
            h = hash_tokens(parent, &t[i * bs], bs) & self.hash_mask
            b = self.find(h)
            # NOTE: a hit is confirmed against the stored tokens and parent: hashes are 64 bits (fewer in tests),
            # and a false hit would silently attend to another prompt's KV. A collision is a miss.
            if b == -1 or not self.same_content(b, h, parent, &t[i * bs]):
                break
            if out != NULL:
                self.ref(b)
                out[i] = b
            parent = h
            i += 1
        return i

    def prefix_hashes(self, token_ids, root_hash: int = 0) -> cnp.ndarray:
        """The chain hash of every full page of `token_ids` (uint64), as cache_block and match_prefix compute it."""
        cdef cnp.ndarray tokens = as_int32_array(token_ids)
        cdef const int32_t* t = <int32_t*>cnp.PyArray_DATA(tokens)
        cdef int bs = self.block_size, num_full = tokens.shape[0] // bs, i
        out = np.empty(num_full, dtype=np.uint64)
        cdef uint64_t[:] o = out
        cdef uint64_t parent = <uint64_t>root_hash
        for i in range(num_full):
            parent = hash_tokens(parent, &t[i * bs], bs) & self.hash_mask
            o[i] = parent
        return out

    # ---- the eviction log (for lower tiers) ---------------------------------------------------------

    def record_evictions(self) -> None:
        """From now on, log every cached page that allocation takes back (see take_evicted)."""
        self.logging_evictions = True
        self.num_evicted = 0

    def take_evicted(self) -> tuple:
        """The cached pages allocation evicted since the last call, their content as it was: (block ids int32,
        hashes uint64, parent hashes uint64, firsts bool, token ids int32 [n, block_size]). Their bytes are
        intact until the step that received them writes: drain before it."""
        cdef int n = self.num_evicted, bs = self.block_size
        ids = np.asarray(<int32_t[:max(n, 1)]>self.evicted_ids)[:n].copy() if n else np.zeros(0, np.int32)
        hashes = np.asarray(<uint64_t[:max(n, 1)]>self.evicted_hashes)[:n].copy() if n else np.zeros(0, np.uint64)
        parents = np.asarray(<uint64_t[:max(n, 1)]>self.evicted_parents)[:n].copy() if n else np.zeros(0, np.uint64)
        firsts = np.asarray(<uint8_t[:max(n, 1)]>self.evicted_firsts)[:n].astype(bool) if n else np.zeros(0, bool)
        tokens = (np.asarray(<int32_t[:max(n, 1) * bs]>self.evicted_tokens)[:n * bs].reshape(n, bs).copy() if n
                  else np.zeros((0, bs), np.int32))
        self.num_evicted = 0
        return ids, hashes, parents, firsts, tokens

    def cached_blocks(self) -> tuple:
        """Every page holding cached content, as take_evicted gives them (for writing them down at shutdown)."""
        ids = np.flatnonzero(np.asarray(<uint8_t[:self.capacity]>self.cached)).astype(np.int32)
        hashes = np.asarray(<uint64_t[:self.capacity]>self.hashes)[ids].copy()
        parents = np.asarray(<uint64_t[:self.capacity]>self.parent_hashes)[ids].copy()
        firsts = np.asarray(<uint8_t[:self.capacity]>self.firsts)[ids].astype(bool)
        tokens = np.asarray(<int32_t[:self.capacity * self.block_size]>self.tokens).reshape(
            self.capacity, self.block_size)[ids].copy()
        return ids, hashes, parents, firsts, tokens

    # ---- events (KV-cache events for routers) -----------------------------------------------------

    def record_events(self) -> None:
        """From now on, log every page entering or leaving the prefix cache (see take_events)."""
        if self.events is None:
            self.events = []

    def take_events(self) -> list:
        """The prefix-cache changes since the last call, in order: ("BlockStored", hash, parent hash or None
        for a sequence's first page, its token ids), ("BlockRemoved", hash), ("AllBlocksCleared",)."""
        if not self.events:
            return []
        events, self.events = self.events, []
        return events

    # ---- introspection -------------------------------------------------------------------------

    def refcount(self, int block_id) -> int:
        cdef int32_t b = block_id
        self.check_ids(&b, 1, False)
        return self.refcounts[block_id]

    def block_hash(self, int block_id):
        """The cached hash of a page, or None when it holds no cached content."""
        cdef int32_t b = block_id
        self.check_ids(&b, 1, False)
        return self.hashes[block_id] if self.cached[block_id] else None

    def free_block_ids(self) -> cnp.ndarray:
        """Free pages in hand-out order: uncached first (below base in FIFO order, then above it lowest first),
        then cached least recently freed first."""
        out = np.empty(self.num_free_blocks, dtype=np.int32)
        cdef int32_t[:] o = out
        cdef int k = 0, s, b
        b = self.next[self.capacity]
        while b != self.capacity and k < self.num_free_blocks:
            o[k] = b
            k += 1
            b = self.next[b]
        for b in range(self.base, self.num_blocks):
            if self.refcounts[b] == 0 and not self.cached[b]:
                o[k] = b
                k += 1
        s = self.capacity + 1
        b = self.next[s]
        while b != s and k < self.num_free_blocks:
            o[k] = b
            k += 1
            b = self.next[b]
        return out[:k]

    # ---- the limit (elastic pools) -------------------------------------------------------------

    def set_limit(self, int n) -> int:
        """Let pages [0, n) be handed out; the limit reached. Growing frees pages [limit, n) at once. Shrinking
        takes back only free pages: cached ones are evicted (logged for the tiers, an event for routers), and it
        stops above the highest page in use, so the limit reached may be above `n`.

        NOTE: the limit moves within the capacity the arrays were sized for, so a pool grows and shrinks in
        O(pages moved) without copying anything and keeps its prefix cache below the limit. The pages a shrink
        takes back are the highest ids, which is why allocation hands out the lowest ones above base first."""
        if not 0 <= n <= self.capacity:
            raise ValueError(f"limit must be within [0, {self.capacity}], got {n}")
        cdef int32_t b, old = self.num_blocks, target = n
        cdef bint was_cached
        if n >= old:
            for b in range(old, n):
                self.hand_back(b)
            self.num_free_blocks += n - old
            self.num_blocks = n
            return n
        for b in range(old - 1, n - 1, -1):
            if self.refcounts[b]:
                target = b + 1
                break
        for b in range(target, old):
            was_cached = self.cached[b]
            self.withdraw(b)
            if was_cached:
                if self.logging_evictions:
                    self.log_eviction(b)
                self.evict(b)
        self.num_free_blocks -= old - target
        self.num_blocks = target
        return target

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_shared_blocks(self) -> int:
        return self.num_shared

    @property
    def num_cached_free_blocks(self) -> int:
        return self.num_cached_free

    def stats(self) -> PoolStats:
        return PoolStats(total=self.num_blocks, used=self.num_blocks - self.num_free_blocks,
                         free=self.num_free_blocks, cached_evictable=self.num_cached_free,
                         shared=self.num_shared, prefix_cache_hits=self.prefix_hits,
                         prefix_cache_queries=self.prefix_queries)
