"""Deterministic by construction: a request's tokens and every logprob are the same bits alone, in a batch of 16,
prefilled in small chunks beside decodes, after a prefix hit, swapped out and back or recomputed after preemption,
and on 1 or 2 threads — on float32 weights and on integer blocks with Q8 activations (cpu_decode.h's NOTE)."""

from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from pagegate import LLM, SamplingParams

from .conftest import SavedModel, hf, save_hf_model
from .loading.gguf_files import write_gguf

WIDE = dict(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512)  # K-quants need rows of 256
PROBE = [(7 * i + 3) % 250 + 3 for i in range(70)]  # the request whose bits are compared
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=3)
Answer = tuple[list[int], list[tuple[float, dict[int, float]]]]


def others(n: int, seed: int = 1) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 250) for _ in range(rng.randrange(5, 90))] for _ in range(n)]


@pytest.fixture(scope="module", params=["f32", "q4_k"])
def model_file(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    saved: SavedModel = save_hf_model(tmp_path_factory.mktemp("wide"), hf().LlamaConfig(**WIDE), seed=5)
    if request.param == "f32":
        return saved.path
    quant = Q.Q4_K
    return write_gguf(tmp_path_factory.mktemp("gguf") / "model.gguf", saved.hf_model, quant=lambda name, v: quant)


def answer(llm: LLM, prompts: list[list[int]], params: SamplingParams = GREEDY, last: bool = False,
           preempted: bool = False, probe: list[int] = PROBE) -> Answer:
    """The probe's tokens and top logprobs; `prompts` run beside it in the same calls (the probe first, or `last`:
    the first a full pool preempts, which `preempted` then checks)."""
    assert llm.engine.runner.chunk_invariant  # every step on the native decoder
    beside = [{"prompt_token_ids": p} for p in prompts]
    mine = {"prompt_token_ids": probe}
    outputs = llm.generate(beside + [mine] if last else [mine] + beside, params, use_tqdm=False)
    output = outputs[-1 if last else 0]
    assert bool(output.metrics.get("preemptions")) == preempted
    out = output.outputs[0]
    assert out.logprobs is not None
    return out.token_ids, [(lp.logprob, lp.top) for lp in out.logprobs]


def make(path: Path, **kwargs: object) -> LLM:
    return LLM(str(path), device="cpu", **{"num_kv_blocks": 128, "max_model_len": 512, **kwargs})


@contextmanager
def threads(n: int) -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.fixture(scope="module")
def alone(model_file: Path) -> Answer:
    return answer(make(model_file, enable_prefix_caching=False), [])


def test_in_a_batch_of_16(model_file: Path, alone: Answer) -> None:
    assert answer(make(model_file, enable_prefix_caching=False), others(15)) == alone


def test_prefilled_in_chunks_beside_decodes(model_file: Path, alone: Answer) -> None:
    llm = make(model_file, enable_prefix_caching=False, max_num_batched_tokens=24)
    assert answer(llm, others(5, seed=2)) == alone


def test_after_a_prefix_hit(model_file: Path, alone: Answer) -> None:
    llm = make(model_file)
    llm.generate([{"prompt_token_ids": PROBE[:50] + [9, 9, 9]}], GREEDY, use_tqdm=False)
    first = answer(llm, [])
    assert llm.engine.scheduler.pool.stats().prefix_cache_hits >= 48
    assert first == alone


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_preempted_and_resumed(model_file: Path, alone: Answer, mode: str) -> None:
    llm = make(model_file, enable_prefix_caching=False, num_kv_blocks=16, swap_space=0.05 if mode == "swap" else 0,
               preemption_mode=mode, max_model_len=128)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=3)
    short = [p[:20] + [5] * (20 - len(p)) for p in others(3, seed=3)]  # all four fit, then the probe must yield
    tokens, logprobs = answer(llm, short, params, last=True, preempted=True)
    assert (tokens[:10], logprobs[:10]) == alone


def test_on_one_thread_as_on_two(model_file: Path, alone: Answer) -> None:
    with threads(1):
        one = answer(make(model_file, enable_prefix_caching=False), others(3, seed=4))
    with threads(2):
        two = answer(make(model_file, enable_prefix_caching=False), [])
    assert one == two == alone


def test_past_one_attention_part_whoever_computes_the_parts(model_file: Path) -> None:
    """Past 256 keys a token's attention runs in parts: alone on two threads they are split over the threads,
    beside three other long prompts each thread takes whole (token, KV head) items, and a prompt's tokens share each
    key tile in blocks that its chunks cut elsewhere; the same bits every way."""
    long = [(11 * i + 5) % 250 + 3 for i in range(300)]
    with threads(2):
        alone = answer(make(model_file, enable_prefix_caching=False), [], probe=long)
        beside = answer(make(model_file, enable_prefix_caching=False), [p * 5 for p in others(3, seed=6)], probe=long)
        chunked = answer(make(model_file, enable_prefix_caching=False, max_num_batched_tokens=23), [], probe=long)
    assert beside == alone and chunked == alone
