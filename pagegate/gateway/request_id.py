"""`x-request-id` on every response: the client's own (when it is a sane token) or a new one. It is the id
of the completion in the body and is appended to every log line written while the request is served."""

from __future__ import annotations

import contextvars
import logging
import re
import uuid

from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

HEADER = b"x-request-id"
CURRENT: contextvars.ContextVar[str | None] = contextvars.ContextVar("request_id", default=None)
_SANE = re.compile(r"[A-Za-z0-9._:-]{1,128}")


class RequestIdMiddleware:
    """Outermost ASGI wrapper, so that even a 500 from Starlette's error middleware carries the header."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = dict(scope.get("headers") or ()).get(HEADER, b"").decode("latin-1")
        request_id = given if _SANE.fullmatch(given) else uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = request_id
        token = CURRENT.set(request_id)

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), (HEADER, request_id.encode())]
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            CURRENT.reset(token)

    def __getattr__(self, name: str) -> object:  # app.state and friends stay reachable
        return getattr(self.app, name)


def request_id_of(request: Request) -> str:
    """The id RequestIdMiddleware gave this request (a fresh one when it did not run, e.g. in-process tests)."""
    return getattr(request.state, "request_id", None) or uuid.uuid4().hex


class RequestIdLogFilter(logging.Filter):
    """Appends ` [request_id=...]` to records written while a request is being served."""

    def filter(self, record: logging.LogRecord) -> bool:
        request_id = CURRENT.get()
        if request_id is not None and not getattr(record, "request_id_added", False):
            record.msg = f"{record.msg} [request_id={request_id}]"
            record.request_id_added = True
        return True
