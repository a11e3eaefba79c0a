"""Restarts that lose nothing (--shutdown-timeout): on SIGTERM or Ctrl-C the gateway drains before it stops.

Draining: /health (and gRPC health) turn 503 / NOT_SERVING at once so load balancers stop sending; new requests get
503 + Retry-After (gRPC: UNAVAILABLE); running generations go on for up to the timeout; what is left then ends with
an error chunk (its pages freed in the core), and only then does uvicorn's own shutdown begin.

NOTE: the drain runs before uvicorn's shutdown because that one closes the listening sockets first: during the
drain new clients must get a 503 they can act on, not a refused connection.

NOTE: what is in flight is counted where every request passes (InFlightMiddleware for REST, the gRPC door's
decoding wrapper), from its first byte to its last, not where each route starts its engine work: counted there,
a route that started work another way (embeddings) was forgotten, so the drain ended at once, uvicorn closed the
sockets and then cut the request off.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from starlette.types import ASGIApp, Receive, Scope, Send

from pagegate.gateway.engine_host import READY, EngineHost

logger = logging.getLogger("pagegate.gateway")


class GracefulShutdown:
    """What a stop signal does. The first: drain for up to `timeout_s` (0: end everything at once), then
    `stop_server()`. A second one during the drain: end the rest now and stop."""

    def __init__(self, host: EngineHost, timeout_s: float, stop_server: Callable[[], None]) -> None:
        self.host = host
        self.timeout_s = timeout_s
        self.stop_server = stop_server
        self.task: asyncio.Task[None] | None = None

    def on_signal(self) -> None:
        """Runs on the event loop (the signal handler schedules it there)."""
        if self.task is not None or self.timeout_s <= 0 or self.host.state != READY:
            self.cancel()
            self._stop_now("The server is shutting down.")
            return
        self.host.begin_drain()
        self.task = asyncio.get_running_loop().create_task(self._drain())

    async def _drain(self) -> None:
        running = self.host.num_in_flight
        logger.info("draining: %d request(s) in flight, up to %g s to finish (--shutdown-timeout); new requests "
                    "get 503", running, self.timeout_s)
        if await self.host.wait_idle(self.timeout_s):
            logger.info("drained: every in-flight request finished")
        else:
            logger.warning("drain timed out after %g s: ending %d request(s)", self.timeout_s,
                           self.host.num_in_flight)
        self._stop_now(f"The server is shutting down: the generation did not finish within --shutdown-timeout "
                       f"{self.timeout_s:g} s.")

    def _stop_now(self, message: str) -> None:
        self.host.end_all(message)
        self.stop_server()

    def cancel(self) -> None:
        """The server stops for another reason (the engine died): no drain outlives the loop."""
        if self.task is not None and not self.task.done():
            self.task.cancel()


# Routes whose requests a drain does not wait for: probes (they watch the drain) and the dashboard, whose feeds
# run until their viewer leaves.
NOT_COUNTED = ("/health", "/metrics", "/dashboard")


class InFlightMiddleware:
    """Counts every HTTP request being served (EngineHost.serving), whatever its route, body format or stream."""

    def __init__(self, app: ASGIApp, host: EngineHost) -> None:
        self.app = app
        self.host = host

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or _not_counted(scope["path"]):
            await self.app(scope, receive, send)
            return
        with self.host.serving():
            await self.app(scope, receive, send)


def _not_counted(path: str) -> bool:
    return any(path == prefix or path.startswith(prefix + "/") for prefix in NOT_COUNTED)
