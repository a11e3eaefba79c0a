"""The formats models write tool calls in (`--tool-call-parser`), and the readers that split a streamed answer
into content and calls.

hermes and qwen3_coder put each call in a `<tool_call>` block amid text; mistral's calls follow a `[TOOL_CALLS]`
marker to the end of the answer; a llama3_json or pythonic answer is calls from its first character, or text.
Any chunking of the text gives the same result: what may still become a call is held back until it is certain.
A call that names no offered function, or whose arguments are not an object, stays content.
"""

from __future__ import annotations

import ast
import json
import re
import secrets
import string
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

Call = tuple[str, Any]  # a function's name and its arguments as the model wrote them (an object, or JSON text)
Schemas = Mapping[str, dict[str, Any]]  # the functions offered: name → parameters schema


@dataclass(frozen=True)
class ParsedCall:
    id: str
    name: str
    arguments: str  # JSON text of an object

    def as_tool_call(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


def mistral_call_id() -> str:
    """Mistral's templates refuse any tool_call_id but nine letters and digits."""
    return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))


class CallReader(Protocol):
    calls: list[ParsedCall]

    def feed(self, text: str) -> list[str | ParsedCall]: ...
    def finish(self) -> list[str | ParsedCall]: ...


@dataclass
class _Calls:
    """What every reader shares: the offered functions, at most how many calls, the calls read so far."""

    schemas: Schemas
    limit: int | None = None
    new_id: Callable[[], str] = new_call_id
    calls: list[ParsedCall] = field(default_factory=list)

    @property
    def full(self) -> bool:
        return self.limit is not None and len(self.calls) >= self.limit

    def accept(self, call: Call | None) -> ParsedCall | None:
        """The call as OpenAI returns it, or None when it names no offered function or has no arguments object."""
        if call is None or call[0] not in self.schemas or self.full:
            return None
        arguments = call[1]
        if isinstance(arguments, str):  # some models write the arguments as JSON text
            arguments = _json(arguments)
        if not isinstance(arguments, dict):
            return None
        parsed = ParsedCall(self.new_id(), call[0], json.dumps(arguments, ensure_ascii=False))
        self.calls.append(parsed)
        return parsed


@dataclass
class TaggedReader(_Calls):
    """Calls in `open`…`close` blocks amid text (hermes, qwen3_coder). A block that is not a call stays content,
    as does an unfinished one at the end. Whitespace next to a call is dropped."""

    open: str = "<tool_call>"
    close: str = "</tool_call>"
    parse_body: Callable[[str, Schemas], Call | None] = lambda body, schemas: None
    _tail: str = ""  # unresolved text: held back outside a block, or the open block so far
    _in_block: bool = False
    _space_before: str = ""  # whitespace before the open block (content again if the block is not a call)
    _after_call: bool = False

    def feed(self, text: str) -> list[str | ParsedCall]:
        events: list[str | ParsedCall] = []
        text = self._tail + text
        while text:
            if self._in_block:
                end = text.find(self.close)
                if end < 0:
                    break
                end += len(self.close)
                self._close_block(text[:end], events)
                text = text[end:]
                continue
            if self._after_call:
                text = text.lstrip()
                if not text:
                    break
                self._after_call = False
            start = text.find(self.open)
            if start >= 0:
                before = text[:start]
                content = before.rstrip()
                _emit(events, content)
                self._space_before, self._in_block, text = before[len(content):], True, text[start:]
                continue
            keep = held_length(text, self.open)
            _emit(events, text[:len(text) - keep])
            text = text[len(text) - keep:]
            break
        self._tail = text
        return events

    def finish(self) -> list[str | ParsedCall]:
        rest = (self._space_before + self._tail) if self._in_block else self._tail
        self._tail, self._space_before, self._in_block = "", "", False
        return [rest] if rest else []

    def _close_block(self, block: str, events: list[str | ParsedCall]) -> None:
        call = self.accept(self.parse_body(block[len(self.open):-len(self.close)], self.schemas))
        if call is None:
            _emit(events, self._space_before + block)
        else:
            events.append(call)
            self._after_call = True
        self._space_before, self._in_block = "", False


@dataclass
class RegionReader(_Calls):
    """Calls from a marker to the end of the answer (mistral), or from the answer's start (llama3_json,
    pythonic: `at_start`). The calls are read at the end; a region that does not read as calls stays content."""

    markers: tuple[str, ...] = ()
    at_start: bool = False
    parse_region: Callable[[str], list[Call] | None] = lambda region: None
    _tail: str = ""
    _state: str = "start"  # start (nothing certain yet), text, region

    def feed(self, text: str) -> list[str | ParsedCall]:
        text, self._tail = self._tail + text, ""
        if self._state == "start":
            self._state = self._opening(text) if self.at_start else "text"
        if self._state != "text":
            self._tail = text  # a region (read at the end), or the start of the answer, still undecided
            return []
        return self._scan(text) if not self.at_start else [text] if text else []

    def _opening(self, text: str) -> str:
        stripped = text.lstrip()
        if any(stripped.startswith(marker) for marker in self.markers):
            return "region"
        return "start" if any(marker.startswith(stripped) for marker in self.markers) else "text"

    def _scan(self, text: str) -> list[str | ParsedCall]:
        starts = [at for at in (text.find(marker) for marker in self.markers) if at >= 0]
        if starts:
            before = text[:min(starts)]
            content = before.rstrip()  # the space before the marker goes with the region (content if it fails)
            self._state, self._tail = "region", text[len(content):]
            return [content] if content else []
        keep = max(held_length(text, marker) for marker in self.markers)
        self._tail = text[len(text) - keep:]
        return [text[:len(text) - keep]] if len(text) > keep else []

    def finish(self) -> list[str | ParsedCall]:
        rest, self._tail = self._tail, ""
        if self._state != "region":
            return [rest] if rest else []
        found = self.parse_region(rest.strip())
        if found and all(name in self.schemas for name, _ in found):
            for call in found:
                self.accept(call)  # calls past the limit are dropped: the model was asked for fewer
            if self.calls:
                return list(self.calls)
        return [rest]


def _emit(events: list[str | ParsedCall], text: str) -> None:
    if text:
        events.append(text)


def held_length(text: str, marker: str) -> int:
    """Characters at the end of `text` that may still start `marker`: a prefix of it and the space before."""
    partial = next((n for n in range(min(len(marker) - 1, len(text)), 0, -1) if marker.startswith(text[-n:])), 0)
    before = text[:len(text) - partial]
    return partial + len(before) - len(before.rstrip())


def _json(text: str) -> Any:
    try:
        return json.loads(text, parse_constant=_no_constant)
    except ValueError:
        return None


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


# -- hermes: <tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call> ---------------------------------
def _hermes_body(body: str, schemas: Schemas) -> Call | None:
    value = _json(body)
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    return value["name"], value.get("arguments", {})


def _hermes_write(calls: list[Call]) -> str:
    return "".join(f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments}, ensure_ascii=False)}\n"
                   "</tool_call>" for name, arguments in calls)  # back to back, as models are asked to


# -- qwen3_coder: <tool_call>\n<function=NAME>\n<parameter=KEY>\nVALUE\n</parameter>\n</function>\n</tool_call> --
_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>(.*)</function>\s*", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.DOTALL)


def _qwen3_coder_body(body: str, schemas: Schemas) -> Call | None:
    function = _FUNCTION.fullmatch(body)
    if function is None:
        return None
    name = function.group(1).strip()
    properties = schemas.get(name, {}).get("properties", {})
    return name, {key.strip(): _typed_value(value, properties.get(key.strip(), {}))
                  for key, value in _PARAMETER.findall(function.group(2))}


def _typed_value(text: str, schema: dict[str, Any]) -> Any:
    """Parameter values are bare text: strings as they are, anything else read as JSON (text if it is not)."""
    if schema.get("type", "string") == "string":
        return text
    value = _json(text)
    return text if value is None and text.strip() != "null" else value


def _qwen3_coder_write(calls: list[Call]) -> str:
    def value(item: Any) -> str:
        return item if isinstance(item, str) else json.dumps(item, ensure_ascii=False)
    return "".join("<tool_call>\n<function=" + name + ">\n" + "".join(
        f"<parameter={key}>\n{value(item)}\n</parameter>\n" for key, item in _as_object(arguments).items())
        + "</function>\n</tool_call>" for name, arguments in calls)


# -- mistral: [TOOL_CALLS][{"name": ..., "arguments": {...}}, ...] or [TOOL_CALLS]name[ARGS]{...} ---------
MISTRAL_MARKER = "[TOOL_CALLS]"


def _mistral_region(region: str) -> list[Call] | None:
    calls: list[Call] = []
    for part in region.split(MISTRAL_MARKER)[1:]:
        part = part.strip()
        if part.startswith("["):
            items = _json(part)
            if not isinstance(items, list) or not all(isinstance(i, dict) and "name" in i for i in items):
                return None
            calls += [(item["name"], item.get("arguments", {})) for item in items]
        elif "[ARGS]" in part:
            name, arguments = part.split("[ARGS]", 1)
            calls.append((name.strip(), _json(arguments)))
        else:
            return None
    return calls


def _mistral_write(calls: list[Call]) -> str:
    items = [{"name": name, "arguments": _as_object(arguments)} for name, arguments in calls]
    return MISTRAL_MARKER + json.dumps(items, ensure_ascii=False)


# -- llama3_json: {"name": ..., "parameters": {...}}; {...} (after <|python_tag|> or from the start) -------
PYTHON_TAG = "<|python_tag|>"


def _llama3_json_region(region: str) -> list[Call] | None:
    text, at, calls = region.removeprefix(PYTHON_TAG), 0, list[Call]()
    decoder = json.JSONDecoder()
    while True:
        while at < len(text) and text[at] in " \t\n;":
            at += 1
        if at == len(text):
            return calls
        try:
            value, at = decoder.raw_decode(text, at)
        except ValueError:
            return None
        if not isinstance(value, dict) or not isinstance(value.get("name"), str):
            return None
        calls.append((value["name"], value.get("parameters", value.get("arguments", {}))))


def _llama3_json_write(calls: list[Call]) -> str:
    return "; ".join(json.dumps({"name": name, "parameters": _as_object(arguments)}, ensure_ascii=False)
                     for name, arguments in calls)


# -- pythonic: [get_weather(city="Paris", unit="celsius"), ping()] ---------------------------------------
def _pythonic_region(region: str) -> list[Call] | None:
    text = region.removeprefix("<|python_start|>").removesuffix("<|python_end|>").strip()
    try:
        tree = ast.parse(text, mode="eval").body
    except SyntaxError:
        return None
    if not isinstance(tree, ast.List):
        return None
    calls: list[Call] = []
    for item in tree.elts:
        if not isinstance(item, ast.Call) or not isinstance(item.func, ast.Name) or item.args:
            return None
        try:
            arguments = {kw.arg: _literal(kw.value) for kw in item.keywords if kw.arg is not None}
        except ValueError:
            return None
        if len(arguments) != len(item.keywords):
            return None  # **kwargs
        calls.append((item.func.id, arguments))
    return calls


def _literal(node: ast.expr) -> Any:
    """A Python literal as its JSON value (tuples as lists); anything else (a name, a set, bytes) is an error."""
    value = ast.literal_eval(node)
    try:
        return json.loads(json.dumps(value))
    except (TypeError, ValueError):
        raise ValueError("not a JSON value") from None


def _pythonic_write(calls: list[Call]) -> str:
    return "[" + ", ".join(f"{name}(" + ", ".join(f"{key}={item!r}" for key, item in _as_object(arguments).items())
                           + ")" for name, arguments in calls) + "]"


def _as_object(arguments: Any) -> dict[str, Any]:
    value = _json(arguments) if isinstance(arguments, str) else arguments
    return value if isinstance(value, dict) else {}


# -- the formats --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ToolFormat:
    """How one family writes calls: read from its answers, written back into the prompt's past turns, and shown
    (with `example`) to models whose template ignores `tools`."""

    name: str
    reader: Callable[[Schemas, int | None, Callable[[], str]], CallReader]
    write: Callable[[list[Call]], str]
    example: str
    new_id: Callable[[], str] = new_call_id  # ids of the calls read
    keeps_special_tokens: bool = False  # its markers are special tokens: the answer's text must keep them

    def read(self, schemas: Schemas, limit: int | None) -> CallReader:
        """A reader of one answer's calls of the functions `schemas` holds, at most `limit` (None: any)."""
        return self.reader(schemas, limit, self.new_id)


def _tagged(parse_body: Callable[[str, Schemas], Call | None]
            ) -> Callable[[Schemas, int | None, Callable[[], str]], CallReader]:
    return lambda schemas, limit, new_id: TaggedReader(schemas, limit, new_id, parse_body=parse_body)


def _region(parse: Callable[[str], list[Call] | None], markers: tuple[str, ...], at_start: bool
            ) -> Callable[[Schemas, int | None, Callable[[], str]], CallReader]:
    return lambda schemas, limit, new_id: RegionReader(schemas, limit, new_id, markers=markers, at_start=at_start,
                                                       parse_region=parse)


TOOL_FORMATS = {format.name: format for format in (
    ToolFormat("hermes", _tagged(_hermes_body), _hermes_write, "one block per call:\n<tool_call>\n"
               '{"name": "<function name>", "arguments": {<arguments as JSON>}}\n</tool_call>'),
    ToolFormat("qwen3_coder", _tagged(_qwen3_coder_body), _qwen3_coder_write, "one block per call:\n<tool_call>\n"
               "<function=FUNCTION_NAME>\n<parameter=ARGUMENT_NAME>\nvalue\n</parameter>\n</function>\n</tool_call>"),
    ToolFormat("mistral", _region(_mistral_region, (MISTRAL_MARKER,), False), _mistral_write,
               f'the marker and a JSON list of calls:\n{MISTRAL_MARKER}[{{"name": "<function name>", '
               '"arguments": {<arguments as JSON>}}]', mistral_call_id, keeps_special_tokens=True),
    ToolFormat("llama3_json", _region(_llama3_json_region, ("{", PYTHON_TAG), True), _llama3_json_write,
               "nothing but JSON, one object per call, separated by '; ':\n"
               '{"name": "<function name>", "parameters": {<arguments as JSON>}}'),
    ToolFormat("pythonic", _region(_pythonic_region, ("[", "<|python_start|>"), True), _pythonic_write,
               "nothing but a Python list of calls:\n[function_name(argument=value, ...), ...]"),
)}


# -- which format a model writes: --tool-call-parser auto -----------------------------------------------
AUTO = "auto"
FALLBACK_FORMAT = "hermes"
# NOTE: as llama.cpp does (common/chat.cpp), the format is read off the chat template's source: each family's
# template writes its own call markup into past turns. Tried in order, a format matching when its template holds
# all of one entry's markers: Qwen3-Coder's template also writes <tool_call>, so it comes before hermes; vLLM's
# and ToolACE's pythonic templates also have Llama's ipython turns, so pythonic comes before llama3_json.
TEMPLATE_MARKERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("qwen3_coder", ("<function=", "<parameter=")),
    ("hermes", ("<tool_call>",)),
    ("mistral", (MISTRAL_MARKER,)),
    ("pythonic", ("[func_name1(",)),  # the call format those templates spell out to the model
    ("llama3_json", (PYTHON_TAG,)),  # Llama 3.1, 3.3
    ("llama3_json", ("<|start_header_id|>ipython<|end_header_id|>",)),  # Llama 3.2 (no python tag)
    ("llama3_json", ("<|header_start|>ipython<|header_end|>",)),  # Llama 4's own template: JSON calls
)


def detect_tool_format(chat_template: str | None) -> tuple[str, str]:
    """The format a model writes calls in, read off its chat template, and why (for the start-up log). A template
    with no known markup (or none at all) gets hermes: models whose template ignores `tools` are shown its
    format in the system message."""
    if not chat_template:
        return FALLBACK_FORMAT, "the model has no chat template"
    for name, markers in TEMPLATE_MARKERS:
        if all(marker in chat_template for marker in markers):
            return name, "its chat template writes " + " and ".join(markers)
    return FALLBACK_FORMAT, "its chat template writes no call markup pagegate knows"


def resolve_tool_format(parser: str, chat_template: str | None) -> tuple[str, str]:
    """--tool-call-parser: a format it names wins; `auto` reads the chat template (detect_tool_format)."""
    if parser != AUTO:
        return parser, "--tool-call-parser"
    return detect_tool_format(chat_template)
