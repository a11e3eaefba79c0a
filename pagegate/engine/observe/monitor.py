"""What the engine reports about itself: its Prometheus metrics, token totals, health grade and the
KV-cache events routers read, all fed from the engine thread once per step."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import msgspec

from pagegate.config import EngineConfig, KVEventsConfig
from pagegate.core import BlockPool
from pagegate.engine.observe.kv_events import AdapterTags, EventPublisher, ImageTags, LoRATag, tier_events
from pagegate.engine.observe.metrics import EngineMetrics
from pagegate.engine.observe.stats import EngineHealth, EngineStats, SchedulerStats

if TYPE_CHECKING:
    from pagegate.engine.kv_tiers import TierStack
    from pagegate.engine.lora.model import LoRAModel
    from pagegate.engine.sequence import Request
    from pagegate.engine.sequence import Sequence as Seq

log = logging.getLogger(__name__)


class EngineMonitor:
    def __init__(self, model_name: str, config: EngineConfig, pool: BlockPool, tiers: TierStack | None = None,
                 lora: LoRAModel | None = None) -> None:
        self.metrics = EngineMetrics(model_name, config.health)
        self.metrics.cache_config(config.cache.block_size, pool.num_blocks)
        self.pool, self.tiers, self.lora = pool, tiers, lora
        self.kv_events = start_kv_events(config.kv_events, pool)
        # the LoRA adapter of each stored page, for the KV events (none to find without adapters)
        self.adapter_tags = AdapterTags(pool) if lora is not None else None
        self.image_tags = ImageTags()  # the tokens and images behind pages keyed by an image
        self.num_prompt_tokens = self.num_generation_tokens = 0
        self.grade, self.reason = "OK", "starting"

    def computed(self, prompt_tokens: int, generated_tokens: int) -> None:
        """One step's totals: prompt tokens it computed, tokens it sampled."""
        self.metrics.prompt_tokens.inc(prompt_tokens)
        self.metrics.generation_tokens.inc(generated_tokens)
        self.num_prompt_tokens += prompt_tokens
        self.num_generation_tokens += generated_tokens

    def token(self, request: Request, now: float) -> None:
        """A request got a token: time to first token, or the gap since its last one."""
        if request.first_token_time is None:
            request.first_token_time = now
            self.metrics.time_to_first_token.observe(now - request.arrival_time)
        elif request.last_token_time is not None:
            self.metrics.inter_token_latency.observe(now - request.last_token_time)
        request.last_token_time = now

    def finished(self, request: Request, now: float) -> None:
        self.metrics.e2e_request_latency.observe(now - request.arrival_time)
        if request.first_scheduled_time is not None:
            self.metrics.request_queue_time.observe(request.first_scheduled_time - request.arrival_time)

    def rebind(self, pool: BlockPool) -> None:
        """A fresh pool replaced the last (a wake, an elastic pool's start): its events are published too."""
        self.pool = pool
        if self.kv_events is not None:
            pool.record_events()
        if self.adapter_tags is not None:
            self.adapter_tags.pool = pool

    def refresh(self, stats: SchedulerStats, now: float | None = None, computed: Sequence[Seq] = (),
                key_pages: Mapping[str, int] | None = None, key_pins: Mapping[str, int] | None = None) -> None:
        """Recompute the gauges and the health grade; publish the pool's new KV events (`computed`: the sequences of
        the step that stored its pages; `key_pages`: the pages each API key's running sequences hold; `key_pins`:
        those each key's pins hold)."""
        self.grade, self.reason = self.metrics.update(stats, now)  # None: update reads the clock
        if key_pages is not None:
            self.metrics.update_keys(key_pages, key_pins)
        if self.tiers is not None:
            self.metrics.update_tiers(self.tiers.stats())
        if self.kv_events is None:
            return
        self.image_tags.learn(seq.request for seq in computed if seq.request.images)
        events = self.pool.take_events()
        if self.tiers is not None:
            events += tier_events(self.tiers.take_events())
        if events and self.adapter_tags is not None:
            events = self.adapter_tags.tag(events, lambda: self._adapter_roots(computed))
        if events:
            events = self.image_tags.tag(events)
        if events and not self.kv_events.publish(events):
            self.metrics.kv_events_dropped.inc()

    def _adapter_roots(self, seqs: Sequence[Seq]) -> dict[int, LoRATag]:
        """The chain roots of the sequences that run with an adapter, and its (lora_int_id, lora_name)."""
        roots = {}
        for seq in seqs:
            name = seq.request.lora_name
            if name is not None and self.lora is not None and name in self.lora.registered:
                roots[seq.request.root_hash] = (self.lora.registered[name].request.lora_int_id, name)
        return roots

    def stats(self, scheduler: SchedulerStats, num_requests: int) -> EngineStats:
        return EngineStats(**msgspec.structs.asdict(scheduler),
                           requests=num_requests, prompt_tokens=self.num_prompt_tokens,
                           generation_tokens=self.num_generation_tokens)

    def health(self, stats: SchedulerStats) -> EngineHealth:
        return EngineHealth(grade=self.grade, reason=self.reason, kv_cache_usage=stats.kv_cache_usage,
                            waiting=stats.waiting, running=stats.running, swapped=stats.swapped,
                            swaps_in_window=len(self.metrics.swap_times))

    def close(self) -> None:
        if self.kv_events is not None:
            self.kv_events.close()
            self.kv_events = None


def start_kv_events(config: KVEventsConfig | None, pool: BlockPool) -> EventPublisher | None:
    if config is None or not config.enable_kv_cache_events:
        return None
    pool.record_events()
    publisher = EventPublisher(config, pool.block_size)
    publisher.publish([("AllBlocksCleared",)])  # a router may hold pages from this server's last life
    log.info("KV-cache events: %s publisher on %s (topic %r, replay %s)", config.publisher, config.endpoint,
             config.topic, config.replay_endpoint)
    return publisher
