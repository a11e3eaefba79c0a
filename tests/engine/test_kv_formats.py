"""Every KV page format through the whole engine: the native step and the torch path agree, and prefix hits,
swap and recompute preemption change no answer."""

from __future__ import annotations

import pytest
import torch

from pagegate import LLM, SamplingParams
from pagegate.kernels.dispatch import decode_kernel
from pagegate.kernels.kv_format import FORMATS, resolve_format

from .conftest import TINY, hf, save_hf_model
from .test_llm import assert_all_pages_free, make_prompts

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=1)
PRESSURE = dict(num_kv_blocks=12, max_num_batched_tokens=32, max_model_len=128)


def run(llm: LLM, prompts: list[list[int]]) -> list[tuple[list[int], list[float]]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    return [(o.outputs[0].token_ids, [lp.logprob for lp in o.outputs[0].logprobs]) for o in outputs]


def assert_same_answers(answers: list, expected: list) -> None:
    """The same tokens; logprobs within float32 noise (another batch shape sums in another order)."""
    for (tokens, logprobs), (ref_tokens, ref_logprobs) in zip(answers, expected, strict=True):
        assert tokens == ref_tokens
        assert max(abs(a - b) for a, b in zip(logprobs, ref_logprobs, strict=True)) < 1e-3


@pytest.fixture(scope="module")
def roomy(llama_model) -> dict[str, list]:
    """Each format's answers with pages to spare (the reference every other run must equal)."""
    answers = {}
    for name in FORMATS:
        llm = LLM(str(llama_model.path), device="cpu", num_kv_blocks=64, kv_cache_dtype=name,
                  enable_prefix_caching=False)
        answers[name] = run(llm, make_prompts())
    return answers


@pytest.mark.parametrize("name", list(FORMATS))
def test_pages_take_the_format_and_its_bytes(llama_model, name):
    llm = LLM(str(llama_model.path), device="cpu", kv_cache_memory="1MiB", kv_cache_dtype=name)
    runner = llm.engine.runner
    k_cache = runner.kv_cache.layers[0][0]
    assert k_cache.dtype == FORMATS[name].dtype and runner.kv_format.name == name
    # tiny Llama: 2 layers, 2 KV heads of 16
    assert runner.kv_bytes_per_token == 2 * 2 * 2 * FORMATS[name].row_bytes(16)
    assert runner.num_blocks == (1 << 20) // (16 * runner.kv_bytes_per_token)
    text = llm.engine.metrics.registry.get_sample_value(
        "pagegate:kv_cache_bytes_per_token", {"model_name": llm.engine.model_name, "kv_cache_dtype": name})
    assert text == runner.kv_bytes_per_token


def test_one_byte_pages_hold_more_tokens_in_the_same_memory(llama_model):
    blocks = {name: LLM(str(llama_model.path), device="cpu", kv_cache_memory="4MiB", kv_cache_dtype=name)
              .engine.runner.num_blocks for name in ("float32", "float16", "int8")}
    assert blocks["float16"] >= 2 * blocks["float32"]
    assert blocks["int8"] >= 3.5 * blocks["float32"]  # head_dim 16: 18 bytes a row against 64


def test_an_unknown_format_fails_at_start(llama_model):
    with pytest.raises(ValueError, match="fp8_e4m3"):
        LLM(str(llama_model.path), device="cpu", kv_cache_dtype="q4_0")


@pytest.mark.parametrize("name", [name for name in FORMATS if not FORMATS[name].rotated])
def test_quantized_pages_stay_close_to_float32(roomy, name):
    # a random model, sharper than a trained one; e5m2 keeps two mantissa bits (int4 is held to a trained model's
    # answer in test_smollm2.py: here heads of 16 are too short for the rotation to spread a row)
    tolerance = {"float32": 0, "float16": 0.01, "bfloat16": 0.05, "int8": 0.05, "fp8_e4m3": 0.3}.get(name, 0.6)
    for (tokens, logprobs), (ref_tokens, ref_logprobs) in zip(roomy[name], roomy["float32"], strict=True):
        same = 0
        while same < len(tokens) and tokens[same] == ref_tokens[same]:
            same += 1
        assert same >= 1, "the first token came from the same prompt pages"
        gaps = [abs(a - b) for a, b in zip(logprobs[:same], ref_logprobs[:same], strict=True)]
        assert max(gaps) <= tolerance, (name, gaps)


@pytest.mark.skipif(decode_kernel() is None, reason="the native decode step is not built")
@pytest.mark.parametrize("name", list(FORMATS))
def test_native_step_equals_the_torch_path(llama_model, roomy, monkeypatch, name):
    # the reference backend runs every step in torch: same stored bytes, the same tokens
    monkeypatch.setenv("PAGEGATE_KERNEL_BACKEND", "reference")
    llm = LLM(str(llama_model.path), device="cpu", num_kv_blocks=64, kv_cache_dtype=name,
              enable_prefix_caching=False)
    assert llm.engine.runner.native is None
    assert_same_answers(run(llm, make_prompts()), roomy[name])


@pytest.mark.parametrize("name", ["float16", "int8", "fp8_e4m3", "int4"])
def test_prefix_hits_give_the_cold_answer(llama_model, roomy, name):
    llm = LLM(str(llama_model.path), device="cpu", num_kv_blocks=64, kv_cache_dtype=name)
    prompts = make_prompts()
    assert_same_answers(run(llm, prompts), roomy[name])
    hits = llm.stats().prefix_cache_hits
    assert_same_answers(run(llm, prompts), roomy[name])
    assert llm.stats().prefix_cache_hits > hits
    assert_all_pages_free(llm)


@pytest.mark.parametrize("mode", ["swap", "recompute"])
@pytest.mark.parametrize("name", ["float16", "int8", "fp8_e5m2", "int4"])
def test_preemption_gives_the_roomy_answer(llama_model, roomy, name, mode):
    swap = 0.001 if mode == "swap" else 0.0
    llm = LLM(str(llama_model.path), device="cpu", kv_cache_dtype=name, swap_space=swap, preemption_mode=mode,
              enable_prefix_caching=False, **PRESSURE)
    assert_same_answers(run(llm, make_prompts()), roomy[name])
    assert llm.stats().preemptions > 0
    if mode == "swap":
        assert llm.stats().swap_out_blocks > 0 and llm.engine.runner.kv_cache.cpu_layers[0][0].dtype == \
            FORMATS[name].dtype
    assert_all_pages_free(llm)


def test_int8_pages_are_the_cpu_default(llama_model):
    llm = LLM(str(llama_model.path), device="cpu", num_kv_blocks=16)
    assert llm.engine.runner.kv_cache.layers[0][0].dtype == torch.int8
    assert resolve_format("auto", torch.float32, torch.device("cpu")).name == "int8"
    assert resolve_format("auto", torch.float16, torch.device("cuda")).name == "float16"  # the model's dtype


@pytest.fixture(scope="module")
def long_model(tmp_path_factory):
    """The tiny Llama with room for contexts long enough that one stream's attention splits over the threads."""
    config = hf().LlamaConfig(**{**TINY, "max_position_embeddings": 1024}, bos_token_id=1, eos_token_id=2)
    return save_hf_model(tmp_path_factory.mktemp("long"), config, seed=4)


@pytest.mark.skipif(decode_kernel() is None, reason="the native decode step is not built")
@pytest.mark.parametrize("name", ["float32", "int8"])
def test_one_long_stream_splits_its_keys_and_still_equals_the_torch_path(long_model, monkeypatch, name):
    # 900 keys, 2 KV heads: the native step splits each head's keys in parts (flash-decoding) and merges them
    prompts = [torch.randint(3, 256, (900,), generator=torch.Generator().manual_seed(0)).tolist()]
    answers = []
    for backend in ("auto", "reference"):
        monkeypatch.setenv("PAGEGATE_KERNEL_BACKEND", backend)
        llm = LLM(str(long_model.path), device="cpu", num_kv_blocks=80, kv_cache_dtype=name)
        assert (llm.engine.runner.native is not None) == (backend == "auto")
        answers.append(run(llm, prompts))
    assert_same_answers(*answers)
