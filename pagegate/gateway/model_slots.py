"""Several models behind one server: each served model is a slot with its own engine core (or data-parallel cores),
loaded on demand, unloaded least recently used first under --models-max, put to sleep when idle, and marked failed
alone when its core dies. This module holds what a slot is and how the models and their page budgets are found;
EngineHost (engine_host.py) drives them.

NOTE: one page budget, moved at idle moments. --kv-cache-memory (on CPU its default) is the whole server's, and
the models holding pages never hold more than it together. A model that loads or wakes takes all the budget that
is free; when less than its floor is free, idle models are shrunk to their floors first (a busy one never is: the
load waits). The floor is half an equal share, `budget / (2 * capacity)` (capacity: --models-max, else the number of
models), so an idle model keeps enough pages to answer at once while the busy one gets most of the budget. A
sleeping or unloaded model holds nothing. A model that has been idle a while (REBALANCE_IDLE_S) and is asked again
takes what the other idle models hold beyond their floors, when that grows it by a quarter or more.
A core's pool is fixed while it runs (the page core has no resize), so shares move only between requests: a pool
is resized by freeing it and allocating the new one (its prefix cache lost, as in a sleep), never under a request.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace
from pathlib import Path

from pagegate.config import EngineConfig, parse_bytes
from pagegate.engine.serving.engine_client import EngineClient
from pagegate.gateway.prepare import ModelContext
from pagegate.gateway.settings import ServedModel

LOADED, LOADING, SLEEPING, UNLOADED, FAILED = "loaded", "loading", "sleeping", "unloaded", "failed"


class ModelSlot:
    """One served model: its names, its engine config, its state and, while loaded or sleeping, its engine."""

    def __init__(self, names: tuple[str, ...], engine_config: EngineConfig) -> None:
        self.names = names  # empty for a lone model named by its engine (the served name is learnt at load)
        self.engine_config = engine_config
        self.state = UNLOADED
        self.reason = "not loaded yet"
        self.engine: EngineClient | None = None
        self.model: ModelContext | None = None
        self.embedding_size: int | None = None  # the model's embedding size, from the warm-up (if it embeds)
        self.in_flight = 0  # API requests addressed to it being served: it is never unloaded while any are
        self.last_used = 0.0  # time.monotonic() of its last request: the least recently used is unloaded first
        self.loading: asyncio.Task[None] | None = None  # its load or wake, while one runs
        self.loads = 0  # how many times its core was started
        self.kv_bytes = 0  # its share of the server's page budget now (0 while it holds no pages)
        self.resizing = False  # its core is resizing its pool (EngineHost._resize)

    @property
    def name(self) -> str:
        if self.names:
            return self.names[0]
        return self.engine.model_name if self.engine is not None else "?"

    @property
    def holds_memory(self) -> bool:
        """Loaded or sleeping: its weights are in memory (it counts against --models-max)."""
        return self.engine is not None

    @property
    def idle(self) -> bool:
        return self.in_flight == 0 and self.loading is None

    def used(self) -> None:
        self.last_used = time.monotonic()

    def card_state(self) -> dict[str, str | None]:
        """Its /v1/models fields: the state, and why it failed (None unless it did)."""
        return {"state": self.state, "reason": self.reason if self.state == FAILED else None}


def discover_models(folder: str) -> list[ServedModel]:
    """--models-dir: every GGUF file and every folder with a config.json in it, named by its file or folder name
    (a GGUF's without its extension), in name order."""
    root = Path(folder)
    if not root.is_dir():
        raise SystemExit(f"--models-dir: {folder} is not a folder")
    found = [ServedModel(entry.stem, str(entry)) for entry in root.iterdir()
             if entry.is_file() and entry.suffix.lower() == ".gguf"]
    found += [ServedModel(entry.name, str(entry)) for entry in root.iterdir()
              if entry.is_dir() and (entry / "config.json").is_file()]
    if not found:
        raise SystemExit(f"--models-dir: {folder} holds no *.gguf file and no folder with a config.json")
    return sorted(found, key=lambda model: model.name)


REBALANCE_IDLE_S = 2.0  # a model idle this long, asked again, may take what idle others hold beyond their floors
GROW_MIN_FRACTION = 0.25  # ... when that grows its pool by this much at least (a resize loses its prefix cache)


class PageBudget:
    """The server's KV bytes and each model's floor; None-free arithmetic over the slots' `kv_bytes`."""

    def __init__(self, total: int, capacity: int) -> None:
        self.total = total
        self.floor = total // (2 * max(capacity, 1))

    def free(self, slots: list[ModelSlot]) -> int:
        return self.total - sum(slot.kv_bytes for slot in slots)

    def spare(self, slot: ModelSlot) -> int:
        """What a model holds beyond its floor."""
        return max(slot.kv_bytes - self.floor, 0)


def page_budget(engine_config: EngineConfig, capacity: int) -> PageBudget | None:
    """The server's page budget, shared by the models; None where each model's pages are given as a count
    (--num-kv-blocks: each model gets that many)."""
    cache = engine_config.cache
    if cache.num_kv_blocks is not None:
        return None
    return PageBudget(parse_bytes(cache.kv_cache_memory or cache.default_cpu_kv_cache_memory), capacity)


def with_kv_bytes(engine_config: EngineConfig, kv_bytes: int | None) -> EngineConfig:
    """The model's EngineConfig with its share of the budget as its --kv-cache-memory (None: as it is)."""
    if kv_bytes is None:
        return engine_config
    return replace(engine_config, cache=replace(engine_config.cache, kv_cache_memory=str(kv_bytes)))
