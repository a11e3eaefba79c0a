"""The dashboard's source of frames: while anyone watches, one pool snapshot per tick (10 Hz at most) asked of
the engine thread, encoded once and broadcast to every viewer; always, a history sample per second.

The engine never waits for a viewer: a snapshot is an item in the engine's inbox, run between two steps (a C
copy of each pool's page states, then the queues), and the event loop encodes it afterwards, once per tick
whatever the number of viewers. Viewers are capped (--dashboard-max-viewers), and one that does not read is
dropped once VIEWER_BUFFER_FRAMES frames wait for it, so a viewer costs a few appends per frame at most.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING

from pagegate.engine.pool_snapshot import PoolSnapshot
from pagegate.gateway.dashboard.history import HISTORY_INTERVAL_S, History
from pagegate.gateway.engine_host import DRAINING, READY, STOPPING, EngineHost
from pagegate.gateway.errors import ServiceUnavailable

if TYPE_CHECKING:  # frames.py (numpy, the page core) comes with the first frame: encoder
    from pagegate.gateway.dashboard.frames import Audience, FrameEncoder

logger = logging.getLogger("pagegate.gateway")

FRAME_INTERVAL_S = 0.1  # 10 Hz at most
SNAPSHOT_TIMEOUT_S = 5.0  # a step longer than this only delays frames; a dead engine never answers
QUERY_TIMEOUT_S = 1.0  # a hover query waits this long for a snapshot (the engine may be mid-step), then 503
FRESH_S = 1.0  # an on-demand query reuses a snapshot this young
VIEWER_BUFFER_FRAMES = 30  # frames waiting for one viewer's connection (3 s at 10 Hz); one more drops it
RETRY_S = 1.0  # after a failed snapshot (engine loading or gone), the next try


class Viewer:
    """One open feed: the broadcast frames its connection has not taken yet."""

    def __init__(self, audience: Audience, max_buffered: int, abort: Callable[[], None] | None) -> None:
        self.audience = audience
        self.following = False  # it has had a key frame, so the next delta frame applies to what it holds
        self.closed = False
        self._max_buffered = max_buffered
        self._buffer: deque[bytes] = deque()
        self._ready = asyncio.Event()
        self._abort = abort

    def offer(self, frame: bytes) -> bool:
        """Queue a frame; False, and the viewer is closed, when its buffer is full: it is not reading."""
        if len(self._buffer) >= self._max_buffered:
            # Its response is stuck in a write that waits for the client to read: only resetting the
            # connection (where the server offers it) ends that write and frees the socket.
            self.close()
            if self._abort is not None:
                self._abort()
            return False
        self._buffer.append(frame)
        self._ready.set()
        return True

    def close(self) -> None:
        self.closed = True
        self._ready.set()

    async def frames(self) -> AsyncIterator[bytes]:
        """The response body: until the viewer is closed (dropped, or the server stops)."""
        yield b": pagegate dashboard feed\n\n"  # headers out now, before the first snapshot
        while True:
            while not self._buffer and not self.closed:
                self._ready.clear()
                await self._ready.wait()
            if self.closed:
                return
            yield self._buffer.popleft()


class DashboardFeed:
    def __init__(self, host: EngineHost, frame_interval_s: float = FRAME_INTERVAL_S,
                 viewer_buffer_frames: int = VIEWER_BUFFER_FRAMES) -> None:
        self.host = host
        self.frame_interval_s = frame_interval_s
        self.query_timeout_s = QUERY_TIMEOUT_S
        self.viewer_buffer_frames = viewer_buffer_frames
        self.history = History()
        self.latest: PoolSnapshot | None = None
        self.ticks = 0  # snapshots broadcast
        self.viewers: set[Viewer] = set()
        self._pending: asyncio.Task[PoolSnapshot] | None = None  # the snapshot asked of the engine, if any
        self._producer: asyncio.Task[None] | None = None

    @functools.cached_property
    def encoder(self) -> FrameEncoder:
        from pagegate.gateway.dashboard.frames import FrameEncoder

        return FrameEncoder()

    @property
    def stopping(self) -> bool:
        return self.host.state == STOPPING

    # -- history ---------------------------------------------------------------------------------
    async def sample_history(self) -> None:
        """Forever (cancelled at shutdown): one sample of the engine's counts per second."""
        while True:
            stats = self.host.stats() if self.host.state in (READY, DRAINING) else None
            if stats is not None:
                self.history.sample(stats, time.time())
            await asyncio.sleep(HISTORY_INTERVAL_S)

    # -- viewers ---------------------------------------------------------------------------------
    def join(self, audience: Audience, abort: Callable[[], None] | None = None) -> Viewer:
        """A new viewer (its first frame a key frame), or a 503 when --dashboard-max-viewers are watching."""
        if self.stopping:
            raise ServiceUnavailable("The server is shutting down.", code="shutting_down")
        limit = self.host.config.dashboard_max_viewers
        if len(self.viewers) >= limit:
            raise ServiceUnavailable(f"The dashboard has {limit} viewers already (--dashboard-max-viewers); "
                                     "retry later.", code="too_many_viewers",
                                     headers={"Retry-After": str(self.host.config.retry_after_s)})
        viewer = Viewer(audience, self.viewer_buffer_frames, abort)
        self.viewers.add(viewer)
        if self._producer is None or self._producer.done():
            self._producer = asyncio.get_running_loop().create_task(self._produce())
        return viewer

    def leave(self, viewer: Viewer) -> None:
        viewer.close()
        self.viewers.discard(viewer)
        if not self.viewers and self._producer is not None:
            self._producer.cancel()  # no snapshot is taken for nobody
            self._producer = None

    async def _produce(self) -> None:
        while self.viewers and not self.stopping:
            started = time.monotonic()
            try:
                snapshot = await self._snapshot(SNAPSHOT_TIMEOUT_S)
            except Exception as exc:  # loading, dead or stopping: /health says which; viewers see no frame
                logger.debug("dashboard snapshot failed: %r", exc)
                await asyncio.sleep(RETRY_S)
                continue
            self._broadcast(snapshot)
            await asyncio.sleep(max(0.0, self.frame_interval_s - (time.monotonic() - started)))
        for viewer in list(self.viewers):  # the server is stopping: end the feeds so that it can drain
            viewer.close()

    def _broadcast(self, snapshot: PoolSnapshot) -> None:
        model = self.host.model.name if self.host.model is not None else ""
        wanted = {(v.audience, not v.following) for v in self.viewers}
        tenants = self.host.engine_requests.request_tenants
        frames = self.encoder.encode(snapshot, self.history, model, wanted, tenants, self.host.models_line())
        self.ticks += 1
        for viewer in list(self.viewers):
            if viewer.offer(frames[viewer.audience, not viewer.following]):
                viewer.following = True
            else:
                self.viewers.discard(viewer)
                logger.info("dashboard viewer dropped: %d frames were waiting for it", self.viewer_buffer_frames)

    # -- snapshots -------------------------------------------------------------------------------
    async def current(self) -> PoolSnapshot:
        """The latest snapshot if it is fresh, else a new one (the hover queries); a 503 with Retry-After
        when the engine is in a step too long to wait for."""
        latest = self.latest
        if latest is not None and time.time() - latest.taken_at < FRESH_S:
            return latest
        try:
            return await self._snapshot(self.query_timeout_s)
        except TimeoutError:
            raise ServiceUnavailable(f"The engine took no snapshot within {self.query_timeout_s:g} s: it is in a "
                                     "long step. Retry later.", code="engine_busy",
                                     headers={"Retry-After": str(self.host.config.retry_after_s)}) from None

    async def _snapshot(self, timeout_s: float) -> PoolSnapshot:
        """A new snapshot. Whoever asks while one is on its way shares it: one inbox item however many ask,
        and a caller that gives up does not take it from the others."""
        if self._pending is None:
            self._pending = asyncio.get_running_loop().create_task(self._ask_engine())
            self._pending.add_done_callback(_retrieve)
        return await asyncio.wait_for(asyncio.shield(self._pending), timeout_s)

    async def _ask_engine(self) -> PoolSnapshot:
        try:
            engine = self.host.engine_for_viewers()  # the drain is worth watching
            snapshot = await asyncio.wait_for(engine.pool_snapshot(), SNAPSHOT_TIMEOUT_S)
            if self.host.draining:  # the badge says what /health says
                snapshot = dataclasses.replace(snapshot, health="DRAINING", health_reason=self.host.reason)
            self.latest = snapshot
            return snapshot
        finally:
            self._pending = None


def _retrieve(task: asyncio.Task[PoolSnapshot]) -> None:
    """Mark a failed snapshot's error as seen: every caller may have stopped waiting for it."""
    if not task.cancelled():
        task.exception()
