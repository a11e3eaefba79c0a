"""Weight buffers on transparent huge pages.

A decode step streams every weight once, and on 4 KiB pages it takes a TLB miss every 4 KiB of it: a one-stream
decode of a 1B model runs ~1.09x faster from huge pages on the 2-core boxes (docs/performance.md). Linux's default
THP mode ("madvise") backs only the mappings that ask, and torch's allocator asks only under THP_MEM_ALLOC_ENABLE
(a process-wide switch read once). So the repacked weights get mappings of their own that ask (`empty`).
"""

from __future__ import annotations

import math
import mmap

import numpy as np

HUGE_PAGE = 2 << 20  # x86-64's PMD size


def empty(shape: tuple[int, ...], dtype: np.dtype | type = np.uint8) -> np.ndarray:
    """An uninitialised array on an anonymous mapping advised MADV_HUGEPAGE; numpy.empty's where the array is under
    a huge page or the platform has no such advice. The mapping is a whole number of huge pages (Linux aligns such
    an anonymous mapping to one) and its last, partly used one is advised back to small pages, so the array's
    resident size is its own (to 4 KiB) and no more. (torch.from_numpy shares it without a copy.)"""
    nbytes = math.prod(shape) * np.dtype(dtype).itemsize
    if nbytes < HUGE_PAGE or not hasattr(mmap, "MADV_HUGEPAGE"):
        return np.empty(shape, dtype=dtype)
    whole = nbytes // HUGE_PAGE * HUGE_PAGE
    region = mmap.mmap(-1, -(-nbytes // HUGE_PAGE) * HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        region.madvise(mmap.MADV_HUGEPAGE, 0, whole)
        if whole < len(region):
            region.madvise(mmap.MADV_NOHUGEPAGE, whole, len(region) - whole)
    except OSError:  # a kernel without THP: small pages, as torch.empty's
        pass
    return np.frombuffer(region, dtype=dtype, count=math.prod(shape)).reshape(shape)
