"""The other routes: models, health, metrics, version, openapi, tokenize/detokenize, msgpack bodies."""

from __future__ import annotations

import httpx
import msgpack
import openai

import pagegate
from pagegate.gateway.schemas import CompletionResponse


def test_models(client: openai.OpenAI, http: httpx.Client, model: str) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == [model] and models[0].owned_by == "pagegate"
    assert client.models.retrieve(model).id == model
    assert http.get("/v1/models").json()["data"][0]["max_model_len"] > 0


def test_health_metrics_version(http: httpx.Client) -> None:
    health = http.get("/health")
    assert health.status_code == 200 and health.json()["status"] == "ok"
    metrics = http.get("/metrics")
    assert metrics.status_code == 200 and metrics.headers["content-type"].startswith("text/plain")
    assert "# TYPE" in metrics.text
    assert http.get("/version").json() == {"version": pagegate.__version__}


def test_openapi_lists_routes_and_schemas(http: httpx.Client) -> None:
    document = http.get("/openapi.json").json()
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models", "/tokenize"} <= set(document["paths"])
    schemas = document["components"]["schemas"]
    assert {"CompletionRequest", "ChatCompletionRequest", "CompletionResponse", "ChatCompletionChunk",
            "ErrorResponse"} <= set(schemas)
    assert "suffix" not in schemas["CompletionRequest"]["properties"]


def test_tokenize_detokenize(http: httpx.Client, model_card: dict) -> None:
    tokens = http.post("/tokenize", json={"prompt": "Hello world"}).json()
    assert tokens["count"] == len(tokens["tokens"]) > 0 and tokens["max_model_len"] == model_card["max_model_len"]
    bare = http.post("/tokenize", json={"prompt": "Hello world", "add_special_tokens": False}).json()
    assert len(bare["tokens"]) <= tokens["count"]
    text = http.post("/detokenize", json={"tokens": bare["tokens"]}).json()["prompt"]
    assert text.strip() == "Hello world"
    assert http.post("/detokenize", json={"tokens": [10**9]}).status_code == 400
    assert http.post("/tokenize", json={"prompt": "x", "messages": []}).status_code == 400


def test_msgpack_request_and_response(http: httpx.Client) -> None:
    body = msgpack.packb({"prompt": "Hello", "max_tokens": 3, "logit_bias": {5: -1.0}})
    headers = {"Content-Type": "application/msgpack", "Accept": "application/msgpack"}
    response = http.post("/v1/completions", content=body, headers=headers)
    assert response.status_code == 200 and response.headers["content-type"] == "application/msgpack"
    CompletionResponse.model_validate(msgpack.unpackb(response.content))
    as_json = http.post("/v1/completions", content=body, headers={"Content-Type": "application/msgpack"})
    assert as_json.json()["object"] == "text_completion"


def test_msgpack_stream_framing(http: httpx.Client) -> None:
    body = msgpack.packb({"prompt": "Hello", "max_tokens": 4, "stream": True, "ignore_eos": True,
                          "stream_options": {"include_usage": True}})
    headers = {"Content-Type": "application/msgpack", "Accept": "application/msgpack"}
    response = http.post("/v1/completions", content=body, headers=headers)
    items = list(msgpack.Unpacker(__import__("io").BytesIO(response.content), raw=False))
    assert items[-1] == {"done": True}
    assert items[-2]["usage"]["completion_tokens"] == 4 and items[-2]["choices"] == []
    assert all(item["object"] == "text_completion" for item in items[:-1])


def test_sse_headers(http: httpx.Client) -> None:
    with http.stream("POST", "/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "stream": True}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]" and all(line.startswith("data: ") for line in lines)
