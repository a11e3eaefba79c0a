"""Tensor parallelism over 2 gloo processes on CPU: the same greedy tokens as one process and as transformers."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from pagegate import LLM, SamplingParams
from pagegate.engine.parallel import ParallelError, StepInputs, TensorParallel
from tests.engine.conftest import TINY, SavedModel, hf, save_hf_model
from tests.engine.test_llm import ENGINE_SETUPS, assert_all_pages_free, hf_greedy, make_prompts
from tests.engine.test_speculation import NGRAM, prompts

MAX_TOKENS = 12
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS)  # as transformers below


@pytest.fixture(scope="module")
def one_kv_head_model(tmp_path_factory: pytest.TempPathFactory) -> SavedModel:
    """One KV head for four query heads: both ranks hold (a copy of) it."""
    config = hf().LlamaConfig(**{**TINY, "num_key_value_heads": 1}, bos_token_id=1, eos_token_id=2)
    return save_hf_model(tmp_path_factory.mktemp("kv1"), config, seed=11)


@pytest.mark.parametrize("fixture", ["one_kv_head_model", "head_dim_model", "mistral_model", "qwen2_model"])
def test_greedy_matches_one_rank_and_transformers(fixture: str, request: pytest.FixtureRequest) -> None:
    saved = request.getfixturevalue(fixture)
    prompts = make_prompts()
    expected = [hf_greedy(saved, p, MAX_TOKENS) for p in prompts]
    single = LLM(str(saved.path), device="cpu", num_kv_blocks=64, kv_cache_dtype="float32")  # as transformers'
    assert [o.outputs[0].token_ids for o in single.generate(prompts, GREEDY, use_tqdm=False)] == expected
    tp = LLM(str(saved.path), device="cpu", num_kv_blocks=64, tensor_parallel_size=2, kv_cache_dtype="float32")
    try:
        assert [o.outputs[0].token_ids for o in tp.generate(prompts, GREEDY, use_tqdm=False)] == expected
        assert_all_pages_free(tp)
    finally:
        tp.shutdown()


@pytest.mark.parametrize("setup", ["recompute", "swap", "chunked"])
def test_page_pressure_and_chunked_prefill(setup: str, llama_model: SavedModel) -> None:
    prompts = make_prompts()
    expected = [hf_greedy(llama_model, p, MAX_TOKENS) for p in prompts]
    tp = LLM(str(llama_model.path), device="cpu", tensor_parallel_size=2, **ENGINE_SETUPS[setup])
    try:
        assert [o.outputs[0].token_ids for o in tp.generate(prompts, GREEDY, use_tqdm=False)] == expected
        if setup != "chunked":
            assert tp.stats().preemptions > 0
        assert_all_pages_free(tp)
    finally:
        tp.shutdown()


def test_default_model_sampling_prefix_hits_and_aborts() -> None:
    single = LLM(None, device="cpu", num_kv_blocks=256)
    prompt = "In the beginning God created the heaven and the earth. " * 3
    params = SamplingParams(temperature=0.8, seed=5, n=3, max_tokens=10)
    want = [[c.token_ids for c in o.outputs] for o in single.generate([prompt, prompt], params, use_tqdm=False)]
    tp = LLM(None, device="cpu", tensor_parallel_size=2, num_kv_blocks=256)  # one TP engine per process at a time
    try:
        got = [[c.token_ids for c in o.outputs] for o in tp.generate([prompt, prompt], params, use_tqdm=False)]
        assert got == want
        assert tp.stats().prefix_cache_hits > 0
        engine = tp.engine
        engine.add_request("gone", prompt, SamplingParams(max_tokens=50))
        engine.step()
        assert engine.abort("gone") and not engine.has_unfinished()
        assert_all_pages_free(tp)
    finally:
        tp.shutdown()


def test_heads_not_divisible_is_a_clear_error(llama_model: SavedModel) -> None:
    with pytest.raises(ParallelError, match="attention heads .4. is not divisible by the tensor-parallel size 3"):
        LLM(str(llama_model.path), device="cpu", tensor_parallel_size=3, num_kv_blocks=64)


def test_head_split() -> None:
    assert TensorParallel(1, 2).split(8, "x") == (4, 4)
    assert TensorParallel(3, 4).kv_heads(2) == (1, 1)  # ranks 2 and 3 share KV head 1
    assert TensorParallel(1, 2).kv_heads(4) == (2, 2)
    with pytest.raises(ParallelError):
        TensorParallel(0, 4).kv_heads(3)


def _pairs(n: int) -> np.ndarray:
    return np.arange(2 * n, dtype=np.int32).reshape(n, 2)


@given(tokens=st.integers(0, 40), seqs=st.integers(0, 8), width=st.integers(0, 5),
       moves=st.tuples(st.integers(0, 4), st.integers(0, 4), st.integers(0, 4)))
def test_step_inputs_round_trip(tokens: int, seqs: int, width: int, moves: tuple[int, int, int]) -> None:
    rng = np.random.default_rng(tokens)
    step = StepInputs(rng.integers(0, 99, tokens), np.arange(tokens), rng.integers(-1, 99, tokens),
                      rng.integers(0, 9, (seqs, width)).astype(np.int32), np.arange(seqs, dtype=np.int32),
                      np.arange(seqs + 1, dtype=np.int32), *(_pairs(n) for n in moves))
    header, payload = step.pack()
    assert len(payload) == StepInputs.payload_size(header)
    back = StepInputs.unpack(header, payload)
    for name, dtype in zip(StepInputs.PARTS, StepInputs.DTYPES, strict=True):
        original, copy = getattr(step, name), getattr(back, name)
        assert copy.dtype == dtype and np.array_equal(copy, original.reshape(copy.shape)), name


def test_speculation_on_two_ranks_keeps_the_greedy_tokens() -> None:
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    single = LLM(None, device="cpu", num_kv_blocks=64, max_model_len=256)
    want = [o.outputs[0].token_ids for o in single.generate(prompts(), params, use_tqdm=False)]
    tp = LLM(None, device="cpu", tensor_parallel_size=2, num_kv_blocks=64, max_model_len=256,
             speculative_config=NGRAM)
    try:
        assert [o.outputs[0].token_ids for o in tp.generate(prompts(), params, use_tqdm=False)] == want
        assert tp.stats().spec_accepted_tokens > 0
        assert_all_pages_free(tp)
    finally:
        tp.shutdown()
