"""The Llama decoder over flattened tokens and a paged KV cache. Mistral (a sliding window), Qwen2 (q/k/v
biases, per-layer windows), Qwen3 (QK-norm) and Phi-3 (fused checkpoint projections, LongRoPE) are the same
graph with other config values, so they run here too; Gemma reuses its attention and MLP."""

from __future__ import annotations

import torch
from torch import nn

from pagegate.engine.models.base import CausalLM, Decoder
from pagegate.engine.models.config import ModelConfig
from pagegate.engine.models.layers import (
    AttentionMetadata,
    Given,
    KVCache,
    PackedLinear,
    PagedAttention,
    RMSNorm,
    RotaryEmbedding,
    RowParallelLinear,
    activation,
    apply_rope,
)
from pagegate.engine.parallel import SINGLE, TensorParallel


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, sliding_window: int | None, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        d = self.head_dim = config.head_dim
        self.num_heads, first_head = tp.split(config.num_attention_heads, "the number of attention heads")
        self.num_kv_heads, first_kv = tp.kv_heads(config.num_key_value_heads)
        self.attn = PagedAttention(config.attention_scale, sliding_window, config.attn_logit_softcap)
        self.q_norm = RMSNorm(d, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(d, config.rms_norm_eps) if config.qk_norm else None
        q_size, kv_size = self.num_heads * d, self.num_kv_heads * d
        q_rows, kv_rows = slice(first_head * d, first_head * d + q_size), slice(first_kv * d, first_kv * d + kv_size)
        self.qkv_proj = PackedLinear(config.hidden_size, ("q_proj", "k_proj", "v_proj"), (q_size, kv_size, kv_size),
                                     bias=config.qkv_bias, shard_rows=(q_rows, kv_rows, kv_rows))
        self.o_proj = RowParallelLinear(config.num_attention_heads * d, config.hidden_size, config.o_bias, tp)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: KVCache,
                attn: AttentionMetadata) -> torch.Tensor:
        q_size, k_size, _ = self.qkv_proj.shard_sizes
        qkv = self.qkv_proj(x)
        qk = qkv[:, :q_size + k_size].view(-1, self.num_heads + self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            qk = torch.cat([self.q_norm(qk[:, :self.num_heads]), self.k_norm(qk[:, self.num_heads:])], dim=1)
        qk = apply_rope(qk, cos, sin)  # q and k rotated together: one set of ops
        q, k = qk[:, :self.num_heads], qk[:, self.num_heads:]
        v = qkv[:, q_size + k_size:].view(-1, self.num_kv_heads, self.head_dim)
        out = self.attn(q, k, v, kv_cache, attn)
        return self.o_proj(out.reshape(-1, self.num_heads * self.head_dim))


class MLP(nn.Module):
    """A gated MLP: down(act(gate(x)) * up(x)), SwiGLU (silu) or GeGLU (tanh GELU)."""

    def __init__(self, config: ModelConfig, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        size, first = tp.split(config.intermediate_size, "the intermediate size")
        rows = slice(first, first + size)
        self.gate_up_proj = PackedLinear(config.hidden_size, ("gate_proj", "up_proj"), (size, size),
                                         bias=config.mlp_bias, shard_rows=(rows, rows))
        self.down_proj = RowParallelLinear(config.intermediate_size, config.hidden_size, config.mlp_bias, tp)
        self.act = activation(config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(self.act(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.local_rope = config.rope_for(layer) is not config.rope  # the decoder's second rotary table
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, config.sliding_window_for(layer), tp)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config, tp)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: KVCache,
                attn: AttentionMetadata) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, attn)
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderModel(Decoder):
    """Embeddings, decoder layers and the final norm (the checkpoint's `model.` prefix)."""

    def __init__(self, config: ModelConfig, tp: TensorParallel = SINGLE,
                 layer_class: type[nn.Module] = DecoderLayer) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(layer_class(config, i, tp) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(config.head_dim, config.rope, config.max_position_embeddings)
        self.local_rotary = (RotaryEmbedding(config.head_dim, config.local_rope, config.max_position_embeddings)
                             if config.local_rope is not None else None)
        self.embed_scale = config.hidden_size**0.5 if config.is_gemma else None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                attn: AttentionMetadata, given: Given | None = None) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        if self.embed_scale is not None:
            x = x * torch.tensor(self.embed_scale, dtype=x.dtype)
        if given is not None:
            x[given[0]] = given[1].to(x.dtype)
        cos_sin = self.rotary(positions)
        local = self.local_rotary(positions) if self.local_rotary is not None else cos_sin
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            cos, sin = local if layer.local_rope else cos_sin
            x = layer(x, cos, sin, kv_cache, attn)
        return self.norm(x)


class LlamaForCausalLM(CausalLM):
    """Llama, Mistral, Qwen2 and Qwen3 checkpoints."""

    def __init__(self, config: ModelConfig, tp: TensorParallel = SINGLE) -> None:
        super().__init__(config, tp, DecoderModel(config, tp))

