"""The dashboard's limits, against real servers on 127.0.0.1: a cap on viewers (503 + Retry-After), a frame
encoded once for all viewers, a viewer that does not read dropped, a hover query during a long engine step
answered 503 + Retry-After, other keys' request ids hidden, and no key in the access log.

Most tests run the app under uvicorn on a thread of this process, so that they can read the feed's counters on
its event loop; a long engine step is the core process held by SIGSTOP.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import httpx
import pytest
import uvicorn

from pagegate.config import CacheConfig, EngineConfig, SchedulerConfig
from pagegate.gateway.app import build_app, build_state
from pagegate.gateway.dashboard.feed import DashboardFeed
from pagegate.gateway.http_protocol import HeadLimitedH11Protocol
from pagegate.gateway.request_id import RequestIdMiddleware
from pagegate.gateway.settings import GatewayConfig
from pagegate.testing.launcher import ServerProcess, wait_for

KEYS = ["key-alpha-0123", "key-beta-4567"]
ALPHA, BETA = ({"Authorization": f"Bearer {key}"} for key in KEYS)
MAX_VIEWERS = 3
FEED = "/dashboard/api/feed"
# The server's sockets send from small kernel buffers, so that a client that does not read fills them (and
# uvicorn's 64 KiB write buffer) in a few hundred frames rather than megabytes.
SERVER_SEND_BUFFER = 4096
DEADLINE_S = 120.0  # bounds every wait below; none of them is a measurement
T = TypeVar("T")


class ThreadedServer:
    """build_app under uvicorn with `pagegate serve`'s HTTP protocol, on a thread of this process."""

    def __init__(self, engine_config: EngineConfig, config: GatewayConfig) -> None:
        self.state = build_state(engine_config, config)
        self.app = build_app(self.state)
        self.listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SERVER_SEND_BUFFER)  # accepted ones inherit it
        self.listener.bind(("127.0.0.1", 0))
        self.base_url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        uv_config = uvicorn.Config(RequestIdMiddleware(self.app), http=HeadLimitedH11Protocol, lifespan="on",
                                   log_config=None, access_log=False)
        self.server = uvicorn.Server(uv_config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.listener]}, daemon=True)

    @property
    def dashboard(self) -> DashboardFeed:
        dashboard = self.state["dashboard"]
        assert dashboard is not None
        return dashboard

    def start(self) -> ThreadedServer:
        self.thread.start()
        host = self.state["host"]
        wait_for(lambda: host.state == "failed" or _healthy(self.base_url), "the server to become healthy", DEADLINE_S)
        assert host.state != "failed", host.reason
        return self

    def on_loop(self, fn: Callable[[], T]) -> T:
        """fn() on the server's event loop: what it reads of the feed is not changing meanwhile."""
        async def call() -> T:
            return fn()

        return asyncio.run_coroutine_threadsafe(call(), self.state["host"].loop).result(DEADLINE_S)

    def stop(self) -> None:
        self.on_loop(self.state["host"].end_all)  # as SIGTERM does: the feeds end, so uvicorn can stop
        self.server.should_exit = True
        self.thread.join(DEADLINE_S)


def _healthy(base_url: str) -> bool:
    try:
        return httpx.get(base_url + "/health", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.fixture(scope="module")
def served() -> Iterator[ThreadedServer]:
    model = os.environ.get("PAGEGATE_TEST_MODEL")
    engine_config = EngineConfig(model=model, dtype="float32", device="cpu", cache=CacheConfig(num_kv_blocks=128),
                                 scheduler=SchedulerConfig(max_num_seqs=4))
    config = GatewayConfig(api_keys=KEYS, grpc_port=0, dashboard_max_viewers=MAX_VIEWERS)
    server = ThreadedServer(engine_config, config).start()
    yield server
    server.stop()


class FeedReader:
    """One viewer of the feed over HTTP: its frames parsed, and every byte it was sent."""

    def __init__(self, lines: Iterator[str]) -> None:
        self.lines = lines
        self.received = ""
        self.queues: dict[str, Any] = {}  # as of the last frame that carried them

    def next_frame(self) -> dict[str, Any]:
        for line in self.lines:
            self.received += line + "\n"
            if line.startswith("data: "):
                frame = json.loads(line[len("data: "):])
                self.queues = frame.get("queues", self.queues)
                return frame
        raise AssertionError("the feed ended")


@contextlib.contextmanager
def feeds(server: ThreadedServer, *headers: dict[str, str]) -> Iterator[list[FeedReader]]:
    """One open feed per header set, each past its first (key) frame."""
    with contextlib.ExitStack() as stack:
        readers = []
        for auth in headers:
            client = stack.enter_context(httpx.Client(base_url=server.base_url, headers=auth, timeout=DEADLINE_S))
            response = stack.enter_context(client.stream("GET", FEED))
            assert response.status_code == 200, response.read()
            readers.append(FeedReader(response.iter_lines()))
        for reader in readers:
            assert reader.next_frame()["key"]
        yield readers


def test_viewers_past_the_cap_get_503_and_one_frame_serves_them_all(served: ThreadedServer) -> None:
    with feeds(served, *[ALPHA] * MAX_VIEWERS) as readers:
        with httpx.stream("GET", served.base_url + FEED, headers=BETA, timeout=DEADLINE_S) as refused:
            assert refused.status_code == 503 and refused.headers["Retry-After"] == "1"  # (a feed would never end)
            error = json.loads(refused.read())["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["code"] == "too_many_viewers"

        def counts() -> tuple[int, int]:
            return served.dashboard.ticks, served.dashboard.encoder.frames_encoded

        ticks, encoded = served.on_loop(counts)
        for _ in range(5):
            for reader in readers:
                assert not reader.next_frame()["key"]
        more_ticks, more_encoded = served.on_loop(counts)
        assert more_ticks > ticks
        assert more_encoded - encoded == more_ticks - ticks  # one frame per snapshot for the three viewers
    wait_for(lambda: served.on_loop(lambda: len(served.dashboard.viewers)) == 0, "the viewers to leave", DEADLINE_S)
    with feeds(served, BETA):  # their slots are free again
        pass


def test_a_viewer_that_does_not_read_is_dropped(served: ThreadedServer) -> None:
    served.on_loop(lambda: setattr(served.dashboard, "frame_interval_s", 0.005))  # fill its buffers sooner
    try:
        with feeds(served, ALPHA) as (reader,), _stuck_viewer(served.base_url) as stuck:
            reading, stop = threading.Event(), threading.Event()

            def keep_reading() -> None:
                while not stop.is_set():
                    reader.next_frame()
                    reading.set()

            thread = threading.Thread(target=keep_reading, daemon=True)
            thread.start()
            wait_for(lambda: _tcp_state(stuck) in CLOSED_BY_SERVER, "the server to close the stuck viewer's connection",
                     DEADLINE_S, poll_s=0.05)
            reading.clear()
            wait_for(reading.is_set, "the reading viewer to get a frame (was it dropped too?)", DEADLINE_S, poll_s=0.05)
            stop.set()
            thread.join(DEADLINE_S)
        wait_for(lambda: served.on_loop(lambda: len(served.dashboard.viewers)) == 0, "every viewer to be dropped",
                 DEADLINE_S, poll_s=0.05)
    finally:
        served.on_loop(lambda: setattr(served.dashboard, "frame_interval_s", 0.1))


TCP_CLOSE, TCP_CLOSE_WAIT = 7, 8  # Linux's tcp_states.h: reset by the peer; closed by the peer (FIN)
CLOSED_BY_SERVER = (TCP_CLOSE, TCP_CLOSE_WAIT)


def _tcp_state(sock: socket.socket) -> int:
    """The connection's state as the kernel sees it (tcp_info's first byte), without reading from it."""
    return sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 1)[0]


@contextlib.contextmanager
def _stuck_viewer(base_url: str) -> Iterator[socket.socket]:
    """A feed request from a client that never reads (and says so with a tiny receive window)."""
    host, port = base_url.removeprefix("http://").split(":")
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect((host, int(port)))
    sock.sendall(f"GET {FEED} HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {KEYS[1]}\r\n\r\n".encode())
    try:
        yield sock
    finally:
        sock.close()


def test_a_hover_query_during_a_long_engine_step_gets_503_with_retry_after(served: ThreadedServer) -> None:
    core = served.state["host"].engine.process.pid  # stopped, the core answers nothing: as in a long step
    served.on_loop(lambda: setattr(served.dashboard, "query_timeout_s", 0.2))  # the wait, not the subject
    os.kill(core, signal.SIGSTOP)
    try:
        answers: list[httpx.Response] = []

        def refused() -> bool:  # a 200 is a snapshot from before, still fresh
            answers[:] = [httpx.get(served.base_url + "/dashboard/api/page?id=0", headers=ALPHA, timeout=DEADLINE_S)]
            return answers[0].status_code != 200

        wait_for(refused, "a hover query that the stopped core cannot answer", DEADLINE_S, poll_s=0)
        [answer] = answers
        assert answer.status_code == 503, answer.text
        assert answer.headers["Retry-After"] == "1" and answer.json()["error"]["code"] == "engine_busy"
    finally:
        os.kill(core, signal.SIGCONT)
        served.on_loop(lambda: setattr(served.dashboard, "query_timeout_s", 1.0))
    after = httpx.get(served.base_url + "/dashboard/api/page?id=0", headers=ALPHA, timeout=DEADLINE_S)
    assert after.status_code == 200 and after.json()["page"] == 0


def test_a_viewer_sees_only_its_own_keys_request_ids(served: ThreadedServer) -> None:
    body = {"prompt": "Once upon a time", "max_tokens": 2000, "ignore_eos": True, "stream": True}
    marker = "alpha-secret-request"
    with _slow_steps(served), feeds(served, ALPHA, BETA) as (alpha, beta), \
            httpx.Client(base_url=served.base_url, headers={**ALPHA, "x-request-id": marker}, timeout=DEADLINE_S) as client, \
            client.stream("POST", "/v1/completions", json=body) as generation:
        assert generation.status_code == 200
        for reader in (alpha, beta):
            def running(reader: FeedReader = reader) -> bool:
                if reader.queues["running"]["count"]:
                    return True
                reader.next_frame()
                return False

            wait_for(running, "the request to show as running", DEADLINE_S, poll_s=0)
        [own_id] = [rid for rid, _, _ in alpha.queues["running"]["requests"]]
        assert marker in own_id
        assert beta.queues["running"]["requests"][0][0] is None  # listed, counted, not named
        assert marker not in beta.received
        pages = _get(served, f"/dashboard/api/pages?request={own_id}", ALPHA)["pages"]
        assert pages and _get(served, f"/dashboard/api/pages?request={own_id}", BETA)["pages"] == []
        seen_by_alpha = _get(served, f"/dashboard/api/page?id={pages[0]}", ALPHA)
        seen_by_beta = _get(served, f"/dashboard/api/page?id={pages[0]}", BETA)
        assert seen_by_alpha["requests"] == [own_id] and seen_by_alpha["other_requests"] == 0
        assert seen_by_beta["requests"] == [] and seen_by_beta["other_requests"] == 1


@contextlib.contextmanager
def _slow_steps(server: ThreadedServer) -> Iterator[None]:
    """The engine core is stopped a few milliseconds at a time, so that the embedded model's generation
    (thousands of tokens a second) is still running when the test looks at it."""
    core, stop = server.state["host"].engine.process.pid, threading.Event()

    def pause_often() -> None:
        while not stop.is_set():
            os.kill(core, signal.SIGSTOP)
            time.sleep(0.005)
            os.kill(core, signal.SIGCONT)
            time.sleep(0.002)

    thread = threading.Thread(target=pause_often, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(DEADLINE_S)
        os.kill(core, signal.SIGCONT)


def _get(server: ThreadedServer, path: str, headers: dict[str, str]) -> dict[str, Any]:
    response = httpx.get(server.base_url + path, headers=headers, timeout=DEADLINE_S)
    assert response.status_code == 200, response.text
    return response.json()


def test_the_access_log_never_shows_a_key() -> None:
    key = "access-log-secret-89ab"
    model = os.environ.get("PAGEGATE_TEST_MODEL")
    args = (["--model", model] if model else []) + ["--dtype", "float32", "--device", "cpu", "--grpc-port", "0",
                                                      "--num-kv-blocks", "128", "--api-key", key]
    with ServerProcess(args) as server:
        paths = [f"/dashboard/api/page?id=0&api_key={key}", f"/v1/models?api_key={key}",
                 f"/health?x=1&api_key={key}&y=2", f"/dashboard/api/pages?request=r&api%5Fkey={key}"]
        statuses = [httpx.get(server.base_url + path, timeout=DEADLINE_S).status_code for path in paths]
        assert statuses == [200, 401, 200, 200]
    log = server.log()
    assert key not in log
    for line in ("/dashboard/api/page?id=0&api_key=*** HTTP/1.1\" 200", "/v1/models?api_key=*** HTTP/1.1\" 401",
                 "/health?x=1&api_key=***&y=2 HTTP/1.1\" 200", "/dashboard/api/pages?request=r&api%5Fkey=*** HTTP"):
        assert line in log, log[-3000:]
