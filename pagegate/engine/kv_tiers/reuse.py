"""Admission to the tiers gated on reuse: a page goes down a tier only once its hash was seen often enough."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable


class ReuseGate:
    """Counts sightings of page hashes in a bounded LRU; admits a hash seen at least `min_seen` times.

    NOTE: as vLLM's BlockReuseTracker gates CPU-offload stores (store_threshold, default 2), a page is copied
    down a tier only when its prefix recurs: LMCache measured 3-15% lost throughput when every page was stored and nothing was reused. A workload with
    no reuse then pays one dictionary update per page and no copies. `min_seen` 1 admits everything (and counts
    nothing); the bounded LRU forgets hashes not seen lately, so memory stays O(capacity).
    """

    def __init__(self, min_seen: int, capacity: int) -> None:
        if min_seen < 1 or capacity < 1:
            raise ValueError(f"min_seen and capacity must be >= 1, got {min_seen} and {capacity}")
        self.min_seen, self.capacity = min_seen, capacity
        self._seen: OrderedDict[int, int] = OrderedDict()  # hash -> sightings, least recently seen first

    def see(self, hash: int) -> None:
        """Count one sighting of `hash` (O(1))."""
        if self.min_seen == 1:
            return
        self._seen[hash] = self._seen.pop(hash, 0) + 1
        if len(self._seen) > self.capacity:
            self._seen.popitem(last=False)

    def see_all(self, hashes: Iterable[int]) -> None:
        for hash in hashes:
            self.see(hash)

    def vouch(self, hashes: Iterable[int]) -> None:
        """Admit these hashes however often they were seen (a stored conversation's pages: reused by design)."""
        if self.min_seen == 1:
            return
        for hash in hashes:
            self._seen[hash] = max(self._seen.pop(hash, 0), self.min_seen)
            if len(self._seen) > self.capacity:
                self._seen.popitem(last=False)

    def admits(self, hash: int) -> bool:
        return self.min_seen == 1 or self._seen.get(hash, 0) >= self.min_seen

    def count(self, hash: int) -> int:
        return self._seen.get(hash, 0)

    def __len__(self) -> int:
        return len(self._seen)
