"""Weight buffers on transparent huge pages: the mapping asks for them, its partly used tail does not."""

from __future__ import annotations

import gc
import itertools
import mmap
import os
import sys
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from pagegate.kernels import cpu_quant, huge_pages
from pagegate.kernels.huge_pages import HUGE_PAGE

THP = Path("/sys/kernel/mm/transparent_hugepage")
pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux") or not hasattr(mmap, "MADV_HUGEPAGE") or not THP.is_dir(),
    reason="transparent huge pages (madvise MADV_HUGEPAGE, the VmFlags of /proc/self/smaps) exist only on a Linux "
           "kernel built with them; elsewhere huge_pages.empty is numpy.empty, which the other kernel tests cover")


def smaps_field(address: int, field: str) -> list[str] | None:
    """The words of `field` (e.g. "Rss:") of this process's mapping that holds `address` (/proc/self/smaps), None if
    no mapping does."""
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(part, 16) for part in head.split("-"))
                inside = start <= address < end
            elif inside and head == field:
                return line.split()[1:]
    return None


def mapping_flags(address: int) -> set[str] | None:
    """The VmFlags of this process's mapping that holds `address`, None if none does."""
    flags = smaps_field(address, "VmFlags:")
    return None if flags is None else set(flags)


def test_small_arrays_are_numpys_own() -> None:
    array = huge_pages.empty((3, 1000), np.float32)
    assert array.shape == (3, 1000) and array.dtype == np.float32
    assert "hg" not in (mapping_flags(array.ctypes.data) or set())


@pytest.mark.parametrize("nbytes", [HUGE_PAGE, 5 * HUGE_PAGE // 2])
def test_a_large_tensor_asks_for_huge_pages_but_its_partial_tail(nbytes: int) -> None:
    tensor = huge_pages.empty((nbytes // 2, 2))
    assert tensor.shape == (nbytes // 2, 2) and tensor.dtype == np.uint8 and tensor.flags.c_contiguous
    tensor.fill(7)
    assert int(tensor.sum(dtype=np.int64)) == 7 * nbytes
    first, last = tensor.ctypes.data, tensor.ctypes.data + nbytes - 1
    assert "hg" in mapping_flags(first)
    assert ("nh" in mapping_flags(last)) == (nbytes % HUGE_PAGE != 0)
    del tensor
    gc.collect()
    assert mapping_flags(first) is None  # unmapped with the tensor


def test_repacked_weights_live_on_huge_pages() -> None:
    rows, blocks_per_row = 8 * 1024, 16  # 8,192 rows of 512 Q8_0 weights: 4.4 MB
    blocks = np.random.default_rng(0).integers(0, 256, (rows, blocks_per_row * 34), dtype=np.uint8)
    repacked, _ = cpu_quant.interleaved(blocks, int(Q.Q8_0))
    assert "hg" in mapping_flags(repacked.ctypes.data)
    panels, _ = cpu_quant.panels(np.zeros((1024, 4096), np.uint8), int(Q.F32))
    assert "hg" in mapping_flags(panels.ctypes.data)


def test_an_arena_carves_arrays_side_by_side_and_asks_for_huge_pages_once_they_are_written() -> None:
    """A model's matrices, each under a huge page, share them: one after another (on cache lines) in one mapping,
    which asks for huge pages over the whole ones carved once they are written (not at the faults: huge_pages'
    NOTE); one past its end gets a mapping of its own, and a small arena is numpy's."""
    arena = huge_pages.Arena(3 * HUGE_PAGE)
    first, second = arena.empty((1000, 3)), arena.empty((5, 7), np.float32)
    assert first.shape == (1000, 3) and second.shape == (5, 7) and second.dtype == np.float32
    assert second.ctypes.data == first.ctypes.data + 3008 and second.ctypes.data % huge_pages.ALIGN == 0
    assert first.ctypes.data % HUGE_PAGE == 0
    first.fill(1)
    second.fill(2.0)
    assert int(first.sum()) == 3000 and float(second.sum()) == 70.0
    arena.written()  # less than a huge page carved: nothing to ask for
    assert "hg" not in mapping_flags(first.ctypes.data)
    third = arena.empty((HUGE_PAGE,))
    third.fill(3)
    assert "hg" not in mapping_flags(third.ctypes.data)
    arena.written()
    assert "hg" in mapping_flags(first.ctypes.data)
    assert "hg" not in mapping_flags(third.ctypes.data + HUGE_PAGE - 1)  # in the partly carved second huge page
    beyond = arena.empty((3 * HUGE_PAGE,))
    assert not first.ctypes.data <= beyond.ctypes.data < first.ctypes.data + 3 * HUGE_PAGE
    assert "hg" in mapping_flags(beyond.ctypes.data)
    assert "hg" not in (mapping_flags(huge_pages.Arena(HUGE_PAGE - 1).empty((10,)).ctypes.data) or set())


def kernel_version() -> tuple[int, int]:
    """The running Linux kernel's (major, minor), from its release string ("6.18.44-...")."""
    major, minor = os.uname().release.split(".")[:2]
    return int(major), int("".join(itertools.takewhile(str.isdigit, minor)) or 0)


def resident_bytes(address: int) -> int:
    """The Rss of this process's mapping that holds `address`."""
    rss = smaps_field(address, "Rss:")
    assert rss is not None, "no mapping holds the address"
    return int(rss[0]) * 1024


def test_a_populating_arena_faults_each_array_in_as_it_is_carved_and_no_more() -> None:
    """A GGUF load's arena faults each array's pages in by one call as it carves it (MADV_POPULATE_WRITE), not a
    fault a page as the repack writes them; what is not carved stays unbacked."""
    if kernel_version() < (5, 14):
        pytest.skip("MADV_POPULATE_WRITE came in Linux 5.14: before it the arena faults each page in as it is "
                    "written, which the other tests cover")
    arena = huge_pages.Arena(3 * HUGE_PAGE, populate=True)
    first = arena.empty((HUGE_PAGE // 2,))
    assert resident_bytes(first.ctypes.data) == HUGE_PAGE // 2
    second = arena.empty((3 * mmap.PAGESIZE,))
    assert resident_bytes(first.ctypes.data) == HUGE_PAGE // 2 + 3 * mmap.PAGESIZE
    assert not first.any() and not second.any()  # zeros, as any fresh page


def test_float_panels_go_where_they_are_told() -> None:
    """A GGUF's float matrices are paneled into its arena (gguf_native), as its blocks are: huge pages once written."""
    arena = huge_pages.Arena(3 * HUGE_PAGE)
    values = np.random.default_rng(0).standard_normal((1024, 512)).astype(np.float32)
    paneled, _ = cpu_quant.panels(values.view(np.uint8), int(Q.F32), arena.empty)
    expected, _ = cpu_quant.panels(values.view(np.uint8), int(Q.F32))
    assert np.array_equal(paneled, expected) and "hg" not in mapping_flags(paneled.ctypes.data)
    arena.written()
    assert "hg" in mapping_flags(paneled.ctypes.data)


def test_a_loaded_gguf_model_asks_for_huge_pages_for_its_repacked_weights(smollm2_gguf: Path) -> None:
    from pagegate.engine.loading.gguf_file import GGUFFile
    from pagegate.engine.loading.gguf_native import load_native

    model = load_native(GGUFFile(smollm2_gguf))
    _, rows, _ = model.layers[0][2]  # layer 0's q/k/v blocks, carved early in the arena
    assert "hg" in mapping_flags(rows.ctypes.data)
