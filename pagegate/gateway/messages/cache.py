"""Anthropic's prompt-cache breakpoints: each block marked with `cache_control` (a tool, a system block, a message's
content block; at most 4) pins the prompt's pages up to the end of that block for its ttl (gateway/prompt_cache.py).

NOTE: where a block ends in the prompt's tokens is the chat template's business, so it is measured, not assumed: the
request is cut after the marked block (in Anthropic's order: tools, system, messages), rendered with the same
template without a generation prompt and tokenized, and the breakpoint's prefix is what that prompt has in common
with the whole one (vLLM and llama.cpp find cached prefixes by common tokens too). A template that renders a block
elsewhere (tools after the system text, tools in the last user turn) gives a shorter common prefix, never a longer
one: a breakpoint never covers a token the prompt does not hold at that place.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pagegate.engine.pin import Pin
from pagegate.gateway.errors import BadRequest
from pagegate.gateway.messages.protocol import (
    Block,
    CacheControl,
    InputMessage,
    MessagesRequest,
    TextBlock,
    ToolResultBlock,
)
from pagegate.gateway.prepare import ModelContext, chat_prompt, template_variables
from pagegate.gateway.prompt_cache import prefix_pin
from pagegate.gateway.protocol import ChatCompletionRequest, parse_request
from pagegate.gateway.tools import offered_tools

MAX_BREAKPOINTS = 4  # Anthropic's bound


@dataclass(frozen=True)
class Breakpoint:
    """A marked block, as the part of the request up to its end: the first `tools` tools and `system` system blocks
    (None: all of them), `messages` whole messages and `blocks` blocks of the next one."""

    ttl: str
    tools: int | None = None
    system: int | None = None
    messages: int = 0
    blocks: int = 0


def breakpoints(request: MessagesRequest) -> list[Breakpoint]:
    """The request's breakpoints in prompt order; a 400 for one on an empty text block, for more than 4, and for a
    1-hour one after a 5-minute one (Anthropic's rules)."""
    marks: list[Breakpoint] = []
    for index, tool in enumerate(request.tools or ()):
        if tool.cache_control is not None:
            marks.append(Breakpoint(tool.cache_control.ttl, tools=index + 1, system=0))
    for index, part in enumerate(request.system if isinstance(request.system, list) else ()):
        if (control := _control(part, f"system.{index}")) is not None:
            marks.append(Breakpoint(control.ttl, system=index + 1))
    for number, message in enumerate(request.messages):
        for index, block in enumerate(message.content if not isinstance(message.content, str) else ()):
            if (control := _control(block, f"messages.{number}.content.{index}")) is not None:
                marks.append(Breakpoint(control.ttl, messages=number, blocks=index + 1))
    if len(marks) > MAX_BREAKPOINTS:
        raise BadRequest(f"A maximum of {MAX_BREAKPOINTS} blocks with cache_control may be provided. Found "
                         f"{len(marks)}.")
    ttls = [mark.ttl for mark in marks]
    if "5m" in ttls and "1h" in ttls[ttls.index("5m"):]:
        raise BadRequest("A cache_control block with ttl '1h' must not come after one with ttl '5m' (blocks are "
                         "processed in the order tools, system, messages).")
    return marks


def _control(block: Block, param: str) -> CacheControl | None:
    """A block's cache_control, a tool_result's from its text parts too (it marks the whole result); a 400 for one
    on an empty text block."""
    if isinstance(block, TextBlock) and block.cache_control is not None and not block.text:
        raise BadRequest(f"{param}.text: cache_control cannot be set for empty text blocks", param=f"{param}.text")
    if not isinstance(block, ToolResultBlock) or isinstance(block.content, str):
        return getattr(block, "cache_control", None)
    parts = [_control(part, f"{param}.content.{index}") for index, part in enumerate(block.content)]
    return next((control for control in [block.cache_control, *parts] if control is not None), None)


def breakpoint_pins(request: MessagesRequest, marks: list[Breakpoint], token_ids: list[int],
                    model: ModelContext) -> list[Pin]:
    """One pin per breakpoint, of the prompt `token_ids` up to the marked block's end (a pin of no tokens holds
    nothing)."""
    return [prefix_pin(token_ids, _common_prefix(_cut_prompt(request, mark, model), token_ids), mark.ttl)
            for mark in marks]


def cut_body(request: MessagesRequest, mark: Breakpoint) -> dict[str, Any]:
    """The chat request of everything up to the end of the marked block; where no message is left, an empty user
    message (templates render none without one)."""
    messages = list(request.messages[:mark.messages])
    if mark.blocks:
        cut = request.messages[mark.messages]
        messages.append(cut.model_copy(update={"content": list(cut.content)[:mark.blocks]}))
    update: dict[str, Any] = {"messages": messages or [InputMessage(role="user", content="")]}
    if mark.tools is not None:
        update["tools"] = (request.tools or [])[:mark.tools] or None
    if mark.system is not None:
        update["system"] = request.system[:mark.system] if isinstance(request.system, list) and mark.system else None
    return request.model_copy(update=update).chat_body()


def _cut_prompt(request: MessagesRequest, mark: Breakpoint, model: ModelContext) -> list[int]:
    """The tokens of the request cut after the marked block; none when its template will not render that."""
    try:
        chat = parse_request(ChatCompletionRequest, cut_body(request, mark))
        return chat_prompt(chat.messages, model, add_generation_prompt=False, tools=offered_tools(chat),
                           variables=template_variables(chat, model)).token_ids
    except BadRequest:
        return []


def _common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
