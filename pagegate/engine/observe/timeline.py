"""A request's timeline: what the scheduler did to it besides producing tokens, and the breakdown read from it.

The core records it as things happen (a few attribute writes per preemption, resume or finish: nothing per
token) and sends it with the request's final delta, inside `timings` (serving.frames.DeltaWriter). The gateway turns
`RequestOutput.metrics` back into a `RequestTiming`: the queue / prefill / decode split, the preemptions, the
pages. Every time is `time.monotonic()` of the core process; on Linux that clock is system-wide, so the gateway,
another process on the same machine, converts it to epoch time with one offset of its own.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SWAP, RECOMPUTE = "swap", "recompute"  # how a preempted sequence gave its pages back


@dataclass(slots=True)
class Preemption:
    kind: str  # SWAP or RECOMPUTE
    at: float
    pages: int  # device pages the sequence held when it was preempted
    index: int = 0  # the choice (sequence) preempted
    resumed_at: float | None = None  # swapped back in, or readmitted to be recomputed

    def to_wire(self) -> list[Any]:
        return [self.kind, self.at, self.pages, self.index, self.resumed_at]


@dataclass(slots=True)
class Timeline:
    """The scheduler's side of one request (its token times live on the Request itself)."""

    prefix_hit_pages: int = 0  # pages the prompt found in the prefix cache when first admitted
    pages_held: int = 0  # the most device pages one of its sequences held
    preemptions: list[Preemption] = field(default_factory=list)

    def held(self, pages: int) -> None:
        if pages > self.pages_held:
            self.pages_held = pages

    def preempted(self, kind: str, now: float, pages: int, index: int) -> None:
        self.held(pages)
        self.preemptions.append(Preemption(kind, now, pages, index))

    def resumed(self, index: int, now: float) -> None:
        """Choice `index` runs again: its open preemption ends (nothing happens when it has none)."""
        for preemption in self.preemptions:
            if preemption.index == index and preemption.resumed_at is None:
                preemption.resumed_at = now
                return

    def to_wire(self, timings: dict[str, Any]) -> dict[str, Any]:
        """Into a request's `timings` dict (msgpack-friendly: numbers and lists)."""
        timings["prefix_hit_pages"] = self.prefix_hit_pages
        timings["pages_held"] = self.pages_held
        if self.preemptions:
            timings["preemptions"] = [p.to_wire() for p in self.preemptions]
        return timings


@dataclass(frozen=True, slots=True)
class RequestTiming:
    """Why one finished request took as long as it did: the gateway's reading of its timings.

    queue: arrival in the core to first scheduled; prefill: first scheduled to first token; decode: first token to
    the last. A preemption's time (until it resumed) lies inside prefill or decode and is also given on its own."""

    request_id: str
    arrival: float  # core monotonic seconds
    first_scheduled: float
    first_token: float
    finished: float
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    prefix_hit_pages: int
    pages_held: int
    preemptions: tuple[Preemption, ...] = ()

    @classmethod
    def from_metrics(cls, request_id: str, metrics: dict[str, Any], prompt_tokens: int, completion_tokens: int,
                     cached_tokens: int = 0) -> RequestTiming | None:
        """None when the timings lack the token times (a request that never produced a token)."""
        try:
            arrival = metrics["arrival_time"]
            first_token, finished = metrics["first_token_time"], metrics["last_token_time"]
        except KeyError:
            return None
        first_scheduled = metrics.get("first_scheduled_time", arrival)
        preemptions = tuple(Preemption(*wire) for wire in metrics.get("preemptions", ()))
        return cls(request_id, arrival, first_scheduled, first_token, finished, prompt_tokens, completion_tokens,
                   cached_tokens, metrics.get("prefix_hit_pages", 0), metrics.get("pages_held", 0), preemptions)

    @property
    def queue_s(self) -> float:
        return self.first_scheduled - self.arrival

    @property
    def prefill_s(self) -> float:
        return self.first_token - self.first_scheduled

    @property
    def decode_s(self) -> float:
        return self.finished - self.first_token

    @property
    def time_to_first_token_s(self) -> float:
        return self.first_token - self.arrival

    @property
    def e2e_s(self) -> float:
        return self.finished - self.arrival

    @property
    def num_swaps(self) -> int:
        return sum(1 for p in self.preemptions if p.kind == SWAP)

    @property
    def preempted_s(self) -> float:
        """Time its sequences sat preempted (one never resumed counts until the request finished)."""
        return sum((p.resumed_at if p.resumed_at is not None else self.finished) - p.at for p in self.preemptions)

    def breakdown(self) -> dict[str, Any]:
        """The opt-in `usage.pagegate_timing` object and a dashboard row: milliseconds and counts."""
        return {"queue_ms": _ms(self.queue_s), "prefill_ms": _ms(self.prefill_s), "decode_ms": _ms(self.decode_s),
                "time_to_first_token_ms": _ms(self.time_to_first_token_s), "e2e_ms": _ms(self.e2e_s),
                "preempted_ms": _ms(self.preempted_s), "preemptions": len(self.preemptions),
                "swaps": self.num_swaps, "prefix_hit_pages": self.prefix_hit_pages, "pages_held": self.pages_held}


def merged_breakdown(timings: list[RequestTiming]) -> dict[str, Any]:
    """One breakdown for a request of several prompts: the longest of each duration, the sum of each count."""
    rows = [t.breakdown() for t in timings]
    return {key: (max if key.endswith("_ms") else sum)(row[key] for row in rows) for key in rows[0]}


def _ms(seconds: float) -> float:
    return round(seconds * 1000.0, 3)
