"""The engine's KV pool through Engine's one-line calls: a sleep frees the pages and refuses requests until a wake
(answers unchanged), a resize brings the pool back another size (or is refused before anything is freed), a wake's
scheduler is a fresh one, and LoRA adapters come in and go out by name, their pages with them."""

import json
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
from prometheus_client import generate_latest

import pagegate
from pagegate import SamplingParams
from pagegate.config import CacheConfig, EngineConfig, LoRAConfig, SchedulerConfig
from pagegate.engine.engine import Engine
from pagegate.engine.errors import InvalidParamError
from pagegate.engine.sequence import Request
from pagegate.testing.lora import lora_tensors, write_adapter

MODEL = str(Path(pagegate.__file__).parent / "engine" / "default_model")
_CONFIG = json.loads((Path(MODEL) / "config.json").read_text())
SHAPES = {"q_proj": (_CONFIG["hidden_size"], _CONFIG["num_attention_heads"] * _CONFIG["head_dim"])}
PAGES = 32
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
PROMPT = list(range(5, 45))


def engine_config() -> EngineConfig:
    cache = CacheConfig(block_size=16, num_kv_blocks=PAGES, kv_cache_dtype="float32")
    return EngineConfig(model=MODEL, device="cpu", dtype="float32", cache=cache,
                        scheduler=SchedulerConfig(max_model_len=128))


@pytest.fixture
def engine() -> Iterator[Engine]:
    engine = Engine(engine_config())
    yield engine
    engine.close()


def run(engine: Engine, request: Request) -> list[int]:
    engine.add(request)
    while engine.has_unfinished():
        engine.step()
    assert request.error is None, request.error
    return request.seqs[0].output_token_ids


def greedy(engine: Engine, request_id: str) -> list[int]:
    return run(engine, engine.intake.make_request(request_id, PROMPT, GREEDY))


def test_a_sleep_frees_the_pages_and_a_wake_answers_as_before(engine: Engine) -> None:
    before, slept_scheduler = greedy(engine, "before"), engine.scheduler
    engine.sleep()
    assert engine.memory.asleep and not hasattr(engine.runner, "kv_cache")  # the pages' memory is gone
    with pytest.raises(RuntimeError, match="asleep"):
        engine.add_request("asleep", PROMPT, GREEDY)
    assert not engine.has_unfinished()
    engine.sleep()  # asleep already: nothing to do
    assert engine.wake_up() == PAGES and not engine.memory.asleep
    assert engine.scheduler is not slept_scheduler and engine.stats().used_blocks == 0
    assert greedy(engine, "after") == before
    assert engine.wake_up() == PAGES  # awake already: nothing to do


def test_an_engine_with_requests_running_cannot_sleep(engine: Engine) -> None:
    engine.add_request("running", PROMPT, GREEDY)
    engine.step()
    with pytest.raises(RuntimeError, match="requests running"):
        engine.sleep()
    assert not engine.memory.asleep
    while engine.has_unfinished():
        engine.step()
    engine.sleep()
    assert engine.memory.asleep


def test_a_resize_brings_the_pool_back_another_size(engine: Engine) -> None:
    page = engine.runner.kv_cache.page_bytes
    before = greedy(engine, "before")
    assert engine.resize(48 * page) == 48
    assert engine.runner.num_blocks == engine.scheduler.pool.num_blocks == engine.stats().num_blocks == 48
    assert 'num_gpu_blocks="48"' in generate_latest(engine.metrics.registry).decode()
    assert greedy(engine, "after") == before
    with pytest.raises(ValueError, match="max_model_len=128"):  # 128 tokens need 8 pages of 16
        engine.resize(4 * page)
    assert not engine.memory.asleep and engine.scheduler.pool.num_blocks == 48  # refused before anything was freed


@pytest.fixture(scope="module")
def adapter(tmp_path_factory: pytest.TempPathFactory) -> str:
    config = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}
    return str(write_adapter(tmp_path_factory.mktemp("lora"), lora_tensors(SHAPES, _CONFIG["num_hidden_layers"], 4, 1, 0.3), config))


def test_adapters_come_in_and_go_out_by_name_and_their_pages_with_them(adapter: str) -> None:
    engine = Engine(replace(engine_config(), lora=LoRAConfig(max_lora_rank=8)))
    try:
        base = greedy(engine, "base")
        assert engine.load_adapter("q", adapter) == 1
        assert engine.load_adapter("q", adapter) == 1  # the same again (a retried load): the one there
        adapted = run(engine, engine.intake.make_request("q", PROMPT, GREEDY, lora=engine.memory.adapter("q")))
        assert adapted != base and engine.stats().used_blocks > 0  # an idle adapter keeps its pages
        waiting = engine.intake.make_request("waiting", PROMPT, GREEDY, lora=engine.memory.adapter("q"))
        engine.add(waiting)
        with pytest.raises(ValueError, match="waiting"):  # never broken under a request
            engine.unload_adapter("q")
        run(engine, engine.intake.make_request("done", [5], GREEDY))
        engine.unload_adapter("q")
        assert engine.stats().used_blocks == 0
        with pytest.raises(InvalidParamError) as unknown:
            engine.unload_adapter("q")
        assert unknown.value.code == "model_not_found"
    finally:
        engine.close()


def test_an_engine_without_adapters_says_how_to_get_them(engine: Engine, adapter: str) -> None:
    with pytest.raises(ValueError, match="--enable-lora"):
        engine.load_adapter("q", adapter)
    assert not engine.memory.serves_adapters
