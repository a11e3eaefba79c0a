"""AsyncEngine, a client of an engine-core process: streaming, abort frees pages within a step, snapshots and
metrics from the core, a killed core fails every open stream and reports unhealthy, and no process outlives it."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from collections.abc import Coroutine, Iterator
from typing import Any, TypeVar

import numpy as np
import pytest

from pagegate import SamplingParams
from pagegate.config import CacheConfig, EngineConfig
from pagegate.engine.errors import EngineDeadError
from pagegate.engine.outputs import RequestOutput
from pagegate.engine.serving.async_engine import AsyncEngine
from pagegate.testing.launcher import core_pids, wait_gone
from tests.engine.serving.loops import end_loop

LONG = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
T = TypeVar("T")


class Running:
    """One engine and the event loop it was started on (a client belongs to one loop)."""

    def __init__(self, config: EngineConfig) -> None:
        self.loop = asyncio.new_event_loop()
        self.engine = self.run(AsyncEngine.start(config))

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return self.loop.run_until_complete(coro)

    def close(self) -> None:
        """Shut the engine down, then end what is left on the loop (as asyncio.run does)."""
        self.run(self.engine.shutdown())
        end_loop(self.loop)


def tiny_config(model: object, **kwargs: Any) -> EngineConfig:
    return EngineConfig(str(model), device="cpu", cache=CacheConfig(num_kv_blocks=64), **kwargs)


@pytest.fixture(scope="module")
def running(llama_model) -> Iterator[Running]:
    running = Running(tiny_config(llama_model.path))
    yield running
    running.close()


async def collect(engine: AsyncEngine, prompt: list[int], params: SamplingParams, request_id: str) -> list[RequestOutput]:
    return [output async for output in engine.generate(prompt, params, request_id)]


def test_concurrent_streams_each_finish_and_every_output_kept_is_the_answer_so_far(running: Running) -> None:
    engine = running.engine

    async def main() -> list[list[RequestOutput]]:
        return await asyncio.gather(*(collect(engine, [3 + i] * (4 + i), SamplingParams(
            temperature=0, max_tokens=5 + i, ignore_eos=True), f"r{i}") for i in range(6)))

    for i, outputs in enumerate(running.run(main())):
        lengths = [len(o.outputs[0].token_ids) for o in outputs]
        assert lengths == sorted(set(lengths)) and lengths[-1] == 5 + i  # cumulative, each output its own
        final = outputs[-1].outputs[0].token_ids
        assert all(o.outputs[0].token_ids == final[:len(o.outputs[0].token_ids)] for o in outputs)
        assert outputs[-1].finished and not any(o.finished for o in outputs[:-1])
    assert engine.stats().used_blocks == 0 and engine.health().engine_running


def test_leaving_a_stream_aborts_and_frees_its_pages_within_a_step(running: Running) -> None:
    engine = running.engine

    async def main() -> bool:
        async for out in engine.generate([5] * 40, LONG, "leaver"):
            if len(out.outputs[0].token_ids) >= 3:
                assert engine.stats().used_blocks > 0
                break  # leaving the loop closes the stream: the abort goes out now
        for _ in range(100):  # the core frees the pages before its next step and sends its counts
            if engine.stats().used_blocks == 0:
                return True
            await asyncio.sleep(0.01)
        return False

    assert running.run(main())
    assert engine.stats().requests == 0
    running.run(collect(engine, [5] * 4, SamplingParams(max_tokens=2), "leaver"))  # its id is free again


def test_n_choices_share_the_prompt_pages(running: Running) -> None:
    params = SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=4, ignore_eos=True)
    final = running.run(collect(running.engine, [7] * 40, params, "n3"))[-1]
    assert [c.index for c in final.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 4 and c.finish_reason == "length" for c in final.outputs)


def test_metrics_and_identity_come_from_the_core(running: Running) -> None:
    engine = running.engine
    metrics = running.run(engine.metrics_text()).decode()
    assert "vllm:generation_tokens_total" in metrics
    assert engine.max_model_len > 0 and engine.model_name and engine.is_running


def test_the_caller_never_imports_torch() -> None:
    """The engine and its OpenMP team live in the core process only."""
    code = ("import sys; from pagegate import AsyncEngine; "
            "print(sorted(m for m in ('torch', 'pagegate.engine.engine') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"


def test_a_killed_core_fails_every_open_stream_and_reports_unhealthy(llama_model) -> None:
    others = set(core_pids(os.getpid()))  # the module's engine
    running = Running(tiny_config(llama_model.path))
    engine = running.engine
    [core] = set(core_pids(os.getpid())) - others

    async def main() -> list[BaseException | list[RequestOutput]]:
        streams = [asyncio.ensure_future(collect(engine, [3 + i] * 8, LONG, f"victim{i}")) for i in range(2)]
        while engine.stats().running < 2:  # both decoding
            await asyncio.sleep(0.01)
        os.kill(core, signal.SIGKILL)
        return await asyncio.wait_for(asyncio.gather(*streams, return_exceptions=True), 30)

    try:
        ends = running.run(main())
        assert all(isinstance(end, EngineDeadError) for end in ends), ends
        assert not engine.is_running and not engine.health().engine_running
        with pytest.raises(EngineDeadError):
            running.run(collect(engine, [3], LONG, "after"))
    finally:
        running.close()


def test_async_with_embeds_and_leaves_no_process_behind(llama_model) -> None:
    async def main() -> tuple[bytes, list[int]]:
        async with await AsyncEngine.start(tiny_config(llama_model.path, pooling="last")) as engine:
            return await engine.embed([4, 5, 6, 7], "e"), sorted(set(core_pids(os.getpid())) - others)

    others = set(core_pids(os.getpid()))  # the module's engine
    embedding, cores = asyncio.run(main())
    vector = np.frombuffer(embedding, dtype="<f4")
    assert vector.shape == (64,) and abs(float(np.linalg.norm(vector)) - 1.0) < 1e-4  # unit length
    assert len(cores) == 1 and wait_gone(cores) == []
