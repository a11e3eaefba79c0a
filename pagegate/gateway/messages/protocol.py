"""Request models of POST /v1/messages (Anthropic's Messages API), and its chat-completion equivalent.

A Messages request becomes the chat request it means: `system` a system message, text blocks content, `tool_use`
blocks an assistant's tool_calls, `tool_result` blocks tool messages; tool_choice auto/any/tool/none are chat's
auto/required/named/none. Thinking blocks a client hands back are dropped (templates leave old reasoning out).
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import Field

from pagegate.engine.sampling.structured import MAX_TOOLS
from pagegate.gateway.protocol import FUNCTION_NAME, INT32, StrictModel

Message = dict[str, Any]


class TextBlock(StrictModel):
    type: Literal["text"]
    text: str
    citations: list[Any] | None = None
    cache_control: dict[str, Any] | None = None  # prefix caching is automatic here


class ToolUseBlock(StrictModel):
    type: Literal["tool_use"]
    id: str = Field(min_length=1)
    name: str
    input: dict[str, Any]
    cache_control: dict[str, Any] | None = None


class ToolResultBlock(StrictModel):
    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1)
    content: str | list[TextBlock] = ""
    is_error: bool | None = None
    cache_control: dict[str, Any] | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)


class ThinkingBlock(StrictModel):
    type: Literal["thinking", "redacted_thinking"]
    thinking: str | None = None
    signature: str | None = None
    data: str | None = None


Block = Annotated[TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock, Field(discriminator="type")]


class InputMessage(StrictModel):
    role: Literal["user", "assistant"]
    content: str | list[Block]


class ToolDefinition(StrictModel):
    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None
    cache_control: dict[str, Any] | None = None


class ToolChoice(StrictModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


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
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None

    def chat_body(self) -> dict[str, Any]:
        """The chat completion request this is."""
        system = self.system if isinstance(self.system, str) else "".join(b.text for b in self.system or ())
        messages = ([{"role": "system", "content": system}] if system else []) + chat_messages(self.messages)
        body: dict[str, Any] = {"model": self.model, "messages": messages, "max_tokens": self.max_tokens,
                                "stream": self.stream, "temperature": self.temperature, "top_p": self.top_p,
                                "top_k": self.top_k, "stop": self.stop_sequences}
        if self.tools:
            body["tools"] = [{"type": "function", "function": {
                "name": tool.name, "description": tool.description, "parameters": tool.input_schema}}
                for tool in self.tools]
        choice = self.tool_choice
        if choice is not None:
            body["tool_choice"] = ({"type": "function", "function": {"name": choice.name}} if choice.type == "tool"
                                   else {"any": "required"}.get(choice.type, choice.type))
            if choice.disable_parallel_tool_use:
                body["parallel_tool_calls"] = False
        if self.thinking is not None:  # templates that read it (Qwen3's) think or not as asked
            body["chat_template_kwargs"] = {"enable_thinking": self.thinking.type != "disabled"}
        return {key: value for key, value in body.items() if value is not None}


class CountTokensRequest(MessagesRequest):
    """POST /v1/messages/count_tokens: a Messages request without a token budget."""

    max_tokens: int | None = Field(None, ge=1, le=INT32)  # type: ignore[assignment]


def chat_messages(messages: list[InputMessage]) -> list[Message]:
    out: list[Message] = []
    for message in messages:
        if isinstance(message.content, str):
            out.append({"role": message.role, "content": message.content})
            continue
        text = "".join(b.text for b in message.content if isinstance(b, TextBlock))
        calls = [{"id": b.id, "type": "function",
                  "function": {"name": b.name, "arguments": json.dumps(b.input, ensure_ascii=False)}}
                 for b in message.content if isinstance(b, ToolUseBlock)]
        results = [{"role": "tool", "tool_call_id": b.tool_use_id, "content": b.text()}
                   for b in message.content if isinstance(b, ToolResultBlock)]
        out.extend(results)  # a user turn's tool results answer the calls just before it
        if message.role == "assistant" and calls:
            out.append({"role": "assistant", "content": text or None, "tool_calls": calls})
        elif text or not results:
            out.append({"role": message.role, "content": text})
    return out
