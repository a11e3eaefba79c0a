"""Text through the engine: stop strings across token boundaries, streaming never splits a character."""

import asyncio
import shutil

import pytest

from pagegate import LLM, SamplingParams
from pagegate.config import CacheConfig, EngineConfig
from pagegate.engine.loading.tokenizer import Tokenizer
from pagegate.engine.serving.async_engine import AsyncEngine

from .conftest import TINY, hf, save_hf_model
from .test_llm import assert_all_pages_free


@pytest.fixture(scope="module")
def text_model(tmp_path_factory, bytelevel_tokenizer_dir):
    folder = tmp_path_factory.mktemp("text_model")
    config = hf().LlamaConfig(**{**TINY, "vocab_size": 400}, bos_token_id=0, eos_token_id=1)
    save_hf_model(folder, config, seed=3)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(bytelevel_tokenizer_dir / name, folder / name)
    return folder


GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


def test_stop_string_across_token_boundaries_is_trimmed(text_model):
    llm = LLM(str(text_model), device="cpu", num_kv_blocks=64)
    tokenizer = llm.get_tokenizer()
    free = llm.generate("Hello world", GREEDY, use_tqdm=False)[0].outputs[0]
    pieces = [tokenizer.decode(free.token_ids[:i]) for i in range(len(free.token_ids) + 1)]
    # a stop string that starts inside one token and ends inside a later one
    k = next(i for i in range(4, len(pieces) - 2) if len(pieces[i + 2]) - len(pieces[i]) >= 3
             and len(pieces[i]) > len(pieces[i - 1]) + 1)
    start = len(pieces[k]) - 1
    stop = free.text[start:len(pieces[k + 2]) - 1]
    assert len(stop) >= 2 and free.text.find(stop) == start
    out = llm.generate("Hello world", SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop]),
                       use_tqdm=False)[0].outputs[0]
    assert out.text == free.text[:start]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert_all_pages_free(llm)


def test_streamed_text_only_grows_and_never_holds_a_broken_character(text_model):
    config = EngineConfig(str(text_model), device="cpu", cache=CacheConfig(num_kv_blocks=64))

    async def stream() -> tuple[list, Tokenizer | None, int]:
        params = SamplingParams(temperature=1.0, seed=7, max_tokens=60, ignore_eos=True)
        async with await AsyncEngine.start(config) as engine:
            outputs = [o.outputs[0] async for o in engine.generate("emoji 😀 café", params, "s")]
            return outputs, engine.tokenizer, engine.stats().used_blocks

    outputs, tokenizer, used_blocks = asyncio.run(stream())
    texts = [o.text for o in outputs]
    # a character split across tokens is held back, never sent half and corrected later
    for before, after in zip(texts, texts[1:], strict=False):
        assert after.startswith(before)
    assert tokenizer is not None and texts[-1] == tokenizer.decode(outputs[-1].token_ids)
    assert used_blocks == 0


def test_a_stop_token_is_cut_from_the_text_unless_asked_for(text_model):
    llm = LLM(str(text_model), device="cpu", num_kv_blocks=64)
    tokenizer = llm.get_tokenizer()
    free = llm.generate("Hello world", GREEDY, use_tqdm=False)[0].outputs[0]
    stop_token = free.token_ids[5]
    cut = free.token_ids.index(stop_token)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop_token_ids=[stop_token])
    out = llm.generate("Hello world", params, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == free.token_ids[:cut + 1] and out.stop_reason == stop_token
    assert out.text == tokenizer.decode(free.token_ids[:cut])
    params.include_stop_str_in_output = True
    kept = llm.generate("Hello world", params, use_tqdm=False)[0].outputs[0]
    assert kept.text == tokenizer.decode(free.token_ids[:cut + 1])
    assert_all_pages_free(llm)


def test_include_stop_str_in_output_keeps_the_stop_string(text_model):
    llm = LLM(str(text_model), device="cpu", num_kv_blocks=64)
    free = llm.generate("Hello world", GREEDY, use_tqdm=False)[0].outputs[0]
    stop = free.text[6:9]
    start = free.text.find(stop)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop],
                            include_stop_str_in_output=True)
    out = llm.generate("Hello world", params, use_tqdm=False)[0].outputs[0]
    assert out.text == free.text[:start + len(stop)] and out.stop_reason == stop


def test_nearby_seeds_share_no_choice(text_model):
    """(seed 1, n 2)'s second choice was (seed 2, n 1)'s first: choice i sampled with seed + i."""
    llm = LLM(str(text_model), device="cpu", num_kv_blocks=64)

    def choices(seed: int, n: int) -> list[list[int]]:
        params = SamplingParams(temperature=1.0, seed=seed, n=n, max_tokens=12, ignore_eos=True)
        return [c.token_ids for c in llm.generate("Hello", params, use_tqdm=False)[0].outputs]

    one, two = choices(1, 4), choices(2, 4)
    assert not set(map(tuple, one)) & set(map(tuple, two))
    assert choices(1, 4) == one  # still reproducible
    assert_all_pages_free(llm)
