"""Runs batches: checks the input, sends each line through its route in-process (a bounded number in flight across
all batches), stores each answer as it comes, and at the end writes the output and error files.

A batch is a state machine in the database (validating -> in_progress -> finalizing -> completed, or failed,
cancelling -> cancelled, expired), and every step starts from what is stored: a server restarted mid-batch
(SIGKILL included) resumes every live batch where it was, skipping the lines whose answers are stored, so no line
is answered twice or lost.

NOTE: a line refused for the server's state (429 overloaded, 503 loading, draining, stopping or stalled) is not
the line's fault: it is tried again after a pause, and never written to the error file.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import itertools
import logging
import secrets
import time
from collections.abc import AsyncIterator, Generator
from dataclasses import dataclass, field

from pagegate.gateway.batches.assemble import Assembled, assemble, new_request_id
from pagegate.gateway.batches.disk import BatchDisk, atomic_file
from pagegate.gateway.batches.in_process import InProcessClient
from pagegate.gateway.batches.lines import BatchLine, InvalidInputFile, Line, check_file, read_lines
from pagegate.gateway.batches.store import (
    TERMINAL,
    BatchRecord,
    BatchStore,
    DatabaseThread,
    FileRecord,
    LineResult,
    read_results,
)

logger = logging.getLogger("pagegate.gateway")

RETRIED = frozenset({429, 503})  # the server's state, not the line: tried again
RETRY_FIRST_S, RETRY_MAX_S = 0.1, 1.0  # short: a resumed batch starts within a second of the model being ready
CHUNK_LINES = 256  # lines read from the input file per trip to a worker thread


def new_file_id() -> str:
    return "file-" + secrets.token_hex(12)


def now() -> int:
    return int(time.time())


@dataclass(eq=False)
class _Job:
    """A batch being run by this process."""

    batch_id: str
    task: asyncio.Task[None] | None = None
    lines: set[asyncio.Task[None]] = field(default_factory=set)
    cancelled: bool = False
    expired: bool = False
    failure: BaseException | None = None  # a line that could not be run or stored (a bug, a full disk)

    def line_done(self, task: asyncio.Task[None]) -> None:
        self.lines.discard(task)
        if not task.cancelled() and task.exception() is not None:
            self.failure = task.exception()

    def stop_lines(self) -> None:
        for task in self.lines:
            task.cancel()


class BatchRunner:
    def __init__(self, store: BatchStore, db: DatabaseThread, disk: BatchDisk, client: InProcessClient,
                 concurrency: int) -> None:
        self.store, self.db, self.disk, self.client = store, db, disk, client
        self._slots = asyncio.Semaphore(concurrency)  # lines in flight, all batches together
        self._jobs: dict[str, _Job] = {}

    def submit(self, batch_id: str) -> None:
        """Run (or resume, or finish) the batch from the state stored for it."""
        job = _Job(batch_id)
        # a fresh context: not the request id of the request that created or cancelled the batch
        job.task = asyncio.get_running_loop().create_task(self._run(job), name=f"pagegate-{batch_id}",
                                                          context=contextvars.Context())
        self._jobs[batch_id] = job
        job.task.add_done_callback(lambda _: self._jobs.pop(batch_id, None) if self._jobs.get(batch_id) is job
                                   else None)

    def cancel(self, batch_id: str) -> None:
        """The batch was moved to cancelling: stop its lines and write what it has."""
        job = self._jobs.get(batch_id)
        if job is None:
            self.submit(batch_id)
            return
        job.cancelled = True
        job.stop_lines()

    async def stop(self) -> None:
        """Stop every batch where it is (nothing is lost: each resumes at the next start)."""
        jobs = list(self._jobs.values())
        for job in jobs:
            job.stop_lines()
            if job.task is not None:
                job.task.cancel()
        await asyncio.gather(*(job.task for job in jobs if job.task is not None), return_exceptions=True)
        await asyncio.gather(*(task for job in jobs for task in job.lines), return_exceptions=True)

    # -- one batch ---------------------------------------------------------------------------------
    async def _run(self, job: _Job) -> None:
        batch = await self.db(self.store.batch, job.batch_id)
        try:
            if batch.status == "validating":
                batch = await self._validate(batch)
            if batch.status == "in_progress":
                await self._run_lines(job, batch)
            if batch.status not in TERMINAL:
                await self._finalize(job, batch)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a bug: the batch fails instead of failing again at every start
            logger.exception("batch %s failed", batch.id)
            await self._fail(batch, "internal_error", f"The batch failed: {type(exc).__name__}: {exc}")

    async def _validate(self, batch: BatchRecord) -> BatchRecord:
        """validating -> in_progress (with its counts), or failed when the input is not a batch."""
        try:
            check = await asyncio.to_thread(check_file, self.disk.input_path(batch.id), batch.endpoint)
        except InvalidInputFile as invalid:
            return await self._fail(batch, invalid.code, invalid.message)
        await self.db(self.store.move, batch.id, "in_progress", now(), ("validating",), total=check.total,
                      failed=check.bad)
        return await self.db(self.store.batch, batch.id)  # in_progress, or cancelling meanwhile

    async def _fail(self, batch: BatchRecord, code: str, message: str) -> BatchRecord:
        logger.warning("batch %s failed: %s", batch.id, message)
        errors = [{"code": code, "message": message, "param": None, "line": None}]
        await self.db(self.store.finish, batch.id, "failed", now(), [], errors=errors)
        await asyncio.to_thread(self.disk.unlink_input, batch.id)
        return await self.db(self.store.batch, batch.id)

    async def _run_lines(self, job: _Job, batch: BatchRecord) -> None:
        """Send every line not answered yet; return once each sent one is answered and stored (or cancelled)."""
        done = await self.db(self.store.done_custom_ids, batch.id)
        lines = read_lines(self.disk.input_path(batch.id), batch.endpoint)
        try:
            async for chunk in _in_chunks(lines):
                if not await self._dispatch(job, batch, chunk, done):
                    break
        finally:
            with contextlib.suppress(ValueError):  # a worker thread still reads it (we were cancelled): GC closes it
                lines.close()
            if job.cancelled or job.expired:
                job.stop_lines()
            await asyncio.gather(*job.lines, return_exceptions=True)
            await self.db(lambda: None)  # every answer handed to the database thread is stored by now
        if job.failure is not None:  # a line's answer could not be stored: the batch must not end as if it had
            raise job.failure

    async def _dispatch(self, job: _Job, batch: BatchRecord, chunk: list[Line], done: set[str]) -> bool:
        """Start the chunk's unanswered lines as slots free up; False once the batch stops taking lines."""
        for line in chunk:
            if not isinstance(line, BatchLine) or line.custom_id in done:
                continue
            if time.time() >= batch.expires_at:
                job.expired = True
                return False
            await self._slots.acquire()
            if job.cancelled or job.failure is not None:
                self._slots.release()
                return False
            task = asyncio.get_running_loop().create_task(self._run_line(batch, line))
            job.lines.add(task)
            task.add_done_callback(job.line_done)
            # NOTE: released when the task ends, not by the coroutine: a task cancelled before its first step
            # never runs its own `finally`, and its slot would be lost for good
            task.add_done_callback(lambda _: self._slots.release())
        return True

    async def _run_line(self, batch: BatchRecord, line: BatchLine) -> None:
        pause = RETRY_FIRST_S
        while True:
            answer = await self.client.post(batch.endpoint, line.body, batch.tenant)
            if answer.status_code not in RETRIED:
                break
            await asyncio.sleep(pause)
            pause = min(2 * pause, RETRY_MAX_S)
        result = LineResult(line.index, line.custom_id, new_request_id(), answer.request_id, answer.status_code,
                            answer.body)
        await self.db(self.store.record, batch.id, result)

    # -- the end -----------------------------------------------------------------------------------
    async def _finalize(self, job: _Job, batch: BatchRecord) -> None:
        status = "expired" if job.expired else await self._end_status(batch)
        output, errors, counts = await asyncio.to_thread(self._write_files, batch, status == "expired")
        outputs = [record for record in (output, errors) if record is not None]
        await self.db(self.store.finish, batch.id, status, now(), outputs, completed=counts.completed,
                      failed=counts.failed, output_file_id=output.id if output else None,
                      error_file_id=errors.id if errors else None)
        await asyncio.to_thread(self.disk.unlink_input, batch.id)
        logger.info("batch %s %s: %d completed, %d failed", batch.id, status, counts.completed, counts.failed)

    async def _end_status(self, batch: BatchRecord) -> str:
        """completed (after finalizing) or, if it was cancelled meanwhile, cancelled."""
        moved = await self.db(self.store.move, batch.id, "finalizing", now(), ("in_progress", "finalizing"))
        return "completed" if moved else "cancelled"

    def _write_files(self, batch: BatchRecord, expired: bool) -> tuple[FileRecord | None, FileRecord | None,
                                                                        Assembled]:
        """The output and error files (each only if it has a line), written whole; in a worker thread."""
        output_id, error_id = new_file_id(), new_file_id()
        with atomic_file(self.disk.file_path(output_id)) as output, \
                atomic_file(self.disk.file_path(error_id)) as errors:
            counts = assemble(read_lines(self.disk.input_path(batch.id), batch.endpoint),
                              read_results(self.store.path, batch.id), output, errors, expired)
            sizes = output.tell(), errors.tell()
        created = now()
        records: list[FileRecord | None] = []
        for file_id, kind, size, lines in ((output_id, "output", sizes[0], counts.completed),
                                           (error_id, "error", sizes[1], counts.failed)):
            if not lines:
                self.disk.delete_file(file_id)
                records.append(None)
                continue
            records.append(FileRecord(file_id, batch.tenant, "batch_output", f"{batch.id}_{kind}.jsonl", size,
                                      created, created + batch.output_ttl_s))
        return records[0], records[1], counts


async def _in_chunks(lines: Generator[Line, None, None]) -> AsyncIterator[list[Line]]:
    """The lines a chunk at a time, each read and parsed in a worker thread."""
    while chunk := await asyncio.to_thread(lambda: list(itertools.islice(lines, CHUNK_LINES))):
        yield chunk
