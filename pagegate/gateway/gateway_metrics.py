"""The gateway's own /metrics: live KV page counts read at scrape time, and request admission."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from pagegate.engine.observe.stats import EngineStats

if TYPE_CHECKING:
    from pagegate.gateway.engine_host import EngineHost



class GatewayCollector:
    """Reads the engine's stats() on every scrape, so the page counts are never a step stale."""

    def __init__(self, host: EngineHost) -> None:
        self.host = host

    def collect(self) -> Iterator[Metric]:
        stats = self.host.stats()
        if stats is not None:
            yield from _page_gauges(stats)
        yield GaugeMetricFamily("pagegate:http_generations_active", "Generations the gateway is driving.",
                                value=float(self.host.engine_requests.num_active))
        yield GaugeMetricFamily("pagegate:http_requests_pending", "Admitted requests without a first token yet.",
                                value=float(self.host.engine_requests.num_pending))
        yield GaugeMetricFamily("pagegate:server_draining", "1 while a stop signal drains in-flight requests "
                                "(--shutdown-timeout): new ones get 503.", value=float(self.host.draining))
        yield CounterMetricFamily("pagegate:http_requests_rejected", "Requests refused with 429 (--max-queue).",
                                  value=float(self.host.admission.num_rejected))
        if self.host.several:
            yield from self._models()

    def _models(self) -> Iterator[Metric]:
        """Several models: each one's state and its share of the server's page budget (its core's pool)."""
        state = GaugeMetricFamily("pagegate:model_state", "1 for each model's state (loaded, loading, sleeping, "
                                  "unloaded, failed).", labels=["model_name", "state"])
        total = GaugeMetricFamily("pagegate:model_kv_blocks_total", "KV pages in each loaded model's pool (its share "
                                  "of the budget; 0 while it sleeps or is unloaded).", labels=["model_name"])
        used = GaugeMetricFamily("pagegate:model_kv_blocks_used", "KV pages each model's requests hold now.",
                                 labels=["model_name"])
        share = GaugeMetricFamily("pagegate:model_kv_budget_bytes", "Each model's share of the server's KV budget "
                                  "(--kv-cache-memory; 0 while it holds no pages).", labels=["model_name"])
        stats = self.host.model_stats()
        for slot in self.host.slots:
            state.add_metric([slot.name, slot.state], 1.0)
            model = stats.get(slot.name)
            total.add_metric([slot.name], float(model.num_blocks if model is not None else 0))
            used.add_metric([slot.name], float(model.used_blocks if model is not None else 0))
            share.add_metric([slot.name], float(slot.kv_bytes))
        yield from (state, total, used, share)


def _page_gauges(stats: EngineStats) -> Iterator[Metric]:
    yield GaugeMetricFamily("pagegate:kv_blocks_used", "KV pages held by requests now (read at scrape time).",
                            value=stats.used_blocks)
    yield GaugeMetricFamily("pagegate:kv_blocks_free", "KV pages on the free list now, cached ones included.",
                            value=stats.free_blocks)
    yield GaugeMetricFamily("pagegate:kv_blocks_cached", "Free KV pages still holding a reusable prefix.",
                            value=stats.cached_blocks)
    yield GaugeMetricFamily("pagegate:kv_blocks_pinned", "KV pages held for stored conversations' next turns (pins; counted in used too).",
                            value=stats.pinned_blocks)
    yield GaugeMetricFamily("pagegate:kv_blocks_total", "KV pages in the device pool.", value=stats.num_blocks)


def gateway_registry(host: EngineHost) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(GatewayCollector(host))
    return registry
