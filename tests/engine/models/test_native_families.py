"""The native decoder on the families beyond Llama's block: Qwen3 (QK-norm, head_dim != hidden / heads), Gemma 2
(four norms, GeGLU, scaled embedding, soft-capped attention and logits, alternating windows), Gemma 3 (QK-norm and
a second RoPE table on the sliding layers, head_dim 64 and 256) and Phi-3 (LongRoPE; Llama's graph). Each against
the torch forward: hidden states, written pages and logits step by step, and greedy tokens through the engine."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import quants

from pagegate.engine.kv_cache import PagedKVCache
from pagegate.engine.loading.loader import load_model
from pagegate.engine.models.base import CausalLM
from pagegate.engine.models.layers import AttentionMetadata, PackedLinear, RowParallelLinear
from pagegate.engine.models.native import NativeDecoder
from pagegate.engine.models.quantized import QuantEmbedding, QuantLinear
from pagegate.engine.parallel import StepInputs

from ..conftest import SavedModel, hf, save_hf_model
from .test_native import greedy

SHAPE = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=256)
GEMMA3_ROPE = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
               "full_attention": {"rope_type": "default", "rope_theta": 1e6}}
PHI3_ROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 128,
             "short_factor": [1.0 + 0.1 * i for i in range(8)], "long_factor": [2.0 + 0.5 * i for i in range(8)]}


def _config(family: str) -> Any:
    t: Any = hf()
    if family == "qwen3":
        return t.Qwen3Config(**SHAPE, num_hidden_layers=2, head_dim=32)
    if family == "gemma2":
        return t.Gemma2Config(**SHAPE, num_hidden_layers=4, head_dim=32, query_pre_attn_scalar=32, sliding_window=8,
                              attn_logit_softcapping=5.0, final_logit_softcapping=3.0)
    if family == "phi3":
        return t.Phi3Config(**SHAPE, num_hidden_layers=2, rope_parameters=PHI3_ROPE,
                            original_max_position_embeddings=128, pad_token_id=0)
    head_dim = 256 if family == "gemma3_256" else 64
    return t.Gemma3TextConfig(**SHAPE, num_hidden_layers=7, head_dim=head_dim, query_pre_attn_scalar=head_dim,
                              sliding_window=8, rope_parameters=GEMMA3_ROPE)


FAMILIES = ["qwen3", "gemma2", "gemma3", "gemma3_256", "phi3"]
# prompts past the Gemma windows (8), over several pages; decode steps of 1 and 3 tokens per sequence
PROMPT_LENS = [3, 12, 21, 9]


@pytest.fixture(scope="module", params=FAMILIES)
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> SavedModel:
    return save_hf_model(tmp_path_factory.mktemp(request.param), _config(request.param), seed=31)


def _prompts(lens: list[int], seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, SHAPE["vocab_size"], (n,), generator=gen).tolist() for n in lens]


def _caches(model: CausalLM, pages: int, block_size: int = 4) -> list[tuple[torch.Tensor, torch.Tensor]]:
    shape = (pages, block_size, model.num_kv_heads, model.head_dim)
    return [(torch.zeros(shape), torch.zeros(shape)) for _ in range(model.num_layers)]


def _step(tables: torch.Tensor, lens: list[int], chunks: list[list[int]], block_size: int = 4) -> list[np.ndarray]:
    """The arrays of one forward appending chunks[i] to sequence i (lens updated)."""
    ids, positions, slots, starts = [], [], [], [0]
    for seq, chunk in enumerate(chunks):
        for offset, token in enumerate(chunk):
            pos = lens[seq] + offset
            ids.append(token)
            positions.append(pos)
            slots.append(int(tables[seq, pos // block_size]) * block_size + pos % block_size)
        lens[seq] += len(chunk)
        starts.append(starts[-1] + len(chunk))
    return [np.array(ids, np.int64), np.array(positions, np.int64), np.array(slots, np.int64),
            tables.numpy(), np.array(lens, np.int32), np.array(starts, np.int32)]


@torch.inference_mode()
def _compare_steps(model: CausalLM, exact: bool = False) -> None:
    """Prefill on torch, then decode steps on both from the same pages: hidden states, the K/V each writes and
    the logits within float tolerance."""
    num_seqs, per_seq = len(PROMPT_LENS), 16  # 64 positions of 4-token pages each
    pages = num_seqs * per_seq + 3
    tables = torch.randperm(pages, generator=torch.Generator().manual_seed(1))[:num_seqs * per_seq]
    tables = tables.view(num_seqs, per_seq).to(torch.int32)
    caches = _caches(model, pages)
    native = NativeDecoder(model, cast(PagedKVCache, SimpleNamespace(layers=caches)), exact=exact)
    lens = [0] * num_seqs

    def torch_forward(arrays: list[np.ndarray]) -> torch.Tensor:
        ids, positions, slots, tables_, seq_lens, starts = (torch.from_numpy(a) for a in arrays)
        return model(ids, positions, caches, AttentionMetadata(slots, tables_, seq_lens, starts))

    torch_forward(_step(tables, lens, _prompts(PROMPT_LENS)))
    extra = _prompts([40] * num_seqs, seed=2)
    at = 0
    for size in [1] * 12 + [3, 1, 3] + [1] * 12:  # 12 + 12 one-token steps pass every window again
        chunks = [e[at:at + size] for e in extra]
        at += size
        before = [(k.clone(), v.clone()) for k, v in caches]
        arrays = _step(tables, lens, chunks)
        expected = torch_forward(arrays)
        written = [(k.clone(), v.clone()) for k, v in caches]
        for (k, v), (k0, v0) in zip(caches, before, strict=True):
            k.copy_(k0)
            v.copy_(v0)
        step = SimpleNamespace(input_ids=arrays[0], positions=arrays[1], slot_mapping=arrays[2],
                               block_tables=arrays[3], seq_lens=arrays[4], query_start_loc=arrays[5], given=None,
                               key_ends=None)
        hidden = native.forward(cast(StepInputs, step))
        torch.testing.assert_close(hidden, expected, rtol=1e-4, atol=1e-4)
        for (k, v), (k1, v1) in zip(caches, written, strict=True):
            torch.testing.assert_close(k, k1, rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(v, v1, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(native.compute_logits(hidden), model.compute_logits(hidden), rtol=1e-4, atol=1e-4)


def test_hidden_states_pages_and_logits_match_the_torch_forward(family: SavedModel) -> None:
    model = load_model(family.path)[0]
    _compare_steps(model)


def test_greedy_tokens_match_the_torch_path(family: SavedModel, monkeypatch: pytest.MonkeyPatch) -> None:
    """40 tokens after prompts that pass the sliding windows, several sequences per decode step; the engine
    picks the native decoder for every family (greedy asserts it)."""
    prompts = _prompts([3, 12, 20, 11, 30], seed=5)
    native = greedy(family.path, "q8", monkeypatch, 40, prompts)
    assert native == greedy(family.path, "torch", monkeypatch, 40, prompts)


def _quantized(model: CausalLM, qtype: Q) -> CausalLM:
    """`model` with every projection and the (tied) embedding in `qtype` blocks."""
    def blocks(weight: torch.Tensor) -> torch.Tensor:
        return torch.from_numpy(quants.quantize(weight.detach().float().numpy(), qtype)).contiguous()

    for module in list(model.modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, PackedLinear | RowParallelLinear):
                shards = (child.shard_names, child.shard_sizes) if isinstance(child, PackedLinear) else ((), ())
                quant = QuantLinear(blocks(child.weight), int(qtype), child.in_features, torch.float32, *shards,
                                    bias=child.bias is not None)
                if child.bias is not None and quant.bias is not None:
                    quant.bias.copy_(child.bias.detach())
                setattr(module, child_name, quant)
    embed = model.model.embed_tokens
    assert isinstance(embed, torch.nn.Embedding)
    model.model.embed_tokens = QuantEmbedding(blocks(embed.weight), int(qtype), embed.embedding_dim, torch.float32)
    model.lm_head = model.model.embed_tokens.as_linear()
    return model


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_1], ids=lambda q: q.name)
@pytest.mark.parametrize("name", ["gemma3", "qwen3"])
def test_block_weights_match_in_exact_mode(name: str, qtype: Q, tmp_path: Path) -> None:
    """Integer blocks (a quantized, scaled embedding too) in exact mode: the torch path's arithmetic."""
    saved = save_hf_model(tmp_path, _config(name), seed=32)
    _compare_steps(_quantized(load_model(saved.path)[0], qtype), exact=True)
