"""Endpoints imported at their first request."""

from __future__ import annotations

import importlib
from collections.abc import Awaitable, Callable

from starlette.requests import Request
from starlette.responses import Response

Endpoint = Callable[[Request], Awaitable[Response]]


def lazy(target: str) -> Endpoint:
    """The endpoint `module:function`, its module imported at the first request: a route module a server may never
    use (the Responses, Messages, Files and Batch APIs, the OpenAPI document, the dashboard: their pydantic models,
    SQLite, numpy) costs its start-up nothing."""
    module, name = target.split(":")

    async def endpoint(request: Request) -> Response:
        handler: Endpoint = getattr(importlib.import_module(module), name)
        return await handler(request)

    return endpoint
