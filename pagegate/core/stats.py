"""What the page pool reports about itself: a typed snapshot, not a dict of string keys."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class PoolStats:
    total: int
    used: int  # physical pages with refcount > 0
    free: int  # on the free list, cached ones included
    cached_evictable: int  # free pages still holding a reusable prefix
    shared: int  # pages with refcount > 1
    prefix_cache_hits: int  # prompt tokens found by match_prefix
    prefix_cache_queries: int  # prompt tokens looked up by match_prefix

    @property
    def utilization(self) -> float:
        return self.used / self.total
