"""Test pages whose bytes and tokens follow from their hash, so any page read back can be checked alone."""

from __future__ import annotations

import numpy as np
import torch

from pagegate.engine.kv_tiers import PageKey

BLOCK_SIZE = 4
PAGE_BYTES = 96
FINGERPRINT = b"model=tiny weights=abc tokenizer=def block=4 format=float16"


def page_data(hash: int, page_bytes: int = PAGE_BYTES) -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng(hash).integers(0, 256, page_bytes, dtype=np.uint8))


def page_key(hash: int, parent: int | None = None) -> PageKey:
    tokens = np.random.default_rng(hash + 1).integers(0, 50_000, BLOCK_SIZE, dtype=np.int32)
    return PageKey.of(hash, hash - 1 if parent is None else parent, tokens, parent == 0)


def chain(first_hash: int, length: int) -> list[PageKey]:
    """`length` pages, each the parent of the next (the first has parent 0)."""
    keys = [page_key(first_hash, 0)]
    for hash in range(first_hash + 1, first_hash + length):
        keys.append(page_key(hash, keys[-1].hash))
    return keys


def stacked(keys: list[PageKey], page_bytes: int = PAGE_BYTES) -> torch.Tensor:
    return torch.stack([page_data(key.hash, page_bytes) for key in keys]) if keys else \
        torch.empty((0, page_bytes), dtype=torch.uint8)


def tokens_of(key: PageKey) -> np.ndarray:
    return np.frombuffer(key.tokens, dtype="<i4")
