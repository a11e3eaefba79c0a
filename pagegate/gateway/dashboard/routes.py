"""GET /dashboard (the page), /dashboard/static/* (its files), and the data under /dashboard/api/, which needs
the API key when the server has one (auth.py): the SSE feed and the two hover queries."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.routing import BaseRoute, Mount, Route
from starlette.staticfiles import StaticFiles

from pagegate.core.page_map import CACHED, MAX_REFCOUNT
from pagegate.gateway.dashboard.feed import DashboardFeed
from pagegate.gateway.dashboard.frames import FrameEncoder
from pagegate.gateway.errors import BadRequest, NotFound

STATIC = Path(__file__).parent / "static"
API_PREFIX = "/dashboard/api/"
_WAIT_S = 0.5  # how often a waiting feed looks up from its wait (to end at shutdown)


def dashboard_routes() -> list[BaseRoute]:
    return [
        Route("/dashboard", page, methods=["GET"]),
        Mount("/dashboard/static", StaticFiles(directory=STATIC), name="dashboard-static"),
        Route(API_PREFIX + "feed", feed, methods=["GET"]),
        Route(API_PREFIX + "pages", request_pages, methods=["GET"]),
        Route(API_PREFIX + "page", page_holders, methods=["GET"]),
    ]


async def page(request: Request) -> Response:
    """The page itself holds no data, so it needs no key; it asks for one when the server has keys."""
    html = (STATIC / "index.html").read_text()
    needs_key = "true" if request.app.state.host.config.api_keys else "false"
    return HTMLResponse(html.replace("{{auth_required}}", needs_key), headers={"Cache-Control": "no-store"})


async def feed(request: Request) -> Response:
    dashboard: DashboardFeed = request.app.state.dashboard
    headers = {"Cache-Control": "no-store", "X-Accel-Buffering": "no"}
    return StreamingResponse(_frames(dashboard), media_type="text/event-stream", headers=headers)


async def _frames(dashboard: DashboardFeed) -> AsyncIterator[bytes]:
    """Until the client leaves (Starlette then cancels this) or the server stops."""
    encoder, seen = FrameEncoder(), 0
    yield b": pagegate dashboard feed\n\n"  # headers out now, before the first snapshot
    async with dashboard.watching():
        while not dashboard.stopping:
            snapshot = await dashboard.next_snapshot(seen, _WAIT_S)
            if snapshot is None:
                continue
            seen = dashboard.version
            model = dashboard.host.model.name if dashboard.host.model is not None else ""
            yield encoder.event(snapshot, dashboard.history, model)


async def request_pages(request: Request) -> Response:
    """The pages one request holds (hovering it in a queue list); none once it has finished."""
    request_id = request.query_params.get("request")
    if not request_id:
        raise BadRequest("Missing query parameter 'request'.", param="request")
    snapshot = await request.app.state.dashboard.current()
    device, cpu = snapshot.pages_of(request_id) or ((), ())
    return JSONResponse({"request": request_id, "pages": list(map(int, device)), "cpu_pages": list(map(int, cpu))})


async def page_holders(request: Request) -> Response:
    """One page's state and the requests holding it (hovering a cell)."""
    cpu = request.query_params.get("pool", "device") == "cpu"
    try:
        page_id = int(request.query_params.get("id", ""))
    except ValueError:
        raise BadRequest("Query parameter 'id' must be a page number.", param="id") from None
    snapshot = await request.app.state.dashboard.current()
    states = snapshot.cpu_states if cpu else snapshot.device_states
    if not 0 <= page_id < len(states):
        raise NotFound(f"No page {page_id} in a pool of {len(states)}.", param="id")
    state = int(states[page_id])
    return JSONResponse({"page": page_id, "pool": "cpu" if cpu else "device", "refcount": state & MAX_REFCOUNT,
                         "prefix_cached": bool(state & CACHED), "requests": snapshot.holders_of(page_id, cpu)})
