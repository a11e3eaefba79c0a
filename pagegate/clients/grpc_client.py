"""GrpcClient / AsyncGrpcClient: pagegate.v1.Generation with the MsgpackClient's methods (grpcio + protobuf only).

Arguments are the REST body's fields (`max_tokens=8`, `stop="\\n"`, `stream_options={...}`) and answers
are the REST JSON's dicts (unset optional fields as None), so code moves between the clients unchanged.
Errors raise the same `PagegateError` classes, with `status_code` the REST status and `grpc_code` the
gRPC status. Breaking out of a stream cancels the call, and the server aborts the generation.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable, Iterator
from typing import Any, cast

import grpc
import grpc.aio

from pagegate.clients.errors import (
    AuthenticationError,
    BadRequestError,
    NotFoundError,
    PagegateError,
    RateLimitError,
    RequestTooLargeError,
    ServerError,
)
from pagegate.gateway.proto import pagegate_pb2 as pb
from pagegate.gateway.proto import pagegate_pb2_grpc as pb_grpc
from pagegate.gateway.proto.convert import UnknownFieldError, body_to_request, message_to_dict

# gRPC status -> (REST status, error class); RESOURCE_EXHAUSTED is 413 when the code says so.
_BY_CODE: dict[grpc.StatusCode, tuple[int, type[PagegateError]]] = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, BadRequestError),
    grpc.StatusCode.UNAUTHENTICATED: (401, AuthenticationError),
    grpc.StatusCode.PERMISSION_DENIED: (403, BadRequestError),
    grpc.StatusCode.NOT_FOUND: (404, NotFoundError),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, RateLimitError),
    grpc.StatusCode.CANCELLED: (499, PagegateError),
    grpc.StatusCode.INTERNAL: (500, ServerError),
    grpc.StatusCode.UNIMPLEMENTED: (501, ServerError),
    grpc.StatusCode.UNAVAILABLE: (503, ServerError),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, ServerError),
}


def grpc_target(target: str) -> str:
    """'host:port', 'grpc://host:port' and 'http://host:port/' all name the same server."""
    for scheme in ("grpc://", "http://", "dns:///"):
        if target.startswith(scheme):
            target = target[len(scheme):]
    return target.rstrip("/")


def error_from_rpc(error: grpc.RpcError) -> PagegateError:
    """The typed exception for a failed call, with the OpenAI error fields from the trailing metadata."""
    code = error.code() if hasattr(error, "code") else grpc.StatusCode.UNKNOWN
    details = (error.details() if hasattr(error, "details") else None) or str(code)
    # (key, value) pairs on the sync and the asyncio API alike (the stubs know only the sync class)
    metadata = cast(Iterable[tuple[str, str | bytes]], error.trailing_metadata() if hasattr(error, "trailing_metadata") else ())
    trailers = {key: value for key, value in metadata if isinstance(value, str)}  # -bin keys are bytes
    status, cls = _BY_CODE.get(code, (500, ServerError))
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED and trailers.get("pagegate-error-code") != "rate_limit_exceeded":
        status, cls = 413, RequestTooLargeError  # a full queue says so; otherwise a message over the limit
    retry = trailers.get("retry-after")
    exc = cls(details, status_code=status, type=trailers.get("pagegate-error-type"),
              param=trailers.get("pagegate-error-param"), code=trailers.get("pagegate-error-code"),
              retry_after=float(retry) if retry and retry.replace(".", "", 1).isdigit() else None)
    exc.grpc_code = code  # type: ignore[attr-defined]
    return exc


def _request(message_cls: type, fields: dict[str, Any], params: dict[str, Any]) -> Any:
    """The request message for REST-style fields; what REST would reject as unknown fails here, locally."""
    try:
        return body_to_request({**fields, **params}, message_cls)
    except UnknownFieldError as exc:
        raise BadRequestError(str(exc), status_code=400, param=exc.key, code="unknown_parameter") from None
    except (TypeError, ValueError) as exc:
        raise BadRequestError(f"Invalid request argument: {exc}", status_code=400, code="invalid_value") from None


def _metadata(api_key: str | None) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {api_key}"),) if api_key else ()


class GrpcClient:
    """Blocking client. `target` is 'host:port' (the server's --grpc-port)."""

    def __init__(self, target: str, api_key: str | None = None, *, timeout: float | None = None,
                 credentials: grpc.ChannelCredentials | None = None, channel: grpc.Channel | None = None,
                 options: list[tuple[str, Any]] | None = None) -> None:
        address = grpc_target(target)
        if channel is None:
            channel = (grpc.secure_channel(address, credentials, options) if credentials is not None
                       else grpc.insecure_channel(address, options))
        self._channel = channel
        self.stub = pb_grpc.GenerationStub(channel)
        self._metadata = _metadata(api_key)
        self._timeout = timeout

    def completions(self, prompt: Any, *, model: str | None = None, **params: Any) -> dict[str, Any]:
        return self._unary(self.stub.Complete, _request(pb.CompletionRequest, {"model": model, "prompt": prompt}, params))

    def stream_completions(self, prompt: Any, *, model: str | None = None, **params: Any) -> Iterator[dict[str, Any]]:
        request = _request(pb.CompletionRequest, {"model": model, "prompt": prompt}, params)
        return self._stream(self.stub.CompleteStream, request)

    def chat(self, messages: list[dict[str, Any]], *, model: str | None = None, **params: Any) -> dict[str, Any]:
        return self._unary(self.stub.Chat, _request(pb.ChatRequest, {"model": model, "messages": messages}, params))

    def stream_chat(self, messages: list[dict[str, Any]], *, model: str | None = None,
                    **params: Any) -> Iterator[dict[str, Any]]:
        request = _request(pb.ChatRequest, {"model": model, "messages": messages}, params)
        return self._stream(self.stub.ChatStream, request)

    def models(self) -> list[dict[str, Any]]:
        return self._unary(self.stub.ListModels, pb.ListModelsRequest())["data"]

    def _unary(self, method: Any, request: Any) -> dict[str, Any]:
        try:
            return message_to_dict(method(request, metadata=self._metadata, timeout=self._timeout))
        except grpc.RpcError as exc:
            raise error_from_rpc(exc) from None

    def _stream(self, method: Any, request: Any) -> Iterator[dict[str, Any]]:
        call = method(request, metadata=self._metadata, timeout=self._timeout)
        try:
            for message in call:
                yield message_to_dict(message)
        except grpc.RpcError as exc:
            raise error_from_rpc(exc) from None
        finally:
            call.cancel()  # a no-op after a clean end; otherwise the server aborts the generation

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> GrpcClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncGrpcClient:
    """asyncio client with the same methods; the stream methods are async iterators. The channel is
    opened on first use, in the loop that uses it."""

    def __init__(self, target: str, api_key: str | None = None, *, timeout: float | None = None,
                 credentials: grpc.ChannelCredentials | None = None,
                 options: list[tuple[str, Any]] | None = None) -> None:
        self._address = grpc_target(target)
        self._credentials = credentials
        self._options = options
        self._channel: grpc.aio.Channel | None = None
        self._stub: pb_grpc.GenerationStub | None = None
        self._metadata = _metadata(api_key)
        self._timeout = timeout

    @property
    def stub(self) -> pb_grpc.GenerationStub:
        if self._stub is None:
            if self._credentials is not None:
                self._channel = grpc.aio.secure_channel(self._address, self._credentials, self._options)
            else:
                self._channel = grpc.aio.insecure_channel(self._address, self._options)
            self._stub = pb_grpc.GenerationStub(self._channel)
        return self._stub

    async def completions(self, prompt: Any, *, model: str | None = None, **params: Any) -> dict[str, Any]:
        request = _request(pb.CompletionRequest, {"model": model, "prompt": prompt}, params)
        return await self._unary(self.stub.Complete, request)

    def stream_completions(self, prompt: Any, *, model: str | None = None,
                           **params: Any) -> AsyncIterator[dict[str, Any]]:
        request = _request(pb.CompletionRequest, {"model": model, "prompt": prompt}, params)
        return self._stream(self.stub.CompleteStream, request)

    async def chat(self, messages: list[dict[str, Any]], *, model: str | None = None, **params: Any) -> dict[str, Any]:
        return await self._unary(self.stub.Chat, _request(pb.ChatRequest, {"model": model, "messages": messages}, params))

    def stream_chat(self, messages: list[dict[str, Any]], *, model: str | None = None,
                    **params: Any) -> AsyncIterator[dict[str, Any]]:
        request = _request(pb.ChatRequest, {"model": model, "messages": messages}, params)
        return self._stream(self.stub.ChatStream, request)

    async def models(self) -> list[dict[str, Any]]:
        return (await self._unary(self.stub.ListModels, pb.ListModelsRequest()))["data"]

    async def _unary(self, method: Any, request: Any) -> dict[str, Any]:
        try:
            return message_to_dict(await method(request, metadata=self._metadata, timeout=self._timeout))
        except grpc.RpcError as exc:
            raise error_from_rpc(exc) from None

    async def _stream(self, method: Any, request: Any) -> AsyncIterator[dict[str, Any]]:
        call = method(request, metadata=self._metadata, timeout=self._timeout)
        try:
            async for message in call:
                yield message_to_dict(message)
        except grpc.RpcError as exc:
            raise error_from_rpc(exc) from None
        finally:
            call.cancel()

    async def aclose(self) -> None:
        if self._channel is not None:
            await self._channel.close()
            self._channel = self._stub = None

    async def __aenter__(self) -> AsyncGrpcClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
