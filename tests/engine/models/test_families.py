"""Gemma 3, Gemma 2, Qwen3 and Phi-3 as tiny random models of their real shapes (transformers' own classes),
each served from its Hugging Face folder and from the GGUF llama.cpp's `convert_hf_to_gguf.py` writes of it:
greedy output identical to transformers, batched and alone, with prefix caching, preemption and n > 1."""

from __future__ import annotations

from copy import deepcopy
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType

from pagegate import LLM, SamplingParams
from pagegate.engine.loading.gguf_file import GGUFFile

from ..conftest import SavedModel
from ..family_models import ORIGINAL_CONTEXT, convert, save_family
from ..loading.gguf_files import requantize
from ..test_llm import assert_all_pages_free

# Phi-3 runs within its original context here, so transformers' short factors apply to every token; pages in
# float32 by name (CPU's default is int8): these tests hold pagegate to transformers' float32 answers
ENGINE = {"max_model_len": ORIGINAL_CONTEXT, "kv_cache_dtype": "float32"}
TOKENS = 64


@pytest.fixture(scope="module", params=["gemma3", "gemma2", "qwen3", "phi3"])
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> SavedModel:
    return save_family(tmp_path_factory.mktemp(request.param), request.param)


@pytest.fixture(scope="module")
def prompts(family: SavedModel) -> list[list[int]]:
    """Eight prompts of 3..40 tokens (past every sliding window), two sharing a 24-token prefix."""
    vocab = family.hf_model.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    made = [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in (5, 12, 20, 40, 3, 17, 9, 30)]
    made[5] = made[7][:24] + made[5]
    return made


@pytest.fixture(scope="module")
def reference(family: SavedModel, prompts: list[list[int]]) -> list[list[int]]:
    """transformers' greedy continuation of each prompt."""
    return [_hf_greedy(family.hf_model, prompt) for prompt in prompts]


def _hf_greedy(model: torch.nn.Module, prompt: list[int]) -> list[int]:
    """Without an eos (ignore_eos=True picks eos like any token; min_new_tokens would forbid it)."""
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=TOKENS,
                         eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def gguf_f32(family: SavedModel, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _convert(family, tmp_path_factory, "f32")


def _convert(family: SavedModel, tmp_path_factory: pytest.TempPathFactory, outtype: str) -> Path:
    return convert(family, tmp_path_factory.mktemp("gguf"), outtype)


GREEDY = SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True)


@pytest.mark.parametrize("source", ["folder", "gguf"])
def test_greedy_equals_transformers_batched_alone_and_preempted(source: str, family: SavedModel,
                                                               prompts: list[list[int]],
                                                               reference: list[list[int]],
                                                               request: pytest.FixtureRequest) -> None:
    path = str(family.path if source == "folder" else request.getfixturevalue("gguf_f32"))
    llm = LLM(path, device="cpu", num_kv_blocks=256, **ENGINE)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == reference
    assert llm.generate([prompts[3]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids == reference[3]
    again = llm.generate(prompts[5:], SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True, n=2),
                         use_tqdm=False)
    assert again[0].num_cached_tokens >= 32 and again[2].num_cached_tokens >= 16  # whole pages, cached
    for output, expected in zip(again, reference[5:], strict=True):
        assert [c.token_ids for c in output.outputs] == [expected, expected]
    assert_all_pages_free(llm)

    # a pool of 14 pages holds two sequences at most: the rest wait, are preempted and recomputed or swapped
    tight = LLM(path, device="cpu", num_kv_blocks=14, max_num_batched_tokens=32, swap_space=0.001, **ENGINE)
    assert [o.outputs[0].token_ids for o in tight.generate(prompts, GREEDY, use_tqdm=False)] == reference
    assert tight.stats().preemptions > 0
    assert_all_pages_free(tight)


def test_gguf_config_is_the_folder_config(family: SavedModel, gguf_f32: Path) -> None:
    from pagegate.engine.models.config import ModelConfig

    folder = ModelConfig.from_folder(family.path)
    gguf = GGUFFile(gguf_f32).config
    for field in ("architecture", "hidden_act", "qk_norm", "attention_scale", "attn_logit_softcap",
                  "final_logit_softcap", "layer_sliding_windows", "local_rope", "tie_word_embeddings",
                  "head_dim", "num_key_value_heads"):
        assert getattr(gguf, field) == getattr(folder, field), field
    assert gguf.rope.theta == folder.rope.theta and gguf.rope.type == folder.rope.type


Q = GGMLQuantizationType


def _q4_k_m(name: str, values: np.ndarray) -> Q:
    """llama.cpp's Q4_K_M mix: Q6_K for the output, value and down projections, Q4_K elsewhere; rows of a length
    K-quants cannot take fall back to Q8_0, as llama-quantize's do."""
    if values.shape[1] % 256:
        return Q.Q8_0
    return Q.Q6_K if name.split(".")[-2] in ("output", "token_embd", "attn_v", "ffn_down") else Q.Q4_K


@pytest.fixture(scope="module", params=["gemma3", "qwen3"])
def wide_family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> SavedModel:
    return save_family(tmp_path_factory.mktemp(f"wide-{request.param}"), request.param, seed=12, wide=True)


@pytest.mark.parametrize("outtype", ["f16", "q8_0", "q4_k_m"])
def test_quantized_gguf_serves_like_transformers_on_the_same_file(outtype: str, wide_family: SavedModel,
                                                                  tmp_path_factory: pytest.TempPathFactory,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """F16 and Q8_0 as llama.cpp's converter writes them, Q4_K_M requantized from its F32 file; the blocks stay
    resident, and greedy output equals transformers running the same file's dequantized weights."""
    if outtype == "q4_k_m":
        source = _convert(wide_family, tmp_path_factory, "f32")
        path = requantize(source, source.with_name(f"{source.stem}-q4_k_m.gguf"), _q4_k_m)
    else:
        path = _convert(wide_family, tmp_path_factory, outtype)
    monkeypatch.setenv("PAGEGATE_KERNEL_BACKEND", "reference")  # the torch path: float32 on the exact blocks
    llm = LLM(str(path), device="cpu", num_kv_blocks=64, kv_cache_dtype="float32")
    kinds = {type(m).__name__ for m in llm.engine.runner.model.modules()}
    assert "QuantLinear" in kinds
    reference = _with_gguf_weights(wide_family.hf_model, path)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 500, (n,), generator=gen).tolist() for n in (4, 11, 19, 27)]
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True), use_tqdm=False)
    for prompt, output in zip(prompts, outputs, strict=True):
        ours = output.outputs[0].token_ids
        with torch.no_grad():  # transformers' logits along our tokens: each must be its best
            logits = reference(torch.tensor([prompt + ours])).logits[0, len(prompt) - 1:-1]
        assert (logits.max(-1).values - logits[torch.arange(len(ours)), ours]).max() < 1e-4


def _with_gguf_weights(model: torch.nn.Module, path: Path) -> torch.nn.Module:
    """A copy of the transformers model holding the GGUF's weights as transformers dequantizes them."""
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    copy = deepcopy(model)
    tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=copy)["tensors"]
    missing, unexpected = copy.load_state_dict(tensors, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    copy.tie_weights()
    return copy.eval()


@pytest.fixture(scope="module")
def phi3(tmp_path_factory: pytest.TempPathFactory) -> SavedModel:
    return save_family(tmp_path_factory.mktemp("phi3-long"), "phi3")


def test_phi3_past_its_original_context_uses_the_long_factors(phi3: SavedModel) -> None:
    """Served with a context past the original one, every position takes LongRoPE's long factors, as
    transformers does for a prompt longer than the original context."""
    llm = LLM(str(phi3.path), device="cpu", num_kv_blocks=64, kv_cache_dtype="float32")  # max_model_len: 256
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, phi3.hf_model.config.vocab_size, (n,), generator=gen).tolist() for n in (130, 150)]
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    for prompt, output in zip(prompts, outputs, strict=True):
        ids = torch.tensor([prompt])
        expected = phi3.hf_model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                          max_new_tokens=16, eos_token_id=None, pad_token_id=0)
        assert output.outputs[0].token_ids == expected[0, len(prompt):].tolist()


def test_tensor_parallel_greedy_equals_transformers(family: SavedModel, prompts: list[list[int]],
                                                    reference: list[list[int]]) -> None:
    """Two ranks, each with half the heads (QK-norm per head, soft-caps, local RoPE and Phi-3's fused tensors
    split by rank)."""
    tp = LLM(str(family.path), device="cpu", num_kv_blocks=256, tensor_parallel_size=2, **ENGINE)
    try:
        outputs = tp.generate(prompts[:4], GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outputs] == reference[:4]
        assert_all_pages_free(tp)
    finally:
        tp.shutdown()
