"""The stored-responses store: bounded in count, bytes and age, oldest out first, per API key, in SQLite."""

from __future__ import annotations

import time
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from pagegate.gateway.responses.store import ResponseStore, StoredResponse


def record(number: int, tenant: str | None = None, words: int = 1, age_s: float = 0.0) -> StoredResponse:
    return StoredResponse(f"resp_{number}", tenant, time.time() - age_s, [{"role": "user", "content": "w " * words}],
                          [], {"id": f"resp_{number}", "output": []})


def test_a_full_store_lets_the_oldest_go_first() -> None:
    evicted: list[str] = []
    store = ResponseStore(max_items=3, max_bytes=1 << 20, ttl_s=60, on_evict=evicted.append)
    for number in range(5):
        store.put(record(number))
    assert evicted == ["resp_0", "resp_1"] and len(store) == 3
    assert store.get("resp_0", None) is None and store.get("resp_4", None) is not None


def test_old_responses_expire() -> None:
    evicted: list[str] = []
    store = ResponseStore(max_items=10, max_bytes=1 << 20, ttl_s=60, on_evict=evicted.append)
    store.put(record(1, age_s=120))
    store.put(record(2))
    assert store.get("resp_1", None) is None and evicted == ["resp_1"]
    assert store.get("resp_2", None) is not None


def test_another_key_sees_nothing() -> None:
    store = ResponseStore(max_items=10, max_bytes=1 << 20, ttl_s=60)
    store.put(record(1, tenant="alice"))
    assert store.get("resp_1", "bob") is None and store.get("resp_1", None) is None
    assert not store.delete("resp_1", "bob")
    assert store.get("resp_1", "alice") is not None
    assert store.delete("resp_1", "alice") and store.get("resp_1", "alice") is None


@settings(max_examples=50, deadline=None)
@given(sizes=st.lists(st.integers(1, 400), min_size=1, max_size=40), max_items=st.integers(1, 8),
       max_bytes=st.integers(200, 4000))
def test_the_store_never_grows_past_its_bounds(sizes: list[int], max_items: int, max_bytes: int) -> None:
    evicted: list[str] = []
    store = ResponseStore(max_items=max_items, max_bytes=max_bytes, ttl_s=60, on_evict=evicted.append)
    for number, words in enumerate(sizes):
        store.put(record(number, words=words))
        assert len(store) <= max_items and store.num_bytes <= max_bytes
    kept = [f"resp_{n}" for n in range(len(sizes)) if store.get(f"resp_{n}", None) is not None]
    assert evicted + kept == [f"resp_{n}" for n in range(len(sizes))]  # out in order, oldest first


def test_a_sqlite_file_keeps_the_store_across_restarts(tmp_path: Path) -> None:
    path = str(tmp_path / "responses.sqlite")
    store = ResponseStore(max_items=2, max_bytes=1 << 20, ttl_s=60, path=path)
    for number in range(3):
        store.put(record(number, tenant="alice"))
    store.delete("resp_2", "alice")
    again = ResponseStore(max_items=2, max_bytes=1 << 20, ttl_s=60, path=path)
    assert len(again) == 1
    kept = again.get("resp_1", "alice")
    assert kept is not None and kept.conversation == [{"role": "user", "content": "w "}]
    assert again.num_bytes == store.num_bytes
