"""POST /v1/responses, GET and DELETE /v1/responses/{id}, GET /v1/responses/{id}/input_items.

A stored response (`store`, the default) keeps its conversation; `previous_response_id` continues it. The
engine pins the conversation's pages under the response's id until the store lets the response go (or a later
turn, whose own pin covers the same pages, continues it), so the next turn prefills only what is new.
"""

from __future__ import annotations

import itertools
import secrets
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from pagegate.gateway.auth import request_key_identity
from pagegate.gateway.codec import EVENT_STREAM, MSGPACK, render, wants_msgpack
from pagegate.gateway.errors import BadRequest, NotFound, client_params, to_api_error, without_tags
from pagegate.gateway.gateway_state import gateway_state
from pagegate.gateway.lanes import request_lane
from pagegate.gateway.preamble import read_and_acquire
from pagegate.gateway.prepare import ModelContext, PreparedRequest, off_loop, prepare_chat
from pagegate.gateway.protocol import parse_request
from pagegate.gateway.responses.conversation import (
    Message,
    answer_message,
    call_ids,
    chat_body,
    client_param,
    describe,
    input_items,
    input_messages,
)
from pagegate.gateway.responses.protocol import ITEM_TYPES, ResponsesRequest
from pagegate.gateway.responses.render import ResponsesRenderer, item_id
from pagegate.gateway.responses.store import Item, ResponseStore, StoredResponse
from pagegate.gateway.routes_api import CLIENT_CLOSED, GenerationStreamResponse, until_disconnect
from pagegate.gateway.streaming import collect, stream_body


@dataclass
class NewTurn:
    """What one request adds to its conversation, prepared off the event loop."""

    history: list[Message]  # the conversation so far, as chat messages
    messages: list[Message]  # this turn's input as chat messages
    items: list[dict[str, Any]]  # this turn's input items with ids (stored: GET .../input_items)
    prepared: PreparedRequest


def prepare_turn(parsed: ResponsesRequest, previous: StoredResponse | None, model: ModelContext) -> NewTurn:
    """The turn as a chat request over the whole conversation; a 400 names the Responses request's field."""
    history = previous.conversation if previous is not None else []
    messages = input_messages(parsed, call_ids(history))
    with client_params(client_param):
        prepared = prepare_chat(chat_body(parsed, history + messages), model)
    items = _with_ids(input_items(parsed)) if parsed.store else []
    return NewTurn(history, messages, items, prepared)


async def create_response(request: Request) -> Response:
    store = gateway_state(request)["responses"]
    host, body, acquired = await read_and_acquire(request, generation=True)
    tenant = request_key_identity(request.scope)
    check_input_count(body, host.config.responses_max_input_items)
    parsed = await off_loop(parse_responses, body)
    previous = _previous(store, parsed, tenant)
    turn = await off_loop(prepare_turn, parsed, previous, acquired.model)
    prepared = turn.prepared
    prepared.tenant = tenant
    prepared.lane = request_lane(request.scope)
    response_id = "resp_" + secrets.token_hex(16)
    if parsed.store:
        prepared.pin = host.engine_requests.pin_for(response_id)
    host.admission.admit(acquired, prepared)
    renderer = ResponsesRenderer(prepared, acquired.model.tokenizer, response_id, base=describe(parsed))
    merger, _ = host.engine_requests.generate(acquired, prepared, response_id)

    async def keep() -> None:
        """Store the finished response (its own turn only: the rest is its previous response's); its
        continuation's pin now holds what the previous one pinned."""
        if renderer.final is None or not parsed.store:
            return
        answer = answer_message(renderer.final["output"])
        messages = turn.messages + ([answer] if answer else [])
        await store.add(response_id, tenant, previous, messages, turn.items, renderer.final)
        if previous is not None:
            host.engine_requests.unpin(previous.id)

    if prepared.stream:
        async def events() -> AsyncIterator[bytes]:
            async for chunk in stream_body(merger, renderer, lambda exc: to_api_error(exc).body(),
                                           wants_msgpack(request), host.engine_requests.stream_pace):
                yield chunk
            await keep()

        return GenerationStreamResponse(events(), merger, headers={"Cache-Control": "no-cache"},
                                        media_type=MSGPACK if wants_msgpack(request) else EVENT_STREAM)
    finals = await until_disconnect(request, collect(merger))
    if finals is None:
        return Response(status_code=CLIENT_CLOSED)
    result = renderer.response(finals)
    await keep()
    return render(result, msgpack_body=wants_msgpack(request))


def parse_responses(body: Any) -> ResponsesRequest:
    """The request, or a 400 naming the field as sent (`input.0.role`, no item type in it)."""
    with client_params(lambda param: without_tags(param, "input", ITEM_TYPES)):
        return parse_request(ResponsesRequest, body)


def check_input_count(body: Any, limit: int) -> None:
    """OpenAI's bound on the items of one request's input (--responses-max-input-items), checked before they
    are parsed."""
    items = body.get("input") if isinstance(body, dict) else None
    if isinstance(items, list) and len(items) > limit:
        raise BadRequest(f"Invalid 'input': array too long. Expected an array with maximum length {limit}, but got "
                         f"an array with length {len(items)} instead.", param="input", code="array_above_max_length")


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
    store = gateway_state(request)["responses"]
    response_id = request.path_params["response_id"]
    record = store.get(response_id, request_key_identity(request.scope))
    if record is None:
        raise NotFound(f"No response found with id '{response_id}'.", param="response_id")
    return record


async def get_response(request: Request) -> Response:
    return render(_stored(request).response_object(), msgpack_body=wants_msgpack(request))


async def delete_response(request: Request) -> Response:
    record = _stored(request)
    gateway_state(request)["responses"].delete(record.id, record.tenant)
    return render({"id": record.id, "object": "response.deleted", "deleted": True},
                  msgpack_body=wants_msgpack(request))


async def list_input_items(request: Request) -> Response:
    record = _stored(request)
    after = request.query_params.get("after")
    limit = _limit(request.query_params.get("limit"))
    newest_first = request.query_params.get("order", "desc") == "desc"
    page, more = await off_loop(_page, record, newest_first, after, limit)  # a long conversation: off the loop
    return render({"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                   "last_id": page[-1]["id"] if page else None, "has_more": more},
                  msgpack_body=wants_msgpack(request))


def _page(record: StoredResponse, newest_first: bool, after: str | None, limit: int) -> tuple[list[Item], bool]:
    """Up to `limit` input items after the one with id `after` (from the start without), and whether more follow."""
    items = record.input_items(newest_first)
    if after is not None:
        for item in items:
            if item["id"] == after:
                break
    page = list(itertools.islice(items, limit + 1))
    return page[:limit], len(page) > limit


def _limit(text: str | None) -> int:
    if text is None:
        return 20
    if not text.isdigit() or not 1 <= int(text) <= 100:
        raise BadRequest("limit must be an integer from 1 to 100.", param="limit")
    return int(text)
