"""The metadata of files and batches and each batch line's result, in SQLite (WAL) under --batch-dir.

Every method runs statements on one connection and must be called from one thread at a time: the service
calls them on its database thread (`DatabaseThread`), never on the event loop. A result is keyed by
(batch_id, custom_id) and written with the batch's counts in one transaction, so a line answered twice (a
resumed batch, a late duplicate) is stored and counted once.

NOTE: synchronous=NORMAL under WAL: a committed transaction survives the process being killed (SIGKILL); only a
power cut may lose the last few, never corrupt the file.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sqlite3
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, ParamSpec, TypeVar

P = ParamSpec("P")
T = TypeVar("T")

LIVE = ("validating", "in_progress", "finalizing", "cancelling")  # a batch the runner still owes work
TERMINAL = ("completed", "failed", "expired", "cancelled")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT NOT NULL UNIQUE, tenant TEXT, purpose TEXT NOT NULL,
    filename TEXT NOT NULL, bytes INTEGER NOT NULL, created_at INTEGER NOT NULL, expires_at INTEGER);
CREATE TABLE IF NOT EXISTS batches (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT NOT NULL UNIQUE, tenant TEXT, endpoint TEXT NOT NULL,
    input_file_id TEXT NOT NULL, completion_window TEXT NOT NULL, status TEXT NOT NULL, metadata TEXT,
    errors TEXT, output_file_id TEXT, error_file_id TEXT, output_ttl_s INTEGER NOT NULL,
    total INTEGER NOT NULL DEFAULT 0, completed INTEGER NOT NULL DEFAULT 0, failed INTEGER NOT NULL DEFAULT 0,
    created_at INTEGER NOT NULL, expires_at INTEGER NOT NULL, in_progress_at INTEGER, finalizing_at INTEGER,
    completed_at INTEGER, failed_at INTEGER, expired_at INTEGER, cancelling_at INTEGER, cancelled_at INTEGER);
CREATE TABLE IF NOT EXISTS results (
    batch_id TEXT NOT NULL, custom_id TEXT NOT NULL, line INTEGER NOT NULL, id TEXT NOT NULL,
    request_id TEXT NOT NULL, status_code INTEGER NOT NULL, body BLOB NOT NULL, PRIMARY KEY (batch_id, custom_id));
CREATE INDEX IF NOT EXISTS results_in_order ON results (batch_id, line);
"""


@dataclass
class FileRecord:
    id: str
    tenant: str | None
    purpose: str
    filename: str
    bytes: int
    created_at: int
    expires_at: int | None


@dataclass
class BatchRecord:
    id: str
    tenant: str | None
    endpoint: str
    input_file_id: str
    completion_window: str
    status: str
    metadata: dict[str, str] | None
    errors: list[dict[str, Any]] | None  # a batch-level failure's errors (OpenAI's `errors.data`)
    output_file_id: str | None
    error_file_id: str | None
    output_ttl_s: int  # how long its output and error files are kept
    total: int
    completed: int
    failed: int
    created_at: int
    expires_at: int
    in_progress_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None


@dataclass(frozen=True)
class LineResult:
    """What a line's request answered."""

    line: int
    custom_id: str
    id: str  # the output line's id (batch_req_...)
    request_id: str
    status_code: int
    body: bytes  # JSON


class StorageFull(Exception):
    def __init__(self, used: int) -> None:
        super().__init__(used)
        self.used = used


class BatchStore:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.db = connect(self.path)
        self.db.executescript(_SCHEMA)

    def close(self) -> None:
        self.db.close()

    # -- files -------------------------------------------------------------------------------------
    def add_file(self, record: FileRecord, max_bytes: int | None = None) -> None:
        """Insert `record`; StorageFull (nothing written) when the files would then hold more than `max_bytes`."""
        with self.transaction():  # the sum and the insert as one step
            used = self.bytes_used()
            if max_bytes is not None and used + record.bytes > max_bytes:
                raise StorageFull(used)
            self._insert("files", record)

    def bytes_used(self) -> int:
        return self.db.execute("SELECT COALESCE(SUM(bytes), 0) FROM files").fetchone()[0]

    def get_file(self, file_id: str, tenant: str | None, now: int) -> FileRecord | None:
        row = self.db.execute("SELECT * FROM files WHERE id = ? AND tenant IS ? AND " + _UNEXPIRED,
                              (file_id, tenant, now)).fetchone()
        return _record(FileRecord, row) if row else None

    def list_files(self, tenant: str | None, now: int, purpose: str | None, after: str | None, limit: int,
                   newest_first: bool) -> tuple[list[FileRecord], bool]:
        """A page of the tenant's files after the one with id `after`, and whether more follow."""
        query = "SELECT * FROM files WHERE tenant IS ? AND " + _UNEXPIRED
        args: list[Any] = [tenant, now]
        if purpose is not None:
            query += " AND purpose = ?"
            args.append(purpose)
        rows = self._page("files", query, args, after, limit, newest_first)
        return [_record(FileRecord, row) for row in rows[:limit]], len(rows) > limit

    def delete_file(self, file_id: str, tenant: str | None, now: int) -> bool:
        with self.transaction():
            return self.db.execute("DELETE FROM files WHERE id = ? AND tenant IS ? AND " + _UNEXPIRED,
                                   (file_id, tenant, now)).rowcount > 0

    def take_expired_files(self, now: int) -> list[str]:
        """Delete the rows of the files expired by `now`; their ids (their bytes are the caller's to remove)."""
        with self.transaction():
            rows = self.db.execute("DELETE FROM files WHERE expires_at IS NOT NULL AND expires_at <= ? RETURNING id",
                                   (now,)).fetchall()
        return [row[0] for row in rows]

    def file_ids(self) -> set[str]:
        return {row[0] for row in self.db.execute("SELECT id FROM files")}

    # -- batches -----------------------------------------------------------------------------------
    def add_batch(self, record: BatchRecord) -> None:
        with self.transaction():
            self._insert("batches", record)

    def get_batch(self, batch_id: str, tenant: str | None) -> BatchRecord | None:
        row = self.db.execute("SELECT * FROM batches WHERE id = ? AND tenant IS ?", (batch_id, tenant)).fetchone()
        return _record(BatchRecord, row) if row else None

    def batch(self, batch_id: str) -> BatchRecord:
        """The batch whatever its tenant (the runner's)."""
        return _record(BatchRecord, self.db.execute("SELECT * FROM batches WHERE id = ?", (batch_id,)).fetchone())

    def list_batches(self, tenant: str | None, after: str | None, limit: int) -> tuple[list[BatchRecord], bool]:
        rows = self._page("batches", "SELECT * FROM batches WHERE tenant IS ?", [tenant], after, limit, True)
        return [_record(BatchRecord, row) for row in rows[:limit]], len(rows) > limit

    def live_batches(self) -> list[BatchRecord]:
        rows = self.db.execute(f"SELECT * FROM batches WHERE status IN ({_marks(LIVE)}) ORDER BY seq",
                               LIVE).fetchall()
        return [_record(BatchRecord, row) for row in rows]

    def move(self, batch_id: str, status: str, now: int, allowed: tuple[str, ...], **values: Any) -> bool:
        """Set the batch's status (and `<status>_at`, and `values`) if its status is one of `allowed`."""
        with self.transaction():
            return self._move(batch_id, status, now, allowed, values)

    def _move(self, batch_id: str, status: str, now: int, allowed: tuple[str, ...], values: dict[str, Any]) -> bool:
        values = {**values, f"{status}_at": now}
        if "errors" in values:
            values["errors"] = json.dumps(values["errors"])
        assignments = ", ".join(f"{name} = ?" for name in values)
        cursor = self.db.execute(f"UPDATE batches SET status = ?, {assignments} WHERE id = ? AND status IN "
                                 f"({_marks(allowed)})", (status, *values.values(), batch_id, *allowed))
        return cursor.rowcount > 0

    # -- results -----------------------------------------------------------------------------------
    def record(self, batch_id: str, result: LineResult) -> bool:
        """Store a line's answer and count it, unless that custom_id has one already; whether it was new."""
        with self.transaction():
            cursor = self.db.execute("INSERT OR IGNORE INTO results VALUES (?, ?, ?, ?, ?, ?, ?)",
                                     (batch_id, result.custom_id, result.line, result.id, result.request_id,
                                      result.status_code, result.body))
            if cursor.rowcount == 0:
                return False
            counter = "completed" if succeeded(result.status_code) else "failed"
            self.db.execute(f"UPDATE batches SET {counter} = {counter} + 1 WHERE id = ?", (batch_id,))
        return True

    def done_custom_ids(self, batch_id: str) -> set[str]:
        return {row[0] for row in self.db.execute("SELECT custom_id FROM results WHERE batch_id = ?", (batch_id,))}

    def finish(self, batch_id: str, status: str, now: int, outputs: list[FileRecord], **values: Any) -> None:
        """The batch's end in one transaction: its output files' rows, its status and counts; its results go
        (the files hold them now)."""
        with self.transaction():
            for record in outputs:
                self._insert("files", record)
            self.db.execute("DELETE FROM results WHERE batch_id = ?", (batch_id,))
            self._move(batch_id, status, now, LIVE, values)

    # -- helpers -----------------------------------------------------------------------------------
    @contextlib.contextmanager
    def transaction(self) -> Iterator[None]:
        """Statements that commit together or not at all (the connection is in autocommit mode otherwise)."""
        self.db.execute("BEGIN IMMEDIATE")
        try:
            yield
        except BaseException:
            self.db.execute("ROLLBACK")
            raise
        self.db.execute("COMMIT")

    def _insert(self, table: str, record: FileRecord | BatchRecord) -> None:
        values = {field.name: getattr(record, field.name) for field in fields(record)}
        for name in ("metadata", "errors"):
            if name in values and values[name] is not None:
                values[name] = json.dumps(values[name])
        self.db.execute(f"INSERT INTO {table} ({', '.join(values)}) VALUES ({', '.join('?' * len(values))})",
                        tuple(values.values()))

    def _page(self, table: str, query: str, args: list[Any], after: str | None, limit: int,
              newest_first: bool) -> list[sqlite3.Row]:
        """Up to limit + 1 rows of `query` in insertion order (or its reverse), after the row with id `after`."""
        if after is not None:
            query += f" AND seq {'<' if newest_first else '>'} (SELECT seq FROM {table} WHERE id = ?)"
            args.append(after)
        query += f" ORDER BY seq {'DESC' if newest_first else 'ASC'} LIMIT ?"
        return self.db.execute(query, (*args, limit + 1)).fetchall()


_UNEXPIRED = "(expires_at IS NULL OR expires_at > ?)"


def _marks(values: tuple[str, ...]) -> str:
    return ", ".join("?" * len(values))


def succeeded(status_code: int) -> bool:
    return 200 <= status_code < 300


def read_results(path: Path, batch_id: str) -> Iterator[LineResult]:
    """A batch's results in input order, through a connection of its own (a WAL reader: the writer goes on)."""
    db = connect(path)
    try:
        for row in db.execute("SELECT line, custom_id, id, request_id, status_code, body FROM results "
                              "WHERE batch_id = ? ORDER BY line", (batch_id,)):
            yield LineResult(row[0], row[1], row[2], row[3], row[4], bytes(row[5]))
    finally:
        db.close()


def connect(path: Path) -> sqlite3.Connection:
    db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
    db.row_factory = sqlite3.Row
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("PRAGMA synchronous=NORMAL")
    db.execute("PRAGMA busy_timeout=10000")
    return db


def _record(cls: type[T], row: sqlite3.Row) -> T:
    values = {key: row[key] for key in row.keys() if key != "seq"}
    for name in ("metadata", "errors"):
        if values.get(name) is not None:
            values[name] = json.loads(values[name])
    return cls(**values)


class DatabaseThread:
    """One thread that runs every BatchStore call, in the order asked, off the event loop."""

    def __init__(self) -> None:
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="pagegate-batches")

    async def __call__(self, function: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._executor, lambda: function(*args, **kwargs))

    def shutdown(self) -> None:
        self._executor.shutdown(wait=True)
