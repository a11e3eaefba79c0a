import tempfile
from pathlib import Path

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pagegate.engine.kv_tiers import CPU, DISK, DiskTier, HostTier, PageKey, ReuseGate, TierStack

from .pages import BLOCK_SIZE, FINGERPRINT, PAGE_BYTES, chain, page_data, stacked, tokens_of

FILE_BYTES = 72 + 4 * BLOCK_SIZE + PAGE_BYTES


def make_stack(directory: Path | None, host_pages: int | None, disk_pages: int = 1000, min_seen: int = 1,
               write_through: bool = False) -> TierStack:
    host = None if host_pages is None else HostTier(host_pages, PAGE_BYTES)
    disk = None if directory is None else DiskTier(directory, disk_pages * FILE_BYTES, FINGERPRINT,
                                                   PAGE_BYTES, BLOCK_SIZE)
    return TierStack(host, disk, ReuseGate(min_seen, 1000), write_through)


def find(stack: TierStack, keys: list[PageKey]) -> tuple[list[int], list[PageKey]]:
    return stack.find_chain([k.hash for k in keys], [k.parent for k in keys], [tokens_of(k) for k in keys])


def fetch(stack: TierStack, keys: list[PageKey]) -> torch.Tensor:
    """The chain's pages as the engine would get them: host pages now, then the disk load."""
    host_slots, disk_keys = find(stack, keys)
    host_pages = stack.read_host(host_slots) if host_slots else stacked([])
    if not disk_keys:
        return host_pages
    load = stack.load_from_disk(disk_keys)
    load.future.result(timeout=10)
    return torch.cat([host_pages, stack.finish_load(load)])


CHAINS = [chain(first * 100 + 1, 5) for first in range(4)]
spills = st.lists(st.tuples(st.integers(0, 3), st.integers(0, 4), st.integers(1, 5)), min_size=1, max_size=12)


@settings(max_examples=40, deadline=None)
@given(spills, st.sampled_from([None, 1, 3, 8]), st.booleans(), st.booleans())
def test_every_spilled_page_comes_back_bit_exact(spill_ops: list[tuple[int, int, int]], host_pages: int | None,
                                                 with_disk: bool, write_through: bool) -> None:
    with tempfile.TemporaryDirectory() as directory:
        stack = make_stack(Path(directory) if with_disk else None, host_pages, write_through=write_through)
        spilled: set[int] = set()
        for chain_index, start, length in spill_ops:
            keys = CHAINS[chain_index][start:start + length]
            stack.spill(keys, stacked(keys))
            spilled |= {key.hash for key in keys}
        for keys in CHAINS:
            pages = fetch(stack, keys)
            assert torch.equal(pages, stacked(keys[:len(pages)]))  # whatever is served is exact
            if with_disk:  # the disk holds everything: a chain comes back up to its first never-spilled page
                whole = next((i for i, key in enumerate(keys) if key.hash not in spilled), len(keys))
                assert len(pages) == whole
            elif host_pages is not None:
                host = stack.host
                assert host is not None and host.num_used <= host_pages
        stack.close()


def test_a_chain_split_head_on_disk_tail_on_host_comes_back_whole(tmp_path: Path) -> None:
    stack = make_stack(tmp_path, host_pages=3)
    keys = chain(1, 6)
    stack.spill(keys, stacked(keys))  # host keeps the last three, pushes the first three to disk
    host_slots, disk_keys = find(stack, keys)
    assert host_slots == [] and [key.hash for key in disk_keys] == [key.hash for key in keys]
    assert torch.equal(fetch(stack, keys), stacked(keys))
    stack.close()


def test_host_run_then_disk_run(tmp_path: Path) -> None:
    stack = make_stack(tmp_path, host_pages=3)
    keys = chain(1, 6)
    stack.spill(keys[::-1], stacked(keys[::-1]))  # tail first, as a pool evicts: the head stays on host
    host_slots, disk_keys = find(stack, keys)
    assert len(host_slots) == 3 and disk_keys == keys[3:]
    assert torch.equal(fetch(stack, keys), stacked(keys))
    stats = stack.stats()
    assert stats.host is not None and stats.disk is not None
    assert stats.host.hits == 6 and stats.disk.hits == 3 and stats.disk.bytes_read == 3 * PAGE_BYTES
    assert stats.host.pages == 3 and stats.disk.pages == 3 and stats.host.evictions == 3
    stack.close()


def test_reuse_gate_keeps_unseen_pages_out(tmp_path: Path) -> None:
    stack = make_stack(tmp_path, host_pages=4, min_seen=2)
    keys = chain(1, 2)
    stack.see([keys[0].hash, keys[0].hash, keys[1].hash])
    stack.spill(keys, stacked(keys))
    assert find(stack, keys) == ([0], [])  # only the page seen twice was stored
    stack.close()


def test_events_name_each_tier(tmp_path: Path) -> None:
    stack = make_stack(tmp_path, host_pages=1)
    keys = chain(1, 2)
    for key in keys:
        stack.spill([key], stacked([key]))
    events = stack.take_events()
    assert [(e.name, e.hashes, e.medium) for e in events] == [
        ("BlockStored", (1,), CPU), ("BlockRemoved", (1,), CPU), ("BlockStored", (2,), CPU),
        ("BlockStored", (1,), DISK)]
    assert events[0].keys[0].token_ids == tokens_of(keys[0]).tolist()  # for BlockStored's wire form
    assert stack.take_events() == []
    stack.close()


def test_persist_and_warm_restart(tmp_path: Path) -> None:
    stack = make_stack(tmp_path, host_pages=8)
    keys = chain(1, 4)
    stack.spill(keys, stacked(keys))
    stack.persist()
    stack.close()
    restarted = make_stack(tmp_path, host_pages=8)
    assert torch.equal(fetch(restarted, keys), stacked(keys))
    assert torch.equal(fetch(restarted, keys[:1])[0], page_data(1))
    restarted.close()
