"""One server with --batch-dir and two API keys for the Files and Batch API tests, and the SDK calls they share."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from pagegate.testing.launcher import ServerProcess
from tests.gateway.server_args import server_args

KEY_A, KEY_B = "batch-key-a", "batch-key-b"
MAX_BYTES = 2 * 1024 * 1024  # --batch-max-bytes: room for every test's files, not for two 1.2 MiB uploads
ENDED = ("completed", "failed", "cancelled", "expired")


@pytest.fixture(scope="session")
def batch_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("batches")


@pytest.fixture(scope="session")
def batch_server(batch_dir: Path) -> Iterator[ServerProcess]:
    args = server_args("--num-kv-blocks", "256", "--max-num-seqs", "32", "--api-key", KEY_A, "--api-key", KEY_B,
                       "--batch-dir", str(batch_dir), "--batch-max-bytes", str(MAX_BYTES))
    process = ServerProcess(args).start()
    yield process
    code = process.stop()
    assert code == 0, f"the server did not stop cleanly ({code}):\n{process.log()[-4000:]}"


def sdk(server: ServerProcess, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=key, max_retries=0, timeout=60)


@pytest.fixture(scope="session")
def client_a(batch_server: ServerProcess) -> openai.OpenAI:
    return sdk(batch_server, KEY_A)


@pytest.fixture(scope="session")
def client_b(batch_server: ServerProcess) -> openai.OpenAI:
    return sdk(batch_server, KEY_B)


@pytest.fixture(scope="session")
def model_name(client_a: openai.OpenAI) -> str:
    return client_a.models.list().data[0].id


def jsonl(lines: list[Any]) -> bytes:
    """Requests as a JSONL file; a str is written as it is (a malformed line)."""
    return b"".join((line if isinstance(line, str) else json.dumps(line)).encode() + b"\n" for line in lines)


def requests(endpoint: str, bodies: list[dict[str, Any]], prefix: str = "r") -> list[dict[str, Any]]:
    return [{"custom_id": f"{prefix}{i}", "method": "POST", "url": endpoint, "body": body}
            for i, body in enumerate(bodies)]


def submit(client: openai.OpenAI, endpoint: str, lines: list[Any]) -> Any:
    """Upload `lines` and start a batch of them."""
    source = client.files.create(file=("input.jsonl", jsonl(lines)), purpose="batch")
    return client.batches.create(input_file_id=source.id, endpoint=endpoint,  # type: ignore[arg-type]
                                 completion_window="24h")


def wait_ended(client: openai.OpenAI, batch_id: str, timeout_s: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while (batch := client.batches.retrieve(batch_id)).status not in ENDED:
        assert time.monotonic() < deadline, f"batch {batch_id} still {batch.status}"
        time.sleep(0.05)
    return batch


def file_lines(client: openai.OpenAI, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    return [json.loads(line) for line in client.files.content(file_id).text.splitlines()]


def run(client: openai.OpenAI, endpoint: str, lines: list[Any]) -> tuple[Any, list[dict], list[dict]]:
    """Run a batch to its end: the batch, its output lines and its error lines."""
    batch = wait_ended(client, submit(client, endpoint, lines).id)
    return batch, file_lines(client, batch.output_file_id), file_lines(client, batch.error_file_id)
