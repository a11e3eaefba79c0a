"""The engine core in its own process, against real `pagegate serve`s: the gateway never maps torch, KV events and
metrics cross the seam, --data-parallel-size routes by prefix then by load, a killed core ends every open stream
with an error and the server with a non-zero exit, and SIGTERM leaves no process behind."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import httpx
import openai
import zmq

from pagegate.testing.kv_index import PageIndex
from pagegate.testing.launcher import ServerProcess, core_pids, descendants, free_port, wait_for, wait_gone
from tests.gateway.conftest import metric_value
from tests.gateway.server_args import server_args

TOPIC = "kv@test@core"
DEADLINE_S = 60.0


def mapped_libraries(pid: int) -> str:
    return Path(f"/proc/{pid}/maps").read_text()


def engine_sample(text: str, name: str, engine: int) -> float:
    """One core's value of a metric under --data-parallel-size (the gateway labels each core's samples)."""
    for line in text.splitlines():
        if line.startswith(name + "{") and f'engine="{engine}"' in line:
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no {name} for engine {engine} in /metrics")


def test_one_core_serves_kv_events_and_metrics_and_sigterm_leaves_nothing() -> None:
    context = zmq.Context()
    subscriber = context.socket(zmq.SUB)
    port = free_port()
    subscriber.bind(f"tcp://127.0.0.1:{port}")
    subscriber.setsockopt(zmq.SUBSCRIBE, TOPIC.encode())
    events = ('{"enable_kv_cache_events": true, "publisher": "zmq", '
              f'"endpoint": "tcp://127.0.0.1:{port}", "topic": "{TOPIC}"}}')
    server = ServerProcess(server_args("--num-kv-blocks", "128", "--kv-events-config", events)).start()
    try:
        [core] = core_pids(server.process.pid)
        assert "libtorch_cpu" in mapped_libraries(core)
        gateway_maps = mapped_libraries(server.process.pid)
        assert "libtorch" not in gateway_maps and "libgomp" not in gateway_maps  # no OpenMP team of its own
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=DEADLINE_S)
        index, prompts = PageIndex(), []

        def published() -> bool:  # PUB/SUB drops what is sent before it connects: send until an event arrives
            # new pages each time: a cached prompt would store (and publish) nothing
            prompts.append(f"Attempt {len(prompts) + 1}: the pages of the cache are shared between requests that "
                           "begin alike. " * 3)
            client.completions.create(model="pagegate-default", prompt=prompts[-1], max_tokens=2)
            while subscriber.poll(300):
                _, _, payload = subscriber.recv_multipart()
                index.apply(payload)
            return bool(index.pages)

        wait_for(published, "a KV event at the subscriber", DEADLINE_S, poll_s=0)
        prompt = prompts[-1]
        second = client.completions.create(model="pagegate-default", prompt=prompt, max_tokens=2)
        assert second.usage.prompt_tokens_details.cached_tokens > 0
        metrics = httpx.get(server.base_url + "/metrics").text
        assert (metric_value(metrics, "vllm:prefix_cache_hits_total") or 0) > 0  # counted in the core
        assert metric_value(metrics, "pagegate:kv_blocks_used") == 0
        below = descendants(server.process.pid)
    finally:
        code = server.stop()
        context.destroy(linger=0)
    assert code == 0, server.log()[-3000:]
    assert wait_gone(below) == []


def test_two_cores_route_by_prefix_then_load_and_a_killed_one_ends_the_server() -> None:
    replicas = ServerProcess(server_args("--num-kv-blocks", "128", "--data-parallel-size", "2")).start()
    try:
        cores = core_pids(replicas.process.pid)
        assert len(cores) == 2
        if len(os.sched_getaffinity(0)) >= 2:  # each core pinned to its own share of the CPUs
            assert not os.sched_getaffinity(cores[0]) & os.sched_getaffinity(cores[1])
        check_routing(replicas, cores)
        check_killed_core(replicas, cores[0])
    finally:
        replicas.stop()


def check_routing(replicas: ServerProcess, cores: list[int]) -> None:
    client = openai.OpenAI(base_url=replicas.base_url + "/v1", api_key="unused", max_retries=0, timeout=DEADLINE_S)
    shared = "A long system prompt that every turn of this conversation starts with, word for word. " * 4
    client.completions.create(model="pagegate-default", prompt=shared + "First turn.", max_tokens=2)
    client.completions.create(model="pagegate-default", prompt=shared + "Second turn.", max_tokens=2)
    metrics = httpx.get(replicas.base_url + "/metrics").text
    hits = [engine_sample(metrics, "vllm:prefix_cache_hits_total", i) for i in (0, 1)]
    assert hits[0] > 0 and hits[1] == 0, hits  # both turns ran on core 0, the second hit its prefix

    before = engine_sample(metrics, "vllm:generation_tokens_total", 1)
    os.kill(cores[0], signal.SIGSTOP)  # core 0 takes nothing in: what is routed to it stays on its way
    try:
        with httpx.Client(base_url=replicas.base_url, timeout=DEADLINE_S) as http, \
                http.stream("POST", "/v1/completions", json={"prompt": "Held on its way to the first core.",
                                                            "max_tokens": 4, "stream": True}) as held:
            assert held.status_code == 200  # routed (idle cores tie on load: core 0), its prompt's pages counted
            other = client.completions.create(model="pagegate-default", prompt="Something else entirely.",
                                              max_tokens=4, extra_body={"ignore_eos": True})
            assert other.usage.completion_tokens == 4
            os.kill(cores[0], signal.SIGCONT)
            assert any("[DONE]" in line for line in held.iter_lines())
    finally:
        os.kill(cores[0], signal.SIGCONT)
    after = engine_sample(httpx.get(replicas.base_url + "/metrics").text, "vllm:generation_tokens_total", 1)
    assert after - before == 4  # the core with pages coming passed over for the one with none


def check_killed_core(replicas: ServerProcess, core: int) -> None:
    below = descendants(replicas.process.pid)
    body = {"prompt": "Once upon a time", "max_tokens": 1500, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=replicas.base_url, timeout=DEADLINE_S) as http, \
            http.stream("POST", "/v1/completions", json=body) as stream:
        lines = stream.iter_lines()
        assert next(lines).startswith("data: {")
        os.kill(core, signal.SIGKILL)  # idle cores tie on load: a new prompt goes to core 0
        rest = list(lines)  # must end, never hang
    assert any('"error"' in line for line in rest), rest[-5:]
    try:
        health = httpx.get(replicas.base_url + "/health", timeout=5).status_code
    except httpx.HTTPError:
        health = 0  # already gone: the server exits as soon as it sees the core die
    assert health != 200
    replicas.process.wait(DEADLINE_S)
    assert replicas.process.returncode not in (0, None)
    assert "exited with code" in replicas.log()
    assert wait_gone(below) == []
