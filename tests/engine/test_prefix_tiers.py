"""The KV tiers under the prefix cache, through the engine: pages pushed out of the pool come back from host memory
or disk bit-exact (every page format), a restart finds its disk pages, and a foreign or unused page is never served."""

from __future__ import annotations

import itertools
import stat
from pathlib import Path

import numpy as np
import pytest
import torch

from pagegate import LLM, SamplingParams
from pagegate.config import KV_CACHE_DTYPES, CacheConfig, EngineConfig, SchedulerConfig
from pagegate.engine.kv_cache import PagedKVCache
from pagegate.engine.pin import Pin
from pagegate.kernels.kv_format import AUTO_4, FORMATS, LayerFormats

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
PROMPT = np.random.default_rng(0).integers(10, 2000, 100).tolist()  # six full pages and a bit
PAGES = len(PROMPT) // 16
OTHERS = [np.random.default_rng(seed).integers(10, 2000, 200).tolist() for seed in range(1, 4)]


def engine(kv_cache_dtype: str = "float32", **tiers: object) -> LLM:
    cache = CacheConfig(num_kv_blocks=24, kv_cache_dtype=kv_cache_dtype, **tiers)  # type: ignore[arg-type]
    return LLM.from_config(EngineConfig(cache=cache, scheduler=SchedulerConfig(max_model_len=256)))


def run(llm: LLM, prompt: list[int]) -> tuple[list[int], int]:
    out = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
    return out.outputs[0].token_ids, out.num_cached_tokens


def push_out(llm: LLM) -> None:
    """Prompts that need the whole pool: every cached page of PROMPT is evicted."""
    for prompt in OTHERS:
        run(llm, prompt)


@pytest.mark.parametrize("kv_cache_dtype", [d for d in KV_CACHE_DTYPES if d != "auto"])
def test_pages_pushed_out_come_back_from_host_memory(kv_cache_dtype: str) -> None:
    llm = engine(kv_cache_dtype, kv_offload_memory="8MiB", kv_offload_min_reuse=1)
    cold, cached = run(llm, PROMPT)
    assert cached == 0
    push_out(llm)
    warm, cached = run(llm, PROMPT)
    assert warm == cold and cached == PAGES * 16
    host = llm.engine.runner.tiers.stats().host
    assert host is not None and host.hits >= PAGES and host.bytes_read > 0
    llm.engine.close()


@pytest.mark.parametrize("kv_cache_dtype", [d for d in KV_CACHE_DTYPES if d != "auto"])
def test_page_bytes_round_trip_in_every_format(kv_cache_dtype: str) -> None:
    formats = (LayerFormats(AUTO_4, (FORMATS["int8"], FORMATS["int4"], FORMATS["int4"])) if kv_cache_dtype == AUTO_4
               else FORMATS[kv_cache_dtype])
    cache = PagedKVCache(3, 8, 16, 2, 64, formats, torch.device("cpu"))
    for k, v in cache.layers:
        k.view(torch.uint8).copy_(torch.randint(0, 256, k.view(torch.uint8).shape, dtype=torch.uint8))
        v.view(torch.uint8).copy_(torch.randint(0, 256, v.view(torch.uint8).shape, dtype=torch.uint8))
    pages = cache.read_pages(np.array([1, 5]))
    assert pages.shape == (2, cache.page_bytes)
    cache.write_pages(np.array([6, 2]), pages)
    for k, v in cache.layers:
        assert torch.equal(k[6].view(torch.uint8), k[1].view(torch.uint8))
        assert torch.equal(v[2].view(torch.uint8), v[5].view(torch.uint8))


def test_a_restart_finds_its_pages_on_disk(tmp_path: Path) -> None:
    first = engine(kv_cache_dir=str(tmp_path), kv_offload_min_reuse=1)
    cold, _ = run(first, PROMPT)
    first.engine.close()  # a clean shutdown writes the pool's cached pages down
    files = [p for p in tmp_path.rglob("*") if p.is_file() and p.name != "lock"]
    assert len(files) >= PAGES
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in files)
    second = engine(kv_cache_dir=str(tmp_path), kv_offload_min_reuse=1)
    warm, cached = run(second, PROMPT)
    assert warm == cold and cached == PAGES * 16
    second.engine.close()
    other_format = engine("float16", kv_cache_dir=str(tmp_path), kv_offload_min_reuse=1)
    assert run(other_format, PROMPT)[1] == 0  # another page format: another fingerprint, never served
    other_format.engine.close()


def test_pages_seen_once_are_not_written_down() -> None:
    llm = engine(kv_offload_memory="8MiB", kv_offload_min_reuse=2)
    run(llm, PROMPT)
    push_out(llm)
    assert run(llm, PROMPT)[1] == 0  # seen once when it left: not kept
    push_out(llm)
    assert run(llm, PROMPT)[1] == PAGES * 16  # seen twice by then
    llm.engine.close()


def test_tiers_need_prefix_caching() -> None:
    with pytest.raises(ValueError, match="prefix caching"):
        LLM.from_config(EngineConfig(cache=CacheConfig(num_kv_blocks=24, enable_prefix_caching=False,
                                                       kv_offload_memory="1MiB"),
                                     scheduler=SchedulerConfig(max_model_len=256)))


def test_a_stored_conversation_spills_to_the_tiers_when_its_pin_goes() -> None:
    """Its pages were seen once, below the reuse gate's two: the pin vouches for them."""
    llm = engine(kv_offload_memory="8MiB", kv_offload_min_reuse=2)
    request = llm.engine.intake.make_request("turn-1", PROMPT, GREEDY, pins=(Pin("conversation", 600.0),))
    llm.engine.add(request)
    while llm.engine.has_unfinished():
        llm.engine.step()
    assert llm.stats().pinned_blocks == PAGES
    llm.generate(OTHERS[:2], GREEDY, use_tqdm=False)  # together they need the pinned pages: the pin goes
    assert llm.stats().pinned_blocks == 0
    push_out(llm)
    assert run(llm, PROMPT)[1] == PAGES * 16
    llm.engine.close()


def test_a_salted_prefix_is_never_another_salts_hit_in_a_tier(tmp_path: Path) -> None:
    """--prefix-cache-scope key salts the chain with the key: the tiers (and their files) keep keys apart."""
    llm = engine(kv_offload_memory="8MiB", kv_cache_dir=str(tmp_path), kv_offload_min_reuse=1)
    ids = itertools.count()

    def cached(salt: str) -> int:
        request = llm.engine.add_request(f"salted-{next(ids)}", PROMPT, GREEDY, cache_salt=salt)
        while llm.engine.has_unfinished():
            llm.engine.step()
        return request.num_cached_tokens

    cached("key:a:")
    push_out(llm)
    assert cached("key:b:") == 0
    push_out(llm)
    assert cached("key:a:") == PAGES * 16
    llm.engine.close()
