"""Tiny random models of the families pagegate runs beyond Llama, built from their real block shapes with
transformers' own classes and saved with their families' tokenizers; and their GGUF files, as llama.cpp's
`convert_hf_to_gguf.py` writes them."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.peers import llamacpp

from .conftest import SavedModel, hf, save_hf_model
from .family_tokenizers import save_gemma_tokenizer, save_qwen3_tokenizer

SHAPE = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=256)
ORIGINAL_CONTEXT = 128  # Phi-3's LongRoPE switches factors past it


def _gemma3(vocab: int) -> Any:
    """Gemma 3 270M's block (one global layer in six, QK-norm, local RoPE base) at a tiny width."""
    rope = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "default", "rope_theta": 1e6}}
    return hf().Gemma3TextConfig(**SHAPE, vocab_size=vocab, num_hidden_layers=7, head_dim=64,
                                 query_pre_attn_scalar=64, sliding_window=8, rope_parameters=rope,
                                 pad_token_id=0, eos_token_id=1, bos_token_id=2)


def _gemma2(vocab: int) -> Any:
    """Gemma 2's block: alternating windows, soft-capped attention and logits (caps small enough to bite)."""
    return hf().Gemma2Config(**SHAPE, vocab_size=vocab, num_hidden_layers=4, head_dim=32, query_pre_attn_scalar=32,
                             sliding_window=8, attn_logit_softcapping=5.0, final_logit_softcapping=3.0,
                             pad_token_id=0, eos_token_id=1, bos_token_id=2)


def _qwen3(vocab: int) -> Any:
    """Qwen3's block: QK-norm, no biases, head_dim 32 != hidden / heads."""
    return hf().Qwen3Config(**SHAPE, vocab_size=vocab, num_hidden_layers=2, head_dim=32)


def _phi3(vocab: int) -> Any:
    """Phi-3.5 mini's block: fused qkv and gate_up tensors, LongRoPE short and long factors."""
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": ORIGINAL_CONTEXT,
            "short_factor": [1.0 + 0.1 * i for i in range(8)], "long_factor": [2.0 + 0.5 * i for i in range(8)]}
    return hf().Phi3Config(**SHAPE, vocab_size=vocab, num_hidden_layers=2, rope_parameters=rope,
                           original_max_position_embeddings=ORIGINAL_CONTEXT, pad_token_id=0, bos_token_id=2,
                           eos_token_id=1)


FAMILIES: dict[str, tuple[Callable[[int], Any], Callable[[Path], None]]] = {
    "gemma3": (_gemma3, save_gemma_tokenizer),
    "gemma2": (_gemma2, save_gemma_tokenizer),
    "qwen3": (_qwen3, save_qwen3_tokenizer),
    "phi3": (_phi3, save_gemma_tokenizer),  # Phi-3's converter wants a SentencePiece tokenizer.model
}


WIDE = dict(SHAPE, hidden_size=256, intermediate_size=512)  # K-quant rows are multiples of 256 values


def save_family(folder: Path, family: str, seed: int = 11, wide: bool = False) -> SavedModel:
    """A random `family` model with its tokenizer in `folder` (its vocabulary the tokenizer's size)."""
    make_config, save_tokenizer = FAMILIES[family]
    save_tokenizer(folder)
    config = make_config(len(hf().AutoTokenizer.from_pretrained(folder)))
    for key, value in (WIDE if wide else {}).items():
        setattr(config, key, value)
    saved = save_hf_model(folder, config, seed=seed)
    save_tokenizer(folder)  # the model's save_pretrained wrote its own generation_config.json
    return saved


def convert(saved: SavedModel, folder: Path, outtype: str) -> Path:
    """The model as the GGUF file llama.cpp's converter writes (its BPE pre-tokenizer named for it)."""
    arch = saved.hf_model.config.model_type
    pre = "qwen2" if arch == "qwen3" else None
    return llamacpp.convert(saved.path, folder / f"{arch}-{outtype}.gguf", outtype, pre=pre)
