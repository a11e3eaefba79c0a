"""One instant of the page pools and the queues, for the dashboard: taken on the engine thread between two
steps (by the core process, asked by its client), so the pages, the queues and the counts all agree.

The engine thread only copies (a C call per pool, a block table per sequence); who holds what is worked out
later, on the reader's thread, the first time it is asked. numpy and the page core are imported where used: the
gateway imports this module for its types, and a gateway nobody asks for a snapshot never needs either.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, TypeAlias

from pagegate.engine.observe.stats import EngineHealth, EngineStats

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

    from pagegate.engine.scheduler import Scheduler
    from pagegate.engine.sequence import Sequence

Pages: TypeAlias = "npt.NDArray[np.int32]"
QUEUES = ("running", "waiting", "swapped")  # a swapped sequence's pages are CPU pages


@dataclass(frozen=True, slots=True)
class QueuedRequest:
    """A request as one queue sees it: its sequences there and the pages the request holds."""

    request_id: str
    seqs: int
    pages: int


@dataclass
class PoolSnapshot:
    """Not changed once taken: the gateway reads it on its own thread while the engine goes on."""

    taken_at: float  # time.time()
    device_states: npt.NDArray[np.uint8]  # one byte per device page (pagegate.core.page_map)
    cpu_states: npt.NDArray[np.uint8]  # one byte per CPU swap page; empty without swap space
    stats: EngineStats
    health: str
    health_reason: str
    # per queue, in queue order: (request id, that sequence's block table)
    seq_pages: dict[str, list[tuple[str, Pages]]]
    _holders: dict[str, tuple[Pages, Pages]] | None = field(default=None, repr=False)

    def queue(self, name: str) -> tuple[QueuedRequest, ...]:
        """A queue's requests, each once, in the order of their first sequence there."""
        counts: dict[str, int] = {}
        for request_id, _ in self.seq_pages[name]:
            counts[request_id] = counts.get(request_id, 0) + 1
        holders = self.holders()
        return tuple(QueuedRequest(rid, n, sum(len(p) for p in holders.get(rid, ()))) for rid, n in counts.items())

    def holders(self) -> dict[str, tuple[Pages, Pages]]:
        """Request id -> the (device, CPU) pages it holds, each page once."""
        if self._holders is None:
            tables: dict[str, tuple[list[Pages], list[Pages]]] = {}
            for name in QUEUES:
                for request_id, pages in self.seq_pages[name]:
                    if len(pages):
                        tables.setdefault(request_id, ([], []))[name == "swapped"].append(pages)
            self._holders = {rid: (_union(d), _union(c)) for rid, (d, c) in tables.items()}
        return self._holders

    def pages_of(self, request_id: str) -> tuple[Pages, Pages] | None:
        return self.holders().get(request_id)

    def holders_of(self, page: int, cpu: bool = False) -> list[str]:
        """The requests holding a page, in queue order."""
        return [rid for rid, pages in self.holders().items() if bool((pages[1 if cpu else 0] == page).any())]


class SnapshotSource(Protocol):
    """What a snapshot reads (the Engine), named here so that nothing below the engine loop imports it."""

    @property
    def scheduler(self) -> Scheduler: ...

    def stats(self) -> EngineStats: ...

    def health(self) -> EngineHealth: ...


def take_snapshot(engine: SnapshotSource) -> PoolSnapshot:
    """On the engine thread: one C copy per pool, one block-table copy per sequence holding pages."""
    import numpy as np

    from pagegate.core import NO_PAGES
    from pagegate.core.page_map import fill_page_states

    scheduler, empty = engine.scheduler, np.zeros(0, dtype=np.int32)
    device = np.empty(scheduler.pool.num_blocks, dtype=np.uint8)
    fill_page_states(scheduler.pool, device)
    cpu_pool = scheduler.cpu_pool
    cpu = np.empty(cpu_pool.num_blocks if cpu_pool is not None else 0, dtype=np.uint8)
    if cpu_pool is not None:
        fill_page_states(cpu_pool, cpu)
    block_ids = scheduler.tables.block_ids

    def tables(seqs: list[Sequence]) -> list[tuple[str, Pages]]:
        return [(s.request.request_id, block_ids(s.handle) if s.handle != NO_PAGES else empty) for s in seqs]

    queues = {"running": tables(scheduler.running), "waiting": tables(scheduler.waiting),
              "swapped": tables(scheduler.swapped)}
    health = engine.health()
    return PoolSnapshot(time.time(), device, cpu, engine.stats(), health.grade, health.reason, queues)


def _union(arrays: list[Pages]) -> Pages:
    """One sequence's table lists each page once; forks of one request share some."""
    import numpy as np

    if len(arrays) <= 1:
        return arrays[0] if arrays else np.zeros(0, dtype=np.int32)
    return np.unique(np.concatenate(arrays))
