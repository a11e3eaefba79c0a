"""The model against transformers: prefill, chunked prefill and decode through a real paged KV cache."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagegate.engine.loading.loader import load_model
from pagegate.engine.models.config import ModelConfig, RopeConfig
from pagegate.engine.models.layers import PagedAttention, RotaryEmbedding, apply_rope
from pagegate.engine.models.registry import build_empty_model
from pagegate.engine.models.rope_table import inv_freq

from ..conftest import TINY, PagedBatch, SavedModel

MODELS = ["llama_model", "llama3_rope_model", "head_dim_model", "mistral_model", "qwen2_model",
          "sharded_model"]
PROMPT_LENS = [1, 6, 13, 21]  # 21 > the Mistral window (5) and crosses several 4-token pages


def _prompts(vocab: int, lens: list[int], seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lens]


@torch.inference_mode()
def _hf_logits(saved: SavedModel, ids: list[int]) -> torch.Tensor:
    return saved.hf_model(torch.tensor([ids])).logits[0].float()


@pytest.mark.parametrize("fixture", MODELS)
@torch.inference_mode()
def test_prefill_logits_match_transformers(fixture: str, request: pytest.FixtureRequest) -> None:
    saved: SavedModel = request.getfixturevalue(fixture)
    model, config, _ = load_model(saved.path)
    prompts = _prompts(config.vocab_size, PROMPT_LENS)
    batch = PagedBatch(model, len(prompts), max(PROMPT_LENS))
    input_ids, positions, attn = batch.step(prompts)
    logits = model.compute_logits(model(input_ids, positions, batch.kv_caches, attn))
    expected = torch.cat([_hf_logits(saved, p) for p in prompts])
    assert logits.dtype == torch.float32 and logits.shape == expected.shape
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("fixture", ["llama_model", "mistral_model", "qwen2_model"])
@torch.inference_mode()
def test_chunked_prefill_then_decode_match_transformers(fixture: str, request: pytest.FixtureRequest) -> None:
    saved: SavedModel = request.getfixturevalue(fixture)
    model, config, _ = load_model(saved.path)
    full = _prompts(config.vocab_size, [14, 9, 17], seed=1)
    steps = [[p[:5] for p in full], [p[5:8] for p in full]] + [[[p[i]] for p in full] for i in range(8, 9)]
    extra = _prompts(config.vocab_size, [4, 4, 4], seed=2)
    steps += [[[e[i]] for e in extra] for i in range(4)]  # decode steps: one new token per sequence
    batch = PagedBatch(model, len(full), 30, seed=3)
    seen: list[list[int]] = [[] for _ in full]
    for chunks in steps:
        input_ids, positions, attn = batch.step(chunks)
        hidden = model(input_ids, positions, batch.kv_caches, attn)
        logits = model.compute_logits(hidden[batch.last_rows(chunks)])
        for seq, chunk in enumerate(chunks):
            seen[seq] += chunk
        expected = torch.stack([_hf_logits(saved, s)[-1] for s in seen])
        torch.testing.assert_close(logits, expected, atol=1e-4, rtol=0)


@torch.inference_mode()
def test_bfloat16_load_stays_close_to_float32(llama_model: SavedModel) -> None:
    model32, config, _ = load_model(llama_model.path, dtype="float32")
    model16, _, _ = load_model(llama_model.path, dtype="bfloat16")
    assert model16.dtype == torch.bfloat16 and model16.lm_head.weight.dtype == torch.bfloat16
    prompts = _prompts(config.vocab_size, [7, 3])
    out = []
    for model in (model32, model16):
        batch = PagedBatch(model, 2, 8)
        input_ids, positions, attn = batch.step(prompts)
        out.append(model.compute_logits(model(input_ids, positions, batch.kv_caches, attn)))
    assert out[1].dtype == torch.float32
    assert (out[0] - out[1]).abs().max() < 0.05 * out[0].abs().max()


def test_cache_dims_exposed(head_dim_model: SavedModel) -> None:
    model, config, _ = load_model(head_dim_model.path)
    assert (model.num_layers, model.num_kv_heads, model.head_dim, model.dtype) == (2, 2, 32, torch.float32)
    assert model.device == torch.device("cpu")


def test_llama3_scaling_keeps_high_divides_low_and_blends_middle_frequencies() -> None:
    # Wavelengths 2*pi*10000^(i/8): 6.3 (< 64/4: kept), 20 and 63 (blended), longer (> 64/1: divided).
    rope = RopeConfig(type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                      original_max_position_embeddings=64)
    plain, scaled = inv_freq(16, RopeConfig(), 256), inv_freq(16, rope, 256)
    assert scaled[0] == plain[0]
    assert bool(((scaled[1:3] < plain[1:3]) & (scaled[1:3] > plain[1:3] / 8)).all())
    np.testing.assert_allclose(scaled[3:], plain[3:] / 8)


def test_rope_keeps_norms_and_is_identity_at_position_zero() -> None:
    rotary = RotaryEmbedding(16, RopeConfig(), 64)
    x = torch.randn(3, 2, 16)
    cos, sin = rotary(torch.tensor([0, 5, 63]))
    rotated = apply_rope(x, cos, sin)
    torch.testing.assert_close(rotated[0], x[0])
    torch.testing.assert_close(rotated.norm(dim=-1), x.norm(dim=-1))
    assert not torch.allclose(rotated[1], x[1])


def test_a_built_model_chooses_its_kernels_once():
    """Every attention layer shares one AttentionOps, chosen for the device when the model was built."""
    model = build_empty_model(ModelConfig.from_dict(dict(TINY, architectures=["LlamaForCausalLM"])),
                              torch.float32, "cpu")
    layers = [m for m in model.modules() if isinstance(m, PagedAttention)]
    assert len(layers) == TINY["num_hidden_layers"] and len({id(m.ops) for m in layers}) == 1
    assert layers[0].ops is not None and layers[0].ops.backend == "reference"
