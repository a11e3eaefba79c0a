# cython: language_level=3
from libc.stdint cimport int32_t, int64_t, uint64_t, uint8_t

cimport cython


@cython.final
cdef class BlockPool:
    cdef readonly int num_blocks    # the limit: pages [0, num_blocks) may be handed out (set_limit moves it)
    cdef readonly int capacity      # pages the arrays are sized for (the most num_blocks may grow to)
    cdef readonly int base          # the limit at construction: free pages below it sit on the FIFO list
    cdef readonly int block_size
    cdef readonly bint enable_prefix_caching
    cdef int32_t* refcounts
    # free pages sit on one of two doubly linked lists through prev/next; sentinels live at
    # index capacity (pages with no cached content, below base) and capacity + 1 (cached, LRU order).
    # Uncached free pages at or above base are bits of a bitmap instead (set_limit's NOTE), levels[0] one bit a
    # page, levels[k] one bit a non-zero word of levels[k - 1], the top level one word.
    cdef int32_t* prev
    cdef int32_t* next
    cdef uint8_t* cached
    cdef uint64_t* hashes
    cdef uint64_t* parent_hashes
    cdef int32_t* tokens            # [num_blocks, block_size], the content a cached hash stands for
    cdef int32_t* table_blocks      # open-addressing hash table: hash -> block id, -1 empty
    cdef uint64_t table_mask
    cdef uint64_t hash_mask
    cdef readonly int num_free_blocks
    cdef int num_cached_free
    cdef int num_shared
    cdef int64_t prefix_hits
    cdef int64_t prefix_queries
    cdef list events                # None, or the prefix-cache changes since take_events()
    cdef uint8_t* firsts            # per cached page: it starts its chain (its parent is a root hash)
    # the eviction log (record_evictions): pages whose cached content take_free dropped since take_evicted(),
    # with that content copied (hash, parent, first, tokens), so a lower tier can keep their bytes
    cdef bint logging_evictions
    cdef int num_evicted
    cdef int32_t* evicted_ids
    cdef uint64_t* evicted_hashes
    cdef uint64_t* evicted_parents
    cdef uint8_t* evicted_firsts
    cdef int32_t* evicted_tokens
    cdef uint64_t* levels[8]
    cdef int num_levels

    cdef void push_back(self, int32_t sentinel, int32_t b) noexcept
    cdef void unlink(self, int32_t b) noexcept
    cdef void mark_free(self, int32_t b) noexcept
    cdef void mark_taken(self, int32_t b) noexcept
    cdef int32_t lowest_marked(self) noexcept
    cdef void hand_back(self, int32_t b) noexcept
    cdef void withdraw(self, int32_t b) noexcept
    cdef uint64_t home(self, uint64_t h) noexcept
    cdef int32_t find(self, uint64_t h) noexcept
    cdef void insert(self, int32_t block) noexcept
    cdef void evict(self, int32_t block) noexcept
    cdef void log_eviction(self, int32_t block) noexcept
    cdef int check_ids(self, const int32_t* ids, Py_ssize_t n, bint allocated) except -1
    cdef bint same_content(self, int32_t b, uint64_t h, uint64_t parent, const int32_t* t) noexcept
    cdef int walk_chain(self, const int32_t* t, int num_full, uint64_t parent, int32_t* out) noexcept
    cdef int take_free(self) noexcept
    cdef void release(self, int32_t block) noexcept
    cdef void ref(self, int32_t block) noexcept
    cdef void unref(self, int32_t block) noexcept
    cdef int allocate_into(self, int32_t* out, int n) except -1
    cdef int free_ptr(self, const int32_t* ids, Py_ssize_t n) except -1
    cdef uint64_t cache_block_c(self, int32_t block_id, uint64_t parent, const int32_t* t, bint first) noexcept
