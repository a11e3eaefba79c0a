"""A request looks its model up once: `EngineHost.acquire` finds the model by name, and admission, the engine
requests and the renderers use what it acquired. Counted on a real server in this process (the app's lifespan
entered: the embedded model's core, gRPC beside REST), every route that runs the model, JSON, msgpack and SSE."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import msgpack
import pytest
from starlette.testclient import TestClient

from pagegate.clients import GrpcClient
from pagegate.config import CacheConfig, EngineConfig
from pagegate.gateway.app import build_app, build_state
from pagegate.gateway.engine_host import EngineHost
from pagegate.gateway.settings import GatewayConfig
from pagegate.testing.launcher import free_port, wait_for

MESSAGES = [{"role": "user", "content": "Hello there"}]


class Server:
    """The app with its lifespan running, and the model names `EngineHost.slot_for` was asked for."""

    def __init__(self, client: TestClient, host: EngineHost, grpc_target: str) -> None:
        self.client = client
        self.grpc_target = grpc_target
        self.looked_up: list[str | None] = []
        slot_for = host.slot_for

        def counted(requested: str | None) -> Any:
            self.looked_up.append(requested)
            return slot_for(requested)

        host.slot_for = counted  # type: ignore[method-assign]

    def lookups(self, send: Callable[[], object]) -> list[str | None]:
        """The names looked up while `send()` makes one request."""
        self.looked_up.clear()
        send()
        return list(self.looked_up)


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    grpc_port = free_port()
    engine_config = EngineConfig(dtype="float32", device="cpu", pooling="mean", cache=CacheConfig(num_kv_blocks=256))
    state = build_state(engine_config, GatewayConfig(grpc_port=grpc_port))
    host = state["host"]
    with TestClient(build_app(state)) as client:
        wait_for(lambda: host.state != "loading", "the model to load", 120)
        assert host.state == "ready", host.reason
        yield Server(client, host, f"127.0.0.1:{grpc_port}")


def _ok(response: Any) -> None:
    assert response.status_code == 200, response.text


def _model(server: Server) -> str:
    return server.client.get("/v1/models").json()["data"][0]["id"]


REST = {
    "completion": ("/v1/completions", {"prompt": "Hello", "max_tokens": 2}),
    "chat": ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 2}),
    "responses": ("/v1/responses", {"input": "Hello", "max_output_tokens": 2}),
    "embeddings": ("/v1/embeddings", {"input": "Hello"}),
    "tokenize": ("/tokenize", {"prompt": "Hello"}),
    "detokenize": ("/detokenize", {"tokens": [1, 2, 3]}),
}


@pytest.mark.parametrize("name", sorted(REST))
def test_a_rest_request_looks_its_model_up_once(server: Server, name: str) -> None:
    path, body = REST[name]
    body = {**body, "model": _model(server)}
    assert server.lookups(lambda: _ok(server.client.post(path, json=body))) == [body["model"]]


def test_messages_a_stream_msgpack_and_tokenizer_info_look_it_up_once(server: Server) -> None:
    model = _model(server)
    messages = {"model": model, "messages": MESSAGES, "max_tokens": 2}
    assert server.lookups(lambda: _ok(server.client.post("/v1/messages", json=messages))) == [model]
    assert server.lookups(lambda: _ok(server.client.post("/v1/messages/count_tokens", json=messages))) == [model]

    def stream() -> None:
        body = {"model": model, "prompt": "Hello", "max_tokens": 2, "stream": True}
        with server.client.stream("POST", "/v1/completions", json=body) as response:
            _ok(response)
            assert "[DONE]" in "".join(response.iter_text())

    assert server.lookups(stream) == [model]
    packed = msgpack.packb({"model": model, "prompt": "Hello", "max_tokens": 2})
    headers = {"Content-Type": "application/msgpack", "Accept": "application/msgpack"}
    assert server.lookups(lambda: _ok(server.client.post("/v1/completions", content=packed, headers=headers))) \
        == [model]
    assert server.lookups(lambda: _ok(server.client.get("/tokenizer_info"))) == [None]


def test_a_grpc_call_looks_its_model_up_once(server: Server) -> None:
    model = _model(server)
    with GrpcClient(server.grpc_target) as grpc_client:
        assert server.lookups(lambda: grpc_client.chat(MESSAGES, model=model, max_tokens=2)) == [model]
        assert server.lookups(lambda: list(grpc_client.stream_completions("Hello", model=model, max_tokens=2))) \
            == [model]
