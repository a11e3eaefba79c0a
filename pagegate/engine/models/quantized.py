"""Layers whose weights stay in GGUF blocks (F16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K) and are decoded
as they are used."""

from __future__ import annotations

import torch
from torch import nn

from pagegate.kernels.quant import dequantize_rows, quantized_matmul


class QuantLinear(nn.Module):
    """A linear layer over a block-quantized weight [N, K]; packed projections keep their shard names."""

    blocks: torch.Tensor  # a buffer

    def __init__(self, blocks: torch.Tensor, qtype: int, in_features: int, dtype: torch.dtype,
                 shard_names: tuple[str, ...] = (), shard_sizes: tuple[int, ...] = (), bias: bool = False) -> None:
        super().__init__()
        self.register_buffer("blocks", blocks)
        self.qtype, self.in_features, self.out_features = qtype, in_features, blocks.shape[0]
        self.shard_names, self.shard_sizes, self.dtype = shard_names, shard_sizes, dtype
        self.bias = nn.Parameter(torch.empty(self.out_features, dtype=dtype), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = quantized_matmul(x.reshape(-1, self.in_features), self.blocks, self.qtype)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)


class QuantLinearStack(nn.Module):
    """A packed projection whose shards the file keeps in blocks of different types (Q4_K_M's Q4_K q and k beside
    a Q6_K v): one QuantLinear a type, their outputs side by side, one bias over them all."""

    def __init__(self, parts: list[QuantLinear], shard_names: tuple[str, ...], shard_sizes: tuple[int, ...],
                 bias: bool = False) -> None:
        super().__init__()
        self.parts = nn.ModuleList(parts)
        self.in_features, self.out_features = parts[0].in_features, sum(part.out_features for part in parts)
        self.shard_names, self.shard_sizes = shard_names, shard_sizes
        dtype = parts[0].dtype
        self.bias = nn.Parameter(torch.empty(self.out_features, dtype=dtype), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.cat([part(x) for part in self.parts], dim=-1)
        return out if self.bias is None else out + self.bias


class QuantEmbedding(nn.Module):
    """Token embeddings in blocks: a lookup decodes only the rows it needs."""

    blocks: torch.Tensor  # a buffer

    def __init__(self, blocks: torch.Tensor, qtype: int, embedding_dim: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.register_buffer("blocks", blocks)
        self.qtype, self.embedding_dim, self.dtype = qtype, embedding_dim, dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = dequantize_rows(self.blocks, self.qtype, self.embedding_dim, ids.reshape(-1))
        return rows.to(self.dtype).reshape(*ids.shape, self.embedding_dim)

    def as_linear(self) -> QuantLinear:
        """The tied output layer: the same blocks read as a [vocab, hidden] weight."""
        return QuantLinear(self.blocks, self.qtype, self.embedding_dim, self.dtype)
