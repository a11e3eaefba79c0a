"""The pieces under the Ray deployment, without Ray: routing text, the in-process ASGI call."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import msgpack
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from pagegate.deploy.proxying import ROUTING_TEXT_CHARS, ProxiedRequest, ResponseHead, call_asgi, routing_text


def test_routing_text_of_completions_and_chat() -> None:
    assert routing_text("/v1/completions", "application/json", b'{"prompt": "Once upon"}') == "Once upon"
    assert routing_text("/v1/completions", None, b'{"prompt": ["a", "b"]}') == "ab"
    assert routing_text("/v1/completions", None, b'{"prompt": [12, 7]}') == "12 7 "
    chat = {"messages": [{"role": "system", "content": "Be brief."},
                         {"role": "user", "content": [{"type": "text", "text": "Hi"}]}]}
    assert routing_text("/v1/chat/completions", None, json.dumps(chat).encode()) == "Be brief.Hi"
    body = msgpack.packb({"prompt": "x", "cache_salt": "tenant-1"})
    assert routing_text("/v1/completions", "application/msgpack", body) == "tenant-1\nx"
    assert len(routing_text("/v1/completions", None, json.dumps({"prompt": "y" * 10**5}).encode())) == ROUTING_TEXT_CHARS


def test_no_routing_text_for_other_requests() -> None:
    assert routing_text("/v1/models", None, b"") == ""
    assert routing_text("/v1/completions", None, b"{not json") == ""
    assert routing_text("/v1/completions", None, b"[1, 2]") == ""
    assert routing_text("/v1/chat/completions", None, b'{"prompt": "wrong field"}') == ""


async def _echo(request: Request) -> JSONResponse:
    return JSONResponse({"method": request.method, "path": request.url.path, "query": request.url.query,
                         "body": (await request.body()).decode(), "agent": request.headers.get("user-agent")},
                        status_code=201)


STREAM_STATE: dict[str, bool] = {}


async def _stream(request: Request) -> StreamingResponse:
    async def chunks() -> AsyncIterator[bytes]:
        try:
            for index in range(1000):
                yield f"chunk {index}\n".encode()
                await asyncio.sleep(0.01)
        finally:
            STREAM_STATE["closed"] = True

    return StreamingResponse(chunks(), media_type="text/plain")


APP = Starlette(routes=[Route("/echo", _echo, methods=["POST"]), Route("/stream", _stream)])


def _request(method: str, path: str, body: bytes = b"", query: bytes = b"") -> ProxiedRequest:
    return ProxiedRequest(method, path, query, [(b"user-agent", b"test")], body, ("127.0.0.1", 5000))


def test_call_asgi_relays_head_and_body() -> None:
    async def collect() -> list[ResponseHead | bytes]:
        return [item async for item in call_asgi(APP, _request("POST", "/echo", b"hello", b"a=1"))]

    head, *body = asyncio.run(collect())
    assert isinstance(head, ResponseHead) and head.status == 201
    assert (b"content-type", b"application/json") in head.headers
    assert json.loads(b"".join(b for b in body if isinstance(b, bytes))) == {
        "method": "POST", "path": "/echo", "query": "a=1", "body": "hello", "agent": "test"}


def test_closing_call_asgi_disconnects_the_app() -> None:
    STREAM_STATE.clear()

    async def read_two_chunks() -> list[ResponseHead | bytes]:
        items = call_asgi(APP, _request("GET", "/stream"))
        got = [await anext(items), await anext(items), await anext(items)]
        await items.aclose()
        return got

    head, first, second = asyncio.run(read_two_chunks())
    assert isinstance(head, ResponseHead) and head.status == 200
    assert (first, second) == (b"chunk 0\n", b"chunk 1\n")
    assert STREAM_STATE.get("closed")  # the app saw the disconnect and ended its stream
