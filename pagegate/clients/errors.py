"""Typed client errors carrying the server's OpenAI-shaped error body."""

from __future__ import annotations

from typing import Any


class PagegateError(Exception):
    """Base class: `status_code`, and the server's `message`, `type`, `param`, `code`."""

    def __init__(self, message: str, *, status_code: int | None = None, type: str | None = None,
                 param: str | None = None, code: str | int | None = None, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status_code = status_code
        self.type = type
        self.param = param
        self.code = code
        self.retry_after = retry_after


class BadRequestError(PagegateError):
    """400 (and other 4xx without a class of their own)."""


class AuthenticationError(PagegateError):
    """401: missing or wrong API key."""


class NotFoundError(PagegateError):
    """404: unknown model or route."""


class RequestTooLargeError(PagegateError):
    """413: the body is over the server's size limit."""


class RateLimitError(PagegateError):
    """429: too many waiting requests; `retry_after` holds the server's Retry-After in seconds."""


class ServerError(PagegateError):
    """5xx, including 503 while the server loads, stops, or its engine died."""


class StreamError(PagegateError):
    """An error the server reported inside a stream, after the 200 status line."""


class ProtocolError(PagegateError):
    """The answer was not what the msgpack framing promises (docs/msgpack.md)."""


_BY_STATUS = {400: BadRequestError, 401: AuthenticationError, 404: NotFoundError, 413: RequestTooLargeError,
              429: RateLimitError}


def error_from_response(status_code: int, body: Any, retry_after: str | None = None) -> PagegateError:
    """The typed exception for an error status and its decoded body."""
    cls = _BY_STATUS.get(status_code) or (ServerError if status_code >= 500 else BadRequestError)
    detail = body.get("error") if isinstance(body, dict) else None
    if not isinstance(detail, dict):
        detail = {"message": f"HTTP {status_code}: {body!r}"[:500]}
    seconds = float(retry_after) if retry_after and retry_after.replace(".", "", 1).isdigit() else None
    return cls(str(detail.get("message")), status_code=status_code, type=detail.get("type"),
               param=detail.get("param"), code=detail.get("code"), retry_after=seconds)


def error_from_chunk(chunk: dict[str, Any]) -> StreamError:
    detail = chunk.get("error") or {}
    return StreamError(str(detail.get("message")), type=detail.get("type"), param=detail.get("param"),
                       code=detail.get("code"))
