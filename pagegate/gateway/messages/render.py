"""Engine outputs -> Anthropic Messages objects and stream events.

An answer's events (reasoning, text, calls: pagegate.gateway.answer) become content blocks in the order they come:
`thinking`, `text`, one `tool_use` per call. Streamed: `message_start` (with the first output, when the prompt's
cache reads and writes are known), then per block `content_block_start`, its deltas (`thinking_delta`,
`text_delta`, `input_json_delta`) and `content_block_stop`, then `message_delta` with the stop reason and usage,
and `message_stop`.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field
from typing import Any

from pagegate.engine.outputs import CompletionOutput, RequestOutput
from pagegate.gateway.answer import AnswerEvent, Reasoning
from pagegate.gateway.prompt_cache import cache_writes
from pagegate.gateway.render import ItemRenderer
from pagegate.gateway.tool_formats import ParsedCall


@dataclass
class MessagesRenderer(ItemRenderer):
    """One message (n = 1)."""

    stop_sequences: list[str] = field(default_factory=list)
    blocks: list[dict[str, Any]] = field(default_factory=list)
    open_kind: str | None = None  # the type of the last block while it still grows
    started: bool = False  # message_start went out

    object_name = "message"

    def message(self, completion: CompletionOutput | None) -> dict[str, Any]:
        """The message so far: `completion` is the answer's last delta once it finished."""
        return {"id": self.request_id, "type": "message", "role": "assistant", "model": self.prepared.model,
                "content": list(self.blocks), "stop_reason": self.stop_reason(completion),
                "stop_sequence": self.stop_sequence(completion), "usage": self.usage_of()}

    def usage_of(self) -> dict[str, Any]:
        """Anthropic's split of the prompt: tokens read from the prefix cache, tokens this request wrote into pages
        its breakpoints pinned (by their TTL), and input_tokens, the rest; they add up to the prompt."""
        prompt, read = len(self.prepared.prompts[0].token_ids), self.cached_tokens()
        progress = self.progress.get(0)
        five, hour = cache_writes(self.prepared.cache_pins, progress.pinned if progress else [], read)
        return {"input_tokens": prompt - read - five - hour, "cache_creation_input_tokens": five + hour,
                "cache_read_input_tokens": read, "output_tokens": self.generated_tokens(),
                "cache_creation": {"ephemeral_5m_input_tokens": five, "ephemeral_1h_input_tokens": hour}}

    def stop_reason(self, completion: CompletionOutput | None) -> str | None:
        if completion is None or not completion.finished:
            return None
        if completion.finish_reason == "length":
            return "max_tokens"
        if any(block["type"] == "tool_use" for block in self.blocks):
            return "tool_use"
        return "stop_sequence" if self.stop_sequence(completion) is not None else "end_turn"

    def stop_sequence(self, completion: CompletionOutput | None) -> str | None:
        reason = completion.stop_reason if completion is not None else None
        return reason if isinstance(reason, str) and reason in self.stop_sequences else None

    # -- the stream -----------------------------------------------------------------------------------
    def update(self, prompt_index: int, output: RequestOutput) -> list[dict]:
        """The first output opens the message: its usage then says what the prompt read and wrote in the cache (it
        travels with the first tokens either way)."""
        events = super().update(prompt_index, output)
        if self.started:
            return events
        self.started = True
        return [{"type": "message_start", "message": dict(self.message(None), content=[])}, *events]

    def error_chunk(self, body: dict) -> dict:
        return body  # already Anthropic's shape (the route's error_body)

    def closing(self, completion: CompletionOutput) -> list[dict]:
        events = self.close_block()
        final = self.final = self.message(completion)
        usage = {key: value for key, value in final["usage"].items() if key != "cache_creation"}  # the totals
        return [*events, {"type": "message_delta", "usage": usage,
                          "delta": {"stop_reason": final["stop_reason"], "stop_sequence": final["stop_sequence"]}},
                {"type": "message_stop"}]

    # -- blocks ---------------------------------------------------------------------------------------
    def take_piece(self, piece: AnswerEvent) -> list[dict]:
        if isinstance(piece, ParsedCall):
            return [*self.close_block(), *self.tool_use(piece)]
        kind, text = ("thinking", piece.text) if isinstance(piece, Reasoning) else ("text", piece)
        events = [] if self.open_kind == kind else [*self.close_block(), *self.open(kind)]
        block = self.blocks[-1]
        block[kind] += text
        delta = {"type": "thinking_delta", "thinking": text} if kind == "thinking" else {"type": "text_delta",
                                                                                          "text": text}
        return [*events, {"type": "content_block_delta", "index": len(self.blocks) - 1, "delta": delta}]

    def open(self, kind: str) -> list[dict]:
        block = {"type": "thinking", "thinking": "", "signature": ""} if kind == "thinking" else {
            "type": "text", "text": ""}
        self.blocks.append(block)
        self.open_kind = kind
        return [{"type": "content_block_start", "index": len(self.blocks) - 1, "content_block": dict(block)}]

    def close_block(self) -> list[dict]:
        if self.open_kind is None:
            return []
        self.open_kind = None
        return [{"type": "content_block_stop", "index": len(self.blocks) - 1}]

    def tool_use(self, call: ParsedCall) -> list[dict]:
        block = {"type": "tool_use", "id": "toolu_" + secrets.token_hex(12), "name": call.name,
                 "input": _arguments_object(call.arguments)}
        self.blocks.append(block)
        index = len(self.blocks) - 1
        return [{"type": "content_block_start", "index": index, "content_block": dict(block, input={})},
                {"type": "content_block_delta", "index": index,
                 "delta": {"type": "input_json_delta", "partial_json": call.arguments}},
                {"type": "content_block_stop", "index": index}]


def _arguments_object(text: str) -> dict[str, Any]:
    """A cut-off forced call's arguments are not JSON yet; its block then has no input."""
    try:
        value = json.loads(text)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}
