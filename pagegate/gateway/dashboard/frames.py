"""A viewer's frames: a pool snapshot as one Server-Sent Event.

The page states travel as run-length-encoded bytes (pagegate.core.page_map), base64 in the JSON: the first
frame of a stream whole, every later one XORed with the frame before it, so a frame where few pages changed
is a few bytes whatever the pool's size. The queues go out only when they changed, the history only its new
points. dashboard.js decodes the same format.
"""

from __future__ import annotations

import base64
import json
from typing import Any

import numpy as np
import numpy.typing as npt

from pagegate.core.page_map import max_encoded_size, rle_encode
from pagegate.engine.pool_snapshot import QUEUES, PoolSnapshot, QueuedRequest
from pagegate.gateway.dashboard.history import History

MAX_LISTED = 100  # requests listed per queue; the rest are counted


class FrameEncoder:
    """One per open feed: it remembers what that viewer was sent."""

    def __init__(self) -> None:
        self._previous: tuple[npt.NDArray[np.uint8], npt.NDArray[np.uint8]] | None = None
        self._queues: Any = None
        self._history_count = 0
        self._buffer = np.empty(0, dtype=np.uint8)

    def frame(self, snapshot: PoolSnapshot, history: History, model: str) -> dict[str, Any]:
        key = self._previous is None or self._previous[0].shape != snapshot.device_states.shape
        base = None if key else self._previous
        frame: dict[str, Any] = {
            "time": snapshot.taken_at, "model": model, "key": key,
            "pages": self._encode(snapshot.device_states, base[0] if base else None),
            "cpu_pages": self._encode(snapshot.cpu_states, base[1] if base else None),
            **figures(snapshot),
        }
        self._previous = (snapshot.device_states, snapshot.cpu_states)
        queues = {name: _listed(snapshot.queue(name)) for name in QUEUES}
        if queues != self._queues:
            frame["queues"] = self._queues = queues
        new_points = history.since(self._history_count)
        self._history_count = history.count
        if new_points or key:
            frame["history"] = [p.as_list() for p in (history.points if key else new_points)]
        return frame

    def event(self, snapshot: PoolSnapshot, history: History, model: str) -> bytes:
        """The frame as an SSE message."""
        data = json.dumps(self.frame(snapshot, history, model), separators=(",", ":"), allow_nan=False)
        return b"event: frame\ndata: " + data.encode() + b"\n\n"

    def _encode(self, states: npt.NDArray[np.uint8], previous: npt.NDArray[np.uint8] | None) -> str:
        need = max_encoded_size(len(states))
        if len(self._buffer) < need:
            self._buffer = np.empty(need, dtype=np.uint8)
        size = rle_encode(states, previous, self._buffer)
        return base64.b64encode(self._buffer[:size].tobytes()).decode("ascii")


def figures(snapshot: PoolSnapshot) -> dict[str, Any]:
    """What the page shows as numbers (its root element's data-* attributes among them)."""
    stats = snapshot.stats
    queries = stats.prefix_cache_queries
    return {
        "total_pages": stats.num_blocks, "used_pages": stats.used_blocks, "shared_pages": stats.shared_blocks,
        "cached_pages": stats.cached_blocks, "cpu_total_pages": stats.cpu_blocks,
        "cpu_used_pages": stats.cpu_used_blocks, "running": stats.running, "waiting": stats.waiting,
        "swapped": stats.swapped, "running_cap": stats.max_num_seqs, "usage": stats.kv_cache_usage,
        "prefix_hit_rate": stats.prefix_cache_hits / queries if queries else None,
        "preemptions": stats.preemptions, "swap_outs": stats.swap_outs,
        "health": snapshot.health, "health_reason": snapshot.health_reason,
    }


def _listed(requests: tuple[QueuedRequest, ...]) -> dict[str, Any]:
    return {"count": len(requests), "requests": [[r.request_id, r.seqs, r.pages] for r in requests[:MAX_LISTED]]}
