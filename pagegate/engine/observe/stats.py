"""Typed snapshots of the engine's state: what the metrics, /health and the gateway read. msgspec Structs,
positional on the wire: a core sends them with every outputs frame (serving.frames.CoreLoad)."""

from __future__ import annotations

import msgspec


class SchedulerStats(msgspec.Struct, frozen=True, array_like=True):
    running: int  # sequences
    waiting: int
    swapped: int
    num_blocks: int  # device pages
    free_blocks: int
    used_blocks: int
    cached_blocks: int  # free pages still holding a reusable prefix
    shared_blocks: int
    kv_cache_usage: float  # used / num_blocks
    cpu_blocks: int  # swap pages
    cpu_used_blocks: int
    preemptions: int  # totals since start
    swap_outs: int
    swap_out_blocks: int
    swap_in_blocks: int
    prefix_cache_queries: int  # prompt tokens
    prefix_cache_hits: int
    max_num_seqs: int  # the running cap after auto-tuning
    pinned_blocks: int  # pages held by prefix pins (stored conversations' next turns)
    spec_drafts: int  # speculation totals: steps a sequence guessed tokens in, tokens guessed, tokens kept
    spec_draft_tokens: int
    spec_accepted_tokens: int
    spec_accepted_per_position: tuple[int, ...]  # tokens kept at each guessed position
    host_tier_pages: int  # KV tiers under the pool (--kv-offload-memory, --kv-cache-dir): pages held, capacity
    host_tier_capacity: int
    disk_tier_pages: int
    disk_tier_capacity: int
    tier_hit_pages: int  # pages brought back from either tier since start
    lora_blocks: int  # device pages held by loaded LoRA adapters' weights (counted in used_blocks too)
    lora_loads: int  # adapters read into pages since start (an evicted one is read again on demand)


class EngineStats(SchedulerStats, frozen=True, array_like=True):
    requests: int  # unfinished
    prompt_tokens: int  # totals since start
    generation_tokens: int


class EngineHealth(msgspec.Struct, frozen=True, array_like=True):
    grade: str  # OK, GOOD, WARNING, CRITICAL (metrics.HEALTH_GRADES)
    reason: str
    kv_cache_usage: float
    waiting: int
    running: int
    swapped: int
    swaps_in_window: int
    engine_running: bool = True
