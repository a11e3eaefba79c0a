"""The host-memory tier: a second, larger page store outside the pool, LRU by page hash."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import torch

from pagegate.engine.kv_tiers.records import CPU, PageKey, TierEvent, TierStats, TokenIds


class HostTier:
    """`num_pages` page slots in one preallocated uint8 tensor; an O(1) LRU maps page hash -> slot.

    NOTE: the tensor is not pinned: on CPU servers pinning buys nothing, and on CUDA a large pinned
    allocation at start-up is slow and takes memory from the OS; the engine copies pages in batches.
    """

    def __init__(self, num_pages: int, page_bytes: int) -> None:
        if num_pages < 1 or page_bytes < 1:
            raise ValueError(f"num_pages and page_bytes must be >= 1, got {num_pages} and {page_bytes}")
        self.page_bytes = page_bytes
        self.pages = torch.empty((num_pages, page_bytes), dtype=torch.uint8)
        self._slots: OrderedDict[int, int] = OrderedDict()  # hash -> slot, least recently used first
        self._keys: list[PageKey | None] = [None] * num_pages
        self._free = list(range(num_pages - 1, -1, -1))  # pop() hands out slot 0 first
        self.stats = TierStats(capacity_bytes=num_pages * page_bytes)
        self.events: list[TierEvent] = []

    @property
    def num_pages(self) -> int:
        return len(self._keys)

    @property
    def num_used(self) -> int:
        return len(self._slots)

    def __contains__(self, hash: int) -> bool:
        return hash in self._slots

    def put(self, keys: Sequence[PageKey], data: torch.Tensor) -> list[tuple[PageKey, torch.Tensor]]:
        """Store pages (`data` [n, page_bytes]); a hash already here is refreshed, not duplicated.

        Returns the pages pushed out to make room, least recently used first, each with a copy of its
        bytes taken before its slot was overwritten (a page of this very batch can be among them when
        the batch is larger than the tier)."""
        data = data.to("cpu")
        evicted: list[tuple[PageKey, int, int | None]] = []  # (key, its slot, its row of `data` or None)
        written: dict[int, int] = {}  # slot -> row of `data` that goes there
        for row, key in enumerate(keys):
            slot = self._slots.get(key.hash)
            if slot is not None and self._keys[slot] == key:
                self._slots.move_to_end(key.hash)
                continue
            if slot is not None:  # a colliding hash: the newer page replaces the older one
                self._drop(key.hash)
                written.pop(slot, None)
            if not self._free:
                old_key, old_slot = self._evict_lru()
                evicted.append((old_key, old_slot, written.pop(old_slot, None)))
            slot = self._free.pop()
            self._slots[key.hash], self._keys[slot] = slot, key
            written[slot] = row
        pushed_out = self._copy_out(evicted, data)
        if written:
            self.pages.index_copy_(0, torch.tensor(list(written)), data[torch.tensor(list(written.values()))])
        self._record("BlockStored", [keys[row] for row in written.values()])
        self.stats.stores += len(written)
        return pushed_out

    def _evict_lru(self) -> tuple[PageKey, int]:
        hash, slot = self._slots.popitem(last=False)
        key = self._keys[slot]
        assert key is not None
        self._keys[slot] = None
        self._free.append(slot)
        self.stats.evictions += 1
        return key, slot

    def _copy_out(self, evicted: list[tuple[PageKey, int, int | None]],
                  data: torch.Tensor) -> list[tuple[PageKey, torch.Tensor]]:
        """The bytes of evicted pages, copied before their slots are overwritten; a page of this batch that
        a later one pushed out (the batch outgrew the tier) takes its bytes from `data`."""
        if not evicted:
            return []
        rows = torch.empty((len(evicted), self.page_bytes), dtype=torch.uint8)
        from_tier = [(i, slot) for i, (_, slot, row) in enumerate(evicted) if row is None]
        if from_tier:
            rows[torch.tensor([i for i, _ in from_tier])] = self.pages[torch.tensor([s for _, s in from_tier])]
        for i, (_, _, row) in enumerate(evicted):
            if row is not None:
                rows[i] = data[row]
        self._record("BlockRemoved", [key for key, _, row in evicted if row is None])
        return [(key, rows[i]) for i, (key, _, _) in enumerate(evicted)]

    def find(self, hash: int, parent: int, tokens: TokenIds) -> int | None:
        """The slot holding this page (and marks it recently used), or None; a colliding hash is a miss."""
        slot = self._slots.get(hash)
        if slot is None:
            return None
        key = self._keys[slot]
        if key is None or not key.matches(parent, tokens):
            return None
        self._slots.move_to_end(hash)
        return slot

    def read(self, slots: Sequence[int]) -> torch.Tensor:
        """A copy of the pages in `slots`, [n, page_bytes]."""
        return self.pages[torch.tensor(list(slots), dtype=torch.long)]

    def key_at(self, slot: int) -> PageKey | None:
        return self._keys[slot]

    def items(self) -> list[tuple[PageKey, int]]:
        """(key, slot) of every stored page, least recently used first."""
        return [(key, slot) for slot in self._slots.values() if (key := self._keys[slot]) is not None]

    def discard(self, hash: int) -> bool:
        """Forget a page; True when it was here."""
        if hash not in self._slots:
            return False
        key = self._drop(hash)
        self._record("BlockRemoved", [key])
        return True

    def _drop(self, hash: int) -> PageKey:
        slot = self._slots.pop(hash)
        key = self._keys[slot]
        assert key is not None
        self._keys[slot] = None
        self._free.append(slot)
        return key

    def _record(self, name: str, keys: list[PageKey]) -> None:
        if keys:
            self.events.append(TierEvent(name, tuple(key.hash for key in keys), CPU, tuple(keys)))

    def current_stats(self) -> TierStats:
        self.stats.pages, self.stats.bytes = self.num_used, self.num_used * self.page_bytes
        return self.stats
