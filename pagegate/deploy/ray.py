"""pagegate replicas on Ray Serve, routed by prompt prefix.

    serve run pagegate.deploy.ray:app num_replicas=2 engine_args="--kv-cache-memory 2GiB"

Two deployments. `PagegateServer` replicas each run pagegate's engine and OpenAI app in their process (no
port of their own). `PagegateIngress` takes every request from Serve's HTTP proxy, finds its prompt text and
hands it to a replica through a deployment handle; the handle's request router, Ray Serve's
PrefixCacheAffinityRouter, sends prompts that share a prefix to the replica that served it before, so the
prefix's KV pages are already there. The router cannot sit on the ingress itself: Serve's proxy passes an
ingress only the ASGI scope, and the router needs an argument with a `prompt`.
"""

from __future__ import annotations

import asyncio
import logging
import shlex
import sys
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager
from dataclasses import replace
from typing import Any

import ray
from pydantic import BaseModel, ConfigDict, Field
from ray import serve
from ray.serve import Application
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from pagegate.deploy.proxying import ProxiedRequest, ResponseHead, call_asgi, routing_text
from pagegate.gateway.app import build_app, build_state
from pagegate.gateway.cli import build_parser, configs_from_args
from pagegate.gateway.codec import render_error, wants_msgpack
from pagegate.gateway.engine_host import FAILED, READY, EngineHost
from pagegate.gateway.errors import ServiceUnavailable
from pagegate.gateway.request_id import RequestIdMiddleware

logger = logging.getLogger("pagegate.deploy")

# ray.serve.llm.request_router.PrefixCacheAffinityRouter is an empty subclass of this class, but importing
# ray.serve.llm needs ray[llm] (vLLM, pyarrow); this module path needs only ray[serve].
PREFIX_ROUTER = "ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router.PrefixCacheAffinityRouter"
# Ray's defaults, except that the prefix tree is trimmed: without eviction it keeps every prompt for ever.
PREFIX_ROUTER_KWARGS: dict[str, Any] = {"do_eviction": True, "eviction_threshold_chars": 400_000,
                                        "eviction_target_chars": 360_000, "eviction_interval_secs": 10}
SERVER_DEPLOYMENT = "PagegateServer"
REPLICA_HEADER = "x-pagegate-replica"
LOAD_POLL_S = 0.1
STATS_TIMEOUT_S = 30.0


class PagegateArgs(BaseModel):
    """The application's arguments: `serve run ... key=value` or a config file's `args`."""

    model_config = ConfigDict(extra="forbid")

    num_replicas: int = Field(1, ge=1)
    # `pagegate serve` flags: "--kv-cache-memory 2GiB", ["--kv-cache-memory", "2GiB"] or {"kv-cache-memory": "2GiB"}
    engine_args: str | list[str] | dict[str, Any] = Field(default_factory=list)
    num_cpus: float = 1.0  # per replica
    num_gpus: float = 0.0  # per replica (1 with --device cuda)
    max_ongoing_requests: int = Field(64, ge=1)  # per replica; more wait in the ingress
    request_router: str | None = PREFIX_ROUTER  # None: Serve's default (power of two choices)
    request_router_kwargs: dict[str, Any] = Field(default_factory=lambda: dict(PREFIX_ROUTER_KWARGS))

    def engine_argv(self) -> list[str]:
        """The engine flags as `pagegate serve` takes them. In a mapping, true is a bare flag and false its
        `--no-` form (for on/off flags such as enable-prefix-caching); a list gives several values."""
        args = self.engine_args
        if isinstance(args, str):
            return shlex.split(args)
        if isinstance(args, list):
            return [str(arg) for arg in args]
        argv: list[str] = []
        for key, value in args.items():
            flag = "--" + key.lstrip("-").replace("_", "-")
            if value is True:
                argv.append(flag)
            elif value is False:
                argv.append("--no-" + flag[2:])
            elif isinstance(value, list):
                argv += [flag, *map(str, value)]
            elif value is not None:
                argv += [flag, str(value)]
        return argv


class PagegateServer:
    """One replica: pagegate's engine and its OpenAI app, served through `forward` calls."""

    async def __init__(self, engine_argv: list[str]) -> None:  # type: ignore[misc]  # Serve awaits it
        engine_config, gateway_config = configs_from_args(build_parser().parse_args(engine_argv))
        gateway_config = replace(gateway_config, grpc_port=0)  # replicas share nodes; Serve's proxy is the way in
        _log_to_stderr(gateway_config.log_level)
        state = build_state(engine_config, gateway_config)
        app = build_app(state)
        self._host: EngineHost = state["host"]
        lifespan = app.router.lifespan_context(app)
        self._lifespan: AbstractAsyncContextManager[Any] | None = lifespan
        await lifespan.__aenter__()
        self._state = state  # the lifespan's state, a copy of which each request's scope carries
        while self._host.state not in (READY, FAILED):  # Serve counts the replica only once it serves
            await asyncio.sleep(LOAD_POLL_S)
        if self._host.state == FAILED:
            await self._stop()
            raise RuntimeError(self._host.reason)
        self._app = RequestIdMiddleware(app)
        self._replica_id = serve.get_replica_context().replica_id.to_full_id_str()

    async def forward(self, request: ProxiedRequest) -> AsyncIterator[ResponseHead | bytes]:
        """The response to `request`: its head (naming this replica), then its body chunks."""
        async for item in call_asgi(self._app, request, self._state):
            if isinstance(item, ResponseHead):
                item = ResponseHead(item.status, [*item.headers, (REPLICA_HEADER.encode(), self._replica_id.encode())])
            yield item

    async def check_health(self) -> None:
        """Serve's health probe: a dead engine fails it, and Serve replaces the replica."""
        status, report = self._host.health()
        if status != 200:
            raise RuntimeError(f"pagegate replica unhealthy: {report}")

    async def record_routing_stats(self) -> dict[str, Any]:
        """Serve polls this for its request router; `replica_stats` reads it too."""
        stats = self._host.stats()
        if stats is None:
            return {"replica_id": self._replica_id}
        return {"replica_id": self._replica_id, "prefix_cache_hits": stats.prefix_cache_hits,
                "prefix_cache_queries": stats.prefix_cache_queries, "kv_cache_usage": stats.kv_cache_usage,
                "running": stats.running, "waiting": stats.waiting, "generation_tokens": stats.generation_tokens}

    async def __del__(self) -> None:  # Serve awaits this when it stops the replica
        await self._stop()

    async def _stop(self) -> None:
        """End every generation, stop the engine, free its pages; once, whatever called it first."""
        lifespan, self._lifespan = getattr(self, "_lifespan", None), None
        if lifespan is not None:
            await lifespan.__aexit__(None, None, None)


class PagegateIngress:
    """Takes each HTTP request from Serve's proxy and relays it to a PagegateServer replica."""

    def __init__(self, server: DeploymentHandle) -> None:
        self._server = server.options(stream=True)

    async def __call__(self, request: Request) -> Response:
        body, path, scope = await request.body(), request.url.path, request.scope
        prompt = routing_text(path, request.headers.get("content-type"), body)
        proxied = ProxiedRequest(request.method, path, scope["query_string"], list(scope["headers"]), body,
                                 scope.get("client"), prompt)
        # The router routes by the `prompt` of positional arguments; a call with none is balanced by load only.
        forward = self._server.forward
        responses = forward.remote(proxied) if proxied.prompt else forward.remote(request=proxied)
        assert isinstance(responses, DeploymentResponseGenerator)  # the handle streams
        try:
            head = await responses.__anext__()
        except Exception as exc:  # no replica answered: the replica died or never came up
            logger.error("%s %s: no response from a replica: %s", request.method, path, exc)
            error = ServiceUnavailable(f"No pagegate replica could answer: {type(exc).__name__}.")
            return render_error(error, msgpack_body=wants_msgpack(request))
        assert isinstance(head, ResponseHead)
        response = StreamingResponse(_relay(responses), status_code=head.status)
        # Serve's proxy adds its own x-request-id, the same id the replica adopted from the request.
        response.raw_headers = [(k, v) for k, v in head.headers if k.lower() != b"x-request-id"]
        return response


async def _relay(responses: DeploymentResponseGenerator) -> AsyncIterator[bytes]:
    finished = False
    try:
        async for chunk in responses:
            yield chunk
        finished = True
    finally:
        if not finished:  # the client left: the replica's generator is cancelled and aborts the generation
            responses.cancel()


def build(args: PagegateArgs) -> Application:
    """The Serve application: an ingress in front of `num_replicas` PagegateServer replicas."""
    argv = args.engine_argv()
    try:
        build_parser().parse_args(argv)  # a bad flag fails here, not in every replica
    except SystemExit as exc:
        raise ValueError(f"invalid engine_args {argv}: see the usage above") from exc
    options: dict[str, Any] = {"num_replicas": args.num_replicas, "max_ongoing_requests": args.max_ongoing_requests,
                               "ray_actor_options": {"num_cpus": args.num_cpus, "num_gpus": args.num_gpus}}
    if args.request_router is not None:
        options["request_router_config"] = {"request_router_class": args.request_router,
                                            "request_router_kwargs": args.request_router_kwargs}
    server = serve.deployment(name=SERVER_DEPLOYMENT, health_check_period_s=10, graceful_shutdown_timeout_s=15,
                              **options)(PagegateServer)
    ingress = serve.deployment(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=10_000)(PagegateIngress)
    return ingress.bind(server.bind(argv))


def app(args: dict[str, Any]) -> Application:
    """`serve run pagegate.deploy.ray:app [key=value ...]`: the application builder Serve calls."""
    return build(PagegateArgs.model_validate(args))


def replica_stats(app_name: str = "default") -> list[dict[str, Any]]:
    """Each running PagegateServer replica's prefix-cache counts and load, from a driver connected to the
    cluster. Replicas are the actors Serve names `SERVE_REPLICA::<app>#<deployment>#<id>`."""
    prefix = f"SERVE_REPLICA::{app_name}#{SERVER_DEPLOYMENT}#"
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
             if a["namespace"] == "serve" and a["name"].startswith(prefix)]
    replicas = [ray.get_actor(name, namespace="serve") for name in sorted(names)]
    return ray.get([replica.record_routing_stats.remote() for replica in replicas], timeout=STATS_TIMEOUT_S)


def _log_to_stderr(level: str) -> None:
    """pagegate's log lines in the replica's stderr, which Ray shows with the replica's name."""
    pagegate_logger = logging.getLogger("pagegate")
    if not pagegate_logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        pagegate_logger.addHandler(handler)
    pagegate_logger.setLevel("DEBUG" if level == "trace" else level.upper())
