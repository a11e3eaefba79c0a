"""One batch line through the app's own route, in-process: the same parsing, validation, admission and answer
as the request would get online, with no socket and no HTTP parsing.

NOTE: the request enters at the router, below the API-key middleware: it carries its batch owner's key
identity (never an admin's), so it sees that key's stored responses and prefix cache, and the batch lane
(pagegate.gateway.lanes), which only the runner can set. It is not counted as in flight: a drain does not wait
for batch lines (a line cut off by a restart is run again after it).
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive

from pagegate.gateway.auth import IS_ADMIN, KEY_IDENTITY
from pagegate.gateway.codec import JSON, dumps_json
from pagegate.gateway.errors import APIError, from_status, to_api_error
from pagegate.gateway.lanes import BATCH, LANE_STATE
from pagegate.gateway.request_id import CURRENT

logger = logging.getLogger("pagegate.gateway")


@dataclass(frozen=True)
class RouteAnswer:
    status_code: int
    body: bytes  # one line of JSON
    request_id: str


class InProcessClient:
    """POSTs to `router` (the app's, under its middleware) with the lifespan's `state` in every request's scope."""

    def __init__(self, router: ASGIApp, state: Mapping[str, Any]) -> None:
        self.router = router
        self.state = state

    async def post(self, path: str, body: bytes, tenant: str | None) -> RouteAnswer:
        request_id = uuid.uuid4().hex
        scope = self._scope(path, body, tenant, request_id)
        answer = _Answer()
        token = CURRENT.set(request_id)
        try:
            await self.router(scope, _receiver(body), answer.send)
        except Exception as exc:  # what the app's exception handlers would have answered
            error = _error(exc, path)
            return RouteAnswer(error.status_code, dumps_json(error.body()), request_id)
        finally:
            CURRENT.reset(token)
        return RouteAnswer(answer.status_code, _one_line(answer.body()), request_id)

    def _scope(self, path: str, body: bytes, tenant: str | None, request_id: str) -> dict[str, Any]:
        headers = [(b"host", b"batch"), (b"content-type", JSON.encode()), (b"content-length", str(len(body)).encode())]
        state = {**self.state, "request_id": request_id, KEY_IDENTITY: tenant, IS_ADMIN: False, LANE_STATE: BATCH}
        return {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
                "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(), "root_path": "",
                "query_string": b"", "headers": headers, "client": None, "server": None, "state": state}


class _Answer:
    def __init__(self) -> None:
        self.status_code = 500
        self.chunks: list[bytes] = []

    async def send(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.status_code = message["status"]
        elif message["type"] == "http.response.body":
            self.chunks.append(message.get("body", b""))

    def body(self) -> bytes:
        return b"".join(self.chunks)


def _receiver(body: bytes) -> Receive:
    """The request's body at once, then nothing: the client never leaves (the runner cancels instead)."""
    sent = False

    async def receive() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.Event().wait()  # until the line's task is cancelled
        return {"type": "http.disconnect"}

    return receive


def _error(exc: Exception, path: str) -> APIError:
    if isinstance(exc, HTTPException):
        return from_status(exc.status_code, f"{exc.detail}: POST {path}")
    error = to_api_error(exc)
    if error.status_code >= 500 and error is not exc:
        logger.error("batch line POST %s failed", path, exc_info=exc)
    return error


def _one_line(body: bytes) -> bytes:
    """The answer as one line of JSON (an error's body when the route answered something else)."""
    if body.startswith(b"{") and b"\n" not in body:  # what the routes write (dumps_json): not decoded again
        return body
    try:
        decoded = json.loads(body)
    except ValueError:
        return dumps_json({"error": {"message": "The route's answer was not JSON.", "type": "server_error",
                                     "param": None, "code": "invalid_answer"}})
    return body if b"\n" not in body else dumps_json(decoded)
