"""Bad input always gets a 4xx in OpenAI's error shape (never a 500), and the SDK raises the right class."""

from __future__ import annotations

import socket
import time

import httpx
import msgpack
import openai
import pytest

from pagegate.testing.launcher import wait_for

PROMPT = "Hello"


def assert_error(response: httpx.Response, status: int, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param is not None:
        assert error["param"] == param
    return error


def test_sdk_bad_request(client: openai.OpenAI, model: str) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=model, prompt=PROMPT, n=0)
    assert caught.value.body["param"] == "n"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=model, messages=[], max_tokens=3)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=model, prompt=PROMPT, max_tokens=0)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=model, prompt=PROMPT, temperature=-1)


def test_sdk_not_found(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        client.completions.create(model="no-such-model", prompt=PROMPT)
    assert "no-such-model" in caught.value.message and caught.value.body["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "x"}])


def test_context_length_says_both_numbers(client: openai.OpenAI, model: str, model_card: dict) -> None:
    limit = model_card["max_model_len"]
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=model, prompt=PROMPT, max_tokens=limit)
    message = caught.value.body["message"]
    assert str(limit) in message and f"{limit} for the completion" in message
    assert caught.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=model, prompt=[5] * (limit + 1), max_tokens=1)
    assert str(limit + 1) in caught.value.body["message"] and str(limit) in caught.value.body["message"]


def test_unsupported_and_unknown_fields(http: httpx.Client) -> None:
    error = assert_error(http.post("/v1/completions", json={"prompt": PROMPT, "suffix": "x"}), 400, "suffix")
    assert "not supported" in error["message"]
    assert_error(http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                          "functions": [{"name": "f"}]}), 400, "functions")
    error = assert_error(http.post("/v1/completions", json={"prompt": PROMPT, "temprature": 1}), 400, "temprature")
    assert "Unrecognized" in error["message"]


@pytest.mark.parametrize("body, param", [
    ({}, "prompt"),
    ({"prompt": 5}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [[]]}, "prompt"),
    ({"prompt": [1, -1]}, "prompt"),
    ({"prompt": [10**9]}, "prompt"),
    ({"prompt": PROMPT, "max_tokens": "16"}, "max_tokens"),
    ({"prompt": PROMPT, "max_tokens": 1.5}, "max_tokens"),
    ({"prompt": PROMPT, "n": 1000}, "n"),
    ({"prompt": PROMPT, "n": True}, "n"),
    ({"prompt": PROMPT, "temperature": "hot"}, "temperature"),
    ({"prompt": PROMPT, "top_p": 0}, "top_p"),
    ({"prompt": PROMPT, "logprobs": -1}, "logprobs"),
    ({"prompt": PROMPT, "stop": [1, 2]}, "stop.0"),
    ({"prompt": PROMPT, "stop": [""]}, "stop"),
    ({"prompt": PROMPT, "logit_bias": {"abc": 1}}, "logit_bias"),
    ({"prompt": PROMPT, "logit_bias": {"5": 1000}}, "logit_bias"),
    ({"prompt": PROMPT, "seed": 2**70}, "seed"),
    ({"prompt": PROMPT, "min_tokens": 10, "max_tokens": 5}, "min_tokens"),
    ({"prompt": PROMPT, "stream_options": {"include_usage": True}}, None),
    ({"prompt": PROMPT, "stop_token_ids": [10**9]}, "stop_token_ids"),
    ({"prompt": PROMPT, "best_of": 3}, None),
    ({"prompt": PROMPT, "model": 7}, "model"),
])
def test_bad_completion_bodies(http: httpx.Client, body: dict, param: str | None) -> None:
    assert_error(http.post("/v1/completions", json=body), 400, param)


@pytest.mark.parametrize("messages, param", [
    ("hi", "messages"),
    ([{"role": "user"}], "messages.0.content"),
    ([{"role": "function", "content": "x"}], "messages.0.role"),
    ([{"role": "tool", "content": "x"}], "messages.0.tool_call_id"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
     "messages.0.content.0.image_url"),  # a text model takes no images
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], "messages.0.content.0.image_url.url"),
    ([{"role": "user", "content": [{"type": "text"}]}], "messages.0.content.0.text"),
    ([{"role": "user", "content": [{"type": "audio"}]}], "messages.0.content"),
    ([{"role": "user", "content": 3}], "messages.0.content"),
])
def test_bad_chat_bodies(http: httpx.Client, messages: object, param: str) -> None:
    assert_error(http.post("/v1/chat/completions", json={"messages": messages}), 400, param)


def test_chat_top_logprobs_needs_logprobs(http: httpx.Client) -> None:
    body = {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}
    assert_error(http.post("/v1/chat/completions", json=body), 400)


@pytest.mark.parametrize("content", [b"{", b"", b"[1, 2]", b"null", b'"text"', b"\xff\xfe", b"{" * 100_000])
def test_malformed_json(http: httpx.Client, content: bytes) -> None:
    response = http.post("/v1/completions", content=content, headers={"Content-Type": "application/json"})
    assert_error(response, 400)


@pytest.mark.parametrize("content", [b"\xc1", b"\x92\x01", msgpack.packb([1, 2]), b"", b"\x85"])
def test_malformed_msgpack(http: httpx.Client, content: bytes) -> None:
    response = http.post("/v1/completions", content=content, headers={"Content-Type": "application/msgpack"})
    assert_error(response, 400)


def test_body_over_limit_is_413(http: httpx.Client) -> None:
    huge = b'{"prompt": "' + b"a" * (17 * 1024 * 1024) + b'"}'
    assert_error(http.post("/v1/completions", content=huge), 413)


def test_unknown_route_and_method(http: httpx.Client) -> None:
    assert_error(http.get("/v1/nothing"), 404)
    not_allowed = http.get("/v1/completions")
    assert_error(not_allowed, 405)
    assert not_allowed.headers["allow"] == "POST"
    assert_error(http.get("/v1/models/no-such-model"), 404, "model")


def test_errors_in_msgpack_when_asked(http: httpx.Client) -> None:
    response = http.post("/v1/completions", content=msgpack.packb({"prompt": PROMPT, "n": 0}),
                         headers={"Content-Type": "application/msgpack", "Accept": "application/msgpack"})
    assert response.status_code == 400 and response.headers["content-type"] == "application/msgpack"
    assert msgpack.unpackb(response.content)["error"]["param"] == "n"


def abandon_upload(server, head: bytes, sent: bytes) -> None:
    """Send a request head promising 1,000 body bytes, then `sent` of them, then leave."""
    host, port = server.base_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n" + head + b"Content-Length: 1000\r\n\r\n" + sent)
        time.sleep(0.3)


def log_since(server, start: int, wanted: str, timeout_s: float = 60.0) -> str:
    """The server's log after offset `start`, once it mentions `wanted` (AssertionError after the timeout)."""
    wait_for(lambda: wanted in server.log()[start:], f"the log to mention {wanted!r}", timeout_s)
    return server.log()[start:]


def test_upload_abandoned_midway_is_one_info_line(server) -> None:
    """A client that leaves during its upload is its own doing: logged once, no traceback, no 500."""
    start = len(server.log())  # only this test's part of the shared server's log
    abandon_upload(server, b"Content-Type: application/json\r\n", b'{"prompt": "ab')
    log = log_since(server, start, "the client left after sending")
    line = next(x for x in log.splitlines() if "the client left after sending" in x)
    assert " INFO " in line and "14 body bytes" in line
    assert "Traceback" not in log and " 500" not in log


def test_every_response_carries_a_request_id(server, http: httpx.Client) -> None:
    """The client's x-request-id is echoed, is the completion's id and tags the request's log lines;
    without one (or with an unusable one) the server makes one up."""
    start = len(server.log())
    given = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 1},
                      headers={"x-request-id": "trace-42.a"})
    assert given.headers["x-request-id"] == "trace-42.a" and given.json()["id"] == "cmpl-trace-42.a"
    again = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 1},
                      headers={"x-request-id": "trace-42.a"})  # the same id twice is fine
    assert again.status_code == 200
    for headers in ({}, {"x-request-id": "spaces are not allowed"}):
        made = http.get("/v1/models", headers=headers).headers["x-request-id"]
        assert len(made) == 32 and made != "spaces are not allowed"
    assert http.get("/v1/nothing").headers["x-request-id"]  # errors too
    refused = http.post("/v1/completions", json={"prompt": PROMPT, "n": 0}, headers={"x-request-id": "bad-n"})
    assert refused.status_code == 400 and refused.headers["x-request-id"] == "bad-n"
    abandon_upload(server, b"x-request-id: gone-early\r\n", b"{")
    assert "[request_id=gone-early]" in log_since(server, start, "[request_id=gone-early]")
