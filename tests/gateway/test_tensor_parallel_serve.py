"""`pagegate serve -tp 2` as a user runs it: the OpenAI SDK, SIGTERM, and a worker that dies."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import httpx
import openai

from pagegate.testing.launcher import ServerProcess, descendants, wait_for, wait_gone

ARGS = ["--tensor-parallel-size", "2", "--device", "cpu", "--grpc-port", "0", "--kv-cache-memory", "64MiB",
        "--distributed-timeout", "20", "--disable-uvicorn-access-log"]


def test_sdk_through_two_ranks_and_sigterm_leaves_nothing() -> None:
    server = ServerProcess(ARGS).start()
    try:
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=60)
        text = client.completions.create(model="pagegate-default", prompt="In the beginning", max_tokens=8,
                                         temperature=0).choices[0].text
        stream = client.chat.completions.create(model="pagegate-default", max_tokens=8, temperature=0, stream=True,
                                                messages=[{"role": "user", "content": "Hello"}])
        assert text and "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        assert "2 rank(s)" in server.log()
        workers = descendants(server.process.pid)  # the engine core (rank 0) and the rank-1 worker below it
        assert len(workers) >= 2
    finally:
        code = server.stop()
    assert code == 0, server.log()
    assert wait_gone(workers, 10) == []


def test_a_dead_worker_fails_health_and_the_server_exits_non_zero() -> None:
    server = ServerProcess(ARGS).start()
    try:
        workers = descendants(server.process.pid)
        worker = next(pid for pid in workers
                      if "spawn_main" in Path(f"/proc/{pid}/cmdline").read_text(errors="replace"))
        os.kill(worker, signal.SIGKILL)
        def unhealthy() -> bool:
            try:
                return httpx.get(server.base_url + "/health", timeout=10).status_code != 200
            except httpx.HTTPError:
                return True  # the server is gone already (it may exit before /health is ever asked)

        wait_for(unhealthy, "/health to fail after a worker died", timeout_s=60, poll_s=0.2)
        server.process.wait(30)
        assert server.process.returncode not in (0, None), server.log()
        assert "exited with code" in server.log()
        assert wait_gone(workers, 10) == [], "a process of the dead engine outlived the server"
    finally:
        server.stop()
