"""Models by hand. POST /sleep, POST /wake_up and GET /is_sleeping (vLLM's; the model as `?model=NAME` or in the
body, optional: the default model) on any server: a sleeping model's KV pages are freed and its weights kept, and its
next request wakes it. POST /models/load and /models/unload (llama.cpp's router names, body {"model": NAME}) need
several models: a one-model server answers them with a 400 that says how to serve several. Behind the API keys, as
/v1 is; every route here but GET /is_sleeping needs an admin key (pagegate.gateway.auth's NOTE).

LoRA adapters at run time (vLLM's routes, behind --allow-runtime-lora as vLLM gates them): POST
/v1/load_lora_adapter {"lora_name", "lora_path"} and /v1/unload_lora_adapter {"lora_name"}."""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response

from pagegate.engine.errors import InvalidParamError
from pagegate.gateway.codec import read_body, render
from pagegate.gateway.engine_host import EngineHost
from pagegate.gateway.errors import APIError, BadRequest, NotFound
from pagegate.gateway.gateway_state import host_of
from pagegate.gateway.model_lifecycle import ModelBusy
from pagegate.gateway.model_slots import SLEEPING, ModelSlot


async def load(request: Request) -> Response:
    host = _several(request)
    name = await _named(request, required=True)
    host.check_serving()
    slot = host.slot_for(name)
    await host.lifecycle.load_model(slot)  # a model whose load failed is tried again at once
    return _answer(slot)


async def unload(request: Request) -> Response:
    host = _several(request)
    slot = host.slot_for(await _named(request, required=True))
    await host.lifecycle.unload_model(slot)
    return _answer(slot)


async def sleep(request: Request) -> Response:
    host = host_of(request)
    slot = _slot(host, await _named(request))
    await host.lifecycle.sleep_model(slot)
    return _answer(slot)


async def wake_up(request: Request) -> Response:
    host = host_of(request)
    slot = _slot(host, await _named(request))
    host.check_serving()
    await host.lifecycle.load_model(slot)  # wakes a sleeping model, loads an unloaded one
    return _answer(slot)


async def is_sleeping(request: Request) -> Response:
    host = host_of(request)
    slot = _slot(host, request.query_params.get("model"))
    return render({"model": slot.name, "is_sleeping": slot.state == SLEEPING}, msgpack_body=False)


async def load_lora_adapter(request: Request) -> Response:
    host, body = await _lora_request(request)
    name, path = _text(body, "lora_name"), _text(body, "lora_path")
    engine, model = host.require_engine()
    if name in host.adapters or name in model.names:
        raise BadRequest(f"The name `{name}` is taken: a LoRA adapter or the model has it.", param="lora_name")
    try:
        await engine.load_lora_adapter(name, path)
    except InvalidParamError as error:
        raise BadRequest(f"The LoRA adapter `{name}` cannot be loaded: {error}", param="lora_path") from None
    host.adapters[name] = path
    return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")


async def unload_lora_adapter(request: Request) -> Response:
    host, body = await _lora_request(request)
    name = _text(body, "lora_name")
    if name not in host.adapters:
        raise NotFound(f"The LoRA adapter `{name}` does not exist.", param="lora_name", code="model_not_found")
    engine, _ = host.require_engine()
    try:
        await engine.unload_lora_adapter(name)
    except InvalidParamError as error:
        raise _lora_error(error) from None
    del host.adapters[name]
    return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")


async def _lora_request(request: Request) -> tuple[EngineHost, dict[str, Any]]:
    host = host_of(request)
    if not host.config.allow_runtime_lora:
        raise BadRequest("Loading and unloading LoRA adapters at run time needs --enable-lora --allow-runtime-lora.")
    body: Any = await read_body(request, host.config.max_request_bytes)
    if not isinstance(body, dict):
        raise BadRequest("The body must be a JSON object.")
    return host, body


def _text(body: dict[str, Any], key: str) -> str:
    value = body.get(key)
    if not isinstance(value, str) or not value:
        raise BadRequest(f"`{key}` must be a non-empty string.", param=key)
    return value


def _lora_error(error: InvalidParamError) -> APIError:
    """The core's refusal to unload: 404 for an adapter it does not have, 409 while requests use it."""
    if error.code == "model_not_found":
        return NotFound(str(error), param="lora_name", code="model_not_found")
    return ModelBusy(f"{error}: retry once its requests are done.", param="lora_name", code="adapter_busy")


def _several(request: Request) -> EngineHost:
    host = host_of(request)
    if not host.several:
        raise BadRequest("This server serves one model: loading and unloading need several (--model repeated, or "
                         "--models-dir).")
    return host


def _slot(host: EngineHost, name: str | None) -> ModelSlot:
    """The model named (None: the default); a one-model server checks the name against its own (a 404 otherwise)."""
    if name is not None and not host.several:
        host.listed_model().resolve(name)
    return host.slot_for(name)


async def _named(request: Request, required: bool = False) -> str | None:
    """The model named by `?model=` or the JSON body's `model` (None: the default model); a 400 for a `model`
    that is not a name or that names another model than the query."""
    name = request.query_params.get("model")
    if request.headers.get("content-length", "0") != "0":
        body: Any = await read_body(request, host_of(request).config.max_request_bytes)
        named = body.get("model") if isinstance(body, dict) else None
        if named is not None and not isinstance(named, str):
            raise BadRequest("`model` must be a model's name (a string).", param="model")
        if named is not None and name is not None and named != name:
            raise BadRequest(f"?model={name} and the body's model {named!r} differ: name one model.", param="model")
        name = name if name is not None else named
    if name is None and required:
        raise BadRequest("Name the model: {\"model\": NAME}.", param="model")
    return name


def _answer(slot: ModelSlot) -> Response:
    return render({"success": True, "model": slot.name, **slot.card_state()}, msgpack_body=False)
