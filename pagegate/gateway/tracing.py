"""OpenTelemetry spans of finished requests (`--otlp-traces-endpoint`): one `llm_request` span per engine request,
with children `queue`, `prefill`, `decode` and one `preempted` per preemption, built from the request's timeline
when its final output reaches the gateway, and exported by a BatchSpanProcessor (its own thread) over OTLP/HTTP.

The OpenTelemetry SDK is an optional dependency (`pip install pagegate[otel]`), imported only here and only when
tracing is on: a server without the flag never loads it. Attribute names follow vLLM's (`gen_ai.*`) where one
exists, `pagegate.*` for the rest.

NOTE: spans are built after the fact with explicit times rather than opened as the request goes: the engine core
(another process) knows the times, and a span per step or per token would cost the hot path for a trace that
reads the same. Core times are `time.monotonic()`, system-wide on Linux: one offset here turns them into epoch ns.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit, urlunsplit

from pagegate.engine.observe.timeline import RequestTiming

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SpanExporter
    from opentelemetry.trace import Span

logger = logging.getLogger("pagegate.gateway")

SERVICE_NAME = "pagegate"
REQUEST_SPAN = "llm_request"
TRACE_HEADERS = ("traceparent", "tracestate")  # W3C trace context: the client's span becomes the parent


def traces_url(endpoint: str) -> str:
    """The OTLP/HTTP traces URL: `http://host:4318` gets OTLP's default path `/v1/traces`; a path is kept."""
    parts = urlsplit(endpoint if "://" in endpoint else f"http://{endpoint}")
    path = parts.path if parts.path not in ("", "/") else "/v1/traces"
    return urlunsplit((parts.scheme, parts.netloc, path, parts.query, ""))


def tracer_provider(endpoint: str | None = None, exporter: SpanExporter | None = None) -> TracerProvider:
    """A provider that batches spans to `exporter`, by default the OTLP/HTTP exporter posting to `endpoint` (tests
    give an InMemorySpanExporter). Not installed as the global provider: one per server."""
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    if exporter is None:
        if endpoint is None:
            raise ValueError("tracer_provider needs an endpoint or an exporter")
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        exporter = OTLPSpanExporter(endpoint=traces_url(endpoint))
    provider = TracerProvider(resource=Resource.create({"service.name": SERVICE_NAME}))
    provider.add_span_processor(BatchSpanProcessor(exporter))
    return provider


class RequestTracer:
    """Turns each finished request's timing into its spans."""

    def __init__(self, provider: TracerProvider) -> None:
        from opentelemetry.trace import SpanKind, set_span_in_context
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.provider = provider
        self.tracer = provider.get_tracer("pagegate.gateway")
        self._server_kind, self._in_span = SpanKind.SERVER, set_span_in_context
        self._propagator = TraceContextTextMapPropagator()
        self.offset_ns = time.time_ns() - time.monotonic_ns()  # monotonic -> epoch, once for the process

    def epoch_ns(self, monotonic_s: float) -> int:
        return int(monotonic_s * 1e9) + self.offset_ns

    def trace(self, timing: RequestTiming, started: float, ended: float, attributes: Mapping[str, Any],
              trace_headers: Mapping[str, str] | None = None) -> None:
        """The request span from `started` (the gateway took the request) to `ended` (its final output came
        back; both gateway monotonic seconds), and its phases from the core's timeline."""
        parent = self._propagator.extract(dict(trace_headers)) if trace_headers else None
        start_ns = self.epoch_ns(min(started, timing.arrival))
        span = self.tracer.start_span(REQUEST_SPAN, context=parent, kind=self._server_kind, start_time=start_ns,
                                      attributes={**request_attributes(timing), **attributes})
        self._child(span, "queue", timing.arrival, timing.first_scheduled)
        self._child(span, "prefill", timing.first_scheduled, timing.first_token,
                    {"gen_ai.usage.prompt_tokens": timing.prompt_tokens, "pagegate.cached_tokens": timing.cached_tokens,
                     "pagegate.prefix_hit_pages": timing.prefix_hit_pages})
        self._child(span, "decode", timing.first_token, timing.finished,
                    {"gen_ai.usage.completion_tokens": timing.completion_tokens})
        for p in timing.preemptions:
            end = p.resumed_at if p.resumed_at is not None else timing.finished
            self._child(span, "preempted", p.at, end, {"pagegate.preemption.kind": p.kind,
                                                       "pagegate.preemption.pages": p.pages,
                                                       "pagegate.preemption.choice": p.index,
                                                       "pagegate.preemption.resumed": p.resumed_at is not None})
        span.end(end_time=self.epoch_ns(max(ended, timing.finished)))

    def _child(self, parent: Span, name: str, start: float, end: float,
               attributes: Mapping[str, Any] | None = None) -> None:
        child = self.tracer.start_span(name, context=self._in_span(parent), start_time=self.epoch_ns(start),
                                       attributes=attributes)
        child.end(end_time=self.epoch_ns(max(start, end)))

    def shutdown(self) -> None:
        """Export what is queued, then stop the exporter's thread."""
        try:
            self.provider.shutdown()
        except Exception as error:  # a collector that is gone must not fail the server's stop
            logger.warning("tracing: the last spans could not be exported: %s", error)


def request_attributes(timing: RequestTiming) -> dict[str, Any]:
    """The request span's attributes from its timing (seconds, like vLLM's)."""
    return {
        "gen_ai.request.id": timing.request_id,
        "gen_ai.usage.prompt_tokens": timing.prompt_tokens,
        "gen_ai.usage.completion_tokens": timing.completion_tokens,
        "gen_ai.latency.time_in_queue": timing.queue_s,
        "gen_ai.latency.time_to_first_token": timing.time_to_first_token_s,
        "gen_ai.latency.e2e": timing.e2e_s,
        "gen_ai.latency.time_in_model_prefill": timing.prefill_s,
        "gen_ai.latency.time_in_model_decode": timing.decode_s,
        "pagegate.cached_tokens": timing.cached_tokens,
        "pagegate.prefix_hit_pages": timing.prefix_hit_pages,
        "pagegate.pages_held": timing.pages_held,
        "pagegate.preemptions": len(timing.preemptions),
        "pagegate.swaps": timing.num_swaps,
        "pagegate.time_preempted": timing.preempted_s,
    }


def start_tracing(endpoint: str) -> RequestTracer:
    """The server's tracer (--otlp-traces-endpoint); ImportError says how to install the SDK."""
    try:
        provider = tracer_provider(endpoint)
    except ImportError as error:
        raise ImportError(f"--otlp-traces-endpoint needs the OpenTelemetry SDK and OTLP exporter: "
                          f"pip install 'pagegate[otel]' ({error})") from error
    logger.info("tracing: request spans go to %s (OTLP/HTTP)", traces_url(endpoint))
    return RequestTracer(provider)
