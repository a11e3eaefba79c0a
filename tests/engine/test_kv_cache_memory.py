"""The KV pages cost memory as they are used: a CPU pool is allocated untouched, and release_pages gives a range's
memory back (what an elastic pool's shrink relies on). Measured as this process's resident set."""

import mmap
from pathlib import Path

import numpy as np
import torch

from pagegate.engine.kv_cache import PagedKVCache
from pagegate.kernels.kv_format import FORMATS

MIB = 2**20


def resident_bytes() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * mmap.PAGESIZE


def make_cache(fmt: str, num_blocks: int) -> PagedKVCache:
    return PagedKVCache(2, num_blocks, 16, 4, 64, FORMATS[fmt], torch.device("cpu"))


def test_a_pool_costs_nothing_until_its_pages_are_written_and_reads_as_zeros():
    before = resident_bytes()
    cache = make_cache("float32", 2048)  # 2 layers x K, V x 2048 pages x 16 KiB = 128 MiB
    assert resident_bytes() - before < 16 * MIB
    assert all(not t[::97].any() for pair in cache.layers for t in pair)


def test_released_pages_give_their_memory_back_and_read_as_zeros_again():
    cache = make_cache("int8", 4096)  # the scales live inside the rows: 2 x 2 x 4096 x 16 x 4 x 68 B = 68 MiB
    before = resident_bytes()
    for k, v in cache.layers:
        k.view(torch.uint8).fill_(1)
        v.view(torch.uint8).fill_(1)
    written = resident_bytes()
    assert written - before > 60 * MIB
    cache.release_pages(1024, 4096)
    assert written - resident_bytes() > 45 * MIB  # three quarters of the pages went back
    k = cache.layers[0][0].view(torch.uint8)
    assert k[:1024].all() and not k[1025:4095].any()  # whole OS pages inside the range (not the ends)
    data = cache.read_pages(np.array([3], dtype=np.int32))
    cache.write_pages(np.array([4000], dtype=np.int32), data)  # a released page is usable again
    assert torch.equal(cache.read_pages(np.array([4000], dtype=np.int32)), data)
