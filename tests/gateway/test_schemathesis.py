"""Schemathesis over /openapi.json against the shared test server: no 5xx, every answer as documented.

Cases come from the document (JSON and msgpack bodies, valid and invalid ones). It is built in-process,
since the tests are parametrized before any server runs; the first test checks the server serves that very
document. Before a case is sent its generation is capped (max_tokens <= 4, n <= 2): the document rightly
allows far more, and the suite cannot wait for thousands of tokens per case.
"""

from __future__ import annotations

import copy
import json
from typing import Any

import httpx
import hypothesis
import msgpack
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from pagegate.gateway.openapi import openapi_document
from pagegate.testing.launcher import ServerProcess
from tests.gateway.test_openapi_contract import sse_events, sse_validator

CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")
CAPS = {"max_tokens": 4, "max_completion_tokens": 4, "min_tokens": 4, "n": 2, "best_of": 2}


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


@schema.parametrize()
@settings(max_examples=100, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
def test_server_answers_as_its_openapi_says(case: schemathesis.Case, server: ServerProcess) -> None:
    if case.path in GENERATION_PATHS and isinstance(case.body, dict):
        keep_generation_short(case.body)
    response = case.call_and_validate(base_url=server.base_url, checks=CHECKS, timeout=60)
    if response.status_code == 200 and response.headers.get("content-type", [""])[0].startswith("text/event-stream"):
        validator = sse_validator(DOCUMENT, case.path)
        for chunk in sse_events(response.content.decode()):
            validator.validate(chunk)
