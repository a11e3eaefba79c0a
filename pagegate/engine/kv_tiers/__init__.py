"""Tiers below the page pool: host memory, then disk (warm restarts), admission gated on reuse.

Self-contained: the engine hands pages as bytes with their prefix-chain keys and gets bytes back.
NOTE: the torch-backed tiers import lazily (as `pagegate`'s own heavy names do), so the records and the gate
(metrics, KV events) stay importable in the gateway process, which never imports torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from pagegate.engine.kv_tiers.records import CPU, DISK, PageKey, StackStats, TierEvent, TierStats
from pagegate.engine.kv_tiers.reuse import ReuseGate

if TYPE_CHECKING:
    from pagegate.engine.kv_tiers.disk import DiskLoad, DiskTier
    from pagegate.engine.kv_tiers.host import HostTier
    from pagegate.engine.kv_tiers.stack import TierStack

_LAZY = {
    "DiskLoad": "pagegate.engine.kv_tiers.disk",
    "DiskTier": "pagegate.engine.kv_tiers.disk",
    "HostTier": "pagegate.engine.kv_tiers.host",
    "TierStack": "pagegate.engine.kv_tiers.stack",
}


def __getattr__(name: str) -> object:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["CPU", "DISK", "DiskLoad", "DiskTier", "HostTier", "PageKey", "ReuseGate", "StackStats", "TierEvent",
           "TierStack", "TierStats"]
