"""The fixed rotation of int4 KV pages: R x = H (s * x) / sqrt(d), with H the d x d Walsh-Hadamard matrix and s a
fixed pattern of signs (QuaRot's randomized Hadamard transform). A rotation spreads a head's outlier channels over
all of them, so one 4-bit scale per row fits the row better; it is orthogonal, so rotated queries meet rotated keys in the
same dot products, and the attention output (a sum of rotated values) is rotated back once per head (R^T y =
s * H y / sqrt(d)).

The butterflies run in the order the C kernels run them (cpu_page_rows.h, pg_rotate): pairs (j, j + h) within blocks
of 2h, h = 1, 2, 4, ..., so both give the same sums. d must be a power of two up to 256.
"""

from __future__ import annotations

import functools
import math

import torch

MAX_DIM = 256
# the signs s: bit i of the words below (word i // 64) set means s_i = -1 (fixed, arbitrary; cpu_page_rows.h's too)
SIGN_WORDS = (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB, 0xD6E8FEB86659FD93)


def rotatable(d: int) -> bool:
    return 2 <= d <= MAX_DIM and d & (d - 1) == 0


@functools.cache
def signs(d: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """s [d] as float32 +-1 (built once per size and device: attention rotates every layer's query every step)."""
    bits = [(SIGN_WORDS[i // 64] >> (i % 64)) & 1 for i in range(d)]
    return torch.tensor([-1.0 if b else 1.0 for b in bits], dtype=torch.float32, device=device)


def _hadamard(x: torch.Tensor) -> torch.Tensor:
    """H x over the last dimension (unnormalized), in float32."""
    d = x.shape[-1]
    y = x.reshape(-1, d)
    h = 1
    while h < d:
        pairs = y.view(-1, d // (2 * h), 2, h)
        y = torch.stack((pairs[:, :, 0] + pairs[:, :, 1], pairs[:, :, 0] - pairs[:, :, 1]), dim=2).view(-1, d)
        h *= 2
    return y.view(x.shape)


def rotate(x: torch.Tensor) -> torch.Tensor:
    """R x over the last dimension, in float32."""
    d = x.shape[-1]
    if not rotatable(d):
        raise ValueError(f"int4 pages rotate heads of a power-of-two size up to {MAX_DIM}, not {d}")
    return _hadamard(x.float() * signs(d, x.device)) * (1.0 / math.sqrt(d))


def unrotate(y: torch.Tensor) -> torch.Tensor:
    """R^T y over the last dimension, in float32."""
    d = y.shape[-1]
    return _hadamard(y.float()) * (1.0 / math.sqrt(d)) * signs(d, y.device)
