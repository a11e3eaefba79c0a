"""Several models by hand: POST /models/load and /models/unload (llama.cpp's router names, body {"model": NAME}),
POST /sleep, POST /wake_up and GET /is_sleeping (vLLM's, the model as `?model=NAME` or in the body). Behind the API
keys, as /v1 is. A one-model server answers them with a 400 that says how to serve several."""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from pagegate.gateway.codec import read_body, render
from pagegate.gateway.engine_host import EngineHost, requested_model
from pagegate.gateway.errors import BadRequest
from pagegate.gateway.model_slots import SLEEPING, ModelSlot


async def load(request: Request) -> Response:
    host = _several(request)
    slot = await host.load_model(await _named(request, required=True))
    return _answer(slot)


async def unload(request: Request) -> Response:
    host = _several(request)
    slot = await host.unload_model(await _named(request, required=True))
    return _answer(slot)


async def sleep(request: Request) -> Response:
    host = _several(request)
    slot = await host.sleep_model(await _named(request))
    return _answer(slot)


async def wake_up(request: Request) -> Response:
    host = _several(request)
    slot = await host.load_model(await _named(request))  # wakes a sleeping model, loads an unloaded one
    return _answer(slot)


async def is_sleeping(request: Request) -> Response:
    host = _several(request)
    slot = host.slot_for(request.query_params.get("model"))
    return render({"model": slot.name, "is_sleeping": slot.state == SLEEPING}, msgpack_body=False)


def _several(request: Request) -> EngineHost:
    host: EngineHost = request.app.state.host
    if not host.several:
        raise BadRequest("This server serves one model: loading, unloading and sleeping need several (--model "
                         "repeated, or --models-dir).")
    return host


async def _named(request: Request, required: bool = False) -> str | None:
    """The model named by `?model=` or the JSON body's `model` (None: the default model)."""
    name = request.query_params.get("model")
    if name is None and request.headers.get("content-length", "0") != "0":
        body: Any = await read_body(request, request.app.state.host.config.max_request_bytes)
        name = requested_model(body)
    if name is None and required:
        raise BadRequest("Name the model: {\"model\": NAME}.", param="model")
    return name


def _answer(slot: ModelSlot) -> Response:
    return render({"success": True, "model": slot.name, **slot.card_state()}, msgpack_body=False)
