"""POST /v1/messages and /v1/messages/count_tokens through the official `anthropic` SDK against the shared
server: text, streams, system prompts, tools and their results, stop sequences, token counts, errors in
Anthropic's shape, and x-api-key auth."""

from __future__ import annotations

import anthropic
import httpx
import pytest

from pagegate.testing.launcher import ServerProcess
from tests.gateway.conftest import KVPages
from tests.gateway.server_args import server_args

WEATHER = {"name": "get_weather", "description": "The weather in a city.",
           "input_schema": {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}},
                            "required": ["city"], "additionalProperties": False}}
HELLO = [{"role": "user", "content": "Say hello."}]
GREEDY: dict = {"extra_body": {"temperature": 0}}  # today's SDK has no sampling arguments; the API still takes them


@pytest.fixture(scope="module")
def claude(server: ServerProcess) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)


def test_a_message_and_its_usage(claude: anthropic.Anthropic, model: str) -> None:
    message = claude.messages.create(model=model, max_tokens=8, messages=HELLO, **GREEDY)
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    assert message.content[0].type == "text" and message.content[0].text
    assert message.stop_reason in ("end_turn", "max_tokens")
    assert message.usage.output_tokens >= 1 and message.usage.input_tokens > 3
    again = claude.messages.create(model=model, max_tokens=8, messages=HELLO, **GREEDY)
    assert again.content[0].text == message.content[0].text
    total = again.usage.input_tokens + (again.usage.cache_read_input_tokens or 0)
    assert total == message.usage.input_tokens + (message.usage.cache_read_input_tokens or 0)


def test_max_tokens_is_the_stop_reason(claude: anthropic.Anthropic, model: str) -> None:
    message = claude.messages.create(model=model, max_tokens=2, messages=HELLO, **GREEDY,
                                     system="You count to one hundred.")
    assert message.stop_reason == "max_tokens" and message.usage.output_tokens == 2


def test_the_stream_matches_the_whole_message(claude: anthropic.Anthropic, model: str, kv_pages: KVPages) -> None:
    whole = claude.messages.create(model=model, max_tokens=10, messages=HELLO, **GREEDY)
    kinds = []
    with claude.messages.stream(model=model, max_tokens=10, messages=HELLO, **GREEDY) as stream:
        for event in stream:
            kinds.append(event.type)
        final = stream.get_final_message()
    assert final.content[0].text == whole.content[0].text and final.stop_reason == whole.stop_reason
    assert kinds[0] == "message_start" and "content_block_delta" in kinds and kinds[-1] == "message_stop"
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert kv_pages.wait_free() == 0


def test_a_stop_sequence_is_named(claude: anthropic.Anthropic, model: str) -> None:
    free = claude.messages.create(model=model, max_tokens=12, messages=HELLO, **GREEDY)
    text = free.content[0].text
    stop = text[len(text) // 2:].strip()[:3]  # greedy: the same answer comes again, up to this stop
    assert stop, f"the greedy answer {text!r} has no text to stop on"
    message = claude.messages.create(model=model, max_tokens=12, messages=HELLO, **GREEDY, stop_sequences=[stop])
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == stop
    assert all(stop not in block.text for block in message.content)


def test_a_forced_tool_is_used_and_its_result_goes_back(claude: anthropic.Anthropic, model: str) -> None:
    question = [{"role": "user", "content": "What is the weather in Paris?"}]
    message = claude.messages.create(model=model, max_tokens=40, messages=question, tools=[WEATHER], **GREEDY,
                                     tool_choice={"type": "tool", "name": "get_weather"})
    uses = [block for block in message.content if block.type == "tool_use"]
    assert len(uses) == 1 and uses[0].name == "get_weather" and uses[0].input["city"] in ("Paris", "Rome")
    assert message.stop_reason == "tool_use"
    history = [*question, {"role": "assistant", "content": message.content},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id, "content": "Sunny"}]}]
    answer = claude.messages.create(model=model, max_tokens=6, messages=history, tools=[WEATHER], **GREEDY,
                                    tool_choice={"type": "none"})
    assert answer.content[0].type == "text" and answer.stop_reason in ("end_turn", "max_tokens")


def test_a_streamed_tool_use_comes_whole(claude: anthropic.Anthropic, model: str) -> None:
    with claude.messages.stream(model=model, max_tokens=100, tools=[WEATHER], **GREEDY,
                                messages=[{"role": "user", "content": "Weather in Rome?"}],
                                tool_choice={"type": "any"}) as stream:
        final = stream.get_final_message()
    uses = [block for block in final.content if block.type == "tool_use"]
    assert uses and uses[0].name == "get_weather" and uses[0].input["city"] in ("Paris", "Rome")


def test_count_tokens_is_the_prompt_a_message_would_have(claude: anthropic.Anthropic, model: str) -> None:
    counted = claude.messages.count_tokens(model=model, messages=HELLO, system="Be brief.")
    message = claude.messages.create(model=model, max_tokens=1, messages=HELLO, system="Be brief.")
    assert counted.input_tokens == message.usage.input_tokens + (message.usage.cache_read_input_tokens or 0)


@pytest.mark.parametrize("body", [
    {"messages": HELLO},  # max_tokens is required
    {"max_tokens": 4, "messages": []},
    {"max_tokens": 4, "messages": [{"role": "robot", "content": "x"}]},
    {"max_tokens": 4, "messages": HELLO, "temperature": 1.5},
    {"max_tokens": 4, "messages": HELLO, "tool_choice": {"type": "tool", "name": "nope"}, "tools": [WEATHER]},
    {"max_tokens": 4, "messages": HELLO, "frobnicate": 1},
    {"max_tokens": 4, "messages": [{"role": "user", "content": []}]},  # a message without content
    {"max_tokens": 4, "messages": [*HELLO, {"role": "assistant", "content": ""}, *HELLO]},
    {"max_tokens": 4, "messages": [  # a tool_result answering no tool_use of the message before
        *HELLO, {"role": "assistant", "content": "Hi."},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_nope", "content": "x"}]}]},
    {"max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_nope", "content": "x"}]}]},
    {"max_tokens": 4, "messages": HELLO, "metadata": {"user_id": "u" * 257}},  # Anthropic: at most 256
    {"max_tokens": 4, "messages": HELLO, "metadata": {f"key{i}": "v" for i in range(1000)}},  # only user_id
])
def test_bad_requests_are_anthropic_400s(http: httpx.Client, model: str, body: dict) -> None:
    reply = http.post("/v1/messages", json={"model": model, **body})
    assert reply.status_code == 400, reply.text
    error = reply.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert error["error"]["message"]


CACHED = {"type": "ephemeral"}


@pytest.mark.parametrize("request_fields, named, not_named", [
    # prompt-cache breakpoints: none on an empty text block, at most 4, Anthropic's types and TTLs, 1 h before 5 min
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "", "cache_control": CACHED}]}]},
     "messages.0.content.0.text: cache_control cannot be set for empty text blocks", "TextBlock"),
    ({"system": [{"type": "text", "text": f"{i}.", "cache_control": CACHED} for i in range(5)]}, "Found 5", "chat"),
    ({"system": [{"type": "text", "text": "x", "cache_control": {"type": "ephemeral", "ttl": "2h"}}]},
     "system.0.cache_control.ttl", "CacheControl"),
    ({"tools": [{**WEATHER, "cache_control": {"type": "persistent"}}]}, "tools.0.cache_control.type", "CacheControl"),
    ({"system": [{"type": "text", "text": "x", "cache_control": CACHED}], "messages": [{"role": "user", "content": [
        {"type": "text", "text": "Hi.", "cache_control": {"type": "ephemeral", "ttl": "1h"}}]}]}, "ttl '1h'", "chat"),
    ({"tools": [WEATHER], "tool_choice": {"type": "tool"}}, "tool_choice.name", "NamedToolChoice"),
    ({"stop_sequences": [""]}, "stop_sequences", "'stop'"),
    ({"stop_sequences": [f"s{i}" for i in range(17)]}, "stop_sequences", "'stop'"),
    ({"tools": [{**WEATHER, "input_schema": {"type": "string"}}]}, "tools.0.input_schema", "function"),
    ({"messages": [*HELLO, {"role": "assistant", "content": "Hi."},
                   {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_x", "content": "x"}]}]},
     "messages.2.content.0", "tool_call"),
    ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages.0.content.0.text", "text.text"),
])
def test_errors_name_the_fields_sent(claude: anthropic.Anthropic, model: str, request_fields: dict, named: str,
                                     not_named: str) -> None:
    """A Messages request runs as a chat request; its errors still name the Messages fields."""
    fields = {"messages": HELLO, **request_fields}
    with pytest.raises(anthropic.BadRequestError) as caught:
        claude.messages.create(model=model, max_tokens=4, **fields)
    message = caught.value.body["error"]["message"]
    assert named in message and not_named not in message, message


def test_the_sdk_raises_its_own_errors(claude: anthropic.Anthropic) -> None:
    with pytest.raises(anthropic.NotFoundError) as caught:
        claude.messages.create(model="no-such-model", max_tokens=4, messages=HELLO)
    assert caught.value.body["error"]["type"] == "not_found_error"


def test_x_api_key_is_an_api_key() -> None:
    with ServerProcess(server_args("--num-kv-blocks", "128", "--api-key", "sk-test")) as server:
        good = anthropic.Anthropic(base_url=server.base_url, api_key="sk-test", max_retries=0, timeout=120)
        assert good.messages.create(model=_model(server), max_tokens=2, messages=HELLO).usage.output_tokens >= 1
        bad = anthropic.Anthropic(base_url=server.base_url, api_key="sk-wrong", max_retries=0, timeout=120)
        with pytest.raises(anthropic.AuthenticationError) as caught:
            bad.messages.create(model="m", max_tokens=2, messages=HELLO)
        assert caught.value.body["error"]["type"] == "authentication_error"


def _model(server: ServerProcess) -> str:
    reply = httpx.get(server.base_url + "/v1/models", headers={"Authorization": "Bearer sk-test"})
    return reply.json()["data"][0]["id"]
