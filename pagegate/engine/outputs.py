"""What the engine hands back (shapes follow vLLM's offline API)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgspec


class Logprob(msgspec.Struct, array_like=True):
    """One position's log-probability: the sampled token and the top alternatives."""

    token_id: int
    logprob: float
    top: dict[int, float] = msgspec.field(default_factory=dict)  # token id -> logprob, best first
    rank: int | None = None  # the token's place in the model's distribution (1: the most likely); prompt tokens


class CompletionOutput(msgspec.Struct, array_like=True):
    """One choice: all of it so far in a cumulative output, what it gained in a delta (the engine-core process's
    frames carry it as it is: positional on the wire)."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # None while running, then "stop" or "length"
    logprobs: list[Logprob] | None = None
    stop_reason: str | int | None = None  # the stop string or token id that ended it

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """Cumulative from the offline engine (each update carries the whole text and token ids so far, for every
    choice); a delta from an engine client (only what each choice gained since the last), which `add` appends to
    where a whole answer is needed."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    metrics: dict[str, Any] = field(default_factory=dict)  # Request.timings(): core monotonic times, timeline
    error: str | None = None  # set when the request failed; the outputs are then incomplete
    prompt_logprobs: list[Logprob | None] | None = None  # params.prompt_logprobs: one per prompt token, the first None
    pinned_tokens: list[int] = field(default_factory=list)  # per pin of the request, the tokens its pages hold

    def add(self, delta: RequestOutput) -> None:
        """Append a later delta of the same request (its choices' new tokens, text and logprobs; its state)."""
        choices = {choice.index: choice for choice in self.outputs}
        for new in delta.outputs:
            choice = choices.get(new.index)
            if choice is None:
                self.outputs.append(new)
                continue
            choice.token_ids.extend(new.token_ids)
            choice.text += new.text
            if new.logprobs is not None and choice.logprobs is not None:
                choice.logprobs.extend(new.logprobs)
            choice.finish_reason, choice.stop_reason = new.finish_reason, new.stop_reason
        if len(self.outputs) > 1:
            self.outputs.sort(key=lambda choice: choice.index)
        self.finished, self.num_cached_tokens, self.error = delta.finished, delta.num_cached_tokens, delta.error
        self.metrics = delta.metrics or self.metrics
        self.prompt_logprobs = delta.prompt_logprobs if delta.prompt_logprobs is not None else self.prompt_logprobs
        self.pinned_tokens = delta.pinned_tokens or self.pinned_tokens

    @property
    def num_generated_tokens(self) -> int:
        return sum(len(choice.token_ids) for choice in self.outputs)


@dataclass
class EmbeddingOutput:
    embedding: list[float]  # unit length


@dataclass
class EmbeddingRequestOutput:
    """LLM.embed's answer for one prompt (vLLM's shape)."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
