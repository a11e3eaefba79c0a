"""The dashboard's sparklines: one sample of the engine's counts per second over the last minutes, kept
whether or not anyone watches, so that a dashboard opens with its history already drawn."""

from __future__ import annotations

from collections import deque
from dataclasses import astuple, dataclass

from pagegate.engine.observe.stats import EngineStats

HISTORY_INTERVAL_S = 1.0
HISTORY_POINTS = 300  # five minutes


@dataclass(frozen=True, slots=True)
class HistoryPoint:
    time: float  # time.time()
    usage: float  # device pages in use, 0-1
    hit_rate: float | None  # prompt tokens served from the prefix cache since the last point; None: no prompts
    preemptions: int  # since the last point
    swaps: int  # swap-outs since the last point

    def as_list(self) -> list[float | int | None]:
        return list(astuple(self))


class History:
    def __init__(self, max_points: int = HISTORY_POINTS) -> None:
        self.points: deque[HistoryPoint] = deque(maxlen=max_points)
        self.count = 0  # points ever added: a viewer asks for those after the count it last saw
        self._last: EngineStats | None = None

    def sample(self, stats: EngineStats, now: float) -> None:
        last, self._last = self._last, stats
        if last is None:  # the first sample only sets the baseline of the per-interval figures
            return
        queries = stats.prefix_cache_queries - last.prefix_cache_queries
        hits = stats.prefix_cache_hits - last.prefix_cache_hits
        self.points.append(HistoryPoint(now, stats.kv_cache_usage, hits / queries if queries else None,
                                        stats.preemptions - last.preemptions, stats.swap_outs - last.swap_outs))
        self.count += 1

    def since(self, count: int) -> list[HistoryPoint]:
        """The points added after the first `count` (as many as are still kept)."""
        new = min(self.count - count, len(self.points))
        return list(self.points)[len(self.points) - new:] if new > 0 else []
