"""What the routes read of the server: the state the app's lifespan yields (Starlette's lifespan state, copied into
every request's scope), typed."""

from __future__ import annotations

from typing import TYPE_CHECKING, TypedDict, cast

from prometheus_client import CollectorRegistry
from starlette.requests import HTTPConnection

from pagegate.gateway.engine_host import EngineHost
from pagegate.gateway.responses.store import ResponseStore

if TYPE_CHECKING:  # imported where used (app.py): a server without them never loads their modules
    from pagegate.gateway.batches.service import Batches
    from pagegate.gateway.dashboard.feed import DashboardFeed


class GatewayState(TypedDict):
    host: EngineHost
    responses: ResponseStore  # stored /v1/responses
    dashboard: DashboardFeed | None  # None: --disable-dashboard
    gateway_registry: CollectorRegistry  # the gateway's own /metrics
    batches: Batches | None  # the Files and Batch APIs; None: no --batch-dir


def gateway_state(request: HTTPConnection) -> GatewayState:
    """The lifespan's state as `request` sees it (what Starlette's `Request[GatewayState]` would type it as)."""
    return cast("GatewayState", request.state)


def host_of(request: HTTPConnection) -> EngineHost:
    return gateway_state(request)["host"]
