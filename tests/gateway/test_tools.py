"""Tool calling: the Hermes-block parser and the chat-template seam as pure functions, then the API against a real
server (the embedded model knows no tools, so with tool_choice "required" or a named function only the grammar
makes its calls valid)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import msgpack
import openai
import pytest

import pagegate.engine
from pagegate.engine.loading.tokenizer import Tokenizer
from pagegate.engine.sampling.structured import GrammarCompiler, closed_objects
from pagegate.gateway.prepare import ModelContext, chat_prompt
from pagegate.gateway.protocol import ChatCompletionRequest, ChatMessage, Tool, parse_request
from pagegate.gateway.tools import (
    CallParsing,
    call_grammar,
    offered_tools,
    parse_tool_calls,
    template_messages,
    tool_prompt,
)

WEATHER_PARAMS = {"type": "object", "properties": {
    "location": {"type": "string", "maxLength": 12},
    "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["location", "unit"], "additionalProperties": False}
# $defs and $ref: the grammar nests this schema under "arguments", so its references must still resolve
EVENT_PARAMS = {"type": "object", "$defs": {"day": {"type": "integer", "minimum": 1, "maximum": 31}},
                "properties": {"days": {"type": "array", "items": {"$ref": "#/$defs/day"}, "minItems": 1,
                                        "maxItems": 3},
                               "urgent": {"type": "boolean"}},
                "required": ["days", "urgent"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                           "parameters": WEATHER_PARAMS}},
         {"type": "function", "function": {"name": "book-event", "parameters": EVENT_PARAMS}},
         {"type": "function", "function": {"name": "ping"}}]  # no parameters: an empty arguments object
SCHEMAS = {"get_weather": WEATHER_PARAMS, "book-event": EVENT_PARAMS,
           "ping": {"type": "object", "properties": {}, "additionalProperties": False}}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"location": "Paris", "unit": "celsius"}}\n</tool_call>'


def check_calls(tool_calls: list[Any], only: str | None = None) -> None:
    """Every call names a tool (`only`, when given) and its arguments match that tool's parameter schema."""
    assert tool_calls
    for call in tool_calls:
        assert call.type == "function" and call.id.startswith("call_") and len(call.id) == 5 + 24
        assert call.function.name in SCHEMAS and call.function.name == (only or call.function.name)
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


# -- the parser ----------------------------------------------------------------------------------------
def split_every(text: str, size: int) -> tuple[str | None, list[tuple[str, str]]]:
    """Feed `text` to a parser `size` characters at a time, as a stream would."""
    parser = CallParsing(SCHEMAS).parser()
    events = [e for start in range(0, len(text), size) for e in parser.feed(text[start:start + size])]
    content = "".join(e for e in events + parser.finish() if isinstance(e, str))
    return (content or None) if parser.calls else content, [(c.name, c.arguments) for c in parser.calls]


@pytest.mark.parametrize("text, content, calls", [
    (CALL, None, [("get_weather", '{"location": "Paris", "unit": "celsius"}')]),
    (f"Let me look.\n{CALL}\n", "Let me look.", [("get_weather", '{"location": "Paris", "unit": "celsius"}')]),
    (f'{CALL}{CALL.replace("Paris", "Rome")}', None, [("get_weather", '{"location": "Paris", "unit": "celsius"}'),
                                                       ("get_weather", '{"location": "Rome", "unit": "celsius"}')]),
    ('<tool_call>{"name":"ping","arguments":"{}"}</tool_call>', None, [("ping", "{}")]),  # arguments as JSON text
    ('<tool_call>{"name": "ping"}</tool_call>', None, [("ping", "{}")]),
    ("No tools needed: 2 < 3 and <b>bold</b>.\n", "No tools needed: 2 < 3 and <b>bold</b>.\n", []),
    ("<tool_call>{not json}</tool_call> then text", "<tool_call>{not json}</tool_call> then text", []),
    ('<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>', '<tool_call>{"name": "rm_rf", "arguments": {}}'
                                                                 "</tool_call>", []),  # not one of the tools
    ('<tool_call>{"name": "ping", "arguments": [1]}</tool_call>', '<tool_call>{"name": "ping", "arguments": [1]}'
                                                                  "</tool_call>", []),
    ('<tool_call>{"name": "ping", "arguments": {"x": NaN}}</tool_call>',
     '<tool_call>{"name": "ping", "arguments": {"x": NaN}}</tool_call>', []),
    (f"Sure. {CALL[:40]}", f"Sure. {CALL[:40]}", []),  # cut short by max_tokens: stays text
    ("ends with <tool_", "ends with <tool_", []),
    ("", "", []),
])
def test_parser_reads_the_same_calls_whatever_the_chunking(text: str, content: str | None,
                                                          calls: list[tuple[str, str]]) -> None:
    for size in (1, 2, 3, 5, 11, len(text) or 1):
        assert split_every(text, size) == (content, calls), size


def test_parsed_calls_get_fresh_ids_and_a_limit_keeps_the_rest_as_text() -> None:
    content, calls = parse_tool_calls(CALL + CALL, CallParsing(SCHEMAS))
    assert content is None and len({call.id for call in calls}) == 2
    content, calls = parse_tool_calls(CALL + CALL, CallParsing(SCHEMAS, limit=1))
    assert len(calls) == 1 and content == CALL


# -- what the chat template sees -----------------------------------------------------------------------
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris and Rome?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"location": "Paris"}'}},
        {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": '{"location": "Rome"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
    {"role": "tool", "tool_call_id": "call_2", "content": [{"type": "text", "text": "21 C"}]},
]


def test_templates_that_ignore_tools_get_them_as_text() -> None:
    messages = [ChatMessage.model_validate(m) for m in CONVERSATION]
    tools = [Tool.model_validate(t) for t in TOOLS]
    dicts = template_messages(messages, tools, template_takes_tools=False)
    assert [d["role"] for d in dicts] == ["system", "user", "assistant", "user"]  # the two results: one turn
    assert dicts[0]["content"].startswith("Be brief.\n\n") and dicts[0]["content"].endswith(tool_prompt(tools))
    assert '"name": "book-event"' in dicts[0]["content"] and "<tool_call>" in dicts[0]["content"]
    assert dicts[2]["content"] == ('<tool_call>\n{"name": "get_weather", "arguments": {"location": "Paris"}}\n'
                                   '</tool_call><tool_call>\n{"name": "get_weather", "arguments": '
                                   '{"location": "Rome"}}\n</tool_call>')
    assert dicts[3]["content"] == "<tool_response>\n18 C\n</tool_response>\n<tool_response>\n21 C\n</tool_response>"
    assert template_messages(messages[1:2], [], template_takes_tools=False) == [CONVERSATION[1]]


def test_templates_that_read_tools_get_openai_messages() -> None:
    messages = [ChatMessage.model_validate(m) for m in CONVERSATION]
    dicts = template_messages(messages, [Tool.model_validate(t) for t in TOOLS], template_takes_tools=True)
    assert dicts[0] == CONVERSATION[0]  # the tool list goes to the template's `tools`, not into the text
    assert dicts[2]["content"] == "" and dicts[2]["tool_calls"][1] == {
        "id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": {"location": "Rome"}}}
    assert dicts[4] == {"role": "tool", "content": "21 C", "tool_call_id": "call_2"}


# A template of the kind Qwen and Hermes models ship: it reads `tools` and writes calls itself.
TOOL_TEMPLATE = ("{% if tools %}<|system|>\n{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}<|end|>{% endif %}"
                 "{% for m in messages %}<|{{ m.role }}|>\n{% if m.tool_calls %}{% for c in m.tool_calls %}"
                 "<tool_call>{{ {'name': c.function.name, 'arguments': c.function.arguments} | tojson }}</tool_call>"
                 "{% endfor %}{% else %}{{ m.content }}{% endif %}<|end|>{% endfor %}<|assistant|>\n")


def test_a_template_that_reads_tools_renders_them_itself() -> None:
    tokenizer = Tokenizer.from_folder(Path(pagegate.engine.__file__).parent / "default_model")
    assert tokenizer is not None and not tokenizer.chat_template_takes_tools
    tokenizer.chat_template = TOOL_TEMPLATE
    assert tokenizer.chat_template_takes_tools
    context = ModelContext(("m",), tokenizer, 2048, tokenizer.vocab_size)
    request = parse_request(ChatCompletionRequest, {"messages": CONVERSATION, "tools": TOOLS})
    text = chat_prompt(request.messages, context, tools=offered_tools(request)).text
    assert text.startswith('<|system|>\n{"type": "function", "function": {"name": "get_weather"')
    assert "# Tools" not in text  # no second tool list in the system message
    assert '<tool_call>{"name": "get_weather", "arguments": {"location": "Rome"}}</tool_call>' in text
    assert "<|tool|>\n18 C<|end|><|tool|>\n21 C<|end|><|assistant|>" in text
    none = parse_request(ChatCompletionRequest, {"messages": CONVERSATION, "tools": TOOLS, "tool_choice": "none"})
    assert chat_prompt(none.messages, context, tools=offered_tools(none)).text.startswith("<|system|>\nBe brief.")


# -- the grammars --------------------------------------------------------------------------------------
CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


@pytest.mark.parametrize("schema, closed", [
    (CITY, {**CITY, "additionalProperties": False}),
    ({"type": "object", "properties": {"where": CITY, "days": {"type": "array", "items": CITY}}},  # at any depth
     {"type": "object", "properties": {"where": {**CITY, "additionalProperties": False},
                                       "days": {"type": "array", "items": {**CITY, "additionalProperties": False}}},
      "additionalProperties": False}),
    ({"$defs": {"c": CITY}, "properties": {"c": {"$ref": "#/$defs/c"}}},
     {"$defs": {"c": {**CITY, "additionalProperties": False}}, "properties": {"c": {"$ref": "#/$defs/c"}},
      "additionalProperties": False}),
    ({**CITY, "additionalProperties": True}, {**CITY, "additionalProperties": True}),  # it says so: open
    ({**CITY, "additionalProperties": {"type": "integer"}}, {**CITY, "additionalProperties": {"type": "integer"}}),
    ({"type": "object"}, {"type": "object"}),  # free-form: names no keys
    ({**CITY, "required": ["city", "country"]}, {**CITY, "required": ["city", "country"]}),  # needs an unlisted one
    ({"allOf": [CITY, {"properties": {"days": {"type": "integer"}}}]},  # keys from several members
     {"allOf": [CITY, {"properties": {"days": {"type": "integer"}}}]}),
    ({"anyOf": [CITY, {"properties": {"zip": {"type": "string"}}}]},  # alternatives: each closed
     {"anyOf": [{**CITY, "additionalProperties": False},
                {"properties": {"zip": {"type": "string"}}, "additionalProperties": False}]}),
    ({**CITY, "oneOf": [{"properties": {"zip": {"type": "string"}}}]},  # keys beside a composition: open
     {**CITY, "oneOf": [{"properties": {"zip": {"type": "string"}}}]}),
    ({"type": "string"}, {"type": "string"}),
])
def test_tool_schemas_close_objects_that_do_not_say(schema: dict, closed: dict) -> None:
    assert closed_objects(schema) == closed
    assert "additionalProperties" not in CITY  # the client's schema is left as it was


@pytest.fixture(scope="module")
def grammars() -> tuple[GrammarCompiler, Tokenizer]:
    tokenizer = Tokenizer.from_folder(Path(pagegate.engine.__file__).parent / "default_model")
    assert tokenizer is not None
    return GrammarCompiler(tokenizer, tokenizer.vocab_size, tokenizer.eos_token_ids), tokenizer


@pytest.mark.parametrize("parallel", [True, False])
def test_a_required_list_may_end_after_any_whole_call(grammars: tuple[GrammarCompiler, Tokenizer],
                                                      parallel: bool) -> None:
    """The model's end-of-turn token may close the list after a call, its `]` unwritten: as a JSON array it could
    only end at `]`, which models with their end masked rarely pick (the embedded model: e^-18 against `,`)."""
    compiler, tokenizer = grammars
    tools = [Tool.model_validate(tool) for tool in TOOLS]
    one = '[{"name": "ping", "parameters": {}}'
    two = one + ', {"name": "ping", "parameters": {}}'
    for text in (one, two, one + "]", two + "]"):
        matcher = compiler.matcher(call_grammar(tools, parallel))
        fits = matcher.consume_tokens(tokenizer.encode(text, add_special_tokens=False))
        assert fits == (parallel or text.count("{") == 2), text
        if fits:
            assert matcher.is_accepting() and matcher.consume_token(tokenizer.eos_token_ids[0]), text
    unfinished = compiler.matcher(call_grammar(tools, parallel))
    assert unfinished.consume_tokens(tokenizer.encode('[{"name": "ping"', add_special_tokens=False))
    assert not unfinished.is_accepting()


# -- the API -------------------------------------------------------------------------------------------
NAMED = {"type": "function", "function": {"name": "book-event"}}


ONE_CALL = [("required", None, False), (NAMED, "book-event", None)]  # parallel_tool_calls


@pytest.mark.parametrize("tool_choice, only, parallel", ONE_CALL)
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_constrained_calls_match_their_schemas(client: openai.OpenAI, model: str, tool_choice: Any,
                                               only: str | None, parallel: bool | None, seed: int) -> None:
    result = client.chat.completions.create(model=model, messages=MESSAGES, tools=TOOLS, tool_choice=tool_choice,
                                            parallel_tool_calls=openai.omit if parallel is None else parallel,
                                            temperature=1.0, seed=seed, n=2, max_tokens=300)
    for choice in result.choices:
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        check_calls(choice.message.tool_calls, only)
        assert len(choice.message.tool_calls) == 1


def test_a_required_list_cut_by_max_tokens_keeps_its_calls(client: openai.OpenAI, model: str) -> None:
    """The embedded (random) model never ends a list of calls: max_tokens cuts it. The calls before the cut are
    whole, the cut one has the arguments it got to, and none of the list's JSON becomes content."""
    result = client.chat.completions.create(model=model, messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                            temperature=1.0, seed=5, n=2, max_tokens=120)
    for choice in result.choices:
        *whole, cut = choice.message.tool_calls
        assert choice.finish_reason == "length" and choice.message.content is None and whole
        check_calls(whole)
        assert cut.function.name in SCHEMAS and cut.function.arguments.startswith("{")


def rebuilt_calls(pieces: list[Any]) -> list[tuple[str, str]]:
    """(name, arguments) of each call, from a stream's tool_calls pieces (as the SDK joins them by index)."""
    calls: dict[int, list[str]] = {}
    for piece in pieces:
        name, arguments = calls.setdefault(piece.index, ["", ""])
        calls[piece.index] = [name + (piece.function.name or ""), arguments + (piece.function.arguments or "")]
    return [(name, arguments) for name, arguments in calls.values()]


@pytest.mark.parametrize("tool_choice, only", [("required", None), (NAMED, "book-event")])
def test_streamed_calls_rebuild_into_the_same_answer(client: openai.OpenAI, model: str, tool_choice: Any,
                                                     only: str | None) -> None:
    body = {"model": model, "messages": MESSAGES, "tools": TOOLS, "tool_choice": tool_choice, "temperature": 1.0,
            "seed": 4, "max_tokens": 150}
    whole = client.chat.completions.create(**body).choices[0]
    pieces, finish, content = [], None, ""
    for chunk in client.chat.completions.create(**body, stream=True):
        for choice in chunk.choices:
            pieces += choice.delta.tool_calls or ()
            finish, content = choice.finish_reason or finish, content + (choice.delta.content or "")
    assert finish == whole.finish_reason and not content
    assert rebuilt_calls(pieces) == [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    check_calls(whole.message.tool_calls[:-1] if finish == "length" else whole.message.tool_calls, only)
    # OpenAI's pieces: id, type and name first (arguments ""), then the arguments
    assert pieces[0].id and pieces[0].type == "function" and pieces[0].function.arguments == ""
    assert pieces[1].id is None and pieces[1].function.name is None and pieces[1].function.arguments


def test_parallel_tool_calls_false_gives_one_call(client: openai.OpenAI, model: str) -> None:
    for seed in range(4):
        result = client.chat.completions.create(model=model, messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                                parallel_tool_calls=False, temperature=0.8, seed=seed, max_tokens=300)
        [choice] = result.choices
        assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1


SHORT_CITY = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 10}}, "required": ["city"]}}}


@pytest.mark.parametrize("tool_choice", [{"type": "function", "function": {"name": "get_weather"}}, "required"])
def test_calls_write_no_keys_their_schema_does_not_list(client: openai.OpenAI, model: str, tool_choice: Any) -> None:
    """A schema that does not mention additionalProperties is closed for tools (as xgrammar reads it): after its
    city, the embedded model went on with keys of its own in 6 of 6 calls while the schema was open."""
    for seed in (1, 2):
        result = client.chat.completions.create(model=model, messages=MESSAGES, tools=[SHORT_CITY],
                                                tool_choice=tool_choice, temperature=0.7, seed=seed, n=3,
                                                max_tokens=48)
        for choice in result.choices:
            calls = choice.message.tool_calls
            whole = calls if choice.finish_reason == "tool_calls" else calls[:-1]
            assert all(json.loads(call.function.arguments).keys() == {"city"} for call in whole)
            assert not any(re.search(r'(?<!\\)", "', call.function.arguments) for call in calls)  # nor a cut one
            if tool_choice != "required":
                assert choice.finish_reason == "tool_calls" and len(calls) == 1


def test_a_conversation_with_calls_and_results_continues(client: openai.OpenAI, model: str) -> None:
    first = client.chat.completions.create(model=model, messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                           parallel_tool_calls=False, temperature=0, max_tokens=300)
    message = first.choices[0].message
    results = [{"role": "tool", "tool_call_id": call.id, "content": "18 C, sunny"} for call in message.tool_calls]
    second = client.chat.completions.create(model=model, messages=[*MESSAGES, message, *results], tools=TOOLS,
                                            max_tokens=5, temperature=0)
    assert second.choices[0].finish_reason in ("stop", "length") and second.usage.prompt_tokens > \
        first.usage.prompt_tokens


def test_auto_and_none(client: openai.OpenAI, model: str) -> None:
    """The embedded model writes no calls: auto gives its text back (as none does); the tool list (in a system
    message, as its template ignores `tools`) is in the prompt for auto only."""
    plain = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=8, temperature=0)
    auto = client.chat.completions.create(model=model, messages=MESSAGES, tools=TOOLS, max_tokens=8, temperature=0)
    none = client.chat.completions.create(model=model, messages=MESSAGES, tools=TOOLS, tool_choice="none",
                                          max_tokens=8, temperature=0)
    assert auto.choices[0].message.content and not auto.choices[0].message.tool_calls
    assert auto.usage.prompt_tokens > plain.usage.prompt_tokens + 100
    assert none.usage.prompt_tokens == plain.usage.prompt_tokens
    assert none.choices[0].message.content == plain.choices[0].message.content


BAD_PARAMETERS = {"type": "object", "properties": {"x": {"type": "nonsense"}}}


@pytest.mark.parametrize("extra, param, words", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "launch"}}}, "tool_choice",
     "'launch' is not among the tools"),
    ({"tool_choice": "required"}, "tool_choice", "only allowed when tools are given"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": BAD_PARAMETERS}}]},
     "tools.0.function.parameters", "nonsense"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
     "tools.0.function.parameters", "object"),
    ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools.0.type", "function"),
    ({"tools": [{"type": "function", "function": {"name": "no spaces"}}]}, "tools.0.function.name", "pattern"),
    ({"tools": [TOOLS[0], TOOLS[0]]}, "tools", "only once"),
    ({"tools": []}, "tools", "at least 1"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice",
     "only one output constraint"),
    ({"messages": [{"role": "tool", "content": "18 C"}]}, "messages.0.tool_call_id", "Missing"),
    ({"messages": [{"role": "user", "content": None}]}, "messages.0.content", "Missing"),
    ({"messages": [{"role": "assistant", "tool_calls": []}]}, "messages.0.content", "Missing"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, "messages.0.tool_calls", "only for assistant"),
    ({"messages": [{"role": "user", "content": "x", "tool_call_id": "c"}]}, "messages.0.tool_call_id",
     "only for tool messages"),
])
def test_bad_tool_requests_are_400s(client: openai.OpenAI, model: str, kv_pages, extra: dict, param: str,
                                    words: str) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=model, **{"messages": MESSAGES, "max_tokens": 4, **extra})
    error = caught.value.body
    assert error["param"] == param and words in error["message"], error
    assert kv_pages.wait_free() == 0


def test_msgpack_carries_tool_calls(http: httpx.Client) -> None:
    body = {"messages": MESSAGES, "tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False,
            "temperature": 1.0, "seed": 6, "max_tokens": 300}
    response = http.post("/v1/chat/completions", content=msgpack.packb(body),
                         headers={"content-type": "application/msgpack", "accept": "application/msgpack"})
    assert response.status_code == 200
    choice = msgpack.unpackb(response.content)["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    for call in choice["message"]["tool_calls"]:
        jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[call["function"]["name"]])
