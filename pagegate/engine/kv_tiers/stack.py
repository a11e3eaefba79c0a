"""The tiers below the pool as one object: the engine spills evicted pages into it and finds chains in it."""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from pagegate.engine.kv_tiers.disk import DiskLoad, DiskTier
from pagegate.engine.kv_tiers.host import HostTier
from pagegate.engine.kv_tiers.records import PageKey, StackStats, TierEvent, TokenIds
from pagegate.engine.kv_tiers.reuse import ReuseGate


class TierStack:
    """Host memory, then disk, each LRU; admission gated on reuse. Called from the engine thread only.

    NOTE: by default a page reaches disk when host memory pushes it out (write-back): the disk is paid
    only under pressure. `write_through` also writes every admitted page to disk at once, so a crash
    keeps what host memory held; `persist()` does the same once, at a clean shutdown.
    """

    def __init__(self, host: HostTier | None, disk: DiskTier | None, gate: ReuseGate,
                 write_through: bool = False) -> None:
        self.host, self.disk, self.gate, self.write_through = host, disk, gate, write_through

    def see(self, hashes: Sequence[int]) -> None:
        """Count a request's page hashes toward reuse (every full prompt page, whether it hit or not)."""
        self.gate.see_all(hashes)

    def spill(self, keys: Sequence[PageKey], data: torch.Tensor) -> None:
        """Pages leaving the pool ([n, page_bytes]): those the gate admits go to host, what host pushes out
        goes to disk (straight to disk without a host tier)."""
        admitted = [i for i, key in enumerate(keys) if self.gate.admits(key.hash)]
        if not admitted:
            return
        if len(admitted) < len(keys):
            keys, data = [keys[i] for i in admitted], data[torch.tensor(admitted, device=data.device)]
        to_disk: list[tuple[PageKey, torch.Tensor]] = []
        if self.host is None or self.write_through:
            to_disk.extend(zip(keys, data, strict=True))
        if self.host is not None:
            to_disk.extend(self.host.put(keys, data))
        if self.disk is not None:
            for key, row in to_disk:
                self.disk.put(key, row)

    def find_chain(self, hashes: Sequence[int], parents: Sequence[int],
                   tokens_rows: Sequence[TokenIds]) -> tuple[list[int], list[PageKey]]:
        """The longest run of pages from the first: host slots first, then the keys of pages to load from disk.

        Host slots stay valid only until the next `spill`: read them (`read_host`) in the same step."""
        host_slots: list[int] = []
        disk_keys: list[PageKey] = []
        for hash, parent, tokens in zip(hashes, parents, tokens_rows, strict=True):
            slot = None if self.host is None else self.host.find(hash, parent, tokens)
            if slot is not None and not disk_keys:
                host_slots.append(slot)
                continue
            key = None if self.disk is None else self.disk.find(hash, parent, tokens) or self._copy_down(slot)
            if key is None:
                break
            disk_keys.append(key)
        if self.host is not None:
            self.host.stats.hits += len(host_slots)
        return host_slots, disk_keys

    def _copy_down(self, slot: int | None) -> PageKey | None:
        """A host page past the chain's first disk page joins the disk load: it is queued for writing and
        served from the write queue's copy. NOTE: the chain stays whole whichever way host memory and disk
        split it (a batch spilled head-first leaves its head on disk and its tail in host memory)."""
        if slot is None or self.host is None or self.disk is None:
            return None
        key = self.host.key_at(slot)
        if key is None:
            return None
        self.disk.put(key, self.host.pages[slot])
        return key if self.disk.holds(key) else None

    def read_host(self, slots: Sequence[int]) -> torch.Tensor:
        """A copy of host pages, [n, page_bytes], for the engine to copy into pool pages."""
        assert self.host is not None, "read_host without a host tier"
        start = time.perf_counter()
        pages = self.host.read(slots)
        self.host.stats.bytes_read += pages.numel()
        self.host.stats.load_seconds += time.perf_counter() - start
        return pages

    def load_from_disk(self, keys: Sequence[PageKey]) -> DiskLoad:
        """Start reading disk pages into host memory on the disk's read thread; poll `done()` on the load.

        NOTE: the loaded pages are handed to the engine (`finish_load`), not stored in the host tier: they
        go into the pool, and only a copy there could later be evicted; promoting them as well would spend
        host capacity on duplicates and could push out the host slots `find_chain` just returned."""
        assert self.disk is not None, "load_from_disk without a disk tier"
        return self.disk.load(keys)

    @staticmethod
    def finish_load(load: DiskLoad) -> torch.Tensor:
        """[n, page_bytes]: the leading pages of a finished load that were read and checked (n may fall
        short of what was asked when a page was bad or gone: the rest of the prefix is recomputed)."""
        return load.result(timeout=0)

    def persist(self) -> None:
        """Write every host page to disk (a clean shutdown, so a restart finds them); waits for the writes."""
        if self.host is None or self.disk is None:
            return
        for key, slot in self.host.items():
            self.disk.put(key, self.host.pages[slot])
        self.disk.flush()

    def stats(self) -> StackStats:
        return StackStats(None if self.host is None else self.host.current_stats(),
                          None if self.disk is None else self.disk.current_stats())

    def take_events(self) -> list[TierEvent]:
        """KV events since the last call, host ("CPU") before disk ("DISK")."""
        events: list[TierEvent] = []
        if self.host is not None:
            events, self.host.events = self.host.events, []
        if self.disk is not None:
            events.extend(self.disk.take_events())
        return events

    def close(self) -> None:
        """Finish the disk's queued writes and release its directory."""
        if self.disk is not None:
            self.disk.flush()
            self.disk.close()
