"""The spare engine core of a server of several models, with real processes: a spare waits (imports done) under
its own name, a model's load takes it and a new one replaces it once the cores are idle, a dead spare is passed
over, the answers are those of a core started afresh, and nothing is left running when the server stops; a
one-model server keeps none."""

from __future__ import annotations

import asyncio
import os
import subprocess
import time
from pathlib import Path

import httpx

import pagegate
from pagegate.engine.serving.core_spawn import (
    CORE_PROCESS_NAME,
    SPARE_PROCESS_NAME,
    early_core,
    spawn_core,
    start_early_core,
)
from pagegate.engine.serving.spare_core import SPARE_IDLE_S, SpareCores
from pagegate.testing import launcher
from pagegate.testing.launcher import ServerProcess, alive, descendants, wait_for, wait_gone

DEFAULT_MODEL = str(Path(pagegate.__file__).parent / "engine" / "default_model")
BASE_ARGS = ["--dtype", "float32", "--device", "cpu", "--disable-uvicorn-access-log", "--grpc-port", "0",
             "--max-model-len", "128", "--kv-cache-memory", "32MiB"]
PROMPT_IDS = [5, 17, 42, 9, 33, 71]


def process_name(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def spares(server: ServerProcess) -> list[int]:
    """The server's waiting spare cores."""
    assert server.process is not None
    return [pid for pid in descendants(server.process.pid) if process_name(pid) == SPARE_PROCESS_NAME]


def serving_cores(server: ServerProcess) -> list[int]:
    """The server's engine cores that serve a model (a taken spare among them)."""
    assert server.process is not None
    return [pid for pid in descendants(server.process.pid) if process_name(pid) == CORE_PROCESS_NAME]


def greedy(http: httpx.Client, model: str) -> list[str]:
    """The greedy answer's tokens, as its logprobs name them."""
    body = {"model": model, "prompt": PROMPT_IDS, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
            "logprobs": 1}
    reply = http.post("/v1/completions", json=body)
    assert reply.status_code == 200, reply.text
    tokens = reply.json()["choices"][0]["logprobs"]["tokens"]
    assert len(tokens) == 8
    return [str(token) for token in tokens]


def test_a_spare_waits_under_its_name_and_exits_cleanly_when_let_go() -> None:
    core = spawn_core(spare=True)
    try:
        wait_for(lambda: process_name(core.process.pid) == SPARE_PROCESS_NAME, "the spare's imports")
        assert core.process.poll() is None
        assert core.process.stdin is not None
        core.process.stdin.close()  # no spec will come: it ends by itself
        assert core.process.wait(60) == 0
    finally:
        core.discard()


def test_a_discarded_spare_ends_at_once() -> None:
    core = spawn_core(spare=True)
    core.discard(timeout_s=10)
    assert not alive(core.process.pid)


class IdleCore:
    busy = False


def test_a_taken_spare_is_replaced_when_idle_a_dead_one_passed_over_and_close_ends_it() -> None:
    async def scenario() -> None:
        spares, core = SpareCores(), IdleCore()
        assert spares.take(core) is None  # none yet
        spares.keep_one()
        assert spares.spare is not None
        taken = spares.take(core)
        assert taken is not None and spares.spare is None
        taken.discard()
        await asyncio.sleep(SPARE_IDLE_S + 1.0)
        assert spares.spare is not None  # the cores are idle: a replacement
        dead = spares.spare.process
        dead.kill()
        dead.wait()
        assert spares.take(core) is None  # a spare that died is not handed out
        spares.keep_one()
        assert spares.spare is not None
        last = spares.spare.process
        await spares.close()
        assert spares.spare is None and not alive(last.pid)

    asyncio.run(scenario())


def test_a_load_takes_the_spare_and_a_new_one_replaces_it() -> None:
    args = [*BASE_ARGS, "--model", DEFAULT_MODEL, "--model", DEFAULT_MODEL, "--served-model-name", "first", "second",
            "--models-max", "1"]
    with ServerProcess(args) as server, httpx.Client(base_url=server.base_url, timeout=120) as http:
        wait_for(lambda: len(spares(server)) == 1, "a spare beside the first model")
        [spare] = spares(server)
        expected = greedy(http, "first")
        assert greedy(http, "second") == expected  # unloads `first`, loads `second` in the spare
        assert serving_cores(server) == [spare]  # renamed pagegate-core once taken
        wait_for(lambda: len(spares(server)) == 1, "a new spare once the cores are idle")
        [replacement] = spares(server)
        assert replacement != spare

        subprocess.run(["kill", "-KILL", str(replacement)], check=True)  # a spare that died is passed over
        wait_for(lambda: not alive(replacement), "the killed spare to go")
        assert greedy(http, "first") == expected
        wait_for(lambda: len(spares(server)) == 1, "a spare again")

        assert server.process is not None
        below = descendants(server.process.pid)
        assert server.stop() == 0
    assert wait_gone(below) == [], "processes left behind by the server"


def test_a_one_model_server_keeps_no_spare() -> None:
    with ServerProcess([*BASE_ARGS, "--model", DEFAULT_MODEL]) as server, \
            httpx.Client(base_url=server.base_url, timeout=120) as http:
        greedy(http, http.get("/v1/models").json()["data"][0]["id"])
        time.sleep(2.0)  # past the idle time after which a spare would be started
        assert len(serving_cores(server)) == 1 and spares(server) == []


def test_the_early_core_is_taken_once_and_one_not_taken_is_ended() -> None:
    cores = SpareCores()
    cores.early = spawn_core()
    taken = cores.take_early()
    assert taken is not None and taken.process.poll() is None
    assert cores.take_early() is None  # once
    taken.discard()
    cores.early = spawn_core()
    untaken = cores.early.process
    cores.drop_early()
    assert untaken.poll() is not None and cores.early is None


def test_the_core_started_before_the_gateway_imports_is_the_spare_cores_to_hand_out() -> None:
    """`pagegate serve` starts its first core with core_spawn alone (light to import); SpareCores, made once the
    gateway's app is imported, takes it over, once."""
    start_early_core(None)
    cores = SpareCores()
    try:
        assert cores.early is not None and cores.early.process.poll() is None
        assert early_core() is None and SpareCores().early is None
    finally:
        cores.drop_early()


def test_a_core_starts_one_blas_thread_unless_its_environment_says() -> None:
    """numpy's OpenBLAS threads spin at its import, on the CPU the gateway imports on: a core starts with one."""
    for env, threads in ((None, "1"), ({**os.environ, "OPENBLAS_NUM_THREADS": "3"}, "3")):
        core = spawn_core(env)
        environ = Path(f"/proc/{core.process.pid}/environ")
        try:  # empty until the exec has set the new image's up, a moment after Popen returns
            wait_for(lambda environ=environ: environ.read_bytes() != b"", "the core's exec")
            assert f"OPENBLAS_NUM_THREADS={threads}".encode() in environ.read_bytes().split(b"\0")
        finally:
            core.discard()


def test_a_server_serves_from_its_early_core_and_keeps_no_other() -> None:
    """`pagegate serve` starts a core before it imports its app and its one model's load takes it: one core serves,
    and no other process (an early core not taken) is left beside it."""
    with ServerProcess([*BASE_ARGS, "--model", DEFAULT_MODEL]) as server, \
            httpx.Client(base_url=server.base_url, timeout=120) as http:
        greedy(http, http.get("/v1/models").json()["data"][0]["id"])
        assert server.process is not None
        assert descendants(server.process.pid) == serving_cores(server) and len(serving_cores(server)) == 1


def test_the_launcher_knows_a_taken_spare_by_its_name() -> None:
    assert launcher.CORE_PROCESS_NAME == CORE_PROCESS_NAME  # core_pids counts taken spares by it
