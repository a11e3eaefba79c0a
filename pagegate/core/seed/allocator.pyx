# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
# cython: binding=False, embedsignature=True, embedsignature.format=clinic
# binding=False: methods are plain C methods, cheaper to call than cyfunctions; the clinic-style
# signatures keep inspect.signature() working
"""The seed's `BlockAllocator`, same method names, backed by the Cython `BlockPool`.

Differences from the seed, on purpose: `stats()['used']` counts physical pages once (the seed
counts a shared page once per sequence that holds it) and `stats()` also reports `logical`
(pages summed over sequences) and `shared` (pages with refcount > 1). Out-of-pages raises
`NoFreeBlocksError`, a `RuntimeError` like the seed's, and changes nothing. `allocated_blocks`
is a read-only view: each lookup gives a copy of the sequence's page list.
"""

from collections.abc import Mapping

cimport cython
from cpython.dict cimport PyDict_GetItemWithError
from cpython.list cimport PyList_New, PyList_SET_ITEM
from cpython.long cimport PyLong_FromLong
from cpython.mem cimport PyMem_Free, PyMem_Realloc
from cpython.object cimport PyObject
from cpython.ref cimport Py_INCREF
from libc.stdint cimport int32_t
from libc.string cimport memcpy

from pagegate.core.block_pool cimport BlockPool

from pagegate.core.block_pool import NoFreeBlocksError

__all__ = ["BlockAllocator", "NoFreeBlocksError"]

cdef extern from *:
    void __builtin_prefetch(const void*) nogil  # GCC and Clang


cdef list as_list(const int32_t* ids, Py_ssize_t n):
    # fresh int objects rather than one kept per page: the pool hands out the longest-free page
    # first, so in a large pool that page's kept int would be cold memory by then
    cdef list out = PyList_New(n)
    cdef Py_ssize_t i
    cdef object page
    for i in range(n):
        page = PyLong_FromLong(ids[i])
        Py_INCREF(page)  # PyList_SET_ITEM steals it
        PyList_SET_ITEM(out, i, page)
    return out


cdef inline void warm_next_free(BlockPool pool) noexcept:
    # the pool's free list is in freeing order, so the page its next take_free() pops is cold by
    # now; fetching its links while Python runs the caller hides most of that miss
    cdef int32_t b = pool.next[pool.num_blocks]  # head of the uncached free list (see block_pool.pxd)
    if b < pool.num_blocks:
        __builtin_prefetch(&pool.next[b])
        __builtin_prefetch(&pool.prev[b])
        __builtin_prefetch(&pool.refcounts[b])


@cython.final
cdef class _Pages:
    """One sequence's pages, in order, in a growable C array."""

    cdef int32_t* ids
    cdef Py_ssize_t n
    cdef Py_ssize_t cap

    def __dealloc__(self):
        PyMem_Free(self.ids)

    cdef int reserve(self, Py_ssize_t extra) except -1:
        if self.n + extra <= self.cap:
            return 0
        # start at 64 pages, from Python's small-block allocator: a table rarely regrows, and cheaply
        cdef Py_ssize_t cap = self.cap if self.cap else 64
        while cap < self.n + extra:
            cap *= 2
        cdef int32_t* ids = <int32_t*>PyMem_Realloc(self.ids, cap * sizeof(int32_t))
        if ids == NULL:
            raise MemoryError()
        self.ids, self.cap = ids, cap
        return 0


@cython.final
cdef class BlockAllocator:
    """Per-sequence page lists over one refcounted pool (the seed's section 3.3.2 interface)."""

    cdef readonly int num_blocks
    cdef readonly BlockPool pool
    cdef dict tables  # seq_id -> _Pages
    cdef Py_ssize_t logical

    def __cinit__(self, int num_blocks) -> None:
        self.pool = BlockPool(num_blocks, enable_prefix_caching=False)
        self.num_blocks = num_blocks
        self.tables = {}

    def allocate(self, seq_id, int num_blocks) -> list:
        """Append `num_blocks` fresh pages to the sequence's table; all or nothing."""
        cdef PyObject* found = PyDict_GetItemWithError(self.tables, seq_id)
        if num_blocks > self.pool.num_free_blocks:  # before growing the table for them
            raise NoFreeBlocksError(num_blocks, self.pool.num_free_blocks)
        cdef _Pages pages = <_Pages>found if found != NULL else _Pages.__new__(_Pages)
        if num_blocks > 0:
            pages.reserve(num_blocks)
        self.pool.allocate_into(pages.ids + pages.n, num_blocks)  # a negative count raises here
        warm_next_free(self.pool)
        if found == NULL:
            self.tables[seq_id] = pages
        pages.n += num_blocks
        self.logical += num_blocks
        return as_list(pages.ids + pages.n - num_blocks, num_blocks)

    def try_allocate(self, num_blocks) -> bool:
        return self.pool.num_free_blocks >= num_blocks

    def free(self, seq_id) -> None:
        """Release every page of the sequence (shared pages stay until their last holder frees)."""
        cdef _Pages pages = self.tables.pop(seq_id, None)
        if pages is None:
            return
        self.logical -= pages.n
        self.pool.free_ptr(pages.ids, pages.n)

    def share_blocks(self, src_seq, dst_seq, num_shared) -> None:
        """`dst_seq` starts with the first `num_shared` pages of `src_seq`, shared by reference."""
        cdef PyObject* found = PyDict_GetItemWithError(self.tables, src_seq)
        if found == NULL:
            raise KeyError(f"sequence {src_seq} holds no pages")
        if dst_seq in self.tables:
            raise ValueError(f"sequence {dst_seq} already holds pages")
        cdef _Pages src = <_Pages>found
        # the seed's `[:num_shared]` slice: None takes all, a negative count drops from the end
        cdef Py_ssize_t i, n = src.n if num_shared is None else num_shared
        n = min(max(n if n >= 0 else src.n + n, 0), src.n)
        cdef _Pages dst = _Pages.__new__(_Pages)
        if n > 0:
            dst.reserve(n)
            memcpy(dst.ids, src.ids, n * sizeof(int32_t))
        for i in range(n):
            self.pool.ref(dst.ids[i])
        dst.n = n
        self.tables[dst_seq] = dst
        self.logical += n

    def block_table(self, seq_id) -> list:
        cdef PyObject* found = PyDict_GetItemWithError(self.tables, seq_id)
        if found == NULL:
            return []
        cdef _Pages pages = <_Pages>found
        return as_list(pages.ids, pages.n)

    @property
    def allocated_blocks(self) -> _Tables:
        return _Tables(self)

    @property
    def free_blocks(self) -> list:
        return self.pool.free_block_ids().tolist()

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def stats(self) -> dict:
        used = self.num_blocks - self.pool.num_free_blocks
        return {
            "total": self.num_blocks,
            "free": self.pool.num_free_blocks,
            "used": used,
            "logical": self.logical,
            "shared": self.pool.num_shared,
            "utilization": f"{used / self.num_blocks * 100:.1f}%",
        }


class _Tables(Mapping):
    """`allocated_blocks`: sequence -> its page list (a copy), read-only."""

    __slots__ = ("_alloc",)

    def __init__(self, alloc: BlockAllocator) -> None:
        self._alloc = alloc

    def __getitem__(self, seq_id):
        cdef BlockAllocator alloc = self._alloc
        cdef _Pages pages = alloc.tables[seq_id]
        return as_list(pages.ids, pages.n)

    def __contains__(self, seq_id) -> bool:
        return seq_id in (<BlockAllocator>self._alloc).tables

    def __iter__(self):
        return iter((<BlockAllocator>self._alloc).tables)

    def __len__(self) -> int:
        return len((<BlockAllocator>self._alloc).tables)
