"""The gRPC door (pagegate.v1.Generation, pagegate.proto): the REST routes' twin on the same EngineHost.

A request message becomes the dict a JSON body would be, then goes through the REST code unchanged:
`prepare_completion` / `prepare_chat` (validation, tokenization, limits), `Admission.admit`, `EngineRequests.generate`,
the renderers. Response messages are built from the dicts REST would send. So both doors give the same
results and the same error messages; only the framing differs. Also served: grpc.health.v1 (SERVING
once the engine is ready) and server reflection, for grpcurl and Kubernetes probes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import Callable
from typing import Any

import grpc
from google.protobuf.message import DecodeError, Message
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection

from pagegate.gateway.acquired import AcquiredModel
from pagegate.gateway.auth import bearer_token, key_identity, matching_key
from pagegate.gateway.engine_host import EngineHost, requested_model
from pagegate.gateway.errors import APIError, Unauthorized, to_api_error
from pagegate.gateway.prepare import ModelContext, PreparedRequest, off_loop, prepare_chat, prepare_completion
from pagegate.gateway.proto import pagegate_pb2 as pb
from pagegate.gateway.proto import pagegate_pb2_grpc as pb_grpc
from pagegate.gateway.proto.convert import request_to_body, response_from_body
from pagegate.gateway.render import ChatRenderer, CompletionRenderer, Renderer
from pagegate.gateway.streaming import collect

logger = logging.getLogger("pagegate.gateway.grpc")

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Generation"].full_name  # "pagegate.v1.Generation"
HEALTH_POLL_S = 0.5  # how often Watch subscribers learn of a state change (Check is always live)
STOP_GRACE_S = 5.0

# HTTP status of the REST answer -> gRPC status (the same APIError drives both).
STATUS_CODES = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
    403: grpc.StatusCode.PERMISSION_DENIED,
    404: grpc.StatusCode.NOT_FOUND,
    405: grpc.StatusCode.UNIMPLEMENTED,
    413: grpc.StatusCode.RESOURCE_EXHAUSTED,
    415: grpc.StatusCode.INVALID_ARGUMENT,
    429: grpc.StatusCode.RESOURCE_EXHAUSTED,
    499: grpc.StatusCode.CANCELLED,
    500: grpc.StatusCode.INTERNAL,
    503: grpc.StatusCode.UNAVAILABLE,
    504: grpc.StatusCode.DEADLINE_EXCEEDED,
}
UNAUTHORIZED_MESSAGE = "Incorrect or missing API key: send 'authorization: Bearer <key>' metadata."


def status_of(error: APIError) -> grpc.StatusCode:
    code = STATUS_CODES.get(error.status_code)
    if code is not None:
        return code
    return grpc.StatusCode.INTERNAL if error.status_code >= 500 else grpc.StatusCode.INVALID_ARGUMENT


def error_metadata(error: APIError) -> tuple[tuple[str, str], ...]:
    """The rest of the OpenAI error body (and Retry-After) as trailing metadata: ASCII values only."""
    pairs = [("pagegate-error-type", error.error_type), ("pagegate-error-param", error.param),
             ("pagegate-error-code", error.code), ("retry-after", error.headers.get("Retry-After"))]
    return tuple((key, _ascii(value)) for key, value in pairs if value is not None)


def _ascii(value: Any) -> str:
    return str(value).encode("ascii", "backslashreplace").decode("ascii")


class GenerationServicer(pb_grpc.GenerationServicer):
    """pagegate.v1.Generation over an EngineHost shared with the REST app."""

    def __init__(self, host: EngineHost) -> None:
        self.host = host

    async def Complete(self, request: pb.CompletionRequest, context: grpc.aio.ServicerContext) -> pb.Completion:
        return await self._unary(request, context, prepare_completion, CompletionRenderer, "cmpl", pb.Completion)

    async def CompleteStream(self, request: pb.CompletionRequest, context: grpc.aio.ServicerContext) -> None:
        await self._stream(request, context, prepare_completion, CompletionRenderer, "cmpl", pb.Completion)

    async def Chat(self, request: pb.ChatRequest, context: grpc.aio.ServicerContext) -> pb.ChatCompletion:
        return await self._unary(request, context, prepare_chat, ChatRenderer, "chatcmpl", pb.ChatCompletion)

    async def ChatStream(self, request: pb.ChatRequest, context: grpc.aio.ServicerContext) -> None:
        await self._stream(request, context, prepare_chat, ChatRenderer, "chatcmpl", pb.ChatCompletionChunk)

    async def ListModels(self, request: pb.ListModelsRequest, context: grpc.aio.ServicerContext) -> pb.ModelList:
        try:
            key = self._key(context)
            admin = key is None or matching_key(key, self.host.config.admin_api_keys) is not None
            cards = self.host.model_cards(paths=admin)
        except Exception as exc:
            await _abort(context, exc)
        fields = pb.ModelCard.DESCRIPTOR.fields_by_name  # REST's card has more (an adapter's parent): left out
        return pb.ModelList(object="list", data=[{k: v for k, v in card.items() if k in fields} for card in cards])

    # -- the two shapes of a generation ----------------------------------------------------------
    async def _unary(self, request: Any, context: grpc.aio.ServicerContext, prepare: Prepare,
                     renderer_cls: type[Renderer], id_prefix: str, response_cls: type) -> Any:
        try:
            acquired, prepared, renderer = await self._start(request, context, prepare, renderer_cls, id_prefix,
                                                             stream=False)
            merger, _ = self.host.engine_requests.generate(acquired, prepared, renderer.request_id)
            finals = await collect(merger)  # cancelled with the call: collect closes the merger (abort)
            return response_from_body(renderer.response(finals), response_cls)
        except Exception as exc:
            await _abort(context, exc)

    async def _stream(self, request: Any, context: grpc.aio.ServicerContext, prepare: Prepare,
                      renderer_cls: type[Renderer], id_prefix: str, chunk_cls: type) -> None:
        # context.write rather than yield: a cancelled call (client gone, deadline) then always raises
        # CancelledError in this frame, and the finally below aborts the generation at once.
        try:
            acquired, prepared, renderer = await self._start(request, context, prepare, renderer_cls, id_prefix,
                                                             stream=True)
            merger, _ = self.host.engine_requests.generate(acquired, prepared, renderer.request_id)
        except Exception as exc:
            await _abort(context, exc)
        try:
            for chunk in renderer.opening_chunks():
                await context.write(response_from_body(chunk, chunk_cls))
            async for batch in merger.batches(self.host.engine_requests.stream_pace):
                for index, output in batch.items():
                    for chunk in renderer.update(index, output):
                        await context.write(response_from_body(chunk, chunk_cls))
            if prepared.include_usage:
                await context.write(response_from_body(renderer.usage_chunk(), chunk_cls))
        except Exception as exc:
            if not isinstance(exc, APIError):
                logger.warning("stream %s ended by %s: %s", renderer.request_id, type(exc).__name__, exc)
            await _abort(context, exc)
        finally:
            merger.close()

    async def _start(self, request: Any, context: grpc.aio.ServicerContext, prepare: Prepare,
                     renderer_cls: type[Renderer], id_prefix: str, *,
                     stream: bool) -> tuple[AcquiredModel, PreparedRequest, Renderer]:
        """Auth, readiness (`acquire` checks it first), the shared validation path, admission (same order as the
        REST route)."""
        tenant = self._authorize(context)
        body = request_to_body(request)
        acquired = await self.host.acquire(requested_model(body))  # a model not loaded loads (or wakes) first
        if stream:
            body["stream"] = True
        prepared = await off_loop(prepare, body, acquired.model)  # validation and tokenization: never on the loop
        prepared.tenant = tenant
        self.host.admission.admit(acquired, prepared)
        return acquired, prepared, renderer_cls(prepared, acquired.model.tokenizer, f"{id_prefix}-{uuid.uuid4().hex}")

    def _authorize(self, context: grpc.aio.ServicerContext) -> str | None:
        """The identity of the call's API key (None when the server has no keys); Unauthorized without one."""
        key = self._key(context)
        return key_identity(key) if key is not None else None

    def _key(self, context: grpc.aio.ServicerContext) -> str | None:
        """The configured key (ordinary or admin) the call presents; None when the server has no keys; Unauthorized
        without one. The service has no management calls: an admin key matters only to ListModels' paths."""
        keys = self.host.config.every_api_key
        if not keys:
            return None
        header = next((value for key, value in context.invocation_metadata() or () if key == "authorization"), None)
        token = bearer_token(header if isinstance(header, str) else None)
        key = matching_key(token, keys) if token is not None else None
        if key is None:
            raise Unauthorized(UNAUTHORIZED_MESSAGE)
        return key


Prepare = Callable[[dict[str, Any], ModelContext], PreparedRequest]


async def _abort(context: grpc.aio.ServicerContext, exc: BaseException) -> None:
    """End the call with the status and message REST would have answered with (raises)."""
    if isinstance(exc, grpc.aio.AbortError):
        raise exc
    error = to_api_error(exc)
    if error.status_code >= 500 and error is not exc:
        logger.error("gRPC call failed", exc_info=exc)
    await context.abort(status_of(error), error.message, trailing_metadata=error_metadata(error))


class EngineHealth(HealthServicer):
    """grpc.health.v1 for "" and pagegate.v1.Generation: SERVING exactly when REST /health says 200."""

    SERVICES = ("", SERVICE_NAME)

    def __init__(self, host: EngineHost) -> None:
        super().__init__()
        self.host = host
        self._poller: asyncio.Task | None = None

    def status(self) -> int:
        ok = self.host.health()[0] == 200
        return health_pb2.HealthCheckResponse.SERVING if ok else health_pb2.HealthCheckResponse.NOT_SERVING

    async def refresh(self) -> None:
        status = self.status()
        for service in self.SERVICES:
            if self._server_status.get(service) != status:
                await self.set(service, status)

    async def Check(self, request: health_pb2.HealthCheckRequest, context: Any) -> Any:
        await self.refresh()
        return await super().Check(request, context)

    def start(self) -> None:
        self._poller = asyncio.get_running_loop().create_task(self._poll())

    async def _poll(self) -> None:
        while True:
            await self.refresh()
            await asyncio.sleep(HEALTH_POLL_S)

    async def stop(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poller
        await self.enter_graceful_shutdown()


class GrpcServer:
    """A started grpc.aio server on the engine host's loop; `port` is the bound one (useful with port 0)."""

    def __init__(self, server: grpc.aio.Server, health: EngineHealth, address: str, port: int) -> None:
        self.server = server
        self.health = health
        self.address = address
        self.port = port

    async def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        """NOT_SERVING first, then let running calls end (they see UNAVAILABLE once the host ends them)."""
        await self.health.stop()
        await self.server.stop(grace_s)
        logger.info("gRPC server on %s stopped", self.address)


def add_generation_service(servicer: GenerationServicer, server: grpc.aio.Server) -> None:
    """Register pagegate.v1.Generation with requests decoded by us, not by grpc: a malformed message then
    gets INVALID_ARGUMENT (a failing grpc deserializer answers UNKNOWN)."""
    handlers: dict[str, grpc.RpcMethodHandler] = {}
    for method in pb.DESCRIPTOR.services_by_name["Generation"].methods:
        request_cls, response_cls = getattr(pb, method.input_type.name), getattr(pb, method.output_type.name)
        factory = grpc.unary_stream_rpc_method_handler if method.server_streaming else grpc.unary_unary_rpc_method_handler
        handlers[method.name] = factory(_decoding(servicer, method.name, request_cls),
                                        response_serializer=response_cls.SerializeToString)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)


def _decoding(servicer: GenerationServicer, name: str, request_cls: type[Message]) -> Callable[..., Any]:
    """The servicer's method behind an authorization check and our own decoding of the request, counted in flight."""
    method = getattr(servicer, name)

    async def behaviour(raw: bytes, context: grpc.aio.ServicerContext) -> Any:
        with servicer.host.serving():  # every Generation call is in flight for a drain, as REST requests are
            try:
                servicer._authorize(context)  # the key first: strangers learn nothing about message formats
            except Exception as exc:
                await _abort(context, exc)
            try:
                request = request_cls.FromString(raw)
            except DecodeError as exc:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                    f"malformed {request_cls.DESCRIPTOR.full_name} message: {exc}")
            return await method(request, context)

    return behaviour


async def start_grpc_server(host: str, port: int, engine_host: EngineHost) -> GrpcServer:
    """Serve pagegate.v1.Generation, health and reflection on host:port, in the running event loop,
    over the REST app's EngineHost. Raises RuntimeError when the port cannot be bound."""
    server = grpc.aio.server(options=[
        ("grpc.so_reuseport", 0),  # a busy port must fail, not be shared with another server
        ("grpc.max_receive_message_length", engine_host.config.max_request_bytes),
        ("grpc.max_send_message_length", -1),
    ])
    add_generation_service(GenerationServicer(engine_host), server)
    health = EngineHealth(engine_host)
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    names = (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME)
    reflection.enable_server_reflection(names, server)
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        bound = server.add_insecure_port(address)
    except RuntimeError:  # grpc's own message names GRPC_VERBOSITY, not the flag
        bound = 0
    if bound == 0:
        raise RuntimeError(f"gRPC: cannot listen on {address} (--grpc-port): is the port taken?")
    await server.start()
    health.start()
    address = f"{address.rsplit(':', 1)[0]}:{bound}"
    logger.info("gRPC (%s, health, reflection) on %s", SERVICE_NAME, address)
    return GrpcServer(server, health, address, bound)
