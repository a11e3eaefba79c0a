"""A client that goes away aborts its request: every KV page is back within an engine step or so."""

from __future__ import annotations

import httpx
import openai
import pytest

LONG = {"prompt": "Tell me a long story", "max_tokens": 400, "ignore_eos": True}


def test_cut_stream_frees_pages(server, http: httpx.Client, kv_pages) -> None:
    assert kv_pages.wait_free() == 0
    with httpx.Client(base_url=server.base_url, timeout=60) as own:
        with own.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as response:
            lines = response.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
            assert kv_pages.in_use() > 0  # the request holds pages while it runs
    assert kv_pages.wait_free(timeout_s=5) == 0


def test_cut_sdk_stream_frees_pages(client: openai.OpenAI, model: str, kv_pages) -> None:
    stream = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Go on"}],
                                            max_tokens=400, stream=True, extra_body={"ignore_eos": True})
    for index, _ in enumerate(stream):
        if index == 3:
            break
    stream.close()
    assert kv_pages.wait_free(timeout_s=5) == 0


def test_abandoned_non_streamed_request_frees_pages(server, kv_pages) -> None:
    with httpx.Client(base_url=server.base_url, timeout=0.5) as impatient:
        with pytest.raises(httpx.ReadTimeout):
            impatient.post("/v1/completions", json={**LONG, "max_tokens": 2000, "n": 2})
    assert kv_pages.wait_free(timeout_s=5) == 0
