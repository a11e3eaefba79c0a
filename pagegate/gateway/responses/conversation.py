"""Responses input items <-> chat messages: a Responses request becomes a chat completion request.

The conversation a later turn continues is kept as chat messages, so a turn renders with the same chat template
as the one before it and its prompt starts with the tokens the earlier turn computed (their pages are reused).
Reasoning a client hands back is dropped: chat templates leave earlier turns' reasoning out.
"""

from __future__ import annotations

import json
from typing import Any

from pagegate.gateway.errors import BadRequest, rename_prefix
from pagegate.gateway.responses.protocol import (
    FunctionCallItem,
    FunctionCallOutputItem,
    FunctionChoice,
    MessageItem,
    ReasoningItem,
    ResponsesRequest,
)

Message = dict[str, Any]


def input_items(request: ResponsesRequest) -> list[dict[str, Any]]:
    """The request's input as items (a string is one user message), as GET .../input_items lists them."""
    if isinstance(request.input, str):
        return [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": request.input}]}]
    return [item.model_dump(exclude_none=True, by_alias=True) for item in request.input]


def input_messages(request: ResponsesRequest, known_calls: set[str]) -> list[Message]:
    """This turn's input as chat messages; consecutive function calls join one assistant turn.
    `known_calls`: call ids made earlier in the conversation (a function_call_output must answer one)."""
    if isinstance(request.input, str):
        return [{"role": "user", "content": request.input}]
    messages: list[Message] = []
    for index, item in enumerate(request.input):
        if isinstance(item, MessageItem):
            messages.append({"role": item.role, "content": item.chat_content()})
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": item.arguments}}
            if messages and messages[-1]["role"] == "assistant" and "tool_calls" in messages[-1]:
                messages[-1]["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            known_calls.add(item.call_id)
        elif isinstance(item, FunctionCallOutputItem):
            if item.call_id not in known_calls:
                raise BadRequest(f"No function call with call_id {item.call_id!r} precedes this output.",
                                 param=f"input.{index}.call_id")
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text()})
        else:
            assert isinstance(item, ReasoningItem)
    return messages


def call_ids(conversation: list[Message]) -> set[str]:
    return {call["id"] for message in conversation for call in message.get("tool_calls") or ()}


def answer_message(output: list[dict[str, Any]]) -> Message | None:
    """The response's output items as the assistant turn a later request continues from."""
    text = "".join(part["text"] for item in output if item["type"] == "message" for part in item["content"])
    calls = [{"id": item["call_id"], "type": "function",
              "function": {"name": item["name"], "arguments": item["arguments"]}}
             for item in output if item["type"] == "function_call"]
    if not text and not calls:
        return None
    message: Message = {"role": "assistant", "content": text or None}
    if calls:
        message["tool_calls"] = calls
    return message


def chat_body(request: ResponsesRequest, conversation: list[Message]) -> dict[str, Any]:
    """The chat completion request this Responses request is, over the whole `conversation`."""
    system = [{"role": "system", "content": request.instructions}] if request.instructions else []
    body: dict[str, Any] = {"model": request.model, "messages": system + conversation, "stream": request.stream,
                            "max_completion_tokens": request.max_output_tokens, "temperature": request.temperature,
                            "top_p": request.top_p, "parallel_tool_calls": request.parallel_tool_calls,
                            "chat_template_kwargs": request.chat_template_kwargs,
                            "prompt_cache_key": request.prompt_cache_key,
                            "prompt_cache_retention": request.prompt_cache_retention}
    if request.tools:
        body["tools"] = [{"type": "function", "function": tool.model_dump(exclude={"type"}, exclude_none=True)}
                         for tool in request.tools]
        choice = request.tool_choice
        body["tool_choice"] = ({"type": "function", "function": {"name": choice.name}}
                               if isinstance(choice, FunctionChoice) else choice)
    if request.reasoning is not None:
        body["reasoning_effort"] = request.reasoning.effort
    fmt = request.text.format if request.text is not None else None
    if fmt is not None and fmt.type == "json_object":
        body["response_format"] = {"type": "json_object"}
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.schema_ is None:
            raise BadRequest("Missing required parameter: 'text.format.schema'.", param="text.format.schema",
                             code="missing_required_parameter")
        body["response_format"] = {"type": "json_schema", "json_schema": {
            "name": fmt.name or "output", "schema": fmt.schema_, "strict": fmt.strict}}
    return {key: value for key, value in body.items() if value is not None}


_CHAT_TO_RESPONSES = (("max_completion_tokens", "max_output_tokens"),
                      ("response_format.json_schema", "text.format"), ("response_format", "text.format"),
                      ("reasoning_effort", "reasoning.effort"), ("tool_choice.function.name", "tool_choice.name"),
                      ("tool_choice.function", "tool_choice"))


def client_param(param: str) -> str:
    """The field of a Responses request a param of its chat body (chat_body) stands for."""
    parts = param.split(".")
    if parts[0] == "tools" and len(parts) >= 3 and parts[2] == "function":
        return ".".join(parts[:2] + parts[3:])  # tools.N.function.parameters -> tools.N.parameters
    if parts[0] == "messages":
        return "input"  # the conversation's messages come from this and earlier turns' items, not one by one
    return rename_prefix(param, _CHAT_TO_RESPONSES)


def describe(request: ResponsesRequest) -> dict[str, Any]:
    """The request-side fields a response object echoes."""
    choice = request.tool_choice
    return {"instructions": request.instructions, "metadata": request.metadata or {},
            "previous_response_id": request.previous_response_id, "store": request.store,
            "tools": [tool.model_dump(exclude_none=True) for tool in request.tools or ()],
            "tool_choice": choice.model_dump() if isinstance(choice, FunctionChoice) else (choice or "auto"),
            "parallel_tool_calls": request.parallel_tool_calls is not False,
            "temperature": request.temperature, "top_p": request.top_p,
            "max_output_tokens": request.max_output_tokens,
            "text": {"format": json.loads(request.text.format.model_dump_json(by_alias=True, exclude_none=True))}
            if request.text is not None and request.text.format is not None else {"format": {"type": "text"}},
            "reasoning": request.reasoning.model_dump() if request.reasoning is not None else None,
            "truncation": request.truncation or "disabled", "user": request.user}
