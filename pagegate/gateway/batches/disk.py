"""The bytes under --batch-dir: files' contents and batches' inputs, the SQLite file beside them, one server's lock.

NOTE: a path is only ever made from an id this server generated (checked against its pattern here), never from
anything a client sent: a client's `filename` is metadata in the database. Every file is written whole or not at
all (a temporary file, fsync, os.replace, fsync of the folder), so a crash leaves either the old state or the
new one, and at worst a stray temporary or unreferenced file that the start-up sweep removes.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

FILE_ID = re.compile(r"file-[0-9a-f]{24}")
BATCH_ID = re.compile(r"batch_[0-9a-f]{24}")
COPY_CHUNK = 1 << 20


class BatchDirInUse(RuntimeError):
    """Another server holds --batch-dir: two would run the same batches."""


class FileTooLarge(Exception):
    """An upload longer than it may be (the copy stops there)."""


class BatchDisk:
    """`root`/files/<file id> (uploads and batch outputs), `root`/inputs/<batch id> (a batch's input, linked to
    its file so deleting the file through the API does not take it from a running batch), `root`/batches.sqlite3."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)
        self.files = self.root / "files"
        self.inputs = self.root / "inputs"
        for folder in (self.root, self.files, self.inputs):
            folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._lock = _lock(self.root / ".lock")

    @property
    def db_path(self) -> Path:
        return self.root / "batches.sqlite3"

    def file_path(self, file_id: str) -> Path:
        if not FILE_ID.fullmatch(file_id):
            raise ValueError(f"not a file id of this server: {file_id!r}")
        return self.files / file_id

    def input_path(self, batch_id: str) -> Path:
        if not BATCH_ID.fullmatch(batch_id):
            raise ValueError(f"not a batch id of this server: {batch_id!r}")
        return self.inputs / batch_id

    def write_upload(self, file_id: str, source: BinaryIO, limit: int) -> int:
        """Copy `source` into the file `file_id`, durably; its size (FileTooLarge past `limit` bytes)."""
        size = 0
        with atomic_file(self.file_path(file_id)) as out:
            while chunk := source.read(COPY_CHUNK):
                size += len(chunk)
                if size > limit:
                    raise FileTooLarge(size)
                out.write(chunk)
        return size

    def delete_file(self, file_id: str) -> None:
        self.file_path(file_id).unlink(missing_ok=True)

    def link_input(self, batch_id: str, file_id: str) -> None:
        """The batch's own name for its input's bytes (a hard link: no copy; a copy where links fail)."""
        target = self.input_path(batch_id)
        target.unlink(missing_ok=True)
        try:
            os.link(self.file_path(file_id), target)
        except OSError:
            with self.file_path(file_id).open("rb") as source, atomic_file(target) as out:
                shutil.copyfileobj(source, out, COPY_CHUNK)
        _fsync_dir(self.inputs)

    def unlink_input(self, batch_id: str) -> None:
        self.input_path(batch_id).unlink(missing_ok=True)

    def sweep(self, known_files: set[str], live_batches: set[str]) -> int:
        """Remove what no record names: temporary files a crash left, files whose row was never written (or was
        deleted before the crash), inputs of batches that ended. How many were removed."""
        removed = 0
        for folder, keep, ours in ((self.files, known_files, FILE_ID), (self.inputs, live_batches, BATCH_ID)):
            for entry in folder.iterdir():
                # NOTE: only names this server makes (an id, or its temporary): --batch-dir may name a folder that
                # holds someone's own files, and the sweep must never touch them
                name = entry.name.removeprefix(".").removesuffix(".tmp")
                if entry.name not in keep and ours.fullmatch(name) and entry.is_file() and not entry.is_symlink():
                    entry.unlink(missing_ok=True)
                    removed += 1
        return removed

    def close(self) -> None:
        self._lock.close()  # closing the descriptor releases the lock


@contextlib.contextmanager
def atomic_file(path: Path) -> Iterator[BinaryIO]:
    """A file written at `path` only as a whole: into a temporary beside it, flushed to disk, then renamed."""
    temporary = path.with_name(f".{path.name}.tmp")
    try:
        with temporary.open("wb") as out:
            yield out
            out.flush()
            os.fsync(out.fileno())
        os.replace(temporary, path)
        _fsync_dir(path.parent)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


def _fsync_dir(folder: Path) -> None:
    """Make a rename in `folder` durable (the folder's entry, not only the file's bytes)."""
    descriptor = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _lock(path: Path) -> BinaryIO:
    """An exclusive lock held while the returned file stays open; the kernel drops it when the process dies
    (SIGKILL included), so a restarted server takes it again."""
    handle = path.open("ab")
    try:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.close()
        raise BatchDirInUse(f"--batch-dir {path.parent} is in use by another pagegate server") from None
    return handle
