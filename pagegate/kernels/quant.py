"""Matmuls on pagegate's CPU kernel (pagegate.kernels.cpu_quant): weights kept in GGUF blocks
(F16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K), and float32 linear layers with few input rows (decode steps), where
streaming the weight on every core beats the BLAS's single-threaded matrix-vector product."""

from __future__ import annotations

from types import ModuleType

import numpy as np
import torch
import torch.nn.functional as F

from pagegate.kernels.dispatch import quant_kernel

F32 = 0  # ggml's type id of plain float32 rows
F16, BF16 = 1, 30  # ggml's type ids of float16 and bfloat16 rows
BF16_PANELS, F16_PANELS, F32_PANELS = 97, 98, 99  # pagegate's ids of such rows in panels (panels(); cpu_panels.h)
PANELS = {F32: F32_PANELS, F16: F16_PANELS, BF16: BF16_PANELS}
FUSED_MAX_ROWS = 8  # up to this many input rows decode each block once for all of them
TILE_BYTES = 1 << 21  # beyond, float32 tiles of the weight this big, each used by one GEMM while in cache


def block_types() -> frozenset[int]:
    """The ggml type ids worth keeping in blocks (none when the extension is not built)."""
    kernel = quant_kernel()
    return frozenset(kernel.BLOCK_BYTES) - {F32, *PANELS.values()} if kernel is not None else frozenset()


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear; a float32 CPU call with at most FUSED_MAX_ROWS rows runs on the kernel."""
    kernel = quant_kernel()
    if (kernel is None or x.dim() != 2 or x.shape[0] > FUSED_MAX_ROWS or x.device.type != "cpu"
            or x.dtype != torch.float32 or weight.dtype != torch.float32 or weight.shape[1] % 32
            or not weight.is_contiguous() or weight.requires_grad):
        return F.linear(x, weight, bias)
    out = kernel.matmul(x, weight.view(torch.uint8), F32)
    return out if bias is None else out + bias


def _required_kernel() -> ModuleType:
    kernel = quant_kernel()
    if kernel is None:
        raise RuntimeError("weights kept in GGUF blocks need pagegate.kernels.cpu_quant, which is not built")
    return kernel


def quantized_matmul(x: torch.Tensor, blocks: torch.Tensor, qtype: int) -> torch.Tensor:
    """x [M, K] @ W.T, W [N, K] given as its blocks [N, K / block values * block bytes]; float32 inside."""
    kernel = _required_kernel()
    x32 = x.float()
    if x32.shape[0] <= FUSED_MAX_ROWS:
        out = kernel.matmul(x32, blocks, qtype)
    else:
        k = x32.shape[1]
        rows = max(32, TILE_BYTES // (4 * k) // 32 * 32)  # whole groups (cpu_qx8.h) or panels (cpu_panels.h) a tile
        out = torch.cat([x32 @ kernel.dequantize(blocks[i:i + rows], qtype, k).t()
                         for i in range(0, blocks.shape[0], rows)], dim=1)
    return out.to(x.dtype)


def interleaved(blocks: torch.Tensor | np.ndarray, qtype: int) -> tuple[torch.Tensor, int]:
    """An integer-block matrix (Q4_0 ... Q8_0, K-quants) as the integer kernels read it best, and its type id: its
    rows interleaved eight at a time (cpu_qx8.h: the file's bytes, permuted) in a new tensor; any other matrix as it
    is (an array copied into a tensor). `blocks` may be a read-only array (a file's mapping)."""
    kept, kind = _required_kernel().interleaved(blocks, qtype)
    return torch.from_numpy(kept), kind


def panels(blocks: torch.Tensor, qtype: int) -> tuple[torch.Tensor, int]:
    """An F32, F16 or BF16 matrix (its bytes [N, row bytes]) as the native step reads it, and its type id
    (PANELS[qtype]): rows in panels of 32, each k-major (cpu_panels.h; the same values, permuted), in a new
    tensor."""
    rows, kind = _required_kernel().panels(blocks, qtype)
    return torch.from_numpy(rows), kind


def dequantize_rows(blocks: torch.Tensor, qtype: int, k: int, rows: torch.Tensor) -> torch.Tensor:
    """The float32 rows `rows` of W (an embedding lookup)."""
    return _required_kernel().dequantize(blocks, qtype, k, rows)
