"""MsgpackClient / AsyncMsgpackClient: the OpenAI-compatible API over msgpack bodies (httpx + msgpack only)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx

from pagegate.clients.framing import (
    ChunkReader,
    api_root,
    decode_response,
    headers,
    read_chunks,
    request_body,
)

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
MODELS = "/v1/models"


class MsgpackClient:
    """Blocking client. Every method returns the same maps as the JSON API; errors raise `PagegateError`s."""

    def __init__(self, base_url: str, api_key: str | None = None, *, timeout: float = 600.0,
                 http_client: httpx.Client | None = None) -> None:
        self._http = http_client or httpx.Client(timeout=timeout)
        self._root = api_root(base_url)
        self._headers = headers(api_key)

    def completions(self, prompt: Any, *, model: str | None = None, **params: Any) -> dict[str, Any]:
        return self._post(COMPLETIONS, request_body({"model": model, "prompt": prompt}, params, stream=False))

    def stream_completions(self, prompt: Any, *, model: str | None = None, **params: Any) -> Iterator[dict[str, Any]]:
        return self._stream(COMPLETIONS, request_body({"model": model, "prompt": prompt}, params, stream=True))

    def chat(self, messages: list[dict[str, Any]], *, model: str | None = None, **params: Any) -> dict[str, Any]:
        return self._post(CHAT, request_body({"model": model, "messages": messages}, params, stream=False))

    def stream_chat(self, messages: list[dict[str, Any]], *, model: str | None = None,
                    **params: Any) -> Iterator[dict[str, Any]]:
        return self._stream(CHAT, request_body({"model": model, "messages": messages}, params, stream=True))

    def models(self) -> list[dict[str, Any]]:
        response = self._http.get(self._root + MODELS, headers=self._headers)
        return decode_response(response.status_code, response.content, response.headers.get("retry-after"))["data"]

    def _post(self, path: str, body: bytes) -> dict[str, Any]:
        response = self._http.post(self._root + path, content=body, headers=self._headers)
        return decode_response(response.status_code, response.content, response.headers.get("retry-after"))

    def _stream(self, path: str, body: bytes) -> Iterator[dict[str, Any]]:
        # Breaking out of the loop closes the response, and the server aborts the request.
        with self._http.stream("POST", self._root + path, content=body, headers=self._headers) as response:
            if response.status_code >= 400:
                response.read()
                decode_response(response.status_code, response.content, response.headers.get("retry-after"))
            yield from read_chunks(response.iter_raw())

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> MsgpackClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncMsgpackClient:
    """asyncio client with the same methods; the stream methods are async iterators."""

    def __init__(self, base_url: str, api_key: str | None = None, *, timeout: float = 600.0,
                 http_client: httpx.AsyncClient | None = None) -> None:
        self._http = http_client or httpx.AsyncClient(timeout=timeout)
        self._root = api_root(base_url)
        self._headers = headers(api_key)

    async def completions(self, prompt: Any, *, model: str | None = None, **params: Any) -> dict[str, Any]:
        return await self._post(COMPLETIONS, request_body({"model": model, "prompt": prompt}, params, stream=False))

    def stream_completions(self, prompt: Any, *, model: str | None = None,
                           **params: Any) -> AsyncIterator[dict[str, Any]]:
        return self._stream(COMPLETIONS, request_body({"model": model, "prompt": prompt}, params, stream=True))

    async def chat(self, messages: list[dict[str, Any]], *, model: str | None = None, **params: Any) -> dict[str, Any]:
        return await self._post(CHAT, request_body({"model": model, "messages": messages}, params, stream=False))

    def stream_chat(self, messages: list[dict[str, Any]], *, model: str | None = None,
                    **params: Any) -> AsyncIterator[dict[str, Any]]:
        return self._stream(CHAT, request_body({"model": model, "messages": messages}, params, stream=True))

    async def models(self) -> list[dict[str, Any]]:
        response = await self._http.get(self._root + MODELS, headers=self._headers)
        return decode_response(response.status_code, response.content, response.headers.get("retry-after"))["data"]

    async def _post(self, path: str, body: bytes) -> dict[str, Any]:
        response = await self._http.post(self._root + path, content=body, headers=self._headers)
        return decode_response(response.status_code, response.content, response.headers.get("retry-after"))

    async def _stream(self, path: str, body: bytes) -> AsyncIterator[dict[str, Any]]:
        async with self._http.stream("POST", self._root + path, content=body, headers=self._headers) as response:
            if response.status_code >= 400:
                await response.aread()
                decode_response(response.status_code, response.content, response.headers.get("retry-after"))
            reader = ChunkReader()
            async for piece in response.aiter_raw():
                for chunk in reader.feed(piece):
                    yield chunk
            reader.finish()

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> AsyncMsgpackClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
