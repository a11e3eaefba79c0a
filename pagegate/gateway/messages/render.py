"""Engine outputs -> Anthropic Messages objects and stream events.

An answer's events (reasoning, text, calls: pagegate.gateway.answer) become content blocks in the order they come:
`thinking`, `text`, one `tool_use` per call. Streamed: `message_start`, then per block `content_block_start`, its
deltas (`thinking_delta`, `text_delta`, `input_json_delta`) and `content_block_stop`, then `message_delta` with the
stop reason and usage, and `message_stop`.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field
from typing import Any

from pagegate.engine.outputs import CompletionOutput, RequestOutput
from pagegate.gateway.answer import AnswerEvent, Reasoning
from pagegate.gateway.render import ChoiceState, Renderer
from pagegate.gateway.tools import ParsedCall


@dataclass
class MessagesRenderer(Renderer):
    """One message (n = 1)."""

    stop_sequences: list[str] = field(default_factory=list)
    blocks: list[dict[str, Any]] = field(default_factory=list)
    open_kind: str | None = None  # the type of the last block while it still grows
    final: dict[str, Any] | None = None

    object_name = "message"
    named_events = True

    def message(self, output: RequestOutput | None) -> dict[str, Any]:
        completion = output.outputs[0] if output is not None else None
        return {"id": self.request_id, "type": "message", "role": "assistant", "model": self.prepared.model,
                "content": list(self.blocks), "stop_reason": self.stop_reason(completion),
                "stop_sequence": self.stop_sequence(completion), "usage": self.usage_of(output)}

    def usage_of(self, output: RequestOutput | None) -> dict[str, Any]:
        """Anthropic counts cache reads apart: input_tokens are the prompt tokens computed anew."""
        prompt = len(self.prepared.prompts[0].token_ids)
        cached = output.num_cached_tokens if output is not None else 0
        generated = len(output.outputs[0].token_ids) if output is not None else 0
        return {"input_tokens": prompt - cached, "cache_creation_input_tokens": 0,
                "cache_read_input_tokens": cached, "output_tokens": generated}

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
    def opening_chunks(self) -> list[dict]:
        return [{"type": "message_start", "message": self.message(None)}]

    def error_chunk(self, body: dict) -> dict:
        return body  # already Anthropic's shape (the route's error_body)

    def update(self, prompt_index: int, output: RequestOutput) -> list[dict]:
        self.latest[prompt_index] = output
        state = self.choices.setdefault(0, ChoiceState())
        return self.choice_deltas(0, state, prompt_index, output.outputs[0])

    def choice_deltas(self, index: int, state: ChoiceState, prompt_index: int, c: CompletionOutput) -> list[dict]:
        if state.finished:
            return []
        events: list[dict] = []
        for piece in self.answer_events(state, self.next_text(state, c), c.finished):
            events.extend(self.take(piece))
        if c.finished:
            state.finished = True
            events.extend(self.close_block())
            self.final = self.message(self.latest[prompt_index])
            events.append({"type": "message_delta", "delta": {"stop_reason": self.final["stop_reason"],
                                                              "stop_sequence": self.final["stop_sequence"]},
                           "usage": {"output_tokens": self.final["usage"]["output_tokens"]}})
            events.append({"type": "message_stop"})
        return events

    def response(self, finals: dict[int, RequestOutput]) -> dict:
        self.update(0, finals[0])
        assert self.final is not None
        return self.final

    # -- blocks ---------------------------------------------------------------------------------------
    def take(self, piece: AnswerEvent) -> list[dict]:
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
                 "input": json.loads(call.arguments) if _is_object(call.arguments) else {}}
        self.blocks.append(block)
        index = len(self.blocks) - 1
        return [{"type": "content_block_start", "index": index, "content_block": dict(block, input={})},
                {"type": "content_block_delta", "index": index,
                 "delta": {"type": "input_json_delta", "partial_json": call.arguments}},
                {"type": "content_block_stop", "index": index}]


def _is_object(text: str) -> bool:
    """A cut-off forced call's arguments are not JSON yet; its block then has no input."""
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False
