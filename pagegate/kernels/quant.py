"""Matmul with weights kept in GGUF blocks (Q4_0, Q4_1, Q8_0), on CPU (pagegate.kernels.cpu_quant)."""

from __future__ import annotations

import torch

from pagegate.kernels.dispatch import quant_kernel

FUSED_MAX_ROWS = 8  # up to this many input rows decode each block once for all of them
TILE_BYTES = 1 << 21  # beyond, float32 tiles of the weight this big, each used by one GEMM while in cache


def block_types() -> frozenset[int]:
    """The ggml type ids this machine can keep in blocks (none when the extension is not built)."""
    kernel = quant_kernel()
    return frozenset(kernel.BLOCK_BYTES) if kernel is not None else frozenset()


def quantized_matmul(x: torch.Tensor, blocks: torch.Tensor, qtype: int) -> torch.Tensor:
    """x [M, K] @ W.T, W [N, K] given as its blocks [N, K / 32 * block bytes]; float32 inside."""
    kernel = quant_kernel()
    x32 = x.float()
    if x32.shape[0] <= FUSED_MAX_ROWS:
        out = kernel.matmul(x32, blocks, qtype)
    else:
        k = x32.shape[1]
        rows = max(1, TILE_BYTES // (4 * k))
        out = torch.cat([x32 @ kernel.dequantize(blocks[i:i + rows], qtype, k).t()
                         for i in range(0, blocks.shape[0], rows)], dim=1)
    return out.to(x.dtype)


def dequantize_rows(blocks: torch.Tensor, qtype: int, k: int, rows: torch.Tensor) -> torch.Tensor:
    """The float32 rows `rows` of W (an embedding lookup)."""
    return quant_kernel().dequantize(blocks, qtype, k, rows)
