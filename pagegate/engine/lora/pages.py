"""Adapters in pages of the KV pool (S-LoRA's unified paging): a loaded adapter holds ceil(bytes / page bytes)
pages of the same budget as the KV cache, referenced by the sequences that run with it; an unused one stays loaded
(a later request needs no read) until the pool wants its pages back, least recently used first.

NOTE: the pages are the budget, not the storage: the weights live in their own tensors (model.py) and the pool
sets aside as many pages as they take, so KV and adapters together stay within the pool's pages and the
scheduler trades one for the other. Torch-free: the scheduler calls this."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from pagegate.core import BlockPool


class AdapterStore(Protocol):
    """Where adapter weights come from and go (model.LoRAModel)."""

    page_bytes: int  # one KV page's bytes
    max_loras: int  # adapters resident at once

    def nbytes(self, name: str) -> int: ...
    def load(self, name: str) -> None: ...
    def drop(self, name: str) -> None: ...


@dataclass
class Resident:
    pages: np.ndarray  # int32 page ids the adapter holds
    users: int = 0  # sequences holding KV pages that run with it


class AdapterPages:
    def __init__(self, pool: BlockPool, store: AdapterStore) -> None:
        self.pool, self.store = pool, store
        self.resident: OrderedDict[str, Resident] = OrderedDict()  # least recently used first
        self.loads = 0  # adapters read into pages since start (evictions bring reloads)

    @property
    def num_pages(self) -> int:
        return sum(len(r.pages) for r in self.resident.values())

    def pages_for(self, name: str) -> int:
        return -(-self.store.nbytes(name) // self.store.page_bytes)

    def acquire(self, name: str, free_up: Callable[[int], bool]) -> bool:
        """One more sequence runs with adapter `name`: loaded into pages first if it is not (`free_up(n)` makes n
        pages free: pins, then idle adapters). False when it cannot be now (the sequence waits)."""
        resident = self.resident.get(name)
        if resident is None:
            if len(self.resident) >= self.store.max_loras and not self.evict_idle():
                return False  # max_loras adapters are all in use
            need = self.pages_for(name)
            if not free_up(need):
                return False
            resident = Resident(self.pool.allocate(need))
            try:
                self.store.load(name)
            except BaseException:
                self.pool.free(resident.pages)
                raise
            self.resident[name] = resident
            self.loads += 1
        resident.users += 1
        self.resident.move_to_end(name)
        return True

    def hold(self, name: str) -> None:
        """One more sequence of a resident adapter (a fork of one that runs with it)."""
        self.resident[name].users += 1

    def release(self, name: str) -> None:
        """A sequence that ran with `name` gave its KV pages back; the adapter stays loaded, evictable."""
        self.resident[name].users -= 1

    def evict_idle(self) -> bool:
        """Give back the pages of the least recently used adapter no sequence runs with; False if none is idle."""
        name = next((n for n, r in self.resident.items() if r.users == 0), None)
        if name is None:
            return False
        self.pool.free(self.resident.pop(name).pages)
        self.store.drop(name)
        return True

    def unload(self, name: str) -> None:
        """Give back an adapter's pages before it is forgotten; refused while sequences run with it."""
        resident = self.resident.get(name)
        if resident is None:
            return
        if resident.users:
            raise ValueError(f"LoRA adapter {name!r} has {resident.users} sequence(s) running with it")
        self.pool.free(self.resident.pop(name).pages)
        self.store.drop(name)
