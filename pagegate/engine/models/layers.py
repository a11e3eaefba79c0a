"""The building blocks every model family shares: linear layers (packed, row-parallel), RMSNorm, RoPE,
and the attention metadata of a step over the paged KV cache."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from pagegate import kernels
from pagegate.engine.models.config import RopeConfig
from pagegate.engine.models.rope_table import cos_sin_table, uses_long_factors
from pagegate.engine.parallel import TensorParallel
from pagegate.kernels.quant import linear

KVCache = tuple[torch.Tensor, torch.Tensor]  # (k_cache, v_cache), each [num_blocks, block_size, Hkv, D]
Given = tuple[torch.Tensor, torch.Tensor]  # (tokens [R], rows [R, hidden]): input rows in place of embeddings


@dataclass
class AttentionMetadata:
    """Where this step's tokens go in the cache and which pages each sequence reads."""

    slot_mapping: torch.Tensor  # [T] int64; -1: do not write
    block_tables: torch.Tensor  # [B, max_blocks] int32
    seq_lens: torch.Tensor  # [B] int32, context length including this step's tokens
    query_start_loc: torch.Tensor  # [B + 1] int32, offsets of each sequence's tokens in the flat batch
    key_ends: torch.Tensor | None = None  # [T] int64: the last position each token sees (None: itself)


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
        self.long = self._long(max_position_embeddings)  # longrope: see fit_context
        self.register_buffer("cos_sin", torch.empty(max_position_embeddings, 2 * head_dim), persistent=False)
        if not self.cos_sin.is_meta:
            self.build_cache()

    def build_cache(self) -> None:
        """Fill the float32 [max_pos, 2 * head_dim] table: (cos, cos) then (-sin, sin) per position."""
        table = cos_sin_table(self.head_dim, self.rope, self.max_position_embeddings, self.long)
        self.cos_sin = torch.from_numpy(table).to(self.cos_sin.device)

    def fit_context(self, max_model_len: int) -> None:
        """LongRoPE's factors for a served context of `max_model_len`: the long ones beyond the original
        context, the short ones within it, for every position (llama.cpp's rule). transformers instead
        switches a sequence to the long factors, recomputing its cache, once it grows past the original
        context; the two agree on every sequence that stays on one side of it."""
        long = self._long(max_model_len)
        if long != self.long:
            self.long = long
            self.build_cache()

    def _long(self, max_model_len: int) -> bool:
        return uses_long_factors(self.rope, max_model_len)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, signed sin [T, 1, head_dim] for the given positions."""
        cos, sin = self.cos_sin[positions].unsqueeze(1).chunk(2, dim=-1)
        return cos, sin


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """A gated MLP's activation: "silu" (SwiGLU) or "gelu_tanh" (GeGLU, tanh-approximated GELU)."""
    if name == "gelu_tanh":
        return partial(F.gelu, approximate="tanh")
    return F.silu


def softcap(x: torch.Tensor, cap: float | None) -> torch.Tensor:
    """cap * tanh(x / cap) (Gemma 2's logit soft-capping); x itself when there is no cap."""
    return x if cap is None else torch.tanh(x / cap) * cap


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, H, D]: halves (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin), in float32."""
    x32 = x if x.dtype == torch.float32 else x.float()
    rotated = x32 * cos + x32.roll(x.shape[-1] // 2, dims=-1) * sin
    return rotated if x.dtype == torch.float32 else rotated.to(x.dtype)


class PagedAttention(nn.Module):
    """Write this step's K/V into their pages, then attend over each sequence's pages. The kernels are
    chosen once (`use_kernels`, when the model is built), not per call."""

    def __init__(self, scale: float, sliding_window: int | None, softcap: float | None = None) -> None:
        super().__init__()
        self.scale = scale
        self.sliding_window = sliding_window
        self.softcap = softcap
        self.ops: kernels.AttentionOps | None = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache,
                attn: AttentionMetadata) -> torch.Tensor:
        if self.ops is None:  # a model built by hand, not by build_empty_model
            self.ops = kernels.AttentionOps(q.device)
        k_cache, v_cache = kv_cache
        self.ops.write_kv(k, v, k_cache, v_cache, attn.slot_mapping)
        return self.ops.paged_attention(q, k_cache, v_cache, attn.block_tables, attn.seq_lens,
                                        attn.query_start_loc, self.scale, self.sliding_window,
                                        softcap=self.softcap, key_ends=attn.key_ends)
