"""What the engine hands back (shapes follow vLLM's offline API)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Logprob:
    """One position's log-probability: the sampled token and the top alternatives."""

    token_id: int
    logprob: float
    top: dict[int, float] = field(default_factory=dict)  # token id -> logprob, best first
    rank: int | None = None  # the token's place in the model's distribution (1: the most likely); prompt tokens


@dataclass
class CompletionOutput:
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
    """Cumulative: each update carries the whole text and token ids so far, for every choice."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    metrics: dict[str, Any] = field(default_factory=dict)  # Request.timings(): core monotonic times, timeline
    error: str | None = None  # set when the request failed; the outputs are then incomplete
    prompt_logprobs: list[Logprob | None] | None = None  # params.prompt_logprobs: one per prompt token, the first None


@dataclass
class EmbeddingOutput:
    embedding: list[float]  # unit length


@dataclass
class EmbeddingRequestOutput:
    """LLM.embed's answer for one prompt (vLLM's shape)."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
