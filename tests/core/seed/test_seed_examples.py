"""The seed's examples (../shared/seed/seed_examples.py) run against pagegate.core.

Expected values are the seed's where it is right; where it is wrong, the comment says why.
"""

import pytest

from pagegate.core import BlockPool, BlockTables
from pagegate.core.seed.allocator import BlockAllocator


class SwapManager:
    """The seed's SwapManager, verbatim but for its Chinese print text: it drives BlockAllocator."""

    def __init__(self, gpu_allocator, cpu_pool_size=5000):
        self.gpu = gpu_allocator
        self.cpu_swap_map = {}
        self.cpu_free = list(range(cpu_pool_size))
        self.swapped_seqs = {}

    def swap_out(self, seq_id):
        if seq_id not in self.gpu.allocated_blocks:
            return
        blocks = self.gpu.allocated_blocks[seq_id]
        if len(self.cpu_free) < len(blocks):
            raise RuntimeError("CPU swap space exhausted")
        swapped = []
        for gpu_block in blocks:
            self.cpu_swap_map[gpu_block] = self.cpu_free.pop()
            swapped.append(gpu_block)
        self.gpu.free(seq_id)
        self.swapped_seqs[seq_id] = swapped


def test_block_allocator_example():
    allocator = BlockAllocator(num_blocks=1000)
    allocator.allocate(1, 10)
    allocator.share_blocks(1, 2, 5)
    allocator.allocate(2, 3)
    stats = allocator.stats()
    # the seed reports used=18: it counts the 5 shared pages twice; 13 physical pages are taken
    assert stats["used"] == 13 and stats["logical"] == 18 and stats["shared"] == 5
    assert stats["free"] == 987 and stats["total"] == 1000 and stats["utilization"] == "1.3%"
    assert allocator.allocated_blocks[2][:5] == allocator.allocated_blocks[1][:5]
    assert len(allocator.allocated_blocks[1]) == 10 and len(allocator.allocated_blocks[2]) == 8
    allocator.free(1)
    assert allocator.num_free_blocks == 992  # the 5 shared pages stay with sequence 2
    allocator.free(2)
    assert allocator.num_free_blocks == 1000


def test_swap_example_out_of_pages_is_an_error_not_a_success():
    alloc = BlockAllocator(num_blocks=100)
    alloc.allocate(1, 80)
    alloc.allocate(2, 15)
    assert alloc.stats()["free"] == 5
    SwapManager(alloc, cpu_pool_size=200).swap_out(1)
    assert alloc.stats()["free"] == 85
    # the seed then asks for 90 pages with 85 free and expects success: it cannot fit
    with pytest.raises(RuntimeError, match="needed 90, only 85 free"):
        alloc.allocate(3, 90)
    assert alloc.stats()["free"] == 85 and 3 not in alloc.allocated_blocks
    assert alloc.try_allocate(85) and not alloc.try_allocate(86)


def test_global_block_pool_example_figures():
    """The seed's GlobalBlockPool demo (500 -> 458 -> 440 -> 459 free) with BlockTables."""
    pool = BlockPool(500, 16)
    tables = BlockTables(pool, 8, 64)
    seqs = {}
    for seq_id, tokens in ((1, 200), (2, 150), (3, 300)):
        seqs[seq_id] = tables.add_sequence()
        tables.grow(seqs[seq_id], tokens)
    assert pool.num_free_blocks == 458
    for _ in range(100):
        assert tables.grow_many(list(seqs.values()), 1) == 3
    assert pool.num_free_blocks == 440
    tables.free_sequence(seqs[1])
    assert pool.num_free_blocks == 459


def test_free_unknown_sequence_is_a_no_op_like_the_seed():
    alloc = BlockAllocator(num_blocks=4)
    alloc.free(42)
    assert alloc.num_free_blocks == 4 and alloc.block_table(42) == []
