# cython: language_level=3, boundscheck=False, wraparound=False
"""A GGUF's strings in C, the hot loops of reading its tokenizer (~49,000 tokens and as many merges for SmolLM2):
its string arrays read from the file, ~0.05 us a string (~0.4 us through struct), and the merges cut into pairs."""

import struct

from cpython.unicode cimport PyUnicode_DecodeUTF8, PyUnicode_FindChar
from libc.stdint cimport uint64_t


def read_strings(view, Py_ssize_t offset, Py_ssize_t count, str order, uint64_t limit, str key):
    """`count` strings from `view` (the file's bytes) at `offset`, each its size (a uint64 in `order`, "<" or ">")
    then its UTF-8 bytes: (the strings, the offset past them). A size past `limit` or the file's end is a ValueError
    naming `key`; a size cut off by the end, struct's error; bytes that are no UTF-8, UnicodeDecodeError."""
    cdef const unsigned char[::1] data = view
    cdef Py_ssize_t end = data.shape[0]
    cdef bint big = order == ">"
    cdef uint64_t size
    cdef int i
    strings = []
    for _ in range(count):
        if offset + 8 > end:
            struct.unpack_from(order + "Q", view, offset)  # raises struct.error, as a reader on struct would
        size = 0
        for i in range(8):
            size |= <uint64_t>data[offset + i] << (8 * (7 - i) if big else 8 * i)
        offset += 8
        if size > limit or offset + <Py_ssize_t>size > end:
            raise ValueError(f"GGUF metadata {key!r}: a string of {size:,} bytes is past the file's end or the bound "
                             f"({limit:,} bytes)")
        strings.append(PyUnicode_DecodeUTF8(<const char *>&data[0] + offset, size, NULL))
        offset += size
    return strings, offset


def merge_pairs(merges):
    """Each "left right" merge as (left, right), cut at its first space after its first character (as llama.cpp
    cuts them); a merge without one is skipped."""
    cdef str merge
    cdef Py_ssize_t cut
    pairs = []
    for merge in merges:
        cut = PyUnicode_FindChar(merge, ord(" "), 1, len(merge), 1)
        if cut > 0:
            pairs.append((merge[:cut], merge[cut + 1:]))
    return pairs
