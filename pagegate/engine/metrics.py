"""Prometheus metrics of one engine: vLLM's names where one exists, pagegate's own for the rest."""

from __future__ import annotations

import time
from collections import deque

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from pagegate.config import HealthThresholds

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
    """Owns a CollectorRegistry (one per engine, so tests can run several)."""

    def __init__(self, model_name: str, thresholds: HealthThresholds) -> None:
        self.registry = CollectorRegistry()
        self.thresholds = thresholds
        self.swap_times: deque[float] = deque()
        self._gauges, self._counters, self._histograms = {}, {}, {}
        labels = ["model_name"]
        for name, doc in [
            ("vllm:num_requests_running", "Sequences running (holding device pages)."),
            ("vllm:num_requests_waiting", "Sequences waiting to be scheduled."),
            ("vllm:kv_cache_usage_perc", "Fraction of device KV pages in use (0-1)."),
            ("pagegate:num_requests_swapped", "Sequences swapped out to CPU memory."),
            ("pagegate:cpu_kv_cache_usage_perc", "Fraction of CPU swap pages in use (0-1)."),
            ("pagegate:kv_shared_blocks_perc", "Fraction of device pages with refcount > 1 (0-1)."),
            ("pagegate:health", "Health grade: 0 OK, 1 GOOD, 2 WARNING, 3 CRITICAL."),
            ("pagegate:max_num_seqs", "The running cap after auto-tuning."),
        ]:
            self._gauges[name] = Gauge(name, doc, labels, registry=self.registry).labels(model_name)
        for name, doc in [
            ("vllm:num_preemptions", "Preempted sequences."),
            ("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache."),
            ("vllm:prefix_cache_hits", "Prompt tokens served from the prefix cache."),
            ("vllm:prompt_tokens", "Prompt tokens computed."),
            ("vllm:generation_tokens", "Tokens generated."),
            ("pagegate:swap_out_blocks", "Pages swapped out to CPU memory."),
            ("pagegate:swap_in_blocks", "Pages swapped back in."),
        ]:
            self._counters[name] = Counter(name, doc, labels, registry=self.registry).labels(model_name)
        for name, doc in [
            ("vllm:time_to_first_token_seconds", "Time to first token."),
            ("vllm:inter_token_latency_seconds", "Time between tokens of a sequence."),
            ("vllm:e2e_request_latency_seconds", "Arrival to finish."),
            ("vllm:request_queue_time_seconds", "Arrival to first scheduled."),
        ]:
            self._histograms[name] = Histogram(name, doc, labels, buckets=_LATENCY_BUCKETS,
                                               registry=self.registry).labels(model_name)
        self._last_totals: dict[str, int] = {}

    def observe(self, name: str, seconds: float) -> None:
        self._histograms[name].observe(seconds)

    def count(self, name: str, amount: int = 1) -> None:
        if amount:
            self._counters[name].inc(amount)

    def update(self, stats: dict, now: float | None = None) -> tuple[str, str]:
        """Refresh the gauges and counters from engine stats; returns the health grade and reason."""
        now = time.monotonic() if now is None else now
        for key, name in (("preemptions", "vllm:num_preemptions"), ("swap_out_blocks", "pagegate:swap_out_blocks"),
                          ("swap_in_blocks", "pagegate:swap_in_blocks"),
                          ("prefix_cache_queries", "vllm:prefix_cache_queries"),
                          ("prefix_cache_hits", "vllm:prefix_cache_hits")):
            self.count(name, stats[key] - self._last_totals.get(key, 0))
            self._last_totals[key] = stats[key]
        new_swaps = stats["swap_outs"] - self._last_totals.get("swap_outs", 0)
        self._last_totals["swap_outs"] = stats["swap_outs"]
        self.swap_times.extend([now] * new_swaps)
        while self.swap_times and now - self.swap_times[0] > self.thresholds.window_s:
            self.swap_times.popleft()
        g = self._gauges
        g["vllm:num_requests_running"].set(stats["running"])
        g["vllm:num_requests_waiting"].set(stats["waiting"])
        g["pagegate:num_requests_swapped"].set(stats["swapped"])
        g["vllm:kv_cache_usage_perc"].set(stats["kv_cache_usage"])
        g["pagegate:cpu_kv_cache_usage_perc"].set(stats["cpu_used_blocks"] / max(stats["cpu_blocks"], 1))
        g["pagegate:kv_shared_blocks_perc"].set(stats["shared_blocks"] / stats["num_blocks"])
        g["pagegate:max_num_seqs"].set(stats["max_num_seqs"])
        grade, reason = health_grade(stats["kv_cache_usage"], stats["waiting"], len(self.swap_times),
                                     self.thresholds)
        g["pagegate:health"].set(HEALTH_GRADES.index(grade))
        return grade, reason
