"""A call's error from the core, seen by the gateway: the same exception, with the same message, as the core's
"Type: message" text gave before it crossed typed."""

from __future__ import annotations

import asyncio

import pytest

from pagegate.engine.errors import InvalidParamError
from pagegate.engine.serving.core_client import CoreClient
from pagegate.engine.serving.frames import CallError, Reply


def client_answering(reply: Reply) -> CoreClient:
    client = CoreClient.__new__(CoreClient)  # no process: the core's answer is given

    async def ask(name, arg=None) -> Reply:
        return reply

    client._ask = ask
    return client


@pytest.mark.parametrize(("call", "error", "param", "code"), [
    ("unload", CallError("InvalidParamError", "no adapter 'x'"), "lora_name", "model_not_found"),
    ("unload", CallError("ValueError", "adapter 'x' is in use"), "lora_name", "adapter_busy"),
    ("load", CallError("ValueError", "rank 99 is over --max-lora-rank"), "lora_path", "invalid_value"),
])
def test_lora_call_errors_become_invalid_params(call, error, param, code) -> None:
    client = client_answering(Reply(0, error=error))
    call_it = client.unload_lora_adapter("x") if call == "unload" else client.load_lora_adapter("x", "/p")
    with pytest.raises(InvalidParamError) as raised:
        asyncio.run(call_it)
    assert (str(raised.value), raised.value.param, raised.value.code) == (error.message, param, code)


def test_other_call_errors_raise_the_cores_type_and_message() -> None:
    client = client_answering(Reply(0, error=CallError("OSError", "disk gone")))
    for call in (client.load_lora_adapter("x", "/p"), client.sleep(), client.wake_up(1 << 20)):
        with pytest.raises(RuntimeError) as raised:
            asyncio.run(call)
        assert type(raised.value) is RuntimeError and str(raised.value) == "OSError: disk gone"


def test_results_come_back_as_the_type_each_call_answers() -> None:
    assert asyncio.run(client_answering(Reply(0, 64)).wake_up()) == 64
    assert asyncio.run(client_answering(Reply(0, b"text")).metrics_text()) == b"text"
    assert asyncio.run(client_answering(Reply(0)).sleep()) is None
    with pytest.raises(RuntimeError, match="answered wake with bytes"):
        asyncio.run(client_answering(Reply(0, b"text")).wake_up())
