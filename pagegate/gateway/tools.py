"""Tool calling in the Hermes format: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks.

What the chat template sees (the tool list, earlier calls and their results; templates that ignore `tools` get
them as text), the grammar that makes `tool_choice` "required" or a named function produce valid calls only,
and the parser that turns the model's blocks back into OpenAI `tool_calls`, streamed or not.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field
from typing import Any

from pagegate.engine.errors import InvalidParamError
from pagegate.engine.sampling.structured import (
    JSON_STYLE,
    MAX_TOOLS_BYTES,
    StructuredOutputsParams,
    check_grammar_size,
)
from pagegate.gateway.protocol import ChatCompletionRequest, ChatMessage, NamedToolChoice, Tool

OPEN, CLOSE = "<tool_call>", "</tool_call>"
TOOL_CALL_PARSERS = ("hermes",)  # the formats models write calls in (--tool-call-parser)
NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


def parameters_schema(tool: Tool) -> dict[str, Any]:
    """The JSON schema of a function's arguments object; OpenAI reads a missing one as "takes no arguments"."""
    schema = tool.function.parameters
    return NO_PARAMETERS if schema is None else {"type": "object", **schema}  # protocol: the type is object


def check_tool_sizes(tools: list[Tool]) -> None:
    """Before anything renders or compiles them: each function's parameter schema within MAX_GRAMMAR_BYTES and
    MAX_SCHEMA_DEPTH, all of them within MAX_TOOLS_BYTES (tool_choice "required" compiles them as one grammar)."""
    total = 0
    for index, tool in enumerate(tools):
        if tool.function.parameters is not None:
            total += check_grammar_size(tool.function.parameters, f"tools.{index}.function.parameters")
    if total > MAX_TOOLS_BYTES:
        raise InvalidParamError(f"The tools' parameter schemas are {total} bytes long together (as compact JSON), "
                                f"more than the {MAX_TOOLS_BYTES} bytes allowed.", "tools")


# -- what the model is asked for ----------------------------------------------------------------------
def offered_tools(request: ChatCompletionRequest) -> list[Tool]:
    """The tools the model may call: none with tool_choice none, only the named one when one is named."""
    mode = request.tool_choice_mode
    if mode == "none" or not request.tools:
        return []
    if isinstance(request.tool_choice, NamedToolChoice):
        return [t for t in request.tools if t.function.name == request.tool_choice.function.name]
    return list(request.tools)


def call_grammar(tools: list[Tool], parallel: bool) -> StructuredOutputsParams:
    """A constraint to one (or, with `parallel`, one or more) Hermes blocks calling one of `tools` with
    arguments that match its parameter schema; JSON written as json.dumps writes it.

    Blocks follow each other with nothing between: after a call, the model chooses between another
    `<tool_call>` and its end-of-turn token. A newline between them would be one more way to go on, and
    small models take it: SmolLM2-135M then repeats its call until max_tokens.
    """
    rules = [f"call_{i}: %json {json.dumps(_call_schema(tool))}" for i, tool in enumerate(tools)]
    calls = " | ".join(f"call_{i}" for i in range(len(tools)))
    start = "start: block+" if parallel else "start: block"
    opening, closing = json.dumps(OPEN + "\n"), json.dumps("\n" + CLOSE)  # as Lark string literals
    block = f"block: {opening} ({calls}) {closing}"
    return StructuredOutputsParams(grammar="\n".join([start, block, *rules]) + "\n")


def named_call_grammar(tool: Tool) -> StructuredOutputsParams:
    """A named tool_choice: the output is that function's arguments alone, and the server writes the call around
    them (as vLLM does). Nothing of the Hermes block is spent on tokens: a cut-off call is one cut in its
    arguments."""
    return StructuredOutputsParams(json={"x-guidance": dict(JSON_STYLE), **parameters_schema(tool)})


def _call_schema(tool: Tool) -> dict[str, Any]:
    arguments = _rebase_refs(parameters_schema(tool), "#/properties/arguments")
    return {"x-guidance": dict(JSON_STYLE), "type": "object",
            "properties": {"name": {"const": tool.function.name}, "arguments": arguments},
            "required": ["name", "arguments"], "additionalProperties": False}


def _rebase_refs(schema: Any, base: str) -> Any:
    """The schema with its local `$ref`s ("#/$defs/x", "#") pointing into it at `base` of a larger one."""
    if isinstance(schema, dict):
        return {key: base + value[1:] if key == "$ref" and isinstance(value, str) and value.startswith("#")
                else _rebase_refs(value, base) for key, value in schema.items()}
    if isinstance(schema, list):
        return [_rebase_refs(item, base) for item in schema]
    return schema


# -- what the chat template sees ----------------------------------------------------------------------
def template_messages(messages: list[ChatMessage], tools: list[Tool], template_takes_tools: bool) -> list[dict]:
    """Messages as chat templates read them (OpenAI's dicts, as transformers passes them).

    A template that reads `tools` gets calls with their arguments as objects and `tool` turns as they are;
    one that does not gets the tool list in the system message, calls written as Hermes blocks in the
    assistant's text and results as `<tool_response>` blocks in user turns, which any template renders.
    """
    if template_takes_tools:
        return [_native_message(m) for m in messages]
    dicts: list[dict[str, Any]] = []
    for message in messages:
        as_text = _text_message(message)
        if message.role == "tool" and dicts and dicts[-1].get("tool_results"):
            dicts[-1]["content"] += "\n" + as_text["content"]  # results of one turn's calls: one user turn
        else:
            dicts.append(as_text)
    for item in dicts:
        item.pop("tool_results", None)
    return _with_tool_prompt(dicts, tools) if tools else dicts


def _role(message: ChatMessage) -> str:
    return "system" if message.role == "developer" else message.role


def _native_message(message: ChatMessage) -> dict[str, Any]:
    item: dict[str, Any] = {"role": _role(message), "content": message.text()}
    if message.name is not None:
        item["name"] = message.name
    if message.tool_calls:
        item["tool_calls"] = [{"id": call.id, "type": "function",
                               "function": {"name": call.function.name,
                                            "arguments": _arguments_value(call.function.arguments)}}
                              for call in message.tool_calls]
    if message.tool_call_id is not None:
        item["tool_call_id"] = message.tool_call_id
    if message.reasoning_content is not None:  # templates that show past thinking read it (Qwen3's)
        item["reasoning_content"] = message.reasoning_content
    return item


def _arguments_value(arguments: str) -> Any:
    """Arguments as an object for templates (they write it with tojson); text that is not JSON stays text."""
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


def _text_message(message: ChatMessage) -> dict[str, Any]:
    if message.role == "tool":
        return {"role": "user", "content": f"<tool_response>\n{message.text()}\n</tool_response>",
                "tool_results": True}
    text = message.text()
    blocks = "".join(hermes_block(call.function.name, _arguments_value(call.function.arguments))
                     for call in message.tool_calls or ())  # back to back, as call_grammar has them
    return {"role": _role(message), "content": "\n".join(part for part in (text, blocks) if part)}


def hermes_block(name: str, arguments: Any) -> str:
    """One call as the model writes it (and as the grammar constrains it)."""
    return f"{OPEN}\n{json.dumps({'name': name, 'arguments': arguments}, ensure_ascii=False)}\n{CLOSE}"


def tool_prompt(tools: list[Tool]) -> str:
    """The tool list and call format, for models whose template ignores `tools`."""
    listing = "\n".join(json.dumps(tool.model_dump(exclude_none=True), ensure_ascii=False) for tool in tools)
    return ("# Tools\n\nYou can call functions to help answer the user. Their signatures, one JSON object per "
            f"line:\n<tools>\n{listing}\n</tools>\n\nTo call a function, reply with one block per call:\n"
            f'{OPEN}\n{{"name": "<function name>", "arguments": {{<arguments as JSON>}}}}\n{CLOSE}\n'
            "The result comes back in a <tool_response> block.")


def _with_tool_prompt(dicts: list[dict[str, Any]], tools: list[Tool]) -> list[dict[str, Any]]:
    prompt = tool_prompt(tools)
    if dicts and dicts[0]["role"] == "system":
        return [{**dicts[0], "content": f"{dicts[0]['content']}\n\n{prompt}"}, *dicts[1:]]
    return [{"role": "system", "content": prompt}, *dicts]


# -- what the model wrote -----------------------------------------------------------------------------
@dataclass(frozen=True)
class ParsedCall:
    id: str
    name: str
    arguments: str  # JSON text of an object

    def as_tool_call(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class CallParsing:
    """How a chat answer's calls are read: the functions offered, and at most how many calls (None: any)."""

    names: frozenset[str]
    limit: int | None = None
    named: str | None = None  # a named tool_choice: the whole output is this function's arguments

    @classmethod
    def of(cls, request: ChatCompletionRequest, offered: list[Tool]) -> CallParsing | None:
        if not offered:
            return None
        names = frozenset(t.function.name for t in offered)
        if isinstance(request.tool_choice, NamedToolChoice):
            return cls(names, 1, request.tool_choice.function.name)
        return cls(names, 1 if request.parallel_tool_calls is False else None)

    def parser(self) -> ToolCallParser | NamedCallParser:
        return NamedCallParser(self.named) if self.named is not None else ToolCallParser(self.names, self.limit)


@dataclass
class NamedCallParser:
    """A named tool_choice's output: the arguments of one call, known whole at the end. A cut-off one is still
    the call, as OpenAI's is: its finish_reason "length" says the arguments stopped short."""

    name: str
    calls: list[ParsedCall] = field(default_factory=list)
    _arguments: str = ""

    def feed(self, text: str) -> list[str | ParsedCall]:
        self._arguments += text
        return []

    def finish(self) -> list[str | ParsedCall]:
        arguments, self._arguments = self._arguments.strip(), ""
        if not arguments:
            return []
        call = ParsedCall(new_call_id(), self.name, arguments)
        self.calls.append(call)
        return [call]


@dataclass
class ToolCallParser:
    """Splits a model's text into content and calls as it streams in; any chunking gives the same result.

    Text that may still become a block (a tail like "<tool_" and the whitespace before it) is held back.
    A block whose JSON is not {"name": one of `names`, "arguments": object} stays content, as do an
    unfinished one at the end and the calls past `limit`. Whitespace next to a call is dropped.
    """

    names: frozenset[str]
    limit: int | None = None
    calls: list[ParsedCall] = field(default_factory=list)
    _tail: str = ""  # unresolved text: held back outside a block, or the open block so far
    _in_block: bool = False
    _space_before: str = ""  # whitespace before the open block (content again if the block is not a call)
    _after_call: bool = False

    def feed(self, text: str) -> list[str | ParsedCall]:
        """Content pieces and completed calls that `text` (the next piece of output) makes certain."""
        events: list[str | ParsedCall] = []
        text = self._tail + text
        while text:
            if self._in_block:
                end = text.find(CLOSE)
                if end < 0:
                    break
                end += len(CLOSE)
                self._close_block(text[:end], events)
                text = text[end:]
                continue
            if self._after_call:
                text = text.lstrip()
                if not text:
                    break
                self._after_call = False
            start = text.find(OPEN)
            if start >= 0:
                before = text[:start]
                content = before.rstrip()
                _emit(events, content)
                self._space_before, self._in_block, text = before[len(content):], True, text[start:]
                continue
            keep = _held_length(text)
            _emit(events, text[:len(text) - keep])
            text = text[len(text) - keep:]
            break
        self._tail = text
        return events

    def finish(self) -> list[str]:
        """At the end of the output: what was held back, as content."""
        rest = (self._space_before + self._tail) if self._in_block else self._tail
        self._tail, self._space_before, self._in_block = "", "", False
        return [rest] if rest else []

    def _close_block(self, block: str, events: list[str | ParsedCall]) -> None:
        call = self._parse(block[len(OPEN):-len(CLOSE)])
        if call is None or (self.limit is not None and len(self.calls) >= self.limit):
            _emit(events, self._space_before + block)
        else:
            self.calls.append(call)
            events.append(call)
            self._after_call = True
        self._space_before, self._in_block = "", False

    def _parse(self, body: str) -> ParsedCall | None:
        try:
            value = json.loads(body, parse_constant=_no_constant)
        except ValueError:
            return None
        if not isinstance(value, dict) or value.get("name") not in self.names:
            return None
        arguments = value.get("arguments", {})
        if isinstance(arguments, str):  # some models write the arguments as JSON text
            try:
                arguments = json.loads(arguments, parse_constant=_no_constant)
            except ValueError:
                return None
        if not isinstance(arguments, dict):
            return None
        return ParsedCall(new_call_id(), value["name"], json.dumps(arguments, ensure_ascii=False))


def _emit(events: list[str | ParsedCall], text: str) -> None:
    if text:
        events.append(text)


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _held_length(text: str) -> int:
    """Characters at the end of `text` that may still start a block: a prefix of OPEN and the space before it."""
    partial = next((n for n in range(min(len(OPEN) - 1, len(text)), 0, -1) if OPEN.startswith(text[-n:])), 0)
    before = text[:len(text) - partial]
    return partial + len(before) - len(before.rstrip())


def parse_tool_calls(text: str, parsing: CallParsing) -> tuple[str | None, list[ParsedCall]]:
    """A whole output as (content, calls); content is None when calls were all there was."""
    parser = parsing.parser()
    events = parser.feed(text) + parser.finish()
    content = "".join(event for event in events if isinstance(event, str))
    return (content or None) if parser.calls else content, parser.calls
