"""/v1/chat/completions through the official OpenAI SDK against a real server."""

from __future__ import annotations

import asyncio

import openai

from pagegate.gateway.schemas import ChatCompletionChunk, ChatCompletionResponse

MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say something."}]


def test_chat_shape(client: openai.OpenAI, model: str, http) -> None:
    result = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=8, temperature=0)
    assert result.object == "chat.completion" and result.id.startswith("chatcmpl-")
    [choice] = result.choices
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert choice.finish_reason in ("stop", "length") and 0 < result.usage.completion_tokens <= 8
    raw = http.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 3}).json()
    ChatCompletionResponse.model_validate(raw)


def test_prompt_is_the_chat_template(client: openai.OpenAI, model: str, http) -> None:
    rendered = http.post("/tokenize", json={"messages": MESSAGES}).json()
    result = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=2)
    assert result.usage.prompt_tokens == rendered["count"]
    parts = [{"role": "user", "content": [{"type": "text", "text": "Say "}, {"type": "text", "text": "something."}]}]
    as_parts = http.post("/tokenize", json={"messages": [MESSAGES[0], *parts]}).json()
    assert as_parts["tokens"] == rendered["tokens"]


def test_stream_order_role_content_finish(client: openai.OpenAI, model: str, http) -> None:
    args = dict(model=model, messages=MESSAGES, max_tokens=10, temperature=0, extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**args)
    chunks = list(client.chat.completions.create(**args, stream=True, stream_options={"include_usage": True}))
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    deltas = [c.choices[0] for c in chunks if c.choices]
    assert deltas[0].delta.role == "assistant" and deltas[0].delta.content == ""
    assert deltas[-1].finish_reason == "length" and deltas[-1].delta.content is None
    assert all(d.finish_reason is None for d in deltas[:-1])
    assert "".join(d.delta.content or "" for d in deltas) == whole.choices[0].message.content
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    raw_events = http.post("/v1/chat/completions", json={**_body(args), "stream": True}).text.split("\n\n")
    assert raw_events[-2:] == ["data: [DONE]", ""]
    for event in raw_events[:-2]:
        ChatCompletionChunk.model_validate_json(event.removeprefix("data: "))


def _body(args: dict) -> dict:
    body = {k: v for k, v in args.items() if k != "extra_body"}
    return {**body, **args.get("extra_body", {})}


def test_max_completion_tokens_and_n(client: openai.OpenAI, model: str) -> None:
    result = client.chat.completions.create(model=model, messages=MESSAGES, max_completion_tokens=3, n=2,
                                            extra_body={"ignore_eos": True})
    assert sorted(c.index for c in result.choices) == [0, 1]
    assert result.usage.completion_tokens == 6


def test_chat_logprobs(client: openai.OpenAI, model: str) -> None:
    result = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=4, logprobs=True,
                                            top_logprobs=3, extra_body={"ignore_eos": True})
    content = result.choices[0].logprobs.content
    assert len(content) == 4
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        assert bytes(entry.bytes).decode(errors="replace") == entry.token
    plain = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=2)
    assert plain.choices[0].logprobs is None


def test_chat_seed_and_stop(client: openai.OpenAI, model: str) -> None:
    args = dict(model=model, messages=MESSAGES, max_tokens=16, temperature=1.0, extra_body={"ignore_eos": True})
    first = client.chat.completions.create(**args, seed=7).choices[0].message.content
    assert client.chat.completions.create(**args, seed=7).choices[0].message.content == first
    stop = first[4:6]
    if stop.strip():
        cut = client.chat.completions.create(**args, seed=7, stop=stop).choices[0]
        assert cut.message.content == first[: first.index(stop)] and cut.finish_reason == "stop"


def test_concurrent_streams(server, model: str) -> None:
    async def one(async_client: openai.AsyncOpenAI, i: int) -> str:
        stream = await async_client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": f"Count to {i}"}], max_tokens=8, stream=True,
            extra_body={"ignore_eos": True})
        return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

    async def all_of_them() -> list[str]:
        async with openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key="-", max_retries=0) as async_client:
            return await asyncio.gather(*(one(async_client, i) for i in range(12)))

    texts = asyncio.run(all_of_them())
    assert len(texts) == 12 and all(isinstance(t, str) for t in texts)
