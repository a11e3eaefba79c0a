"""GET /dashboard (the page), /dashboard/static/* (its files), and the data under /dashboard/api/, which needs
the API key when the server has one (auth.py): the SSE feed, the two hover queries and the recent requests. With several keys a
viewer sees only its own key's request ids; other requests are listed and counted, not named."""

from __future__ import annotations

from collections.abc import Callable

from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from pagegate.core.page_map import CACHED, MAX_REFCOUNT
from pagegate.gateway.auth import request_key_identity
from pagegate.gateway.dashboard.feed import DashboardFeed, Viewer
from pagegate.gateway.dashboard.frames import EVERY_ID, Audience, shown_id
from pagegate.gateway.dashboard.table import STATIC
from pagegate.gateway.errors import BadRequest, NotFound
from pagegate.gateway.gateway_state import gateway_state, host_of
from pagegate.gateway.http_protocol import CONNECTION_EXTENSION

NOBODY = ""  # the audience of a viewer without a key identity (none gets past auth): no request is its own


async def page(request: Request) -> Response:
    """The page itself holds no data, so it needs no key; it asks for one when the server has keys."""
    html = (STATIC / "index.html").read_text()
    needs_key = "true" if host_of(request).config.every_api_key else "false"
    return HTMLResponse(html.replace("{{auth_required}}", needs_key), headers={"Cache-Control": "no-store"})


async def feed(request: Request) -> Response:
    dashboard = _dashboard(request)
    viewer = dashboard.join(audience(request), abort=_connection_abort(request.scope))
    return FeedResponse(dashboard, viewer)


class FeedResponse(StreamingResponse):
    """A viewer's frames; it leaves the feed however the response ends (finished, client gone, cancelled)."""

    def __init__(self, dashboard: DashboardFeed, viewer: Viewer) -> None:
        headers = {"Cache-Control": "no-store", "X-Accel-Buffering": "no"}
        super().__init__(viewer.frames(), media_type="text/event-stream", headers=headers)
        self.dashboard = dashboard
        self.viewer = viewer

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.dashboard.leave(self.viewer)


def _dashboard(request: Request) -> DashboardFeed:
    """The feed: its routes are mounted only where there is one (no --disable-dashboard)."""
    dashboard = gateway_state(request)["dashboard"]
    if dashboard is None:
        raise NotFound("The dashboard is disabled (--disable-dashboard).")
    return dashboard


def _connection_abort(scope: Scope) -> Callable[[], None] | None:
    """What resets this request's connection, where the server offers it (pagegate serve's uvicorn does)."""
    return (scope.get("extensions") or {}).get(CONNECTION_EXTENSION, {}).get("abort")


def audience(request: Request) -> Audience:
    """Whose request ids this viewer may see: with several API keys only its own key's, else every one."""
    if len(set(host_of(request).config.every_api_key)) <= 1:
        return EVERY_ID
    return request_key_identity(request.scope) or NOBODY


async def request_pages(request: Request) -> Response:
    """The pages one request holds (hovering it in a queue list); none once it has finished."""
    request_id = request.query_params.get("request")
    if not request_id:
        raise BadRequest("Missing query parameter 'request'.", param="request")
    snapshot = await _dashboard(request).current()
    tenants = host_of(request).engine_requests.request_tenants
    visible = shown_id(request_id, audience(request), tenants) is not None
    device, cpu = (snapshot.pages_of(request_id) if visible else None) or ((), ())  # another key's: as if gone
    return JSONResponse({"request": request_id, "pages": list(map(int, device)), "cpu_pages": list(map(int, cpu))})


async def recent_requests(request: Request) -> Response:
    """The last finished requests, newest first, each with where its time went (request_timing.py); the page
    polls it. Other keys' requests are listed without their ids."""
    seen_by = audience(request)
    rows = host_of(request).timings.rows(seen_by, every_id=seen_by is EVERY_ID)
    return JSONResponse({"requests": rows}, headers={"Cache-Control": "no-store"})


async def page_holders(request: Request) -> Response:
    """One page's state and the requests holding it (hovering a cell)."""
    cpu = request.query_params.get("pool", "device") == "cpu"
    try:
        page_id = int(request.query_params.get("id", ""))
    except ValueError:
        raise BadRequest("Query parameter 'id' must be a page number.", param="id") from None
    snapshot = await _dashboard(request).current()
    states = snapshot.cpu_states if cpu else snapshot.device_states
    if not 0 <= page_id < len(states):
        raise NotFound(f"No page {page_id} in a pool of {len(states)}.", param="id")
    state = int(states[page_id])
    seen_by, tenants = audience(request), host_of(request).engine_requests.request_tenants
    holders = snapshot.holders_of(page_id, cpu)
    shown = [rid for rid in holders if shown_id(rid, seen_by, tenants) is not None]
    return JSONResponse({"page": page_id, "pool": "cpu" if cpu else "device", "refcount": state & MAX_REFCOUNT,
                         "prefix_cached": bool(state & CACHED), "requests": shown,
                         "other_requests": len(holders) - len(shown)})
