"""The Starlette application: routes, error handlers, auth and CORS, the engine's lifespan and the state it yields."""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from pagegate.config import EngineConfig
from pagegate.engine.errors import EngineDeadError, InvalidParamError, RequestFailedError
from pagegate.gateway import embeddings, routes_api, routes_models, routes_ops
from pagegate.gateway.auth import APIKeyMiddleware, log_management_access
from pagegate.gateway.codec import render_error, wants_msgpack
from pagegate.gateway.dashboard.table import dashboard_routes
from pagegate.gateway.engine_host import EngineHost
from pagegate.gateway.errors import APIError, from_status, speaks_anthropic, to_api_error
from pagegate.gateway.gateway_metrics import gateway_registry
from pagegate.gateway.gateway_state import GatewayState
from pagegate.gateway.lazy_endpoint import lazy
from pagegate.gateway.responses.store import ResponseStore
from pagegate.gateway.settings import GatewayConfig
from pagegate.gateway.shutdown import InFlightMiddleware

if TYPE_CHECKING:
    from pagegate.gateway.batches.service import Batches
    from pagegate.gateway.dashboard.feed import DashboardFeed
    from pagegate.gateway.grpc_server import GrpcServer

logger = logging.getLogger("pagegate.gateway")

RESPONSES, MESSAGES, BATCHES = ("pagegate.gateway.responses.routes", "pagegate.gateway.messages.routes",
                                "pagegate.gateway.batches.routes")
ROUTES = [
    Route("/v1/completions", routes_api.completions, methods=["POST"]),
    Route("/v1/chat/completions", routes_api.chat_completions, methods=["POST"]),
    Route("/v1/embeddings", embeddings.create_embeddings, methods=["POST"]),
    Route("/v1/models", routes_api.models, methods=["GET"]),
    Route("/v1/models/{model:path}", routes_api.model_detail, methods=["GET"]),
    Route("/v1/responses", lazy(f"{RESPONSES}:create_response"), methods=["POST"]),
    Route("/v1/responses/{response_id}", lazy(f"{RESPONSES}:get_response"), methods=["GET"]),
    Route("/v1/responses/{response_id}", lazy(f"{RESPONSES}:delete_response"), methods=["DELETE"]),
    Route("/v1/responses/{response_id}/input_items", lazy(f"{RESPONSES}:list_input_items"), methods=["GET"]),
    Route("/v1/messages", lazy(f"{MESSAGES}:create_message"), methods=["POST"]),
    Route("/v1/messages/count_tokens", lazy(f"{MESSAGES}:count_tokens"), methods=["POST"]),
    Route("/v1/files", lazy(f"{BATCHES}:upload_file"), methods=["POST"]),
    Route("/v1/files", lazy(f"{BATCHES}:list_files"), methods=["GET"]),
    Route("/v1/files/{file_id}", lazy(f"{BATCHES}:retrieve_file"), methods=["GET"]),
    Route("/v1/files/{file_id}", lazy(f"{BATCHES}:delete_file"), methods=["DELETE"]),
    Route("/v1/files/{file_id}/content", lazy(f"{BATCHES}:file_content"), methods=["GET"]),
    Route("/v1/batches", lazy(f"{BATCHES}:create_batch"), methods=["POST"]),
    Route("/v1/batches", lazy(f"{BATCHES}:list_batches"), methods=["GET"]),
    Route("/v1/batches/{batch_id}", lazy(f"{BATCHES}:retrieve_batch"), methods=["GET"]),
    Route("/v1/batches/{batch_id}/cancel", lazy(f"{BATCHES}:cancel_batch"), methods=["POST"]),
    Route("/tokenize", routes_ops.tokenize, methods=["POST"]),
    Route("/detokenize", routes_ops.detokenize, methods=["POST"]),
    Route("/tokenizer_info", routes_ops.tokenizer_info, methods=["GET"]),
    Route("/health", routes_ops.health, methods=["GET"]),
    Route("/metrics", routes_ops.metrics, methods=["GET"]),
    Route("/version", routes_ops.version, methods=["GET"]),
    Route("/openapi.json", lazy("pagegate.gateway.openapi:openapi"), methods=["GET"]),
    Route("/models/load", routes_models.load, methods=["POST"]),
    Route("/models/unload", routes_models.unload, methods=["POST"]),
    Route("/sleep", routes_models.sleep, methods=["POST"]),
    Route("/wake_up", routes_models.wake_up, methods=["POST"]),
    Route("/is_sleeping", routes_models.is_sleeping, methods=["GET"]),
    Route("/v1/load_lora_adapter", routes_models.load_lora_adapter, methods=["POST"]),
    Route("/v1/unload_lora_adapter", routes_models.unload_lora_adapter, methods=["POST"]),
]


def build_state(engine_config: EngineConfig, config: GatewayConfig,
                on_fatal: Callable[[], None] | None = None) -> GatewayState:
    """What the app's lifespan yields to every request: the engine host (its engine loads once the server runs, so
    /health says 503 meanwhile), the response store, the dashboard's feed and the gateway's metrics."""
    host = EngineHost(engine_config, config, on_fatal)
    responses = ResponseStore(config.responses_store_max_items, config.responses_store_max_bytes,
                              config.responses_store_ttl_s, config.responses_store_path, host.engine_requests.unpin)
    return GatewayState(host=host, responses=responses, dashboard=_dashboard(host) if config.enable_dashboard else None,
                        gateway_registry=gateway_registry(host), batches=_batches(engine_config, config))


async def _grpc_server(host: EngineHost) -> GrpcServer:
    """The gRPC server on --grpc-port, started beside the first model's load (the server turns ready once it is up:
    EngineHost.start); its modules imported on a thread, where `pagegate serve` has not imported them already
    (__main__.import_beside): ~0.05 s that would hold up the load's start."""
    grpc_server = await asyncio.to_thread(importlib.import_module, "pagegate.gateway.grpc_server")
    return await grpc_server.start_grpc_server(host.config.host, host.config.grpc_port, host)


async def _stop_grpc(starting: asyncio.Task[GrpcServer]) -> None:
    starting.cancel()  # nothing where it is up
    try:
        server = await starting
    except (asyncio.CancelledError, Exception):  # stopped while starting, or it could not bind (EngineHost said so)
        return
    await server.stop()


def _dashboard(host: EngineHost) -> DashboardFeed:
    from pagegate.gateway.dashboard.feed import DashboardFeed

    return DashboardFeed(host)


def _batches(engine_config: EngineConfig, config: GatewayConfig) -> Batches | None:
    """The Files and Batch APIs under --batch-dir (BatchDirInUse if another server holds it)."""
    if config.batch_dir is None:
        return None
    from pagegate.gateway.batches.service import Batches

    return Batches(config, config.batch_concurrency or engine_config.scheduler.max_num_seqs)


def build_app(state: GatewayState) -> Starlette:
    """The ASGI app over `state` (build_state's); routes read it as lifespan state (gateway_state.py)."""
    host, dashboard, batch_api = state["host"], state["dashboard"], state["batches"]
    config = host.config

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[GatewayState]:
        loop = asyncio.get_running_loop()
        # same process, event loop and engine as the HTTP server
        grpc_server = loop.create_task(_grpc_server(host)) if config.grpc_port else None
        host.start(listeners=grpc_server)
        history = loop.create_task(dashboard.sample_history()) if dashboard else None
        try:
            if batch_api is not None:  # its lines enter at the router, below the middleware (batches/in_process.py)
                await batch_api.start(app.router, state)
            yield state
        finally:
            if batch_api is not None:
                await batch_api.stop()
            if history is not None:
                history.cancel()
            if grpc_server is not None:
                await _stop_grpc(grpc_server)
            await host.stop()

    middleware = [Middleware(APIKeyMiddleware, api_keys=config.client_api_keys, admin_keys=config.admin_api_keys)]
    log_management_access(config.client_api_keys, config.admin_api_keys)
    if config.allowed_origins:
        cors = Middleware(CORSMiddleware, allow_origins=config.allowed_origins, allow_methods=["*"],
                          allow_headers=["*"], allow_credentials="*" not in config.allowed_origins)
        middleware.insert(0, cors)
    middleware.insert(0, Middleware(InFlightMiddleware, host=host))  # outermost: every request a drain waits for
    handlers = {HTTPException: _http_error, APIError: _any_error, InvalidParamError: _any_error,
                EngineDeadError: _any_error, RequestFailedError: _any_error, Exception: _any_error}
    routes = ROUTES + (dashboard_routes() if dashboard is not None else [])
    return Starlette(routes=routes, middleware=middleware, exception_handlers=handlers, lifespan=lifespan)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    error = from_status(exc.status_code, f"{exc.detail}: {request.method} {request.url.path}")
    error.headers.update(exc.headers or {})  # e.g. the Allow header of a 405
    return _error_response(request, error)


async def _any_error(request: Request, exc: Exception) -> Response:
    error = to_api_error(exc)
    if error.status_code >= 500 and error is not exc:
        logger.error("%s %s failed", request.method, request.url.path, exc_info=exc)
    return _error_response(request, error)


def _error_response(request: Request, error: APIError) -> Response:
    return render_error(error, msgpack_body=wants_msgpack(request), anthropic=speaks_anthropic(request.url.path))
