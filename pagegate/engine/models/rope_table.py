"""RoPE's cos/sin table, in numpy: the torch models' RotaryEmbedding and the native core (which imports no torch)
read the very same floats.

NOTE: computed in float64 and rounded once to float32, so the table does not depend on which float32 sin/cos a
library (or an instruction set) brings; transformers computes in float32, within an ulp of this.
"""

from __future__ import annotations

import math

import numpy as np

from pagegate.engine.models.config import RopeConfig


def inv_freq(head_dim: int, rope: RopeConfig, max_position_embeddings: int, long: bool = False) -> np.ndarray:
    """Inverse frequencies [head_dim / 2] (float64), with linear, llama3 or longrope scaling (`long`: its long
    factors)."""
    exponents = np.arange(0, head_dim, 2, dtype=np.float64) / head_dim
    if rope.type == "longrope":
        factors = rope.long_factor if long else rope.short_factor
        return 1.0 / (np.asarray(factors, dtype=np.float64) * rope.theta ** exponents)
    inverse = 1.0 / rope.theta ** exponents
    if rope.freq_factors is not None:
        return inverse / np.asarray(rope.freq_factors, dtype=np.float64)
    if rope.type == "linear":
        return inverse / rope.factor
    if rope.type != "llama3":
        return inverse
    old_len = rope.original_max_position_embeddings or max_position_embeddings
    low_freq_wavelen = old_len / rope.low_freq_factor
    high_freq_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inverse
    scaled = np.where(wavelen > low_freq_wavelen, inverse / rope.factor, inverse)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return np.where(is_medium, smoothed, scaled)


def uses_long_factors(rope: RopeConfig, max_model_len: int) -> bool:
    """LongRoPE's long factors for a served context of `max_model_len`: beyond the original context (llama.cpp's
    rule, for every position)."""
    original = rope.original_max_position_embeddings
    return rope.type == "longrope" and original is not None and max_model_len > original


def cos_sin_table(head_dim: int, rope: RopeConfig, max_position_embeddings: int, long: bool = False) -> np.ndarray:
    """The float32 [max_position_embeddings, 2 * head_dim] table: (cos, cos) then (-sin, sin) per position (the
    signed sin that makes x cos + roll(x, D/2) sin' HF's x cos + rotate_half(x) sin)."""
    freqs = np.outer(np.arange(max_position_embeddings, dtype=np.float64),
                     inv_freq(head_dim, rope, max_position_embeddings, long))
    half = freqs.shape[1]
    table = np.empty((max_position_embeddings, 4 * half), dtype=np.float32)  # each quarter rounded once, in place
    cos = np.cos(freqs)
    cos *= rope.attention_factor
    table[:, :half] = table[:, half:2 * half] = cos
    sin = np.sin(freqs, out=freqs)
    sin *= rope.attention_factor
    table[:, 3 * half:] = sin
    table[:, 2 * half:3 * half] = np.negative(sin, out=sin)
    return table
