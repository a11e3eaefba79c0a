"""POST /v1/responses, GET and DELETE /v1/responses/{id}, GET /v1/responses/{id}/input_items.

A stored response (`store`, the default) keeps its conversation; `previous_response_id` continues it. The
engine pins the conversation's pages under the response's id until the store lets the response go (or a later
turn, whose own pin covers the same pages, continues it), so the next turn prefills only what is new.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from pagegate.gateway.auth import request_key_identity
from pagegate.gateway.codec import EVENT_STREAM, MSGPACK, read_body, render, wants_msgpack
from pagegate.gateway.engine_host import EngineHost
from pagegate.gateway.errors import BadRequest, NotFound, to_api_error
from pagegate.gateway.prepare import off_loop, prepare_chat
from pagegate.gateway.protocol import parse_request
from pagegate.gateway.responses.conversation import (
    answer_message,
    call_ids,
    chat_body,
    describe,
    input_items,
    input_messages,
)
from pagegate.gateway.responses.protocol import ResponsesRequest
from pagegate.gateway.responses.render import ResponsesRenderer, item_id
from pagegate.gateway.responses.store import ResponseStore, StoredResponse
from pagegate.gateway.routes_api import CLIENT_CLOSED, GenerationStreamResponse, until_disconnect
from pagegate.gateway.streaming import collect, stream_body


async def create_response(request: Request) -> Response:
    host: EngineHost = request.app.state.host
    store: ResponseStore = request.app.state.responses
    _, model = host.require_engine()
    body = await read_body(request, host.config.max_request_bytes)
    tenant = request_key_identity(request.scope)
    parsed = parse_request(ResponsesRequest, body)
    previous = _previous(store, parsed, tenant)
    history = previous.conversation if previous is not None else []
    turn = input_messages(parsed, call_ids(history))
    prepared = await off_loop(prepare_chat, chat_body(parsed, history + turn), model)
    prepared.tenant = tenant
    response_id = "resp_" + secrets.token_hex(16)
    if parsed.store:
        prepared.pin = host.pin_for(response_id)
    host.admit(prepared)
    renderer = ResponsesRenderer(prepared, model.tokenizer, response_id, base=describe(parsed))
    merger, _ = host.generate(prepared, response_id)
    items = _with_ids((previous.input_items + previous.response["output"]) if previous else []) + _with_ids(
        input_items(parsed))

    def keep() -> None:
        """Store the finished response; its continuation's pin now holds what the previous one pinned."""
        if renderer.final is None or not parsed.store:
            return
        answer = answer_message(renderer.final["output"])
        conversation = history + turn + ([answer] if answer else [])
        store.put(StoredResponse(response_id, tenant, time.time(), conversation, items, renderer.final))
        if previous is not None:
            host.unpin(previous.id)

    if prepared.stream:
        async def events() -> AsyncIterator[bytes]:
            async for chunk in stream_body(merger, renderer, lambda exc: to_api_error(exc).body(),
                                           wants_msgpack(request), host.stream_pace):
                yield chunk
            keep()

        return GenerationStreamResponse(events(), merger, headers={"Cache-Control": "no-cache"},
                                        media_type=MSGPACK if wants_msgpack(request) else EVENT_STREAM)
    finals = await until_disconnect(request, collect(merger))
    if finals is None:
        return Response(status_code=CLIENT_CLOSED)
    result = renderer.response(finals)
    keep()
    return render(result, msgpack_body=wants_msgpack(request))


def _previous(store: ResponseStore, parsed: ResponsesRequest, tenant: str | None) -> StoredResponse | None:
    if parsed.previous_response_id is None:
        return None
    previous = store.get(parsed.previous_response_id, tenant)
    if previous is None:
        raise NotFound(f"Previous response with id '{parsed.previous_response_id}' not found.",
                       param="previous_response_id", code="previous_response_not_found")
    return previous


def _with_ids(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    prefixes = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}
    return [item if item.get("id") else {"id": item_id(prefixes.get(item["type"], "item")), **item}
            for item in items]


def _stored(request: Request) -> StoredResponse:
    store: ResponseStore = request.app.state.responses
    response_id = request.path_params["response_id"]
    record = store.get(response_id, request_key_identity(request.scope))
    if record is None:
        raise NotFound(f"No response found with id '{response_id}'.", param="response_id")
    return record


async def get_response(request: Request) -> Response:
    return render(_stored(request).response, msgpack_body=wants_msgpack(request))


async def delete_response(request: Request) -> Response:
    record = _stored(request)
    request.app.state.responses.delete(record.id, record.tenant)
    return render({"id": record.id, "object": "response.deleted", "deleted": True},
                  msgpack_body=wants_msgpack(request))


async def list_input_items(request: Request) -> Response:
    items = list(_stored(request).input_items)
    if request.query_params.get("order", "desc") == "desc":
        items.reverse()
    after = request.query_params.get("after")
    if after is not None:
        at = next((i for i, item in enumerate(items) if item["id"] == after), None)
        items = items[at + 1:] if at is not None else []
    limit = _limit(request.query_params.get("limit"))
    page = items[:limit]
    return render({"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                   "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit},
                  msgpack_body=wants_msgpack(request))


def _limit(text: str | None) -> int:
    if text is None:
        return 20
    if not text.isdigit() or not 1 <= int(text) <= 100:
        raise BadRequest("limit must be an integer from 1 to 100.", param="limit")
    return int(text)
