"""--shutdown-timeout: SIGTERM drains. /health and new requests get 503 (gRPC: UNAVAILABLE) at once, live streams
over REST SSE, msgpack and gRPC and every other kind of request (embeddings, Responses, Messages, scoring) run to
their end (or, past the timeout, end with an error), and the server exits 0."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import anthropic
import grpc
import httpx
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pagegate.clients import GrpcClient, MsgpackClient
from pagegate.clients.errors import PagegateError
from pagegate.gateway.cli import build_parser, configs_from_args
from pagegate.gateway.shutdown import GracefulShutdown
from pagegate.testing.launcher import ServerProcess, alive, core_pids, cores_stopped, free_port, wait_for
from tests.gateway.conftest import metric_value
from tests.gateway.server_args import server_args

NUM_STREAMS = 32
DRAIN_S = 300  # --shutdown-timeout where a drain must not time out: it ends when its requests do, however slowly
TRANSPORTS = ("sse", "msgpack", "grpc")


@dataclass
class StreamResult:
    transport: str
    started: threading.Event = field(default_factory=threading.Event)  # its first token has arrived
    finish_reason: str | None = None
    completion_tokens: int | None = None
    error: BaseException | None = None
    ended_at: float | None = None


def _chunks(transport: str, server: ServerProcess, grpc_port: int, max_tokens: int, index: int) -> Iterator[Any]:
    """One streamed completion's chunks as dicts, whatever the transport."""
    params: dict[str, Any] = {"max_tokens": max_tokens, "ignore_eos": True, "temperature": 0.0,
                              "stream_options": {"include_usage": True}}
    prompt = f"Stream {index} says"
    if transport == "sse":
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=DRAIN_S)
        model = client.models.list().data[0].id
        stream = client.completions.create(model=model, prompt=prompt, stream=True, max_tokens=max_tokens,
                                           temperature=0.0, stream_options={"include_usage": True},
                                           extra_body={"ignore_eos": True})
        for chunk in stream:
            yield chunk.model_dump()
    elif transport == "msgpack":
        with MsgpackClient(server.base_url, timeout=DRAIN_S) as client:
            yield from client.stream_completions(prompt, **params)
    else:
        with GrpcClient(f"127.0.0.1:{grpc_port}", timeout=DRAIN_S) as client:
            yield from client.stream_completions(prompt, **params)


def _run_stream(result: StreamResult, chunks: Callable[[], Iterator[Any]]) -> None:
    try:
        for chunk in chunks():
            choices = chunk.get("choices") or []
            if choices and choices[0].get("text"):
                result.started.set()
            if choices and choices[0].get("finish_reason"):
                result.finish_reason = choices[0]["finish_reason"]
            if chunk.get("usage"):
                result.completion_tokens = chunk["usage"]["completion_tokens"]
    except BaseException as exc:  # noqa: B036 - the test reads it
        result.error = exc
    finally:
        result.ended_at = time.monotonic()
        result.started.set()


def _start_streams(server: ServerProcess, grpc_port: int, count: int,
                   max_tokens: int) -> tuple[list[StreamResult], list[threading.Thread]]:
    results = [StreamResult(TRANSPORTS[i % len(TRANSPORTS)]) for i in range(count)]
    threads = []
    for i, result in enumerate(results):
        def chunks(t: str = result.transport, i: int = i) -> Iterator[Any]:
            return _chunks(t, server, grpc_port, max_tokens, i)

        threads.append(threading.Thread(target=_run_stream, args=(result, chunks), daemon=True))
        threads[-1].start()
    for result in results:
        assert result.started.wait(180), "a stream never started"
    assert not [r for r in results if r.error is not None], [repr(r.error) for r in results if r.error][:3]
    return results, threads


def _server(shutdown_timeout_s: float) -> tuple[ServerProcess, int]:
    grpc_port = free_port()
    args = server_args("--num-kv-blocks", "1024", "--max-num-seqs", str(NUM_STREAMS), "--max-model-len", "2048",
                       "--grpc-port", str(grpc_port), "--shutdown-timeout", str(shutdown_timeout_s),
                       "--engine-step-timeout", "0")  # the tests stop the core on purpose: never take it for hung
    return ServerProcess(args).start(), grpc_port


def _wait_health_503(server: ServerProcess) -> dict:
    """/health's report once it says 503. The callers hold the drain open (the core stopped, or the requests
    unfinished), so that it answers 503 while requests are still in flight is shown by the report, not by a clock."""
    last: list[httpx.Response] = []

    def refused() -> bool:
        last[:] = [httpx.get(server.base_url + "/health", timeout=30)]
        return last[0].status_code == 503

    wait_for(refused, "/health to answer 503", timeout_s=120, poll_s=0.01)
    return last[0].json()


def _assert_new_requests_refused(server: ServerProcess, grpc_port: int) -> None:
    """Every door answers 503 / UNAVAILABLE (the engine core may be stopped: nothing here asks it anything)."""
    body = {"prompt": "late", "max_tokens": 4}
    response = httpx.post(server.base_url + "/v1/completions", json=body, timeout=10)
    assert response.status_code == 503 and response.headers["retry-after"] == "1", response.text
    assert response.json()["error"]["code"] == "draining", response.text
    assert response.headers["connection"] == "close"  # the client's next request opens a connection elsewhere
    with MsgpackClient(server.base_url, timeout=10) as client, pytest.raises(PagegateError) as refused:
        client.completions("late", max_tokens=4)
    assert refused.value.status_code == 503 and refused.value.code == "draining"
    with GrpcClient(f"127.0.0.1:{grpc_port}", timeout=10) as client, pytest.raises(PagegateError) as refused:
        client.completions("late", max_tokens=4)
    assert refused.value.grpc_code == grpc.StatusCode.UNAVAILABLE  # type: ignore[attr-defined]
    assert refused.value.retry_after == 1.0
    with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
        answer = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
    assert answer.status == health_pb2.HealthCheckResponse.NOT_SERVING


def _metrics_later(server: ServerProcess) -> tuple[threading.Thread, list[str]]:
    """/metrics fetched in a thread: with the engine core stopped, the answer comes once it runs again."""
    texts: list[str] = []
    thread = threading.Thread(target=lambda: texts.append(httpx.get(server.base_url + "/metrics",
                                                                    timeout=DRAIN_S).text),
                              daemon=True)
    thread.start()
    return thread, texts


def test_sigterm_drains_32_live_streams_to_their_end() -> None:
    """The engine core is stopped from before the signal until the checks are done, so the drain outlasts them
    however fast the machine finishes 160 tokens."""
    server, grpc_port = _server(DRAIN_S)  # generous: a drain ends as soon as its requests do
    max_tokens = 48
    try:
        results, threads = _start_streams(server, grpc_port, NUM_STREAMS, max_tokens)
        assert server.process is not None
        with cores_stopped(server.process.pid):
            server.process.send_signal(signal.SIGTERM)
            report = _wait_health_503(server)
            assert report["status"] == "draining" and report["in_flight"] == NUM_STREAMS, report
            _assert_new_requests_refused(server, grpc_port)
            metrics, texts = _metrics_later(server)
        metrics.join(DRAIN_S)  # the core answers before its next step: the 32 streams still have ~40 to go
        assert metric_value(texts[0], "pagegate:server_draining") == 1
        assert server.process.wait(DRAIN_S + 30) == 0, server.log()[-3000:]
        for thread in threads:
            thread.join(5)
        bad = [(r.transport, repr(r.error), r.finish_reason, r.completion_tokens) for r in results
               if r.error is not None or r.finish_reason != "length" or r.completion_tokens != max_tokens]
        assert not bad, (bad[:4], server.log()[-3000:])
        log = server.log()
        assert "drained: every in-flight request finished" in log and ", 0 in use" in log, log[-3000:]
    finally:
        server.stop()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_short_timeout_ends_long_streams_with_an_error_and_exits_0(sig: signal.Signals) -> None:
    """The engine core is stopped from before the signal until the streams have ended: none can finish within
    the 1 s drain, however fast the machine."""
    server, grpc_port = _server(1.0)
    try:
        results, threads = _start_streams(server, grpc_port, 6, 1500)
        assert server.process is not None
        with cores_stopped(server.process.pid):
            server.process.send_signal(sig)
            _wait_health_503(server)
            for thread in threads:
                thread.join(60)
        assert server.process.wait(60) == 0, server.log()[-3000:]
        for result in results:
            assert result.ended_at is not None, result
            assert result.finish_reason is None, result
            assert isinstance(result.error, (openai.APIError, PagegateError)), repr(result.error)
            assert "shutting down" in str(result.error), repr(result.error)
        log = server.log()
        assert "drain timed out after 1 s: ending 6 request(s)\n" in log and ", 0 in use" in log, log[-3000:]
    finally:
        server.stop()


# -- every kind of request counts -------------------------------------------------------------------
KIND_TOKENS = 6


def _kinds(server: ServerProcess, grpc_port: int) -> dict[str, Callable[[], Any]]:
    """One request of each kind a drain must wait for; each returns what the test then checks."""
    oai = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=DRAIN_S)
    claude = anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0, timeout=DRAIN_S)
    model = oai.models.list().data[0].id
    greedy = {"temperature": 0.0, "ignore_eos": True}

    def chat_stream() -> list[Any]:
        stream = oai.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}], stream=True,
                                             max_tokens=KIND_TOKENS, extra_body=greedy)
        return [c.choices[0].finish_reason for c in stream if c.choices and c.choices[0].finish_reason]

    def scoring() -> dict:
        body = {"model": model, "prompt": "Score every token of this prompt.", "echo": True, "logprobs": 1,
                "max_tokens": 0}
        response = httpx.post(server.base_url + "/v1/completions", json=body, timeout=DRAIN_S)
        assert response.status_code == 200, response.text
        return response.json()

    def grpc_completion() -> dict:
        with GrpcClient(f"127.0.0.1:{grpc_port}", timeout=DRAIN_S) as client:
            return client.completions("Over gRPC", max_tokens=KIND_TOKENS, **greedy)

    return {
        "completions": lambda: oai.completions.create(model=model, prompt="Once", max_tokens=KIND_TOKENS,
                                                      extra_body=greedy),
        "chat": chat_stream,
        "embeddings": lambda: oai.embeddings.create(model=model, input=["First text to embed.", "Second one."]),
        "responses": lambda: oai.responses.create(model=model, input="Say hello.", max_output_tokens=KIND_TOKENS,
                                                  temperature=0),
        "messages": lambda: claude.messages.create(model=model, max_tokens=KIND_TOKENS,
                                                   messages=[{"role": "user", "content": "Say hello."}]),
        "scoring": scoring,
        "grpc": grpc_completion,
    }


def _check_answer(kind: str, answer: Any) -> None:
    """Each kind's answer is a normal, whole one."""
    if kind == "completions":
        assert answer.choices[0].finish_reason == "length" and answer.usage.completion_tokens == KIND_TOKENS
    elif kind == "chat":
        assert answer == ["length"]
    elif kind == "embeddings":
        assert len(answer.data) == 2 and all(len(item.embedding) > 0 for item in answer.data)
    elif kind == "responses":
        assert answer.status in ("completed", "incomplete") and answer.usage.output_tokens > 0
    elif kind == "messages":
        assert answer.stop_reason in ("end_turn", "max_tokens") and answer.usage.output_tokens > 0
    elif kind == "scoring":
        assert len(answer["choices"][0]["logprobs"]["token_logprobs"]) > 3
    else:
        assert answer["usage"]["completion_tokens"] == KIND_TOKENS


def _wait_admitted(server: ServerProcess, count: int, calls: dict[str, Call]) -> None:
    """Until the gateway has started the engine work of `count` requests (the core, stopped, finishes none)."""
    def admitted() -> bool:
        report = httpx.get(server.base_url + "/health", timeout=30).json()
        failed = {kind: repr(call.error) for kind, call in calls.items() if call.error is not None}
        assert not failed, failed
        return report.get("admitted") == count

    wait_for(admitted, f"all {count} requests to be admitted", timeout_s=90, poll_s=0.05)


@dataclass
class Call:
    answer: Any = None
    error: BaseException | None = None


def _call_in_thread(call: Call, fn: Callable[[], Any]) -> threading.Thread:
    def run() -> None:
        try:
            call.answer = fn()
        except BaseException as exc:  # noqa: B036 - the test reads it
            call.error = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_every_kind_of_request_counts_in_a_drain() -> None:
    """Embeddings, Responses, Messages, prompt scoring, gRPC, completions and a chat stream are all in flight when
    SIGTERM comes: the drain waits for each (none is cut off), and new requests meanwhile get the 503.

    The engine core is stopped (SIGSTOP) before the requests are sent and until the checks are done, so none can
    finish early, however fast the machine."""
    grpc_port = free_port()
    server = ServerProcess(server_args("--num-kv-blocks", "256", "--pooling", "mean", "--grpc-port", str(grpc_port),
                                       "--shutdown-timeout", str(DRAIN_S), "--engine-step-timeout", "0")).start()
    assert server.process is not None
    [core] = core_pids(server.process.pid)
    try:
        kinds = _kinds(server, grpc_port)
        os.kill(core, signal.SIGSTOP)
        calls = {kind: Call() for kind in kinds}
        threads = [_call_in_thread(calls[kind], fn) for kind, fn in kinds.items()]
        _wait_admitted(server, len(kinds), calls)
        server.process.send_signal(signal.SIGTERM)
        report = _wait_health_503(server)
        assert report["status"] == "draining" and report["in_flight"] == len(kinds), report
        late = httpx.post(server.base_url + "/v1/embeddings", json={"input": "late"}, timeout=10)
        assert late.status_code == 503 and late.json()["error"]["code"] == "draining", late.text
        late = httpx.post(server.base_url + "/v1/completions", json={"prompt": "late", "max_tokens": 2}, timeout=10)
        assert late.status_code == 503 and late.json()["error"]["code"] == "draining", late.text
        with GrpcClient(f"127.0.0.1:{grpc_port}", timeout=10) as client, pytest.raises(PagegateError) as refused:
            client.completions("late", max_tokens=2)
        assert refused.value.grpc_code == grpc.StatusCode.UNAVAILABLE  # type: ignore[attr-defined]
        assert all(call.answer is None and call.error is None for call in calls.values())
        os.kill(core, signal.SIGCONT)
        assert server.process.wait(DRAIN_S + 30) == 0, server.log()[-3000:]
        for thread in threads:
            thread.join(10)
        failed = {kind: repr(call.error) for kind, call in calls.items() if call.error is not None}
        assert not failed, (failed, server.log()[-3000:])
        for kind, call in calls.items():
            _check_answer(kind, call.answer)
        log = server.log()
        assert f"draining: {len(kinds)} request(s) in flight" in log, log[-3000:]
        assert "drained: every in-flight request finished" in log and ", 0 in use" in log, log[-3000:]
    finally:
        if alive(core):
            os.kill(core, signal.SIGCONT)
        server.stop()


def test_shutdown_timeout_flag() -> None:
    parser = build_parser()
    assert configs_from_args(parser.parse_args([]))[1].shutdown_timeout_s == 0.0  # vLLM's default: no drain
    assert configs_from_args(parser.parse_args(["--shutdown-timeout", "30"]))[1].shutdown_timeout_s == 30.0
    for bad in ("-1", "nan"):
        with pytest.raises(SystemExit):
            parser.parse_args(["--shutdown-timeout", bad])


class FakeHost:
    """The EngineHost calls GracefulShutdown makes, recorded."""

    def __init__(self, state: str = "ready", busy_s: float = 10.0) -> None:
        self.state = state
        self.busy_s = busy_s  # how long the in-flight requests would take
        self.calls: list[str] = []
        self.num_in_flight = 3

    def begin_drain(self) -> None:
        self.calls.append("begin_drain")
        self.state = "draining"

    async def wait_idle(self, timeout_s: float) -> bool:
        await asyncio.sleep(min(timeout_s, self.busy_s))
        return self.busy_s <= timeout_s

    def end_all(self, message: str = "") -> None:
        self.calls.append("end_all")


def _signals(host: FakeHost, timeout_s: float, count: int, gap_s: float = 0.05) -> list[str]:
    """Deliver `count` stop signals `gap_s` apart; what the host and the server saw, in order."""
    async def run() -> None:
        shutdown = GracefulShutdown(host, timeout_s, lambda: host.calls.append("stop_server"))  # type: ignore[arg-type]
        for _ in range(count):
            shutdown.on_signal()
            await asyncio.sleep(gap_s)
        if shutdown.task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await shutdown.task

    asyncio.run(run())
    return host.calls


def test_without_a_timeout_a_signal_ends_everything_at_once() -> None:
    assert _signals(FakeHost(), 0, 1) == ["end_all", "stop_server"]


def test_a_drain_stops_the_server_once_idle() -> None:
    assert _signals(FakeHost(busy_s=0.01), 5, 1) == ["begin_drain", "end_all", "stop_server"]


def test_a_drain_past_its_timeout_ends_the_rest() -> None:
    assert _signals(FakeHost(busy_s=10), 0.1, 1, gap_s=0.2) == ["begin_drain", "end_all", "stop_server"]


def test_a_second_signal_ends_the_drain_at_once() -> None:
    assert _signals(FakeHost(busy_s=10), 30, 2) == ["begin_drain", "end_all", "stop_server"]


def test_a_server_still_loading_stops_at_once() -> None:
    assert _signals(FakeHost(state="loading"), 30, 1) == ["end_all", "stop_server"]
