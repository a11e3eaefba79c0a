from collections import OrderedDict

import torch
from hypothesis import given
from hypothesis import strategies as st

from pagegate.engine.kv_tiers import CPU, HostTier, PageKey

from .pages import PAGE_BYTES, page_data, page_key, stacked, tokens_of

KEYS = [page_key(hash) for hash in range(1, 13)]
puts = st.lists(st.sampled_from(KEYS), min_size=1, max_size=8).map(lambda keys: ("put", keys))
finds = st.sampled_from(KEYS).map(lambda key: ("find", key))
discards = st.sampled_from(KEYS).map(lambda key: ("discard", key))


@given(st.integers(1, 6), st.lists(st.one_of(puts, finds, discards), max_size=25))
def test_host_tier_is_a_bounded_lru_that_loses_no_page(num_pages: int, operations: list) -> None:
    host = HostTier(num_pages, PAGE_BYTES)
    model: OrderedDict[int, PageKey] = OrderedDict()
    for kind, arg in operations:
        if kind == "put":
            pushed = host.put(arg, stacked(arg))
            expected_pushed = []
            for key in arg:
                if key.hash in model:
                    model.move_to_end(key.hash)
                    continue
                if len(model) == num_pages:
                    expected_pushed.append(model.popitem(last=False)[1])
                model[key.hash] = key
            assert [key for key, _ in pushed] == expected_pushed
            for key, row in pushed:  # bytes copied out before their slots were reused
                assert torch.equal(row, page_data(key.hash))
        elif kind == "find":
            slot = host.find(arg.hash, arg.parent, tokens_of(arg))
            assert (slot is not None) == (arg.hash in model)
            if slot is not None:
                model.move_to_end(arg.hash)
        else:
            assert host.discard(arg.hash) == (model.pop(arg.hash, None) is not None)
        assert host.num_used == len(model) <= num_pages
        assert [key for key, _ in host.items()] == list(model.values())
    for key, slot in host.items():
        assert torch.equal(host.read([slot])[0], page_data(key.hash))


def test_a_colliding_hash_is_a_miss() -> None:
    host = HostTier(2, PAGE_BYTES)
    key = page_key(5)
    host.put([key], stacked([key]))
    other_tokens = tokens_of(key) + 1
    assert host.find(key.hash, key.parent, other_tokens) is None
    assert host.find(key.hash, key.parent + 1, tokens_of(key)) is None
    assert host.find(key.hash, key.parent, tokens_of(key)) is not None


def test_a_refreshed_page_is_not_stored_twice() -> None:
    host = HostTier(3, PAGE_BYTES)
    keys = [page_key(hash) for hash in (1, 2)]
    host.put(keys, stacked(keys))
    host.put(keys[:1], stacked(keys[:1]))
    assert host.num_used == 2 and host.stats.stores == 2
    assert [key.hash for key, _ in host.items()] == [2, 1]


def test_events_name_the_cpu_medium() -> None:
    host = HostTier(1, PAGE_BYTES)
    keys = [page_key(hash) for hash in (1, 2)]
    host.put(keys[:1], stacked(keys[:1]))
    host.put(keys[1:], stacked(keys[1:]))
    assert [(event.name, event.hashes, event.medium) for event in host.events] == [
        ("BlockStored", (1,), CPU), ("BlockRemoved", (1,), CPU), ("BlockStored", (2,), CPU)]
