"""The preamble of every REST route that runs a model: the server takes requests, the body is read, the model it
names is acquired (the gRPC door has its own: its body is the decoded message)."""

from __future__ import annotations

from typing import Any

from starlette.requests import Request

from pagegate.gateway.acquired import AcquiredModel
from pagegate.gateway.codec import read_body
from pagegate.gateway.engine_host import EngineHost, requested_model
from pagegate.gateway.gateway_state import host_of


async def read_and_acquire(request: Request, *, generation: bool = False) -> tuple[EngineHost, Any, AcquiredModel]:
    """The host, the request's body and its model, loaded or woken first if need be. A 503 before the body is read
    unless the server takes requests; for a `generation`, also a 400 before it from an embedding server (it says
    what the server is)."""
    host = host_of(request)
    host.check_serving()
    if generation:
        host.admission.check_generates()
    body = await read_body(request, host.config.max_request_bytes)
    return host, body, await host.acquire(requested_model(body))
