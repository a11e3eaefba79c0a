"""Llama-family decoder (Llama, Mistral, Qwen2) over flattened tokens and a paged KV cache."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pagegate import kernels
from pagegate.engine.model_config import ModelConfig, RopeConfig
from pagegate.engine.parallel import SINGLE, TensorParallel
from pagegate.kernels.quant import linear

KVCache = tuple[torch.Tensor, torch.Tensor]  # (k_cache, v_cache), each [num_blocks, block_size, Hkv, D]


@dataclass
class AttentionMetadata:
    """Where this step's tokens go in the cache and which pages each sequence reads."""

    slot_mapping: torch.Tensor  # [T] int64; -1: do not write
    block_tables: torch.Tensor  # [B, max_blocks] int32
    seq_lens: torch.Tensor  # [B] int32, context length including this step's tokens
    query_start_loc: torch.Tensor  # [B + 1] int32, offsets of each sequence's tokens in the flat batch


class Linear(nn.Linear):
    """nn.Linear through pagegate's kernels (decode steps stream the weight on every core)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


class PackedLinear(Linear):
    """Several checkpoint projections stacked along the output dim (q/k/v, gate/up) for one matmul.

    Column-parallel under tensor parallelism: each shard holds `shard_rows[i]` of its checkpoint tensor."""

    def __init__(self, in_features: int, shard_names: tuple[str, ...], shard_sizes: tuple[int, ...],
                 bias: bool, shard_rows: tuple[slice, ...] | None = None) -> None:
        super().__init__(in_features, sum(shard_sizes), bias=bias)
        self.shard_names = shard_names  # the checkpoint's module names, e.g. ("q_proj", "k_proj", "v_proj")
        self.shard_sizes = shard_sizes
        self.shard_rows = shard_rows or tuple(slice(None) for _ in shard_names)


class RowParallelLinear(Linear):
    """A linear layer whose input features are split across ranks (o_proj, down_proj): each rank holds
    checkpoint columns `in_columns`, and one all-reduce sums the partial outputs (the bias added once after)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TensorParallel) -> None:
        local, first = tp.split(in_features, "the input features of a row-parallel layer")
        super().__init__(local, out_features, bias=bias)
        self.tp = tp
        self.in_columns = slice(first, first + local)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return linear(x, self.weight, self.bias)
        out = self.tp.all_reduce(linear(x, self.weight))
        return out if self.bias is None else out + self.bias


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:  # one fused op, bit-identical to the steps below
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # Normalise in float32, scale in the model dtype, as Hugging Face does.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rope_inv_freq(head_dim: int, rope: RopeConfig, max_position_embeddings: int) -> torch.Tensor:
    """Inverse frequencies [head_dim / 2], with linear or llama3 scaling."""
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if rope.freq_factors is not None:
        return inv_freq / torch.tensor(rope.freq_factors, dtype=torch.float32)
    if rope.type == "linear":
        return inv_freq / rope.factor
    if rope.type != "llama3":
        return inv_freq
    old_len = rope.original_max_position_embeddings or max_position_embeddings
    low_freq_wavelen = old_len / rope.low_freq_factor
    high_freq_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Neox-style RoPE (rotate_half, as HF Llama) with a cos/sin table for every position.

    The table holds cos and a signed sin over the whole head: x -> x cos + roll(x, D/2) sin'
    is HF's x cos + rotate_half(x) sin in four ops, with the same roundings."""

    cos_sin: torch.Tensor  # a buffer

    def __init__(self, head_dim: int, rope: RopeConfig, max_position_embeddings: int) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.rope = rope
        self.max_position_embeddings = max_position_embeddings
        self.register_buffer("cos_sin", torch.empty(max_position_embeddings, 2 * head_dim), persistent=False)
        if not self.cos_sin.is_meta:
            self.build_cache()

    def build_cache(self) -> None:
        """Fill the float32 [max_pos, 2 * head_dim] table: (cos, cos) then (-sin, sin) per position."""
        inv_freq = rope_inv_freq(self.head_dim, self.rope, self.max_position_embeddings)
        positions = torch.arange(self.max_position_embeddings, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq)
        cos, sin = freqs.cos(), freqs.sin()
        table = torch.cat([cos, cos, -sin, sin], dim=-1)
        self.cos_sin = table.to(self.cos_sin.device)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, signed sin [T, 1, head_dim] for the given positions."""
        cos, sin = self.cos_sin[positions].unsqueeze(1).chunk(2, dim=-1)
        return cos, sin


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, H, D]: halves (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin), in float32."""
    x32 = x if x.dtype == torch.float32 else x.float()
    rotated = x32 * cos + x32.roll(x.shape[-1] // 2, dims=-1) * sin
    return rotated if x.dtype == torch.float32 else rotated.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, sliding_window: int | None, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        d = self.head_dim = config.head_dim
        self.num_heads, first_head = tp.split(config.num_attention_heads, "the number of attention heads")
        self.num_kv_heads, first_kv = tp.kv_heads(config.num_key_value_heads)
        self.scale = self.head_dim**-0.5
        self.sliding_window = sliding_window
        q_size, kv_size = self.num_heads * d, self.num_kv_heads * d
        q_rows, kv_rows = slice(first_head * d, first_head * d + q_size), slice(first_kv * d, first_kv * d + kv_size)
        self.qkv_proj = PackedLinear(config.hidden_size, ("q_proj", "k_proj", "v_proj"), (q_size, kv_size, kv_size),
                                     bias=config.qkv_bias, shard_rows=(q_rows, kv_rows, kv_rows))
        self.o_proj = RowParallelLinear(config.num_attention_heads * d, config.hidden_size, config.o_bias, tp)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: KVCache,
                attn: AttentionMetadata) -> torch.Tensor:
        q_size, k_size, _ = self.qkv_proj.shard_sizes
        qkv = self.qkv_proj(x)
        qk = apply_rope(qkv[:, :q_size + k_size].view(-1, self.num_heads + self.num_kv_heads, self.head_dim),
                        cos, sin)  # q and k rotated together: one set of ops
        q, k = qk[:, :self.num_heads], qk[:, self.num_heads:]
        v = qkv[:, q_size + k_size:].view(-1, self.num_kv_heads, self.head_dim)
        k_cache, v_cache = kv_cache
        kernels.write_kv(k, v, k_cache, v_cache, attn.slot_mapping)
        out = kernels.paged_attention(q, k_cache, v_cache, attn.block_tables, attn.seq_lens,
                                      attn.query_start_loc, self.scale, self.sliding_window)
        return self.o_proj(out.reshape(-1, self.num_heads * self.head_dim))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, config: ModelConfig, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        size, first = tp.split(config.intermediate_size, "the intermediate size")
        rows = slice(first, first + size)
        self.gate_up_proj = PackedLinear(config.hidden_size, ("gate_proj", "up_proj"), (size, size),
                                         bias=config.mlp_bias, shard_rows=(rows, rows))
        self.down_proj = RowParallelLinear(config.intermediate_size, config.hidden_size, config.mlp_bias, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, config.sliding_window_for(layer), tp)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config, tp)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: KVCache,
                attn: AttentionMetadata) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, attn)
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderModel(nn.Module):
    """Embeddings, decoder layers and the final norm (the checkpoint's `model.` prefix)."""

    def __init__(self, config: ModelConfig, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i, tp) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(config.head_dim, config.rope, config.max_position_embeddings)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                attn: AttentionMetadata) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary(positions)
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            x = layer(x, cos, sin, kv_cache, attn)
        return self.norm(x)


class CausalLM(nn.Module):
    """The whole model: `forward` gives hidden states, `compute_logits` the next-token logits.

    Under tensor parallelism (`tp`) each rank holds its slice of the attention heads, KV heads and MLP;
    the embedding and LM head stay whole on every rank: sampling on rank 0 needs every logit, and a
    vocab-parallel head would add an all-gather of [batch, vocab] logits to every step."""

    def __init__(self, config: ModelConfig, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.config = config
        self.tp = tp
        self.model = DecoderModel(config, tp)
        self.lm_head: nn.Module = Linear(config.hidden_size, config.vocab_size, bias=False)  # or a QuantLinear
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share the embedding matrix with lm_head when the config says so."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                attn: AttentionMetadata) -> torch.Tensor:
        """Hidden states [T, hidden] for flattened tokens input_ids [T] at positions [T]."""
        return self.model(input_ids, positions, kv_caches, attn)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits [N, vocab] for the rows of hidden [N, hidden] that sample."""
        return self.lm_head(hidden).float()

    @property
    def num_layers(self) -> int:
        return self.config.num_hidden_layers

    @property
    def num_kv_heads(self) -> int:
        """KV heads this rank holds in every page."""
        return self.tp.kv_heads(self.config.num_key_value_heads)[0]

    @property
    def head_dim(self) -> int:
        return self.config.head_dim

    @property
    def dtype(self) -> torch.dtype:
        return self.model.norm.weight.dtype  # the embedding may be kept in quantized blocks

    @property
    def device(self) -> torch.device:
        return self.model.norm.weight.device


def build_empty_model(config: ModelConfig, dtype: torch.dtype, device: str | torch.device,
                      tp: TensorParallel = SINGLE) -> CausalLM:
    """A model (this rank's slice of it) with uninitialised weights, ready for the loader to fill."""
    with torch.device("meta"):
        model = CausalLM(config, tp)
    model = model.to(dtype=dtype).to_empty(device=device)
    model.tie_weights()  # to_empty gives each reference to a shared weight its own storage
    model.model.rotary.build_cache()  # a non-persistent buffer: to_empty left it uninitialised
    return model.eval().requires_grad_(False)
