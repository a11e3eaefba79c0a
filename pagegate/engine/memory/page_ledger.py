"""The page budget of a several-model server, shared by its engine cores: a small file of counters in shared memory.

The gateway creates it with the server's KV bytes (--kv-cache-memory) and one entry per model; each core of a model
takes bytes from it into its model's entry when its pool grows and gives them back when it shrinks or sleeps; the
gateway reserves a model's first pages before its core starts or wakes and clears the entry when the core is gone.
Every change is one read-modify-write under an exclusive flock of the file, so the entries never sum past the
budget whichever processes change them at once. An entry refused bytes notes when (its want), so that the others
know the budget is contested and hold no more than their fair share of it (`fair_share`).

NOTE: a memory file (memfd; tmpfs in RAM) with flock rather than multiprocessing.shared_memory with a semaphore:
flock's lock dies with a killed holder (a core SIGKILLed mid-change never blocks the others), and no Python object
of the gateway's is needed to use it. The file has no name: a core gets its own descriptor of it over its socket
(`send_ledger`, `receive_ledger`), never a path, so nothing that cleans /dev/shm or /tmp (systemd's RemoveIPC=yes,
tmp cleaners) can take the budget away from later loads, and nothing is left behind by a killed server. While
debugging, the counters can still be read with `od /proc/<gateway pid>/fd/<n>`.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import socket
import struct
import tempfile
import time
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

_SLOT = struct.Struct("<q")  # one signed 64-bit counter: the total first, then each entry's bytes held and want
_FIELDS = 2  # an entry's counters: the bytes it holds, when it was last refused bytes (CLOCK_MONOTONIC ns, 0: never)


@dataclass(frozen=True)
class ElasticSpec:
    """A core's elastic pool (several models sharing one page budget; pagegate.engine.memory.elastic_pages): its
    pages are allocated for the whole budget (config's kv_cache_memory) and it may use `start_bytes` of them,
    already taken for it in the ledger's `entry`; it grows from the ledger and shrinks back to `floor_bytes`."""

    ledger_fd: int  # the ledger's descriptor in the process that holds the spec (the gateway's, then the core's)
    entry: int
    floor_bytes: int
    start_bytes: int
    capacity_bytes: int  # the pages it allocates on CPU (the budget); on a GPU only start_bytes are allocated


def _held(entry: int) -> int:
    return 1 + entry * _FIELDS


def _wanted(entry: int) -> int:
    return 2 + entry * _FIELDS


def _memory_file() -> int:
    """A fresh file in memory, with no name (where memfd is missing: a temporary file, unlinked at once)."""
    if hasattr(os, "memfd_create"):
        return os.memfd_create("pagegate-ledger", os.MFD_CLOEXEC)
    fd, path = tempfile.mkstemp(prefix="pagegate-ledger-")
    os.unlink(path)
    return fd


class PageLedger:
    """`total` bytes of KV pages and `entries` counters of the bytes each model holds, in the file open as `fd`
    (the ledger owns that descriptor and closes it in `close`)."""

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._map = mmap.mmap(self._fd, os.fstat(self._fd).st_size)
        self.num_entries = (len(self._map) // _SLOT.size - 1) // _FIELDS
        self._closer = weakref.finalize(self, os.close, fd)  # a ledger dropped unclosed gives its descriptor back

    @classmethod
    def create(cls, total: int, entries: int) -> PageLedger:
        """A fresh ledger with every byte free (the gateway's): a file with no name (the module's NOTE)."""
        fd = _memory_file()
        os.write(fd, _SLOT.pack(total) + bytes(_SLOT.size * _FIELDS * entries))
        return cls(fd)

    @classmethod
    def attach(cls, fd: int) -> PageLedger:
        """The ledger open as `fd` (a core's, received by `receive_ledger`), on a descriptor of its own."""
        return cls(os.dup(fd))

    def fileno(self) -> int:
        return self._fd

    @property
    def total(self) -> int:
        return self._read(0)

    def held(self, entry: int) -> int:
        return self._read(_held(entry))

    def free(self) -> int:
        with self._locked():
            return self._free()

    def take(self, entry: int, wanted: int, at_least: int = 0) -> int:
        """Up to `wanted` free bytes into `entry` (none when fewer than `at_least` are free); how many it took. An
        entry that got less than it wanted is marked wanting (`fair_share`)."""
        with self._locked():
            granted = min(wanted, self._free())
            if granted < max(at_least, 1):
                granted = 0
            if granted < wanted:
                self._write(_wanted(entry), time.monotonic_ns())
            if granted:
                self._write(_held(entry), self.held(entry) + granted)
            return granted

    def want(self, entry: int) -> None:
        """Mark `entry` wanting more than it may take now (`fair_share`)."""
        with self._locked():
            self._write(_wanted(entry), time.monotonic_ns())

    def fair_share(self, entry: int, within_s: float) -> int | None:
        """While other entries were refused bytes within the last `within_s`, the bytes `entry` may hold: an equal
        part of the budget among them and it; None when nobody else wants (it may take all that is free)."""
        since = time.monotonic_ns() - int(within_s * 1e9)
        wanting = sum(1 for other in range(self.num_entries)
                      if other != entry and self._read(_wanted(other)) > since)
        return self.total // (wanting + 1) if wanting else None

    def give(self, entry: int, amount: int) -> None:
        """`amount` bytes of `entry` back to the budget."""
        with self._locked():
            self._write(_held(entry), max(self.held(entry) - amount, 0))

    def clear(self, entry: int) -> int:
        """Everything `entry` holds back to the budget (its cores are gone); how much that was."""
        with self._locked():
            held = self.held(entry)
            self._write(_held(entry), 0)
            self._write(_wanted(entry), 0)
            return held

    def close(self) -> None:
        """This process's mapping and descriptor; the file goes once every process that holds it has closed it."""
        self._map.close()
        self._closer()

    def _free(self) -> int:
        return self.total - sum(self.held(entry) for entry in range(self.num_entries))

    def _read(self, index: int) -> int:
        return int(_SLOT.unpack_from(self._map, index * _SLOT.size)[0])

    def _write(self, index: int, value: int) -> None:
        _SLOT.pack_into(self._map, index * _SLOT.size, value)

    @contextmanager
    def _locked(self) -> Iterator[None]:
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)


def send_ledger(sock: socket.socket, ledger_fd: int) -> None:
    """Hand a core the ledger over its socket, before anything else is sent on it (SCM_RIGHTS: it gets a descriptor
    of its own, which no name on disk backs)."""
    socket.send_fds(sock, [b"L"], [ledger_fd])


def receive_ledger(sock: socket.socket) -> int:
    """The ledger's descriptor a core is handed on its socket (`send_ledger`), before any frame."""
    data, fds, _, _ = socket.recv_fds(sock, 1, 1)
    if data != b"L" or len(fds) != 1:
        raise RuntimeError("the gateway sent no page ledger before its frames")
    return fds[0]
