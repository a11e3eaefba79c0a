# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""The pool as one byte per page, for viewers: copied from a BlockPool in one C call, and run-length
encoded (optionally against the previous copy) so a live view costs a few bytes per frame.

A page's byte: bit 7 set when its content is registered in the prefix cache, bits 0-6 its refcount
(capped at 127). So 0 is free, 0x80 cached and evictable, 1 used by one holder, k > 1 shared by k.
"""

from libc.stdint cimport int32_t, uint8_t, uint32_t, uint64_t
from libc.string cimport memcpy

from pagegate.core.block_pool cimport BlockPool

cdef enum:
    CACHED_BIT = 0x80
    REFCOUNT_CAP = 0x7F

CACHED = CACHED_BIT
MAX_REFCOUNT = REFCOUNT_CAP


def fill_page_states(BlockPool pool, uint8_t[::1] out not None) -> None:
    """Write every page's state byte into `out[:pool.num_blocks]`.

    Holds the GIL and calls no Python, so no pool mutation (all made under the GIL) can interleave:
    the copy is one instant of the pool whichever thread takes it.
    """
    cdef int i, n = pool.num_blocks
    if out.shape[0] < n:
        raise ValueError(f"out holds {out.shape[0]} bytes, the pool has {n} pages")
    cdef const int32_t* refcounts = pool.refcounts
    cdef const uint8_t* cached = pool.cached
    cdef uint8_t* o = &out[0]
    cdef int32_t r
    for i in range(n):
        r = refcounts[i]
        o[i] = <uint8_t>((r if r < REFCOUNT_CAP else REFCOUNT_CAP) | (CACHED_BIT if cached[i] else 0))


def max_encoded_size(n: int) -> int:
    """The most bytes rle_encode writes for n pages: a run of one page takes 2 bytes, longer ones fewer."""
    return 2 * n + 8


def rle_encode(const uint8_t[::1] states not None, const uint8_t[::1] previous, uint8_t[::1] out not None) -> int:
    """Encode `states` as runs of (byte, run length as LEB128) into `out`; returns the bytes written.

    With `previous` (same length), the runs are of `states XOR previous`: a frame where little changed
    is a few runs of zeros. The GIL is released: the arrays must not change meanwhile.
    """
    cdef Py_ssize_t n = states.shape[0]
    if previous is not None and previous.shape[0] != n:
        raise ValueError(f"previous holds {previous.shape[0]} pages, states {n}")
    if out.shape[0] < max_encoded_size(n):
        raise ValueError(f"out holds {out.shape[0]} bytes, encoding {n} pages may take {max_encoded_size(n)}")
    cdef const uint8_t* s = &states[0] if n else NULL
    cdef const uint8_t* p = &previous[0] if previous is not None and n else NULL
    cdef uint8_t* o = &out[0]
    cdef Py_ssize_t i = 0, j, k = 0
    cdef uint8_t value
    cdef uint32_t run
    with nogil:
        while i < n:
            value = s[i] ^ (p[i] if p != NULL else 0)
            j = run_end(s, p, i + 1, n, value)
            o[k] = value
            k += 1
            run = <uint32_t>(j - i)
            while run >= 0x80:
                o[k] = <uint8_t>((run & 0x7F) | 0x80)
                k += 1
                run >>= 7
            o[k] = <uint8_t>run
            k += 1
            i = j
    return k


cdef inline uint64_t load8(const uint8_t* at) noexcept nogil:
    cdef uint64_t word
    memcpy(&word, at, 8)  # an unaligned load
    return word


cdef inline Py_ssize_t run_end(const uint8_t* s, const uint8_t* p, Py_ssize_t j, Py_ssize_t n,
                               uint8_t value) noexcept nogil:
    """The first index from j whose (XORed) byte is not `value`: eight bytes a step while they all are."""
    cdef uint64_t pattern = <uint64_t>value * <uint64_t>0x0101010101010101
    if p == NULL:
        while j + 8 <= n and load8(s + j) == pattern:
            j += 8
        while j < n and s[j] == value:
            j += 1
    else:
        while j + 8 <= n and (load8(s + j) ^ load8(p + j)) == pattern:
            j += 8
        while j < n and (s[j] ^ p[j]) == value:
            j += 1
    return j


def rle_decode(const uint8_t[::1] data not None, uint8_t[::1] states not None, bint delta=False) -> None:
    """Inverse of rle_encode: overwrite `states` (delta False) or XOR the runs into it (delta True)."""
    cdef Py_ssize_t n = states.shape[0], m = data.shape[0], i = 0, k = 0, end
    cdef uint8_t value
    cdef uint32_t run
    cdef int shift
    while k < m:
        value = data[k]
        k += 1
        run, shift = 0, 0
        while k < m and data[k] & 0x80:
            run |= <uint32_t>(data[k] & 0x7F) << shift
            shift += 7
            k += 1
        if k >= m:
            raise ValueError("truncated run length")
        run |= <uint32_t>data[k] << shift
        k += 1
        end = i + run
        if end > n:
            raise ValueError(f"the runs cover more than {n} pages")
        while i < end:
            states[i] = (states[i] ^ value) if delta else value
            i += 1
    if i != n:
        raise ValueError(f"the runs cover {i} pages, not {n}")
