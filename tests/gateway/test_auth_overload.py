"""A second server with API keys, a tiny queue and a low chunk rate: 401s in OpenAI's shape, 429 with
Retry-After, several tokens per streamed chunk."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import httpx
import openai
import pytest

from pagegate.testing.launcher import ServerProcess, cores_stopped, wait_for
from tests.gateway.server_args import server_args

KEYS = ["key-one", "key-two"]
AUTH = {"Authorization": f"Bearer {KEYS[0]}"}
ARGS = server_args("--num-kv-blocks", "128", "--max-num-seqs", "1", "--max-queue", "1", "--api-key", KEYS[0],
                   "--stream-chunk-rate", "20")


@pytest.fixture(scope="module")
def guarded():
    process = ServerProcess(ARGS, env={"PAGEGATE_API_KEY": KEYS[1]}).start()
    yield process
    assert process.stop() == 0, process.log()[-3000:]


def sdk(server: ServerProcess, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=key, max_retries=0)


def test_api_key_required_on_v1(guarded: ServerProcess) -> None:
    with pytest.raises(openai.AuthenticationError) as caught:
        sdk(guarded, "wrong").completions.create(model="x", prompt="hi", max_tokens=1)
    assert caught.value.body["code"] == "invalid_api_key"
    for key in KEYS:  # --api-key and $PAGEGATE_API_KEY both work
        assert sdk(guarded, key).models.list().data
    bare = httpx.post(guarded.base_url + "/v1/completions", json={"prompt": "hi"})
    assert bare.status_code == 401 and set(bare.json()["error"]) == {"message", "type", "param", "code"}
    assert httpx.post(guarded.base_url + "/tokenize", json={"prompt": "hi"}).status_code == 401


def test_without_an_admin_key_nobody_may_manage_the_server(guarded: ServerProcess) -> None:
    """--api-key and no --admin-api-key: every key reads the state, none changes it (pagegate.gateway.auth's NOTE)."""
    for key in KEYS:
        refused = httpx.post(guarded.base_url + "/sleep", headers={"Authorization": f"Bearer {key}"})
        assert refused.status_code == 403 and refused.json()["error"]["type"] == "permission_error"
        assert "no admin key" in refused.json()["error"]["message"]
        asleep = httpx.get(guarded.base_url + "/is_sleeping", headers={"Authorization": f"Bearer {key}"})
        assert asleep.status_code == 200 and asleep.json()["is_sleeping"] is False
    assert "no --admin-api-key: the management routes" in guarded.log()


def test_health_and_metrics_stay_open(guarded: ServerProcess) -> None:
    assert httpx.get(guarded.base_url + "/health").status_code == 200
    assert httpx.get(guarded.base_url + "/metrics").status_code == 200


@contextlib.contextmanager
def held_streams(server: ServerProcess, count: int) -> Iterator[None]:
    """Open `count` long streams (one runs, the rest wait: --max-num-seqs 1) and close them at the end."""
    body = {"prompt": "Once upon a time", "max_tokens": 1000, "ignore_eos": True, "stream": True}
    with contextlib.ExitStack() as stack:
        for _ in range(count):
            session = stack.enter_context(httpx.Client(base_url=server.base_url, headers=AUTH, timeout=60))
            stack.enter_context(session.stream("POST", "/v1/completions", json=body))
        wait_for(lambda: _pending(server) >= count - 1, "the held requests to queue", timeout_s=60, poll_s=0.05)
        yield


def _pending(server: ServerProcess) -> float:
    metrics = httpx.get(server.base_url + "/metrics").text
    line = next(x for x in metrics.splitlines() if x.startswith("pagegate:http_requests_pending "))
    return float(line.split()[1])


def test_overload_gets_429_and_health_still_answers(guarded: ServerProcess) -> None:
    # one running, one waiting = --max-queue; the core stopped meanwhile, so the running one cannot finish and let
    # the waiting one in, however fast the machine. /health answers while the core is stopped: it waits on nothing
    # the core must do (were it to, it would hang until the block ends, and its generous timeout fail it)
    with held_streams(guarded, 2), cores_stopped(guarded.process.pid):  # type: ignore[union-attr]
        health = httpx.get(guarded.base_url + "/health", timeout=60)
        refused = httpx.post(guarded.base_url + "/v1/completions", json={"prompt": "x"}, headers=AUTH)
        with pytest.raises(openai.RateLimitError) as caught:  # the SDK sees the same 429
            sdk(guarded, KEYS[0]).chat.completions.create(model=_model(guarded), max_tokens=1,
                                                          messages=[{"role": "user", "content": "x"}])
    assert health.status_code == 200
    assert refused.status_code == 429 and int(refused.headers["Retry-After"]) >= 1
    assert refused.json()["error"]["type"] == "rate_limit_error" and "waiting" in refused.json()["error"]["message"]
    assert caught.value.status_code == 429
    assert sdk(guarded, KEYS[0]).completions.create(model=_model(guarded), prompt="x", max_tokens=1).choices


def _model(server: ServerProcess) -> str:
    return httpx.get(server.base_url + "/v1/models", headers=AUTH).json()["data"][0]["id"]


def test_low_chunk_rate_batches_tokens_without_changing_text(guarded: ServerProcess) -> None:
    client = sdk(guarded, KEYS[0])
    args = dict(model=_model(guarded), prompt="In the beginning", max_tokens=60, temperature=0,
                extra_body={"ignore_eos": True})
    whole = client.completions.create(**args).choices[0].text
    started = time.monotonic()
    chunks = [c for c in client.completions.create(**args, stream=True) if c.choices]
    elapsed = time.monotonic() - started
    assert "".join(c.choices[0].text for c in chunks) == whole
    # One stream paced at 1/20 s sends at most 20 chunks a second (the first and the finishing one excepted),
    # however many tokens the engine makes meanwhile: several a chunk on a fast machine, one on a slow one.
    # NOTE: a bound from the time the stream took, not a fixed count, so the machine's speed cannot decide it.
    assert len(chunks) <= elapsed * 20 + 2, (len(chunks), elapsed)
    assert chunks[-1].choices[0].finish_reason == "length"


def test_queue_counts_sequences_not_requests(guarded: ServerProcess) -> None:
    """--max-num-seqs 1, --max-queue 1: an idle server takes two sequences (one runs, one waits), never more;
    n = 2 choices, which run together, could never run here at all."""
    def post(prompts: list[str], n: int = 1) -> httpx.Response:
        body = {"prompt": prompts, "n": n, "max_tokens": 1}
        return httpx.post(guarded.base_url + "/v1/completions", json=body, headers=AUTH, timeout=60)

    assert post(["a", "b"]).status_code == 200
    for prompts in (["a", "b", "c"], ["a"] * 600):
        refused = post(prompts)
        assert refused.status_code == 429, len(prompts)
        assert f"adds {len(prompts)}" in refused.json()["error"]["message"]
    too_many = post(["a"], n=2)
    assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "n"
