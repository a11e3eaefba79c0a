"""The feed's frames: a pool snapshot as one Server-Sent Event, encoded once for every viewer.

The page states travel as run-length-encoded bytes (pagegate.core.page_map), base64 in the JSON: a viewer's
first frame whole (a key frame), every later one XORed with the frame before it, so a frame where few pages
changed is a few bytes whatever the pool's size. The queues go out only when they changed, the history only its
new points. dashboard.js decodes the same format.

All viewers see the same pages; only the queues' request ids depend on who looks (an audience: viewers with
the same API key), so a snapshot's audience-free part is serialized once and each audience adds its queues.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Mapping, Set
from typing import Any

import numpy as np
import numpy.typing as npt

from pagegate.core.page_map import max_encoded_size, rle_encode
from pagegate.engine.pool_snapshot import QUEUES, PoolSnapshot, QueuedRequest
from pagegate.gateway.dashboard.history import History

MAX_LISTED = 100  # requests listed per queue; the rest are counted
EVERY_ID: None = None  # the audience of a server with one key or none: every request id is shown
Audience = str | None  # the key identity (auth.key_identity) whose requests a viewer may name, or EVERY_ID
Tenants = Mapping[str, str]  # engine request id -> the identity of the key that sent it
FrameKind = tuple[Audience, bool]  # (audience, key frame?)
_EVENT_START = b"event: frame\ndata: "


def shown_id(request_id: str, audience: Audience, tenants: Tenants) -> str | None:
    """A request's id as a viewer sees it: None (anonymous) unless the request came with the viewer's own key
    or the viewer's audience sees every id."""
    return request_id if audience is EVERY_ID or tenants.get(request_id) == audience else None


class FrameEncoder:
    """One for the whole feed. Each encode() follows the last: a delta frame applies to the frames before it,
    so a viewer given one must have been given every frame since its key frame."""

    def __init__(self) -> None:
        self._previous: tuple[npt.NDArray[np.uint8], npt.NDArray[np.uint8]] | None = None
        self._queues_sent: dict[Audience, Any] = {}
        self._history_count = 0
        self._buffer = np.empty(0, dtype=np.uint8)
        self.frames_encoded = 0  # SSE frames built, whatever the number of viewers they went to

    def encode(self, snapshot: PoolSnapshot, history: History, model: str, wanted: Set[FrameKind],
               tenants: Tenants, models: str | None = None) -> dict[FrameKind, bytes]:
        """The SSE frame of this snapshot for each wanted (audience, key frame?) pair; `models`: with several,
        each one's state and share of the page budget (the pool shown is the first model's)."""
        whole = not self._delta_applies(snapshot)
        shared = {key: self._shared_part(snapshot, history, model, key, models)
                  for key in {k or whole for _, k in wanted}}
        queued = {name: snapshot.queue(name) for name in QUEUES}
        sent, self._queues_sent = self._queues_sent, {}
        frames: dict[FrameKind, bytes] = {}
        for audience in {a for a, _ in wanted}:
            queues = {name: _listed(queued[name], audience, tenants) for name in QUEUES}
            self._queues_sent[audience] = queues
            for key in (k for a, k in wanted if a == audience):
                as_key = key or whole
                frames[audience, key] = _event(shared[as_key], queues if as_key or queues != sent.get(audience) else None)
                self.frames_encoded += 1
        self._previous = (snapshot.device_states, snapshot.cpu_states)
        self._history_count = history.count
        return frames

    def _delta_applies(self, snapshot: PoolSnapshot) -> bool:
        previous = self._previous
        return previous is not None and previous[0].shape == snapshot.device_states.shape \
            and previous[1].shape == snapshot.cpu_states.shape

    def _shared_part(self, snapshot: PoolSnapshot, history: History, model: str, key: bool,
                     models: str | None = None) -> bytes:
        """The frame's JSON object without its closing brace, the same for every audience."""
        base = None if key else self._previous
        members: dict[str, Any] = {
            "time": snapshot.taken_at, "model": model, "key": key,
            "pages": self._encode(snapshot.device_states, base[0] if base else None),
            "cpu_pages": self._encode(snapshot.cpu_states, base[1] if base else None),
            **figures(snapshot),
        }
        if models is not None:
            members["models"] = models
        new_points = history.since(self._history_count)
        if new_points or key:
            members["history"] = [p.as_list() for p in (history.points if key else new_points)]
        return _dumps(members)[:-1]

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
        "spec_acceptance_rate": (stats.spec_accepted_tokens / stats.spec_draft_tokens
                                 if stats.spec_draft_tokens else None),  # speculation: guesses kept
        "preemptions": stats.preemptions, "swap_outs": stats.swap_outs,
        "host_tier_pages": stats.host_tier_pages, "host_tier_capacity": stats.host_tier_capacity,
        "disk_tier_pages": stats.disk_tier_pages, "disk_tier_capacity": stats.disk_tier_capacity,
        "tier_hit_pages": stats.tier_hit_pages,
        "health": snapshot.health, "health_reason": snapshot.health_reason,
    }


def _event(shared: bytes, queues: dict[str, Any] | None) -> bytes:
    tail = b',"queues":' + _dumps(queues) + b"}" if queues is not None else b"}"
    return _EVENT_START + shared + tail + b"\n\n"


def _dumps(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":"), allow_nan=False).encode()


def _listed(requests: tuple[QueuedRequest, ...], audience: Audience, tenants: Tenants) -> dict[str, Any]:
    listed = [[shown_id(r.request_id, audience, tenants), r.seqs, r.pages] for r in requests[:MAX_LISTED]]
    return {"count": len(requests), "requests": listed}
