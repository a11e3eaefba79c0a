"""Pool snapshots for the dashboard: taken between steps, they agree with the engine's counts and say which
request holds which page, on the device and in the CPU swap pool."""

from __future__ import annotations

import asyncio

import numpy as np

from pagegate import LLM, SamplingParams
from pagegate.config import CacheConfig, EngineConfig
from pagegate.core.page_map import CACHED, MAX_REFCOUNT
from pagegate.engine.pool_snapshot import PoolSnapshot, take_snapshot
from pagegate.engine.serving.async_engine import AsyncEngine

from .test_llm import make_prompts


def assert_counts_agree(snapshot: PoolSnapshot) -> None:
    refcounts, stats = snapshot.device_states & MAX_REFCOUNT, snapshot.stats
    assert int((refcounts > 0).sum()) == stats.used_blocks
    assert int((refcounts > 1).sum()) == stats.shared_blocks
    assert int((snapshot.device_states == CACHED).sum()) == stats.cached_blocks
    assert int((snapshot.cpu_states > 0).sum()) == stats.cpu_used_blocks
    assert [len(snapshot.seq_pages[q]) for q in ("running", "waiting", "swapped")] == [
        stats.running, stats.waiting, stats.swapped]


def test_forked_request_holds_its_shared_pages(llama_model) -> None:
    engine = LLM(str(llama_model.path), device="cpu", num_kv_blocks=64).engine
    engine.add_request("forked", make_prompts()[7], SamplingParams(max_tokens=20, n=2, ignore_eos=True))
    engine.add_request("single", make_prompts()[3], SamplingParams(max_tokens=20, ignore_eos=True))
    for _ in range(3):
        engine.step()
    snapshot = take_snapshot(engine)
    assert_counts_agree(snapshot)
    running = {r.request_id: r for r in snapshot.queue("running")}
    assert running["forked"].seqs == 2 and running["single"].seqs == 1
    device, cpu = snapshot.pages_of("forked") or (None, None)
    assert device is not None and cpu is not None and len(cpu) == 0
    assert running["forked"].pages == len(device) == len(np.unique(device))
    shared = np.flatnonzero((snapshot.device_states & MAX_REFCOUNT) > 1)
    assert len(shared) > 0 and all(snapshot.holders_of(int(page)) == ["forked"] for page in shared)
    free_page = int(np.flatnonzero(snapshot.device_states == 0)[0])
    assert snapshot.holders_of(free_page) == [] and snapshot.pages_of("nobody") is None
    while engine.has_unfinished():
        engine.step()
    idle = take_snapshot(engine)
    assert_counts_agree(idle)
    assert idle.stats.used_blocks == 0 and idle.holders() == {} and idle.queue("running") == ()


def test_swapped_sequences_hold_cpu_pages(llama_model) -> None:
    llm = LLM(str(llama_model.path), device="cpu", num_kv_blocks=24, max_model_len=128, swap_space=0.002,
              preemption_mode="swap", enable_prefix_caching=False)
    engine = llm.engine
    for i in range(8):
        engine.add_request(f"r{i}", make_prompts()[i % 8][:30], SamplingParams(max_tokens=60, ignore_eos=True))
    snapshots = []
    while engine.has_unfinished():
        engine.step()
        snapshots.append(take_snapshot(engine))
    swapped = [s for s in snapshots if s.stats.swapped]
    assert swapped, "the pool was meant to overflow into the swap pool"
    for snapshot in swapped:
        assert_counts_agree(snapshot)
        for queued in snapshot.queue("swapped"):
            device, cpu = snapshot.pages_of(queued.request_id) or (None, None)
            assert cpu is not None and len(cpu) > 0
            assert snapshot.holders_of(int(cpu[0]), cpu=True) == [queued.request_id]


def test_async_engine_snapshots_between_steps_and_when_idle(llama_model) -> None:
    """Asked of the engine-core process, answered between two of its steps, and by an idle core too."""
    config = EngineConfig(str(llama_model.path), device="cpu", cache=CacheConfig(num_kv_blocks=64))

    async def main() -> tuple[PoolSnapshot, PoolSnapshot]:
        async with await AsyncEngine.start(config) as engine:
            params = SamplingParams(max_tokens=40, ignore_eos=True, n=2)
            stream = engine.generate(make_prompts()[7], params, "busy")
            await stream.__anext__()  # running now
            busy = await engine.pool_snapshot()
            async for _ in stream:
                pass
            return busy, await asyncio.wait_for(engine.pool_snapshot(), 5)  # the idle core wakes for it

    busy, idle = asyncio.run(main())
    assert busy.stats.used_blocks > 0 and busy.stats.shared_blocks > 0 and busy.queue("running")
    assert idle.stats.used_blocks == 0
    assert_counts_agree(busy)
