"""Who a request runs for, as the scheduler weighs it: its lane (online, or batch work that takes only what online
traffic leaves) and its API key's share of the pages (a weight against other keys, a quota). Torch-free: the
gateway builds both and they cross the seam as they are."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Lane = Literal["online", "batch"]
ONLINE: Lane = "online"
BATCH: Lane = "batch"
LANES: tuple[Lane, ...] = (ONLINE, BATCH)  # most urgent first: every sort key of the scheduler starts with it
LANE_RANK: dict[str, int] = {lane: rank for rank, lane in enumerate(LANES)}


@dataclass(frozen=True)
class KeyShare:
    """An API key as the scheduler sees it. `name`: what metrics show (its configured name, else its identity; never
    the key); `weight`: its share of the pages against other keys' (2 holds twice the pages of 1 before it yields
    its turn); `max_kv_blocks`: a quota on the pages its running sequences hold (None: none)."""

    name: str
    weight: float = 1.0
    max_kv_blocks: int | None = None

    def __post_init__(self) -> None:
        if not self.weight > 0:
            raise ValueError(f"key {self.name!r}: weight must be above 0, got {self.weight}")
        if self.max_kv_blocks is not None and self.max_kv_blocks < 1:
            raise ValueError(f"key {self.name!r}: max_kv_blocks must be at least 1, got {self.max_kv_blocks}")
