"""Two engines' elastic pools over one ledger, as two models' cores of one server hold them: a busy pool takes what
the idle one leaves, and keeps to its fair share once the other wants pages too."""

from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client import generate_latest

import pagegate
from pagegate import SamplingParams
from pagegate.config import CacheConfig, EngineConfig, SchedulerConfig
from pagegate.engine.engine import Engine
from pagegate.engine.memory.elastic_pages import ElasticPages
from pagegate.engine.memory.page_ledger import ElasticSpec, PageLedger
from pagegate.engine.runner import ModelRunner

MODEL = str(Path(pagegate.__file__).parent / "engine" / "default_model")
BUDGET_PAGES, FLOOR_PAGES = 64, 8
PARAMS = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def page_bytes() -> int:
    engine = Engine(config(CacheConfig(block_size=16, num_kv_blocks=8)))
    try:
        assert isinstance(engine.runner, ModelRunner)
        return int(engine.runner.kv_cache.page_bytes)
    finally:
        engine.close()


@pytest.fixture
def ledger(page_bytes: int) -> Iterator[PageLedger]:
    ledger = PageLedger.create(BUDGET_PAGES * page_bytes, 2)
    yield ledger
    ledger.close()


def config(cache: CacheConfig) -> EngineConfig:
    return EngineConfig(model=MODEL, device="cpu", cache=cache, scheduler=SchedulerConfig(max_model_len=128))


def elastic_engine(ledger: PageLedger, entry: int, page_bytes: int) -> tuple[Engine, ElasticPages]:
    """An engine whose pool may use the ledger's whole budget, started at its floor (as a core starts)."""
    floor = FLOOR_PAGES * page_bytes
    assert ledger.take(entry, floor, floor) == floor
    spec = ElasticSpec(ledger.fileno(), entry, floor, floor, BUDGET_PAGES * page_bytes)
    engine = Engine(config(CacheConfig(block_size=16)), spec)
    pages = engine.memory.elastic
    assert pages is not None and pages.limit == pages.floor == FLOOR_PAGES
    assert engine.runner.num_blocks == BUDGET_PAGES  # allocated for the whole budget on CPU (elastic_config)
    return engine, pages


def step(engine: Engine, pages: ElasticPages) -> None:
    engine.step()
    engine.memory.rebalance(engine.has_unfinished())


def add(engine: Engine, name: str, count: int) -> None:
    for index in range(count):
        prompt = [2 + index, *range(3, 98)]  # distinct (no prefix shared): with the output, 8 pages each
        engine.add_request(f"{name}-{index}", prompt, PARAMS)


def test_a_busy_pool_takes_the_idle_ones_pages_then_keeps_to_its_fair_share(ledger: PageLedger,
                                                                            page_bytes: int) -> None:
    first, first_pages = elastic_engine(ledger, 0, page_bytes)
    second, second_pages = elastic_engine(ledger, 1, page_bytes)
    try:
        add(first, "first", 8)  # 64 pages wanted, 56 free (all but the other's floor): one is preempted and
        # runs again after the others, holding some of the pages it had (its prefix, cached)
        for _ in range(16):
            step(first, first_pages)
        assert first_pages.limit == BUDGET_PAGES - FLOOR_PAGES
        metrics = generate_latest(first.metrics.registry).decode()
        assert f'num_gpu_blocks="{first_pages.limit}"' in metrics  # vllm:cache_config_info follows an in-step grow
        assert ledger.free() == 0 and ledger.fair_share(0, 1.0) is None  # nobody else wants: uncontested

        add(second, "second", 8)  # it wants more than its floor: refused, the budget is contested
        step(second, second_pages)
        assert ledger.fair_share(0, 1.0) == BUDGET_PAGES * page_bytes // 2
        high = first_pages.limit
        while first.has_unfinished() and second_pages.limit <= FLOOR_PAGES:
            step(first, first_pages)  # free pages above its share and its highest page in use go back
            step(second, second_pages)
            assert first_pages.limit <= high
            high = first_pages.limit
        assert second_pages.limit > FLOOR_PAGES, "the second model got pages while the first still served"
        while first.has_unfinished() or second.has_unfinished():
            step(first, first_pages)
            step(second, second_pages)
            assert first_pages.limit + second_pages.limit <= BUDGET_PAGES
        assert ledger.held(0) + ledger.held(1) + ledger.free() == BUDGET_PAGES * page_bytes
    finally:
        first.close()
        second.close()


def test_an_elastic_pool_sleeps_back_into_the_ledger_and_wakes_at_its_floor(ledger: PageLedger,
                                                                           page_bytes: int) -> None:
    engine, pages = elastic_engine(ledger, 0, page_bytes)
    floor = FLOOR_PAGES * page_bytes
    try:
        assert engine.scheduler.grow_pool == pages.grow_now  # the policy grows the pool inside a step
        engine.sleep()
        assert ledger.held(0) == 0  # everything it held goes back
        assert ledger.take(0, floor, floor) == floor  # the gateway reserves a wake's pages first
        assert engine.wake_up() == FLOOR_PAGES and ledger.held(0) == floor
        assert engine.scheduler.grow_pool == pages.grow_now  # the fresh scheduler is built the same way
        assert ledger.take(0, floor, floor) == floor  # reserved for a wake that finds the pool awake
        assert engine.wake_up(floor) == FLOOR_PAGES and ledger.held(0) == floor  # so it goes back
        assert engine.resize(2 * floor) == 2 * FLOOR_PAGES and ledger.held(0) == 2 * floor  # in place, by the ledger
        assert engine.resize(floor) == FLOOR_PAGES and ledger.held(0) == floor
    finally:
        engine.close()
