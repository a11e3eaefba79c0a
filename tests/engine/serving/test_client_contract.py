"""docs/CONTRACTS.md's engine section, clause by clause, held to each EngineClient against real engine-core
processes on the embedded model: `CoreClient` (one core) and `Replicas` (two data-parallel cores).
tests/test_contracts.py checks that the page names every member; this file checks that each does what it says."""

from __future__ import annotations

import asyncio
import json
import os
import re
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import msgspec
import numpy as np
import pytest

import pagegate
from pagegate import LLM, SamplingParams
from pagegate.config import CacheConfig, EngineConfig, LoRAConfig, SchedulerConfig
from pagegate.engine.errors import InvalidParamError
from pagegate.engine.loading.tokenizer import Tokenizer
from pagegate.engine.observe.stats import EngineHealth, EngineStats
from pagegate.engine.outputs import RequestOutput
from pagegate.engine.pool_snapshot import PoolSnapshot
from pagegate.engine.sampling.structured import StructuredOutputsParams
from pagegate.engine.serving.core_client import CoreClient
from pagegate.engine.serving.engine_client import EngineClient
from pagegate.engine.serving.replicas import Replicas, start_cores
from pagegate.testing.launcher import core_pids, wait_for, wait_gone
from tests.engine.serving.loops import end_loop

DEFAULT_MODEL = Path(pagegate.__file__).parent / "engine" / "default_model"
PAGES = 64  # each core's pool
CONFIG = EngineConfig(str(DEFAULT_MODEL), dtype="float32", device="cpu", pooling="last", lora=LoRAConfig(),
                      cache=CacheConfig(num_kv_blocks=PAGES), scheduler=SchedulerConfig(max_model_len=128))
PROMPT = "The page pool holds every sequence's keys and values in pages of sixteen tokens"
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=1)
LONG = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)  # with 24 prompt tokens: under 128
T = TypeVar("T")


class Serving:
    """One client and the event loop it was started on (a client belongs to one loop)."""

    def __init__(self, data_parallel_size: int) -> None:
        self.loop = asyncio.new_event_loop()
        self.client: CoreClient | Replicas = self.run(start_cores(CONFIG, data_parallel_size))
        self.cores = data_parallel_size

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return self.loop.run_until_complete(coro)

    def polled(self, condition: Callable[[EngineClient], bool]) -> Callable[[], bool]:
        """For wait_for: `condition` on the client after the loop has taken what the cores sent meanwhile."""
        def check() -> bool:
            self.run(asyncio.sleep(0.01))
            return condition(self.client)
        return check

    def close(self) -> None:
        self.run(self.client.shutdown())
        end_loop(self.loop)


@pytest.fixture(scope="module", params=[1, 2], ids=["CoreClient", "Replicas"])
def serving(request: pytest.FixtureRequest) -> Iterator[Serving]:
    others = set(core_pids(os.getpid()))
    serving = Serving(request.param)
    mine = sorted(set(core_pids(os.getpid())) - others)
    assert len(mine) == request.param
    yield serving
    serving.close()
    # `shutdown`: every engine process gone
    assert not serving.client.is_running and wait_gone(mine) == []


@pytest.fixture(scope="module")
def one_shot() -> RequestOutput:
    """The offline engine's whole answer to PROMPT, on the cores' config."""
    llm = LLM.from_config(CONFIG)
    [answer] = llm.generate([PROMPT], GREEDY, use_tqdm=False)
    return answer


def page_bytes(client: EngineClient) -> int:
    """One page's bytes, from `kv_pages` ("int8 pages, 1,056 bytes a token")."""
    match = re.search(r"([\d,]+) bytes a token", client.kv_pages)
    assert match is not None, client.kv_pages
    return int(match.group(1).replace(",", "")) * CONFIG.cache.block_size


async def collect(client: EngineClient, prompt: str | list[int], params: SamplingParams,
                  request_id: str) -> list[RequestOutput]:
    return [delta async for delta in client.generate(prompt, params, request_id)]


def test_the_attributes_are_there_with_their_types(serving: Serving) -> None:
    client = serving.client
    model_config = json.loads((DEFAULT_MODEL / "config.json").read_text())
    assert isinstance(client.model_name, str) and client.model_name
    assert isinstance(client.tokenizer, Tokenizer)
    assert type(client.max_model_len) is int and client.max_model_len == 128
    assert isinstance(client.kv_pages, str) and page_bytes(client) > 0
    assert type(client.vocab_size) is int and client.vocab_size == model_config["vocab_size"]
    assert isinstance(client.default_sampling, dict)
    assert all(isinstance(k, str) and isinstance(v, float) for k, v in client.default_sampling.items())
    assert client.on_dead is None or callable(client.on_dead)
    assert isinstance(type(client).is_running, property) and client.is_running is True


def test_generate_yields_deltas_that_add_joins_into_the_one_shot_answer(serving: Serving,
                                                                        one_shot: RequestOutput) -> None:
    client = serving.client
    deltas = serving.run(collect(client, PROMPT, GREEDY, "joined"))
    assert len(deltas) >= 2 and deltas[-1].finished and not any(d.finished for d in deltas[:-1])
    new_tokens = [len(d.outputs[0].token_ids) for d in deltas]
    assert sum(new_tokens) == GREEDY.max_tokens  # each delta only what is new
    joined = deltas[0]
    for delta in deltas[1:]:
        joined.add(delta)
    [answer], [expected] = joined.outputs, one_shot.outputs
    assert (answer.token_ids, answer.text, answer.finish_reason) == (expected.token_ids, expected.text, "length")
    assert answer.logprobs is not None and expected.logprobs is not None
    assert [lp.token_id for lp in answer.logprobs] == expected.token_ids
    np.testing.assert_allclose([lp.logprob for lp in answer.logprobs], [lp.logprob for lp in expected.logprobs],
                               atol=1e-4)
    assert joined.prompt_token_ids == one_shot.prompt_token_ids


def test_a_bad_request_raises_invalid_param_error_before_any_output(serving: Serving) -> None:
    client = serving.client
    outputs: list[RequestOutput] = []

    async def main() -> None:
        async for delta in client.generate([5, client.vocab_size + 7], GREEDY, "bad"):
            outputs.append(delta)

    with pytest.raises(InvalidParamError, match="out of range"):
        serving.run(main())
    assert outputs == []
    wait_for(serving.polled(lambda c: c.stats().requests == 0), "the bad request gone from the counts")
    assert len(serving.run(collect(client, [5, 6], SamplingParams(max_tokens=2), "bad"))) >= 1  # its id free


def test_leaving_the_loop_aborts_the_request_and_its_pages_come_free(serving: Serving) -> None:
    client = serving.client
    before = client.stats().generation_tokens

    async def leave() -> None:
        async for _ in client.generate([9] * 24, LONG, "leaver"):
            assert client.stats().used_blocks > 0
            break

    serving.run(leave())
    wait_for(serving.polled(lambda c: c.stats().used_blocks == 0 and c.stats().requests == 0),
             "the abandoned request's pages free")
    assert client.stats().generation_tokens - before < LONG.max_tokens  # it stopped: aborted, not finished
    assert len(serving.run(collect(client, [9] * 4, SamplingParams(max_tokens=2), "leaver"))) >= 1  # its id free


def test_embed_returns_little_endian_float32_of_the_models_width(serving: Serving) -> None:
    width = json.loads((DEFAULT_MODEL / "config.json").read_text())["hidden_size"]
    embedding = serving.run(serving.client.embed([4, 5, 6, 7], "embedded"))
    assert isinstance(embedding, bytes) and len(embedding) == 4 * width
    vector = np.frombuffer(embedding, dtype="<f4")
    assert np.isfinite(vector).all() and np.abs(vector).max() > 0


def test_stats_and_health_are_the_frozen_structs_named(serving: Serving) -> None:
    stats, health = serving.client.stats(), serving.client.health()
    assert type(stats) is EngineStats and type(health) is EngineHealth
    for value in (stats, health):
        assert isinstance(value, msgspec.Struct) and value.__struct_config__.frozen
    with pytest.raises(AttributeError):
        stats.used_blocks = 1  # type: ignore[misc]
    assert stats.num_blocks == PAGES * serving.cores and health.engine_running is True


def test_a_serving_client_takes_new_work_and_stalls_nowhere(serving: Serving) -> None:
    client = serving.client
    assert client.accepting is True and client.stalled() is None
    waiting, free = client.queue_load()
    assert waiting == 0 and free > 0


def test_compile_grammar_refuses_a_bad_constraint(serving: Serving) -> None:
    serving.client.compile_grammar(StructuredOutputsParams(regex="[0-9]+"))
    with pytest.raises(InvalidParamError):
        serving.client.compile_grammar(StructuredOutputsParams(regex="[0-9"))


def test_pool_snapshot_and_metrics_text_come_from_the_cores(serving: Serving) -> None:
    snapshot = serving.run(serving.client.pool_snapshot())
    assert isinstance(snapshot, PoolSnapshot) and type(snapshot.stats) is EngineStats
    assert len(snapshot.device_states) == snapshot.stats.num_blocks == PAGES  # the first core's pool
    metrics = serving.run(serving.client.metrics_text())
    assert isinstance(metrics, bytes)
    assert re.search(rb"^vllm:kv_cache_usage_perc\{", metrics, re.MULTILINE)
    if serving.cores > 1:
        assert all(f'engine="{i}"'.encode() in metrics for i in range(serving.cores))


def test_sleep_wake_up_and_resize_free_and_allocate_an_idle_cores_pages(serving: Serving) -> None:
    client, page = serving.client, page_bytes(serving.client)
    prompt, params = [11] * 40, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)

    def cached_tokens(request_id: str) -> int:
        return serving.run(collect(client, prompt, params, request_id))[-1].num_cached_tokens

    cached_tokens("warm")
    assert cached_tokens("hit") > 0  # the prompt's pages are in the prefix cache
    assert serving.run(client.sleep()) is None
    woken = 40 * serving.cores
    assert serving.run(client.wake_up(woken * page)) == woken  # `kv_bytes` of pages, for all the cores together
    wait_for(serving.polled(lambda c: c.stats().num_blocks == woken), "the woken pool's counts")
    assert cached_tokens("cold") == 0  # fresh pages: the prefix cache went with the old ones
    resized = 48 * serving.cores
    assert serving.run(client.resize(resized * page)) == resized
    wait_for(serving.polled(lambda c: c.stats().num_blocks == resized), "the resized pool's counts")
    assert cached_tokens("cold again") == 0  # a fixed pool's resize is a sleep and a wake
    assert serving.run(client.resize(PAGES * serving.cores * page)) == PAGES * serving.cores  # as it was
    wait_for(serving.polled(lambda c: c.stats().num_blocks == PAGES * serving.cores), "the pool back")


def test_lora_calls_refuse_with_invalid_param_error_naming_why(serving: Serving) -> None:
    client = serving.client
    with pytest.raises(InvalidParamError, match="/no/such/adapter") as missing:
        serving.run(client.load_lora_adapter("missing", "/no/such/adapter"))
    assert missing.value.param == "lora_path"
    with pytest.raises(InvalidParamError) as unknown:
        serving.run(client.unload_lora_adapter("nobody"))
    assert unknown.value.code == "model_not_found"
    assert client.stats().lora_blocks == 0
