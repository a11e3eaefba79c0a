"""The OpenAI routes: /v1/completions, /v1/chat/completions, /v1/models."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from pagegate.engine.outputs import RequestOutput
from pagegate.gateway.auth import request_is_admin, request_key_identity
from pagegate.gateway.codec import EVENT_STREAM, MSGPACK, render, render_in_pieces, wants_msgpack
from pagegate.gateway.errors import to_api_error
from pagegate.gateway.gateway_state import host_of
from pagegate.gateway.lanes import request_lane
from pagegate.gateway.preamble import read_and_acquire
from pagegate.gateway.prepare import (
    ModelContext,
    PreparedRequest,
    off_loop,
    prepare_chat,
    prepare_completion,
    render_off_loop,
)
from pagegate.gateway.render import ChatRenderer, CompletionRenderer, Renderer
from pagegate.gateway.request_id import request_id_of
from pagegate.gateway.request_timing import trace_headers, wants_timing
from pagegate.gateway.streaming import OutputMerger, collect, stream_body

T = TypeVar("T")
CLIENT_CLOSED = 499  # nginx's code for a client that left before the answer; never actually sent


async def completions(request: Request) -> Response:
    return await _generate(request, prepare_completion, CompletionRenderer, "cmpl")


async def chat_completions(request: Request) -> Response:
    return await _generate(request, prepare_chat, ChatRenderer, "chatcmpl")


async def _generate(
    request: Request,
    prepare: Callable[[Any, ModelContext], PreparedRequest],
    renderer_cls: type[Renderer],
    id_prefix: str,
) -> Response:
    host, body, acquired = await read_and_acquire(request, generation=True)
    prepared = await off_loop(prepare, body, acquired.model)  # validation and tokenization: never on the event loop
    prepared.tenant = request_key_identity(request.scope)
    prepared.lane = request_lane(request.scope)
    host.admission.admit(acquired, prepared)
    renderer = renderer_cls(prepared, acquired.model.tokenizer, f"{id_prefix}-{request_id_of(request)}",
                            timing=wants_timing(request.headers))
    merger, _ = host.engine_requests.generate(acquired, prepared, renderer.request_id, trace_headers(request.headers))
    msgpack_out = wants_msgpack(request)
    if prepared.stream:
        return _stream(merger, renderer, msgpack_out, host.engine_requests.stream_pace)
    finals = await until_disconnect(request, collect(merger))
    if finals is None:
        return Response(status_code=CLIENT_CLOSED)
    return await whole_answer(renderer, finals, msgpack_out)


async def whole_answer(renderer: Renderer, finals: dict[int, RequestOutput], msgpack_out: bool) -> Response:
    """The non-streamed response. One that carries a scored prompt (up to --max-scoring-tokens entries) is built
    and encoded in a render thread, a piece at a time, so the event loop keeps answering meanwhile."""
    if not renderer.prepared.scoring_size:
        return render(renderer.response(finals), msgpack_body=msgpack_out)
    return await render_off_loop(lambda: render_in_pieces(renderer.response(finals), msgpack_body=msgpack_out))


def _stream(merger: OutputMerger, renderer: Renderer, msgpack_out: bool, pace: Callable[[], float]) -> Response:
    body = stream_body(merger, renderer, lambda exc: to_api_error(exc).body(), msgpack_out, pace)
    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    return GenerationStreamResponse(body, merger, headers=headers, media_type=MSGPACK if msgpack_out else EVENT_STREAM)


class GenerationStreamResponse(StreamingResponse):
    """A stream whose generation ends with the response, even when the client leaves before the first byte."""

    def __init__(self, content: Any, merger: OutputMerger, **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self.merger = merger

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.merger.close()


async def until_disconnect(request: Request, work: Awaitable[T]) -> T | None:
    """Await `work` unless the client disconnects first (then `work` is cancelled and None returned)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    return task.result() if task.done() and not task.cancelled() else None


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def models(request: Request) -> Response:
    host = host_of(request)
    cards = host.model_cards(paths=request_is_admin(request.scope))
    return render({"object": "list", "data": cards}, msgpack_body=wants_msgpack(request))


async def model_detail(request: Request) -> Response:
    host = host_of(request)
    requested = request.path_params["model"]
    if host.several:  # any model there is, loaded or not
        host.check_serving()
        return render(host.model_card(host.slot_for(requested).name, request_is_admin(request.scope)),
                      msgpack_body=wants_msgpack(request))
    model = host.listed_model()  # also while it sleeps (not woken by a look)
    name = model.resolve(requested)
    return render(host.model_card(name, request_is_admin(request.scope)), msgpack_body=wants_msgpack(request))

