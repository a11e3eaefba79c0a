"""API keys: `Authorization: Bearer <key>` (or Anthropic's `x-api-key`) on the API routes, compared in constant time."""

from __future__ import annotations

import hashlib
import hmac
from urllib.parse import parse_qs

from starlette.types import ASGIApp, Receive, Scope, Send

from pagegate.gateway.codec import is_msgpack, render_error
from pagegate.gateway.errors import Unauthorized, speaks_anthropic

# /health, /metrics, /version and the dashboard's page and files stay open; its data does not
PROTECTED_PREFIXES = ("/v1/", "/tokenize", "/detokenize", "/dashboard/api/", "/models/", "/sleep", "/wake_up",
                      "/is_sleeping")
QUERY_KEY_PREFIXES = ("/dashboard/api/",)  # also take ?api_key=: an EventSource cannot send a header


def key_matches(presented: str, keys: list[str]) -> bool:
    """True when `presented` equals one of `keys`; every key is compared, so timing tells nothing."""
    return matching_key(presented, keys) is not None


def matching_key(presented: str, keys: list[str]) -> str | None:
    """The key of `keys` that `presented` equals, or None; every key is compared, so timing tells nothing."""
    given = presented.encode()
    matched = None
    for key in keys:
        if hmac.compare_digest(given, key.encode()):
            matched = key
    return matched


def key_identity(key: str) -> str:
    """A stable name of an API key that does not reveal it: the tenant a request belongs to."""
    return hashlib.sha256(b"pagegate-key\0" + key.encode()).hexdigest()[:24]


def request_key_identity(scope: Scope) -> str | None:
    """The identity of the key that authorized this request (None without --api-key)."""
    return scope.get("state", {}).get(KEY_IDENTITY)


KEY_IDENTITY = "api_key_identity"  # where APIKeyMiddleware leaves it in the ASGI scope's state


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
        if scope["type"] != "http" or not self._needs_key(scope):
            await self.app(scope, receive, send)
            return
        key = self._presented_key(scope)
        if key is not None:
            scope.setdefault("state", {})[KEY_IDENTITY] = key_identity(key)
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        error = Unauthorized("Incorrect or missing API key: send 'Authorization: Bearer <key>' (or 'x-api-key').",
                             headers={"WWW-Authenticate": "Bearer"})
        response = render_error(error, msgpack_body=is_msgpack(headers.get(b"accept", b"").decode("latin-1")),
                                anthropic=speaks_anthropic(scope["path"]))
        await response(scope, receive, send)

    def _needs_key(self, scope: Scope) -> bool:
        return bool(self.api_keys) and scope["method"] != "OPTIONS" and scope["path"].startswith(PROTECTED_PREFIXES)

    def _presented_key(self, scope: Scope) -> str | None:
        """The configured key the request presents, or None."""
        headers = scope["headers"]
        header = next((v for k, v in headers if k == b"authorization"), b"").decode("latin-1")
        token = bearer_token(header)
        if token is None:  # Anthropic's clients send their key so
            token = next((v.decode("latin-1") for k, v in headers if k == b"x-api-key"), None)
        if token is None and scope["path"].startswith(QUERY_KEY_PREFIXES):
            token = query_key(scope.get("query_string", b""))
        return matching_key(token, self.api_keys) if token is not None else None


def query_key(query_string: bytes) -> str | None:
    keys = parse_qs(query_string.decode("latin-1")).get("api_key")
    return keys[0] if keys else None
