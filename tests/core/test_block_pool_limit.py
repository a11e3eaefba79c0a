"""BlockPool with a limit (elastic pools): unit tests and a hypothesis state machine for its invariants."""

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pagegate.core import BlockPool, NoFreeBlocksError

BS = 4
CAPACITY = 40


def test_a_limited_pool_hands_out_only_pages_below_its_limit():
    pool = BlockPool(16, BS, limit=4)
    assert (pool.num_blocks, pool.capacity, pool.num_free_blocks) == (4, 16, 4)
    assert sorted(pool.allocate(4).tolist()) == [0, 1, 2, 3]
    with pytest.raises(NoFreeBlocksError):
        pool.allocate(1)
    with pytest.raises(ValueError, match="out of range"):
        pool.free([4])


def test_growing_hands_out_the_lowest_new_pages_first():
    pool = BlockPool(300, BS, limit=2)
    pool.allocate(2)
    assert pool.set_limit(300) == 300
    taken = pool.allocate(3)
    assert taken.tolist() == [2, 3, 4]
    pool.free(taken[:1])
    assert pool.allocate(1).tolist() == [2]  # a freed page above base comes back before higher ones


def test_shrinking_stops_above_the_highest_page_in_use_and_evicts_cached_ones():
    pool = BlockPool(16, BS, limit=16)
    pool.record_evictions()
    pool.record_events()
    held = pool.allocate(10)
    pool.cache_block(9, 0, [1, 2, 3, 4])
    pool.free(held[8:])  # page 8 free, page 9 free and cached
    assert pool.set_limit(2) == 8  # page 7 is in use
    assert pool.num_blocks == 8 and pool.num_free_blocks == 0
    assert pool.take_evicted()[0].tolist() == [9]
    assert [event[0] for event in pool.take_events()] == ["BlockStored", "BlockRemoved"]
    pool.free(held[:8])
    assert pool.set_limit(2) == 2 and pool.num_free_blocks == 2


def test_the_limit_stays_within_the_capacity():
    pool = BlockPool(8, BS, limit=4)
    with pytest.raises(ValueError):
        pool.set_limit(9)
    with pytest.raises(ValueError):
        BlockPool(8, BS, limit=9)


def test_a_prefix_cached_below_the_limit_survives_a_shrink():
    pool = BlockPool(16, BS, limit=8)
    page = pool.allocate(1)
    h = pool.cache_block(int(page[0]), 0, [5, 6, 7, 8])
    pool.free(page)
    pool.set_limit(16)
    pool.set_limit(4)
    assert pool.block_hash(int(page[0])) == h
    assert pool.match_prefix([5, 6, 7, 8, 9])[1] == 4


class LimitMachine(RuleBasedStateMachine):
    """Random allocations, frees, caching and limit moves; the pool's counts checked against what is held."""

    def __init__(self):
        super().__init__()
        self.pool = BlockPool(CAPACITY, BS, limit=10)
        self.pool.record_evictions()
        self.held: list[int] = []  # one entry per reference taken
        self.next_token = 0

    @rule(n=st.integers(0, 12))
    def allocate(self, n):
        free = self.pool.num_free_blocks
        if n > free:
            with pytest.raises(NoFreeBlocksError):
                self.pool.allocate(n)
            return
        ids = self.pool.allocate(n).tolist()
        assert all(0 <= b < self.pool.num_blocks for b in ids)
        assert len(set(ids)) == len(ids) and not set(ids) & set(self.held)
        self.held += ids

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def free(self, data):
        index = data.draw(st.integers(0, len(self.held) - 1))
        self.pool.free([self.held.pop(index)])

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def cache(self, data):
        block = data.draw(st.sampled_from(self.held))
        self.next_token += 1
        self.pool.cache_block(block, 0, [self.next_token] * BS)

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def share(self, data):
        block = data.draw(st.sampled_from(self.held))
        self.pool.incref([block])
        self.held.append(block)

    @rule(n=st.integers(0, CAPACITY))
    def set_limit(self, n):
        before = {b: self.pool.refcount(b) for b in set(self.held)}
        reached = self.pool.set_limit(n)
        assert reached == max(n, max(self.held, default=-1) + 1)  # never below a page in use, else exactly n
        assert {b: self.pool.refcount(b) for b in set(self.held)} == before  # no used page taken
        self.pool.take_evicted()

    @invariant()
    def counts_add_up(self):
        pool, limit = self.pool, self.pool.num_blocks
        free = pool.free_block_ids().tolist()
        assert len(free) == len(set(free)) == pool.num_free_blocks
        assert all(b < limit for b in free) and all(b < limit for b in self.held)
        assert not set(free) & set(self.held)
        assert pool.num_free_blocks + len(set(self.held)) == limit  # free (cached ones too) + used == limit
        stats = pool.stats()
        assert stats.total == limit and stats.used == len(set(self.held))
        assert stats.cached_evictable == sum(pool.block_hash(b) is not None for b in free)
        assert all(pool.refcount(b) == 0 for b in free)

    def teardown(self):
        self.pool.free(self.held)
        assert self.pool.num_free_blocks == self.pool.num_blocks


TestLimitMachine = LimitMachine.TestCase
TestLimitMachine.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)
