"""Engine outputs -> Responses API objects and stream events.

An answer's events (reasoning, text, calls: pagegate.gateway.answer) become output items in the order they
come: a `reasoning` item, a `message` item with one `output_text` part, one `function_call` item per call.
Streamed, each item opens with `response.output_item.added`, grows by deltas and closes with
`response.output_item.done`; the stream starts with `response.created` and ends with `response.completed`.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from typing import Any

from pagegate.engine.outputs import CompletionOutput
from pagegate.gateway.answer import AnswerEvent, Reasoning
from pagegate.gateway.render import ItemRenderer
from pagegate.gateway.tool_formats import ParsedCall


def item_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


@dataclass
class OpenItem:
    """The output item being written: its index, body, and the text its deltas added."""

    index: int
    body: dict[str, Any]
    text: str = ""


@dataclass
class ResponsesRenderer(ItemRenderer):
    """One response (n = 1). `base` is the response object's request-side fields (tools, instructions...)."""

    base: dict[str, Any] = field(default_factory=dict)
    items: list[dict[str, Any]] = field(default_factory=list)
    open_item: OpenItem | None = None
    sequence: int = 0

    object_name = "response"

    def response_object(self, status: str, finished: bool = False) -> dict[str, Any]:
        body = {"id": self.request_id, "object": "response", "created_at": self.created, "status": status,
                "model": self.prepared.model, "output": list(self.items), "error": None,
                "incomplete_details": None, **self.base}
        if finished:
            body["usage"] = self.usage_of()
            if status == "incomplete":
                body["incomplete_details"] = {"reason": "max_output_tokens"}
        return body

    def usage_of(self) -> dict[str, Any]:
        prompt, generated = len(self.prepared.prompts[0].token_ids), self.generated_tokens()
        return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": self.cached_tokens()},
                "output_tokens": generated, "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": prompt + generated}

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        self.sequence += 1
        return {"type": kind, "sequence_number": self.sequence - 1, **fields}

    def opening_chunks(self) -> list[dict]:
        created = self.response_object("in_progress")
        return [self.event("response.created", response=created),
                self.event("response.in_progress", response=created)]

    def error_chunk(self, body: dict) -> dict:
        error = body.get("error", {})
        return self.event("error", code=error.get("code"), message=error.get("message", ""),
                          param=error.get("param"))

    def closing(self, completion: CompletionOutput) -> list[dict]:
        events = self.close_item()
        self.final = self.response_object("incomplete" if completion.finish_reason == "length" else "completed",
                                          finished=True)
        # NOTE: one cut short by max_output_tokens ends with response.completed too (its status says
        # incomplete), as vLLM does: the SDK's stream helper only finishes on response.completed.
        return [*events, self.event("response.completed", response=self.final)]

    # -- items ----------------------------------------------------------------------------------------
    def take_piece(self, piece: AnswerEvent) -> list[dict]:
        if isinstance(piece, ParsedCall):
            return [*self.close_item(), *self.call_item(piece)]
        kind = "reasoning" if isinstance(piece, Reasoning) else "message"
        text = piece.text if isinstance(piece, Reasoning) else piece
        events = [] if self.open_item is not None and self.open_item.body["type"] == kind else [
            *self.close_item(), *self.open(kind)]
        assert self.open_item is not None
        self.open_item.text += text
        where = {"item_id": self.open_item.body["id"], "output_index": self.open_item.index, "content_index": 0}
        if kind == "message":
            return [*events, self.event("response.output_text.delta", **where, delta=text, logprobs=[])]
        return [*events, self.event("response.reasoning_text.delta", **where, delta=text)]

    def open(self, kind: str) -> list[dict]:
        index = len(self.items)
        if kind == "message":
            body = {"type": "message", "id": item_id("msg"), "role": "assistant", "status": "in_progress",
                    "content": []}
        else:
            body = {"type": "reasoning", "id": item_id("rs"), "summary": [], "content": []}
        self.open_item = OpenItem(index, body)
        self.items.append(body)
        added = self.event("response.output_item.added", output_index=index, item=dict(body, content=[]))
        if kind != "message":
            return [added]
        where = {"item_id": body["id"], "output_index": index, "content_index": 0}
        return [added, self.event("response.content_part.added", **where, part=_part(kind, ""))]

    def close_item(self) -> list[dict]:
        item, self.open_item = self.open_item, None
        if item is None:
            return []
        body, where = item.body, {"item_id": item.body["id"], "output_index": item.index, "content_index": 0}
        part = _part(body["type"], item.text)
        body["content"] = [part]
        if body["type"] == "message":
            body["status"] = "completed"
            events = [self.event("response.output_text.done", **where, text=item.text, logprobs=[]),
                      self.event("response.content_part.done", **where, part=part)]
        else:
            events = [self.event("response.reasoning_text.done", **where, text=item.text)]
        return [*events, self.event("response.output_item.done", output_index=item.index, item=body)]

    def call_item(self, call: ParsedCall) -> list[dict]:
        index = len(self.items)
        body = {"type": "function_call", "id": item_id("fc"), "call_id": call.id, "name": call.name,
                "arguments": call.arguments, "status": "completed"}
        self.items.append(body)
        where = {"item_id": body["id"], "output_index": index}
        return [self.event("response.output_item.added", output_index=index,
                           item=dict(body, arguments="", status="in_progress")),
                self.event("response.function_call_arguments.delta", **where, delta=call.arguments),
                self.event("response.function_call_arguments.done", **where, arguments=call.arguments),
                self.event("response.output_item.done", output_index=index, item=body)]


def _part(kind: str, text: str) -> dict[str, Any]:
    if kind == "message":
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    return {"type": "reasoning_text", "text": text}
