"""Weight buffers on transparent huge pages.

A decode step streams every weight once, and on 4 KiB pages it takes a TLB miss every 4 KiB of it: a one-stream
decode of a 1B model runs ~1.09x faster from huge pages on the 2-core boxes (docs/performance.md). Linux's default
THP mode ("madvise") backs only the mappings that ask, and torch's allocator asks only under THP_MEM_ALLOC_ENABLE
(a process-wide switch read once). So the repacked weights get mappings of their own that ask (`empty`), or, a
model's many matrices under a huge page each, share one (`Arena`).

NOTE: an Arena asks only once its arrays are written (`Arena.written`): khugepaged then collapses them in the
background. A huge page taken at the fault is a free 2 MiB block, which a VM with free page reporting (virtio-balloon,
order 9: the 2-core boxes) has handed back to its host: touching it faults the host in too. Faulting SmolLM2's 92 MB
of repacked weights so took 0.06-0.39 s of a start-up in a fresh process, small pages 0.11-0.20 s (`pagegate serve`
healthy 0.765 -> 0.722 s, medians of 8 alternating launches).
"""

from __future__ import annotations

import contextlib
import math
import mmap

import numpy as np

HUGE_PAGE = 2 << 20  # x86-64's PMD size
ALIGN = 64  # an Arena's arrays start on cache lines
MADV_POPULATE_WRITE = 23  # Linux 5.14's: fault a range in, writable, in one call (not in Python 3.11's mmap)


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
    """Arrays carved one after another out of one mapping that asks for huge pages once they are written: a model's
    repacked matrices, which on a small model are each under a huge page (all of SmolLM2-135M's but its embedding)
    and so share huge pages rather than each keep small ones. The mapping reserves `nbytes` and holds what is carved
    (a page never touched costs no memory); it lives while an array carved from it does. An array past its end gets
    a mapping of its own (`empty`)."""

    def __init__(self, nbytes: int, populate: bool = False) -> None:
        big = nbytes >= HUGE_PAGE and hasattr(mmap, "MADV_HUGEPAGE")
        self._region = _mapping(nbytes) if big else None
        self._populate = populate  # each array's pages faulted in as it is carved, by one call
        self._used = 0
        self._advised = 0  # the bytes advised MADV_HUGEPAGE so far (whole huge pages)

    def written(self) -> None:
        """The arrays carved so far are written: their whole huge pages are advised MADV_HUGEPAGE (the last, partly
        carved one is not, so the resident size stays the arrays' own), for khugepaged to collapse in the
        background (the module's NOTE)."""
        whole = self._used // HUGE_PAGE * HUGE_PAGE
        if self._region is None or whole <= self._advised:
            return
        with contextlib.suppress(OSError):  # a kernel without THP: small pages
            self._region.madvise(mmap.MADV_HUGEPAGE, self._advised, whole - self._advised)
        self._advised = whole

    def empty(self, shape: tuple[int, ...], dtype: np.dtype | type = np.uint8) -> np.ndarray:
        """An uninitialised array of the arena's, ALIGN-aligned; `empty`'s where it would not fit."""
        count = math.prod(shape)
        start = -(-self._used // ALIGN) * ALIGN
        end = start + count * np.dtype(dtype).itemsize
        if self._region is None or end > len(self._region):
            return empty(shape, dtype)
        self._used = end
        if self._populate and end > start:
            first = start // mmap.PAGESIZE * mmap.PAGESIZE
            with contextlib.suppress(OSError):  # a kernel before 5.14: a fault a page as the array is written
                self._region.madvise(MADV_POPULATE_WRITE, first, end - first)
        return np.frombuffer(self._region, dtype=dtype, count=count, offset=start).reshape(shape)


def _advised(nbytes: int) -> mmap.mmap:
    """An anonymous mapping of whole huge pages for `nbytes` (Linux aligns such a mapping to one), advised
    MADV_HUGEPAGE but for its last, partly used page."""
    whole = nbytes // HUGE_PAGE * HUGE_PAGE
    region = _mapping(nbytes)
    try:
        region.madvise(mmap.MADV_HUGEPAGE, 0, whole)
        if whole < len(region):
            region.madvise(mmap.MADV_NOHUGEPAGE, whole, len(region) - whole)
    except OSError:  # a kernel without THP: small pages, as torch.empty's
        pass
    return region


def _mapping(nbytes: int) -> mmap.mmap:
    """An anonymous mapping of whole huge pages for `nbytes`: Linux aligns such a mapping to one."""
    return mmap.mmap(-1, -(-nbytes // HUGE_PAGE) * HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
