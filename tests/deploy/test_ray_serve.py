"""Two pagegate replicas on a real local Ray cluster, reached with the OpenAI SDK through Serve's HTTP proxy.

One module-wide cluster (`ray.init(num_cpus=2)`, a replica per CPU, the embedded model), about 30-60 s here.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator

import httpx
import msgpack
import openai
import pytest

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")

from pagegate.deploy.ray import REPLICA_HEADER, PagegateArgs, build, replica_stats  # noqa: E402
from pagegate.testing.launcher import wait_for  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.slow]

APP_NAME = "pagegate"
ENGINE_ARGS = ["--kv-cache-memory", "64MiB", "--grpc-port", "0", "--dtype", "float32", "--device", "cpu"]
MODEL = "pagegate-default"


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="module")
def client() -> Iterator[openai.OpenAI]:
    port = _free_port()
    ray.init(address="local", num_cpus=2, include_dashboard=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build(PagegateArgs(num_replicas=2, engine_args=ENGINE_ARGS)), name=APP_NAME, route_prefix="/")
        yield openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=60)
    finally:
        serve.shutdown()
        ray.shutdown()


def _hits() -> dict[str, int]:
    stats = replica_stats(APP_NAME)
    assert len(stats) == 2, stats
    return {s["replica_id"]: s["prefix_cache_hits"] for s in stats}


def _replicas_of(client: openai.OpenAI, prompts: list[str]) -> set[str]:
    served = set()
    for prompt in prompts:
        raw = client.completions.with_raw_response.create(model=MODEL, prompt=prompt, max_tokens=1)
        assert raw.parse().choices[0].finish_reason in ("length", "stop")
        served.add(raw.headers[REPLICA_HEADER])
    return served


def test_completions_and_streams_through_the_proxy(client: openai.OpenAI) -> None:
    raw = client.completions.with_raw_response.create(model=MODEL, prompt="In the beginning", max_tokens=8)
    completion = raw.parse()
    assert completion.choices[0].text and completion.usage and completion.usage.completion_tokens == 8
    assert raw.headers.get_list("x-request-id") == [completion.id.removeprefix("cmpl-")]  # one id, Serve's
    assert raw.headers[REPLICA_HEADER].startswith(f"SERVE_REPLICA::{APP_NAME}#PagegateServer#")

    stream = client.completions.create(model=MODEL, prompt="And God said", max_tokens=12, stream=True,
                                       extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices)
    assert chunks[-1].choices[0].finish_reason == "length"

    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hello"}],
                                          max_tokens=12, stream=True, stream_options={"include_usage": True})
    events = list(chat)
    assert "".join(e.choices[0].delta.content or "" for e in events if e.choices)
    assert events[-1].usage is not None and events[-1].usage.completion_tokens > 0

    assert [m.id for m in client.models.list()] == [MODEL]  # a request without a prompt is served too


def test_msgpack_through_the_proxy(client: openai.OpenAI) -> None:
    msgpack_type = {"content-type": "application/msgpack", "accept": "application/msgpack"}
    body = msgpack.packb({"model": MODEL, "prompt": "Hello", "max_tokens": 3})
    response = httpx.post(f"{client.base_url}completions", content=body, headers=msgpack_type, timeout=60)
    assert response.status_code == 200 and response.headers["content-type"] == "application/msgpack"
    assert msgpack.unpackb(response.content)["usage"]["completion_tokens"] == 3


def test_shared_prefixes_stay_on_one_replica(client: openai.OpenAI) -> None:
    first = "You are a careful assistant for a library of old maps. " * 24  # ~1,300 characters
    second = "System: answer in French, with the tone of a ship's log. " * 24
    before = _hits()

    served_first = _replicas_of(client, [f"{first}Question {i}: where?" for i in range(6)])
    after_first = _hits()
    served_second = _replicas_of(client, [f"{second}Entry {i}." for i in range(6)])
    after_second = _hits()
    print(f"prefix-cache hits per replica: before {before}, after the first prefix {after_first}, "
          f"after the second {after_second}")

    assert len(served_first) == 1 and len(served_second) == 1
    (a,) = served_first
    (b,) = served_second
    assert a != b  # the second prefix matches nothing: it goes to the replica that holds the fewest prompts
    assert after_first[a] - before[a] >= 5 * 200  # 5 repeats of a prefix of 200+ tokens, whole pages
    assert after_first[b] == before[b]
    assert after_second[b] - after_first[b] >= 5 * 200
    assert after_second[a] == after_first[a]


def test_client_leaving_a_stream_stops_its_generation(client: openai.OpenAI) -> None:
    """The generation stops short of its 1,500th token: the replicas' token counts say so, not a clock."""
    before = sum(s.get("generation_tokens", 0) for s in replica_stats(APP_NAME))
    stream = client.completions.create(model=MODEL, prompt="Tell me a long story", max_tokens=1500, stream=True,
                                       extra_body={"ignore_eos": True})
    next(iter(stream))
    stream.close()
    wait_for(lambda: not any(s.get("running") for s in replica_stats(APP_NAME)), "the generation to stop",
             timeout_s=120, poll_s=0.05)
    assert sum(s.get("generation_tokens", 0) for s in replica_stats(APP_NAME)) - before < 1500
