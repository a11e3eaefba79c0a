"""Hostile grammars and tools (security review, findings 5, 7 and 10), against the shared real server: what
would hold the preparation threads or the grammar cache is refused with a 400 naming the field, before it is
compiled, and no grammar or schema the client wrote is ever a 500."""

from __future__ import annotations

import json

import httpx
import pytest

from pagegate.engine.sampling.structured import (
    MAX_GRAMMAR_BYTES,
    MAX_SCHEMA_DEPTH,
    MAX_TOOLS,
    MAX_TOOLS_BYTES,
)

MESSAGES = [{"role": "user", "content": "Hi"}]
DEPTH = 600  # past MAX_SCHEMA_DEPTH and llguidance's 128, under what the body's JSON parser takes (~1000)


def assert_400(response: httpx.Response, param: str, words: str = "") -> str:
    assert response.status_code == 400, response.text[:500]
    error = response.json()["error"]
    assert error["param"] == param, error
    assert words in error["message"], error
    return error["message"]


def chat(http: httpx.Client, model: str, **fields) -> httpx.Response:
    return http.post("/v1/chat/completions", json={"model": model, "messages": MESSAGES, "max_tokens": 1, **fields})


def function(name: str, parameters: dict | None = None) -> dict:
    body: dict = {"name": name}
    if parameters is not None:
        body["parameters"] = parameters
    return {"type": "function", "function": body}


def properties(count: int, prefix: str = "p") -> dict:
    """An object schema of `count` string properties: ~26 bytes of compact JSON each."""
    return {"type": "object", "properties": {f"{prefix}{i:05d}": {"type": "string"} for i in range(count)}}


def compact_size(schema: dict) -> int:
    return len(json.dumps(schema, separators=(",", ":")))


def nested_text(depth: int) -> str:
    """A schema nested `depth` arrays deep, as JSON text (json.dumps of it would recurse in this test)."""
    return '{"type": "array", "items": ' * depth + '{"type": "integer"}' + "}" * depth


def post_raw(http: httpx.Client, path: str, body_text: str) -> httpx.Response:
    return http.post(path, content=body_text.encode(), headers={"Content-Type": "application/json"})


# -- finding 5: tools are bounded, and checked cheaply before anything compiles -------------------------
def test_more_tools_than_openai_allows_is_a_400_naming_tools(http: httpx.Client, model: str) -> None:
    tools = [function(f"f{i}") for i in range(MAX_TOOLS + 1)]
    assert_400(chat(http, model, tools=tools), "tools", f"at most {MAX_TOOLS}")


def test_the_most_tools_openai_allows_are_served(http: httpx.Client, model: str) -> None:
    tools = [function(f"f{i}") for i in range(MAX_TOOLS)]
    response = chat(http, model, tools=tools, tool_choice="none")  # the tool list would not fit the prompt
    assert response.status_code == 200, response.text[:500]


def test_a_tool_schema_over_the_byte_cap_is_a_400_naming_it(http: httpx.Client, model: str) -> None:
    schema = properties(MAX_GRAMMAR_BYTES // 26 + 100)
    assert compact_size(schema) > MAX_GRAMMAR_BYTES
    tools = [function("small", properties(2)), function("huge", schema)]
    assert_400(chat(http, model, tools=tools), "tools.1.function.parameters", f"more than the {MAX_GRAMMAR_BYTES}")


def test_tool_schemas_over_the_total_byte_cap_are_a_400_naming_tools(http: httpx.Client, model: str) -> None:
    each = properties(MAX_GRAMMAR_BYTES // 30)
    count = MAX_TOOLS_BYTES // compact_size(each) + 1
    assert compact_size(each) <= MAX_GRAMMAR_BYTES < MAX_TOOLS_BYTES < count * compact_size(each)
    tools = [function(f"f{i}", each) for i in range(count)]
    assert_400(chat(http, model, tools=tools), "tools", f"more than the {MAX_TOOLS_BYTES}")


def test_the_context_length_is_checked_before_any_tool_schema_compiles(http: httpx.Client, model: str) -> None:
    """Only compiling finds this schema invalid, so the context-length refusal proves compiling comes later."""
    invalid = {"type": "object", "properties": {"a": {"type": "nonsense"}}}
    long = [{"role": "user", "content": "hello " * 4000}]  # > 2048 tokens, under the characters bound
    response = http.post("/v1/chat/completions", json={"model": model, "messages": long, "max_tokens": 1,
                                                       "tools": [function("f", invalid)]})
    assert response.status_code == 400, response.text[:500]
    assert response.json()["error"]["code"] == "context_length_exceeded", response.text[:500]
    assert_400(chat(http, model, tools=[function("f", invalid)]), "tools.0.function.parameters", "nonsense")


# -- findings 5 and 7: a constraint's source is bounded in bytes ---------------------------------------
BIG_ENUM = {"enum": [f"value-{i:06d}" for i in range(80_000)]}  # 1.2 MB: ~30 MB compiled, cached for good


@pytest.mark.parametrize(("fields", "param"), [
    ({"guided_json": BIG_ENUM}, "guided_json"),
    ({"guided_json": json.dumps(BIG_ENUM)}, "guided_json"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "big", "schema": BIG_ENUM}}},
     "response_format"),
    ({"structured_outputs": {"json": BIG_ENUM}}, "structured_outputs"),
    ({"guided_regex": "|".join(f"w{i}" for i in range(MAX_GRAMMAR_BYTES // 4))}, "guided_regex"),
    ({"guided_grammar": "start: " + " | ".join(f'"w{i}"' for i in range(MAX_GRAMMAR_BYTES // 6))},
     "guided_grammar"),
    ({"guided_choice": [f"choice {i}" for i in range(MAX_GRAMMAR_BYTES // 8)]}, "guided_choice"),
])
def test_a_constraint_over_the_byte_cap_is_a_400_naming_it(http: httpx.Client, model: str, fields: dict,
                                                           param: str) -> None:
    assert_400(chat(http, model, **fields), param, f"more than the {MAX_GRAMMAR_BYTES} bytes")


def test_a_constraint_under_the_byte_cap_is_served(http: httpx.Client, model: str) -> None:
    enum = {"enum": [f"value-{i:06d}" for i in range(4_000)]}  # 60 KB
    response = http.post("/v1/completions", json={"model": model, "prompt": "Pick:", "max_tokens": 3,
                                                  "guided_json": enum})
    assert response.status_code == 200, response.text[:500]


# -- finding 10: every grammar or schema failure is the client's 400 -----------------------------------
@pytest.mark.parametrize(("fields", "param", "words"), [
    ({"guided_grammar": "root ::= undefined-rule"}, "guided_grammar", "not found"),
    ({"structured_outputs": {"grammar": "root ::= undefined-rule"}}, "structured_outputs", "not found"),
    ({"guided_grammar": "root ::= " + "(" * 3000 + '"a"' + ")" * 3000}, "guided_grammar", "nested too deeply"),
    ({"guided_grammar": "start: " + "(" * 3000 + '"a"' + ")" * 3000}, "guided_grammar", "nested"),
    ({"guided_regex": "(" * 3000 + "a" + ")" * 3000}, "guided_regex", "Invalid structured output"),
    ({"guided_json": "[" * 3000 + "]" * 3000}, "guided_json", "nested too deeply"),
    ({"guided_json": nested_text(DEPTH)}, "guided_json", "Invalid structured output"),
])
def test_broken_grammars_are_400s(http: httpx.Client, model: str, fields: dict, param: str, words: str) -> None:
    for path, extra in [("/v1/chat/completions", {"messages": MESSAGES}), ("/v1/completions", {"prompt": "x"})]:
        response = http.post(path, json={"model": model, "max_tokens": 1, **extra, **fields})
        assert_400(response, param, words)


@pytest.mark.parametrize(("template", "param"), [
    ('"guided_json": {schema}', "guided_json"),
    ('"structured_outputs": {{"json": {schema}}}', "structured_outputs"),
    ('"response_format": {{"type": "json_schema", "json_schema": {{"name": "deep", "schema": {schema}}}}}',
     "response_format"),
    ('"tools": [{{"type": "function", "function": {{"name": "f", "parameters": {schema}}}}}]',
     "tools.0.function.parameters"),
    ('"tools": [{{"type": "function", "function": {{"name": "f", "parameters": {schema}}}}}], '
     '"tool_choice": "required"', "tools.0.function.parameters"),
])
def test_schemas_nested_too_deep_as_objects_are_400s(http: httpx.Client, model: str, template: str,
                                                     param: str) -> None:
    schema = '{"type": "object", "properties": {"a": ' + nested_text(DEPTH) + "}}"
    body = ('{"model": ' + json.dumps(model) + ', "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, '
            + template.format(schema=schema) + "}")
    assert_400(post_raw(http, "/v1/chat/completions", body), param, f"deeper than {MAX_SCHEMA_DEPTH}")


def test_a_schema_at_the_depth_limit_compiles(http: httpx.Client, model: str) -> None:
    depth = MAX_SCHEMA_DEPTH - 1  # one dict per level, and the innermost one: MAX_SCHEMA_DEPTH in all
    schema = json.loads(nested_text(depth))
    response = http.post("/v1/completions", json={"model": model, "prompt": "x", "max_tokens": 2,
                                                  "guided_json": schema})
    assert response.status_code == 200, response.text[:500]
