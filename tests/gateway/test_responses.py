"""POST /v1/responses through the official OpenAI SDK against the shared server: plain and streamed answers,
items, tools, structured text, stored conversations that continue with previous_response_id, and bad input."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"],
                          "additionalProperties": False}}


def test_a_string_input_gets_a_message(client: openai.OpenAI, model: str) -> None:
    response = client.responses.create(model=model, input="Say hello.", max_output_tokens=8, temperature=0)
    assert response.object == "response" and response.id.startswith("resp_")
    assert response.status in ("completed", "incomplete")
    message = response.output[-1]
    assert message.type == "message" and message.role == "assistant"
    assert response.output_text == message.content[0].text and response.output_text
    assert response.usage.output_tokens >= 1 and response.usage.input_tokens > 5


def test_max_output_tokens_makes_it_incomplete(client: openai.OpenAI, model: str) -> None:
    response = client.responses.create(model=model, input="Count to one hundred.", max_output_tokens=3,
                                       temperature=0)
    assert response.status == "incomplete"
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.output_tokens == 3


def test_the_stream_matches_the_whole_answer(client: openai.OpenAI, model: str) -> None:
    whole = client.responses.create(model=model, input="Name a colour.", max_output_tokens=12, temperature=0,
                                    store=False)
    kinds = []
    with client.responses.stream(model=model, input="Name a colour.", max_output_tokens=12, temperature=0,
                                 store=False) as stream:
        for event in stream:
            kinds.append(event.type)
        final = stream.get_final_response()
    assert final.output_text == whole.output_text
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[2] == "response.output_item.added" and "response.output_text.delta" in kinds
    assert kinds[-1] == "response.completed" and final.status == whole.status
    assert kinds.index("response.output_text.done") < kinds.index("response.output_item.done")


def test_raw_stream_events_are_numbered_in_order(client: openai.OpenAI, model: str) -> None:
    events = list(client.responses.create(model=model, input="Hi", max_output_tokens=4, stream=True, store=False))
    assert [event.sequence_number for event in events] == list(range(len(events)))
    assert events[-1].response.output[-1].content[0].text == "".join(
        event.delta for event in events if event.type == "response.output_text.delta")


def test_instructions_and_items(client: openai.OpenAI, model: str) -> None:
    items = [{"role": "user", "content": "What is 2 + 2?"},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "4."}]},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "And 3 + 3?"}]}]
    with_instructions = client.responses.create(model=model, input=items, instructions="Answer with a number.",
                                                max_output_tokens=4, temperature=0, store=False)
    without = client.responses.create(model=model, input=items, max_output_tokens=4, temperature=0, store=False)
    assert with_instructions.instructions == "Answer with a number."
    assert with_instructions.usage.input_tokens > without.usage.input_tokens


def test_a_named_function_is_called(client: openai.OpenAI, model: str) -> None:
    response = client.responses.create(model=model, input="What is the weather in Paris?", tools=[WEATHER],
                                       tool_choice={"type": "function", "name": "get_weather"},
                                       max_output_tokens=48, temperature=0, store=False)
    calls = [item for item in response.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and calls[0].call_id
    assert json.loads(calls[0].arguments)["city"] in ("Paris", "Rome")
    assert response.status == "completed"


def test_a_function_result_goes_back(client: openai.OpenAI, model: str) -> None:
    items = [{"role": "user", "content": "Weather in Paris?"},
             {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
             {"type": "function_call_output", "call_id": "call_1", "output": "Sunny, 21 C"}]
    response = client.responses.create(model=model, input=items, tools=[WEATHER], tool_choice="none",
                                       max_output_tokens=6, temperature=0, store=False)
    assert response.output[-1].type == "message"


def test_json_schema_text_format(client: openai.OpenAI, model: str) -> None:
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}  # an integer could run past any token budget
    response = client.responses.create(model=model, input="Is 2 + 2 four? As JSON", max_output_tokens=24,
                                       temperature=0, store=False,
                                       text={"format": {"type": "json_schema", "name": "flag", "schema": schema}})
    assert response.status == "completed"
    assert isinstance(json.loads(response.output_text)["ok"], bool)


def test_three_turns_continue_a_stored_conversation(client: openai.OpenAI, model: str) -> None:
    first = client.responses.create(model=model, input="My name is Ada. Remember it.", max_output_tokens=8,
                                    temperature=0)
    second = client.responses.create(model=model, input="What is my name?", previous_response_id=first.id,
                                     max_output_tokens=8, temperature=0)
    third = client.responses.create(model=model, input="Spell it.", previous_response_id=second.id,
                                    max_output_tokens=8, temperature=0)
    assert second.previous_response_id == first.id
    # each turn's prompt is the one before, its answer and the new input: its pages are there already
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens - 2
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens - 16
    assert third.usage.input_tokens_details.cached_tokens >= second.usage.input_tokens - 16
    stateless = client.responses.create(
        model=model, temperature=0, max_output_tokens=8, store=False,
        input=[{"role": "user", "content": "My name is Ada. Remember it."},
               {"role": "assistant", "content": first.output_text}, {"role": "user", "content": "What is my name?"}])
    assert stateless.output_text == second.output_text
    assert client.responses.retrieve(second.id).output_text == second.output_text
    items = client.responses.input_items.list(third.id, order="asc")
    texts = [item.content[0].text for item in items.data if item.type == "message"]
    assert texts[0] == "My name is Ada. Remember it." and texts[-1] == "Spell it."


def test_delete_and_unknown_ids(client: openai.OpenAI, model: str) -> None:
    response = client.responses.create(model=model, input="Hi", max_output_tokens=2)
    client.responses.delete(response.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(response.id)
    with pytest.raises(openai.NotFoundError) as caught:
        client.responses.create(model=model, input="Hi", previous_response_id="resp_nope", max_output_tokens=2)
    assert caught.value.body["param"] == "previous_response_id"


def test_unstored_responses_are_not_kept(client: openai.OpenAI, model: str) -> None:
    response = client.responses.create(model=model, input="Hi", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(response.id)


@pytest.mark.parametrize("body, param", [
    ({"input": []}, "input"),
    ({"input": [{"type": "message", "role": "robot", "content": "x"}]}, "input.0.role"),  # no item type in it
    ({"input": [{"role": "user", "content": [{"type": "input_text"}]}]}, "input.0.content.0.text"),
    ({"input": [{"type": "function_call_output", "call_id": "nope", "output": "x"}]}, "input.0.call_id"),
    ({"input": "x", "tool_choice": "required"}, None),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "x", "frobnicate": 1}, "frobnicate"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "flag"}}}, "text.format.schema"),
    ({"input": "x", "metadata": {f"key{i}": "v" for i in range(17)}}, "metadata"),  # OpenAI: at most 16 keys,
    ({"input": "x", "metadata": {"k" * 65: "v"}}, "metadata"),  # of at most 64 characters,
    ({"input": "x", "metadata": {"k": "v" * 513}}, "metadata"),  # with values of at most 512
    ({"input": [{"type": "reasoning", "summary": []}] * 16_385}, "input"),  # OpenAI's bound on input items
    # the chat request a Responses request becomes: its errors name the Responses fields
    ({"input": "word " * 200_000}, "input"),
    ({"input": "x", "tools": [{**WEATHER, "parameters": {"type": "string"}}]}, "tools.0.parameters"),
    ({"input": "x", "max_output_tokens": 1 << 30}, "input"),
])
def test_bad_input_is_a_400(http: httpx.Client, model: str, body: dict, param: str | None) -> None:
    reply = http.post("/v1/responses", json={"model": model, **body})
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"]
    if param is not None:
        assert error["param"] == param


def test_errors_name_the_fields_sent(client: openai.OpenAI, model: str) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model=model, input="x", text={"format": {"type": "json_schema", "name": "x"}})
    assert caught.value.body["param"] == "text.format.schema" and "text.format.schema" in caught.value.message
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model=model, input="word " * 200_000)
    assert caught.value.body["param"] == "input" and caught.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model=model, input=[{"role": "user", "content": "x"}] * 16_385)
    assert caught.value.body["param"] == "input" and caught.value.code == "array_above_max_length"


def test_metadata_within_openai_s_bounds_is_echoed(client: openai.OpenAI, model: str) -> None:
    metadata = {f"{i:02d}" + "k" * 62: "v" * 512 for i in range(16)}
    response = client.responses.create(model=model, input="Hi", max_output_tokens=1, store=False, metadata=metadata)
    assert response.metadata == metadata


def test_a_long_stored_conversation_lists_every_item_once(client: openai.OpenAI, model: str) -> None:
    """Each turn hands back 300 reasoning items (as agents do); every turn's items are listed once, in order,
    newest first by default, and pages walk the whole chain."""
    previous = None
    sent: list[str] = []
    for turn in range(4):
        reasoning = [{"type": "reasoning", "id": f"rs_{turn}_{i}", "summary": [{"type": "summary_text", "text": "t"}]}
                     for i in range(300)]
        response = client.responses.create(model=model, input=[*reasoning, {"role": "user", "content": f"Turn {turn}"}],
                                           previous_response_id=previous, max_output_tokens=2, temperature=0)
        sent += [item["id"] for item in reasoning] + ["?"] + [item.id for item in response.output]
        previous = response.id
    listed = [item.id for item in client.responses.input_items.list(previous, order="asc", limit=100)]
    assert len(listed) == len(sent) - len(response.output)  # the last turn's output is no input
    assert all(want in ("?", got) for want, got in zip(sent, listed, strict=False))
    newest = client.responses.input_items.list(previous, limit=3)
    assert [item.id for item in newest.data] == listed[::-1][:3] and newest.has_more


def test_a_stored_response_is_its_key_s_and_outlives_a_restart(tmp_path) -> None:
    """Another API key gets a 404 for it; with --responses-store-path it is there after a restart and its
    conversation goes on."""
    from pagegate.testing.launcher import ServerProcess
    from tests.gateway.server_args import server_args

    args = server_args("--num-kv-blocks", "128", "--api-key", "key-a", "--api-key", "key-b",
                       "--responses-store-path", str(tmp_path / "responses.sqlite"))
    with ServerProcess(args) as server:
        alice, bob = (openai.OpenAI(base_url=server.base_url + "/v1", api_key=key, max_retries=0, timeout=120)
                      for key in ("key-a", "key-b"))
        first = alice.responses.create(input="My name is Ada.", max_output_tokens=4, temperature=0)
        with pytest.raises(openai.NotFoundError):
            bob.responses.retrieve(first.id)
        with pytest.raises(openai.NotFoundError):
            bob.responses.create(input="And?", previous_response_id=first.id, max_output_tokens=2)
        with pytest.raises(openai.NotFoundError):
            bob.responses.delete(first.id)
    with ServerProcess(args) as server:
        alice = openai.OpenAI(base_url=server.base_url + "/v1", api_key="key-a", max_retries=0, timeout=120)
        assert alice.responses.retrieve(first.id).output_text == first.output_text
        second = alice.responses.create(input="What is my name?", previous_response_id=first.id,
                                        max_output_tokens=4, temperature=0)
        assert second.usage.input_tokens > first.usage.input_tokens
