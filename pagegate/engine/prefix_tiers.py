"""The scheduler's side of the KV tiers: a prompt's pages found below the pool come back into pool pages.

The pool's prefix cache answers first; where its chain ends, the tiers (host memory, then disk) may hold the next
pages. Host pages are copied out at once and written into fresh pool pages before the step's forward; disk pages
are read on the disk tier's thread while the request waits, and other requests go on being scheduled.
"""

from __future__ import annotations

from concurrent.futures import FIRST_COMPLETED, wait
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from pagegate.core import BlockPool
from pagegate.engine.kv_tiers import PageKey
from pagegate.engine.sequence import Sequence

if TYPE_CHECKING:
    import torch

    from pagegate.core.block_pool import EvictedPages
    from pagegate.engine.kv_cache import PagedKVCache
    from pagegate.engine.kv_tiers import DiskLoad, TierStack


@dataclass
class TierLoad:
    """Pool pages to fill before the step's forward, and their bytes ([n, page_bytes])."""

    pages: npt.NDArray[np.int32]
    data: torch.Tensor


@dataclass
class Found:
    """The pages below the pool that continue a prompt's chain, in order, with their bytes."""

    keys: list[PageKey]
    data: torch.Tensor


WAIT = None  # the prompt's next pages are being read from disk: admit it later


class PrefixTiers:
    """Finds prompt pages in the tiers and stages them into the pool; counts each prompt's pages toward reuse."""

    def __init__(self, tiers: TierStack, pool: BlockPool) -> None:
        self.tiers, self.pool = tiers, pool
        self.block_size = pool.block_size
        self._loads: dict[int, DiskLoad] = {}  # id(seq) -> its disk read in flight
        self._seen: set[int] = set()  # id(seq) of sequences whose pages were counted toward reuse
        pool.record_evictions()

    def find(self, seq: Sequence, tokens: list[int], root_hash: int, num_pool_pages: int) -> Found | None:
        """The pages after the pool's `num_pool_pages` hits found in the tiers (maybe none), or WAIT while a
        disk read for them runs."""
        import torch  # the tiers serve the torch runner only (native_runner.py)

        hashes = self.pool.prefix_hashes(tokens, root_hash)
        if id(seq) not in self._seen:
            self._seen.add(id(seq))
            self.tiers.see(hashes.tolist())
        start = num_pool_pages
        if start >= len(hashes):
            return Found([], torch.empty(0, 0, dtype=torch.uint8))
        rows = np.asarray(tokens[:len(hashes) * self.block_size], dtype=np.int32).reshape(-1, self.block_size)
        parents = [int(hashes[i - 1]) if i else root_hash for i in range(start, len(hashes))]
        slots, on_disk = self.tiers.find_chain(hashes[start:].tolist(), parents, list(rows[start:]))
        keys = [PageKey.of(int(hashes[start + i]), parents[i], rows[start + i], start + i == 0)
                for i in range(len(slots))]
        data = self.tiers.read_host(slots) if slots else None
        if on_disk:
            loaded = self._disk_pages(seq, on_disk)
            if loaded is WAIT:
                return WAIT
            keys += on_disk[:len(loaded)]
            data = loaded if data is None else torch.cat([data, loaded])
        return Found(keys, data if data is not None else torch.empty(0, 0, dtype=torch.uint8))

    def _disk_pages(self, seq: Sequence, keys: list[PageKey]) -> torch.Tensor | None:
        """The bytes of `keys` (their leading run that was read and checked) once this sequence's read is done."""
        load = self._loads.get(id(seq))
        if load is None:
            self._loads[id(seq)] = self.tiers.load_from_disk(keys)
            return WAIT
        if not load.done():
            return WAIT
        del self._loads[id(seq)]
        pages = self.tiers.finish_load(load)
        same = 0  # the chain may have changed while the read ran: only its common start is used
        while same < min(len(pages), len(keys)) and load.keys[same] == keys[same]:
            same += 1
        return pages[:same]

    def stage(self, found: Found) -> tuple[npt.NDArray[np.int32], TierLoad | None]:
        """Fresh pool pages for `found`, cached under their keys (so the sequence starts with them as hits), and
        the load that fills them. The caller made room for them. A page the pool will not cache (its hash
        collides with another page's) ends the run: the rest is computed."""
        pages = self.pool.allocate(len(found.keys))
        kept = 0
        for page, key in zip(pages, found.keys, strict=True):
            self.pool.cache_block(int(page), key.parent, key.token_ids, key.first)
            if self.pool.block_hash(int(page)) != key.hash:
                break
            kept += 1
        if kept < len(pages):
            self.pool.free(pages[kept:])
        if kept == 0:
            return pages[:0], None
        return pages[:kept], TierLoad(pages[:kept], found.data[:kept])

    def wait_for_disk(self, timeout_s: float) -> None:
        """Block up to `timeout_s` for a disk read in flight. NOTE: for a step with nothing to run: the engine
        would otherwise spin through empty steps holding the GIL while the read thread needs it."""
        if self._loads:
            wait([load.future for load in self._loads.values()], timeout_s, FIRST_COMPLETED)

    def forget(self, seq: Sequence) -> None:
        """The sequence was admitted or left: drop its bookkeeping (a read in flight just finishes unused)."""
        self._loads.pop(id(seq), None)
        self._seen.discard(id(seq))


def move_tier_pages(kv_cache: PagedKVCache, tiers: TierStack, evicted: EvictedPages | None,
                    loads: list[TierLoad]) -> None:
    """A step's page moves to and from the tiers, before anything writes its new pages: the cached pages
    allocation evicted go down (those the reuse gate admits), then the pages found in the tiers come back."""
    if evicted is not None:
        spill(kv_cache, tiers, evicted)
    for load in loads:
        kv_cache.write_pages(load.pages, load.data)


def write_down(kv_cache: PagedKVCache, tiers: TierStack, pool: BlockPool) -> None:
    """At a clean shutdown: every cached page the gate admits goes down the tiers, host memory goes to disk."""
    spill(kv_cache, tiers, pool.cached_blocks())
    tiers.persist()


def keep_asleep(kv_cache: PagedKVCache, tiers: TierStack, pool: BlockPool) -> None:
    """Before a sleep frees the pool: every cached page goes down the tiers, however often it was seen."""
    pages = pool.cached_blocks()
    tiers.gate.vouch(pages[1].tolist())
    spill(kv_cache, tiers, pages)


def spill(kv_cache: PagedKVCache, tiers: TierStack, pages: EvictedPages) -> None:
    ids, hashes, parents, firsts, tokens = pages
    admitted = [i for i, h in enumerate(hashes.tolist()) if tiers.gate.admits(h)]
    if admitted:
        keys = [PageKey.of(int(hashes[i]), int(parents[i]), tokens[i], bool(firsts[i])) for i in admitted]
        tiers.spill(keys, kv_cache.read_pages(ids[admitted]))
