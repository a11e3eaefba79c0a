"""The seed-compatible BlockAllocator: edge cases, and a hypothesis state machine against two models.

The models: the pool oracle plus plain lists (predicts every page id and the free order) and the
seed's own allocator (must agree on every count where the seed is right).
"""

from collections import Counter
from collections.abc import Mapping

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from pagegate.core import NoFreeBlocksError
from pagegate.core.seed.allocator import BlockAllocator
from pagegate.testing.seed_allocator import BlockAllocator as SeedAllocator

from ..oracle import PoolModel


def snapshot(alloc: BlockAllocator) -> tuple:
    tables = {seq: alloc.block_table(seq) for seq in alloc.allocated_blocks}
    return tables, alloc.free_blocks, alloc.stats()


def test_allocate_returns_new_pages_and_tables_are_copies():
    alloc = BlockAllocator(8)
    first, second = alloc.allocate("a", 3), alloc.allocate("a", 2)
    assert alloc.block_table("a") == first + second and len(set(first + second)) == 5
    first.append(99)
    alloc.block_table("a").clear()
    alloc.allocated_blocks["a"].clear()
    assert alloc.block_table("a") == first[:3] + second


def test_out_of_pages_changes_nothing():
    alloc = BlockAllocator(6)
    alloc.allocate(1, 4)
    before = snapshot(alloc)
    for seq in (1, 2):
        with pytest.raises(NoFreeBlocksError, match="needed 3, only 2 free") as err:
            alloc.allocate(seq, 3)
        assert isinstance(err.value, RuntimeError)
    with pytest.raises(ValueError, match="negative"):
        alloc.allocate(2, -1)
    assert snapshot(alloc) == before and 2 not in alloc.allocated_blocks
    with pytest.raises(OverflowError):
        alloc.allocate(2, 2**40)
    assert snapshot(alloc) == before


def test_zero_pages_still_registers_the_sequence():
    alloc = BlockAllocator(4)
    assert alloc.allocate(7, 0) == []
    assert 7 in alloc.allocated_blocks and alloc.block_table(7) == []
    alloc.allocate(1, 1)
    with pytest.raises(ValueError, match="already holds pages"):
        alloc.share_blocks(1, 7, 1)


def test_share_blocks_errors_and_slice_semantics():
    alloc = BlockAllocator(10)
    pages = alloc.allocate(0, 4)
    with pytest.raises(KeyError):
        alloc.share_blocks(5, 6, 1)
    with pytest.raises(ValueError):
        alloc.share_blocks(0, 0, 1)
    alloc.share_blocks(0, 1, -1)  # like the seed's `[:num_shared]`
    alloc.share_blocks(0, 2, 100)
    alloc.share_blocks(0, 3, 0)
    assert alloc.block_table(1) == pages[:-1] and alloc.block_table(2) == pages and alloc.block_table(3) == []
    assert alloc.stats() == {"total": 10, "free": 6, "used": 4, "logical": 11, "shared": 4,
                             "utilization": "40.0%"}
    alloc.free(0)
    alloc.free(2)
    assert alloc.stats()["shared"] == 0 and alloc.num_free_blocks == 7


def test_free_unknown_is_a_no_op_and_new_tables_start_empty():
    alloc = BlockAllocator(64)
    alloc.free("nobody")
    for seq in range(100):
        alloc.allocate(seq, 1 + seq % 5)
        alloc.free(seq - 1)
    assert alloc.allocated_blocks.keys() == {99} and len(alloc.block_table(99)) == 5
    assert alloc.num_free_blocks == 59


def test_allocated_blocks_is_a_read_only_mapping_of_copies():
    alloc = BlockAllocator(8)
    alloc.allocate(1, 2)
    alloc.allocate(2, 1)
    view = alloc.allocated_blocks
    assert isinstance(view, Mapping) and dict(view) == {1: [0, 1], 2: [2]} and len(view) == 2
    assert view.get(3) is None and 3 not in view
    with pytest.raises(TypeError):
        view[3] = [4]


def test_long_tables_grow():
    alloc = BlockAllocator(5000)
    for _ in range(4000):
        alloc.allocate(0, 1)
    assert alloc.block_table(0) == list(range(4000))
    assert alloc.free_blocks == list(range(4000, 5000))


def test_bad_arguments():
    with pytest.raises(ValueError):
        BlockAllocator(0)
    alloc = BlockAllocator(4)
    alloc.allocate(0, 1)
    with pytest.raises(TypeError):
        alloc.allocate([1], 1)  # unhashable sequence id
    with pytest.raises(TypeError):
        alloc.share_blocks(0, 1, 0.5)
    alloc.share_blocks(0, 1, None)
    assert alloc.block_table(1) == alloc.block_table(0) == [0]


NUM_BLOCKS = 16
seqs = st.integers(0, 5)
counts = st.integers(0, 7)


class AllocatorMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.alloc = BlockAllocator(NUM_BLOCKS)
        self.seed = SeedAllocator(NUM_BLOCKS)
        self.pool = PoolModel(NUM_BLOCKS, 16, caching=False)
        self.tables: dict[int, list[int]] = {}

    @rule(seq=seqs, n=counts)
    def allocate(self, seq, n):
        if n > self.pool.num_free:
            before = snapshot(self.alloc)
            with pytest.raises(NoFreeBlocksError):
                self.alloc.allocate(seq, n)
            with pytest.raises(RuntimeError):
                self.seed.allocate(seq, n)
            assert snapshot(self.alloc) == before
            return
        expected = self.pool.allocate(n)
        self.tables.setdefault(seq, []).extend(expected)
        assert self.alloc.allocate(seq, n) == expected
        self.seed.allocate(seq, n)

    @rule(seq=seqs)
    def free(self, seq):
        if seq in self.tables:
            self.pool.free(self.tables.pop(seq))
        self.alloc.free(seq)
        self.seed.free(seq)

    @rule(src=seqs, dst=seqs, n=st.integers(-3, 8))
    def share(self, src, dst, n):
        if src not in self.tables:
            with pytest.raises(KeyError):
                self.alloc.share_blocks(src, dst, n)
        elif dst in self.tables:
            with pytest.raises(ValueError):
                self.alloc.share_blocks(src, dst, n)
        else:
            shared = self.tables[src][:n]
            self.pool.incref(shared)
            self.tables[dst] = list(shared)
            self.alloc.share_blocks(src, dst, n)
            self.seed.share_blocks(src, dst, n)

    @rule(n=counts)
    def try_allocate(self, n):
        assert self.alloc.try_allocate(n) == self.seed.try_allocate(n) == (n <= self.pool.num_free)

    @invariant()
    def tables_match(self):
        assert dict(self.alloc.allocated_blocks) == self.tables
        assert {seq: self.alloc.block_table(seq) for seq in self.tables} == self.tables
        assert {seq: len(t) for seq, t in self.seed.allocated_blocks.items()} == {
            seq: len(t) for seq, t in self.tables.items()}

    @invariant()
    def pages_and_counts_agree(self):
        held = Counter(page for table in self.tables.values() for page in table)
        assert all(len(set(table)) == len(table) for table in self.tables.values())
        for page in range(NUM_BLOCKS):
            # a page is held once per holder: in two tables only when shared, in none when free
            assert self.alloc.pool.refcount(page) == self.pool.refs[page] == held[page]
        free = self.alloc.free_blocks
        assert free == self.pool.free_order() and not set(free) & set(held)
        assert len(free) == self.alloc.num_free_blocks == len(self.seed.free_blocks)
        stats = self.alloc.stats()
        assert stats["free"] + stats["used"] == stats["total"] == NUM_BLOCKS
        assert stats["used"] == len(held)
        assert stats["logical"] == held.total() == sum(len(t) for t in self.seed.allocated_blocks.values())
        assert stats["shared"] == sum(count > 1 for count in held.values())


TestAllocatorMachine = AllocatorMachine.TestCase
TestAllocatorMachine.settings = settings(max_examples=200, stateful_step_count=50, deadline=None)
