"""The dashboard's source of snapshots: while anyone watches, one pool snapshot per tick (10 Hz at most) asked
of the engine thread and shared by every viewer; always, a history sample per second.

The engine never waits for a viewer: a snapshot is an item in the engine's inbox, run between two steps
(a C copy of each pool's page states, then the queues), and viewers encode it on the event loop afterwards.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator

from pagegate.engine.pool_snapshot import PoolSnapshot
from pagegate.gateway.dashboard.history import HISTORY_INTERVAL_S, History
from pagegate.gateway.engine_host import READY, STOPPING, EngineHost

logger = logging.getLogger("pagegate.gateway")

FRAME_INTERVAL_S = 0.1  # 10 Hz at most
SNAPSHOT_TIMEOUT_S = 5.0  # a step longer than this only delays frames; a dead engine never answers
FRESH_S = 1.0  # an on-demand query reuses a snapshot this young


class DashboardFeed:
    def __init__(self, host: EngineHost, frame_interval_s: float = FRAME_INTERVAL_S) -> None:
        self.host = host
        self.frame_interval_s = frame_interval_s
        self.history = History()
        self.latest: PoolSnapshot | None = None
        self.version = 0  # snapshots taken; a viewer waits for one newer than the last it sent
        self._fresh = asyncio.Event()
        self._viewers = 0
        self._ticker: asyncio.Task[None] | None = None

    @property
    def stopping(self) -> bool:
        return self.host.state == STOPPING

    # -- history ---------------------------------------------------------------------------------
    async def sample_history(self) -> None:
        """Forever (cancelled at shutdown): one sample of the engine's counts per second."""
        while True:
            stats = self.host.stats() if self.host.state == READY else None
            if stats is not None:
                self.history.sample(stats, time.time())
            await asyncio.sleep(HISTORY_INTERVAL_S)

    # -- snapshots -------------------------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def watching(self) -> AsyncIterator[None]:
        """Snapshots are taken while at least one viewer is inside this context."""
        self._viewers += 1
        if self._ticker is None or self._ticker.done():
            self._ticker = asyncio.get_running_loop().create_task(self._tick())
        try:
            yield
        finally:
            self._viewers -= 1
            if self._viewers == 0 and self._ticker is not None:
                self._ticker.cancel()  # no snapshot is taken for nobody

    async def next_snapshot(self, seen: int, timeout_s: float) -> PoolSnapshot | None:
        """A snapshot newer than version `seen`, or None if none came within the timeout."""
        if self.version <= seen:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._fresh.wait(), timeout_s)
        return self.latest if self.version > seen else None

    async def current(self) -> PoolSnapshot:
        """The latest snapshot if it is fresh, else a new one (the hover queries)."""
        latest = self.latest
        if latest is not None and time.time() - latest.taken_at < FRESH_S:
            return latest
        return await self._take()

    async def _tick(self) -> None:
        while self._viewers > 0 and not self.stopping:
            started = time.monotonic()
            try:
                await self._take()
            except Exception as exc:  # loading, dead or stopping: /health says which; viewers see no frame
                logger.debug("dashboard snapshot failed: %r", exc)
                await asyncio.sleep(1.0)
                continue
            await asyncio.sleep(max(0.0, self.frame_interval_s - (time.monotonic() - started)))

    async def _take(self) -> PoolSnapshot:
        engine, _ = self.host.require_engine()
        snapshot = await asyncio.wait_for(engine.pool_snapshot(), SNAPSHOT_TIMEOUT_S)
        self.latest = snapshot
        self.version += 1
        fresh, self._fresh = self._fresh, asyncio.Event()
        fresh.set()
        return snapshot
