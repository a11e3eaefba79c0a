"""One HTTP request carried from a front process into an in-process ASGI app, and the text a prefix-aware
router matches it by. No Ray here: the Ray Serve deployments (`pagegate.deploy.ray`) are built on it."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any

import msgpack
from starlette.types import ASGIApp, Message

from pagegate.gateway.codec import is_msgpack

logger = logging.getLogger("pagegate.deploy")

CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"
ROUTING_TEXT_CHARS = 8192  # requests that agree this far share their pages anyway; bounds the router's tree
DISCONNECT_GRACE_S = 5.0  # after the client left, how long the app gets to abort its generation


@dataclass(frozen=True, slots=True)
class ProxiedRequest:
    """An HTTP request with its whole body. `prompt` is the routing key: Ray Serve's PrefixCacheAffinityRouter
    reads the `prompt` attribute of a handle call's positional arguments."""

    method: str
    path: str
    query_string: bytes
    headers: list[tuple[bytes, bytes]]
    body: bytes
    client: tuple[str, int] | None = None
    prompt: str = ""


@dataclass(frozen=True, slots=True)
class ResponseHead:
    status: int
    headers: list[tuple[bytes, bytes]]


def routing_text(path: str, content_type: str | None, body: bytes) -> str:
    """The prompt's text (chat: the messages' text in order; token ids as decimal words), after the
    request's `cache_salt`, cut to ROUTING_TEXT_CHARS. "" for any other request or an unreadable body: the
    replica answers those (with a 400 where the body is bad) wherever they land."""
    if path not in (COMPLETIONS_PATH, CHAT_PATH):
        return ""
    try:
        payload = msgpack.unpackb(body) if is_msgpack(content_type) else json.loads(body)
    except Exception:  # any malformed body: the replica's parser says what is wrong with it
        return ""
    if not isinstance(payload, dict):
        return ""
    text = _text_of(payload.get("messages" if path == CHAT_PATH else "prompt"))
    salt = payload.get("cache_salt")
    if text and isinstance(salt, str) and salt:  # pages are shared only between requests of one salt
        text = f"{salt}\n{text}"
    return text[:ROUTING_TEXT_CHARS]


def _text_of(value: Any) -> str:
    """Text of a prompt, a list of prompts or token ids, chat messages or their content parts."""
    if isinstance(value, str):
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value} "
    if isinstance(value, list):
        return "".join(_text_of(item) for item in value)
    if isinstance(value, dict):
        text = value.get("text")
        return text if isinstance(text, str) else _text_of(value.get("content"))
    return ""


async def call_asgi(app: ASGIApp, request: ProxiedRequest,
                    state: Mapping[str, Any] | None = None) -> AsyncIterator[ResponseHead | bytes]:
    """Run `request` through `app` in this process: yield the response head, then body chunks as the app
    sends them. Closing the iterator early tells the app that the client disconnected. `state`: what the app's
    lifespan yielded, which the request's scope carries a copy of (as an ASGI server's does)."""
    scope: dict[str, Any] = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": request.method,
        "scheme": "http", "path": request.path, "raw_path": request.path.encode(), "root_path": "",
        "query_string": request.query_string, "headers": request.headers, "client": request.client,
        "server": None, "state": dict(state or {}),
    }
    pending_body = [{"type": "http.request", "body": request.body, "more_body": False}]
    client_left = asyncio.Event()
    sent: asyncio.Queue[Message | None] = asyncio.Queue()

    async def receive() -> Message:
        if pending_body:
            return pending_body.pop()
        await client_left.wait()
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        sent.put_nowait(message)

    async def run() -> None:
        try:
            await app(scope, receive, send)
        except Exception:  # Starlette has answered with a 500 if it could; as uvicorn, log and end the response
            logger.exception("%s %s failed", request.method, request.path)
        finally:
            sent.put_nowait(None)

    task = asyncio.create_task(run())
    try:
        while (message := await sent.get()) is not None:
            if message["type"] == "http.response.start":
                yield ResponseHead(message["status"], [(bytes(k), bytes(v)) for k, v in message.get("headers", [])])
            elif message["type"] == "http.response.body" and message.get("body"):
                yield bytes(message["body"])
    finally:
        client_left.set()
        if not task.done():
            await asyncio.wait({task}, timeout=DISCONNECT_GRACE_S)
            task.cancel()
