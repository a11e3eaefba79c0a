"""POST /v1/messages and POST /v1/messages/count_tokens: Anthropic's Messages API over the chat path, so Claude
clients and agent frameworks that speak it (the `anthropic` SDK, Claude Code) run against this server. Errors
come in Anthropic's shape (errors.speaks_anthropic)."""

from __future__ import annotations

import secrets

from starlette.requests import Request
from starlette.responses import Response

from pagegate.gateway.acquired import AcquiredModel
from pagegate.gateway.auth import request_key_identity
from pagegate.gateway.codec import EVENT_STREAM, render
from pagegate.gateway.errors import anthropic_error_body, client_params, to_api_error
from pagegate.gateway.gateway_state import host_of
from pagegate.gateway.lanes import request_lane
from pagegate.gateway.messages.cache import breakpoint_pins, breakpoints
from pagegate.gateway.messages.protocol import CountTokensRequest, MessagesRequest, parse_messages
from pagegate.gateway.messages.render import MessagesRenderer
from pagegate.gateway.preamble import read_and_acquire
from pagegate.gateway.prepare import ModelContext, PreparedRequest, off_loop, prepare_chat
from pagegate.gateway.routes_api import CLIENT_CLOSED, GenerationStreamResponse, until_disconnect
from pagegate.gateway.streaming import collect, stream_body


async def _prepare(
    request: Request, request_cls: type[MessagesRequest] = MessagesRequest, cache: bool = True,
) -> tuple[AcquiredModel, MessagesRequest, PreparedRequest]:
    _, body, acquired = await read_and_acquire(request, generation=True)
    parsed = await off_loop(parse_messages, request_cls, body)
    prepared = await off_loop(_prepare_chat, parsed, acquired.model, cache)
    prepared.tenant = request_key_identity(request.scope)
    prepared.lane = request_lane(request.scope)
    return acquired, parsed, prepared


def _prepare_chat(parsed: MessagesRequest, model: ModelContext, cache: bool) -> PreparedRequest:
    """The chat request it is, prepared, with its cache breakpoints' pins when `cache`; a 400 names the field of
    the Messages request, not of the chat one."""
    parsed.check_conversation()
    marks = breakpoints(parsed)
    with client_params(parsed.client_param):
        prepared = prepare_chat(parsed.chat_body(), model)
    if cache and marks:
        prepared.cache_pins = breakpoint_pins(parsed, marks, prepared.prompts[0].token_ids, model)
    return prepared


async def create_message(request: Request) -> Response:
    host = host_of(request)
    acquired, parsed, prepared = await _prepare(request)
    host.admission.admit(acquired, prepared)
    renderer = MessagesRenderer(prepared, acquired.model.tokenizer, "msg_" + secrets.token_hex(12),
                                stop_sequences=parsed.stop_sequences or [])
    merger, _ = host.engine_requests.generate(acquired, prepared, renderer.request_id)
    if prepared.stream:
        body = stream_body(merger, renderer, lambda exc: anthropic_error_body(to_api_error(exc)), False, host.engine_requests.stream_pace)
        return GenerationStreamResponse(body, merger, headers={"Cache-Control": "no-cache"}, media_type=EVENT_STREAM)
    finals = await until_disconnect(request, collect(merger))
    if finals is None:
        return Response(status_code=CLIENT_CLOSED)
    return render(renderer.response(finals), msgpack_body=False)


async def count_tokens(request: Request) -> Response:
    """The prompt's token count as /v1/messages would render it (nothing runs)."""
    _, _, prepared = await _prepare(request, CountTokensRequest, cache=False)
    return render({"input_tokens": len(prepared.prompts[0].token_ids)}, msgpack_body=False)
