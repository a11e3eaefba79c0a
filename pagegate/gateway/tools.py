"""Tool calling: what the chat template sees (the tool list, earlier calls and their results; templates that
ignore `tools` get them as text, in the served model's call format), the grammars that make `tool_choice`
"required" or a named function produce valid calls only, and how an answer's calls are read back into OpenAI
`tool_calls`, streamed or not (the formats themselves: pagegate.gateway.tool_formats).
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pagegate.engine.errors import InvalidParamError
from pagegate.engine.sampling.structured import (
    JSON_STYLE,
    MAX_TOOLS_BYTES,
    StructuredOutputsParams,
    check_grammar_size,
    closed_objects,
)
from pagegate.gateway.protocol import ChatCompletionRequest, ChatMessage, NamedToolChoice, Tool
from pagegate.gateway.tool_formats import (
    AUTO,
    TOOL_FORMATS,
    CallReader,
    ParsedCall,
    Schemas,
    ToolFormat,
    new_call_id,
    resolve_tool_format,
)

TOOL_CALL_PARSERS = (AUTO, *TOOL_FORMATS)  # --tool-call-parser: a format models write calls in, or auto
logger = logging.getLogger("pagegate.gateway")
NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}


def parameters_schema(tool: Tool) -> dict[str, Any]:
    """The JSON schema of a function's arguments object, its objects closed where they do not say (a function
    takes the keys it names: structured.closed_objects); OpenAI reads a missing one as "takes no arguments"."""
    schema = tool.function.parameters
    return NO_PARAMETERS if schema is None else closed_objects({"type": "object", **schema})  # type: object


def served_tool_format(parser: str, chat_template: str | None) -> str:
    """The format the served model's calls are read in (--tool-call-parser, `auto`: from its chat template),
    logged at start-up with why."""
    name, why = resolve_tool_format(parser, chat_template)
    logger.info("tool calls: the %s format (%s)", name, why)
    return name


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
    """tool_choice "required": a JSON list of one (or, with `parallel`, one or more) calls of `tools`, each
    `{"name": ..., "parameters": {...}}` with arguments that match the function's schema (vLLM's form). The
    server writes `tool_calls` from it: no call markup is spent on tokens.

    NOTE: the list may end at the model's end-of-turn token after any whole call, its `]` unwritten. As a JSON
    schema (an array, minItems 1) it could only end at `]`: after a call a model's mass is on ending its turn,
    which the mask took away, and what was left leaned to `, ` (SmolLM2 wrote call after call until max_tokens;
    the embedded model gave `]` e^-18). Now a list ends where the model says its turn does, as Hermes blocks
    did. A model that prefers `, ` to its end goes on (the embedded one: 97-99 % on `,`); that is its choice,
    and parallel_tool_calls false bounds it to one call.
    """
    rules = [f"call_{i}: %json {json.dumps(_call_schema(tool))}" for i, tool in enumerate(tools)]
    more = ' (", " call)*' if parallel else ""
    lines = [f'start: "[" call{more} "]"?', "call: " + " | ".join(f"call_{i}" for i in range(len(tools))), *rules]
    return StructuredOutputsParams(grammar="\n".join(lines) + "\n")


def named_call_grammar(tool: Tool) -> StructuredOutputsParams:
    """A named tool_choice: the output is that function's arguments alone, and the server writes the call around
    them (as vLLM does). Nothing of the Hermes block is spent on tokens: a cut-off call is one cut in its
    arguments."""
    return StructuredOutputsParams(json={"x-guidance": dict(JSON_STYLE), **parameters_schema(tool)})


def _call_schema(tool: Tool) -> dict[str, Any]:
    """One call of the list, a grammar rule of its own (so its `$ref`s are rebased to its root)."""
    return {"x-guidance": dict(JSON_STYLE), "type": "object",
            "properties": {"name": {"const": tool.function.name},
                           "parameters": _rebase_refs(parameters_schema(tool), "#/properties/parameters")},
            "required": ["name", "parameters"], "additionalProperties": False}


def _rebase_refs(schema: Any, base: str) -> Any:
    """The schema with its local `$ref`s ("#/$defs/x", "#") pointing into it at `base` of a larger one."""
    if isinstance(schema, dict):
        return {key: base + value[1:] if key == "$ref" and isinstance(value, str) and value.startswith("#")
                else _rebase_refs(value, base) for key, value in schema.items()}
    if isinstance(schema, list):
        return [_rebase_refs(item, base) for item in schema]
    return schema


# -- what the chat template sees ----------------------------------------------------------------------
def template_messages(messages: list[ChatMessage], tools: list[Tool], template_takes_tools: bool,
                      call_format: ToolFormat = TOOL_FORMATS["hermes"], image_token: str = "") -> list[dict]:
    """Messages as chat templates read them (OpenAI's dicts, as transformers passes them); image parts as
    `image_token` in the text.

    A template that reads `tools` gets calls with their arguments as objects and `tool` turns as they are;
    one that does not gets the tool list in the system message, calls written in `call_format` in the
    assistant's text and results as `<tool_response>` blocks in user turns, which any template renders.
    """
    if template_takes_tools:
        return [_native_message(m, image_token) for m in messages]
    dicts: list[dict[str, Any]] = []
    for message in messages:
        as_text = _text_message(message, call_format, image_token)
        if message.role == "tool" and dicts and dicts[-1].get("tool_results"):
            dicts[-1]["content"] += "\n" + as_text["content"]  # results of one turn's calls: one user turn
        else:
            dicts.append(as_text)
    for item in dicts:
        item.pop("tool_results", None)
    return _with_tool_prompt(dicts, tools, call_format) if tools else dicts


def _role(message: ChatMessage) -> str:
    return "system" if message.role == "developer" else message.role


def _native_message(message: ChatMessage, image_token: str = "") -> dict[str, Any]:
    item: dict[str, Any] = {"role": _role(message), "content": message.text(image_token)}
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


def _text_message(message: ChatMessage, call_format: ToolFormat, image_token: str = "") -> dict[str, Any]:
    if message.role == "tool":
        return {"role": "user", "content": f"<tool_response>\n{message.text()}\n</tool_response>",
                "tool_results": True}
    text = message.text(image_token)
    calls = call_format.write([(call.function.name, _arguments_value(call.function.arguments))
                               for call in message.tool_calls]) if message.tool_calls else ""
    return {"role": _role(message), "content": "\n".join(part for part in (text, calls) if part)}


def tool_prompt(tools: list[Tool], call_format: ToolFormat = TOOL_FORMATS["hermes"]) -> str:
    """The tool list and call format, for models whose template ignores `tools`."""
    listing = "\n".join(json.dumps(tool.model_dump(exclude_none=True), ensure_ascii=False) for tool in tools)
    return ("# Tools\n\nYou can call functions to help answer the user. Their signatures, one JSON object per "
            f"line:\n<tools>\n{listing}\n</tools>\n\nTo call a function, reply with {call_format.example}\n"
            "The result comes back in a <tool_response> block.")


def _with_tool_prompt(dicts: list[dict[str, Any]], tools: list[Tool], call_format: ToolFormat
                      ) -> list[dict[str, Any]]:
    prompt = tool_prompt(tools, call_format)
    if dicts and dicts[0]["role"] == "system":
        return [{**dicts[0], "content": f"{dicts[0]['content']}\n\n{prompt}"}, *dicts[1:]]
    return [{"role": "system", "content": prompt}, *dicts]


# -- what the model wrote -----------------------------------------------------------------------------
@dataclass(frozen=True)
class CallParsing:
    """How a chat answer's calls are read: the functions offered, at most how many calls (None: any), the
    tool_choice (auto: the served format's markup amid text; required: a JSON list of calls; named: the
    function's arguments alone) and the format."""

    schemas: Schemas
    limit: int | None = None
    named: str | None = None
    required: bool = False
    call_format: ToolFormat = TOOL_FORMATS["hermes"]

    @classmethod
    def of(cls, request: ChatCompletionRequest, offered: list[Tool], call_format: ToolFormat) -> CallParsing | None:
        if not offered:
            return None
        schemas = {tool.function.name: parameters_schema(tool) for tool in offered}
        if isinstance(request.tool_choice, NamedToolChoice):
            return cls(schemas, 1, request.tool_choice.function.name, call_format=call_format)
        return cls(schemas, 1 if request.parallel_tool_calls is False else None,
                   required=request.tool_choice_mode == "required", call_format=call_format)

    def parser(self) -> CallReader:
        if self.named is not None:
            return NamedCallParser(self.named, self.call_format.new_id)
        if self.required:
            return ListCallReader(self.schemas, self.limit, self.call_format.new_id)
        return self.call_format.read(self.schemas, self.limit)


@dataclass
class NamedCallParser:
    """A named tool_choice's output: the arguments of one call, known whole at the end. A cut-off one is still
    the call, as OpenAI's is: its finish_reason "length" says the arguments stopped short."""

    name: str
    new_id: Callable[[], str] = new_call_id
    calls: list[ParsedCall] = field(default_factory=list)
    _arguments: str = ""

    def feed(self, text: str) -> list[str | ParsedCall]:
        self._arguments += text
        return []

    def finish(self) -> list[str | ParsedCall]:
        arguments, self._arguments = self._arguments.strip(), ""
        if not arguments:
            return []
        call = ParsedCall(self.new_id(), self.name, arguments)
        self.calls.append(call)
        return [call]


_CUT_ITEM = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"parameters"\s*:\s*(.*)', re.DOTALL)


@dataclass
class ListCallReader:
    """tool_choice "required": the answer is the JSON list of calls that call_grammar allows, read as each item
    closes. A list cut short by max_tokens ends in the calls it holds, the cut one with the arguments it got to
    (finish_reason "length" says so); what cannot be a call yet is never content."""

    schemas: Schemas
    limit: int | None = None
    new_id: Callable[[], str] = new_call_id
    calls: list[ParsedCall] = field(default_factory=list)
    _text: str = ""
    _at: int = 0  # where the next item starts (before the separators)

    def feed(self, text: str) -> list[str | ParsedCall]:
        self._text += text
        events: list[str | ParsedCall] = []
        while True:
            at = self._next_item()
            try:
                item, self._at = _DECODER.raw_decode(self._text, at)
            except ValueError:
                return events
            if isinstance(item, dict):
                self._add(item.get("name"), json.dumps(item.get("parameters", {}), ensure_ascii=False), events)

    def finish(self) -> list[str | ParsedCall]:
        events: list[str | ParsedCall] = []
        cut = _CUT_ITEM.fullmatch(self._text, self._next_item())
        if cut is not None:
            self._add(json.loads(cut.group(1)), cut.group(2).strip(), events)
        self._text, self._at = "", 0
        return events

    def _next_item(self) -> int:
        at = self._at
        while at < len(self._text) and self._text[at] in " \t\n[,":
            at += 1
        return at

    def _add(self, name: Any, arguments: str, events: list[str | ParsedCall]) -> None:
        if name in self.schemas and arguments and (self.limit is None or len(self.calls) < self.limit):
            call = ParsedCall(self.new_id(), name, arguments)
            self.calls.append(call)
            events.append(call)


_DECODER = json.JSONDecoder()


def parse_tool_calls(text: str, parsing: CallParsing) -> tuple[str | None, list[ParsedCall]]:
    """A whole output as (content, calls); content is None when calls were all there was."""
    parser = parsing.parser()
    events = parser.feed(text) + parser.finish()
    content = "".join(event for event in events if isinstance(event, str))
    return (content or None) if parser.calls else content, parser.calls
