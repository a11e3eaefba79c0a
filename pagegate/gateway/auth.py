"""API keys: `Authorization: Bearer <key>` on the API routes, compared in constant time."""

from __future__ import annotations

import hmac
from urllib.parse import parse_qs

from starlette.types import ASGIApp, Receive, Scope, Send

from pagegate.gateway.codec import is_msgpack, render_error
from pagegate.gateway.errors import Unauthorized

# /health, /metrics, /version and the dashboard's page and files stay open; its data does not
PROTECTED_PREFIXES = ("/v1/", "/tokenize", "/detokenize", "/dashboard/api/")
QUERY_KEY_PREFIXES = ("/dashboard/api/",)  # also take ?api_key=: an EventSource cannot send a header


def key_matches(presented: str, keys: list[str]) -> bool:
    """True when `presented` equals one of `keys`; every key is compared, so timing tells nothing."""
    given = presented.encode()
    matched = False
    for key in keys:
        matched |= hmac.compare_digest(given, key.encode())
    return matched


def bearer_token(header: str | None) -> str | None:
    if not header:
        return None
    scheme, _, token = header.partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


class APIKeyMiddleware:
    """Pure ASGI middleware so streamed responses pass through untouched."""

    def __init__(self, app: ASGIApp, api_keys: list[str]) -> None:
        self.app = app
        self.api_keys = list(api_keys)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self._needs_key(scope) or self._authorized(scope):
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        error = Unauthorized("Incorrect or missing API key: send 'Authorization: Bearer <key>'.",
                             headers={"WWW-Authenticate": "Bearer"})
        response = render_error(error, msgpack_body=is_msgpack(headers.get(b"accept", b"").decode("latin-1")))
        await response(scope, receive, send)

    def _needs_key(self, scope: Scope) -> bool:
        return bool(self.api_keys) and scope["method"] != "OPTIONS" and scope["path"].startswith(PROTECTED_PREFIXES)

    def _authorized(self, scope: Scope) -> bool:
        header = next((v for k, v in scope["headers"] if k == b"authorization"), b"").decode("latin-1")
        token = bearer_token(header)
        if token is None and scope["path"].startswith(QUERY_KEY_PREFIXES):
            token = query_key(scope.get("query_string", b""))
        return token is not None and key_matches(token, self.api_keys)


def query_key(query_string: bytes) -> str | None:
    keys = parse_qs(query_string.decode("latin-1")).get("api_key")
    return keys[0] if keys else None
