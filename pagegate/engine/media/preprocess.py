"""What every family's image preprocessing shares: the prepared image, transformers' rescale-then-normalize
arithmetic, and reading the checkpoint's processor configs. Torch-free."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pagegate.engine.errors import ModelLoadError


@dataclass(frozen=True)
class PreparedImage:
    """One image ready for the model: `tiles` uint8 [n, S, S, 3] (SmolVLM's row-major crops, then the global image;
    Gemma 3's one square; `normalize` makes them the encoder's input) and `text`, the prompt text that replaces the
    image's one placeholder.

    NOTE: tiles stay uint8 until the encoder runs: a fourth of float32's bytes across the seam and while the request
    lives (a 17-tile SmolVLM image: 13 MB, not 53)."""

    tiles: np.ndarray
    text: str


def rescale_normalize(frames: np.ndarray, rescale_factor: float | None,
                      mean_std: tuple[tuple[float, ...], tuple[float, ...]] | None) -> np.ndarray:
    """uint8 tiles [n, S, S, 3] -> float32 [n, 3, S, S], times `rescale_factor` (None: not rescaled), then minus
    mean and over std per channel (None: not normalized).

    NOTE: transformers rescales in float64 and rounds to float32, then normalizes in float32 (mean and std rounded to
    float32 first); the same order keeps the tiles bit-identical to its pixel_values."""
    tiles = frames.transpose(0, 3, 1, 2)
    values = (tiles.astype(np.float64) * rescale_factor).astype(np.float32) if rescale_factor is not None \
        else tiles.astype(np.float32)
    if mean_std is not None:
        mean, std = (np.asarray(v, dtype=np.float32)[:, None, None] for v in mean_std)
        values = (values - mean) / std
    return np.ascontiguousarray(values)


def three(values: float | list[float]) -> tuple[float, float, float]:
    if isinstance(values, (int, float)):
        return (float(values),) * 3
    if len(values) != 3:
        raise ModelLoadError(f"expected 3 per-channel values, got {values}")
    return float(values[0]), float(values[1]), float(values[2])


def read_json(path: Path) -> dict[str, Any]:
    if not path.exists():
        return {}
    loaded: dict[str, Any] = json.loads(path.read_text())
    return loaded
