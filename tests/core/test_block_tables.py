"""Block tables, copy-on-write, swap bookkeeping and the batch builder, against the oracle."""

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pagegate.core import BatchBuilder, BlockPool, BlockTables, NoFreeBlocksError

from .oracle import PoolModel, TablesModel

BS = 4


def make(num_blocks=16, cpu_blocks=None, max_seqs=8, max_blocks=8):
    cpu = BlockPool(cpu_blocks, BS, enable_prefix_caching=False) if cpu_blocks else None
    pool = BlockPool(num_blocks, BS)
    return pool, BlockTables(pool, max_seqs, max_blocks, cpu)


def test_grow_takes_a_page_exactly_when_the_last_is_full():
    pool, tables = make()
    seq = tables.add_sequence()
    added = [tables.grow(seq, 1) for _ in range(9)]
    assert added == [1, 0, 0, 0, 1, 0, 0, 0, 1]
    assert tables.num_blocks(seq) == 3 and tables.num_tokens(seq) == 9


def test_grow_is_all_or_nothing():
    pool, tables = make(num_blocks=4)
    seq = tables.add_sequence()
    with pytest.raises(NoFreeBlocksError):
        tables.grow(seq, 17)
    assert tables.num_tokens(seq) == 0 and pool.num_free_blocks == 4


def test_fork_shares_pages_and_copy_on_write_reports_pairs():
    pool, tables = make()
    parent = tables.add_sequence()
    tables.grow(parent, 6)  # pages [0, 1], page 1 half full
    child = tables.fork(parent)
    assert pool.refcount(0) == 2 and pool.refcount(1) == 2
    tables.grow(child, 1)  # writes into shared page 1: copy first
    assert tables.take_cow_pairs().tolist() == [[1, 2]]
    assert tables.block_ids(child).tolist() == [0, 2] and pool.refcount(1) == 1
    tables.grow(parent, 1)  # page 1 is now private to the parent: no copy
    assert tables.take_cow_pairs().shape == (0, 2)


def test_full_shared_pages_are_never_copied():
    pool, tables = make()
    parent = tables.add_sequence()
    tables.grow(parent, 8)
    child = tables.fork(parent)
    tables.grow(child, 1)
    assert tables.take_cow_pairs().shape == (0, 2)
    assert tables.block_ids(child).tolist()[:2] == tables.block_ids(parent).tolist()


def test_swap_out_and_in_restore_the_table():
    pool, tables = make(num_blocks=8, cpu_blocks=8)
    seq = tables.add_sequence()
    tables.grow(seq, 10)
    device = tables.block_ids(seq).tolist()
    out = tables.swap_out(seq)
    assert out[:, 0].tolist() == device and pool.num_free_blocks == 8 and tables.is_swapped(seq)
    with pytest.raises(ValueError, match="swapped out"):
        tables.grow(seq, 1)
    back = tables.swap_in(seq)
    assert back[:, 0].tolist() == out[:, 1].tolist()
    assert tables.block_ids(seq).tolist() == back[:, 1].tolist() and tables.num_tokens(seq) == 10
    assert tables.cpu_pool.num_free_blocks == 8


def test_swap_out_without_cpu_room_changes_nothing():
    pool, tables = make(num_blocks=8, cpu_blocks=2)
    seq = tables.add_sequence()
    tables.grow(seq, 10)
    with pytest.raises(NoFreeBlocksError):
        tables.swap_out(seq)
    assert not tables.is_swapped(seq) and pool.num_free_blocks == 5


def test_grow_many_stops_at_the_first_that_does_not_fit():
    pool, tables = make(num_blocks=3)
    seqs = [tables.add_sequence() for _ in range(3)]
    for s in seqs[:2]:
        tables.grow(s, 4)
    assert tables.grow_many(seqs, 1) == 1  # seqs[0] takes the last page; seqs[1] cannot
    assert [tables.num_tokens(s) for s in seqs] == [5, 4, 0]


def test_builder_mixes_prefill_chunks_and_decodes():
    pool, tables = make(num_blocks=16)
    a, b = tables.add_sequence(), tables.add_sequence()
    tables.grow(a, 6)  # prefill chunk of 6
    tables.grow(b, 9)
    builder = BatchBuilder(tables, 4, 32)
    bt, slots, pos, lens, qsl = builder.build([a, b], [6, 1])  # b decodes its 9th token
    ta, tb = tables.block_ids(a).tolist(), tables.block_ids(b).tolist()
    assert bt.tolist() == [ta + [0], tb]
    assert pos.tolist() == [0, 1, 2, 3, 4, 5, 8]
    expect = [ta[p // BS] * BS + p % BS for p in range(6)] + [tb[2] * BS]
    assert slots.tolist() == expect and slots.dtype == np.int64
    assert lens.tolist() == [6, 9] and qsl.tolist() == [0, 6, 7]


def test_builder_rejects_bad_batches():
    pool, tables = make()
    seq = tables.add_sequence()
    tables.grow(seq, 3)
    builder = BatchBuilder(tables, 2, 4)
    with pytest.raises(ValueError, match="query length"):
        builder.build([seq], [4])
    with pytest.raises(ValueError, match="no sequence"):
        builder.build([5], [1])


class TablesMachine(RuleBasedStateMachine):
    """Random add / grow / fork / free / swap sequences: the C tables match the oracle."""

    def __init__(self):
        super().__init__()
        self.pool = BlockPool(20, BS, hash_bits=8)
        cpu = BlockPool(10, BS, enable_prefix_caching=False)
        self.tables = BlockTables(self.pool, 6, 24, cpu)  # more pages per row than the pool has
        self.model = TablesModel(PoolModel(20, BS, hash_bits=8), PoolModel(10, BS, caching=False))
        self.builder = BatchBuilder(self.tables, 6, 20 * BS * 6)

    def live(self, swapped=False):
        return [h for h, s in self.model.seqs.items() if s["swapped"] == swapped]

    @precondition(lambda self: len(self.model.seqs) < 6)
    @rule(prompt=st.lists(st.integers(0, 1), max_size=3 * BS), root=st.sampled_from([0, 7]))
    def add(self, prompt, root):
        """A new sequence starting from its prompt's prefix-cache hits."""
        blocks, n = self.tables.pool.match_prefix(prompt, root_hash=root)
        assert (blocks.tolist(), n) == self.model.pool.match_prefix(prompt, root)
        handle = self.tables.add_sequence(blocks, n, root_hash=root)
        assert handle not in self.model.seqs
        self.model.add(handle, blocks.tolist(), n, root)

    @precondition(lambda self: self.live())
    @rule(data=st.data())
    def commit(self, data):
        handle = data.draw(st.sampled_from(self.live()))
        seq = self.model.seqs[handle]
        tokens = data.draw(st.lists(st.integers(0, 1), max_size=seq["tokens"] - seq["committed"]))
        self.tables.commit(handle, tokens)
        self.model.commit(handle, tokens)

    @precondition(lambda self: self.live())
    @rule(data=st.data(), k=st.integers(0, 9))
    def grow(self, data, k):
        handle = data.draw(st.sampled_from(self.live()))
        assert self.tables.pages_needed(handle, k) == self.model.pages_needed(handle, k)
        try:
            self.model.grow(handle, k)
        except NoFreeBlocksError:
            with pytest.raises(NoFreeBlocksError):
                self.tables.grow(handle, k)
            return
        self.tables.grow(handle, k)
        self.check_cow()

    @precondition(lambda self: self.live())
    @rule(data=st.data(), k=st.integers(0, 9))
    def append(self, data, k):
        handle = data.draw(st.sampled_from(self.live()))
        if self.model.seqs[handle]["committed"] < self.model.seqs[handle]["tokens"]:
            return
        tokens = data.draw(st.lists(st.integers(0, 1), min_size=k, max_size=k))
        try:
            self.model.grow(handle, k)
        except NoFreeBlocksError:
            with pytest.raises(NoFreeBlocksError):
                self.tables.append(handle, tokens)
            return
        self.model.commit(handle, tokens)
        self.tables.append(handle, tokens)
        self.check_cow()

    @precondition(lambda self: self.live())
    @rule(data=st.data())
    def append_many(self, data):
        ready = [h for h in self.live() if self.model.seqs[h]["committed"] == self.model.seqs[h]["tokens"]]
        handles = data.draw(st.lists(st.sampled_from(ready), unique=True)) if ready else []
        tokens = data.draw(st.lists(st.integers(0, 1), min_size=len(handles), max_size=len(handles)))
        expected = len(handles)
        for i, (handle, token) in enumerate(zip(handles, tokens, strict=True)):
            if self.model.pages_needed(handle, 1) > self.model.pool.num_free:
                expected = i
                break
            self.model.grow(handle, 1)
            self.model.commit(handle, [token])
        assert self.tables.append_many(handles, tokens) == expected
        self.check_cow()

    @precondition(lambda self: self.live())
    @rule(data=st.data())
    def truncate(self, data):
        """Speculative slots given back: to any length from the committed tokens to all of them."""
        handle = data.draw(st.sampled_from(self.live()))
        seq = self.model.seqs[handle]
        tokens = data.draw(st.integers(seq["committed"] - 1, seq["tokens"] + 1))
        if not seq["committed"] <= tokens <= seq["tokens"]:
            with pytest.raises(ValueError):
                self.tables.truncate(handle, tokens)
            return
        assert self.tables.truncate(handle, tokens) == self.model.truncate(handle, tokens)

    def check_cow(self):
        assert self.tables.take_cow_pairs().tolist() == [list(p) for p in self.model.cow]
        self.model.cow.clear()

    @precondition(lambda self: self.live() and len(self.model.seqs) < 6)
    @rule(data=st.data())
    def fork(self, data):
        handle = data.draw(st.sampled_from(self.live()))
        child = self.tables.fork(handle)
        self.model.fork(handle, child)

    @precondition(lambda self: self.model.seqs)
    @rule(data=st.data())
    def free(self, data):
        handle = data.draw(st.sampled_from(sorted(self.model.seqs)))
        self.tables.free_sequence(handle)
        self.model.free_sequence(handle)

    @precondition(lambda self: self.model.seqs)
    @rule(data=st.data())
    def swap(self, data):
        handle = data.draw(st.sampled_from(sorted(self.model.seqs)))
        to_cpu = not self.model.seqs[handle]["swapped"]
        op = self.tables.swap_out if to_cpu else self.tables.swap_in
        try:
            expected = self.model.move(handle, to_cpu)
        except NoFreeBlocksError:
            with pytest.raises(NoFreeBlocksError):
                op(handle)
            return
        assert op(handle).tolist() == [list(p) for p in expected]

    @precondition(lambda self: any(self.model.seqs[h]["tokens"] for h in self.live()))
    @rule(data=st.data())
    def build(self, data):
        handles = [h for h in self.live() if self.model.seqs[h]["tokens"]]
        qlens = [data.draw(st.integers(1, self.model.seqs[h]["tokens"])) for h in handles]
        bt, slots, pos, lens, qsl = self.builder.build(handles, qlens)
        k = 0
        for b, (h, q) in enumerate(zip(handles, qlens, strict=True)):
            blocks, n = self.model.seqs[h]["blocks"], self.model.seqs[h]["tokens"]
            assert bt[b, :len(blocks)].tolist() == blocks and lens[b] == n
            for p in range(n - q, n):
                assert pos[k] == p and slots[k] == blocks[p // BS] * BS + p % BS
                k += 1
            assert qsl[b + 1] == k

    @invariant()
    def matches_model(self):
        for handle, seq in self.model.seqs.items():
            assert self.tables.block_ids(handle).tolist() == seq["blocks"]
            assert self.tables.num_tokens(handle) == seq["tokens"]
            assert self.tables.num_committed(handle) == seq["committed"]
        for pool, model in ((self.pool, self.model.pool), (self.tables.cpu_pool, self.model.cpu)):
            assert pool.free_block_ids().tolist() == model.free_order()
            assert [pool.refcount(b) for b in range(pool.num_blocks)] == model.refs
            assert pool.num_used_blocks + pool.num_free_blocks == pool.num_blocks

    def teardown(self):
        for handle in list(self.model.seqs):
            self.tables.free_sequence(handle)
        assert self.pool.num_free_blocks == 20 and self.tables.cpu_pool.num_free_blocks == 10


TestTablesMachine = TablesMachine.TestCase
TestTablesMachine.settings = settings(max_examples=120, stateful_step_count=40, deadline=None)


def test_commit_caches_pages_as_they_fill_and_a_new_sequence_reuses_them():
    pool, tables = make()
    seq = tables.add_sequence(root_hash=5)
    tables.grow(seq, 10)
    tables.commit(seq, list(range(10)))
    assert pool.block_hash(int(tables.block_ids(seq)[1])) is not None
    assert pool.block_hash(int(tables.block_ids(seq)[2])) is None  # partly filled: not cached
    with pytest.raises(ValueError, match="past its 10 slots"):
        tables.commit(seq, [1])
    blocks, n = pool.match_prefix(list(range(10)), root_hash=5)
    assert n == 8 and blocks.tolist() == tables.block_ids(seq).tolist()[:2]
    other = tables.add_sequence(blocks, n, root_hash=5)
    assert pool.refcount(int(blocks[0])) == 2  # held by seq and, through the hit, by other
    assert pool.match_prefix(list(range(10)), root_hash=6)[1] == 0  # another salt never shares
    assert tables.append_many([seq, other], [10, 8]) == 2
    assert tables.num_committed(seq) == 11 and tables.num_committed(other) == 9
    tables.grow(seq, 1)
    with pytest.raises(ValueError, match="uncommitted slots"):
        tables.append_many([seq], [1])
