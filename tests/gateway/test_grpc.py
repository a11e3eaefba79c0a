"""The gRPC door against a real server (HTTP and gRPC in one process, one engine): the same results and
error messages as REST, auth, status codes, cancellation frees pages, health, reflection, stale stubs.

One server for the module; the last test stops it with SIGTERM (keep it last).
"""

from __future__ import annotations

import asyncio
import json
import re
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from google.protobuf.descriptor_pool import DescriptorPool
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from pagegate.clients import (
    AsyncGrpcClient,
    AuthenticationError,
    BadRequestError,
    GrpcClient,
    NotFoundError,
    RateLimitError,
    RequestTooLargeError,
    ServerError,
)
from pagegate.gateway import protocol, schemas
from pagegate.gateway.proto import pagegate_pb2 as pb
from pagegate.gateway.proto import pagegate_pb2_grpc as pb_grpc
from pagegate.gateway.proto.convert import body_to_request, request_to_body
from pagegate.testing.launcher import cores_stopped, free_port, wait_for
from tests.gateway.conftest import KVPages, metric_value
from tests.gateway.server_args import server_args

KEY = "grpc-key"
AUTH = (("authorization", f"Bearer {KEY}"),)
REST_AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_REQUEST = 1024 * 1024
# Two running sequences and a queue of two: four held streams fill it (RESOURCE_EXHAUSTED test).
ARGS = server_args("--num-kv-blocks", "256", "--max-num-seqs", "2", "--max-queue", "2", "--api-key", KEY,
                   "--max-request-size", str(MAX_REQUEST))
PROMPT = "The quick brown fox"
MESSAGES = [{"role": "user", "content": "Hello there"}]
LONG = {"prompt": "Go", "max_tokens": 1500, "ignore_eos": True}


# -- the server ------------------------------------------------------------------------------------
class Served:
    """`pagegate serve --grpc-port P` in a subprocess."""

    def __init__(self) -> None:
        self.host, self.port, self.grpc_port = "127.0.0.1", free_port(), free_port()
        self.log_file = tempfile.NamedTemporaryFile(prefix="pagegate-grpc-", suffix=".log", delete=False)
        command = [sys.executable, "-m", "pagegate", "serve", "--host", self.host, "--port", str(self.port), *ARGS,
                   "--grpc-port", str(self.grpc_port)]  # last: wins over a --grpc-port 0 in server_args()
        self.process = subprocess.Popen(command, stdout=self.log_file, stderr=subprocess.STDOUT)
        # NOTE: a channel whose first connects are refused backs off for up to 120 s (1 s, x1.6, jittered); a short,
        # flat backoff lets the probe reach the port as soon as it opens, inside the engine's loading window.
        self.channel = grpc.insecure_channel(self.target, options=[("grpc.initial_reconnect_backoff_ms", 50),
                                                                   ("grpc.min_reconnect_backoff_ms", 50),
                                                                   ("grpc.max_reconnect_backoff_ms", 100)])
        self.stub = pb_grpc.GenerationStub(self.channel)
        self.startup: list[tuple[str, str]] = []  # (health status, ListModels status) while loading

    @property
    def target(self) -> str:
        return f"{self.host}:{self.grpc_port}"

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def wait_ready(self, timeout_s: float = 180.0) -> None:
        """Poll the gRPC side until ListModels answers, recording what it said meanwhile."""
        def answered() -> bool:
            assert self.process.poll() is None, f"the server exited:\n{self.log()}"
            seen = self._probe()
            if seen is not None:
                self.startup.append(seen)
            return seen is not None and seen[1] == "OK"

        try:
            wait_for(answered, "a gRPC answer", timeout_s, poll_s=0.05)
        except AssertionError as exc:
            if self.process.poll() is not None:
                raise
            raise AssertionError(f"{exc}:\n{self.log()}") from exc

    def _probe(self) -> tuple[str, str] | None:
        """(health status, ListModels outcome), or None while the port is not open yet. The call goes
        first: once it succeeds, health must already say SERVING."""
        try:
            self.stub.ListModels(pb.ListModelsRequest(), metadata=AUTH, timeout=2)
            outcome = "OK"
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.UNAVAILABLE and "not ready" not in (exc.details() or ""):
                return None
            outcome = f"{exc.code().name}: {exc.details()}"
        try:
            status = health_pb2_grpc.HealthStub(self.channel).Check(health_pb2.HealthCheckRequest(), timeout=2)
        except grpc.RpcError:
            return None
        return health_pb2.HealthCheckResponse.ServingStatus.Name(status.status), outcome

    def stop(self) -> int | None:
        self.channel.close()
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                return None
        return self.process.returncode

    def log(self) -> str:
        self.log_file.flush()
        return Path(self.log_file.name).read_text(errors="replace")[-4000:]


@pytest.fixture(scope="module")
def served():
    server = Served()
    try:
        server.wait_ready()
        yield server
    finally:
        code = server.stop()
    assert code == 0, f"the server did not stop cleanly ({code}):\n{server.log()}"
    Path(server.log_file.name).unlink()  # kept only when something went wrong


@pytest.fixture(scope="module")
def rest(served: Served):
    with httpx.Client(base_url=served.base_url, headers=REST_AUTH, timeout=120) as session:
        yield session


@pytest.fixture(scope="module")
def client(served: Served):
    with GrpcClient(served.target, api_key=KEY) as session:
        yield session


@pytest.fixture(scope="module")
def kv_pages(served: Served) -> KVPages:
    return KVPages(httpx.Client(base_url=served.base_url, timeout=30))


def rpc_error(call: Any, *args: Any, **kwargs: Any) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as caught:
        result = call(*args, **kwargs)
        if hasattr(result, "__next__"):  # a streaming call fails while it is read
            list(result)
    return caught.value


def trailers(error: grpc.RpcError) -> dict[str, str]:
    return dict(error.trailing_metadata() or ())


def same_answer(rest_body: dict, grpc_body: dict) -> None:
    """Everything but the request id and timestamp is identical."""
    for key in ("object", "model", "choices", "usage"):
        assert grpc_body[key] == rest_body[key], key


# -- stubs and schema ------------------------------------------------------------------------------
def _without_version_stamps(text: str) -> str:
    """The generator's own version (protoc's, grpcio-tools') is not staleness: a newer grpcio-tools
    writes the same stubs with a newer stamp."""
    text = re.sub(r"# Protobuf Python Version: .*", "", text)
    text = re.sub(r"ValidateProtobufRuntimeVersion\([^)]*\)", "", text)
    return re.sub(r"GRPC_GENERATED_VERSION = .*", "", text)


def test_committed_stubs_are_fresh(tmp_path: Path) -> None:
    from pagegate.gateway.proto.generate import generate  # needs grpcio-tools, a test dependency

    for fresh in generate(tmp_path):
        committed = Path(pb.__file__).parent / fresh.name
        assert _without_version_stamps(committed.read_text()) == _without_version_stamps(fresh.read_text()), (
            f"{committed.name} is stale: run `python -m pagegate.gateway.proto.generate`")


def _json_keys(descriptor: Any) -> set[str]:
    keys = set()
    for field in descriptor.fields:
        oneof = field.containing_oneof
        real = oneof is not None and not (len(oneof.fields) == 1 and oneof.name == "_" + field.name)
        keys.add(oneof.name if real else field.name)
    return keys


@pytest.mark.parametrize("message, model, left_out", [
    # the RPC decides streaming; prompt logprobs (evaluation harnesses) are REST's alone
    (pb.CompletionRequest, protocol.CompletionRequest, {"stream", "prompt_logprobs"}),
    (pb.ChatRequest, protocol.ChatCompletionRequest, {"stream", "prompt_logprobs"}),
    (pb.ChatMessage, protocol.ChatMessage, set()),
    (pb.ContentPart, protocol.TextPart, set()),
    (pb.StreamOptions, protocol.StreamOptions, set()),
    (pb.Completion, schemas.CompletionResponse, set()),
    (pb.CompletionChoice, schemas.CompletionChoice, {"prompt_logprobs"}),
    (pb.CompletionLogprobs, schemas.CompletionLogprobs, set()),
    (pb.ChatCompletion, schemas.ChatCompletionResponse, {"prompt_logprobs"}),
    (pb.ChatCompletionChunk, schemas.ChatCompletionChunk, set()),
    (pb.ChatChunkChoice, schemas.ChatChunkChoice, set()),
    (pb.AssistantMessage, schemas.AssistantMessage, set()),
    (pb.ChatDelta, schemas.ChatDelta, set()),
    (pb.ToolCall, schemas.ToolCall, set()),
    (pb.ToolCall, protocol.ToolCall, set()),
    (pb.FunctionCall, schemas.FunctionCall, set()),
    (pb.ToolCallDelta, schemas.ToolCallDelta, set()),
    (pb.TokenLogprob, schemas.TokenLogprob, set()),
    (pb.Usage, schemas.Usage, set()),
    (pb.ModelCard, schemas.ModelCard, {"parent"}),  # a LoRA adapter's base model: listed over REST alone
])
def test_messages_mirror_the_rest_models(message: Any, model: Any, left_out: set[str]) -> None:
    assert _json_keys(message.DESCRIPTOR) == set(model.model_fields) - left_out


def test_request_conversion_round_trips() -> None:
    bodies = [
        ({"prompt": "hi", "max_tokens": 3, "stop": ["a", "b"], "logit_bias": {"5": -1.0}, "seed": -1}, pb.CompletionRequest),
        ({"prompt": [1, 2, 3], "n": 2, "stream_options": {"include_usage": True}}, pb.CompletionRequest),
        ({"prompt": ["a", "b"], "temperature": 0.0, "echo": False}, pb.CompletionRequest),
        ({"prompt": [[1, 2], [3]]}, pb.CompletionRequest),
        ({"messages": [{"role": "user", "content": "x"}, {"role": "user", "content": [{"type": "text", "text": "y"}]}],
          "response_format": {"type": "text"}, "logprobs": True, "top_logprobs": 0}, pb.ChatRequest),
        ({"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
                                                              "function": {"name": "f", "arguments": ""}}]},
                       {"role": "tool", "tool_call_id": "c", "content": "1"}],
          "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "maxProperties": 2}}}],
          "tool_choice": {"type": "function", "function": {"name": "f"}}, "parallel_tool_calls": False}, pb.ChatRequest),
        ({"messages": [{"role": "user", "content": "x"}], "tool_choice": "auto"}, pb.ChatRequest),
    ]
    for body, cls in bodies:
        assert request_to_body(body_to_request(body, cls)) == body
    # unset is not zero: a zero or false that was sent reaches validation as such
    assert request_to_body(pb.CompletionRequest(text="x", n=0, ignore_eos=False)) == {
        "prompt": "x", "n": 0, "ignore_eos": False}


def test_struct_numbers_arrive_as_json_wrote_them() -> None:
    """Struct holds every number as a double; a schema's whole numbers reach validation as ints again."""
    body = request_to_body(body_to_request({"messages": MESSAGES, "guided_json": {"maxLength": 8, "x": 0.5}},
                                           pb.ChatRequest))
    assert body["guided_json"] == {"maxLength": 8, "x": 0.5} and isinstance(body["guided_json"]["maxLength"], int)


def test_status_mapping() -> None:
    from pagegate.engine.errors import EngineDeadError, InvalidParamError
    from pagegate.gateway.errors import NotFound, Overloaded, ServiceUnavailable, to_api_error
    from pagegate.gateway.grpc_server import status_of

    cases = {EngineDeadError("gone"): grpc.StatusCode.UNAVAILABLE,
             ServiceUnavailable("loading"): grpc.StatusCode.UNAVAILABLE,
             Overloaded("full"): grpc.StatusCode.RESOURCE_EXHAUSTED,
             NotFound("no model"): grpc.StatusCode.NOT_FOUND,
             InvalidParamError("bad", "n"): grpc.StatusCode.INVALID_ARGUMENT,
             RuntimeError("bug"): grpc.StatusCode.INTERNAL}
    for exc, code in cases.items():
        assert status_of(to_api_error(exc)) == code, exc


# -- the live server -------------------------------------------------------------------------------
def test_not_ready_while_loading(served: Served) -> None:
    """The gRPC port opens while the engine loads; until the engine is up, calls get UNAVAILABLE."""
    seen = served.startup
    assert seen[-1] == ("SERVING", "OK")
    loading = [s for s in seen[:-1] if s[0] == "NOT_SERVING"]
    assert loading, f"never saw the loading state: {seen[:3]}"
    assert all(call.startswith("UNAVAILABLE: The server is not ready") for _, call in loading), loading[:3]


def test_a_grpc_port_taken_stops_the_server_with_why() -> None:
    """The gRPC server starts beside the model's load (app._grpc_server): one that cannot bind its port fails the
    start as a busy HTTP port does, at once and saying why, and ends the cores it started."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        command = [sys.executable, "-m", "pagegate", "serve", "--host", "127.0.0.1", "--port", str(free_port()),
                   *ARGS, "--grpc-port", str(taken.getsockname()[1])]
        done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stderr[-2000:]
    assert re.search(r"cannot serve: gRPC: cannot listen on 127\.0\.0\.1:\d+", done.stderr), done.stderr[-2000:]


def test_health_and_reflection(served: Served) -> None:
    health = health_pb2_grpc.HealthStub(served.channel)
    for service in ("", "pagegate.v1.Generation"):  # open without an API key, like /health
        assert health.Check(health_pb2.HealthCheckRequest(service=service)).status == \
            health_pb2.HealthCheckResponse.SERVING
    watch = health.Watch(health_pb2.HealthCheckRequest(service=""))
    assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
    watch.cancel()
    database = ProtoReflectionDescriptorDatabase(served.channel)
    assert {"pagegate.v1.Generation", "grpc.health.v1.Health"} <= set(database.get_services())
    service = DescriptorPool(database).FindServiceByName("pagegate.v1.Generation")
    assert [m.name for m in service.methods] == ["Complete", "CompleteStream", "Chat", "ChatStream", "ListModels"]


def test_list_models(client: GrpcClient, rest: httpx.Client) -> None:
    assert client.models() == rest.get("/v1/models").json()["data"]


@pytest.mark.parametrize("body", [
    {"prompt": PROMPT, "max_tokens": 10, "temperature": 0.9, "seed": 7, "n": 2, "logprobs": 2, "ignore_eos": True},
    {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "echo": True, "logprobs": 1},
    {"prompt": [[5, 6, 7], [8, 9]], "max_tokens": 4, "temperature": 0.5, "seed": 3, "stop": [" the"],
     "logit_bias": {"10": 5.0}, "top_k": 20, "min_p": 0.01, "repetition_penalty": 1.1},
])
def test_completion_matches_rest(client: GrpcClient, rest: httpx.Client, body: dict) -> None:
    expected = rest.post("/v1/completions", json=body).json()
    got = client.completions(**body)
    same_answer(expected, got)
    assert got["id"].startswith("cmpl-")


def test_completion_stream(client: GrpcClient, served: Served) -> None:
    args = dict(max_tokens=12, temperature=0, ignore_eos=True)
    whole = client.completions(PROMPT, **args)["choices"][0]["text"]
    chunks = list(client.stream_completions(PROMPT, **args, stream_options={"include_usage": True}))
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == whole
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]] \
        == ["length"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 12
    assert all(c["usage"] is None for c in chunks[:-1]) and len({c["id"] for c in chunks}) == 1
    raw = list(served.stub.CompleteStream(pb.CompletionRequest(text=PROMPT, max_tokens=3), metadata=AUTH))
    assert raw and all(isinstance(m, pb.Completion) and not m.HasField("usage") for m in raw)


def test_chat_matches_rest_and_streams(client: GrpcClient, rest: httpx.Client) -> None:
    body = {"messages": MESSAGES, "max_tokens": 8, "temperature": 0.8, "seed": 11, "logprobs": True,
            "top_logprobs": 2}
    expected = rest.post("/v1/chat/completions", json=body).json()
    got = client.chat(**body)
    same_answer(expected, got)
    assert got["object"] == "chat.completion" and got["choices"][0]["message"]["role"] == "assistant"
    chunks = list(client.stream_chat(**body))
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": "", "tool_calls": [],
                                         "reasoning_content": None}
    text = "".join(c["choices"][0]["delta"]["content"] or "" for c in chunks[1:])
    assert text == got["choices"][0]["message"]["content"]
    streamed_logprobs = [e for c in chunks if c["choices"][0]["logprobs"] for e in c["choices"][0]["logprobs"]["content"]]
    assert streamed_logprobs == got["choices"][0]["logprobs"]["content"]
    parts = client.chat([{"role": "user", "content": [{"type": "text", "text": "Hello "}, {"type": "text", "text": "there"}]}],
                        max_tokens=8, temperature=0.8, seed=11)
    assert parts["choices"][0]["message"] == got["choices"][0]["message"]


def test_tool_calls_match_rest_and_stream(client: GrpcClient, rest: httpx.Client) -> None:
    # One property: a Struct keeps no key order, and the grammar writes properties in the schema's order
    params = {"type": "object", "properties": {"days": {"type": "integer", "minimum": 1, "maximum": 5}},
              "required": ["days"], "additionalProperties": False}
    tools = [{"type": "function", "function": {"name": "forecast", "parameters": params}}]
    body = {"messages": MESSAGES, "tools": tools, "tool_choice": "required", "parallel_tool_calls": False,
            "max_tokens": 200, "temperature": 1.0, "seed": 3}
    expected = rest.post("/v1/chat/completions", json=body).json()["choices"][0]
    got = client.chat(**body)["choices"][0]
    assert got["finish_reason"] == expected["finish_reason"] == "tool_calls" and got["message"]["content"] is None
    calls = got["message"]["tool_calls"]
    assert [c["function"] for c in calls] == [c["function"] for c in expected["message"]["tool_calls"]]
    for call in calls:
        assert call["type"] == "function" and call["id"].startswith("call_")
        assert 1 <= json.loads(call["function"]["arguments"])["days"] <= 5
    pieces = [call for chunk in client.stream_chat(**body) for choice in chunk["choices"]
              for call in choice["delta"]["tool_calls"]]
    assert pieces[0]["function"] == {"name": "forecast", "arguments": ""} and pieces[0]["id"].startswith("call_")
    assert "".join(p["function"]["arguments"] for p in pieces if p["index"] == 0) == calls[0]["function"]["arguments"]
    history = [*MESSAGES, got["message"], {"role": "tool", "tool_call_id": calls[0]["id"], "content": "sunny"}]
    assert client.chat(history, tools=tools, max_tokens=2)["choices"][0]["finish_reason"] == "length"


def test_structured_outputs_match_rest(client: GrpcClient, rest: httpx.Client) -> None:
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    chat = {"messages": MESSAGES, "max_tokens": 20, "temperature": 1.0, "seed": 2,
            "response_format": {"type": "json_schema", "json_schema": {"name": "flag", "schema": schema}}}
    got = client.chat(**chat)
    same_answer(rest.post("/v1/chat/completions", json=chat).json(), got)
    assert isinstance(json.loads(got["choices"][0]["message"]["content"])["ok"], bool)
    for extra in ({"guided_choice": ["up", "down"]}, {"guided_json": schema}, {"guided_json": json.dumps(schema)},
                  {"structured_outputs": {"regex": "[ud]"}}, {"guided_regex": "[ud]"}):
        body = {"prompt": PROMPT, "max_tokens": 12, "temperature": 1.0, "seed": 4, **extra}
        same_answer(rest.post("/v1/completions", json=body).json(), client.completions(**body))


def test_api_key_required(served: Served) -> None:
    for metadata in ((), (("authorization", "Bearer wrong"),), (("authorization", KEY),)):
        error = rpc_error(served.stub.Complete, pb.CompletionRequest(text="hi"), metadata=metadata)
        assert error.code() == grpc.StatusCode.UNAUTHENTICATED
        assert trailers(error)["pagegate-error-code"] == "invalid_api_key"
    error = rpc_error(served.stub.ListModels, pb.ListModelsRequest())
    assert error.code() == grpc.StatusCode.UNAUTHENTICATED
    with GrpcClient(served.target, api_key="wrong") as bad, pytest.raises(AuthenticationError) as caught:
        list(bad.stream_completions("hi"))
    assert caught.value.status_code == 401
    assert httpx.post(served.base_url + "/v1/completions", json={"prompt": "hi"}).status_code == 401


BAD_COMPLETIONS = [
    {"prompt": PROMPT, "n": 0},
    {"prompt": PROMPT, "max_tokens": 0},
    {"max_tokens": 3},
    {"prompt": []},
    {"prompt": PROMPT, "temperature": -0.5},  # (a double: REST says "got -1" for the JSON int -1)
    {"prompt": [5, 10**9]},
    {"prompt": [5] * 2049, "max_tokens": 1},
    {"prompt": PROMPT, "max_tokens": 4000},
    {"prompt": PROMPT, "stop": [""]},
    {"prompt": PROMPT, "stop": ["a"] * 17},
    {"prompt": PROMPT, "logit_bias": {"abc": 1}},
    {"prompt": PROMPT, "best_of": 2},
    {"prompt": PROMPT, "logprobs": 21},
    {"prompt": PROMPT, "stream_options": {"include_usage": True}},  # on a unary call
    {"prompt": PROMPT, "cache_salt": ""},
]
BAD_CHATS = [
    {"messages": [{"role": "robot", "content": "x"}]},
    {"messages": [{"role": "user"}]},
    {"messages": MESSAGES, "top_logprobs": 2},
    {"messages": MESSAGES, "response_format": {"type": "json_schema"}},
    {"messages": MESSAGES, "response_format": {"type": "json_object"}, "guided_regex": "a"},
    {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
]


@pytest.mark.parametrize("path, body", [("/v1/completions", b) for b in BAD_COMPLETIONS]
                         + [("/v1/chat/completions", b) for b in BAD_CHATS])
def test_invalid_argument_says_what_rest_says(served: Served, rest: httpx.Client, path: str, body: dict) -> None:
    expected = rest.post(path, json=body)
    assert expected.status_code == 400, expected.text
    detail = expected.json()["error"]
    chat = path.endswith("chat/completions")
    request = body_to_request(body, pb.ChatRequest if chat else pb.CompletionRequest)
    error = rpc_error(served.stub.Chat if chat else served.stub.Complete, request, metadata=AUTH)
    assert (error.code(), error.details()) == (grpc.StatusCode.INVALID_ARGUMENT, detail["message"])
    assert trailers(error).get("pagegate-error-param") == detail["param"]
    assert trailers(error).get("pagegate-error-code") == detail["code"]


def test_typed_client_errors(client: GrpcClient) -> None:
    with pytest.raises(BadRequestError) as caught:
        client.completions("x", n=0)
    assert caught.value.param == "n" and caught.value.status_code == 400
    assert caught.value.grpc_code == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(BadRequestError) as caught:
        client.completions("x", temprature=1)  # unknown fields fail before the call, as REST words it
    assert caught.value.message == "Unrecognized request argument supplied: temprature"
    with pytest.raises(BadRequestError):
        list(client.stream_chat([], max_tokens=2))


def test_unknown_model_is_not_found(served: Served, client: GrpcClient) -> None:
    for call, request in ((served.stub.Complete, pb.CompletionRequest(text="x", model="nope")),
                          (served.stub.ChatStream, pb.ChatRequest(model="nope", messages=[{"role": "user", "text": "x"}]))):
        error = rpc_error(call, request, metadata=AUTH)
        assert error.code() == grpc.StatusCode.NOT_FOUND and "`nope` does not exist" in error.details()
    with pytest.raises(NotFoundError):
        client.chat(MESSAGES, model="nope")


@pytest.mark.parametrize("method", ["Complete", "ChatStream"])
def test_malformed_message_is_invalid_argument(served: Served, method: str) -> None:
    call = (served.channel.unary_stream if method.endswith("Stream") else served.channel.unary_unary)(
        f"/pagegate.v1.Generation/{method}")  # no serializers: raw bytes go out as they are
    with pytest.raises(grpc.RpcError) as caught:
        reply = call(b"\x0a\xff\xff\xff\xff\x0f", metadata=AUTH, timeout=10)  # a length past the end
        if method.endswith("Stream"):
            list(reply)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "malformed pagegate.v1." in caught.value.details()


def test_oversized_message_is_resource_exhausted(served: Served, client: GrpcClient, rest: httpx.Client) -> None:
    huge = "x" * (MAX_REQUEST + 1)
    error = rpc_error(served.stub.Complete, pb.CompletionRequest(text=huge), metadata=AUTH)
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    with pytest.raises(RequestTooLargeError):
        client.completions(huge)
    assert rest.post("/v1/completions", json={"prompt": huge}).status_code == 413


def _gauge(served: Served, name: str) -> float:
    return metric_value(httpx.get(served.base_url + "/metrics").text, name) or 0.0


def _wait_gauge(served: Served, name: str, wanted: float, timeout_s: float = 60.0) -> None:
    wait_for(lambda: _gauge(served, name) >= wanted, f"{name} to reach {wanted}", timeout_s, poll_s=0.05)


def test_full_queue_is_resource_exhausted(served: Served, kv_pages: KVPages) -> None:
    held = []
    try:
        for count in range(1, 5):  # one at a time: two run, then two wait, which fills --max-queue 2
            held.append(served.stub.CompleteStream(body_to_request(LONG, pb.CompletionRequest), metadata=AUTH))
            _wait_gauge(served, "pagegate:http_generations_active", count)
        _wait_gauge(served, "pagegate:http_requests_pending", 2)
        with cores_stopped(served.process.pid):  # the two running cannot finish and free their slots meanwhile
            error = rpc_error(served.stub.Complete, pb.CompletionRequest(text="x", max_tokens=1), metadata=AUTH)
            assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "overloaded" in error.details()
            assert int(trailers(error)["retry-after"]) >= 1
            with GrpcClient(served.target, api_key=KEY) as other, pytest.raises(RateLimitError) as caught:
                other.chat(MESSAGES, max_tokens=1)
            assert caught.value.retry_after and caught.value.retry_after >= 1
    finally:
        for call in held:
            call.cancel()
    assert kv_pages.wait_free(timeout_s=30) == 0


def test_cancelled_stream_frees_pages(served: Served, client: GrpcClient, kv_pages: KVPages) -> None:
    """Each stream is cut short, not run on to its 1,500th token: the server's token count says so, not a clock."""
    assert kv_pages.wait_free() == 0
    before = _gauge(served, "vllm:generation_tokens_total")
    call = served.stub.CompleteStream(body_to_request(LONG, pb.CompletionRequest), metadata=AUTH)
    for index, _ in enumerate(call):
        if index == 2:
            break
    assert kv_pages.in_use() > 0
    call.cancel()
    assert kv_pages.wait_free(timeout_s=120) == 0
    assert _gauge(served, "vllm:generation_tokens_total") - before < 1500
    before = _gauge(served, "vllm:generation_tokens_total")
    for index, _ in enumerate(client.stream_chat(MESSAGES, max_tokens=1500, ignore_eos=True)):
        if index == 3:
            break  # leaving the loop closes the generator, which cancels the call
    assert kv_pages.wait_free(timeout_s=120) == 0
    assert _gauge(served, "vllm:generation_tokens_total") - before < 1500


def test_deadline_frees_pages(served: Served, kv_pages: KVPages) -> None:
    """The call cannot finish before its deadline, however fast the machine: once it holds pages (1,500 tokens x 2
    to go), the engine core is stopped until the deadline has passed. The deadline only has to outlast the prefill
    of a two-token prompt."""
    deadline_s = 5.0
    request = body_to_request({**LONG, "n": 2}, pb.CompletionRequest)
    future = served.stub.Complete.future(request, metadata=AUTH, timeout=deadline_s)
    wait_for(lambda: kv_pages.in_use() > 0, "the request to hold pages", deadline_s, poll_s=0.02)  # freed after
    with cores_stopped(served.process.pid), pytest.raises(grpc.RpcError) as caught:
        future.result()
    assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert kv_pages.wait_free(timeout_s=30) == 0


def test_async_client(served: Served, kv_pages: KVPages) -> None:
    before = _gauge(served, "vllm:generation_tokens_total")

    async def run() -> None:
        async with AsyncGrpcClient(served.target, api_key=KEY) as client:
            assert await client.models()
            result = await client.completions("Hi", max_tokens=3, ignore_eos=True)
            assert result["usage"]["completion_tokens"] == 3
            chunks = [c async for c in client.stream_chat(MESSAGES, max_tokens=3)]
            assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
            answers = await asyncio.gather(*(client.chat(MESSAGES, max_tokens=2) for _ in range(2)))
            assert all(a["choices"][0]["finish_reason"] for a in answers)
            with pytest.raises(BadRequestError):
                await client.chat([], max_tokens=2)
            with pytest.raises(BadRequestError):
                [c async for c in client.stream_completions("x", n=0)]
            stream = client.stream_completions("Go", max_tokens=1500, ignore_eos=True)
            async for index, _ in _aenumerate(stream):
                if index == 2:
                    break
            await stream.aclose()

    asyncio.run(run())
    assert kv_pages.wait_free(timeout_s=120) == 0
    assert _gauge(served, "vllm:generation_tokens_total") - before < 1500  # the last stream stopped short


async def _aenumerate(items: Any) -> Any:
    index = 0
    async for item in items:
        yield index, item
        index += 1


def test_shutdown_ends_streams_unavailable(served: Served) -> None:
    """Keep last: SIGTERM while a stream runs -> UNAVAILABLE 'shutting down', the process exits 0."""
    call = served.stub.CompleteStream(body_to_request(LONG, pb.CompletionRequest), metadata=AUTH)
    received = 0
    with pytest.raises(grpc.RpcError) as caught:
        for _ in call:
            received += 1
            if received == 2:
                served.process.send_signal(signal.SIGTERM)
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE and "shutting down" in caught.value.details()
    assert served.process.wait(60) == 0, served.log()
    with pytest.raises(ServerError):
        GrpcClient(served.target, api_key=KEY, timeout=2).models()
