"""Where each finished request's timing goes in the gateway: the dashboard's last N requests, the request's spans
(with --otlp-traces-endpoint), and, when the client asked with `X-Pagegate-Timing: 1`, its response's usage
(render.py). Every final output passes `TimingRecorder.finished` once: a few dict reads, nothing per token."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pagegate.engine.observe.timeline import RequestTiming
from pagegate.engine.outputs import RequestOutput
from pagegate.engine.sampling.params import SamplingParams
from pagegate.gateway.tracing import TRACE_HEADERS, RequestTracer  # OpenTelemetry itself: only when tracing

TIMING_HEADER = "x-pagegate-timing"  # "1": the response's usage gains `pagegate_timing`
RECENT_REQUESTS = 20  # finished requests the dashboard lists
_YES = ("1", "true", "yes", "on")


def wants_timing(headers: Mapping[str, str]) -> bool:
    return headers.get(TIMING_HEADER, "").strip().lower() in _YES


def trace_headers(headers: Mapping[str, str]) -> dict[str, str] | None:
    """The client's W3C trace context (traceparent, tracestate), if it sent one."""
    found = {name: headers[name] for name in TRACE_HEADERS if name in headers}
    return found or None


def timing_of(output: RequestOutput, generated: int) -> RequestTiming | None:
    """A request's timing from its finishing output (a delta will do: it carries the timings) and the tokens all
    its choices generated (None while it runs, or when it produced no token)."""
    if not output.finished:
        return None
    return RequestTiming.from_metrics(output.request_id, output.metrics, len(output.prompt_token_ids), generated,
                                      output.num_cached_tokens)


@dataclass(frozen=True, slots=True)
class FinishedRequest:
    """One row of the dashboard's recent requests."""

    request_id: str
    tenant: str | None  # the identity of its API key: other keys' viewers see the row, not the id
    finished_at: float  # time.time()
    model: str
    timing: RequestTiming

    def row(self, shown: bool) -> dict[str, Any]:
        return {"request_id": self.request_id if shown else None, "finished_at": self.finished_at,
                "model": self.model, "prompt_tokens": self.timing.prompt_tokens,
                "completion_tokens": self.timing.completion_tokens, **self.timing.breakdown()}


class TimingRecorder:
    def __init__(self, tracer: RequestTracer | None = None, keep: int = RECENT_REQUESTS) -> None:
        self.tracer = tracer
        self.recent: deque[FinishedRequest] = deque(maxlen=keep)

    def finished(self, output: RequestOutput, generated: int, started: float, model: str, tenant: str | None = None,
                 attributes: Mapping[str, Any] | None = None, trace_context: Mapping[str, str] | None = None) -> None:
        """A request finished (`output`: its finishing delta, `generated`: its tokens): keep its row; trace it from
        `started` (gateway monotonic seconds)."""
        timing = timing_of(output, generated)
        if timing is None:
            return
        self.recent.append(FinishedRequest(output.request_id, tenant, time.time(), model, timing))
        if self.tracer is not None:
            self.tracer.trace(timing, started, time.monotonic(), {"gen_ai.response.model": model, **(attributes or {})},
                              trace_context)

    def rows(self, audience: str | None, every_id: bool) -> list[dict[str, Any]]:
        """The recent requests, newest first; ids of other keys' requests hidden (unless `every_id`)."""
        return [r.row(every_id or r.tenant == audience) for r in reversed(self.recent)]

    def shutdown(self) -> None:
        if self.tracer is not None:
            self.tracer.shutdown()


def sampling_attributes(params: SamplingParams) -> dict[str, Any]:
    """The sampling settings a request span carries (vLLM's gen_ai.request.* names)."""
    attributes = {"gen_ai.request.n": params.n, "gen_ai.request.temperature": params.temperature,
                  "gen_ai.request.top_p": params.top_p}
    if params.max_tokens is not None:
        attributes["gen_ai.request.max_tokens"] = params.max_tokens
    return attributes
