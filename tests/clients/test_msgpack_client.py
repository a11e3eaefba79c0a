"""MsgpackClient and AsyncMsgpackClient against a real server."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from pagegate.clients import (
    AsyncMsgpackClient,
    AuthenticationError,
    BadRequestError,
    MsgpackClient,
    NotFoundError,
    PagegateError,
)
from pagegate.testing.launcher import wait_for

API_KEY = "client-key"  # as in conftest.SERVER_ARGS
MESSAGES = [{"role": "user", "content": "Hello there"}]


@pytest.fixture(scope="module")
def client(server):
    with MsgpackClient(server.base_url + "/v1", api_key=API_KEY) as session:
        yield session


def test_models_and_completions(client: MsgpackClient) -> None:
    [card] = client.models()
    result = client.completions("Once upon a time", model=card["id"], max_tokens=5, temperature=0, ignore_eos=True)
    assert result["object"] == "text_completion" and result["usage"]["completion_tokens"] == 5
    ids = client.completions([1, 2, 3], max_tokens=2)["usage"]
    assert ids["prompt_tokens"] == 3


def test_stream_completions_matches(client: MsgpackClient) -> None:
    args = dict(max_tokens=8, temperature=0, ignore_eos=True)
    whole = client.completions("Once upon a time", **args)["choices"][0]["text"]
    chunks = list(client.stream_completions("Once upon a time", **args, stream_options={"include_usage": True}))
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == whole
    assert chunks[-1]["usage"]["completion_tokens"] == 8


def test_chat_and_stream_chat(client: MsgpackClient) -> None:
    whole = client.chat(MESSAGES, max_tokens=6, temperature=0)
    assert whole["choices"][0]["message"]["role"] == "assistant"
    chunks = list(client.stream_chat(MESSAGES, max_tokens=6, temperature=0))
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    assert text == whole["choices"][0]["message"]["content"]
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")


def test_typed_errors_carry_the_message(server, client: MsgpackClient) -> None:
    with pytest.raises(BadRequestError) as caught:
        client.completions("x", n=0)
    assert caught.value.status_code == 400 and caught.value.param == "n" and "n" in caught.value.message
    with pytest.raises(NotFoundError):
        client.chat(MESSAGES, model="missing")
    with pytest.raises(BadRequestError):
        list(client.stream_completions("x", max_tokens=0))
    with MsgpackClient(server.base_url, api_key="wrong") as bad, pytest.raises(AuthenticationError):
        bad.models()
    assert issubclass(AuthenticationError, PagegateError)


def test_breaking_a_stream_aborts_it(server, client: MsgpackClient) -> None:
    before = _generated(server.base_url)
    for index, _ in enumerate(client.stream_completions("Go", max_tokens=500, ignore_eos=True)):
        if index == 2:
            break
    wait_for(lambda: _idle(server.base_url), "the broken stream's pages to be free", timeout_s=120, poll_s=0.05)
    assert _generated(server.base_url) - before < 500  # stopped: it did not run on to its 500th token


def _idle(base_url: str) -> bool:
    text = httpx.get(base_url + "/metrics").text
    used = [line for line in text.splitlines() if line.startswith("pagegate:kv_blocks_used ")]
    return bool(used) and all(float(line.rsplit(" ", 1)[1]) == 0 for line in used)


def _generated(base_url: str) -> float:
    """Tokens the server has generated so far (/metrics asks the engine core, so nothing lags)."""
    text = httpx.get(base_url + "/metrics").text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:generation_tokens_total"))


def test_async_client(server) -> None:
    async def run() -> None:
        async with AsyncMsgpackClient(server.base_url, api_key=API_KEY) as client:
            assert await client.models()
            result = await client.completions("Hi", max_tokens=3, ignore_eos=True)
            assert result["usage"]["completion_tokens"] == 3
            chunks = [c async for c in client.stream_chat(MESSAGES, max_tokens=3)]
            assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
            texts = await asyncio.gather(*(client.chat(MESSAGES, max_tokens=2) for _ in range(4)))
            assert len(texts) == 4
            with pytest.raises(BadRequestError):
                await client.chat([], max_tokens=2)
            with pytest.raises(BadRequestError):
                [c async for c in client.stream_completions("x", n=0)]

    asyncio.run(run())
