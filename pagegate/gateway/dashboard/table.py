"""The dashboard's routes: the page, its static files and its API, each endpoint imported at its first request."""

from __future__ import annotations

from pathlib import Path

from starlette.routing import BaseRoute, Mount, Route
from starlette.staticfiles import StaticFiles

from pagegate.gateway.lazy_endpoint import lazy

STATIC = Path(__file__).parent / "static"
API_PREFIX = "/dashboard/api/"
ROUTES = "pagegate.gateway.dashboard.routes"


def dashboard_routes() -> list[BaseRoute]:
    return [
        Route("/dashboard", lazy(f"{ROUTES}:page"), methods=["GET"]),
        Mount("/dashboard/static", StaticFiles(directory=STATIC), name="dashboard-static"),
        Route(API_PREFIX + "feed", lazy(f"{ROUTES}:feed"), methods=["GET"]),
        Route(API_PREFIX + "pages", lazy(f"{ROUTES}:request_pages"), methods=["GET"]),
        Route(API_PREFIX + "page", lazy(f"{ROUTES}:page_holders"), methods=["GET"]),
        Route(API_PREFIX + "recent", lazy(f"{ROUTES}:recent_requests"), methods=["GET"]),
    ]
