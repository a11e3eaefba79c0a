"""BlockPool: unit tests and a hypothesis state machine against the pure-Python oracle."""

import copy

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pagegate.core import BlockPool, NoFreeBlocksError, compute_block_hash

from .oracle import PoolModel

BS = 4


def test_allocate_is_all_or_nothing():
    pool = BlockPool(8, BS)
    pool.allocate(5)
    with pytest.raises(NoFreeBlocksError, match="needed 4, only 3 free"):
        pool.allocate(4)
    assert pool.num_free_blocks == 3


def test_allocate_returns_int32_arrays():
    ids = BlockPool(8, BS).allocate(3)
    assert ids.dtype == np.int32 and ids.tolist() == [0, 1, 2]


@pytest.mark.parametrize("bad", [[8], [-1], [0, 0], [1, 2, 99]])
def test_bad_free_raises_and_changes_nothing(bad):
    pool = BlockPool(8, BS)
    pool.allocate(2)  # pages 0 and 1, refcount 1
    before = (pool.free_block_ids().tolist(), [pool.refcount(i) for i in range(8)])
    with pytest.raises(ValueError):
        pool.free(bad)
    assert (pool.free_block_ids().tolist(), [pool.refcount(i) for i in range(8)]) == before


def test_free_rejects_non_integers():
    pool = BlockPool(4, BS)
    pool.allocate(1)
    with pytest.raises(ValueError, match="integers"):
        pool.free([0.5])


def test_uncached_pages_are_handed_out_before_cached_ones():
    pool = BlockPool(4, BS)
    a = pool.allocate(2)
    pool.cache_block(int(a[0]), 0, [1, 2, 3, 4])
    pool.free(a)
    # pages 2, 3 never used, then 1 (freed, uncached), then the cached page 0 last
    assert pool.free_block_ids().tolist() == [2, 3, 1, 0]
    assert pool.allocate(3).tolist() == [2, 3, 1]
    assert pool.block_hash(0) is not None
    pool.allocate(1)  # evicts page 0's content
    assert pool.block_hash(0) is None


def test_cached_pages_evict_least_recently_freed_first():
    pool = BlockPool(3, BS)
    ids = pool.allocate(3).tolist()
    for i, block in enumerate(ids):
        pool.cache_block(block, 0, [i] * BS)
    for block in [2, 0, 1]:
        pool.free([block])
    assert pool.allocate(1).tolist() == [2]
    assert pool.match_prefix([0] * BS)[1] == BS  # page 0 still cached, revived
    assert pool.match_prefix([2] * BS)[1] == 0  # page 2's content was evicted


def test_prefix_hit_revives_free_page_and_counts_tokens():
    pool = BlockPool(8, BS)
    a = pool.allocate(2).tolist()
    h = pool.cache_block(a[0], 0, [1, 2, 3, 4])
    pool.cache_block(a[1], h, [5, 6, 7, 8])
    pool.free(a)
    blocks, n = pool.match_prefix([1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert blocks.tolist() == a and n == 8
    assert pool.refcount(a[0]) == 1 and pool.num_free_blocks == 6
    stats = pool.stats()
    assert stats.prefix_cache_hits == 8 and stats.prefix_cache_queries == 9


def test_root_hash_salts_the_chain():
    pool = BlockPool(4, BS)
    a = pool.allocate(1).tolist()
    pool.cache_block(a[0], 111, [1, 2, 3, 4])
    assert pool.match_prefix([1, 2, 3, 4], root_hash=222)[1] == 0
    assert pool.match_prefix([1, 2, 3, 4], root_hash=111)[1] == 4


def test_hash_collision_is_never_served():
    pool = BlockPool(64, BS, hash_bits=3)  # 8 possible hashes: collisions are certain
    target = compute_block_hash(0, [7] * BS) & 7
    collider = next([i] * BS for i in range(100) if i != 7 and compute_block_hash(0, [i] * BS) & 7 == target)
    block = int(pool.allocate(1)[0])
    assert pool.cache_block(block, 0, [7] * BS) == target
    assert pool.match_prefix(collider)[1] == 0  # same hash, other tokens: a miss
    assert pool.match_prefix([7] * BS)[1] == BS


def test_stats_report_shared_and_evictable_pages():
    pool = BlockPool(8, BS)
    a = pool.allocate(3).tolist()
    pool.incref(a[:2])
    pool.cache_block(a[2], 0, [1, 1, 1, 1])
    pool.free([a[2]])
    stats = pool.stats()
    assert stats.used == 2 and stats.free == 6 and stats.shared == 2
    assert stats.cached_evictable == 1 and stats.utilization == 2 / 8


tokens_st = st.lists(st.integers(0, 2), min_size=BS, max_size=BS)


def cached_content(pages: tuple) -> dict[int, tuple]:
    ids, hashes, parents, firsts, tokens = pages
    rows = zip(ids, hashes, parents, firsts, tokens, strict=True)
    return {int(b): (int(h), int(p), bool(f), tuple(t)) for b, h, p, f, t in rows}


def test_prefix_hashes_are_the_chain_cache_block_computes():
    pool = BlockPool(8, BS)
    tokens = list(range(3 * BS + 2))
    parent, expected = 7, []
    for i in range(3):
        parent = compute_block_hash(parent, tokens[i * BS:(i + 1) * BS])
        expected.append(parent)
    assert pool.prefix_hashes(tokens, 7).tolist() == expected


def test_cached_blocks_and_the_eviction_log_keep_first_pages_apart():
    pool = BlockPool(2, BS)
    pool.record_evictions()
    a, b = pool.allocate(2).tolist()
    h = pool.cache_block(a, 5, [1] * BS, first=True)
    pool.cache_block(b, h, [2] * BS)
    assert cached_content(pool.cached_blocks()) == {a: (h, 5, True, (1,) * BS), b: (pool.block_hash(b), h, False,
                                                                                     (2,) * BS)}
    pool.free([a, b])
    pool.allocate(1)  # the chain's tail goes first
    assert cached_content(pool.take_evicted()) == {b: (compute_block_hash(h, [2] * BS), h, False, (2,) * BS)}


class PoolMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.pool = BlockPool(12, BS, hash_bits=6)
        self.model = PoolModel(12, BS, hash_bits=6)
        self.hashes = [0]
        self.pool.record_evictions()

    def held(self):
        return [b for b in range(12) for _ in range(self.model.refs[b])]

    @rule(n=st.integers(0, 14))
    def allocate(self, n):
        before = cached_content(self.pool.cached_blocks())
        try:
            expected = self.model.allocate(n)
        except NoFreeBlocksError:
            with pytest.raises(NoFreeBlocksError):
                self.pool.allocate(n)
            return
        assert self.pool.allocate(n).tolist() == expected
        # the eviction log: exactly the cached pages this allocation took, with the content they held
        evicted = cached_content(self.pool.take_evicted())
        still = cached_content(self.pool.cached_blocks())
        assert evicted == {b: c for b, c in before.items() if b not in still and b in expected}
        assert cached_content(self.pool.take_evicted()) == {}

    @rule(data=st.data())
    def free(self, data):
        candidates = self.held() + [0, 5, 11, 12, -1]
        ids = data.draw(st.lists(st.sampled_from(candidates), max_size=6))
        self.same_outcome(self.model.free, self.pool.free, ids)

    @precondition(lambda self: any(self.model.refs))
    @rule(data=st.data())
    def incref(self, data):
        ids = data.draw(st.lists(st.sampled_from(self.held() + [12]), max_size=4))
        self.same_outcome(self.model.incref, self.pool.incref, ids)

    @precondition(lambda self: any(self.model.refs))
    @rule(data=st.data(), tokens=tokens_st)
    def cache_block(self, data, tokens):
        block = data.draw(st.sampled_from(self.held()))
        parent = data.draw(st.sampled_from(self.hashes))
        h = self.model.cache_block(block, parent, tokens)
        assert self.pool.cache_block(block, parent, tokens) == h
        self.hashes.append(h)

    @rule(chunks=st.lists(tokens_st, max_size=3), extra=st.integers(0, BS - 1))
    def match_prefix(self, chunks, extra):
        tokens = [t for c in chunks for t in c] + [1] * extra
        blocks, n = self.pool.match_prefix(tokens)
        assert (blocks.tolist(), n) == self.model.match_prefix(tokens)

    @rule(chunks=st.lists(tokens_st, max_size=3), extra=st.integers(0, BS - 1))
    def cached_prefix_tokens(self, chunks, extra):
        """What match_prefix would find, found without a reference or a query counted (matches_model checks)."""
        tokens = [t for c in chunks for t in c] + [1] * extra
        assert self.pool.cached_prefix_tokens(tokens) == copy.deepcopy(self.model).match_prefix(tokens)[1]

    def same_outcome(self, model_op, pool_op, ids):
        try:
            model_op(ids)
        except ValueError:
            with pytest.raises(ValueError):
                pool_op(ids)
            return
        pool_op(ids)

    @invariant()
    def matches_model(self):
        pool, model = self.pool, self.model
        assert pool.num_free_blocks == model.num_free
        assert pool.free_block_ids().tolist() == model.free_order()
        assert [pool.refcount(b) for b in range(12)] == model.refs
        free = set(pool.free_block_ids().tolist())
        assert not any(model.refs[b] for b in free)  # no page both free and referenced
        stats = pool.stats()
        assert stats.used + stats.free == 12
        assert stats.shared == sum(r > 1 for r in model.refs)
        assert stats.cached_evictable == len(model.cached_free)
        assert (stats.prefix_cache_hits, stats.prefix_cache_queries) == (model.hits, model.queries)

    def teardown(self):
        self.pool.free(self.held())
        assert self.pool.num_free_blocks == 12


TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
