"""Requests and their sequences as the engine tracks them."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pagegate.core import NO_PAGES
from pagegate.engine.loading.tokenizer import IncrementalDetokenizer, StopChecker
from pagegate.engine.media.prompt_images import ImageInput
from pagegate.engine.observe.timeline import Timeline
from pagegate.engine.outputs import CompletionOutput, Logprob, RequestOutput
from pagegate.engine.pin import Pin
from pagegate.engine.sampling.draws import Draws
from pagegate.engine.sampling.params import SamplingParams
from pagegate.engine.sampling.sampler import LogitBias
from pagegate.engine.tenants import LANE_RANK, ONLINE, KeyShare, Lane

if TYPE_CHECKING:
    import numpy as np
    import torch
    from llguidance import LLMatcher


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """One completion: prompt + output tokens, and how many of them have KV in the cache."""

    request: Request
    index: int
    token_ids: list[int]
    num_prompt_tokens: int
    generator: Draws | None = None
    handle: int = NO_PAGES  # BlockTables handle while the sequence holds pages
    num_computed: int = 0  # tokens whose KV is (or is being) written
    status: SeqStatus = SeqStatus.WAITING
    detokenizer: IncrementalDetokenizer | None = None
    stop_checker: StopChecker | None = None
    text: str = ""
    logprobs: list[Logprob] | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    recompute_only: bool = False  # set by the adaptive swap threshold after bounces
    last_swap_in: float = -1.0
    matcher: LLMatcher | None = None  # structured outputs: the grammar state after the tokens so far
    grammar_waits: bool = False  # the model is still reasoning: the grammar starts after grammar_after_token
    draft: list[int] = field(default_factory=list)  # tokens guessed for this step (pagegate/engine/speculation.py)
    draft_kept: int = 0  # of them, those the model agreed with so far
    pool_sum: np.ndarray | None = None  # mean pooling of an embedding request: its hidden states so far
    served_step: int = 0  # the last step that held its tokens, as the key slices count (key_slices.py)

    @property
    def pools(self) -> bool:
        """An embedding request's prompt: pooled when computed, never sampled (pagegate/engine/pooling.py)."""
        return self.request.embed

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    def keys(self, start: int, end: int) -> list[int]:
        """Its tokens [start, end) as the prefix cache knows them: an image's tokens are words of its content hash
        (media/prompt_images.py)."""
        keys = self.request.prefix_keys
        if keys is None or start >= len(keys):
            return self.token_ids[start:end]
        return keys[start:end] + self.token_ids[len(keys):end] if end > len(keys) else keys[start:end]

    @property
    def num_uncomputed(self) -> int:
        return len(self.token_ids) - self.num_computed

    @property
    def decodes(self) -> bool:
        """A generation's one-token step without guesses (an embedding's last prompt token is no decode)."""
        return self.num_uncomputed == 1 and not self.draft and not self.pools

    @property
    def sort_key(self) -> tuple:
        """Scheduling order: the online lane before the batch lane, then most urgent first, then earliest arrival
        (then choice index). Preemption takes the tail, so batch work goes first."""
        request = self.request
        return (LANE_RANK[request.lane], request.effective_priority, request.arrival_time, request.order, self.index)

    @property
    def finished(self) -> bool:
        return self.status is SeqStatus.FINISHED


@dataclass(eq=False)
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int = 0
    cache_salt: str | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    order: int = 0  # admission counter: ties on arrival time keep submission order
    effective_priority: float = 0.0  # priority less the urgency gained while waiting (aging)
    root_hash: int = 0  # prefix-cache chain root: core/chain_root.py of model, adapter, salt and tenant
    lora_name: str | None = None  # the LoRA adapter it runs with (pagegate/engine/lora/); None: the base model
    seqs: list[Sequence] = field(default_factory=list)
    forked: bool = False  # n > 1: the prompt's sequence has been forked into n choices
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    num_cached_tokens: int = 0
    error: str | None = None
    matcher: LLMatcher | None = None  # structured outputs: the compiled grammar at its start
    logit_bias: LogitBias | None = None  # params.logit_bias as tensors, built once
    pins: tuple[Pin, ...] = ()  # pages to hold for later requests (a conversation's next turn, a cached prefix)
    pinned_tokens: list[int] = field(default_factory=list)  # per pin, the tokens its pages hold (0: none yet)
    prompt_logprobs: list[Logprob | None] | None = None  # params.prompt_logprobs: scored so far (the first None)
    timeline: Timeline = field(default_factory=Timeline)  # preemptions, prefix hits, pages held
    embed: bool = False  # an embedding request: its prompt is pooled, nothing is generated
    embedding: np.ndarray | torch.Tensor | None = None  # its answer, float32 [hidden] on the CPU, once the prompt is computed
    lane: Lane = ONLINE  # BATCH: runs only in the pages and step budget online requests leave (tenants.py)
    key: KeyShare | None = None  # the API key it runs for: its weight and quota of pages (None: no key)
    images: tuple[ImageInput, ...] = ()  # the prompt's images, in prompt order
    prefix_keys: list[int] | None = None  # the prompt as the prefix cache knows it, where it holds images

    def __post_init__(self) -> None:
        self.effective_priority = float(self.priority)
        self.pinned_tokens = [0] * len(self.pins)
        if self.params.prompt_logprobs is not None:
            self.prompt_logprobs = [None]

    @property
    def scoring_prompt(self) -> bool:
        """Prompt logprobs are asked for and not all computed yet."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < len(self.prompt_token_ids)

    @property
    def scored_prompt(self) -> list[Logprob | None] | None:
        """The prompt's logprobs once all are in."""
        return None if self.scoring_prompt else self.prompt_logprobs

    @property
    def finished(self) -> bool:
        return self.error is not None or (self.forked or self.params.n == 1) and all(
            s.finished for s in self.seqs)

    def output(self) -> RequestOutput:
        """The cumulative output of every choice so far."""
        choices = [CompletionOutput(s.index, s.text, s.output_token_ids, s.finish_reason,
                                    list(s.logprobs) if s.logprobs is not None else None, s.stop_reason)
                   for s in self.seqs if self.forked or self.params.n == 1]
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, choices, self.finished,
                             self.num_cached_tokens, self.timings(), self.error, self.scored_prompt,
                             list(self.pinned_tokens))

    def timings(self) -> dict[str, Any]:
        """Core monotonic times of its milestones, and its timeline (observe/timeline.py)."""
        out: dict[str, Any] = {"arrival_time": self.arrival_time}
        for name in ("first_scheduled_time", "first_token_time", "last_token_time"):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        return self.timeline.to_wire(out)
