"""One real server for the gateway tests: `python -m pagegate serve` on the embedded model, float32 CPU."""

from __future__ import annotations

from pathlib import Path

import httpx
import openai
import pytest

import pagegate
from pagegate.testing.launcher import ServerProcess, wait_for
from tests.gateway.server_args import server_args

DEFAULT_MODEL = str(Path(pagegate.__file__).parent / "engine" / "default_model")

SERVER_ARGS = server_args("--num-kv-blocks", "256", "--max-num-seqs", "32")


@pytest.fixture(scope="session")
def server():
    process = ServerProcess(SERVER_ARGS).start()
    yield process
    code = process.stop()
    assert code == 0, f"the server did not stop cleanly ({code}):\n{process.log()[-4000:]}"


@pytest.fixture(scope="session")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="session")
def http(server: ServerProcess):
    with httpx.Client(base_url=server.base_url, timeout=120) as session:
        yield session


@pytest.fixture(scope="session")
def model_card(http: httpx.Client) -> dict:
    return http.get("/v1/models").json()["data"][0]


@pytest.fixture(scope="session")
def model(model_card: dict) -> str:
    return model_card["id"]


PAGES_IN_USE = "pagegate:kv_blocks_used"  # the engine's gauge of KV pages held by requests
PAGES_PINNED = "pagegate:kv_blocks_pinned"  # ... and of those, the ones held for stored responses


def metric_value(text: str, name: str) -> float | None:
    """The sum over label sets of one metric in Prometheus text, or None when absent."""
    total, found = 0.0, False
    for line in text.splitlines():
        if line.startswith(name) and line[len(name):len(name) + 1] in (" ", "{"):
            total += float(line.rsplit(" ", 1)[1])
            found = True
    return total if found else None


class KVPages:
    """The KV pages in use, as the server's /metrics reports them."""

    def __init__(self, http: httpx.Client) -> None:
        self.http = http

    def in_use(self) -> float:
        """Pages held by requests: those in use less those that stored responses pin (which, with no request
        running, are all the pinned pages there are)."""
        text = self.http.get("/metrics").text
        value, pinned = metric_value(text, PAGES_IN_USE), metric_value(text, PAGES_PINNED)
        assert value is not None and pinned is not None, f"/metrics has no {PAGES_IN_USE} or {PAGES_PINNED}"
        return value - pinned

    def wait_free(self, timeout_s: float = 10.0) -> float:
        """Poll until no page is in use; returns that reading (AssertionError, from wait_for, after `timeout_s`)."""
        readings = [self.in_use()]

        def free() -> bool:
            readings.append(self.in_use())
            return readings[-1] <= 0

        wait_for(free, f"every KV page to be free (in use: {readings[-1]:g} at first)", timeout_s, poll_s=0.05)
        return readings[-1]


@pytest.fixture(scope="session")
def kv_pages(http: httpx.Client) -> KVPages:
    return KVPages(http)


@pytest.fixture(scope="module")
def adapter_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A rank-4 PEFT LoRA over the embedded model (random weights: what loads and what a card shows, not what
    it answers)."""
    peft = pytest.importorskip("peft")
    import torch
    from transformers import AutoModelForCausalLM

    from pagegate.testing.lora import save_random_adapter

    folder = tmp_path_factory.mktemp("adapter")
    base = AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL, dtype=torch.float32)
    save_random_adapter(base, folder, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"]), seed=1,
                        scale=0.2)
    return folder
