"""Prefix pins: a request's cached pages held for a while under a key, so a later request finds them in the prefix
cache: the next turn of a stored conversation (the Responses API's `previous_response_id`), a prompt-cache
breakpoint (Anthropic's `cache_control`) or an OpenAI `prompt_cache_key`.

A pin is one more reference on each full page it holds, so eviction skips them. Pins never cost a running request
anything: they live within a budget (a fraction of the pool), expire after their TTL, and the scheduler releases
the least recently used before it would preempt or fail a request for want of pages. A hit on a pin's whole prefix
by a request of the same API key refreshes it (a new TTL, and it becomes the most recently used)."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from pagegate.core.block_pool import BlockPool


@dataclass
class _Held:
    block_ids: npt.NDArray[np.int32]
    expires_at: float
    ttl_s: float
    owner: str | None  # the API key it was taken for (None: a request without one)


class PrefixPins:
    """The held pins, least recently used first; each holds one reference on each of its pages. Pins of one
    conversation's turns share their prefix pages: the budget counts pages, not references."""

    def __init__(self, pool: BlockPool, max_blocks: int) -> None:
        self.pool = pool
        self.max_blocks = max_blocks
        self._held: OrderedDict[str, _Held] = OrderedDict()
        self._pins_on = np.zeros(pool.num_blocks, dtype=np.int32)  # per page: how many pins hold it
        self._ends_on = np.zeros(pool.num_blocks, dtype=np.int32)  # per page: how many pins end on it
        self._ending: dict[int, set[str]] = {}  # a page -> the keys of the pins that end on it
        self._by_owner: dict[str, int] | None = {}  # pages each API key's pins hold (None: to be counted again)
        self.num_blocks = 0  # pages held by at least one pin

    def __len__(self) -> int:
        return len(self._held)

    def hold(self, key: str, block_ids: npt.NDArray[np.int32], now: float, ttl_s: float,
             owner: str | None = None) -> bool:
        """Pin `block_ids` under `key` until `now + ttl_s` (replacing what the key held); the least recently used
        pins make room within the budget. False when the pages alone exceed the budget (nothing is pinned then)."""
        self.release(key)
        if len(block_ids) == 0 or len(block_ids) > self.max_blocks:
            return False
        while self.num_blocks + self._new_pages(block_ids) > self.max_blocks:
            self.release_oldest()
        self.num_blocks += self._new_pages(block_ids)
        self._pins_on[block_ids] += 1  # a sequence's pages are distinct: no repeated index
        self.pool.incref(block_ids)
        last = int(block_ids[-1])
        self._ends_on[last] += 1
        self._ending.setdefault(last, set()).add(key)
        self._held[key] = _Held(block_ids, now + ttl_s, ttl_s, owner)
        self._by_owner = None
        return True

    def _new_pages(self, block_ids: npt.NDArray[np.int32]) -> int:
        return int(np.count_nonzero(self._pins_on[block_ids] == 0))

    def release(self, key: str) -> bool:
        held = self._held.pop(key, None)
        if held is None:
            return False
        self._pins_on[held.block_ids] -= 1
        self.num_blocks -= int(np.count_nonzero(self._pins_on[held.block_ids] == 0))
        last = int(held.block_ids[-1])
        self._ends_on[last] -= 1
        ending = self._ending[last]
        ending.discard(key)
        if not ending:
            del self._ending[last]
        self.pool.free(held.block_ids)
        self._by_owner = None
        return True

    def release_oldest(self) -> bool:
        """Release the pin used longest ago; False when none is held."""
        if not self._held:
            return False
        return self.release(next(iter(self._held)))

    def expire(self, now: float) -> int:
        """Release every pin past its time; how many went."""
        gone = [key for key, held in self._held.items() if held.expires_at <= now]
        for key in gone:
            self.release(key)
        return len(gone)

    def refresh(self, block_ids: npt.NDArray[np.int32], owner: str | None, now: float) -> int:
        """A request of API key `owner` hit `block_ids` (its prompt's leading pages): each pin of that key that ends
        on one of them (so the hit covers all of its pages, one chain) lives its TTL again from `now` and becomes
        the most recently used. How many were refreshed.

        NOTE: only the same key's pins: a hit on shared pages never keeps another key's pin alive."""
        if not self._held or len(block_ids) == 0:
            return 0
        ends = block_ids[self._ends_on[block_ids] > 0]
        fresh = [key for page in ends for key in self._ending[int(page)] if self._held[key].owner == owner]
        order = {key: i for i, key in enumerate(self._held)} if len(fresh) > 1 else {}
        for key in sorted(fresh, key=order.__getitem__) if order else fresh:  # they stay in the order they were used
            held = self._held[key]
            held.expires_at = now + held.ttl_s
            self._held.move_to_end(key)
        return len(fresh)

    def pages_by_owner(self) -> dict[str, int]:
        """The pages each API key's pins hold (a page once per key however many of its pins hold it); pins taken
        without a key are not counted."""
        if self._by_owner is None:
            pages: dict[str, list[npt.NDArray[np.int32]]] = {}
            for held in self._held.values():
                if held.owner is not None:
                    pages.setdefault(held.owner, []).append(held.block_ids)
            self._by_owner = {owner: len(np.unique(np.concatenate(ids))) for owner, ids in pages.items()}
        return dict(self._by_owner)

    def keys(self) -> list[str]:
        return list(self._held)
