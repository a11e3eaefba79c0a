"""--engine-step-timeout: an engine core that has work and finishes no step (SIGSTOP stands in for a hang) turns
/health 503, its requests end with an error in OpenAI's shape instead of hanging, and new requests go to the other
cores; with one core, new requests get a 503 at once. Once the core steps again (SIGCONT), all is as before.

The bound is short here (3 s); every wait is generous, and nothing asserts how long anything took."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import openai
import pytest

from pagegate.testing.launcher import ServerProcess, alive, core_pids, wait_for
from tests.gateway.conftest import metric_value
from tests.gateway.server_args import server_args

STEP_TIMEOUT_S = 3
WAIT_S = 90.0  # generous: a loaded machine is slow, but a hang never ends on its own
SHARED = "A long prefix that every request of this test starts with, so that the router likes core 0. " * 3


def _server(*extra: str) -> ServerProcess:
    return ServerProcess(server_args("--num-kv-blocks", "128", "--engine-step-timeout", str(STEP_TIMEOUT_S),
                                     *extra)).start()


@contextmanager
def _stopped(pid: int) -> Iterator[None]:
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        if alive(pid):
            os.kill(pid, signal.SIGCONT)


def _open_stream(http: httpx.Client, prompt: str) -> tuple[Any, Iterator[str]]:
    """A long streamed completion, once its first token has arrived."""
    body = {"prompt": prompt, "max_tokens": 1500, "ignore_eos": True, "stream": True}
    context = http.stream("POST", "/v1/completions", json=body)
    response = context.__enter__()
    assert response.status_code == 200, response.read()
    lines = response.iter_lines()
    assert next(line for line in lines if line.startswith("data: {")), "no first chunk"
    return context, lines


def _health(server: ServerProcess) -> httpx.Response:
    return httpx.get(server.base_url + "/health", timeout=10)


def _wait_health(server: ServerProcess, status: int) -> dict:
    last: list[httpx.Response] = []

    def answers() -> bool:
        last[:] = [_health(server)]
        return last[0].status_code == status

    wait_for(answers, f"/health to answer {status}", WAIT_S)
    return last[0].json()


def _assert_stalled_error(lines: Iterator[str]) -> None:
    """The rest of a stream on the hung core: it ends, with an error chunk in OpenAI's shape."""
    rest = list(lines)
    errors = [line for line in rest if '"error"' in line]
    assert errors and '"code":"engine_stalled"' in errors[-1].replace(" ", ""), rest[-3:]
    assert '"type":"server_error"' in errors[-1].replace(" ", ""), errors[-1]


def _wait_pages_free(server: ServerProcess) -> float | None:
    used: list[float | None] = []

    def free() -> bool:
        used[:] = [metric_value(httpx.get(server.base_url + "/metrics", timeout=10).text, "pagegate:kv_blocks_used")]
        return not used[0]

    wait_for(free, "every KV page to be free", WAIT_S)
    return used[0]


def _running_on(metrics: str) -> list[float]:
    """Requests running on core 0 and core 1 (the gateway labels each core's samples engine="<index>")."""
    running = [0.0, 0.0]
    for line in metrics.splitlines():
        if line.startswith("vllm:num_requests_running{"):
            running[int(line.split('engine="', 1)[1].split('"', 1)[0])] += float(line.rsplit(" ", 1)[1])
    return running


def _wait_admitted(server: ServerProcess, count: int) -> None:
    wait_for(lambda: _health(server).json().get("admitted") == count, f"{count} requests admitted", WAIT_S, 0.02)


def test_a_hung_core_is_routed_around_and_its_requests_fail() -> None:
    server = _server("--data-parallel-size", "2")
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=WAIT_S)
    try:
        assert server.process is not None
        cores = sorted(core_pids(server.process.pid))  # started in order: core 0 first
        with httpx.Client(base_url=server.base_url, timeout=WAIT_S) as http:
            context, lines = _open_stream(http, SHARED + "Streamed.")  # idle cores tie: core 0
            assert _running_on(http.get("/metrics").text) == [1.0, 0.0]
            held: dict[str, Any] = {}
            same_prefix = threading.Thread(target=_create, args=(client, SHARED + "Not streamed.", held), daemon=True)
            same_prefix.start()  # its prefix hit sends it to core 0 too
            _wait_admitted(server, 2)
            with _stopped(cores[0]):
                _assert_stalled_error(lines)
                context.__exit__(None, None, None)
                same_prefix.join(WAIT_S)
                error = held.get("error")
                assert isinstance(error, openai.APIStatusError) and error.status_code == 503, held
                assert error.body["code"] == "engine_stalled", error.body  # type: ignore[index]
                report = _wait_health(server, 503)
                assert report["status"] == "stalled" and "engine core 0" in report["reason"], report
                for prompt in (SHARED + "Routed around.", "Something else entirely."):
                    answer = client.completions.create(model="pagegate-default", prompt=prompt, max_tokens=4,
                                                       extra_body={"ignore_eos": True})
                    assert answer.usage.completion_tokens == 4  # core 1 served it: core 0 is passed over
            assert _wait_health(server, 200)["status"] == "ok"
            answer = client.completions.create(model="pagegate-default", prompt=SHARED, max_tokens=2)
            assert answer.choices[0].finish_reason in ("length", "stop")
            assert _wait_pages_free(server) == 0  # the hung core freed its aborted requests' pages once it stepped
        assert "engine core 0 has had work and finished no step" in server.log()
    finally:
        code = server.stop()
    assert code == 0, server.log()[-3000:]


def _create(client: openai.OpenAI, prompt: str, into: dict[str, Any]) -> None:
    try:
        into["answer"] = client.completions.create(model="pagegate-default", prompt=prompt, max_tokens=1500,
                                                   extra_body={"ignore_eos": True})
    except Exception as exc:
        into["error"] = exc


def test_with_one_hung_core_the_server_is_unhealthy_and_refuses_at_once() -> None:
    server = _server()
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=WAIT_S)
    try:
        assert server.process is not None
        [core] = core_pids(server.process.pid)
        with httpx.Client(base_url=server.base_url, timeout=WAIT_S) as http:
            context, lines = _open_stream(http, "Once upon a time")
            with _stopped(core):
                _assert_stalled_error(lines)
                context.__exit__(None, None, None)
                report = _wait_health(server, 503)
                assert report["status"] == "stalled", report
                with pytest.raises(openai.APIStatusError) as refused:  # answered at once, not held
                    client.completions.create(model="pagegate-default", prompt="Hello", max_tokens=2)
                assert refused.value.status_code == 503
                assert refused.value.body["code"] == "engine_stalled"  # type: ignore[index]
                assert refused.value.response.headers["retry-after"] == "1"
            assert _wait_health(server, 200)["status"] == "ok"
            answer = client.completions.create(model="pagegate-default", prompt="Hello", max_tokens=2)
            assert answer.usage.completion_tokens >= 1
            assert _wait_pages_free(server) == 0
    finally:
        code = server.stop()
    assert code == 0, server.log()[-3000:]
