"""One oversized request never freezes the others (issue 12): a prompt longer than max_model_len tokens
could hold is refused before tokenization, off the event loop, while /health keeps answering; a request
head past --max-header-size gets 431 and the server keeps serving."""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import pytest

from pagegate.gateway.cli import build_parser, configs_from_args
from pagegate.testing.launcher import ServerProcess

BIG_TEXT = "All work and no play makes Jack a dull boy. " * 230_000  # ~10 MB, under the 16 MiB body limit
HANG_S = 120  # only a hang runs into it: how fast /health answers is bench/health_latency.py's to measure


def assert_openai_error(response: httpx.Response, status: int, code: str, param: str | None) -> str:
    assert response.status_code == status, response.text[:500]
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert (error["code"], error["param"]) == (code, param)
    return error["message"]


def assert_refused_before_tokenizing(response: httpx.Response, param: str) -> None:
    message = assert_openai_error(response, 400, "context_length_exceeded", param)
    assert "characters long" in message, message  # the character bound, not a token count


def test_health_answers_while_a_10mb_prompt_is_refused(server: ServerProcess, http: httpx.Client, model: str) -> None:
    """Every /health probe made while the 10 MB prompt is on its way and refused answers 200, and the refusal
    comes from the character bound, before any tokenizing (the message says so): no clock decides either."""
    answer: dict[str, httpx.Response] = {}

    def send() -> None:
        body = {"model": model, "prompt": BIG_TEXT, "max_tokens": 1}
        answer["response"] = httpx.post(server.base_url + "/v1/completions", json=body, timeout=HANG_S)

    sender = threading.Thread(target=send)
    sender.start()
    probes = 0
    while True:  # at least one probe, however fast the refusal
        assert http.get("/health", timeout=HANG_S).status_code == 200
        probes += 1
        if not sender.is_alive():
            break
        time.sleep(0.01)
    sender.join()
    assert probes >= 1 and "response" in answer
    assert_refused_before_tokenizing(answer["response"], "prompt")


@pytest.mark.parametrize(("path", "field", "param"), [
    ("/v1/chat/completions", "messages", "messages"),
    ("/tokenize", "prompt", "prompt"),
])
def test_other_doors_refuse_a_10mb_text_before_tokenizing(http: httpx.Client, model: str, path: str, field: str,
                                                          param: str) -> None:
    value = [{"role": "user", "content": BIG_TEXT}] if field == "messages" else BIG_TEXT
    response = http.post(path, json={"model": model, field: value}, timeout=HANG_S)
    assert_refused_before_tokenizing(response, param)  # the character bound: nothing was tokenized


def raw_get(server: ServerProcess, header_bytes: int) -> tuple[int, bytes]:
    """GET /health with one header of `header_bytes` bytes, over a plain socket: (status, body)."""
    head = (b"GET /health HTTP/1.1\r\nHost: test\r\nConnection: close\r\nX-Padding: " + b"p" * header_bytes
            + b"\r\n\r\n")
    with socket.create_connection((server.host, server.port), timeout=HANG_S) as sock:
        sock.sendall(head)
        chunks = []
        while chunk := sock.recv(1 << 16):
            chunks.append(chunk)
    answer = b"".join(chunks)
    status_line, _, rest = answer.partition(b"\r\n")
    return int(status_line.split()[1]), rest.partition(b"\r\n\r\n")[2]


@pytest.mark.parametrize("header_bytes", [100 * 1024, 16 * 1024 * 1024])
def test_oversized_head_gets_431_and_the_server_keeps_serving(server: ServerProcess, http: httpx.Client,
                                                              header_bytes: int) -> None:
    status, body = raw_get(server, header_bytes)  # a server that read on and on would hang it into HANG_S
    assert status == 431 and json.loads(body)["error"]["code"] == "request_header_fields_too_large"
    assert http.get("/health").status_code == 200


def test_head_under_the_default_limit_is_served(server: ServerProcess) -> None:
    assert raw_get(server, 32 * 1024)[0] == 200  # past h11's own 16 KiB default, under our 64 KiB


def test_max_header_size_flag() -> None:
    assert configs_from_args(build_parser().parse_args([]))[1].max_header_bytes == 64 * 1024
    assert configs_from_args(build_parser().parse_args(["--max-header-size", "8KiB"]))[1].max_header_bytes == 8192


@pytest.fixture(scope="module")
def impatient() -> ServerProcess:
    """A server that gives each request one second to arrive whole."""
    from tests.gateway.server_args import server_args

    with ServerProcess(server_args("--request-timeout", "1", "--num-kv-blocks", "256")) as process:
        yield process


def answer_to(server: ServerProcess, sent: bytes) -> bytes:
    """What the server says (until it closes) to a client that sends `sent` and then nothing. The socket's
    timeout fails only a hang: 20 times the impatient server's 1 s, yet short of the 30 s default, so a server
    that ignored --request-timeout would still be caught."""
    with socket.create_connection((server.host, server.port), timeout=20) as sock:
        sock.sendall(sent)
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
    return reply


@pytest.mark.parametrize("sent", [
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n",  # half a head
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"pro",  # a stalled body
])
def test_a_request_that_never_arrives_whole_gets_408(impatient: ServerProcess, sent: bytes) -> None:
    reply = answer_to(impatient, sent)
    assert reply.startswith(b"HTTP/1.1 408"), reply[:200]
    assert json.loads(reply.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "request_timeout"
    assert httpx.get(impatient.base_url + "/health").status_code == 200
    slow_but_whole = httpx.post(impatient.base_url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert slow_but_whole.status_code == 200
