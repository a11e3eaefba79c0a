"""A model's lifecycle at its edges: /sleep, /wake_up and /is_sleeping on a one-model server (the shared server of
conftest.py: a request to the sleeping model wakes it, /health and /v1/models stay sensible), and the backoff after a
failed load (a model whose file is garbage is not loaded again by every request: 503 with Retry-After at once, the
window doubling per failure, reset by POST /models/load or a load that succeeds); a model that is not loaded cannot
be put to sleep or unloaded (409); the shared page budget's ledger has no name a cleaner could remove."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from pagegate.config import EngineConfig
from pagegate.gateway.model_slots import ModelSlot
from pagegate.testing.launcher import ServerProcess, core_pids, descendants

from .test_models import BASE_ARGS, DEFAULT_MODEL


def complete(client: openai.OpenAI, model: str) -> str:
    reply = client.completions.create(model=model, prompt="Hello", max_tokens=6, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert reply.usage is not None and reply.usage.completion_tokens == 6
    return reply.choices[0].text


# -- one model: sleep and wake ---------------------------------------------------------------------
def test_one_model_sleeps_and_its_next_request_wakes_it(client: openai.OpenAI, http: httpx.Client,
                                                        model: str) -> None:
    before = complete(client, model)
    slept = http.post("/sleep")  # no model named: the one there is
    assert slept.status_code == 200, slept.text
    assert slept.json()["state"] == "sleeping"
    assert http.get("/is_sleeping").json() == {"model": model, "is_sleeping": True}
    health = http.get("/health")
    assert health.status_code == 200 and health.json()["status"] == "ok" and health.json()["sleeping"] is True
    (card,) = [card for card in http.get("/v1/models").json()["data"] if card["id"] == model]
    assert card["state"] == "sleeping" and card["max_model_len"] is not None
    assert http.get(f"/v1/models/{model}").json() == card  # looked at, not woken
    assert complete(client, model) == before  # woken by the request: its pages again, the same answer
    assert http.get("/is_sleeping", params={"model": model}).json()["is_sleeping"] is False
    assert http.get("/health").json()["sleeping"] is False


def test_a_model_named_twice_or_not_by_name_is_a_400(http: httpx.Client, model: str) -> None:
    for params, body in (({}, {"model": 5}), ({"model": model}, {"model": "another"})):
        answer = http.post("/sleep", params=params, json=body)
        assert answer.status_code == 400 and answer.json()["error"]["param"] == "model", answer.text
    assert http.get("/is_sleeping").json()["is_sleeping"] is False  # nothing was put to sleep


def test_one_model_wakes_up_by_hand_and_checks_the_name(http: httpx.Client, model: str) -> None:
    assert http.post("/sleep", json={"model": model}).json()["state"] == "sleeping"
    woken = http.post("/wake_up", params={"model": model})
    assert woken.status_code == 200 and woken.json()["state"] == "loaded"
    unknown = http.post("/sleep", params={"model": "no-such-model"})
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"
    for route in ("/models/load", "/models/unload"):  # several models only
        refused = http.post(route, json={"model": model})
        assert refused.status_code == 400 and "serves one model" in refused.json()["error"]["message"]


# -- a failed load backs off -----------------------------------------------------------------------
def test_the_load_backoff_doubles_up_to_a_minute_and_is_forgotten() -> None:
    slot = ModelSlot(("m",), EngineConfig())
    windows = []
    for _ in range(8):
        slot.load_failed("the engine failed to start")
        windows.append(round(slot.backoff_left()))
    assert windows == [1, 2, 4, 8, 16, 32, 60, 60]
    slot.forget_failures()
    assert slot.backoff_left() == 0
    slot.load_failed("again")
    assert round(slot.backoff_left()) == 1


@pytest.fixture(scope="module")
def garbage_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("garbage") / "garbage.gguf"
    path.write_bytes(b"this is not a GGUF file\n" * 64)
    return path


@pytest.fixture(scope="module")
def flaky_link(garbage_gguf: Path) -> Path:
    """The `flaky` model's file: a link to the garbage file (a test may point it at a real model)."""
    link = garbage_gguf.parent / "flaky.gguf"
    link.symlink_to(garbage_gguf)
    return link


def point(link: Path, target: Path) -> None:
    link.unlink()
    link.symlink_to(target)


@pytest.fixture(scope="module")
def flaky_server(flaky_link: Path) -> Iterator[ServerProcess]:
    """The embedded model (`good`, loaded at start) and `flaky` (loaded on demand: it fails while its file is
    garbage)."""
    args = ["--model", DEFAULT_MODEL, "--model", str(flaky_link), "--served-model-name", "good", "flaky",
            "--max-model-len", "128", "--kv-cache-memory", "16MiB"]
    process = ServerProcess([*BASE_ARGS, *args]).start()
    yield process
    code = process.stop()
    assert code == 0, f"the server did not stop cleanly ({code}):\n{process.log()[-4000:]}"


@pytest.fixture(scope="module")
def flaky_http(flaky_server: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=flaky_server.base_url, timeout=120) as session:
        yield session


@pytest.fixture(scope="module")
def flaky_client(flaky_server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=flaky_server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def ask_flaky(http: httpx.Client) -> httpx.Response:
    return http.post("/v1/completions", json={"model": "flaky", "prompt": "Hello", "max_tokens": 2})


def loads_failed(server: ServerProcess) -> int:
    return server.log().count("cannot serve flaky")


def test_a_failed_load_is_not_tried_again_within_its_backoff(flaky_server: ServerProcess, flaky_http: httpx.Client,
                                                             flaky_client: openai.OpenAI) -> None:
    first = ask_flaky(flaky_http)  # the load is tried, and fails
    assert first.status_code == 503 and first.headers["retry-after"] == "1"
    assert first.json()["error"]["code"] == "model_unavailable" and "GGUF" in first.json()["error"]["message"]
    assert loads_failed(flaky_server) == 1
    with pytest.raises(openai.InternalServerError) as raised:  # within the backoff: refused, no load tried
        flaky_client.completions.create(model="flaky", prompt="Hello", max_tokens=2)
    assert loads_failed(flaky_server) == 1  # the log counts each load tried: still the one
    assert raised.value.status_code == 503 and raised.value.response.headers["retry-after"] == "1"
    assert "failed to start" in raised.value.message and "loaded again in 1 s" in raised.value.message
    card = {card["id"]: card for card in flaky_http.get("/v1/models").json()["data"]}["flaky"]
    assert card["state"] == "failed" and "GGUF" in card["reason"]
    assert complete(flaky_client, "good")  # the other model serves on
    time.sleep(1.0)  # the backoff is over: the next request tries again, and the backoff doubles
    second = ask_flaky(flaky_http)
    assert second.status_code == 503 and second.headers["retry-after"] == "2" and loads_failed(flaky_server) == 2
    forced = flaky_http.post("/models/load", json={"model": "flaky"})  # by hand: tried at once, the backoff reset
    assert forced.status_code == 503 and forced.headers["retry-after"] == "1" and loads_failed(flaky_server) == 3


def test_a_load_that_succeeds_forgets_the_backoff(flaky_server: ServerProcess, flaky_http: httpx.Client,
                                                  flaky_client: openai.OpenAI, flaky_link: Path,
                                                  garbage_gguf: Path, smollm2_gguf: Path) -> None:
    assert flaky_http.post("/models/load", json={"model": "flaky"}).status_code == 503  # one failure
    point(flaky_link, smollm2_gguf)  # the file is fixed
    time.sleep(1.0)
    assert complete(flaky_client, "flaky")  # loaded on its request once the backoff is over
    assert flaky_http.post("/models/unload", json={"model": "flaky"}).json()["state"] == "unloaded"
    point(flaky_link, garbage_gguf)
    again = ask_flaky(flaky_http)
    assert again.status_code == 503 and again.headers["retry-after"] == "1"  # the count started afresh


def test_a_model_that_is_not_loaded_cannot_sleep_nor_be_unloaded(flaky_http: httpx.Client) -> None:
    assert ask_flaky(flaky_http).status_code == 503  # its load fails (or failed): FAILED
    for route in ("/sleep", "/models/unload"):
        refused = flaky_http.post(route, json={"model": "flaky"})
        assert refused.status_code == 409, refused.text
        error = refused.json()["error"]
        assert error["code"] == "model_not_loaded" and error["param"] == "model" and "failed" in error["message"]
    card = {card["id"]: card for card in flaky_http.get("/v1/models").json()["data"]}["flaky"]
    assert card["state"] == "failed"  # an unload does not forget the failure


def ledger_files(pid: int) -> list[str]:
    """What the server's processes hold open of page ledgers: a path, or a memory file's name (`/memfd:...`)."""
    found = []
    for process in (pid, *descendants(pid)):
        for fd in Path(f"/proc/{process}/fd").iterdir() if Path(f"/proc/{process}/fd").is_dir() else ():
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if "pagegate-ledger" in target:
                found.append(target)
    return found


def test_a_load_needs_no_name_of_the_page_ledger(flaky_server: ServerProcess, flaky_http: httpx.Client,
                                                 flaky_client: openai.OpenAI) -> None:
    """systemd's RemoveIPC=yes and tmp cleaners remove files from /dev/shm while a server runs: every file of a
    page ledger the server's processes hold is removed, and a model still unloads, loads and serves."""
    assert flaky_server.process is not None
    pid = flaky_server.process.pid
    for held in ledger_files(pid):
        if held.startswith("/") and not held.startswith("/memfd:"):
            Path(held.removesuffix(" (deleted)")).unlink(missing_ok=True)
    assert flaky_http.post("/models/unload", json={"model": "good"}).json()["state"] == "unloaded"
    unloaded = flaky_http.post("/sleep", json={"model": "good"})  # not loaded: nothing to put to sleep
    assert unloaded.status_code == 409 and unloaded.json()["error"]["code"] == "model_not_loaded"
    loaded = flaky_http.post("/models/load", json={"model": "good"})
    assert loaded.status_code == 200 and loaded.json()["state"] == "loaded", loaded.text
    assert complete(flaky_client, "good")
    held = ledger_files(pid)
    assert held and all(name.startswith("/memfd:pagegate-ledger") for name in held), held  # no name on disk
    cores = set(core_pids(pid))
    assert any(name.startswith("/memfd:") for core in cores for name in ledger_files(core)), "no core holds it"
