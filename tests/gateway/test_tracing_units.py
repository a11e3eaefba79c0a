"""Request spans from a timing (an in-memory exporter), the collector URL, the recent-requests rows, and tracing
off by default: a server without --otlp-traces-endpoint never imports OpenTelemetry."""

from __future__ import annotations

import subprocess
import sys

from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from pagegate.engine.observe.timeline import RECOMPUTE, SWAP, Preemption, RequestTiming
from pagegate.engine.outputs import CompletionOutput, RequestOutput
from pagegate.gateway.request_timing import TimingRecorder, trace_headers, wants_timing
from pagegate.gateway.tracing import RequestTracer, tracer_provider, traces_url

TRACE_ID, PARENT_ID = "0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331"
TIMING = RequestTiming("cmpl-x-0-abc", 10.0, 10.5, 11.0, 13.0, 20, 8, 16, 1, 3,
                       (Preemption(SWAP, 11.5, 3, 0, 12.0), Preemption(RECOMPUTE, 12.2, 3, 0, None)))


def spans_of(tracer: RequestTracer, exporter: InMemorySpanExporter) -> dict:
    tracer.provider.force_flush()
    spans = exporter.get_finished_spans()
    return {name: [s for s in spans if s.name == name] for name in {s.name for s in spans}}


def test_a_request_span_has_its_phases_and_preemptions_as_children() -> None:
    exporter = InMemorySpanExporter()
    tracer = RequestTracer(tracer_provider(exporter=exporter))
    tracer.trace(TIMING, 9.9, 13.1, {"gen_ai.response.model": "m"}, {"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"})
    spans = spans_of(tracer, exporter)
    assert sorted(spans) == ["decode", "llm_request", "preempted", "prefill", "queue"]
    (request,) = spans["llm_request"]
    assert format(request.context.trace_id, "032x") == TRACE_ID  # the client's trace
    assert request.parent is not None and format(request.parent.span_id, "016x") == PARENT_ID
    attributes = request.attributes
    assert attributes["gen_ai.request.id"] == "cmpl-x-0-abc" and attributes["gen_ai.response.model"] == "m"
    assert attributes["gen_ai.usage.prompt_tokens"] == 20 and attributes["gen_ai.usage.completion_tokens"] == 8
    assert attributes["gen_ai.latency.time_in_queue"] == 0.5 and attributes["gen_ai.latency.e2e"] == 3.0
    assert attributes["pagegate.preemptions"] == 2 and attributes["pagegate.swaps"] == 1
    assert attributes["pagegate.prefix_hit_pages"] == 1 and attributes["pagegate.pages_held"] == 3
    children = [s for name, group in spans.items() if name != "llm_request" for s in group]
    assert all(s.parent.span_id == request.context.span_id for s in children)
    assert all(request.start_time <= s.start_time <= s.end_time <= request.end_time for s in children)
    (queue,), (prefill,), (decode,) = spans["queue"], spans["prefill"], spans["decode"]
    assert queue.end_time == prefill.start_time and prefill.end_time == decode.start_time
    assert (decode.end_time - queue.start_time) / 1e9 == 3.0 and request.start_time == tracer.epoch_ns(9.9)
    kinds = [(s.attributes["pagegate.preemption.kind"], s.attributes["pagegate.preemption.resumed"])
             for s in sorted(spans["preempted"], key=lambda s: s.start_time)]
    assert kinds == [(SWAP, True), (RECOMPUTE, False)]  # one never resumed lasts until the finish
    assert spans["preempted"][0].end_time - spans["preempted"][0].start_time == 500_000_000


def test_without_trace_context_the_request_span_is_a_root() -> None:
    exporter = InMemorySpanExporter()
    tracer = RequestTracer(tracer_provider(exporter=exporter))
    tracer.trace(TIMING, 10.0, 13.0, {})
    (request,) = spans_of(tracer, exporter)["llm_request"]
    assert request.parent is None


def test_the_collector_url_gets_otlp_path_unless_it_has_one() -> None:
    assert traces_url("http://collector:4318") == "http://collector:4318/v1/traces"
    assert traces_url("localhost:4318/") == "http://localhost:4318/v1/traces"
    assert traces_url("https://c.example/otlp/v1/traces") == "https://c.example/otlp/v1/traces"


def test_headers_opt_in() -> None:
    assert wants_timing({"x-pagegate-timing": "1"}) and wants_timing({"x-pagegate-timing": "true"})
    assert not wants_timing({}) and not wants_timing({"x-pagegate-timing": "0"})
    assert trace_headers({"traceparent": "t", "other": "x"}) == {"traceparent": "t"} and trace_headers({}) is None


def finished_output(request_id: str) -> RequestOutput:
    metrics = {"arrival_time": 1.0, "first_scheduled_time": 1.1, "first_token_time": 1.3, "last_token_time": 2.0,
               "prefix_hit_pages": 2, "pages_held": 4, "preemptions": [[RECOMPUTE, 1.5, 3, 0, 1.6]]}
    return RequestOutput(request_id, None, [1, 2, 3], [CompletionOutput(0, "ab", [5, 6], "length")], True, 0, metrics)


def test_recent_requests_keep_the_last_n_and_hide_other_keys_ids() -> None:
    exporter = InMemorySpanExporter()
    recorder = TimingRecorder(RequestTracer(tracer_provider(exporter=exporter)), keep=2)
    for i, tenant in enumerate(["a", "b", "a"]):
        recorder.finished(finished_output(f"r{i}"), 2, 0.9, "m", tenant)
    recorder.finished(RequestOutput("running", None, [1], [], False), 0, 0.9, "m")  # not finished: nothing kept
    mine = recorder.rows("a", every_id=False)
    assert [row["request_id"] for row in mine] == ["r2", None]  # newest first, b's unnamed
    assert mine[0]["preemptions"] == 1 and mine[0]["swaps"] == 0 and mine[0]["preempted_ms"] == 100.0
    assert mine[0]["queue_ms"] == 100.0 and mine[0]["prompt_tokens"] == 3 and mine[0]["completion_tokens"] == 2
    assert [row["request_id"] for row in recorder.rows(None, every_id=True)] == ["r2", "r1"]
    recorder.shutdown()  # flushes: every finished request was traced
    assert len([s for s in exporter.get_finished_spans() if s.name == "llm_request"]) == 3


def test_a_server_without_the_flag_never_imports_opentelemetry() -> None:
    code = ("import sys\n"
            "from pagegate.gateway.app import build_app, build_state\n"
            "from pagegate.gateway.cli import build_parser, configs_from_args\n"
            "state = build_state(*configs_from_args(build_parser().parse_args([])))\n"
            "build_app(state)\n"
            "assert state['host'].timings.tracer is None\n"
            "print(sorted(m for m in sys.modules if m.startswith('opentelemetry')))\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"


def test_the_flag_and_the_recent_requests_route() -> None:
    from pagegate.gateway.cli import build_parser, configs_from_args
    from pagegate.gateway.settings import GatewayConfig
    from tests.gateway.unstarted import unstarted_client

    assert configs_from_args(build_parser().parse_args([]))[1].otlp_traces_endpoint is None
    flagged = configs_from_args(build_parser().parse_args(["--otlp-traces-endpoint", "http://c:4318"]))[1]
    assert flagged.otlp_traces_endpoint == "http://c:4318"
    app = unstarted_client(GatewayConfig(api_keys=["secret"]))  # no lifespan: no engine
    assert app.get("/dashboard/api/recent").status_code == 401
    app.app_state["host"].timings.finished(finished_output("r"), 2, 0.9, "m", None)
    response = app.get("/dashboard/api/recent", headers={"Authorization": "Bearer secret"})
    assert response.status_code == 200 and [row["request_id"] for row in response.json()["requests"]] == ["r"]
