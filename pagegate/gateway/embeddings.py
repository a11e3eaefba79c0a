"""POST /v1/embeddings in OpenAI's shape: the request model, its inputs as token ids, and the response.

Each input is one engine request, pooled rather than generated (pagegate/engine/pooling.py, or the encoder of
`--task embed`); they run at once, batched by the scheduler with whatever else runs.

NOTE: `dimensions` is taken only when it is the model's own size. A shorter vector cut from these models is not a
good embedding (they were not trained Matryoshka-style), so a request for one is a 400, not a silent truncation.
"""

from __future__ import annotations

import base64
import struct
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from pagegate.engine.limits import check_embedding_length, check_token_ids
from pagegate.gateway.auth import request_key_identity
from pagegate.gateway.codec import render, wants_msgpack
from pagegate.gateway.errors import BadRequest
from pagegate.gateway.lanes import request_lane
from pagegate.gateway.preamble import read_and_acquire
from pagegate.gateway.prepare import ModelContext, off_loop
from pagegate.gateway.protocol import EmbeddingRequest, parse_request
from pagegate.gateway.request_id import request_id_of
from pagegate.gateway.routes_api import CLIENT_CLOSED, until_disconnect

MAX_INPUTS = 2048  # OpenAI's limit on the inputs of one request


@dataclass
class PreparedEmbeddings:
    request: EmbeddingRequest
    model: str
    inputs: list[list[int]]  # token ids, one list per input

    @property
    def num_tokens(self) -> int:
        return sum(len(ids) for ids in self.inputs)


def prepare_embeddings(body: Any, model: ModelContext, max_tokens: int | None = None) -> PreparedEmbeddings:
    """Validate and tokenize (text gets the tokenizer's special tokens, token ids are taken as they are); at most
    `max_tokens` over all the inputs (--max-embedding-tokens), counted as they are tokenized."""
    request = parse_request(EmbeddingRequest, body)
    name = model.resolve(request.model)
    items = _inputs(request.input)
    if len(items) > MAX_INPUTS:
        raise BadRequest(f"At most {MAX_INPUTS} inputs can be embedded in one request; this one has {len(items)}.",
                         param="input")
    inputs: list[list[int]] = []
    total = 0
    for item in items:
        if isinstance(item, str):
            if not item:
                raise BadRequest("An input to embed is an empty string.", param="input")
            model.check_text_fits(item, "input")
            token_ids = model.require_tokenizer("input").encode(item)
        else:
            check_token_ids(item, model.vocab_size, "input")
            token_ids = item
        check_embedding_length(len(token_ids), model.max_model_len)
        total += len(token_ids)
        check_total_tokens(total, len(inputs) + 1, len(items), max_tokens)
        inputs.append(token_ids)
    return PreparedEmbeddings(request, name, inputs)


def check_total_tokens(total: int, counted: int, num_inputs: int, limit: int | None) -> None:
    """OpenAI's cap on one request (300,000 tokens over all its inputs): one request's prefill must not hold the
    engine, nor its vectors the gateway, beyond a bound."""
    if limit is None or total <= limit:
        return
    so_far = "its inputs have" if counted == num_inputs else f"its first {counted} of {num_inputs} inputs have"
    raise BadRequest(f"This request asks to embed more tokens than one request may: {so_far} {total} tokens, "
                     f"more than this server's {limit} (--max-embedding-tokens). Split the inputs over several "
                     "requests.", param="input", code="max_tokens_per_request")


def _inputs(value: str | list[str] | list[int] | list[list[int]]) -> list[str | list[int]]:
    """One entry per input: a text or its token ids."""
    if isinstance(value, str):
        return [value]
    if all(isinstance(item, int) for item in value):
        return [[int(item) for item in value]]  # type: ignore[arg-type]
    return [item if isinstance(item, str) else list(item) for item in value]  # type: ignore[arg-type]


def check_dimensions(wanted: int | None, size: int) -> None:
    if wanted is not None and wanted != size:
        raise BadRequest(f"This model gives {size}-dimensional embeddings and does not support other sizes: leave "
                         f"dimensions out or set it to {size}.", param="dimensions", code="unsupported_value")


def embeddings_body(prepared: PreparedEmbeddings, vectors: list[bytes]) -> dict[str, Any]:
    """OpenAI's response: float lists, or base64 of the little-endian float32 bytes (what the SDK decodes)."""
    check_dimensions(prepared.request.dimensions, len(vectors[0]) // 4)
    as_base64 = prepared.request.encoding_format == "base64"
    data = [{"object": "embedding", "index": i,
             "embedding": base64.b64encode(v).decode() if as_base64 else list(struct.unpack(f"<{len(v) // 4}f", v))}
            for i, v in enumerate(vectors)]
    usage = {"prompt_tokens": prepared.num_tokens, "total_tokens": prepared.num_tokens}
    return {"object": "list", "data": data, "model": prepared.model, "usage": usage}


async def create_embeddings(request: Request) -> Response:
    host, body, acquired = await read_and_acquire(request)
    prepared = await off_loop(prepare_embeddings, body, acquired.model, host.config.max_embedding_tokens)
    embedding_size = acquired.slot.embedding_size
    if embedding_size is not None:  # known since the warm-up: a wrong size is refused before any work
        check_dimensions(prepared.request.dimensions, embedding_size)
    host.admission.admit_embeddings(acquired, len(prepared.inputs), prepared.request.priority)
    embedded = host.engine_requests.embed(acquired, prepared.inputs, f"embd-{request_id_of(request)}",
                                          prepared.request.priority, prepared.model,
                                          request_key_identity(request.scope), request_lane(request.scope))
    vectors = await until_disconnect(request, embedded)
    if vectors is None:
        return Response(status_code=CLIENT_CLOSED)
    return render(embeddings_body(prepared, vectors), msgpack_body=wants_msgpack(request))
