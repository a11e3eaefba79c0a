"""Engine outputs -> OpenAI response bodies and stream chunks (completions and chat).

Engine outputs come as deltas (each choice's new text, token ids and logprobs), which a streamed response
appends as they come; a renderer keeps per prompt only counts (usage, timing) and per choice where its answer
stands, never the whole text. A non-streamed response renders the whole outputs, joined by `collect`. The
engine holds back text that could still become a stop string (or an unfinished UTF-8 character), so streamed
text always equals the final text.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field

from pagegate.engine.observe.timeline import merged_breakdown
from pagegate.engine.outputs import CompletionOutput, Logprob, RequestOutput
from pagegate.gateway.answer import AnswerEvent, AnswerSplitter, Reasoning, split_answer
from pagegate.gateway.prepare import PreparedRequest, TokenizerLike
from pagegate.gateway.protocol import CompletionRequest
from pagegate.gateway.request_timing import timing_of
from pagegate.gateway.tool_formats import ParsedCall

TokenText = Callable[[int], str]

# vLLM's floor: a token the request masked out has logprob -inf, which JSON cannot carry.
LOGPROB_FLOOR = -9999.0


def finite_logprob(value: float) -> float:
    """A logprob as the API returns it: -inf (and a NaN, which nothing should produce) become LOGPROB_FLOOR."""
    return value if value > LOGPROB_FLOOR else LOGPROB_FLOOR  # NaN fails the comparison too


@dataclass
class PromptProgress:
    """What usage, timing and echo need of one prompt's outputs so far: counts, never the text."""

    generated: int = 0  # tokens of all its choices
    cached: int = 0  # prompt tokens served from the prefix cache
    pinned: list[int] = field(default_factory=list)  # per pin of its request, the tokens its pages hold
    prompt_logprobs: list[Logprob | None] | None = None
    last: RequestOutput | None = None  # its finishing delta (its timings), once it finished

    def take(self, output: RequestOutput) -> None:
        self.generated += output.num_generated_tokens
        self.cached = output.num_cached_tokens
        self.pinned = output.pinned_tokens or self.pinned
        if output.prompt_logprobs is not None:
            self.prompt_logprobs = output.prompt_logprobs
        if output.finished:
            self.last = output


@dataclass
class ChoiceState:
    text_offset: int = 0  # completions logprobs: offset of the next token in the returned text
    started: bool = False
    finished: bool = False
    answer: AnswerSplitter | None = None  # chat: splits the text into reasoning, content and calls


@dataclass
class Renderer(ABC):
    """Shared bookkeeping: ids, usage, per-choice progress."""

    prepared: PreparedRequest
    tokenizer: TokenizerLike | None
    request_id: str
    created: int = field(default_factory=lambda: int(time.time()))
    progress: dict[int, PromptProgress] = field(default_factory=dict)  # per prompt
    choices: dict[int, ChoiceState] = field(default_factory=dict)
    widths: dict[int, int] = field(default_factory=dict)
    timing: bool = False  # X-Pagegate-Timing: the finished usage carries `pagegate_timing`

    object_name = ""
    chunk_object = ""
    named_events = False  # SSE frames carry `event: <type>` and the stream has no [DONE] (Responses, Anthropic)

    def choice_index(self, prompt_index: int, output: CompletionOutput) -> int:
        return prompt_index * self.prepared.params.n + output.index

    def token_text(self, token_id: int) -> str:
        """A token as logprobs show it: its text, or (as OpenAI does) `bytes:\\xNN...` for a token that
        holds only part of a UTF-8 character, whose text would be U+FFFD."""
        if self.tokenizer is None:
            return f"<{token_id}>"
        raw = self.tokenizer.token_bytes(token_id)
        try:
            raw.decode()
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{byte:02x}" for byte in raw)
        return self.tokenizer.token_text(token_id)

    def token_bytes(self, token_id: int) -> list[int]:
        """The token's own bytes: joined in order, the tokens' bytes are the answer's UTF-8."""
        raw = self.tokenizer.token_bytes(token_id) if self.tokenizer is not None else self.token_text(token_id).encode()
        return list(raw)

    def text_width(self, token_id: int) -> int:
        """Characters a token adds to the returned text: special tokens are skipped when decoding."""
        width = self.widths.get(token_id)
        if width is None:
            if self.tokenizer is None:
                width = len(self.token_text(token_id))
            else:  # special tokens are skipped when decoding; a partial character's U+FFFD counts one
                special = self.tokenizer.decode([token_id]) == ""
                width = 0 if special else len(self.tokenizer.token_text(token_id))
            self.widths[token_id] = width
        return width

    def envelope(self, object_name: str, choices: list[dict]) -> dict:
        body = {"id": self.request_id, "object": object_name, "created": self.created,
                "model": self.prepared.model, "choices": choices}
        if self.prepared.include_usage:
            body["usage"] = self.usage() if self.continuous_usage else None
        return body

    @property
    def continuous_usage(self) -> bool:
        """vLLM's stream_options.continuous_usage_stats (with include_usage): every chunk carries the usage so far."""
        options = self.prepared.request.stream_options
        return bool(options and options.include_usage and options.continuous_usage_stats)

    def usage(self) -> dict:
        """The tokens so far: every prompt's (known before the first output), those generated until now."""
        prompt_tokens = sum(len(prompt.token_ids) for prompt in self.prepared.prompts)
        completion_tokens, cached = self.generated_tokens(), self.cached_tokens()
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                 "total_tokens": prompt_tokens + completion_tokens, "prompt_tokens_details": {"cached_tokens": cached}}
        if self.timing and (breakdown := self.timing_breakdown()) is not None:
            usage["pagegate_timing"] = breakdown
        return usage

    def generated_tokens(self) -> int:
        return sum(progress.generated for progress in self.progress.values())

    def cached_tokens(self) -> int:
        return sum(progress.cached for progress in self.progress.values())

    def timing_breakdown(self) -> dict | None:
        """Where the time went (request_timing.py), once every prompt has finished; None before."""
        timings = [timing_of(p.last, p.generated) if p.last is not None else None for p in self.progress.values()]
        if len(timings) < len(self.prepared.prompts) or any(t is None for t in timings):
            return None
        return merged_breakdown([t for t in timings if t is not None])

    def take(self, prompt_index: int, output: RequestOutput) -> None:
        """Count a delta of one prompt's request (a whole output counts as one delta)."""
        self.progress.setdefault(prompt_index, PromptProgress()).take(output)

    def usage_chunk(self) -> dict:
        return {"id": self.request_id, "object": self.chunk_object, "created": self.created,
                "model": self.prepared.model, "choices": [], "usage": self.usage()}

    def opening_chunks(self) -> list[dict]:
        return []

    def error_chunk(self, body: dict) -> dict:
        """The chunk that ends a stream an error cut short; `body` is the OpenAI error body."""
        return body

    @abstractmethod
    def response(self, finals: dict[int, RequestOutput]) -> dict:
        """The whole (non-streamed) response body from each prompt's final output."""

    def update(self, prompt_index: int, output: RequestOutput) -> list[dict]:
        """Chunks for one delta of one engine request (possibly none)."""
        self.take(prompt_index, output)
        deltas = []
        for completion in output.outputs:
            index = self.choice_index(prompt_index, completion)
            state = self.choices.setdefault(index, ChoiceState())
            deltas.extend(self.choice_deltas(index, state, prompt_index, completion))
        return [self.envelope(self.chunk_object, group) for group in _one_per_index(deltas)]

    @abstractmethod
    def choice_deltas(self, index: int, state: ChoiceState, prompt_index: int, c: CompletionOutput) -> list[dict]:
        """The chunk deltas one output delta of one choice adds (possibly none)."""

    def answer_events(self, state: ChoiceState, text: str, finished: bool) -> list[AnswerEvent]:
        """Fresh text as reasoning, content and completed calls; text that may still be a tag is held back."""
        if state.answer is None:
            state.answer = AnswerSplitter(self.prepared.tool_calls, self.prepared.reasoning)
        return state.answer.feed(text) + (state.answer.finish() if finished else [])

    def prompt_logprobs(self, prompt_index: int) -> list[dict | None] | None:
        """vLLM's prompt_logprobs: per prompt token (the first null), the token's and the top alternatives'
        {token id: {logprob, rank, decoded_token}}, the prompt's token first."""
        scored = self.progress[prompt_index].prompt_logprobs
        if scored is None:
            return None
        return [None if lp is None else self.ranked_entries(lp) for lp in scored]

    def ranked_entries(self, logprob: Logprob) -> dict[str, dict]:
        def entry(token_id: int, value: float, rank: int | None) -> dict:
            return {"logprob": finite_logprob(value), "rank": rank, "decoded_token": self.token_text(token_id)}
        entries = {str(logprob.token_id): entry(logprob.token_id, logprob.logprob, logprob.rank)}
        for rank, (token_id, value) in enumerate(logprob.top.items(), 1):
            entries.setdefault(str(token_id), entry(token_id, value, rank))
        return entries

    def ordered(self, finals: dict[int, RequestOutput]) -> list[tuple[int, int, CompletionOutput]]:
        """Each whole output's choices in the order of their indices (and the outputs counted)."""
        for prompt_index, output in finals.items():
            self.take(prompt_index, output)
        rows = [(self.choice_index(p, c), p, c) for p, out in finals.items() for c in out.outputs]
        return sorted(rows, key=lambda row: row[0])


@dataclass
class ItemRenderer(Renderer):
    """One answer (n = 1) as typed parts with named stream events (Responses, Anthropic Messages): each event of
    the answer goes to `take` as it comes; at the end `closing` gives the last events and sets `final`."""

    final: dict | None = None

    named_events = True

    @abstractmethod
    def take_piece(self, piece: AnswerEvent) -> list[dict]:
        """The events one piece of the answer (text, reasoning, a call) adds."""

    @abstractmethod
    def closing(self, completion: CompletionOutput) -> list[dict]:
        """The events that end the answer (`completion`: its last delta); sets `final`, the whole response body."""

    def update(self, prompt_index: int, output: RequestOutput) -> list[dict]:
        self.take(prompt_index, output)
        state = self.choices.setdefault(0, ChoiceState())
        return self.choice_deltas(0, state, prompt_index, output.outputs[0])

    def choice_deltas(self, index: int, state: ChoiceState, prompt_index: int, c: CompletionOutput) -> list[dict]:
        if state.finished:
            return []
        events = [event for piece in self.answer_events(state, c.text, c.finished) for event in self.take_piece(piece)]
        if c.finished:
            state.finished = True
            events.extend(self.closing(c))
        return events

    def response(self, finals: dict[int, RequestOutput]) -> dict:
        self.update(0, finals[0])
        assert self.final is not None
        return self.final


def _one_per_index(deltas: list[dict]) -> list[list[dict]]:
    """Group choice deltas into chunks where each choice index appears at most once, order kept."""
    groups: list[list[dict]] = []
    seen: set[int] = set()
    for delta in deltas:
        if not groups or delta["index"] in seen:
            groups.append([])
            seen = set()
        groups[-1].append(delta)
        seen.add(delta["index"])
    return groups


class CompletionRenderer(Renderer):
    object_name = "text_completion"
    chunk_object = "text_completion"

    def prompt_text(self, prompt_index: int) -> str:
        prompt = self.prepared.prompts[prompt_index]
        if prompt.text is None:
            prompt.text = self.tokenizer.decode(prompt.token_ids) if self.tokenizer is not None else ""
        return prompt.text

    def choice_deltas(self, index: int, state: ChoiceState, prompt_index: int, c: CompletionOutput) -> list[dict]:
        if state.finished:
            return []
        text, fresh = c.text, c.logprobs or []
        if self.request.echo_only:  # the engine's one token is not part of the answer
            text, fresh = "", []
        first = not state.started
        prefix, prompt_lp = self.echo_prefix(state, prompt_index)
        state.started = True
        state.finished = c.finished
        if not (prefix or text or fresh or c.finished):
            return []
        logprobs = None
        if self.prepared.params.logprobs is not None:
            logprobs = self.logprobs_block(state, prompt_lp + [(lp.token_id, lp) for lp in fresh])
        delta = {"index": index, "text": prefix + text, "logprobs": logprobs,
                 "finish_reason": "length" if c.finished and self.request.echo_only else c.finish_reason}
        if first and self.request.prompt_logprobs is not None:
            delta["prompt_logprobs"] = self.prompt_logprobs(prompt_index)
        return [delta]

    @property
    def request(self) -> CompletionRequest:
        assert isinstance(self.prepared.request, CompletionRequest)
        return self.prepared.request

    def usage(self) -> dict:
        usage = super().usage()
        if self.request.echo_only:
            usage["total_tokens"] -= usage["completion_tokens"]
            usage["completion_tokens"] = 0
        return usage

    def echo_prefix(self, state: ChoiceState, prompt_index: int) -> tuple[str, list[tuple[int, Logprob | None]]]:
        """echo: the prompt's text, and its tokens with their logprobs (the first has none, as OpenAI's)."""
        if state.started or not self.request.echo:
            return "", []
        prompt_ids = self.prepared.prompts[prompt_index].token_ids
        scored = self.progress[prompt_index].prompt_logprobs or [None] * len(prompt_ids)
        return self.prompt_text(prompt_index), list(zip(prompt_ids, scored, strict=True))

    def logprobs_block(self, state: ChoiceState, rows: list[tuple[int, Logprob | None]]) -> dict:
        """OpenAI's legacy shape; the prompt's first token (echo) has a null logprob."""
        block: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for token_id, logprob in rows:
            token = self.token_text(token_id)
            block["tokens"].append(token)
            block["token_logprobs"].append(finite_logprob(logprob.logprob) if logprob else None)
            block["top_logprobs"].append(self.top_dict(logprob) if logprob else None)
            block["text_offset"].append(state.text_offset)
            state.text_offset += self.text_width(token_id)
        return block

    def top_dict(self, logprob: Logprob) -> dict[str, float]:
        top = {self.token_text(token_id): finite_logprob(value) for token_id, value in logprob.top.items()}
        top.setdefault(self.token_text(logprob.token_id), finite_logprob(logprob.logprob))
        return top

    def response(self, finals: dict[int, RequestOutput]) -> dict:
        choices = []
        for index, prompt_index, completion in self.ordered(finals):
            state = ChoiceState()
            delta = self.choice_deltas(index, state, prompt_index, completion)
            choices.append(delta[0] if delta else {"index": index, "text": "", "logprobs": None,
                                                   "finish_reason": completion.finish_reason})
        body = self.envelope(self.object_name, choices)
        body["usage"] = self.usage()
        return body


class ChatRenderer(Renderer):
    object_name = "chat.completion"
    chunk_object = "chat.completion.chunk"

    def opening_chunks(self) -> list[dict]:
        n = self.prepared.params.n
        role = [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
                for i in range(n)]
        return [self.envelope(self.chunk_object, role)]

    def choice_deltas(self, index: int, state: ChoiceState, prompt_index: int, c: CompletionOutput) -> list[dict]:
        if state.finished:
            return []
        events = self.answer_events(state, c.text, c.finished)
        fresh = c.logprobs or []
        deltas = []
        thought = "".join(event.text for event in events if isinstance(event, Reasoning))
        if thought:
            deltas.append({"index": index, "delta": {"reasoning_content": thought}, "logprobs": None,
                           "finish_reason": None})
        text = "".join(event for event in events if isinstance(event, str))
        if text or fresh:
            logprobs = {"content": self.logprob_entries(fresh)} if self.prepared.params.logprobs is not None else None
            deltas.append({"index": index, "delta": {"content": text}, "logprobs": logprobs, "finish_reason": None})
        calls = [event for event in events if isinstance(event, ParsedCall)]
        first = len(state.answer.parsed_calls) - len(calls) if state.answer is not None else 0
        for number, call in enumerate(calls, first):
            deltas.extend({"index": index, "delta": {"tool_calls": [piece]}, "logprobs": None, "finish_reason": None}
                          for piece in call_pieces(number, call))
        if c.finished:
            state.finished = True
            called = state.answer is not None and bool(state.answer.parsed_calls)
            deltas.append({"index": index, "delta": {}, "logprobs": None,
                           "finish_reason": finish_reason(c.finish_reason, called)})
        return deltas

    def logprob_entries(self, logprobs: list[Logprob]) -> list[dict]:
        limit = self.prepared.params.logprobs or 0
        entries = []
        for lp in logprobs:
            top = list(lp.top.items())[:limit]
            entry = self.token_entry(lp.token_id, lp.logprob)
            entry["top_logprobs"] = [self.token_entry(token_id, value) for token_id, value in top]
            entries.append(entry)
        return entries

    def token_entry(self, token_id: int, logprob: float) -> dict:
        token = self.token_text(token_id)
        return {"token": token, "logprob": finite_logprob(logprob), "bytes": self.token_bytes(token_id)}

    def response(self, finals: dict[int, RequestOutput]) -> dict:
        choices = []
        for index, _, completion in self.ordered(finals):
            logprobs = None
            if self.prepared.params.logprobs is not None:
                logprobs = {"content": self.logprob_entries(completion.logprobs or [])}
            message = self.message(completion)
            choices.append({"index": index, "message": message, "logprobs": logprobs,
                            "finish_reason": finish_reason(completion.finish_reason, bool(message["tool_calls"]))})
        body = self.envelope(self.object_name, choices)
        body["usage"] = self.usage()
        if self.prepared.params.prompt_logprobs is not None:
            body["prompt_logprobs"] = self.prompt_logprobs(0)
        return body

    def message(self, completion: CompletionOutput) -> dict:
        answer = split_answer(completion.text, self.prepared.tool_calls, self.prepared.reasoning)
        return {"role": "assistant", "content": answer.content,
                "tool_calls": [call.as_tool_call() for call in answer.calls], "reasoning_content": answer.reasoning}


def finish_reason(engine_reason: str | None, called: bool) -> str | None:
    """OpenAI's "tool_calls" when an answer that ended by itself made calls (one cut short keeps "length")."""
    return "tool_calls" if called and engine_reason == "stop" else engine_reason


def call_pieces(number: int, call: ParsedCall) -> list[dict]:
    """A call as OpenAI streams it: id, type and name with empty arguments first, then the arguments."""
    return [{"index": number, "id": call.id, "type": "function", "function": {"name": call.name, "arguments": ""}},
            {"index": number, "function": {"arguments": call.arguments}}]
