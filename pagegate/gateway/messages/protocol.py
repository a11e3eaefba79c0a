"""Request models of POST /v1/messages (Anthropic's Messages API), and its chat-completion equivalent.

A Messages request becomes the chat request it means: `system` a system message, text blocks content, `tool_use`
blocks an assistant's tool_calls, `tool_result` blocks tool messages; tool_choice auto/any/tool/none are chat's
auto/required/named/none. Thinking blocks a client hands back are dropped (templates leave old reasoning out).
A block marked with `cache_control` is a prompt-cache breakpoint (messages/cache.py).
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import Field

from pagegate.engine.sampling.structured import MAX_TOOLS
from pagegate.gateway.errors import BadRequest, client_params, rename_prefix, without_tags
from pagegate.gateway.protocol import FUNCTION_NAME, INT32, StrictModel, parse_request

Message = dict[str, Any]


class CacheControl(StrictModel):
    """A prompt-cache breakpoint: the prompt up to the end of its block stays cached for `ttl`."""

    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] = "5m"


class TextBlock(StrictModel):
    type: Literal["text"]
    text: str
    citations: list[Any] | None = None
    cache_control: CacheControl | None = None


class ToolUseBlock(StrictModel):
    type: Literal["tool_use"]
    id: str = Field(min_length=1)
    name: str
    input: dict[str, Any]
    cache_control: CacheControl | None = None


class ToolResultBlock(StrictModel):
    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1)
    content: str | list[TextBlock] = ""
    is_error: bool | None = None
    cache_control: CacheControl | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)


class ThinkingBlock(StrictModel):
    type: Literal["thinking", "redacted_thinking"]
    thinking: str | None = None
    signature: str | None = None
    data: str | None = None


class Base64Source(StrictModel):
    type: Literal["base64"]
    media_type: Literal["image/jpeg", "image/png", "image/gif", "image/webp"]
    data: str = Field(min_length=1)


class URLSource(StrictModel):
    type: Literal["url"]
    url: str = Field(min_length=1)


class ImageBlock(StrictModel):
    type: Literal["image"]
    source: Annotated[Base64Source | URLSource, Field(discriminator="type")]
    cache_control: CacheControl | None = None

    def url(self) -> str:
        """The image as a chat image_url's URL (a data: URL for base64 data)."""
        source = self.source
        return source.url if isinstance(source, URLSource) else f"data:{source.media_type};base64,{source.data}"


Block = Annotated[TextBlock | ImageBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock, Field(discriminator="type")]
BLOCK_TYPES = frozenset({"text", "image", "tool_use", "tool_result", "thinking", "redacted_thinking"})


class InputMessage(StrictModel):
    role: Literal["user", "assistant"]
    content: str | list[Block]


class ToolDefinition(StrictModel):
    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None
    cache_control: CacheControl | None = None


class ToolChoice(StrictModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class Metadata(StrictModel):
    """Anthropic's request metadata: an opaque id of the end user, nothing else."""

    user_id: str | None = Field(None, max_length=256)


class Thinking(StrictModel):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = None


class MessagesRequest(StrictModel):
    model: str
    max_tokens: int = Field(ge=1, le=INT32)
    messages: Annotated[list[InputMessage], Field(min_length=1)]
    system: str | list[TextBlock] | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = Field(None, ge=0.0, le=1.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0, le=INT32)
    tools: Annotated[list[ToolDefinition], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    metadata: Metadata | None = None
    service_tier: str | None = None

    def check_conversation(self) -> None:
        """What Anthropic's API refuses beyond the shape of each field: a message without content (the last
        may be an empty assistant turn to continue), a tool_result answering no tool_use of the message before."""
        last = len(self.messages) - 1
        for index, message in enumerate(self.messages):
            if not message.content and not (index == last and message.role == "assistant"):
                raise BadRequest(f"messages.{index}: all messages must have non-empty content except for the "
                                 "optional final assistant message", param=f"messages.{index}.content")
            _check_results(self.messages, index)

    def chat_body(self) -> dict[str, Any]:
        """The chat completion request this is."""
        system = self._system_text()
        messages = ([{"role": "system", "content": system}] if system else []) + chat_messages(self.messages)[0]
        body: dict[str, Any] = {"model": self.model, "messages": messages, "max_tokens": self.max_tokens,
                                "stream": self.stream, "temperature": self.temperature, "top_p": self.top_p,
                                "top_k": self.top_k, "stop": self.stop_sequences}
        if self.tools:
            body["tools"] = [{"type": "function", "function": {
                "name": tool.name, "description": tool.description, "parameters": tool.input_schema}}
                for tool in self.tools]
        choice = self.tool_choice
        if choice is not None:
            named = {"name": choice.name} if choice.name is not None else {}  # none: a 400 naming tool_choice.name
            body["tool_choice"] = ({"type": "function", "function": named} if choice.type == "tool"
                                   else {"any": "required"}.get(choice.type, choice.type))
            if choice.disable_parallel_tool_use:
                body["parallel_tool_calls"] = False
        if self.thinking is not None:  # templates that read it (Qwen3's) think or not as asked
            body["chat_template_kwargs"] = {"enable_thinking": self.thinking.type != "disabled"}
        return {key: value for key, value in body.items() if value is not None}

    def _system_text(self) -> str:
        return self.system if isinstance(self.system, str) else "".join(b.text for b in self.system or ())

    def client_param(self, param: str) -> str:
        """The field of this request a param of its chat body (chat_body) stands for."""
        if param == "messages" or param.startswith("messages."):
            sources = (["system"] if self._system_text() else []) + chat_messages(self.messages)[1]
            index = param.split(".")[1] if "." in param else ""
            return sources[int(index)] if index.isdigit() and int(index) < len(sources) else "messages"
        if param.startswith("tools."):
            return _tool_param(param)
        return rename_prefix(param, _CHAT_TO_MESSAGES)


_CHAT_TO_MESSAGES = (("stop", "stop_sequences"), ("tool_choice.function.name", "tool_choice.name"),
                     ("tool_choice.function", "tool_choice"),
                     ("parallel_tool_calls", "tool_choice.disable_parallel_tool_use"),
                     ("chat_template_kwargs", "thinking"))


def _tool_param(param: str) -> str:
    """tools.N.function.parameters... (a chat tool) -> tools.N.input_schema... (a Messages tool)."""
    parts = param.split(".")
    if len(parts) < 3 or parts[2] != "function":
        return param
    rest = parts[3:]
    if rest and rest[0] == "parameters":
        rest[0] = "input_schema"
    return ".".join(parts[:2] + rest)


def _check_results(messages: list[InputMessage], index: int) -> None:
    """Each tool_result of messages[index] answers a tool_use of the message just before it."""
    content = messages[index].content
    if isinstance(content, str):
        return
    before = messages[index - 1].content if index > 0 and messages[index - 1].role == "assistant" else []
    asked = {block.id for block in before if isinstance(block, ToolUseBlock)} if not isinstance(before, str) else set()
    for position, block in enumerate(content):
        if isinstance(block, ToolResultBlock) and block.tool_use_id not in asked:
            raise BadRequest(f"messages.{index}.content.{position}: unexpected `tool_use_id` found in "
                             f"`tool_result` blocks: {block.tool_use_id}. Each `tool_result` block must have a "
                             "corresponding `tool_use` block in the previous message.",
                             param=f"messages.{index}.content.{position}.tool_use_id")


def parse_messages(request_cls: type[MessagesRequest], body: Any) -> MessagesRequest:
    """The request, or a 400 naming the field as sent (`messages.0.content.1.text`, no block type in it)."""
    def sent(param: str) -> str:
        parts = param.split(".")
        if len(parts) > 3 and parts[0] == "messages" and parts[2] == "content":
            return without_tags(param, ".".join(parts[:3]), BLOCK_TYPES)
        return param

    with client_params(sent):
        return parse_request(request_cls, body)


class CountTokensRequest(MessagesRequest):
    """POST /v1/messages/count_tokens: a Messages request without a token budget."""

    max_tokens: int | None = Field(None, ge=1, le=INT32)  # type: ignore[assignment]


def chat_messages(messages: list[InputMessage]) -> tuple[list[Message], list[str]]:
    """The chat messages, and for each the path of the message it came from (`messages.3`)."""
    out: list[Message] = []
    sources: list[str] = []
    for index, message in enumerate(messages):
        start = len(out)
        _add_chat_messages(message, out)
        sources.extend([f"messages.{index}"] * (len(out) - start))
    return out, sources


def _add_chat_messages(message: InputMessage, out: list[Message]) -> None:
    if isinstance(message.content, str):
        out.append({"role": message.role, "content": message.content})
    else:
        _add_blocks(message.role, message.content, out)


def _add_blocks(role: str, blocks: list[Block], out: list[Message]) -> None:
    text = "".join(b.text for b in blocks if isinstance(b, TextBlock))
    calls = [{"id": b.id, "type": "function",
              "function": {"name": b.name, "arguments": json.dumps(b.input, ensure_ascii=False)}}
             for b in blocks if isinstance(b, ToolUseBlock)]
    results = [{"role": "tool", "tool_call_id": b.tool_use_id, "content": b.text()}
               for b in blocks if isinstance(b, ToolResultBlock)]
    out.extend(results)  # a user turn's tool results answer the calls just before it
    if role == "assistant" and calls:
        out.append({"role": "assistant", "content": text or None, "tool_calls": calls})
    elif any(isinstance(b, ImageBlock) for b in blocks):  # text and images in their order, as chat parts
        out.append({"role": role, "content": [{"type": "image_url", "image_url": {"url": b.url()}}
                                              if isinstance(b, ImageBlock) else {"type": "text", "text": b.text}
                                              for b in blocks if isinstance(b, TextBlock | ImageBlock)]})
    elif text or not results:
        out.append({"role": role, "content": text})
