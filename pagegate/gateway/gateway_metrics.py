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
