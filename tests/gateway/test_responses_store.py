"""The stored-responses store: bounded in count, bytes and age, oldest out first, per API key, in SQLite; a
conversation's turns stored once each (not once per later turn), and the byte bound counting real memory (which,
measured by tracemalloc, was ~6x the JSON length the store counted when it kept items as objects)."""

from __future__ import annotations

import asyncio
import gc
import json
import sqlite3
import time
import tracemalloc
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from pagegate.gateway.responses.store import ResponseStore, StoredResponse


def record(number: int, tenant: str | None = None, words: int = 1, age_s: float = 0.0,
           previous: StoredResponse | None = None, items: int = 0) -> StoredResponse:
    """A response continuing `previous`, sent `items` reasoning items (as a client hands them back)."""
    sent = [{"id": f"rs_{number}_{i}", "type": "reasoning", "summary": [{"type": "summary_text", "text": f"{i} " * 8}]}
            for i in range(items)]
    made = StoredResponse.new(f"resp_{number}", tenant, previous, [{"role": "user", "content": "w " * words}], sent,
                              {"id": f"resp_{number}", "output": [{"type": "message", "id": f"msg_{number}"}]})
    made.created_at = time.time() - age_s
    return made


def chain(store: ResponseStore, turns: int, items: int, start: int = 0) -> StoredResponse:
    previous = None
    for number in range(start, start + turns):
        previous = record(number, previous=previous, items=items)
        store.put(previous)
    assert previous is not None
    return previous


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
       max_bytes=st.integers(2000, 8000), continues=st.lists(st.booleans(), min_size=40, max_size=40))
def test_the_store_never_grows_past_its_bounds(sizes: list[int], max_items: int, max_bytes: int,
                                               continues: list[bool]) -> None:
    evicted: list[str] = []
    store = ResponseStore(max_items=max_items, max_bytes=max_bytes, ttl_s=60, on_evict=evicted.append)
    previous = None
    for number, words in enumerate(sizes):
        previous = record(number, words=words, previous=previous if continues[number] else None)
        store.put(previous)
        assert len(store) <= max_items and store.num_bytes <= max_bytes
    kept = [f"resp_{n}" for n in range(len(sizes)) if store.get(f"resp_{n}", None) is not None]
    assert evicted + kept == [f"resp_{n}" for n in range(len(sizes))]  # out in order, oldest first
    for number in range(len(sizes)):
        store.delete(f"resp_{number}", None)
    assert store.num_bytes == 0  # every turn freed once nothing needs it


def test_a_conversation_s_turns_are_stored_once() -> None:
    """Twenty turns of 500 items each hold twenty times what one does, not 210 times (each turn again)."""
    one = ResponseStore(max_items=100, max_bytes=1 << 30, ttl_s=60)
    chain(one, turns=1, items=500)
    store = ResponseStore(max_items=100, max_bytes=1 << 30, ttl_s=60)
    last = chain(store, turns=20, items=500, start=100)
    assert 18 * one.num_bytes < store.num_bytes < 22 * one.num_bytes
    items = list(last.input_items())
    assert len(items) == 20 * 500 + 19  # every turn's input, and every earlier turn's output
    assert items[0]["id"] == "rs_100_0" and items[500]["id"] == "msg_100" and items[-1]["id"] == "rs_119_499"
    assert [item["id"] for item in last.input_items(newest_first=True)] == [item["id"] for item in reversed(items)]
    assert len(last.conversation) == 20


def test_a_continuation_keeps_the_turns_it_needs() -> None:
    """Deleting (or evicting) an earlier response keeps its turn while a later one continues it."""
    store = ResponseStore(max_items=100, max_bytes=1 << 30, ttl_s=60)
    first = record(1)
    store.put(first)
    second = record(2, previous=first, words=3)
    store.put(second)
    assert store.delete("resp_1", None) and store.get("resp_1", None) is None
    kept = store.get("resp_2", None)
    assert kept is not None and [m["content"] for m in kept.conversation] == ["w ", "w w w "]
    held = store.num_bytes
    assert held > second.size + second.turn.size  # the first turn is still held, and counted
    store.delete("resp_2", None)
    assert store.num_bytes == 0


def test_a_turn_freed_while_its_continuation_ran_is_stored_again() -> None:
    store = ResponseStore(max_items=100, max_bytes=1 << 30, ttl_s=60)
    first = record(1)
    store.put(first)
    store.delete("resp_1", None)  # evicted while the next turn was being generated
    assert store.num_bytes == 0
    store.put(record(2, previous=first))
    kept = store.get("resp_2", None)
    assert kept is not None and len(kept.conversation) == 2
    assert store.num_bytes == kept.size + kept.turn.size + first.turn.size


def test_add_encodes_on_the_writer_thread() -> None:
    store = ResponseStore(max_items=10, max_bytes=1 << 30, ttl_s=60)
    items = [{"id": "rs_1", "type": "reasoning", "summary": []}]
    made = asyncio.run(store.add("resp_1", None, None, [{"role": "user", "content": "x"}], items,
                                 {"id": "resp_1", "output": [{"id": "msg_1"}]}))
    assert store.get("resp_1", None) is made and store.num_bytes == made.size + made.turn.size > 0
    assert list(made.input_items()) == items and made.response_object() == {"id": "resp_1", "output": [{"id": "msg_1"}]}


def _traced_growth(build) -> tuple[int, object]:
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        kept = build()
        gc.collect()
        return tracemalloc.get_traced_memory()[0] - before, kept
    finally:
        tracemalloc.stop()


def test_the_byte_count_is_the_memory_the_store_holds(tmp_path: Path) -> None:
    """What tracemalloc sees the store allocate is what it counts (within 20%), both for records made here and
    for records read from SQLite."""
    path = str(tmp_path / "responses.sqlite")

    def build() -> ResponseStore:
        store = ResponseStore(max_items=1000, max_bytes=1 << 30, ttl_s=60, path=path)
        for start in range(0, 40, 8):
            chain(store, turns=8, items=200, start=start)
        store.flush()
        return store

    grown, store = _traced_growth(build)
    assert isinstance(store, ResponseStore)
    assert 0.8 < store.num_bytes / grown < 1.2, (store.num_bytes, grown)
    store.close()
    grown, again = _traced_growth(lambda: ResponseStore(max_items=1000, max_bytes=1 << 30, ttl_s=60, path=path))
    assert isinstance(again, ResponseStore) and len(again) == 40
    assert 0.8 < again.num_bytes / grown < 1.2, (again.num_bytes, grown)  # more than before: decoded strings


def test_a_sqlite_file_keeps_the_store_across_restarts(tmp_path: Path) -> None:
    path = str(tmp_path / "responses.sqlite")
    store = ResponseStore(max_items=2, max_bytes=1 << 20, ttl_s=60, path=path)
    first = record(0, tenant="alice")
    store.put(first)
    store.put(record(1, tenant="alice", previous=first, words=2))
    store.put(record(2, tenant="alice"))  # resp_0 leaves the store; its turn stays, resp_1 continues it
    store.delete("resp_2", "alice")
    store.close()
    again = ResponseStore(max_items=2, max_bytes=1 << 20, ttl_s=60, path=path)
    assert len(again) == 1 and again.get("resp_0", "alice") is None
    kept = again.get("resp_1", "alice")
    assert kept is not None and [m["content"] for m in kept.conversation] == ["w ", "w w "]
    assert kept.response_object()["output"] == [{"type": "message", "id": "msg_1"}]
    again.delete("resp_1", "alice")
    again.close()
    db = sqlite3.connect(path)
    assert db.execute("SELECT COUNT(*) FROM response_turns").fetchone() == (0,)  # nothing left behind
    assert db.execute("SELECT COUNT(*) FROM response_records").fetchone() == (0,)


def test_a_file_of_the_earlier_layout_is_read(tmp_path: Path) -> None:
    path = str(tmp_path / "responses.sqlite")
    db = sqlite3.connect(path)
    db.execute("CREATE TABLE responses (id TEXT PRIMARY KEY, created_at REAL, body TEXT)")
    old = {"id": "resp_old", "tenant": None, "created_at": time.time(), "conversation": [{"role": "user", "content": "x"}],
           "input_items": [{"id": "msg_in", "type": "message"}],
           "response": {"id": "resp_old", "output": [{"id": "msg_out"}]}}
    db.execute("INSERT INTO responses VALUES (?, ?, ?)", ("resp_old", old["created_at"], json.dumps(old)))
    db.commit()
    db.close()
    store = ResponseStore(max_items=10, max_bytes=1 << 20, ttl_s=60, path=path)
    kept = store.get("resp_old", None)
    assert kept is not None and kept.conversation == old["conversation"]
    assert [item["id"] for item in kept.input_items()] == ["msg_in"]
    assert kept.response_object() == old["response"]
