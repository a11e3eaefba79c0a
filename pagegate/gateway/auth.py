"""API keys: `Authorization: Bearer <key>` (or Anthropic's `x-api-key`) on the API routes, compared in constant time;
admin keys (--admin-api-key) for the routes that manage the server (MANAGEMENT_PATHS).

NOTE: managing is an admin's: loading, unloading, sleeping and waking models or adapters changes what every other
key is served (a key could put another's busy model to sleep, or load an adapter from any path on the server). An
admin key also opens every route an ordinary key opens. Reading state (/is_sleeping, /v1/models) stays open to
every key, but only an admin sees an adapter's server path. With no key at all the server is open, management
included, as it always was (it listens on 127.0.0.1 by default; the start-up log warns). With --api-key and no
admin key, nobody may manage it: a key meant for clients must not become an admin's by default.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
from urllib.parse import parse_qs

from starlette.types import ASGIApp, Receive, Scope, Send

from pagegate.gateway.codec import is_msgpack, render_error
from pagegate.gateway.errors import APIError, Forbidden, Unauthorized, speaks_anthropic

logger = logging.getLogger("pagegate.gateway")

# /health, /metrics, /version and the dashboard's page and files stay open; its data does not
PROTECTED_PREFIXES = ("/v1/", "/tokenize", "/detokenize", "/dashboard/api/", "/models/", "/sleep", "/wake_up",
                      "/is_sleeping")
QUERY_KEY_PREFIXES = ("/dashboard/api/",)  # also take ?api_key=: an EventSource cannot send a header
# The routes that change what the server serves: an admin key's (the module's NOTE)
MANAGEMENT_PATHS = frozenset({"/models/load", "/models/unload", "/sleep", "/wake_up", "/v1/load_lora_adapter",
                              "/v1/unload_lora_adapter"})


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
IS_ADMIN = "api_key_admin"  # ... and whether the request may manage the server


def request_is_admin(scope: Scope) -> bool:
    """Whether this request may manage the server and see its paths: an admin key's, or any on a server without
    keys (APIKeyMiddleware decides; False for a request it did not see)."""
    return bool(scope.get("state", {}).get(IS_ADMIN, False))


def management_refusal(admin_keys: list[str]) -> Forbidden:
    """The 403 an ordinary key gets on a management route (REST and gRPC say the same)."""
    why = ("this key is not an admin key (--admin-api-key)" if admin_keys
           else "the server has no admin key (--admin-api-key), so nobody may")
    return Forbidden(f"Managing the server (loading, unloading, sleeping or waking models and LoRA adapters) needs "
                     f"an admin key: {why}.")


def log_management_access(api_keys: list[str], admin_keys: list[str]) -> None:
    """Say at start-up who may manage the server when it is not an admin alone."""
    if not api_keys and not admin_keys:
        logger.warning("no --api-key nor --admin-api-key: anyone who reaches this server may use it and manage it "
                       "(load, unload, sleep and wake models and LoRA adapters)")
    elif not admin_keys:
        logger.info("no --admin-api-key: the management routes (/models/load, /models/unload, /sleep, /wake_up, "
                    "the LoRA adapter routes) are refused to every key (403)")


def bearer_token(header: str | None) -> str | None:
    if not header:
        return None
    scheme, _, token = header.partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


class APIKeyMiddleware:
    """Pure ASGI middleware so streamed responses pass through untouched: a 401 without a key, a 403 for a key that
    is not an admin's on a management route; the request's key identity and role in the scope's state."""

    def __init__(self, app: ASGIApp, api_keys: list[str], admin_keys: list[str] | None = None) -> None:
        self.app = app
        self.api_keys = list(api_keys)
        self.admin_keys = list(admin_keys or [])
        self.keys = self.api_keys + self.admin_keys

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if not self.keys:  # an open server: everyone may do everything (the module's NOTE)
            scope.setdefault("state", {})[IS_ADMIN] = True
            await self.app(scope, receive, send)
            return
        if not self._needs_key(scope):
            await self.app(scope, receive, send)
            return
        key = self._presented_key(scope)
        if key is None:
            await self._refuse(scope, receive, send, Unauthorized(
                "Incorrect or missing API key: send 'Authorization: Bearer <key>' (or 'x-api-key').",
                headers={"WWW-Authenticate": "Bearer"}))
            return
        admin = matching_key(key, self.admin_keys) is not None
        if not admin and scope["path"] in MANAGEMENT_PATHS:
            await self._refuse(scope, receive, send, management_refusal(self.admin_keys))
            return
        state = scope.setdefault("state", {})
        state[KEY_IDENTITY], state[IS_ADMIN] = key_identity(key), admin
        await self.app(scope, receive, send)

    @staticmethod
    async def _refuse(scope: Scope, receive: Receive, send: Send, error: APIError) -> None:
        headers = dict(scope["headers"])
        response = render_error(error, msgpack_body=is_msgpack(headers.get(b"accept", b"").decode("latin-1")),
                                anthropic=speaks_anthropic(scope["path"]))
        await response(scope, receive, send)

    def _needs_key(self, scope: Scope) -> bool:
        return scope["method"] != "OPTIONS" and scope["path"].startswith(PROTECTED_PREFIXES)

    def _presented_key(self, scope: Scope) -> str | None:
        """The configured key the request presents, or None."""
        headers = scope["headers"]
        header = next((v for k, v in headers if k == b"authorization"), b"").decode("latin-1")
        token = bearer_token(header)
        if token is None:  # Anthropic's clients send their key so
            token = next((v.decode("latin-1") for k, v in headers if k == b"x-api-key"), None)
        if token is None and scope["path"].startswith(QUERY_KEY_PREFIXES):
            token = query_key(scope.get("query_string", b""))
        return matching_key(token, self.keys) if token is not None else None


def query_key(query_string: bytes) -> str | None:
    keys = parse_qs(query_string.decode("latin-1")).get("api_key")
    return keys[0] if keys else None
