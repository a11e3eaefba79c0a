"""Gemma 2 and Gemma 3: the Llama attention and a GeGLU MLP in a block of four norms (before and after
attention, before and after the MLP), the embedding scaled by sqrt(hidden), norms that scale by (1 + w).

The norms hold the (1 + w) they multiply by, as llama.cpp's GGUF files store them: a Hugging Face checkpoint's
w gets its 1 added when it is loaded (`from_hf`). Gemma 2 soft-caps attention scores and logits; Gemma 3
has QK-norm and its own RoPE base on the sliding-window layers (both from the config)."""

from __future__ import annotations

import torch
from torch import nn

from pagegate.engine.models.base import CausalLM
from pagegate.engine.models.config import ModelConfig
from pagegate.engine.models.layers import AttentionMetadata, KVCache, RMSNorm
from pagegate.engine.models.llama import MLP, Attention, DecoderModel
from pagegate.engine.parallel import SINGLE, TensorParallel


class GemmaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.local_rope = config.rope_for(layer) is not config.rope
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(hidden, eps)
        self.self_attn = Attention(config, config.sliding_window_for(layer), tp)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = RMSNorm(hidden, eps)
        self.mlp = MLP(config, tp)
        self.post_feedforward_layernorm = RMSNorm(hidden, eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: KVCache,
                attn: AttentionMetadata) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, attn))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class GemmaForCausalLM(CausalLM):
    """Gemma2ForCausalLM and Gemma3ForCausalLM (text) checkpoints."""

    def __init__(self, config: ModelConfig, tp: TensorParallel = SINGLE) -> None:
        super().__init__(config, tp, DecoderModel(config, tp, GemmaDecoderLayer))

    def from_hf(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.float() + 1.0 if name.endswith("norm.weight") else tensor
