"""The transport holds under cheap attacks, against one real server (`guarded`):

- a body of millions of empty maps/objects or arrays (1 byte each in msgpack, 64 bytes each in Python) is
  refused with a 413 before it is decoded, while brackets inside strings do not count;
- a connection that never sends a byte is closed after --idle-connection-timeout, and one past
  --max-connections takes the place of the longest idle one (or is closed as soon as it is accepted when all
  are busy), and the listen backlog fits in what the file limit
  leaves (silent sockets cannot use up the file limit);
- stream_options.continuous_usage_stats puts the usage so far on every chunk, as vLLM does.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator

import httpx
import openai
import pytest

from pagegate.gateway.cli import build_parser, configs_from_args
from pagegate.gateway.codec import MAX_BODY_CONTAINERS
from pagegate.gateway.http_protocol import DEFAULT_BACKLOG, FILE_HEADROOM, MIN_BACKLOG, listen_backlog
from pagegate.testing.launcher import ServerProcess
from tests.gateway.server_args import server_args

MAX_CONNECTIONS = 8
MSGPACK = {"Content-Type": "application/msgpack"}
EMPTY_MAPS = 15_000_000  # a 15 MB msgpack body, under the 16 MiB limit, that used to decode to ~1 GB


@pytest.fixture(scope="module")
def guarded() -> Iterator[ServerProcess]:
    args = server_args("--idle-connection-timeout", "1", "--max-connections", str(MAX_CONNECTIONS),
                       "--num-kv-blocks", "128")
    with ServerProcess(args) as process:
        yield process


@pytest.fixture()
def sdk(guarded: ServerProcess) -> Iterator[openai.OpenAI]:
    # Retries only redo a request whose connection failed: the server closes pooled connections idle for 1 s.
    with openai.OpenAI(base_url=guarded.base_url + "/v1", api_key="unused", max_retries=2, timeout=120) as client:
        yield client


def post(server: ServerProcess, path: str, content: bytes, headers: dict[str, str] | None = None) -> httpx.Response:
    return httpx.post(server.base_url + path, content=content, headers=headers, timeout=120)


def assert_too_many_containers(response: httpx.Response) -> None:
    assert response.status_code == 413, response.text[:300]
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == "too_many_containers" and str(MAX_BODY_CONTAINERS) in error["message"]


def msgpack_array(count: int, item: bytes) -> bytes:
    return b"\xdd" + count.to_bytes(4, "big") + item * count  # array32 header, then `count` items


@pytest.mark.parametrize("item", [b"\x80", b"\x90"], ids=["empty maps", "empty arrays"])
def test_a_msgpack_body_of_millions_of_containers_gets_413(guarded: ServerProcess, item: bytes) -> None:
    assert_too_many_containers(post(guarded, "/v1/completions", msgpack_array(EMPTY_MAPS, item), MSGPACK))
    in_a_field = b"\x82\xa6prompt" + msgpack_array(EMPTY_MAPS, item) + b"\xaamax_tokens\x01"
    assert_too_many_containers(post(guarded, "/tokenize", in_a_field, MSGPACK))
    assert httpx.get(guarded.base_url + "/health").status_code == 200


@pytest.mark.parametrize("item", [b"{}", b"[]"], ids=["empty objects", "empty arrays"])
def test_a_json_body_of_millions_of_containers_gets_413(guarded: ServerProcess, item: bytes) -> None:
    body = b'{"prompt": [' + b",".join([item] * 5_000_000) + b'], "max_tokens": 1}'  # 15 MB
    assert_too_many_containers(post(guarded, "/v1/completions", body, {"Content-Type": "application/json"}))
    assert httpx.get(guarded.base_url + "/health").status_code == 200


def test_brackets_inside_strings_are_not_containers(guarded: ServerProcess) -> None:
    text = '{[\\"' * (MAX_BODY_CONTAINERS // 2 + 1)  # more brackets than the cap, all inside one string
    response = post(guarded, "/v1/completions", json.dumps({"prompt": text, "max_tokens": 1}).encode())
    assert response.status_code == 400 and response.json()["error"]["code"] == "context_length_exceeded"
    packed = b"\x82\xa6prompt\xa2hi\xaamax_tokens\x01"  # a plain msgpack request still decodes
    assert post(guarded, "/v1/completions", packed, MSGPACK).status_code == 200


def connect(server: ServerProcess) -> socket.socket:
    return socket.create_connection((server.host, server.port), timeout=30)  # 30 s: a hang guard, not a bound


def closed_by_server(sock: socket.socket) -> bool:
    """Read until the server ends the connection: True on its close (or reset), False if it sent something."""
    try:
        return sock.recv(65536) == b""
    except ConnectionResetError:
        return True


def get_health(sock: socket.socket) -> bytes:
    """One keep-alive GET /health on `sock`: the response's status line (b"" if the server closed instead)."""
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: test\r\n\r\n")
    reply = b""
    while b"\r\n\r\n" not in reply:
        chunk = sock.recv(65536)
        if not chunk:
            return b""
        reply += chunk
    head, _, body = reply.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    length = next(int(line.split(b":")[1]) for line in lines if line.lower().startswith(b"content-length:"))
    while len(body) < length:
        body += sock.recv(65536)
    return lines[0]


def test_a_silent_connection_is_closed(guarded: ServerProcess) -> None:
    with connect(guarded) as silent:
        assert closed_by_server(silent)  # on the old server it stayed open until the client gave up
    with connect(guarded) as served:
        assert get_health(served).startswith(b"HTTP/1.1 200")
        assert closed_by_server(served)  # and after a response, as before (uvicorn's keep-alive timeout)


def held_connection(server: ServerProcess) -> socket.socket:
    """A connection the server has accepted and keeps: served once, then half a request head, so neither the
    idle timeout nor the 30 s request timeout closes it during the test. Retried while the server still counts
    a connection of an earlier test that is closing."""
    for _ in range(50):
        sock = connect(server)
        try:
            if get_health(sock).startswith(b"HTTP/1.1 200"):
                sock.sendall(b"GET /health HTTP/1.1\r\n")
                return sock
        except ConnectionResetError:
            pass
        sock.close()
        time.sleep(0.1)
    raise AssertionError("the server did not keep a connection")


def test_connections_past_the_cap_are_closed_at_once(guarded: ServerProcess) -> None:
    held = [held_connection(guarded) for _ in range(MAX_CONNECTIONS)]
    try:
        with connect(guarded) as extra:
            assert closed_by_server(extra)  # accepted and closed: its file descriptor is free again
        with pytest.raises(httpx.TransportError):
            httpx.get(guarded.base_url + "/health")
        held.pop().close()
        for _ in range(50):  # the server notices the close within a loop iteration or two
            try:
                if httpx.get(guarded.base_url + "/health").status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.1)
        else:
            raise AssertionError("a freed slot was not served")
    finally:
        for sock in held:
            sock.close()


def test_connection_flags() -> None:
    defaults = configs_from_args(build_parser().parse_args([]))[1]
    assert (defaults.idle_connection_timeout_s, defaults.max_connections) == (5.0, 512)
    flags = ["--idle-connection-timeout", "2.5", "--max-connections", "64"]
    config = configs_from_args(build_parser().parse_args(flags))[1]
    assert (config.idle_connection_timeout_s, config.max_connections) == (2.5, 64)
    for bad in (["--max-connections", "0"], ["--idle-connection-timeout", "0"], ["--max-connections", "x"]):
        with pytest.raises(SystemExit):
            build_parser().parse_args(bad)


def test_a_burst_of_connections_fits_in_the_file_limit(caplog: pytest.LogCaptureFixture) -> None:
    # asyncio accepts up to the backlog at once before any is counted: what the cap leaves of the limit bounds it.
    assert listen_backlog(512, 1024) == 1024 - 512 - FILE_HEADROOM
    assert listen_backlog(8, 1 << 20) == DEFAULT_BACKLOG
    with caplog.at_level("WARNING", logger="pagegate.gateway"):
        assert listen_backlog(1000, 1024) == MIN_BACKLOG
    assert "ulimit -n" in caplog.text


CONTINUOUS = {"include_usage": True, "continuous_usage_stats": True}
MESSAGES = [{"role": "user", "content": "Say something."}]
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def served_model(guarded: ServerProcess) -> str:
    return httpx.get(guarded.base_url + "/v1/models").json()["data"][0]["id"]


def assert_running_usage(chunks: list, tokens_in: list[int]) -> None:
    """Every chunk carries the usage so far: the prompt's tokens throughout, the generated ones as the chunks
    (`tokens_in` each, as their logprobs count them) add up, then the usage-only last chunk as before."""
    assert all(chunk.usage is not None for chunk in chunks), [chunk.usage is None for chunk in chunks]
    prompt_tokens = chunks[0].usage.prompt_tokens
    assert prompt_tokens > 0 and all(chunk.usage.prompt_tokens == prompt_tokens for chunk in chunks)
    so_far = 0
    for chunk, tokens in zip(chunks[:-1], tokens_in, strict=True):
        so_far += tokens
        assert chunk.usage.completion_tokens == so_far and chunk.usage.total_tokens == prompt_tokens + so_far
    assert so_far == MAX_TOKENS
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == MAX_TOKENS


def test_continuous_usage_on_chat_chunks(sdk: openai.OpenAI, served_model: str) -> None:
    args = dict(model=served_model, messages=MESSAGES, max_tokens=MAX_TOKENS, extra_body={"ignore_eos": True})
    chunks = list(sdk.chat.completions.create(**args, stream=True, stream_options=CONTINUOUS, logprobs=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert_running_usage(chunks, [len(c.choices[0].logprobs.content) if c.choices[0].logprobs else 0
                                  for c in chunks[:-1]])
    assert sdk.chat.completions.create(**args).usage.prompt_tokens == chunks[0].usage.prompt_tokens


def test_continuous_usage_on_completion_chunks(sdk: openai.OpenAI, served_model: str) -> None:
    args = dict(model=served_model, prompt="Once upon a time", max_tokens=MAX_TOKENS, stream=True,
                extra_body={"ignore_eos": True})
    chunks = list(sdk.completions.create(**args, stream_options=CONTINUOUS, logprobs=0))
    assert_running_usage(chunks, [len(c.choices[0].logprobs.tokens) for c in chunks[:-1]])
    # As in vLLM, continuous_usage_stats alone adds nothing: usage comes with include_usage.
    plain = list(sdk.completions.create(**args, stream_options={"continuous_usage_stats": True}))
    assert all(chunk.usage is None for chunk in plain)


def test_a_newcomer_takes_the_place_of_the_longest_idle_connection(guarded: ServerProcess) -> None:
    """MAX_CONNECTIONS silent sockets must not lock others out: the oldest makes room for a new connection."""
    silent = [connect(guarded) for _ in range(MAX_CONNECTIONS)]
    try:
        with connect(guarded) as newcomer:
            assert get_health(newcomer).startswith(b"HTTP/1.1 200")
        assert closed_by_server(silent[0])
    finally:
        for sock in silent:
            sock.close()
