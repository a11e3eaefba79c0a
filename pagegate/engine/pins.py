"""Prefix pins: a finished request's cached pages held for a while under a key, so the next turn of a stored
conversation (the Responses API's `previous_response_id`) finds them in the prefix cache.

A pin is one more reference on each full page the request left in the cache, so eviction skips them. Pins never
cost a running request anything: they live within a budget (a fraction of the pool), expire after their TTL, and
the scheduler releases the oldest before it would preempt or fail a request for want of pages."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from pagegate.core.block_pool import BlockPool


@dataclass(frozen=True)
class Pin:
    """What a request asks for: keep my prompt and answer's pages under `key` for `ttl_s` seconds."""

    key: str
    ttl_s: float


@dataclass
class _Held:
    block_ids: npt.NDArray[np.int32]
    expires_at: float


class PrefixPins:
    """The held pins, oldest first; each holds one reference on each of its pages. Pins of one conversation's
    turns share their prefix pages: the budget counts pages, not references."""

    def __init__(self, pool: BlockPool, max_blocks: int) -> None:
        self.pool = pool
        self.max_blocks = max_blocks
        self._held: OrderedDict[str, _Held] = OrderedDict()
        self._pins_on = np.zeros(pool.num_blocks, dtype=np.int32)  # per page: how many pins hold it
        self.num_blocks = 0  # pages held by at least one pin

    def __len__(self) -> int:
        return len(self._held)

    def hold(self, key: str, block_ids: npt.NDArray[np.int32], expires_at: float) -> bool:
        """Pin `block_ids` under `key` (replacing what the key held); older pins make room within the budget.
        False when the pages alone exceed the budget (nothing is pinned then)."""
        self.release(key)
        if len(block_ids) == 0 or len(block_ids) > self.max_blocks:
            return False
        while self.num_blocks + self._new_pages(block_ids) > self.max_blocks:
            self.release_oldest()
        self.num_blocks += self._new_pages(block_ids)
        self._pins_on[block_ids] += 1  # a sequence's pages are distinct: no repeated index
        self.pool.incref(block_ids)
        self._held[key] = _Held(block_ids, expires_at)
        return True

    def _new_pages(self, block_ids: npt.NDArray[np.int32]) -> int:
        return int(np.count_nonzero(self._pins_on[block_ids] == 0))

    def release(self, key: str) -> bool:
        held = self._held.pop(key, None)
        if held is None:
            return False
        self._pins_on[held.block_ids] -= 1
        self.num_blocks -= int(np.count_nonzero(self._pins_on[held.block_ids] == 0))
        self.pool.free(held.block_ids)
        return True

    def release_oldest(self) -> bool:
        """Release the pin taken longest ago; False when none is held."""
        if not self._held:
            return False
        return self.release(next(iter(self._held)))

    def expire(self, now: float) -> int:
        """Release every pin past its time; how many went."""
        gone = [key for key, held in self._held.items() if held.expires_at <= now]
        for key in gone:
            self.release(key)
        return len(gone)

    def keys(self) -> list[str]:
        return list(self._held)
