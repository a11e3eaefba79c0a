"""Weight buffers on transparent huge pages.

A decode step streams every weight once, and on 4 KiB pages it takes a TLB miss every 4 KiB of it: a one-stream
decode of a 1B model runs ~1.09x faster from huge pages on the 2-core boxes (docs/performance.md). Linux's default
THP mode ("madvise") backs only the mappings that ask, and torch's allocator asks only under THP_MEM_ALLOC_ENABLE
(a process-wide switch read once). So the repacked weights get mappings of their own that ask (`empty`), or, a
model's many matrices under a huge page each, share one (`Arena`).
"""

from __future__ import annotations

import math
import mmap

import numpy as np

HUGE_PAGE = 2 << 20  # x86-64's PMD size
ALIGN = 64  # an Arena's arrays start on cache lines


def empty(shape: tuple[int, ...], dtype: np.dtype | type = np.uint8) -> np.ndarray:
    """An uninitialised array on an anonymous mapping advised MADV_HUGEPAGE; numpy.empty's where the array is under
    a huge page or the platform has no such advice. The mapping is a whole number of huge pages (Linux aligns such
    an anonymous mapping to one) and its last, partly used one is advised back to small pages, so the array's
    resident size is its own (to 4 KiB) and no more. (torch.from_numpy shares it without a copy.)"""
    nbytes = math.prod(shape) * np.dtype(dtype).itemsize
    if nbytes < HUGE_PAGE or not hasattr(mmap, "MADV_HUGEPAGE"):
        return np.empty(shape, dtype=dtype)
    region = _advised(nbytes)
    return np.frombuffer(region, dtype=dtype, count=math.prod(shape)).reshape(shape)


class Arena:
    """Arrays carved one after another out of one mapping advised MADV_HUGEPAGE: a model's repacked matrices, which
    on a small model are each under a huge page (all of SmolLM2-135M's but its embedding: ~18,000 faults of 4 KiB,
    most of its repacking) and so share huge pages rather than each fault in small ones. The mapping reserves
    `nbytes` and holds what is carved, to a huge page (a page never touched costs no memory); it lives while an
    array carved from it does. An array past its end gets a mapping of its own (`empty`)."""

    def __init__(self, nbytes: int) -> None:
        self._region = _advised(nbytes) if nbytes >= HUGE_PAGE and hasattr(mmap, "MADV_HUGEPAGE") else None
        self._used = 0

    def empty(self, shape: tuple[int, ...], dtype: np.dtype | type = np.uint8) -> np.ndarray:
        """An uninitialised array of the arena's, ALIGN-aligned; `empty`'s where it would not fit."""
        count = math.prod(shape)
        start = -(-self._used // ALIGN) * ALIGN
        end = start + count * np.dtype(dtype).itemsize
        if self._region is None or end > len(self._region):
            return empty(shape, dtype)
        self._used = end
        return np.frombuffer(self._region, dtype=dtype, count=count, offset=start).reshape(shape)


def _advised(nbytes: int) -> mmap.mmap:
    """An anonymous mapping of whole huge pages for `nbytes` (Linux aligns such a mapping to one), advised
    MADV_HUGEPAGE but for its last, partly used page."""
    whole = nbytes // HUGE_PAGE * HUGE_PAGE
    region = mmap.mmap(-1, -(-nbytes // HUGE_PAGE) * HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        region.madvise(mmap.MADV_HUGEPAGE, 0, whole)
        if whole < len(region):
            region.madvise(mmap.MADV_NOHUGEPAGE, whole, len(region) - whole)
    except OSError:  # a kernel without THP: small pages, as torch.empty's
        pass
    return region
