"""What a model wrote, split into its parts as it streams: reasoning, the answer's text, tool calls.

Every API (chat completions, Responses, Anthropic Messages) reads an answer through `AnswerSplitter`, so
`<think>` blocks and tool-call markup are parsed once, the same way, streamed or not. Any chunking of the
text gives the same events: text that may still become a tag is held back until it is certain.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagegate.gateway.tool_formats import CallReader, ParsedCall
from pagegate.gateway.tools import CallParsing

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
# deepseek_r1: the template opens the <think> block, so the answer starts inside it (a leading tag is dropped);
# qwen3: reasoning only when the answer opens with <think> (enable_thinking false leaves it out).
REASONING_PARSERS = ("deepseek_r1", "qwen3")


@dataclass(frozen=True)
class Reasoning:
    """A piece of the model's reasoning (the inside of its <think> block)."""

    text: str


AnswerEvent = str | Reasoning | ParsedCall  # str: a piece of the answer's content


@dataclass
class ReasoningSplitter:
    """Splits text into reasoning and content at the <think> tags of `parser` (one of REASONING_PARSERS)."""

    parser: str
    _tail: str = ""
    _state: str = "start"  # start (nothing certain yet), reasoning, content
    _after_close: bool = False  # the whitespace between </think> and the answer is dropped, however it is chunked

    def feed(self, text: str) -> list[str | Reasoning]:
        text, self._tail = self._tail + text, ""
        events: list[str | Reasoning] = []
        if self._state == "start":
            stripped = text.lstrip()
            if THINK_OPEN.startswith(stripped) and len(stripped) < len(THINK_OPEN):
                self._tail = text  # may still open the block
                return []
            if stripped.startswith(THINK_OPEN):
                self._state, text = "reasoning", stripped[len(THINK_OPEN):]
            else:
                self._state = "reasoning" if self.parser == "deepseek_r1" else "content"
        if self._state == "reasoning":
            end = text.find(THINK_CLOSE)
            if end < 0:
                keep = _partial_tag(text, THINK_CLOSE)
                _add(events, Reasoning(text[:len(text) - keep]))
                self._tail = text[len(text) - keep:]
                return events
            _add(events, Reasoning(text[:end]))
            self._state, self._after_close, text = "content", True, text[end + len(THINK_CLOSE):]
        if self._after_close:
            text = text.lstrip()
            self._after_close = not text
        _add(events, text)
        return events

    def finish(self) -> list[str | Reasoning]:
        rest, self._tail = self._tail, ""
        if not rest:
            return []
        return [Reasoning(rest)] if self._state == "reasoning" else [rest]


def _partial_tag(text: str, tag: str) -> int:
    """Characters at the end of `text` that may be the start of `tag`."""
    return next((n for n in range(min(len(tag) - 1, len(text)), 0, -1) if tag.startswith(text[-n:])), 0)


def _add(events: list, event: str | Reasoning) -> None:
    if (event.text if isinstance(event, Reasoning) else event):
        events.append(event)


@dataclass
class AnswerSplitter:
    """Reasoning first (with a reasoning parser), then the content's tool calls (with tools offered)."""

    calls: CallParsing | None = None
    reasoning: str | None = None
    _reasoning: ReasoningSplitter | None = field(init=False, default=None)
    _calls: CallReader | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        self._reasoning = ReasoningSplitter(self.reasoning) if self.reasoning else None
        self._calls = self.calls.parser() if self.calls is not None else None

    @property
    def parsed_calls(self) -> list[ParsedCall]:
        return self._calls.calls if self._calls is not None else []

    def feed(self, text: str) -> list[AnswerEvent]:
        pieces: list[str | Reasoning] = [text] if self._reasoning is None else self._reasoning.feed(text)
        return self._split_calls(pieces, finished=False)

    def finish(self) -> list[AnswerEvent]:
        pieces = self._reasoning.finish() if self._reasoning is not None else []
        return self._split_calls(pieces, finished=True)

    def _split_calls(self, pieces: list[str | Reasoning], finished: bool) -> list[AnswerEvent]:
        if self._calls is None:
            return [piece for piece in pieces if piece]
        events: list[AnswerEvent] = []
        for piece in pieces:
            events.extend([piece] if isinstance(piece, Reasoning) else self._calls.feed(piece))
        if finished:
            events.extend(self._calls.finish())
        return events


@dataclass(frozen=True)
class Answer:
    reasoning: str | None
    content: str | None  # None when calls were all there was
    calls: list[ParsedCall]


def split_answer(text: str, calls: CallParsing | None, reasoning: str | None) -> Answer:
    """A whole output as its reasoning, content and calls."""
    splitter = AnswerSplitter(calls, reasoning)
    events = splitter.feed(text) + splitter.finish()
    thought = "".join(event.text for event in events if isinstance(event, Reasoning))
    content = "".join(event for event in events if isinstance(event, str))
    return Answer(thought or None, (content or None) if splitter.parsed_calls else content, splitter.parsed_calls)
