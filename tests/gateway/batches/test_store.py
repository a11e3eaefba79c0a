"""The batch store: a line's answer is stored and counted once however often and in whatever order it comes, and
the output files list each answered line once, in input order; files belong to one key, are bounded in bytes and
expire."""

from __future__ import annotations

import io
import json
import tempfile
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagegate.gateway.batches.assemble import assemble
from pagegate.gateway.batches.lines import read_lines
from pagegate.gateway.batches.store import (
    BatchRecord,
    BatchStore,
    FileRecord,
    LineResult,
    StorageFull,
    read_results,
)

CHAT = "/v1/chat/completions"
BATCH = "batch_" + "0" * 24


def batch(batch_id: str = BATCH, tenant: str | None = None, status: str = "in_progress") -> BatchRecord:
    return BatchRecord(batch_id, tenant, CHAT, "file-" + "0" * 24, "24h", status, None, None, None, None, 3600,
                       0, 0, 0, 1000, 1000 + 86400)


def file(number: int, tenant: str | None = None, size: int = 10, expires_at: int | None = None) -> FileRecord:
    return FileRecord(f"file-{number:024x}", tenant, "batch", f"f{number}.jsonl", size, 1000 + number, expires_at)


def input_file(folder: Path, bad: list[bool]) -> Path:
    """A line per entry: a request with custom_id `c<position>`, or a malformed line where `bad` says so."""
    lines = ["{oops" if is_bad else json.dumps({"custom_id": f"c{i}", "method": "POST", "url": CHAT, "body": {}})
             for i, is_bad in enumerate(bad)]
    path = folder / "input.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


@settings(max_examples=30, deadline=None)
@given(data=st.data(), bad=st.lists(st.booleans(), min_size=1, max_size=24))
def test_answers_in_any_order_and_repeated_are_assembled_once_each_in_input_order(data: st.DataObject,
                                                                                  bad: list[bool]) -> None:
    good = [i for i, is_bad in enumerate(bad) if not is_bad]
    answers = data.draw(st.lists(st.tuples(st.sampled_from(good), st.sampled_from([200, 400])), max_size=40)
                        if good else st.just([]))
    with tempfile.TemporaryDirectory() as folder:
        store = BatchStore(Path(folder) / "batches.sqlite3")
        store.add_batch(batch())
        first: dict[int, tuple[str, int]] = {}
        for number, (line, status) in enumerate(answers):
            result = LineResult(line, f"c{line}", f"batch_req_{number}", f"request{number}", status,
                                json.dumps({"answer": number}).encode())
            assert store.record(BATCH, result) == (line not in first)
            first.setdefault(line, (result.id, status))
        output, errors = io.BytesIO(), io.BytesIO()
        counts = assemble(read_lines(input_file(Path(folder), bad), CHAT), read_results(store.path, BATCH), output,
                          errors)
        stored = store.batch(BATCH)
        store.close()
    written = [json.loads(line) for line in output.getvalue().splitlines()]
    refused = [json.loads(line) for line in errors.getvalue().splitlines()]
    assert [line["custom_id"] for line in written] == [f"c{i}" for i in sorted(first) if first[i][1] == 200]
    assert [line["id"] for line in written] == [first[i][0] for i in sorted(first) if first[i][1] == 200]
    assert [line["custom_id"] for line in refused if line["response"]] == [
        f"c{i}" for i in sorted(first) if first[i][1] == 400]
    assert sum(line["error"] is not None for line in refused) == sum(bad)  # the malformed lines, once each
    assert all(line["response"]["body"]["answer"] >= 0 for line in written + refused if line["response"])
    ok = sum(status == 200 for _, status in first.values())
    assert (counts.completed, counts.failed) == (ok, len(first) - ok + sum(bad))
    assert (stored.completed, stored.failed) == (ok, len(first) - ok)  # the store counted each line once


def test_an_output_line_is_openais_shape(tmp_path: Path) -> None:
    store = BatchStore(tmp_path / "batches.sqlite3")
    store.add_batch(batch())
    store.record(BATCH, LineResult(0, "c0", "batch_req_1", "req1", 200, b'{"id":"chatcmpl-req1"}'))
    output = io.BytesIO()
    assemble(read_lines(input_file(tmp_path, [False]), CHAT), read_results(store.path, BATCH), output, io.BytesIO())
    assert json.loads(output.getvalue()) == {
        "id": "batch_req_1", "custom_id": "c0", "error": None,
        "response": {"status_code": 200, "request_id": "req1", "body": {"id": "chatcmpl-req1"}}}


def test_an_expired_batch_lists_its_unrun_lines_as_expired(tmp_path: Path) -> None:
    store = BatchStore(tmp_path / "batches.sqlite3")
    store.add_batch(batch())
    store.record(BATCH, LineResult(1, "c1", "batch_req_1", "req1", 200, b"{}"))
    output, errors = io.BytesIO(), io.BytesIO()
    counts = assemble(read_lines(input_file(tmp_path, [False] * 3), CHAT), read_results(store.path, BATCH), output,
                      errors, expired=True)
    assert [(line["custom_id"], line["error"]["code"]) for line in map(json.loads, errors.getvalue().splitlines())] \
        == [("c0", "batch_expired"), ("c2", "batch_expired")]
    assert (counts.completed, counts.failed) == (1, 2)


def test_a_key_reaches_only_its_own_files_and_batches(tmp_path: Path) -> None:
    store = BatchStore(tmp_path / "batches.sqlite3")
    store.add_file(file(1, "alice"))
    store.add_batch(batch(tenant="alice"))
    assert store.get_file(file(1).id, "alice", 0) is not None
    for tenant in ("bob", None):
        assert store.get_file(file(1).id, tenant, 0) is None
        assert store.get_batch(BATCH, tenant) is None
        assert store.list_files(tenant, 0, None, None, 10, True) == ([], False)
        assert store.list_batches(tenant, None, 10) == ([], False)
        assert not store.delete_file(file(1).id, tenant, 0)
    assert store.delete_file(file(1).id, "alice", 0)


def test_files_past_max_bytes_are_refused_and_deleting_makes_room(tmp_path: Path) -> None:
    store = BatchStore(tmp_path / "batches.sqlite3")
    store.add_file(file(1, size=60), max_bytes=100)
    with pytest.raises(StorageFull) as full:
        store.add_file(file(2, size=60), max_bytes=100)
    assert full.value.used == 60 and store.get_file(file(2).id, None, 0) is None
    store.delete_file(file(1).id, None, 0)
    store.add_file(file(2, size=60), max_bytes=100)
    assert store.bytes_used() == 60


def test_expired_files_are_gone_at_once_and_taken_by_the_janitor(tmp_path: Path) -> None:
    store = BatchStore(tmp_path / "batches.sqlite3")
    store.add_file(file(1, expires_at=2000))
    store.add_file(file(2, expires_at=None))
    assert store.get_file(file(1).id, None, 1999) is not None
    assert store.get_file(file(1).id, None, 2000) is None  # expired: a 404 before the janitor runs
    assert store.take_expired_files(2000) == [file(1).id]
    assert store.file_ids() == {file(2).id}


def test_lists_page_newest_first_by_default(tmp_path: Path) -> None:
    store = BatchStore(tmp_path / "batches.sqlite3")
    for number in range(5):
        store.add_file(file(number))
    ids = [file(number).id for number in range(5)]
    page, more = store.list_files(None, 0, None, None, 2, True)
    assert [record.id for record in page] == ids[:2:-1][:2] == [ids[4], ids[3]] and more
    page, more = store.list_files(None, 0, None, ids[3], 10, True)
    assert [record.id for record in page] == [ids[2], ids[1], ids[0]] and not more
    page, more = store.list_files(None, 0, None, ids[1], 2, False)
    assert [record.id for record in page] == [ids[2], ids[3]] and more


def test_a_status_moves_only_from_the_states_allowed(tmp_path: Path) -> None:
    store = BatchStore(tmp_path / "batches.sqlite3")
    store.add_batch(batch(status="finalizing"))
    assert not store.move(BATCH, "cancelling", 1500, ("validating", "in_progress"))
    assert store.move(BATCH, "completed", 1600, ("finalizing",))
    record = store.batch(BATCH)
    assert (record.status, record.completed_at, record.cancelling_at) == ("completed", 1600, None)
