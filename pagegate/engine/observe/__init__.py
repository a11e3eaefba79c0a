"""What the engine reports: metrics, stats and health, KV-cache events. Its face to the engine is below."""

from pagegate.engine.observe.monitor import EngineMonitor
from pagegate.engine.observe.stats import EngineHealth, EngineStats, SchedulerStats

__all__ = ["EngineHealth", "EngineMonitor", "EngineStats", "SchedulerStats"]
