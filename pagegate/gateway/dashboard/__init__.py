"""The live KV-page dashboard at /dashboard: the pools as a grid, the queues, the health, over SSE."""

from pagegate.gateway.dashboard.feed import DashboardFeed
from pagegate.gateway.dashboard.routes import API_PREFIX, dashboard_routes

__all__ = ["API_PREFIX", "DashboardFeed", "dashboard_routes"]
