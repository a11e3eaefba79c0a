"""The tool-call formats: each reads what its models write (and what it writes into past turns) into the same calls
however the answer is chunked; a required list of calls reads call by call, cut or not. Then each format through a
real server, with the model made to write its markup by a regex."""

from __future__ import annotations

import itertools
import json
import re
from typing import Any

import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagegate.gateway.protocol import ChatMessage, Tool
from pagegate.gateway.tool_formats import (
    TOOL_FORMATS,
    ParsedCall,
    ToolFormat,
    detect_tool_format,
    resolve_tool_format,
)
from pagegate.gateway.tools import CallParsing, ListCallReader, template_messages
from pagegate.testing.launcher import ServerProcess
from tests.engine.family_tokenizers import GEMMA3_CHAT_TEMPLATE, QWEN3_CHAT_TEMPLATE
from tests.gateway.server_args import server_args

SCHEMAS = {"get_weather": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                                            "hourly": {"type": "boolean"}}},
           "ping": {"type": "object", "properties": {}}}


def read(call_format: ToolFormat, pieces: list[str], limit: int | None = None) -> tuple[str, list[tuple[str, Any]]]:
    reader = call_format.read(SCHEMAS, limit)
    events = [event for piece in pieces for event in reader.feed(piece)] + reader.finish()
    assert [e for e in events if isinstance(e, ParsedCall)] == reader.calls  # each call is an event, once
    return "".join(e for e in events if isinstance(e, str)), [(c.name, json.loads(c.arguments)) for c in reader.calls]


def chunked(text: str, cuts: list[int]) -> list[str]:
    points = sorted({0, len(text), *(cut % (len(text) + 1) for cut in cuts)})
    return [text[a:b] for a, b in itertools.pairwise(points)] or [""]


PARIS = ("get_weather", {"city": "Paris", "days": 3})
CASES = [
    ("hermes", 'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>',
     "Sure.", [PARIS]),
    ("hermes", '<tool_call>{"name": "nope", "arguments": {}}</tool_call>',
     '<tool_call>{"name": "nope", "arguments": {}}</tool_call>', []),
    ("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n"
     "</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=ping>\n</function>\n</tool_call>", "",
     [PARIS, ("ping", {})]),
    ("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=city>\n12\n</parameter>\n</function>\n</tool_call>",
     "", [("get_weather", {"city": "12"})]),  # a string parameter stays text, whatever it looks like
    ("qwen3_coder", "<tool_call>oops</tool_call>", "<tool_call>oops</tool_call>", []),
    ("mistral", 'Let me check. [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}, '
     '{"name": "ping", "arguments": {}}]', "Let me check.", [PARIS, ("ping", {})]),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 3}[TOOL_CALLS]ping[ARGS]{}', "",
     [PARIS, ("ping", {})]),  # the newer tokenizers' form
    ("mistral", "[TOOL_CALLS] not a list", "[TOOL_CALLS] not a list", []),
    ("mistral", "Text with [brackets] and [TOOL_ but no calls.", "Text with [brackets] and [TOOL_ but no calls.", []),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}; {"name": "ping", '
     '"parameters": {}}', "", [PARIS, ("ping", {})]),
    ("llama3_json", '<|python_tag|>{"name": "ping", "arguments": {}}', "", [("ping", {})]),
    ("llama3_json", '{"answer": 42}', '{"answer": 42}', []),  # JSON, but not a call: the answer
    ("llama3_json", "  Hello {name}!", "  Hello {name}!", []),
    ("pythonic", '[get_weather(city="Paris", days=3), ping()]', "", [PARIS, ("ping", {})]),
    ("pythonic", "[get_weather(city=Paris)]", "[get_weather(city=Paris)]", []),  # a name, not a literal
    ("pythonic", "[1] says so.", "[1] says so.", []),
    ("pythonic", "Hi.", "Hi.", []),
]


@pytest.mark.parametrize("name, text, content, calls", CASES)
def test_each_format_reads_its_calls(name: str, text: str, content: str, calls: list) -> None:
    assert read(TOOL_FORMATS[name], [text]) == (content, calls)


@settings(max_examples=40, deadline=None)
@given(case=st.sampled_from(CASES), cuts=st.lists(st.integers(0, 500), max_size=8))
def test_any_chunking_reads_the_same(case: tuple, cuts: list[int]) -> None:
    name, text, content, calls = case
    assert read(TOOL_FORMATS[name], chunked(text, cuts)) == (content, calls)


ARGUMENT_VALUES = {"city": st.text(st.characters(codec="utf-8", exclude_characters="\n<\\\"'"), max_size=12),
                   "days": st.integers(-5, 400), "hourly": st.booleans()}
CALLS = st.lists(st.one_of(st.just(("ping", {})), st.fixed_dictionaries(
    {}, optional=ARGUMENT_VALUES).map(lambda arguments: ("get_weather", arguments))), min_size=1, max_size=3)


@settings(max_examples=60, deadline=None)
@given(name=st.sampled_from(sorted(TOOL_FORMATS)), calls=CALLS, cuts=st.lists(st.integers(0, 400), max_size=6))
def test_what_a_format_writes_it_reads_back(name: str, calls: list, cuts: list[int]) -> None:
    """Past turns' calls, written into a prompt in the format, are what the model is shown to write."""
    call_format = TOOL_FORMATS[name]
    assert read(call_format, chunked(call_format.write(calls), cuts)) == ("", calls)


def test_a_limit_keeps_the_first_calls() -> None:
    for name in ("mistral", "llama3_json", "pythonic"):
        text = TOOL_FORMATS[name].write([PARIS, ("ping", {})])
        assert read(TOOL_FORMATS[name], [text], limit=1) == ("", [PARIS])


def test_mistral_ids_are_what_its_templates_accept() -> None:
    reader = TOOL_FORMATS["mistral"].read(SCHEMAS, None)
    assert reader.feed("[TOOL_CALLS]ping[ARGS]{}") == []  # its calls are read at the end of the answer
    [call] = reader.finish()
    assert isinstance(call, ParsedCall) and re.fullmatch("[A-Za-z0-9]{9}", call.id)


# -- tool_choice "required": a JSON list of calls ----------------------------------------------------------
LIST = '[{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}, {"name": "ping", "parameters": {}}]'


@settings(max_examples=60, deadline=None)
@given(end=st.integers(0, len(LIST)), cuts=st.lists(st.integers(0, len(LIST)), max_size=6))
def test_a_required_list_reads_call_by_call_and_never_as_content(end: int, cuts: list[int]) -> None:
    """Every prefix of the list (max_tokens may cut anywhere): the whole items are calls as they close, the cut
    one keeps its name and the arguments so far, nothing is content."""
    reader = ListCallReader(SCHEMAS)
    text = LIST[:end]
    events = [event for piece in chunked(text, cuts) for event in reader.feed(piece)] + reader.finish()
    assert all(isinstance(event, ParsedCall) for event in events) and events == reader.calls
    whole = [json.loads(c.arguments) for c in reader.calls if c.arguments.endswith("}")]
    assert [c.name for c in reader.calls] == ["get_weather", "ping"][:len(reader.calls)]
    if end == len(LIST):
        assert whole == [{"city": "Paris", "days": 3}, {}]
    for call in reader.calls:
        assert call.arguments.startswith("{") and '"name"' not in call.arguments


def test_a_required_list_is_read_whatever_the_served_format() -> None:
    for call_format in TOOL_FORMATS.values():
        parsing = CallParsing(SCHEMAS, required=True, call_format=call_format)
        reader = parsing.parser()
        assert [c.name for c in reader.feed(LIST) + reader.finish()] == ["get_weather", "ping"]


# -- through a server -------------------------------------------------------------------------------------
@pytest.fixture(scope="module", params=sorted(set(TOOL_FORMATS) - {"hermes"}))
def served_format(request: pytest.FixtureRequest):
    with ServerProcess(server_args("--num-kv-blocks", "128", "--tool-call-parser", request.param)) as server:
        yield request.param, openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)


TOOLS = [{"type": "function", "function": {"name": name, "parameters": schema}} for name, schema in SCHEMAS.items()]


def test_a_served_format_returns_the_calls_its_markup_holds(served_format: tuple[str, openai.OpenAI]) -> None:
    """The embedded model knows no tools: a regex makes it write two calls in the served format, streamed or not."""
    name, client = served_format
    body = {"model": "pagegate-default", "messages": [{"role": "user", "content": "Weather in Paris?"}],
            "tools": TOOLS, "max_tokens": 200, "temperature": 0,
            "extra_body": {"structured_outputs": {"regex": re.escape(TOOL_FORMATS[name].write([PARIS, ("ping", {})]))}}}
    choice = client.chat.completions.create(**body).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == \
        [PARIS, ("ping", {})]
    streamed = [call for chunk in client.chat.completions.create(**body, stream=True) for c in chunk.choices
                for call in c.delta.tool_calls or ()]
    assert [c.function.name for c in streamed if c.function.name] == ["get_weather", "ping"]


def test_templates_that_ignore_tools_see_the_served_format() -> None:
    messages = [ChatMessage.model_validate(m) for m in (
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]})]
    pythonic = TOOL_FORMATS["pythonic"]
    dicts = template_messages(messages, [Tool.model_validate(t) for t in TOOLS], False, pythonic)
    assert "nothing but a Python list of calls" in dicts[0]["content"] and "<tool_call>" not in dicts[0]["content"]
    assert dicts[2]["content"] == "[get_weather(city='Paris')]"


# -- --tool-call-parser auto: the format read off the chat template ---------------------------------------
# The lines of each family's template that write its calls (the markers llama.cpp also looks for)
LLAMA31_LINES = ('{%- if message.role == "tool" or message.role == "ipython" %}'
                 '{{- "<|start_header_id|>ipython<|end_header_id|>\\n\\n" }}{%- endif %}'
                 '{{- "<|python_tag|>" + tool_call.name + ".call(" }}')
LLAMA32_LINES = '{{- "<|start_header_id|>ipython<|end_header_id|>\\n\\n" }}'
MISTRAL_LINES = '{%- if message.tool_calls %}{{- "[TOOL_CALLS][" }}{%- for tool_call in message.tool_calls %}'
QWEN3_CODER_LINES = ("{{- '<tool_call>\\n<function=' + tool_call.name + '>\\n' }}"
                     "{{- '<parameter=' + args_name + '>\\n' }}")
PYTHONIC_LINES = ("you MUST put it in the format of [func_name1(params_name1=params_value1, "
                  "params_name2=params_value2...), func_name2(params)]" + LLAMA32_LINES)
EMBEDDED_TEMPLATE = ("{%- for message in messages -%}{{ '<|' + message['role'] + '|>\\n' }}"
                     "{{- message['content'] | trim -}}{{ '<|end|>' }}{%- endfor -%}"
                     "{%- if add_generation_prompt -%}{{ '<|assistant|>\\n' }}{%- endif -%}")


@pytest.mark.parametrize("template, name", [
    (QWEN3_CHAT_TEMPLATE, "hermes"), (QWEN3_CODER_LINES, "qwen3_coder"), (MISTRAL_LINES, "mistral"),
    (LLAMA31_LINES, "llama3_json"), (LLAMA32_LINES, "llama3_json"), (PYTHONIC_LINES, "pythonic"),
    (GEMMA3_CHAT_TEMPLATE, "hermes"), (EMBEDDED_TEMPLATE, "hermes"), (None, "hermes"),
])
def test_auto_reads_the_format_off_the_chat_template(template: str | None, name: str) -> None:
    assert detect_tool_format(template)[0] == name
    assert resolve_tool_format("auto", template) == detect_tool_format(template)
    assert resolve_tool_format("pythonic", template) == ("pythonic", "--tool-call-parser")  # the flag wins


# The embedded model with a template whose assistant turns write Mistral's calls
MISTRAL_TEMPLATE = ("{%- for message in messages -%}{{ '<|' + message['role'] + '|>\\n' }}"
                    "{%- if message.tool_calls -%}{{ '[TOOL_CALLS]' + message.tool_calls | tojson }}"
                    "{%- else -%}{{ message['content'] | trim }}{%- endif -%}{{ '<|end|>' }}{%- endfor -%}"
                    "{%- if add_generation_prompt -%}{{ '<|assistant|>\\n' }}{%- endif -%}")


@pytest.fixture(scope="module", params=[(), ("--tool-call-parser", "hermes")], ids=["auto", "flag"])
def mistral_templated(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    template = tmp_path_factory.mktemp("template") / "mistral.jinja"
    template.write_text(MISTRAL_TEMPLATE)
    args = server_args("--num-kv-blocks", "128", "--chat-template", str(template), *request.param)
    with ServerProcess(args) as server:
        yield request.param, server, openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)


def test_a_server_reads_calls_in_its_templates_format(mistral_templated: tuple) -> None:
    """No --tool-call-parser: the calls are read as the template writes them (they were content under the old
    hermes default), and the start-up log says so; a format named with the flag still wins."""
    flags, server, client = mistral_templated
    markup = TOOL_FORMATS["mistral"].write([PARIS, ("ping", {})])
    choice = client.chat.completions.create(
        model="pagegate-default", messages=[{"role": "user", "content": "Weather in Paris?"}], tools=TOOLS,
        max_tokens=200, temperature=0, extra_body={"structured_outputs": {"regex": re.escape(markup)}}).choices[0]
    if not flags:
        assert "tool calls: the mistral format (its chat template writes [TOOL_CALLS])" in server.log()
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == \
            [PARIS, ("ping", {})]
    else:
        assert "tool calls: the hermes format (--tool-call-parser)" in server.log()
        assert choice.message.content == markup and not choice.message.tool_calls
