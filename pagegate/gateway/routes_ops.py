"""Operational routes: /health, /metrics, /version, /tokenize, /detokenize, /tokenizer_info, /openapi.json."""

from __future__ import annotations

import asyncio
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

import pagegate
from pagegate.engine.limits import check_token_ids
from pagegate.engine.serving.replicas import merge_metrics
from pagegate.gateway.codec import render, wants_msgpack
from pagegate.gateway.engine_host import EngineHost
from pagegate.gateway.gateway_state import gateway_state, host_of
from pagegate.gateway.preamble import read_and_acquire
from pagegate.gateway.prepare import ModelContext, chat_prompt, off_loop
from pagegate.gateway.protocol import DetokenizeRequest, TokenizeRequest, parse_request


async def health(request: Request) -> Response:
    status, report = host_of(request).health()
    return JSONResponse(report, status_code=status)


async def metrics(request: Request) -> Response:
    """The engine's registry, then the gateway's live page counts and admission counters."""
    state = gateway_state(request)
    host, registry = state["host"], state["gateway_registry"]
    if host.several:
        return Response(await models_metrics(host) + generate_latest(registry), media_type=CONTENT_TYPE_LATEST)
    if host.engine is None:
        return Response(f"# engine {host.state}\n", status_code=503, media_type=CONTENT_TYPE_LATEST)
    try:
        engine_text = await host.engine.metrics_text()
    except Exception as exc:  # the core is gone: /health says why
        return Response(f"# engine unavailable: {exc}\n", status_code=503, media_type=CONTENT_TYPE_LATEST)
    text = engine_text + generate_latest(registry)
    return Response(text, media_type=CONTENT_TYPE_LATEST)


async def models_metrics(host: EngineHost) -> bytes:
    """Several models: each loaded one's engine metrics, every sample labelled `model_name` (as vLLM's are); a
    model whose core does not answer is left out (/health says why)."""
    loaded = [slot for slot in host.slots if slot.engine is not None]
    texts = await asyncio.gather(*(slot.engine.metrics_text() for slot in loaded if slot.engine is not None),
                                 return_exceptions=True)
    answered = [(slot.name, text) for slot, text in zip(loaded, texts, strict=True) if isinstance(text, bytes)]
    if not answered:
        return b""
    return merge_metrics([text for _, text in answered], "model_name", [name for name, _ in answered])


async def version(request: Request) -> Response:
    return JSONResponse({"version": pagegate.__version__})


async def tokenize(request: Request) -> Response:
    _, body, acquired = await read_and_acquire(request)
    token_ids = await off_loop(_tokenize, body, acquired.model)
    body = {"count": len(token_ids), "max_model_len": acquired.model.max_model_len, "tokens": token_ids}
    return render(body, msgpack_body=wants_msgpack(request))


def _tokenize(body: Any, model: ModelContext) -> list[int]:
    req = parse_request(TokenizeRequest, body)
    model.resolve(req.model)
    if req.messages is not None:
        return chat_prompt(req.messages, model, req.add_generation_prompt).token_ids
    tokenizer = model.require_tokenizer("prompt")
    model.check_text_fits(req.prompt or "", "prompt")
    return tokenizer.encode(req.prompt or "", add_special_tokens=req.add_special_tokens)


async def detokenize(request: Request) -> Response:
    _, body, acquired = await read_and_acquire(request)
    text = await off_loop(_detokenize, body, acquired.model)
    return render({"prompt": text}, msgpack_body=wants_msgpack(request))


def _detokenize(body: Any, model: ModelContext) -> str:
    req = parse_request(DetokenizeRequest, body)
    model.resolve(req.model)
    check_token_ids(req.tokens, model.vocab_size, "tokens")
    return model.require_tokenizer("tokens").decode(req.tokens)


async def tokenizer_info(request: Request) -> Response:
    """vLLM's /tokenizer_info: what a client needs to use the served tokenizer remotely (lm-eval's
    `tokenizer_backend=remote` reads the special tokens and the chat template; /tokenize does the rest)."""
    acquired = await host_of(request).acquire(request.query_params.get("model"))  # ?model=NAME with several models
    model = acquired.model
    tokenizer = model.require_tokenizer("model")
    body = {"tokenizer_class": "PreTrainedTokenizerFast", **tokenizer.special_tokens,
            "eos_token_ids": tokenizer.eos_token_ids, "chat_template": tokenizer.chat_template,
            "model_max_length": model.max_model_len, "vocab_size": tokenizer.vocab_size}
    return render(body, msgpack_body=wants_msgpack(request))
