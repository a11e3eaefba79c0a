"""Schemathesis over /openapi.json against real servers: no 5xx, every answer as documented.

Cases come from the document (JSON and msgpack bodies, valid and invalid ones). It is built in-process,
since the tests are parametrized before any server runs; the first test checks the server serves that very
document. Before a case is sent its generation is capped (max_tokens <= 4, n <= 2): the document rightly
allows far more, and the suite cannot wait for thousands of tokens per case.

The routes that change what a server serves run against servers of their own (the shared one-model server must
keep its model awake for the other tests, so it is spared /sleep and /models/unload): the model routes against one
that serves two models and against a one-model server that also loads LoRA adapters at run time, the LoRA routes
against that one too. Random model names rarely name a served one, so each of those servers is also walked through
every documented answer by hand (200s, 400, 404, 409), each checked as the fuzzed cases are.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import signal
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import hypothesis
import msgpack
import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

import pagegate
from pagegate.gateway.openapi import openapi_document
from pagegate.testing.launcher import ServerProcess, core_pids, wait_for
from tests.gateway.conftest import SERVER_ARGS
from tests.gateway.test_openapi_contract import sse_events, sse_validator

CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")
CAPS = {"max_tokens": 4, "max_completion_tokens": 4, "min_tokens": 4, "n": 2, "best_of": 2}
SETTINGS = settings(max_examples=100, deadline=None, derandomize=True, database=None,
                    suppress_health_check=list(HealthCheck))
FEW = settings(SETTINGS, max_examples=30)  # the routes that only read a name or two

LIFECYCLE_PATHS = ["/models/load", "/models/unload", "/sleep", "/wake_up", "/is_sleeping"]
LORA_PATHS = ["/v1/load_lora_adapter", "/v1/unload_lora_adapter"]
SHARED_SERVER_SPARES = ["/sleep", "/models/unload"]  # NOTE: they would take the shared server's model away
DEFAULT_MODEL = str(Path(pagegate.__file__).parent / "engine" / "default_model")
BASE_ARGS = ["--dtype", "float32", "--device", "cpu", "--disable-uvicorn-access-log", "--grpc-port", "0"]
MODELS = ("first", "second")  # the embedded model twice: a server of several models that starts in seconds


@schemathesis.serializer("application/msgpack")
def _msgpack_body(_ctx: schemathesis.SerializationContext, value: Any) -> bytes:
    try:
        return msgpack.packb(value, use_bin_type=True)
    except OverflowError:  # an int beyond 64 bits has no msgpack form: this case cannot be sent that way
        hypothesis.reject()


# A JSON round trip, so the generator sees exactly what a client of /openapi.json sees.
DOCUMENT: dict[str, Any] = json.loads(json.dumps(openapi_document()))
schema = schemathesis.openapi.from_dict(copy.deepcopy(DOCUMENT))
# Fuzzing only: the coverage phase would add some 1,500 boundary cases, several times the time allowed here.
schema.config.phases.update(phases=["examples", "fuzzing"])
schema.config.max_stream_events = 10_000  # read whole streams (20 by default), so `[DONE]` can be checked


def test_the_server_serves_the_tested_document(http: httpx.Client) -> None:
    assert http.get("/openapi.json").json() == DOCUMENT


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def keep_generation_short(body: dict[str, Any]) -> None:
    """Cap the numbers that set how much is generated; leave every other value (valid or not) as it came."""
    for key, cap in CAPS.items():
        if _is_number(body.get(key)) and body[key] > cap:
            body[key] = cap
    if body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
        body["max_tokens"] = CAPS["max_tokens"]  # null or absent means "until the context is full"
    if _is_number(body.get("best_of")):
        # best_of == n is a rule JSON Schema cannot state; test_openapi_contract covers the 400 otherwise
        body["best_of"] = body.get("n", 1)


@schema.exclude(path=SHARED_SERVER_SPARES).parametrize()
@SETTINGS
def test_server_answers_as_its_openapi_says(case: schemathesis.Case, server: ServerProcess) -> None:
    if case.path in GENERATION_PATHS and isinstance(case.body, dict):
        keep_generation_short(case.body)
    response = case.call_and_validate(base_url=server.base_url, checks=CHECKS, timeout=60)
    if response.status_code == 200 and response.headers.get("content-type", [""])[0].startswith("text/event-stream"):
        validator = sse_validator(DOCUMENT, case.path)
        for chunk in sse_events(response.content.decode()):
            validator.validate(chunk)


# -- several models: load, unload, sleep, wake ---------------------------------------------------------

@pytest.fixture(scope="module")
def several_models() -> Iterator[ServerProcess]:
    args = [*BASE_ARGS, "--model", DEFAULT_MODEL, "--model", DEFAULT_MODEL, "--served-model-name", *MODELS,
            "--max-model-len", "128", "--kv-cache-memory", "64MiB", "--max-num-seqs", "8"]
    with ServerProcess(args) as process:
        yield process


@schema.include(path=LIFECYCLE_PATHS).parametrize()
@FEW
def test_model_routes_answer_as_documented(case: schemathesis.Case, several_models: ServerProcess) -> None:
    case.call_and_validate(base_url=several_models.base_url, checks=CHECKS, timeout=60)


def documented_call(base_url: str, path: str, status: int, *, body: Any = None, query: dict[str, str] | None = None,
                    media_type: str = "application/json") -> Any:
    """Send one request as the document describes the route, check the answer as the fuzzed ones are, and
    require `status`; the decoded answer (a JSON body, or the text of a text/plain one)."""
    operation = schema[path]["GET" if path == "/is_sleeping" else "POST"]
    case = operation.Case(query=query, **({"body": body, "media_type": media_type} if body is not None else {}))
    response = case.call_and_validate(base_url=base_url, checks=CHECKS, timeout=60)
    assert response.status_code == status, response.text
    return response.json() if response.headers["content-type"][0].startswith("application/json") else response.text


def nothing_running(base_url: str) -> bool:
    """No request runs in the server's engine (vllm:num_requests_running 0)."""
    metrics = httpx.get(base_url + "/metrics", timeout=30).text.splitlines()
    running = [line for line in metrics if line.startswith("vllm:num_requests_running{")]
    return bool(running) and all(float(line.rsplit(" ", 1)[1]) == 0 for line in running)


@contextlib.contextmanager
def model_serving_a_request(server: ServerProcess, model: str) -> Iterator[None]:
    """`model` serves a request for as long as this lasts: its core is stopped (SIGSTOP) before the request is
    sent, so the request cannot finish, and goes on (SIGCONT) after."""
    assert server.process is not None
    cores = core_pids(server.process.pid)
    body = {"model": model, "prompt": [5, 17, 42], "max_tokens": 2}
    with httpx.Client(base_url=server.base_url, timeout=60) as http, ThreadPoolExecutor(1) as pool:
        for pid in cores:
            os.kill(pid, signal.SIGSTOP)
        try:
            answer = pool.submit(http.post, "/v1/completions", json=body)
            wait_for(lambda: http.get("/health").json()["models"][model]["in_flight"] == 1, f"request to {model}")
            yield
        finally:
            for pid in cores:
                os.kill(pid, signal.SIGCONT)
        assert answer.result(timeout=60).status_code == 200


@contextlib.contextmanager
def adapter_serving_a_request(base_url: str, adapter: str) -> Iterator[None]:
    """A long streamed completion with `adapter`, its first token out. NOTE: the core itself refuses to unload an
    adapter its requests use, so it must run meanwhile: 1,000 tokens take tens of seconds here, far longer than the
    unload asked once the first token is read."""
    body = {"model": adapter, "prompt": [5, 17, 42], "max_tokens": 1000, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=base_url, timeout=60) as http, http.stream("POST", "/v1/completions",
                                                                          json=body) as response:
        assert response.status_code == 200
        lines = response.iter_lines()  # NOTE: held until the end: a dropped iterator closes the connection
        first = next(lines)
        assert '"text"' in first and '"error"' not in first, first
        yield


def test_model_routes_walk_every_documented_answer(several_models: ServerProcess) -> None:
    url, second = several_models.base_url, {"model": MODELS[1]}
    assert documented_call(url, "/models/load", 200, body=second) == {
        "success": True, "model": MODELS[1], "state": "loaded", "reason": None}
    assert documented_call(url, "/is_sleeping", 200, query=second) == {"model": MODELS[1], "is_sleeping": False}
    assert documented_call(url, "/sleep", 200, query=second)["state"] == "sleeping"
    assert documented_call(url, "/is_sleeping", 200, query=second)["is_sleeping"] is True
    assert documented_call(url, "/wake_up", 200, body=second,
                           media_type="application/msgpack")["state"] == "loaded"
    assert documented_call(url, "/models/unload", 200, body=second)["state"] == "unloaded"
    assert documented_call(url, "/sleep", 409, query=second)["error"]["code"] == "model_not_loaded"
    assert documented_call(url, "/wake_up", 200)["model"] == MODELS[0]  # none named: the default model
    for path in ("/models/load", "/models/unload"):
        assert documented_call(url, path, 400, body={})["error"]["param"] == "model"
    for path in LIFECYCLE_PATHS:
        assert documented_call(url, path, 404, query={"model": "nobody"})["error"]["code"] == "model_not_found"
    with model_serving_a_request(several_models, MODELS[0]):
        for path in ("/sleep", "/models/unload"):
            assert documented_call(url, path, 409, body={"model": MODELS[0]})["error"]["code"] == "model_busy"


# -- one model, LoRA adapters at run time ------------------------------------------------------------

@pytest.fixture(scope="module")
def one_model_server() -> Iterator[ServerProcess]:
    with ServerProcess([*SERVER_ARGS, "--enable-lora", "--max-lora-rank", "8", "--allow-runtime-lora"]) as process:
        yield process


@schema.include(path=LIFECYCLE_PATHS + LORA_PATHS).parametrize()
@FEW
def test_one_model_server_answers_as_documented(case: schemathesis.Case, one_model_server: ServerProcess) -> None:
    case.call_and_validate(base_url=one_model_server.base_url, checks=CHECKS, timeout=60)


def test_one_model_server_walks_the_sleep_routes(one_model_server: ServerProcess) -> None:
    url = one_model_server.base_url
    named = documented_call(url, "/wake_up", 200)["model"]  # awake, whatever the fuzzed cases left
    assert documented_call(url, "/is_sleeping", 200) == {"model": named, "is_sleeping": False}
    assert documented_call(url, "/sleep", 200, body={"model": named})["state"] == "sleeping"
    assert documented_call(url, "/is_sleeping", 200, query={"model": named})["is_sleeping"] is True
    assert documented_call(url, "/wake_up", 200, query={"model": named})["state"] == "loaded"
    for path in LIFECYCLE_PATHS:  # load and unload need several models: a 400 before the name is looked at
        documented_call(url, path, 400 if path.startswith("/models/") else 404, query={"model": "nobody"})


def test_lora_routes_walk_every_documented_answer(one_model_server: ServerProcess, adapter_folder: Path) -> None:
    url, adapter = one_model_server.base_url, {"lora_name": "tiny", "lora_path": str(adapter_folder)}
    assert documented_call(url, "/v1/load_lora_adapter", 200, body=adapter).startswith("Success")
    assert documented_call(url, "/v1/load_lora_adapter", 400, body=adapter)["error"]["param"] == "lora_name"
    missing = {"lora_name": "other", "lora_path": str(adapter_folder / "nowhere")}
    assert documented_call(url, "/v1/load_lora_adapter", 400, body=missing)["error"]["param"] == "lora_path"
    gone = documented_call(url, "/v1/unload_lora_adapter", 404, body={"lora_name": "nobody"})
    assert gone["error"]["code"] == "model_not_found"
    with adapter_serving_a_request(url, "tiny"):
        busy = documented_call(url, "/v1/unload_lora_adapter", 409, body={"lora_name": "tiny"})
        assert busy["error"]["code"] == "adapter_busy"
    wait_for(lambda: nothing_running(url), "the closed stream's request to be aborted")
    assert documented_call(url, "/v1/unload_lora_adapter", 200, body={"lora_name": "tiny"}).startswith("Success")
