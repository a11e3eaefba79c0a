"""Structured outputs through the official OpenAI SDK (and msgpack) against a real server: the embedded model
knows no JSON, so only the constraint makes these outputs parse."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import msgpack
import openai
import pytest

MESSAGES = [{"role": "user", "content": "Describe a person."}]
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
JSON_SCHEMA_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}


def test_chat_response_format_json_schema(client: openai.OpenAI, model: str) -> None:
    result = client.chat.completions.create(model=model, messages=MESSAGES, response_format=JSON_SCHEMA_FORMAT,
                                            max_tokens=60, temperature=1.0, seed=3, n=2)
    for choice in result.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), PERSON)


def test_chat_stream_with_a_schema_validates(client: openai.OpenAI, model: str) -> None:
    stream = client.chat.completions.create(model=model, messages=MESSAGES, response_format=JSON_SCHEMA_FORMAT,
                                            max_tokens=60, temperature=1.0, seed=5, n=2, stream=True)
    texts = ["", ""]
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    for text in texts:
        jsonschema.validate(json.loads(text), PERSON)


@pytest.mark.parametrize("extra, check", [
    ({"guided_choice": ["sunny", "rainy"]}, lambda text: text in ("sunny", "rainy")),
    ({"guided_regex": "[0-9]{2}:[0-9]{2}"}, lambda text: re.fullmatch("[0-9]{2}:[0-9]{2}", text)),
    ({"structured_outputs": {"choice": ["yes", "no"]}}, lambda text: text in ("yes", "no")),
    ({"structured_outputs": {"grammar": 'start: "a" "b"+'}}, lambda text: re.fullmatch("ab+", text)),
    ({"guided_json": {"type": "integer", "minimum": 1, "maximum": 9}}, lambda text: 1 <= json.loads(text) <= 9),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {"enum": [1, 2]}}}},
     lambda text: json.loads(text) in (1, 2)),
])
def test_completions_take_every_way_of_asking(client: openai.OpenAI, model: str, extra: dict, check) -> None:
    result = client.completions.create(model=model, prompt="Answer:", max_tokens=40, temperature=1.0, seed=1,
                                       extra_body=extra)
    assert check(result.choices[0].text), result.choices[0].text


def test_json_object(client: openai.OpenAI, model: str) -> None:
    result = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=40, temperature=0,
                                            response_format={"type": "json_object"})
    text = result.choices[0].message.content
    assert text.startswith("{")
    if result.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)


@pytest.mark.parametrize("extra, param, words", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "response_format", "nonsense"),
    ({"guided_regex": "a(b"}, "guided_regex", "unclosed group"),
    ({"structured_outputs": {"grammar": "start: ??"}}, "structured_outputs", "Invalid structured output"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one"),
    ({"guided_json": "{not json"}, "guided_json", "Invalid structured output"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice", "only one output constraint"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "json_schema"),
])
def test_bad_constraints_are_400s(client: openai.OpenAI, model: str, kv_pages, extra: dict, param: str,
                                  words: str) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=4, extra_body=extra)
    error = caught.value.body
    assert error["param"] == param and words in error["message"], error
    assert kv_pages.wait_free() == 0


def test_msgpack_carries_the_same_fields(http: httpx.Client) -> None:
    body = {"prompt": "Pick:", "max_tokens": 8, "temperature": 1.0, "guided_choice": ["left", "right"]}
    response = http.post("/v1/completions", content=msgpack.packb(body),
                         headers={"content-type": "application/msgpack", "accept": "application/msgpack"})
    assert response.status_code == 200
    assert msgpack.unpackb(response.content)["choices"][0]["text"] in ("left", "right")
