"""Clients for a pagegate server. Importing this package needs only httpx and msgpack (never torch);
GrpcClient / AsyncGrpcClient load grpcio and protobuf on first use."""

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

_LAZY = {"GrpcClient": "pagegate.clients.grpc_client", "AsyncGrpcClient": "pagegate.clients.grpc_client"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'pagegate.clients' has no attribute {name!r}")


__all__ = [
    "AsyncGrpcClient",
    "AsyncMsgpackClient",
    "AuthenticationError",
    "BadRequestError",
    "GrpcClient",
    "MsgpackClient",
    "NotFoundError",
    "PagegateError",
    "ProtocolError",
    "RateLimitError",
    "RequestTooLargeError",
    "ServerError",
    "StreamError",
]
