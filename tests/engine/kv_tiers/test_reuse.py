from collections import OrderedDict

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pagegate.engine.kv_tiers import ReuseGate


@given(st.lists(st.integers(0, 9), max_size=60), st.integers(1, 4), st.integers(1, 12))
def test_counts_follow_a_bounded_lru(sightings: list[int], min_seen: int, capacity: int) -> None:
    gate = ReuseGate(min_seen, capacity)
    model: OrderedDict[int, int] = OrderedDict()
    for hash in sightings:
        gate.see(hash)
        model[hash] = model.pop(hash, 0) + 1
        if len(model) > capacity:
            model.popitem(last=False)
    for hash in range(10):
        expected = model.get(hash, 0)
        if min_seen > 1:
            assert gate.count(hash) == expected
        assert gate.admits(hash) == (min_seen == 1 or expected >= min_seen)
    assert len(gate) <= capacity


def test_min_seen_one_admits_everything_and_keeps_nothing() -> None:
    gate = ReuseGate(1, 4)
    gate.see_all(range(100))
    assert gate.admits(12345) and len(gate) == 0


def test_second_sighting_admits() -> None:
    gate = ReuseGate(2, 4)
    gate.see(7)
    assert not gate.admits(7)
    gate.see(7)
    assert gate.admits(7)


def test_rejects_nonsense_settings() -> None:
    with pytest.raises(ValueError):
        ReuseGate(0, 4)


def test_vouched_hashes_are_admitted_unseen() -> None:
    gate = ReuseGate(min_seen=3, capacity=8)
    gate.see(1)
    gate.vouch([1, 2])
    assert gate.admits(1) and gate.admits(2) and not gate.admits(3)
