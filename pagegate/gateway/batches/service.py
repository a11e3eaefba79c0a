"""What the Files and Batch routes do, per API key: a key reaches only its own files and batches (any other id is
answered as a missing one), and a batch only its key's input file. Disk and database work runs off the event loop.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import Mapping
from typing import Any, BinaryIO

from starlette.types import ASGIApp

from pagegate.gateway.batches.disk import BatchDisk, FileTooLarge
from pagegate.gateway.batches.in_process import InProcessClient
from pagegate.gateway.batches.protocol import (
    COMPLETION_WINDOW_S,
    DEFAULT_TTL_S,
    UPLOAD_PURPOSE,
    BatchCreateRequest,
)
from pagegate.gateway.batches.runner import BatchRunner, new_file_id, now
from pagegate.gateway.batches.store import BatchRecord, BatchStore, DatabaseThread, FileRecord, StorageFull
from pagegate.gateway.errors import APIError, BadRequest, NotFound, PayloadTooLarge
from pagegate.gateway.settings import GatewayConfig

logger = logging.getLogger("pagegate.gateway")

MAX_UPLOAD_BYTES = 200 * 1024 * 1024  # one batch input file (OpenAI's bound)
JANITOR_INTERVAL_S = 300.0  # how often expired files are removed (an expired file is answered 404 at once)


class BatchConflict(APIError):
    """A cancel of a batch that has already ended or is ending."""

    status_code = 409
    default_code = "batch_not_cancellable"


class Batches:
    """The Files and Batch APIs over --batch-dir: started and stopped by the app's lifespan."""

    def __init__(self, config: GatewayConfig, concurrency: int) -> None:
        assert config.batch_dir is not None
        self.max_bytes = config.batch_max_bytes
        self.concurrency = concurrency
        self.disk = BatchDisk(config.batch_dir)
        self.store = BatchStore(self.disk.db_path)
        self.db = DatabaseThread()
        self.runner: BatchRunner | None = None
        self._janitor: asyncio.Task[None] | None = None

    # -- lifecycle ---------------------------------------------------------------------------------
    async def start(self, router: ASGIApp, state: Mapping[str, Any]) -> None:
        """Sweep what a crash left, drop expired files, resume every batch that was live; lines go to `router`."""
        live = await self.db(self.store.live_batches)
        known = await self.db(self.store.file_ids)
        removed = await asyncio.to_thread(self.disk.sweep, known, {batch.id for batch in live})
        if removed:
            logger.info("batches: removed %d unreferenced file(s) under %s", removed, self.disk.root)
        await self.expire_files()
        self.runner = BatchRunner(self.store, self.db, self.disk, InProcessClient(router, state), self.concurrency)
        for batch in live:
            self.runner.submit(batch.id)
        if live:
            logger.info("batches: resuming %d batch(es)", len(live))
        self._janitor = asyncio.get_running_loop().create_task(self._expire_periodically())

    async def stop(self) -> None:
        if self._janitor is not None:
            self._janitor.cancel()
        if self.runner is not None:
            await self.runner.stop()
        await asyncio.to_thread(self.db.shutdown)
        self.store.close()
        self.disk.close()

    async def expire_files(self) -> None:
        expired = await self.db(self.store.take_expired_files, now())
        for file_id in expired:
            await asyncio.to_thread(self.disk.delete_file, file_id)

    async def _expire_periodically(self) -> None:
        while True:
            await asyncio.sleep(JANITOR_INTERVAL_S)
            try:
                await self.expire_files()
            except Exception:
                logger.exception("batches: removing expired files failed")

    # -- files -------------------------------------------------------------------------------------
    async def upload_limit(self) -> int:
        """The most bytes an upload may have now (the per-file bound, or what --batch-max-bytes leaves)."""
        return max(0, min(MAX_UPLOAD_BYTES, self.max_bytes - await self.db(self.store.bytes_used)))

    async def upload(self, tenant: str | None, filename: str, purpose: str, source: BinaryIO,
                     ttl_s: int | None) -> FileRecord:
        if purpose != UPLOAD_PURPOSE:
            raise BadRequest(f"Invalid purpose {purpose!r}: this server takes files for the Batch API only "
                             f"(purpose {UPLOAD_PURPOSE!r}).", param="purpose")
        file_id = new_file_id()
        try:
            size = await asyncio.to_thread(self.disk.write_upload, file_id, source, MAX_UPLOAD_BYTES)
        except FileTooLarge:
            raise PayloadTooLarge(f"The file is larger than {MAX_UPLOAD_BYTES} bytes, the most one batch input "
                                  f"file may hold.", param="file") from None
        created = now()
        record = FileRecord(file_id, tenant, purpose, filename, size, created, created + (ttl_s or DEFAULT_TTL_S))
        try:
            await self.db(self.store.add_file, record, self.max_bytes)
        except StorageFull as full:
            await asyncio.to_thread(self.disk.delete_file, file_id)
            raise self.storage_full(size, full.used) from None
        return record

    def storage_full(self, size: int, used: int) -> PayloadTooLarge:
        return PayloadTooLarge(f"The file ({size} bytes or more) does not fit: the server's files hold {used} of "
                               f"{self.max_bytes} bytes (--batch-max-bytes). Delete files to make room.",
                               param="file", code="storage_limit_exceeded")

    async def file(self, tenant: str | None, file_id: str) -> FileRecord:
        record = await self.db(self.store.get_file, file_id, tenant, now())
        if record is None:
            raise NotFound(f"No such File object: {file_id}", param="id")
        return record

    async def list_files(self, tenant: str | None, purpose: str | None, after: str | None, limit: int,
                         newest_first: bool) -> tuple[list[FileRecord], bool]:
        return await self.db(self.store.list_files, tenant, now(), purpose, after, limit, newest_first)

    async def delete_file(self, tenant: str | None, file_id: str) -> None:
        if not await self.db(self.store.delete_file, file_id, tenant, now()):
            raise NotFound(f"No such File object: {file_id}", param="id")
        await asyncio.to_thread(self.disk.delete_file, file_id)

    async def open_file(self, tenant: str | None, file_id: str) -> tuple[FileRecord, BinaryIO]:
        """The file's record and its bytes, open (still readable if it is deleted meanwhile)."""
        record = await self.file(tenant, file_id)
        try:
            return record, await asyncio.to_thread(self.disk.file_path(file_id).open, "rb")
        except FileNotFoundError:  # deleted since it was looked up
            raise NotFound(f"No such File object: {file_id}", param="id") from None

    # -- batches -----------------------------------------------------------------------------------
    async def create(self, tenant: str | None, request: BatchCreateRequest) -> BatchRecord:
        source = await self.db(self.store.get_file, request.input_file_id, tenant, now())
        if source is None:
            raise NotFound(f"No such File object: {request.input_file_id}", param="input_file_id")
        if source.purpose != UPLOAD_PURPOSE:
            raise BadRequest(f"The input file's purpose is {source.purpose!r}, not {UPLOAD_PURPOSE!r}.",
                             param="input_file_id")
        batch_id = "batch_" + secrets.token_hex(12)
        try:
            await asyncio.to_thread(self.disk.link_input, batch_id, source.id)
        except FileNotFoundError:  # deleted since it was looked up
            raise NotFound(f"No such File object: {request.input_file_id}", param="input_file_id") from None
        created = now()
        ttl = request.output_expires_after.seconds if request.output_expires_after else DEFAULT_TTL_S
        record = BatchRecord(batch_id, tenant, request.endpoint, source.id, request.completion_window, "validating",
                             request.metadata, None, None, None, ttl, 0, 0, 0, created,
                             created + COMPLETION_WINDOW_S)
        await self.db(self.store.add_batch, record)
        self._runner().submit(batch_id)
        return record

    async def batch(self, tenant: str | None, batch_id: str) -> BatchRecord:
        record = await self.db(self.store.get_batch, batch_id, tenant)
        if record is None:
            raise NotFound(f"No batch found with id '{batch_id}'.", param="batch_id")
        return record

    async def list_batches(self, tenant: str | None, after: str | None,
                           limit: int) -> tuple[list[BatchRecord], bool]:
        return await self.db(self.store.list_batches, tenant, after, limit)

    async def cancel(self, tenant: str | None, batch_id: str) -> BatchRecord:
        """validating or in_progress -> cancelling; the runner then stops its lines and writes what it has."""
        record = await self.batch(tenant, batch_id)
        if record.status in ("cancelling", "cancelled"):
            return record
        if await self.db(self.store.move, batch_id, "cancelling", now(), ("validating", "in_progress")):
            self._runner().cancel(batch_id)
            return await self.batch(tenant, batch_id)
        record = await self.batch(tenant, batch_id)
        if record.status in ("cancelling", "cancelled"):
            return record
        raise BatchConflict(f"Cannot cancel a batch whose status is '{record.status}'.")

    def _runner(self) -> BatchRunner:
        assert self.runner is not None, "Batches.start has not run"
        return self.runner
