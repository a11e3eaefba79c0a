"""/openapi.json: the request and response schemas, generated from the pydantic models."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

import pagegate
from pagegate.gateway import schemas
from pagegate.gateway.messages.protocol import CountTokensRequest
from pagegate.gateway.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    TokenizeRequest,
)

REF = "#/components/schemas/{model}"
UNAUTHORIZED = {"401": "Missing or wrong API key"}
TOO_LARGE = {"413": "Body too large"}
API_ERRORS = {"400": "Invalid request", **UNAUTHORIZED, "404": "Unknown model", **TOO_LARGE,
              "429": "Too many waiting requests", "503": "Not serving"}
NO_SUCH_MODEL = {"404": "No model of that name (`model_not_found`; the message names the served ones)"}
NOT_LOADED_OR_BUSY = {"409": "The model is serving requests (`model_busy`: retry once they are done), or is not loaded "
                             "(`model_not_loaded`: its load failed, or it was never loaded)"}
ADMIN_ONLY = {"403": "The key is not an admin key (`admin_key_required`): managing the server needs --admin-api-key"}
LOAD_FAILED = {"503": "The server is not serving, or the model could not be loaded or woken (the message says why; "
                      "Retry-After)"}
NAME_NEEDED = "Bad parameters: no model named, a body that is neither JSON nor msgpack, or a one-model server"
BAD_PARAMETERS = "Bad parameters (a body that is neither JSON nor msgpack, for one)"
LORA_OFF = "run-time LoRA off (it needs --enable-lora --allow-runtime-lora)"
SSE_DESCRIPTION = (
    "With `stream: true`: server-sent events, each a line `data: <JSON>` and a blank line. The JSON is a chunk "
    "as `x-sse-data` describes (an ErrorResponse when generation fails after the 200 went out); the last event "
    "is `data: [DONE]`. The body as a whole is text, so no JSON schema covers it."
)
MODEL_QUERY = {"name": "model", "in": "query", "required": False, "schema": {"type": "string"},
               "description": "Which model (a route with a body also reads the body's `model`)."}


@dataclass(frozen=True)
class Operation:
    """One route of the document: what it reads, what it answers, and every error status it really answers."""

    method: str
    summary: str
    response: type[BaseModel] | None  # None: a text/plain answer
    request: type[BaseModel] | None = None
    chunk: type[BaseModel] | None = None  # one event of the stream `stream: true` asks for
    errors: Mapping[str, str] = field(default_factory=dict)  # status -> when
    body_required: bool = True
    model_query: bool = False  # the model may be named as `?model=NAME`
    error: type[BaseModel] = schemas.ErrorResponse  # the shape of every error it answers


ROUTES: dict[str, Operation] = {
    "/v1/completions": Operation("post", "Create a text completion", schemas.CompletionResponse, CompletionRequest,
                                 schemas.CompletionResponse, API_ERRORS),
    "/v1/chat/completions": Operation("post", "Create a chat completion", schemas.ChatCompletionResponse,
                                      ChatCompletionRequest, schemas.ChatCompletionChunk, API_ERRORS),
    "/v1/embeddings": Operation("post", "Embed texts or token ids (an encoder, or a decoder's hidden states)",
                                schemas.EmbeddingResponse, EmbeddingRequest, errors=API_ERRORS),
    "/v1/models": Operation("get", "List the served models", schemas.ModelList,
                            errors={**UNAUTHORIZED, "503": "Not serving"}),
    "/v1/models/{model}": Operation("get", "One served model (a LoRA adapter's card names its base as `parent`)",
                                    schemas.ModelCard, errors={**UNAUTHORIZED, **NO_SUCH_MODEL,
                                                               "503": "Not serving"}),
    "/v1/messages/count_tokens": Operation(
        "post", "Count the tokens of a Messages API request's prompt (Anthropic's API; its error shape)",
        schemas.MessageTokenCount, CountTokensRequest, errors={k: v for k, v in API_ERRORS.items() if k != "429"},
        error=schemas.AnthropicErrorResponse),
    "/tokenize": Operation("post", "Tokenize a prompt or chat messages", schemas.TokenizeResponse, TokenizeRequest,
                           errors=API_ERRORS),
    "/detokenize": Operation("post", "Turn token ids back into text", schemas.DetokenizeResponse, DetokenizeRequest,
                             errors=API_ERRORS),
    "/tokenizer_info": Operation("get", "The served tokenizer's special tokens and chat template",
                                 schemas.TokenizerInfo, errors={"400": "The model has no tokenizer", **UNAUTHORIZED,
                                                                **NO_SUCH_MODEL, **LOAD_FAILED}, model_query=True),
    "/health": Operation("get", "200 when serving, 503 while loading, stopping or when the engine died",
                         schemas.HealthResponse),
    "/version": Operation("get", "The server version", schemas.VersionResponse),
    # models by hand: load and unload need several models (llama.cpp's router names); the sleep routes (vLLM's) do not
    "/models/load": Operation(
        "post", "Load a model now (or wake it); it waits until the model serves", schemas.ModelStateResponse,
        schemas.ModelNameBody, errors={"400": NAME_NEEDED, **UNAUTHORIZED, **ADMIN_ONLY, **NO_SUCH_MODEL,
                                       **TOO_LARGE, **LOAD_FAILED}, body_required=False, model_query=True),
    "/models/unload": Operation(
        "post", "Unload a model: its core ends, its pages and weights are freed", schemas.ModelStateResponse,
        schemas.ModelNameBody, errors={"400": NAME_NEEDED, **UNAUTHORIZED, **ADMIN_ONLY, **NO_SUCH_MODEL,
                                       **NOT_LOADED_OR_BUSY, **TOO_LARGE}, body_required=False, model_query=True),
    "/sleep": Operation(
        "post", "Put a model to sleep (none named: the default one): its KV pages are freed, its weights kept",
        schemas.ModelStateResponse, schemas.DefaultModelNameBody,
        errors={"400": BAD_PARAMETERS, **UNAUTHORIZED, **ADMIN_ONLY, **NO_SUCH_MODEL, **NOT_LOADED_OR_BUSY,
                **TOO_LARGE, "503": "Not serving"}, body_required=False, model_query=True),
    "/wake_up": Operation(
        "post", "Wake a sleeping model (none named: the default one), or load an unloaded one",
        schemas.ModelStateResponse, schemas.DefaultModelNameBody,
        errors={"400": BAD_PARAMETERS, **UNAUTHORIZED, **ADMIN_ONLY, **NO_SUCH_MODEL, **TOO_LARGE, **LOAD_FAILED},
        body_required=False, model_query=True),
    "/is_sleeping": Operation("get", "Whether a model (none named: the default one) sleeps",
                              schemas.IsSleepingResponse, errors={**UNAUTHORIZED, **NO_SUCH_MODEL,
                                                                  "503": "Not serving"}, model_query=True),
    # LoRA adapters at run time (vLLM's names); both answer a line of text
    "/v1/load_lora_adapter": Operation(
        "post", "Serve a PEFT LoRA adapter under a name", None, schemas.LoadLoRAAdapterBody,
        errors={"400": f"Bad parameters, the name taken already, an adapter that does not fit, or {LORA_OFF}",
                **UNAUTHORIZED, **ADMIN_ONLY, **TOO_LARGE, "503": "Not serving"}),
    "/v1/unload_lora_adapter": Operation(
        "post", "Stop serving a LoRA adapter", None, schemas.UnloadLoRAAdapterBody,
        errors={"400": f"Bad parameters, or {LORA_OFF}", **UNAUTHORIZED, **ADMIN_ONLY,
                "404": "No adapter of that name (`model_not_found`)",
                "409": "Requests use the adapter (`adapter_busy`): retry once they are done", **TOO_LARGE,
                "503": "Not serving"}),
}


@lru_cache(maxsize=1)
def openapi_document() -> dict[str, Any]:
    models = {m for op in ROUTES.values() for m in (op.response, op.request, op.chunk, op.error) if m is not None}
    _, top = models_json_schema([(m, "validation") for m in sorted(models, key=lambda m: m.__name__)],
                                ref_template=REF)
    paths = {path: {op.method: _operation(path, op)} for path, op in ROUTES.items()}
    paths["/health"]["get"]["responses"]["503"] = {"description": "Not serving", "content": {
        "application/json": {"schema": _ref(schemas.HealthResponse)}}}
    paths["/metrics"] = {"get": {"summary": "Prometheus text of the engine's metrics",
                                 "responses": {"200": {"description": "text/plain; version=0.0.4"}}}}
    return {
        "openapi": "3.1.0",
        "info": {"title": "pagegate", "version": pagegate.__version__,
                 "description": "OpenAI-compatible API. Every /v1 POST also accepts and returns msgpack "
                                "(Content-Type / Accept: application/msgpack), see docs/msgpack.md."},
        "paths": paths,
        "components": {"schemas": top.get("$defs", {}),
                       "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
    }


def _operation(path: str, op: Operation) -> dict[str, Any]:
    operation: dict[str, Any] = {"summary": op.summary, "responses": {"200": {"description": "OK",
                                                                              "content": _answer(op)}}}
    parameters = _path_parameters(path) + ([MODEL_QUERY] if op.model_query else [])
    if parameters:
        operation["parameters"] = parameters
    if op.request is not None:
        body = {"schema": _ref(op.request)}
        operation["requestBody"] = {"required": op.body_required,
                                    "content": {"application/json": body, "application/msgpack": body}}
    operation["responses"].update({code: {"description": text, "content": {
        "application/json": {"schema": _ref(op.error)}}} for code, text in op.errors.items()})
    return operation


def _answer(op: Operation) -> dict[str, Any]:
    """The 200's content: JSON (and the event stream where the route streams), or a line of text."""
    if op.response is None:
        return {"text/plain": {"schema": {"type": "string"}}}
    content: dict[str, Any] = {"application/json": {"schema": _ref(op.response)}}
    if op.chunk is not None:
        # OpenAPI 3.1 has no way to type the events (3.2's itemSchema does). A `type: string` here would be
        # right for the body, yet tools that read the schema as one event's (schemathesis does) would reject
        # every event; so the schema stays open and the chunk sits in an extension.
        content["text/event-stream"] = {
            "schema": {"description": SSE_DESCRIPTION},
            "x-sse-data": {"anyOf": [_ref(op.chunk), _ref(schemas.ErrorResponse)]},
        }
    return content


def _path_parameters(path: str) -> list[dict[str, Any]]:
    return [{"name": name, "in": "path", "required": True, "schema": {"type": "string", "minLength": 1}}
            for name in re.findall(r"{(\w+)}", path)]


def _ref(model: type[BaseModel]) -> dict[str, str]:
    return {"$ref": REF.format(model=model.__name__)}


async def openapi(request: Request) -> Response:
    """GET /openapi.json."""
    return JSONResponse(openapi_document())
