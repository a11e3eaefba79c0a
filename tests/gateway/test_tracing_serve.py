"""A real server with --otlp-traces-endpoint pointed at a collector in this test (OTLP/HTTP protobuf posts to
/v1/traces): each request's spans arrive, parented by the client's traceparent; a request preempted under page
pressure has its `preempted` span; `X-Pagegate-Timing: 1` puts the breakdown in the usage, streamed or not; the
dashboard lists the last requests."""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

from pagegate.testing.launcher import ServerProcess, wait_for
from tests.gateway.server_args import server_args

TRACE_ID, PARENT_ID = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
TIMING = {"X-Pagegate-Timing": "1"}
BREAKDOWN_KEYS = {"queue_ms", "prefill_ms", "decode_ms", "time_to_first_token_ms", "e2e_ms", "preempted_ms",
                  "preemptions", "swaps", "prefix_hit_pages", "pages_held"}


class Collector(ThreadingHTTPServer):
    """Every span posted to /v1/traces, as {name, trace_id, span_id, parent_id, start, end, attributes}."""

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _CollectorHandler)
        self.spans: list[dict] = []
        self.lock = threading.Lock()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def take(self, body: bytes) -> None:
        request = ExportTraceServiceRequest.FromString(body)
        with self.lock:
            self.spans += [span_dict(span) for rs in request.resource_spans for ss in rs.scope_spans
                           for span in ss.spans]

    def request_spans(self, request_id_prefix: str, count: int = 1, timeout_s: float = 60.0) -> list[dict]:
        """The llm_request spans of an API request's engine requests (waiting for `count` of them)."""
        found: list[dict] = []

        def arrived() -> bool:
            with self.lock:
                found[:] = [s for s in self.spans if s["name"] == "llm_request"
                            and s["attributes"]["gen_ai.request.id"].startswith(request_id_prefix + "-")]
            return len(found) >= count

        wait_for(arrived, f"{count} llm_request span(s) of {request_id_prefix}", timeout_s, poll_s=0.05)
        return found

    def children(self, parent: dict) -> list[dict]:
        with self.lock:
            return [s for s in self.spans if s["parent_id"] == parent["span_id"]]


class _CollectorHandler(BaseHTTPRequestHandler):
    server: Collector

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        body = self.rfile.read(int(self.headers["Content-Length"]))
        if self.path == "/v1/traces":
            self.server.take(body)
        reply = ExportTraceServiceResponse().SerializeToString()
        self.send_response(200 if self.path == "/v1/traces" else 404)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply)

    def log_message(self, *args: object) -> None:
        pass


def span_dict(span) -> dict:
    attributes = {kv.key: getattr(kv.value, kv.value.WhichOneof("value")) for kv in span.attributes}
    return {"name": span.name, "trace_id": span.trace_id.hex(), "span_id": span.span_id.hex(),
            "parent_id": span.parent_span_id.hex(), "start": span.start_time_unix_nano,
            "end": span.end_time_unix_nano, "attributes": attributes}


@pytest.fixture(scope="module")
def collector():
    server = Collector()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()


@pytest.fixture(scope="module")
def traced(collector: Collector):
    # 12 pages of 16 tokens: six requests that grow to 4 pages each cannot all run at once (preemption)
    args = server_args("--num-kv-blocks", "12", "--max-model-len", "128", "--max-num-seqs", "8",
                       "--otlp-traces-endpoint", collector.endpoint)
    process = ServerProcess(args, env={"OTEL_BSP_SCHEDULE_DELAY": "100"}).start()
    yield process
    assert process.stop() == 0, process.log()[-4000:]


@pytest.fixture(scope="module")
def http(traced: ServerProcess):
    with httpx.Client(base_url=traced.base_url, timeout=120) as session:
        yield session


def complete(http: httpx.Client, prompt: list[int], max_tokens: int = 8, headers: dict | None = None,
             **extra: object) -> dict:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, **extra}
    response = http.post("/v1/completions", json=body, headers=headers or {})
    assert response.status_code == 200, response.text
    return response.json()


def test_a_request_span_and_its_phases_reach_the_collector(http: httpx.Client, collector: Collector) -> None:
    traceparent = {"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"}
    body = complete(http, [11] * 20, headers={**TIMING, **traceparent})
    timing = body["usage"]["pagegate_timing"]
    assert set(timing) == BREAKDOWN_KEYS and timing["preemptions"] == 0 and timing["pages_held"] == 2
    (span,) = collector.request_spans(body["id"])
    assert span["trace_id"] == TRACE_ID and span["parent_id"] == PARENT_ID
    attributes = span["attributes"]
    assert attributes["gen_ai.usage.prompt_tokens"] == 20 and attributes["gen_ai.usage.completion_tokens"] == 8
    assert attributes["gen_ai.request.max_tokens"] == 8 and attributes["pagegate.pages_held"] == 2
    assert attributes["gen_ai.latency.time_in_queue"] * 1000 == pytest.approx(timing["queue_ms"], abs=0.01)
    children = {s["name"]: s for s in collector.children(span)}
    assert set(children) == {"queue", "prefill", "decode"}
    assert span["start"] <= children["queue"]["start"] <= children["prefill"]["start"] <= children["decode"]["start"]
    assert children["decode"]["end"] <= span["end"] and abs(span["start"] / 1e9 - time.time()) < 60  # epoch time


def test_without_the_header_the_usage_has_no_breakdown(http: httpx.Client, collector: Collector) -> None:
    body = complete(http, [12] * 20)
    assert "pagegate_timing" not in body["usage"]
    (span,) = collector.request_spans(body["id"])  # traced all the same
    assert len(span["parent_id"]) == 0  # no traceparent: a root span


def test_a_stream_carries_the_breakdown_in_its_usage_chunk(http: httpx.Client) -> None:
    body = {"prompt": [13] * 20, "max_tokens": 6, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    with http.stream("POST", "/v1/completions", json=body, headers=TIMING) as response:
        chunks = [json.loads(line[6:]) for line in response.iter_lines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
    *running, last = chunks
    assert set(last["usage"]["pagegate_timing"]) == BREAKDOWN_KEYS and last["choices"] == []
    assert all("pagegate_timing" not in chunk["usage"] for chunk in running[:-1])  # none before the finish


def test_a_request_preempted_under_page_pressure_has_preempted_spans(http: httpx.Client,
                                                                     collector: Collector) -> None:
    prompts = [[100 + i] * 20 for i in range(6)]  # distinct: no shared prefix pages
    with ThreadPoolExecutor(6) as pool:
        bodies = list(pool.map(lambda p: complete(http, p, max_tokens=40, headers=TIMING), prompts))
    preempted = [b for b in bodies if b["usage"]["pagegate_timing"]["preemptions"]]
    assert preempted, [b["usage"] for b in bodies]
    for body in preempted:
        timing = body["usage"]["pagegate_timing"]
        (span,) = collector.request_spans(body["id"])
        assert span["attributes"]["pagegate.preemptions"] == timing["preemptions"]
        marks = [s for s in collector.children(span) if s["name"] == "preempted"]
        assert len(marks) == timing["preemptions"] and timing["preempted_ms"] > 0
        assert all(m["attributes"]["pagegate.preemption.kind"] == "recompute" for m in marks)  # no swap space
        assert all(m["attributes"]["pagegate.preemption.pages"] > 0 and m["end"] >= m["start"] for m in marks)


def test_the_dashboard_lists_the_last_requests(http: httpx.Client) -> None:
    body = complete(http, [14] * 20, headers=TIMING)
    rows = http.get("/dashboard/api/recent").json()["requests"]
    assert 0 < len(rows) <= 20 and rows[0]["request_id"].startswith(body["id"] + "-")
    assert rows[0]["queue_ms"] == body["usage"]["pagegate_timing"]["queue_ms"]
    assert rows[0]["prompt_tokens"] == 20 and rows[0]["completion_tokens"] == 8


def test_chat_usage_carries_the_breakdown_too(http: httpx.Client, collector: Collector) -> None:
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": 0}
    response = http.post("/v1/chat/completions", json=body, headers=TIMING)
    assert response.status_code == 200, response.text
    answer = response.json()
    assert set(answer["usage"]["pagegate_timing"]) == BREAKDOWN_KEYS
    (span,) = collector.request_spans(answer["id"])
    assert span["attributes"]["gen_ai.usage.completion_tokens"] == answer["usage"]["completion_tokens"]
