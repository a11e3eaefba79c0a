"""/openapi.json: the request and response schemas, generated from the pydantic models."""

from __future__ import annotations

from functools import lru_cache
from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

import pagegate
from pagegate.gateway import schemas
from pagegate.gateway.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    TokenizeRequest,
)

# path -> (method, summary, request model, response model, stream chunk model)
ROUTES: dict[str, tuple[str, str, type[BaseModel] | None, type[BaseModel], type[BaseModel] | None]] = {
    "/v1/completions": ("post", "Create a text completion", CompletionRequest, schemas.CompletionResponse,
                        schemas.CompletionResponse),
    "/v1/chat/completions": ("post", "Create a chat completion", ChatCompletionRequest,
                             schemas.ChatCompletionResponse, schemas.ChatCompletionChunk),
    "/v1/embeddings": ("post", "Embed texts or token ids (an encoder, or a decoder's hidden states)", EmbeddingRequest,
                       schemas.EmbeddingResponse, None),
    "/v1/models": ("get", "List the served models", None, schemas.ModelList, None),
    "/tokenize": ("post", "Tokenize a prompt or chat messages", TokenizeRequest, schemas.TokenizeResponse, None),
    "/detokenize": ("post", "Turn token ids back into text", DetokenizeRequest, schemas.DetokenizeResponse, None),
    "/tokenizer_info": ("get", "The served tokenizer's special tokens and chat template", None,
                        schemas.TokenizerInfo, None),
    "/health": ("get", "200 when serving, 503 while loading, stopping or when the engine died", None,
                schemas.HealthResponse, None),
    "/version": ("get", "The server version", None, schemas.VersionResponse, None),
}
REF = "#/components/schemas/{model}"
ERROR_STATUSES = {"400": "Invalid request", "401": "Missing or wrong API key", "404": "Unknown model",
                  "413": "Body too large", "429": "Too many waiting requests", "503": "Not serving"}
SSE_DESCRIPTION = (
    "With `stream: true`: server-sent events, each a line `data: <JSON>` and a blank line. The JSON is a chunk "
    "as `x-sse-data` describes (an ErrorResponse when generation fails after the 200 went out); the last event "
    "is `data: [DONE]`. The body as a whole is text, so no JSON schema covers it."
)


@lru_cache(maxsize=1)
def openapi_document() -> dict[str, Any]:
    models = {m for route in ROUTES.values() for m in route[2:] if m is not None} | {schemas.ErrorResponse}
    _, top = models_json_schema([(m, "validation") for m in sorted(models, key=lambda m: m.__name__)],
                                ref_template=REF)
    paths = {path: {route[0]: _operation(*route)} for path, route in ROUTES.items()}
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


def _operation(method: str, summary: str, request: type[BaseModel] | None, response: type[BaseModel],
               chunk: type[BaseModel] | None) -> dict[str, Any]:
    content: dict[str, Any] = {"application/json": {"schema": _ref(response)}}
    if chunk is not None:
        # OpenAPI 3.1 has no way to type the events (3.2's itemSchema does). A `type: string` here would be
        # right for the body, yet tools that read the schema as one event's (schemathesis does) would reject
        # every event; so the schema stays open and the chunk sits in an extension.
        content["text/event-stream"] = {
            "schema": {"description": SSE_DESCRIPTION},
            "x-sse-data": {"anyOf": [_ref(chunk), _ref(schemas.ErrorResponse)]},
        }
    operation: dict[str, Any] = {"summary": summary, "responses": {"200": {"description": "OK", "content": content}}}
    if request is not None:
        body = {"schema": _ref(request)}
        operation["requestBody"] = {"required": True,
                                    "content": {"application/json": body, "application/msgpack": body}}
        operation["responses"].update({code: {"description": text, "content": {
            "application/json": {"schema": _ref(schemas.ErrorResponse)}}} for code, text in ERROR_STATUSES.items()})
    return operation


def _ref(model: type[BaseModel]) -> dict[str, str]:
    return {"$ref": REF.format(model=model.__name__)}
