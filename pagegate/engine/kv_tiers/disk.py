"""The disk tier: one file per page under a fingerprinted, locked directory; LRU by use; survives restarts."""

from __future__ import annotations

import hashlib
import logging
import os
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from contextlib import suppress
from functools import partial
from pathlib import Path

import numpy as np
import torch

from pagegate.engine.kv_tiers.disk_slot import UnsafeDirectory, take_slot
from pagegate.engine.kv_tiers.page_file import (
    BadPage,
    PageFormat,
    file_name,
    read_page,
    remove_page,
    scan_directory,
    write_page,
)
from pagegate.engine.kv_tiers.records import DISK, PageKey, TierEvent, TierStats, TokenIds

log = logging.getLogger(__name__)

MAX_PENDING_BYTES = 256 << 20  # pages copied but not yet written; past it a store is skipped, never waited on


class DiskLoad:
    """Pages the read thread copies into `pages`; when done, `result()` is the leading run it verified."""

    def __init__(self, keys: Sequence[PageKey], page_bytes: int) -> None:
        self.keys = list(keys)
        self.pages = torch.empty((len(self.keys), page_bytes), dtype=torch.uint8)
        self.future: Future[int] = Future()

    def done(self) -> bool:
        return self.future.done()

    def result(self, timeout: float | None = None) -> torch.Tensor:
        """[n, page_bytes]: the first n pages asked for, read and checked (a missing or bad one ends the run)."""
        return self.pages[: self.future.result(timeout)]


class DiskTier:
    """Pages in `directory/<fingerprint[:16]>/<slot>/<hash>`; a write thread and a read thread do the I/O.

    The fingerprint (any bytes naming model, weights, tokenizer, block size and KV format) is kept as its
    SHA-256 in every header: a file of another model is never served. Any OSError while setting up or
    writing (unwritable directory, full disk) turns the tier off with one warning; serving goes on. A directory
    that fails disk_slot's checks (a link, another user's, writable by others) is refused with one error and
    the tier stays off; only files the tier wrote (page magic, or its `.tmp`) are ever deleted.
    """

    def __init__(self, directory: str | Path, max_bytes: int, fingerprint: bytes, page_bytes: int,
                 block_size: int) -> None:
        self.format = PageFormat(hashlib.sha256(fingerprint).digest(), block_size, page_bytes)
        self.root = Path(directory) / self.format.fingerprint.hex()[:16]
        self.capacity_pages = max(0, max_bytes) // self.format.file_bytes
        self.enabled = True
        self.directory: Path | None = None
        self.stats = TierStats(capacity_bytes=self.capacity_pages * self.format.file_bytes)
        self.events: list[TierEvent] = []
        self._index: OrderedDict[int, PageKey] = OrderedDict()  # hash -> key, least recently used first
        self._pending: dict[int, bytes] = {}  # copied pages not yet on disk, served from memory meanwhile
        self._mutex = threading.Lock()
        self._lock_fd: int | None = None
        self._dir_fd: int | None = None
        try:
            self.directory, self._dir_fd, self._lock_fd = take_slot(Path(directory), self.root.name)
            self._index_files(self._dir_fd)
        except OSError as error:
            self._disable(error)
        self._writes: queue.Queue[Callable[[], None] | None] = queue.Queue()
        self._reads: queue.Queue[Callable[[], None] | None] = queue.Queue()
        # NOTE: reads have their own thread so a request waiting for its pages never queues behind writes
        self._threads = [threading.Thread(target=_work, args=(jobs,), name=f"pagegate-kv-disk-{name}",
                                          daemon=True) for name, jobs in (("write", self._writes),
                                                                          ("read", self._reads))]
        for thread in self._threads:
            thread.start()

    def _index_files(self, dir_fd: int) -> None:
        """Index the sane page files, least recently used first; the tier's other files are deleted and what it
        did not write is left alone, with one warning for both."""
        keys, dropped, left = scan_directory(dir_fd, self.format)
        if dropped or left:
            reasons = ", ".join(f"{count} {reason}" for reason, count in dropped.most_common())
            log.warning("kv disk tier %s: deleted %d files that will not be served (%s); left alone %d entries "
                        "it did not write", self.directory, dropped.total(), reasons or "none", left)
        self._index.update((key.hash, key) for key in keys)
        self._record("BlockStored", keys)
        for hash in self._evict_over_capacity():
            self._delete(hash)

    def __contains__(self, hash: int) -> bool:
        return hash in self._index

    @property
    def num_pages(self) -> int:
        return len(self._index)

    def put(self, key: PageKey, data_row: torch.Tensor) -> None:
        """Queue one page for writing (its bytes are copied now); a page already stored is only refreshed."""
        with self._mutex:
            if not self.enabled or self.capacity_pages == 0:
                return
            if key.hash in self._index:
                self._index.move_to_end(key.hash)
                return
            if len(self._pending) * self.format.page_bytes >= MAX_PENDING_BYTES:
                self.stats.skipped_stores += 1
                return
        payload = data_row.detach().to("cpu").contiguous().numpy().tobytes()
        with self._mutex:
            if not self.enabled:  # turned off by the write thread meanwhile
                return
            self._index[key.hash], self._pending[key.hash] = key, payload
            self.stats.stores += 1
            evicted = self._evict_over_capacity()
            self._record("BlockStored", [key])
        self._writes.put(partial(self._write, key, payload))
        for hash in evicted:
            self._writes.put(partial(self._delete, hash))

    def _evict_over_capacity(self) -> list[int]:
        keys = [self._index.popitem(last=False)[1] for _ in range(len(self._index) - self.capacity_pages)]
        self.stats.evictions += len(keys)
        self._record("BlockRemoved", keys)
        return [key.hash for key in keys]

    def find(self, hash: int, parent: int, tokens: TokenIds) -> PageKey | None:
        """The stored page's key (and marks it recently used), or None; a colliding hash is a miss."""
        with self._mutex:
            key = self._index.get(hash) if self.enabled else None
            if key is None or not key.matches(parent, tokens):
                return None
            self._index.move_to_end(hash)
            return key

    def holds(self, key: PageKey) -> bool:
        return self._index.get(key.hash) == key

    def load(self, keys: Sequence[PageKey]) -> DiskLoad:
        """Read pages on the read thread; poll `done()` on the returned load (the caller never waits)."""
        load = DiskLoad(keys, self.format.page_bytes)
        self._reads.put(partial(self._read_into, load))
        return load

    def read(self, hash: int) -> tuple[PageKey, bytes] | None:
        """One page, read and checked on the calling thread, or None (missing or bad: recompute it)."""
        out = torch.empty(self.format.page_bytes, dtype=torch.uint8)
        key = self._read_one(hash, None, out)
        return None if key is None else (key, out.numpy().tobytes())

    def flush(self) -> None:
        """Wait until every queued write, delete and read is done (shutdown, tests)."""
        self._writes.join()
        self._reads.join()

    def close(self) -> None:
        """Finish queued work, stop the threads and release the slot's lock."""
        if not self._threads:
            return
        for jobs in (self._writes, self._reads):
            jobs.put(None)
        for thread in self._threads:
            thread.join()
        self._threads = []
        for fd in (self._dir_fd, self._lock_fd):
            if fd is not None:
                os.close(fd)
        self._dir_fd = self._lock_fd = None

    def take_events(self) -> list[TierEvent]:
        with self._mutex:
            events, self.events = self.events, []
        return events

    def current_stats(self) -> TierStats:
        with self._mutex:
            self.stats.pages, self.stats.enabled = len(self._index), self.enabled
            self.stats.bytes = self.stats.pages * self.format.file_bytes
        return self.stats

    def _write(self, key: PageKey, payload: bytes) -> None:
        try:
            if self.enabled and self._dir_fd is not None and key.hash in self._index:
                write_page(self._dir_fd, file_name(key.hash), self.format.encode_head(key, payload), payload)
        except OSError as error:
            self._disable(error)
        finally:
            with self._mutex:
                if self._pending.get(key.hash) is payload:
                    del self._pending[key.hash]

    def _delete(self, hash: int) -> None:
        if self._dir_fd is not None:
            with suppress(OSError):
                remove_page(self._dir_fd, file_name(hash))

    def _read_into(self, load: DiskLoad) -> None:
        start, count = time.perf_counter(), 0
        try:
            for key, row in zip(load.keys, load.pages, strict=True):
                if self._read_one(key.hash, key, row) is None:
                    break
                count += 1
        finally:
            with self._mutex:
                self.stats.hits += count
                self.stats.bytes_read += count * self.format.page_bytes
                self.stats.load_seconds += time.perf_counter() - start
            load.future.set_result(count)

    def _read_one(self, hash: int, expected: PageKey | None, out: torch.Tensor) -> PageKey | None:
        """Read the page stored under `hash` into `out`; None when missing, bad or not `expected`."""
        with self._mutex:
            key = self._index.get(hash) if self.enabled else None
            payload = self._pending.get(hash)
        dir_fd = self._dir_fd
        if key is None or dir_fd is None or (expected is not None and key != expected):
            return None
        if payload is not None:
            out.numpy()[:] = np.frombuffer(payload, dtype=np.uint8)
            return key
        try:
            read_page(dir_fd, file_name(hash), self.format, key, out.numpy().data)  # its mtime: the last use
            return key
        except (BadPage, OSError) as bad:
            self._drop(hash, dir_fd, bad)
            return None

    def _drop(self, hash: int, dir_fd: int, reason: BaseException) -> None:
        """A page that fails its checks is forgotten and deleted (logged once: it is gone after)."""
        with self._mutex:
            key = self._index.pop(hash, None)
            self._record("BlockRemoved", [] if key is None else [key])
        if not isinstance(reason, FileNotFoundError):
            log.warning("kv disk tier: page %s/%s not served (%s); its prefix is recomputed", self.directory,
                        file_name(hash), reason)
        with suppress(OSError):
            remove_page(dir_fd, file_name(hash))

    def _disable(self, error: OSError) -> None:
        with self._mutex:
            if not self.enabled:
                return
            self.enabled = False
            self._record("BlockRemoved", list(self._index.values()))
            self._index.clear()
            self._pending.clear()
        if isinstance(error, UnsafeDirectory):
            # NOTE: refused, not fatal: the tier is a cache, so serving without it loses only warm restarts,
            # while failing start-up would let whoever planted the directory keep the server from starting
            log.error("kv disk tier refused: %s is %s; serving goes on WITHOUT the disk tier", error.filename,
                      error.strerror)
            return
        log.warning("kv disk tier off (%s: %s); serving goes on without it", self.root, error)

    def _record(self, name: str, keys: list[PageKey]) -> None:
        if keys:
            self.events.append(TierEvent(name, tuple(key.hash for key in keys), DISK, tuple(keys)))


def _work(jobs: queue.Queue[Callable[[], None] | None]) -> None:
    while (job := jobs.get()) is not None:
        try:
            job()
        except Exception:
            log.exception("kv disk tier: a background job failed")
        finally:
            jobs.task_done()
    jobs.task_done()
