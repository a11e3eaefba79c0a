"""A real server for the client tests (same flags as the gateway tests)."""

from __future__ import annotations

import pytest

from pagegate.testing.launcher import ServerProcess
from tests.gateway.server_args import server_args

SERVER_ARGS = server_args("--num-kv-blocks", "256", "--api-key", "client-key")


@pytest.fixture(scope="session")
def server():
    process = ServerProcess(SERVER_ARGS).start()
    yield process
    assert process.stop() == 0, process.log()[-3000:]
