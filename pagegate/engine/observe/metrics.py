"""Prometheus metrics of one engine: vLLM's names where one exists, pagegate's own for the rest."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Mapping
from dataclasses import replace
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from pagegate.config import HealthThresholds
from pagegate.engine.kv_tiers.records import StackStats, TierStats
from pagegate.engine.observe.stats import SchedulerStats


class NamedFormat(Protocol):
    """A page format as the metrics label it (kv_format.LayerFormats, native_runner.PageFormat)."""

    @property
    def name(self) -> str: ...

HEALTH_GRADES = ("OK", "GOOD", "WARNING", "CRITICAL")
_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                    10.0, 20.0, 40.0, 80.0)


def health_grade(usage: float, waiting: int, swaps: int, t: HealthThresholds) -> tuple[str, str]:
    """The seed monitor's grade (section 3.3.5) and the reason for it."""
    if swaps > t.critical_swaps or waiting > t.critical_waiting:
        return "CRITICAL", f"{swaps} swaps in the last {t.window_s:.0f}s, {waiting} waiting: add capacity"
    if usage > t.warning_usage or waiting > t.warning_waiting:
        return "WARNING", f"KV usage {usage:.0%}, {waiting} waiting: memory is tight"
    if usage > t.good_usage:
        return "GOOD", f"KV usage {usage:.0%}: well used"
    return "OK", f"KV usage {usage:.0%}: plenty of room"


class EngineMetrics:
    """Owns a CollectorRegistry (one per engine, so tests can run several); each metric is an attribute."""

    def __init__(self, model_name: str, thresholds: HealthThresholds) -> None:
        self.registry = CollectorRegistry()
        self.thresholds = thresholds
        self.swap_times: deque[float] = deque()
        self._model_name = model_name

        gauge, counter, histogram = self._gauge, self._counter, self._histogram
        self.running = gauge("vllm:num_requests_running", "Sequences running (holding device pages).")
        self.waiting = gauge("vllm:num_requests_waiting", "Sequences waiting to be scheduled.")
        self.kv_cache_usage = gauge("vllm:kv_cache_usage_perc", "Fraction of device KV pages in use (0-1).")
        self.swapped = gauge("pagegate:num_requests_swapped", "Sequences swapped out to CPU memory.")
        self.cpu_kv_cache_usage = gauge("pagegate:cpu_kv_cache_usage_perc", "Fraction of CPU swap pages in use (0-1).")
        self.shared_blocks = gauge("pagegate:kv_shared_blocks_perc",
                                   "Fraction of device pages with refcount > 1 (0-1).")
        self.health = gauge("pagegate:health", "Health grade: 0 OK, 1 GOOD, 2 WARNING, 3 CRITICAL.")
        self.max_num_seqs = gauge("pagegate:max_num_seqs", "The running cap after auto-tuning.")
        self.lora_blocks = gauge("pagegate:lora_adapter_blocks", "KV pages held by loaded LoRA adapters' weights "
                                 "(unified paging; counted in the pages in use too).")

        self.preemptions = counter("vllm:num_preemptions", "Preempted sequences.")
        self.prefix_cache_queries = counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_cache_hits = counter("vllm:prefix_cache_hits", "Prompt tokens served from the prefix cache.")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Prompt tokens computed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Tokens generated.")
        self.swap_out_blocks = counter("pagegate:swap_out_blocks", "Pages swapped out to CPU memory.")
        self.swap_in_blocks = counter("pagegate:swap_in_blocks", "Pages swapped back in.")
        self.lora_loads = counter("pagegate:lora_adapter_loads", "LoRA adapters read into pages (evicted ones "
                                  "are read again on demand).")
        self.kv_events_dropped = counter("pagegate:kv_events_dropped",
                                         "KV-cache event batches dropped because the publisher queue was full.")
        self._cache_config_info = Gauge("vllm:cache_config_info", "The KV cache's configuration (value 1).",
                                        ["model_name", "block_size", "num_gpu_blocks"], registry=self.registry)

        self.time_to_first_token = histogram("vllm:time_to_first_token_seconds", "Time to first token.")
        self.inter_token_latency = histogram("vllm:inter_token_latency_seconds", "Time between tokens of a sequence.")
        self.e2e_request_latency = histogram("vllm:e2e_request_latency_seconds", "Arrival to finish.")
        self.request_queue_time = histogram("vllm:request_queue_time_seconds", "Arrival to first scheduled.")
        self.spec_drafts = counter("vllm:spec_decode_num_drafts", "Steps in which a sequence guessed tokens.")
        self.spec_draft_tokens = counter("vllm:spec_decode_num_draft_tokens", "Tokens guessed (speculation).")
        self.spec_accepted_tokens = counter("vllm:spec_decode_num_accepted_tokens",
                                            "Guessed tokens the model agreed with (kept).")
        self.spec_accepted_per_position = Counter(
            "vllm:spec_decode_num_accepted_tokens_per_pos", "Guessed tokens kept, by position in the guess.",
            ["model_name", "position"], registry=self.registry)
        self.tier_pages = Gauge("pagegate:kv_tier_pages", "Pages held by a KV tier under the pool (host, disk).",
                                ["model_name", "tier"], registry=self.registry)
        self.tier_capacity = Gauge("pagegate:kv_tier_capacity_bytes", "A KV tier's budget in bytes.",
                                   ["model_name", "tier"], registry=self.registry)
        self.tier_counters = {name: Counter(f"pagegate:kv_tier_{name}", documentation, ["model_name", "tier"],
                                            registry=self.registry) for name, documentation in _TIER_COUNTERS.items()}
        self._last_tiers: dict[str, TierStats] = {}
        self._keys_shown: set[str] = set()
        self.key_blocks = Gauge("pagegate:key_kv_blocks_used", "KV pages the running sequences of an API key hold, "
                                "labelled by its --api-key-config name (else its identity, never the key).",
                                ["model_name", "key"], registry=self.registry)
        self.key_pinned = Gauge("pagegate:key_kv_blocks_pinned", "KV pages the prefix pins of an API key hold (its "
                                "stored conversations, cache breakpoints and prompt_cache_keys), labelled as "
                                "pagegate:key_kv_blocks_used.", ["model_name", "key"], registry=self.registry)
        zeros: dict = dict.fromkeys(SchedulerStats.__struct_fields__, 0)
        self._last = SchedulerStats(**{**zeros, "spec_accepted_per_position": ()})  # the totals the counters saw

    def update_tiers(self, stats: StackStats) -> None:
        """The KV tiers' gauges and counters (labelled tier="host" / "disk")."""
        for tier, now in (("host", stats.host), ("disk", stats.disk)):
            if now is None:
                continue
            self.tier_pages.labels(self._model_name, tier).set(now.pages)
            self.tier_capacity.labels(self._model_name, tier).set(now.capacity_bytes)
            last = self._last_tiers.get(tier, TierStats())
            for name, field in _TIER_FIELDS.items():
                _advance(self.tier_counters[name].labels(self._model_name, tier),
                         getattr(now, field) - getattr(last, field))
            self._last_tiers[tier] = replace(now)

    def update_keys(self, pages: Mapping[str, int], pinned: Mapping[str, int] | None = None) -> None:
        """pagegate:key_kv_blocks_used and pagegate:key_kv_blocks_pinned: each key's pages; a key seen before that
        holds none now reads 0."""
        pinned = pinned or {}
        for key in self._keys_shown - pages.keys():
            self.key_blocks.labels(self._model_name, key).set(0)
        for key in self._keys_shown - pinned.keys():
            self.key_pinned.labels(self._model_name, key).set(0)
        for key, held in pages.items():
            self.key_blocks.labels(self._model_name, key).set(held)
        for key, held in pinned.items():
            self.key_pinned.labels(self._model_name, key).set(held)
        self._keys_shown |= pages.keys() | pinned.keys()

    def kv_page_format(self, kv_format: NamedFormat | None, bytes_per_token: int) -> None:
        """pagegate:kv_cache_bytes_per_token: K and V of one token in every layer, in the pages' format (none when
        the model keeps no pages)."""
        if kv_format is None:
            return
        Gauge("pagegate:kv_cache_bytes_per_token", "KV bytes one token takes in the pages' format (scales included).",
              ["model_name", "kv_cache_dtype"], registry=self.registry).labels(self._model_name,
                                                                             kv_format.name).set(bytes_per_token)

    def cache_config(self, block_size: int, num_blocks: int) -> None:
        """vllm:cache_config_info, which llm-d's scorers read for the page size and count (one series: a resized
        pool replaces it)."""
        self._cache_config_info.clear()
        self._cache_config_info.labels(self._model_name, str(block_size), str(num_blocks)).set(1)

    def _gauge(self, name: str, documentation: str) -> Gauge:
        return Gauge(name, documentation, ["model_name"], registry=self.registry).labels(self._model_name)

    def _counter(self, name: str, documentation: str) -> Counter:
        return Counter(name, documentation, ["model_name"], registry=self.registry).labels(self._model_name)

    def _histogram(self, name: str, documentation: str) -> Histogram:
        return Histogram(name, documentation, ["model_name"], buckets=_LATENCY_BUCKETS,
                         registry=self.registry).labels(self._model_name)

    def rebase(self, stats: SchedulerStats) -> None:
        """A fresh scheduler (a woken engine) counts its totals from zero: the counters go on from there."""
        self._last = stats

    def update(self, stats: SchedulerStats, now: float | None = None) -> tuple[str, str]:
        """Refresh the gauges and counters from engine stats; returns the health grade and reason."""
        now = time.monotonic() if now is None else now
        last, self._last = self._last, stats
        _advance(self.preemptions, stats.preemptions - last.preemptions)
        _advance(self.swap_out_blocks, stats.swap_out_blocks - last.swap_out_blocks)
        _advance(self.swap_in_blocks, stats.swap_in_blocks - last.swap_in_blocks)
        _advance(self.prefix_cache_queries, stats.prefix_cache_queries - last.prefix_cache_queries)
        _advance(self.prefix_cache_hits, stats.prefix_cache_hits - last.prefix_cache_hits)
        _advance(self.spec_drafts, stats.spec_drafts - last.spec_drafts)
        _advance(self.spec_draft_tokens, stats.spec_draft_tokens - last.spec_draft_tokens)
        _advance(self.spec_accepted_tokens, stats.spec_accepted_tokens - last.spec_accepted_tokens)
        for position, total in enumerate(stats.spec_accepted_per_position):
            before = last.spec_accepted_per_position[position] if position < len(last.spec_accepted_per_position) else 0
            _advance(self.spec_accepted_per_position.labels(self._model_name, str(position)), total - before)
        self.swap_times.extend([now] * (stats.swap_outs - last.swap_outs))
        while self.swap_times and now - self.swap_times[0] > self.thresholds.window_s:
            self.swap_times.popleft()
        self.running.set(stats.running)
        self.waiting.set(stats.waiting)
        self.swapped.set(stats.swapped)
        self.kv_cache_usage.set(stats.kv_cache_usage)
        self.cpu_kv_cache_usage.set(stats.cpu_used_blocks / max(stats.cpu_blocks, 1))
        self.shared_blocks.set(stats.shared_blocks / stats.num_blocks)
        self.max_num_seqs.set(stats.max_num_seqs)
        self.lora_blocks.set(stats.lora_blocks)
        _advance(self.lora_loads, stats.lora_loads - last.lora_loads)
        grade, reason = health_grade(stats.kv_cache_usage, stats.waiting, len(self.swap_times), self.thresholds)
        self.health.set(HEALTH_GRADES.index(grade))
        return grade, reason


_TIER_COUNTERS = {"hits": "Pages found in a KV tier and brought back into the pool (prefill not recomputed).",
                  "stores": "Pages written down into a KV tier.",
                  "evictions": "Pages a KV tier dropped to make room (least recently used first).",
                  "read_bytes": "Bytes brought back from a KV tier.",
                  "load_seconds": "Time spent bringing pages back from a KV tier."}
_TIER_FIELDS = {"hits": "hits", "stores": "stores", "evictions": "evictions", "read_bytes": "bytes_read",
                "load_seconds": "load_seconds"}


def _advance(counter: Counter, amount: float) -> None:
    if amount:
        counter.inc(amount)
