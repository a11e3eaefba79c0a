"""What the tiers store and report: a page's identity, per-tier counters and KV events."""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple, TypeAlias

if TYPE_CHECKING:  # numpy arrays come in, but the gateway imports these records without numpy
    import numpy as np

TokenIds: TypeAlias = "Sequence[int] | np.ndarray"

CPU = "CPU"  # vLLM's KV-event medium for host memory
DISK = "DISK"


def token_bytes(tokens: TokenIds) -> bytes:
    """A page's token ids as stored: int32, little-endian."""
    return struct.pack(f"<{len(tokens)}i", *tokens)


@dataclass(frozen=True, slots=True)
class PageKey:
    """One page's prefix-chain identity: its hash, its parent's hash and its token ids (int32 bytes)."""

    hash: int
    parent: int
    tokens: bytes
    first: bool

    @classmethod
    def of(cls, hash: int, parent: int, tokens: TokenIds, first: bool) -> PageKey:
        return cls(int(hash), int(parent), token_bytes(tokens), bool(first))

    def matches(self, parent: int, tokens: TokenIds) -> bool:
        """NOTE: a hash hit is confirmed against parent and tokens (as the pool's match_prefix does), so a
        hash collision is a miss, never another prefix's pages."""
        return self.parent == parent and self.tokens == token_bytes(tokens)

    @property
    def token_ids(self) -> list[int]:
        return list(struct.unpack(f"<{len(self.tokens) // 4}i", self.tokens))


class TierEvent(NamedTuple):
    """A KV event: "BlockStored" when pages enter a tier, "BlockRemoved" when they leave it."""

    name: str
    hashes: tuple[int, ...]
    medium: str  # CPU or DISK
    keys: tuple[PageKey, ...]  # parents and token ids, for BlockStored's wire form


@dataclass
class TierStats:
    """One tier's size and counters (pages and bytes; load time in seconds)."""

    pages: int = 0
    bytes: int = 0
    capacity_bytes: int = 0
    hits: int = 0
    stores: int = 0
    skipped_stores: int = 0  # the disk's write backlog was full: the page was not stored
    evictions: int = 0
    bytes_read: int = 0
    load_seconds: float = 0.0
    enabled: bool = True


@dataclass
class StackStats:
    host: TierStats | None
    disk: TierStats | None
