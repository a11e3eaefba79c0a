"""AsyncEngine: streaming, abort frees pages within a step, a crashed loop fails everyone."""

import asyncio

import pytest

from pagegate import SamplingParams
from pagegate.config import CacheConfig, EngineConfig
from pagegate.engine.errors import EngineDeadError
from pagegate.engine.serving.async_engine import AsyncEngine

LONG = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)


@pytest.fixture
def engine(llama_model):
    engine = AsyncEngine(EngineConfig(str(llama_model.path), device="cpu", cache=CacheConfig(num_kv_blocks=64)))
    yield engine
    engine.shutdown()


def run(coro):
    return asyncio.run(coro)


def test_concurrent_streams_each_finish(engine):
    async def one(i: int) -> list:
        params = SamplingParams(temperature=0, max_tokens=5 + i, ignore_eos=True)
        return [o async for o in engine.generate([3 + i] * (4 + i), params, f"r{i}")]

    async def main():
        return await asyncio.gather(*(one(i) for i in range(6)))

    streams = run(main())
    for i, outputs in enumerate(streams):
        assert [len(o.outputs[0].token_ids) for o in outputs] == list(range(1, 6 + i))
        assert outputs[-1].finished and not any(o.finished for o in outputs[:-1])
    assert engine.stats().used_blocks == 0


def test_leaving_a_stream_aborts_and_frees_its_pages(engine):
    async def main():
        stream = engine.generate([5] * 40, LONG, "leaver")
        async for out in stream:
            if len(out.outputs[0].token_ids) == 3:
                assert engine.stats().used_blocks > 0
                break
        await stream.aclose()
        for _ in range(100):  # within one engine step
            if engine.stats().used_blocks == 0:
                return True
            await asyncio.sleep(0.01)
        return False

    assert run(main())
    assert engine.stats().requests == 0


def test_n_choices_share_the_prompt_pages(engine):
    async def main():
        params = SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=4, ignore_eos=True)
        return [o async for o in engine.generate([7] * 40, params, "n3")][-1]

    final = run(main())
    assert [c.index for c in final.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 4 and c.finish_reason == "length" for c in final.outputs)


def test_a_crashed_loop_fails_waiting_requests_and_reports_unhealthy(engine):
    async def main():
        runner = engine.engine.runner
        runner.kv_cache.layers, runner.native = [], None  # break the engine: the next forward raises
        with pytest.raises(EngineDeadError, match="crashed"):
            async for _ in engine.generate([3, 4, 5], LONG, "victim"):
                pass

    run(main())
    assert not engine.is_running and not engine.health().engine_running
    with pytest.raises(EngineDeadError):
        run(anext(engine.generate([3], LONG, "after")))
    assert engine.engine.stats().used_blocks == 0
