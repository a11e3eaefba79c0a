"""Running batches: a server killed (SIGKILL) mid-batch and started again on the same --batch-dir finishes the batch
(the lines it had answered are not run again, every custom_id is answered exactly once); in-process, with a stand-in
for the routes: lines refused for the server's state are tried again, never more than --batch-concurrency run at
once, and a cancel gives back the slots of its lines."""

from __future__ import annotations

import asyncio
import io
import json
import sqlite3
import time
from collections import Counter
from pathlib import Path

import pytest

from pagegate.gateway.batches import runner
from pagegate.gateway.batches.in_process import RouteAnswer
from pagegate.gateway.batches.protocol import BatchCreateRequest
from pagegate.gateway.batches.service import Batches
from pagegate.gateway.batches.store import BatchRecord, LineResult
from pagegate.gateway.settings import GatewayConfig
from pagegate.testing.launcher import ServerProcess, descendants, wait_gone
from tests.gateway.batches.conftest import ENDED, file_lines, jsonl, requests, sdk, submit, wait_ended
from tests.gateway.server_args import server_args

LINES = 60


def start(batch_dir: Path, concurrency: int) -> ServerProcess:
    return ServerProcess(server_args("--num-kv-blocks", "256", "--max-num-seqs", "8", "--batch-dir", str(batch_dir),
                                     "--batch-concurrency", str(concurrency))).start()


def kill(server: ServerProcess) -> None:
    assert server.process is not None
    below = descendants(server.process.pid)
    server.process.kill()
    server.process.wait()
    assert wait_gone(below) == [], "the engine core outlived its server"


def stored_answers(batch_dir: Path, batch_id: str) -> dict[str, str]:
    """custom_id -> the output line id of each answer the killed server had stored."""
    with sqlite3.connect(batch_dir / "batches.sqlite3") as db:
        return dict(db.execute("SELECT custom_id, id FROM results WHERE batch_id = ?", (batch_id,)).fetchall())


def test_a_batch_killed_midway_resumes_and_answers_each_line_once(tmp_path: Path) -> None:
    first = start(tmp_path, concurrency=1)  # one line at a time: still running when the test sees 3 answers
    try:
        client = sdk(first, "unused")
        model = client.models.list().data[0].id
        bodies = [{"model": model, "prompt": f"Verse {i}:", "max_tokens": 4, "temperature": 0} for i in range(LINES)]
        batch = submit(client, "/v1/completions", requests("/v1/completions", bodies))
        deadline = time.monotonic() + 60
        while client.batches.retrieve(batch.id).request_counts.completed < 3:  # type: ignore[union-attr]
            assert time.monotonic() < deadline
            time.sleep(0.005)
    finally:
        kill(first)
    before = stored_answers(tmp_path, batch.id)
    assert 3 <= len(before) < LINES, "the kill came too late to test a resume"
    second = start(tmp_path, concurrency=8)
    try:
        client = sdk(second, "unused")
        ended = wait_ended(client, batch.id)
        output = file_lines(client, ended.output_file_id)
    finally:
        assert second.stop() == 0
    assert ended.status == "completed" and ended.error_file_id is None
    assert (ended.request_counts.total, ended.request_counts.completed, ended.request_counts.failed) == (LINES, LINES, 0)
    assert [line["custom_id"] for line in output] == [f"r{i}" for i in range(LINES)]  # once each, in input order
    ids = {line["custom_id"]: line["id"] for line in output}
    assert {custom_id: ids[custom_id] for custom_id in before} == before  # answered before the kill: not run again
    assert stored_answers(tmp_path, batch.id) == {}  # the output file holds them now


# -- in-process, with a stand-in for the routes ------------------------------------------------------------------
class FakeRoutes:
    """Answers each line with its `n` after `refusals` 503s; `block`: never answers. Counts calls and lines in
    flight."""

    def __init__(self, refusals: int = 0, block: bool = False) -> None:
        self.refusals, self.block = refusals, block
        self.calls: Counter[int] = Counter()
        self.in_flight = self.most_in_flight = 0

    async def post(self, path: str, body: bytes, tenant: str | None) -> RouteAnswer:
        number = json.loads(body)["n"]
        self.calls[number] += 1
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            await asyncio.sleep(0.001)
            while self.block:
                await asyncio.sleep(0.01)
            if self.calls[number] <= self.refusals:
                return RouteAnswer(503, b'{"error": {"message": "loading"}}', "busy")
            return RouteAnswer(200, json.dumps({"n": number}).encode(), f"request{number}")
        finally:
            self.in_flight -= 1


def numbered(count: int) -> bytes:
    return jsonl(requests("/v1/completions", [{"n": n} for n in range(count)]))


async def started(folder: Path, routes: FakeRoutes, concurrency: int = 3) -> Batches:
    batches = Batches(GatewayConfig(batch_dir=str(folder)), concurrency)
    await batches.start(router=None, state={})  # type: ignore[arg-type]  # lines go to `routes` instead
    assert batches.runner is not None
    batches.runner.client = routes  # type: ignore[assignment]
    return batches


async def create(batches: Batches, content: bytes) -> str:
    source = await batches.upload(None, "in.jsonl", "batch", io.BytesIO(content), None)
    request = BatchCreateRequest(input_file_id=source.id, endpoint="/v1/completions", completion_window="24h")
    return (await batches.create(None, request)).id


async def ended(batches: Batches, batch_id: str) -> BatchRecord:
    for _ in range(1000):
        record = await batches.batch(None, batch_id)
        if record.status in ENDED:
            return record
        await asyncio.sleep(0.01)
    raise AssertionError(f"batch {batch_id} is still {record.status}")


def output_numbers(batches: Batches, record: BatchRecord) -> list[int]:
    assert record.output_file_id is not None
    lines = batches.disk.file_path(record.output_file_id).read_text().splitlines()
    return [json.loads(line)["response"]["body"]["n"] for line in lines]


def test_lines_refused_for_the_servers_state_are_tried_again_never_more_than_the_bound_at_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(runner, "RETRY_FIRST_S", 0.001)
    routes = FakeRoutes(refusals=2)

    async def scenario() -> None:
        batches = await started(tmp_path, routes)
        record = await ended(batches, await create(batches, numbered(20)))
        assert (record.status, record.completed, record.failed, record.error_file_id) == ("completed", 20, 0, None)
        assert output_numbers(batches, record) == list(range(20))
        await batches.stop()

    asyncio.run(scenario())
    assert routes.calls == {n: 3 for n in range(20)} and routes.most_in_flight == 3


def test_a_cancel_gives_back_every_slot_of_its_lines(tmp_path: Path) -> None:
    routes = FakeRoutes(block=True)

    async def scenario() -> None:
        batches = await started(tmp_path, routes)
        first = await create(batches, numbered(20))
        while routes.in_flight < 3:
            await asyncio.sleep(0.005)
        await batches.cancel(None, first)
        record = await ended(batches, first)
        assert (record.status, record.completed, record.output_file_id) == ("cancelled", 0, None)
        routes.block = False
        record = await ended(batches, await create(batches, numbered(5)))  # runs: no slot was lost
        assert record.status == "completed" and output_numbers(batches, record) == list(range(5))
        await batches.stop()

    asyncio.run(scenario())


def test_a_resumed_batch_runs_only_the_lines_with_no_stored_answer(tmp_path: Path) -> None:
    routes = FakeRoutes(block=True)

    async def scenario() -> str:
        batches = await started(tmp_path, routes)
        batch_id = await create(batches, numbered(10))
        while sum(routes.calls.values()) < 3:
            await asyncio.sleep(0.005)
        for n in (0, 4, 9):  # answered before the "crash"
            await batches.db(batches.store.record, batch_id, LineResult(n, f"r{n}", f"batch_req_{n}", "earlier",
                                                                        200, json.dumps({"n": n}).encode()))
        await batches.stop()  # what a kill leaves: the batch in_progress, three answers stored
        return batch_id

    batch_id = asyncio.run(scenario())
    routes = FakeRoutes()

    async def resumed() -> None:
        batches = await started(tmp_path, routes)
        record = await ended(batches, batch_id)
        assert record.status == "completed" and output_numbers(batches, record) == list(range(10))
        await batches.stop()

    asyncio.run(resumed())
    assert sorted(routes.calls) == [1, 2, 3, 5, 6, 7, 8]
