"""Clients for a pagegate server. Importing this package needs only httpx and msgpack (never torch)."""

from pagegate.clients.errors import (
    AuthenticationError,
    BadRequestError,
    NotFoundError,
    PagegateError,
    ProtocolError,
    RateLimitError,
    RequestTooLargeError,
    ServerError,
    StreamError,
)
from pagegate.clients.msgpack_client import AsyncMsgpackClient, MsgpackClient

__all__ = [
    "AsyncMsgpackClient",
    "AuthenticationError",
    "BadRequestError",
    "MsgpackClient",
    "NotFoundError",
    "PagegateError",
    "ProtocolError",
    "RateLimitError",
    "RequestTooLargeError",
    "ServerError",
    "StreamError",
]
